"""ChatService with a tiny random model: streaming, multi-turn prompts, stop, failures, compare."""
import threading

import pytest

import tiny
from app.chat import ChatService, Options, last
from app.store import Store
from gumiho_core import Engine, new_heads


@pytest.fixture(scope="module")
def engine():
    target = tiny.tiny_target(eos=False)
    return Engine(target, new_heads(target))


@pytest.fixture
def service(engine, tmp_path):
    return ChatService(engine, Store(tmp_path / "chat.db"), model_name="tiny", heads_note="untrained")


def test_stream_grows_and_ends_with_stats(service):
    # The same Answer object grows; record what it looked like at each yield.
    seen = [(a.done, len(a.steps)) for a in service.stream([{"role": "user", "text": "w5 w6 w7"}],
                                                             Options(max_new_tokens=12))]
    assert [done for done, _ in seen] == [False] * (len(seen) - 1) + [True]
    assert [n for _, n in seen[:-1]] == list(range(1, len(seen)))  # one more step per yield
    final = last(service.stream([{"role": "user", "text": "w5 w6 w7"}], Options(max_new_tokens=12)))
    assert final.finish_reason == "length" and final.stats["new_tokens"] == 12 and final.error is None
    assert sum(len(s["tokens"]) for s in final.steps) == 12
    origins = {t[1] for s in final.steps for t in s["tokens"]}
    assert origins <= {"serial", "mlp", "fta", "lookup", "target"} and "target" in origins


def test_multi_turn_prompt_contains_earlier_turns(service):
    history = [{"role": "user", "text": "w10"}, {"role": "assistant", "text": "w11"}, {"role": "user", "text": "w12"}]
    one = service.prompt_ids("", history[-1:])
    three = service.prompt_ids("", history)
    assert len(three) > len(one)
    assert service.engine.target.encode("w10")[0] in three


def test_stop_keeps_the_partial_answer(service):
    cancel = threading.Event()
    answers = []
    for answer in service.stream([{"role": "user", "text": "w3"}], Options(max_new_tokens=200), cancel=cancel):
        answers.append(answer)
        if len(answer.steps) == 3:
            cancel.set()
    final = answers[-1]
    assert final.finish_reason == "cancelled" and 0 < final.stats["new_tokens"] < 200
    sid = service.store.create_session("stop")
    mid = service.save_answer(sid, final, speculative=True)
    [row] = service.store.messages(sid)
    assert row["id"] == mid and row["finish_reason"] == "cancelled" and row["text"] == final.text


def test_failure_mid_answer_is_reported_not_raised(service, monkeypatch):
    real = service.engine.generate

    def broken(*args, **kwargs):
        for i, event in enumerate(real(*args, **kwargs)):
            if i == 2:
                raise RuntimeError("out of memory")
            yield event

    monkeypatch.setattr(service.engine, "generate", broken)
    final = last(service.stream([{"role": "user", "text": "w3"}], Options(max_new_tokens=50)))
    assert final.finish_reason == "error" and "out of memory" in final.error and final.steps


def test_speculative_without_heads_is_a_clear_error(engine):
    plain_only = ChatService(Engine(engine.target, None), None)
    final = last(plain_only.stream([{"role": "user", "text": "w3"}], Options(speculative=True)))
    assert final.error and "heads" in final.error
    ok = last(plain_only.stream([{"role": "user", "text": "w3"}], Options(speculative=False, max_new_tokens=4)))
    assert ok.error is None and ok.stats["tau"] == 1.0


def test_compare_is_identical_under_greedy(service):
    plain, gumiho = service.compare([{"role": "user", "text": "w8 w9"}], Options(max_new_tokens=20, temperature=1.0))
    assert plain.text == gumiho.text
    assert plain.stats["speculative"] is False and gumiho.stats["speculative"] is True
    assert plain.stats["forward_passes"] >= gumiho.stats["forward_passes"]


def test_answers_use_the_services_tree(service):
    from gumiho_core import TreeSettings

    default = last(service.stream([{"role": "user", "text": "w5 w6"}], Options(max_new_tokens=8)))
    assert default.stats["tree"]["total_tokens"] == TreeSettings().total_tokens
    service.tree = TreeSettings(top_k=2, total_tokens=3, depth=2, fta=False, fta_tokens=0)  # as --auto-tree sets it
    small = last(service.stream([{"role": "user", "text": "w5 w6"}], Options(max_new_tokens=8)))
    assert small.stats["tree"]["total_tokens"] == 3 and small.stats["tree"]["top_k"] == 2
    assert max(len(s["tokens"]) for s in small.steps) <= 3  # at most 2 drafts + the target's token


def test_load_model_swaps_only_on_success(service, monkeypatch):
    from gumiho_core import GumihoError, TreeSettings, loading

    before = service.engine
    service.tree = TreeSettings(top_k=2, total_tokens=3, depth=2)
    with pytest.raises(GumihoError, match="model path not found"):
        service.load_model("/no/such/model", "")
    assert (service.engine, service.model_name, service.heads_note) == (before, "tiny", "untrained")
    assert service.tree.total_tokens == 3  # a failed load changes nothing

    def broken(*args, **kwargs):
        raise ValueError("not\na model")

    monkeypatch.setattr(loading, "load_engine", broken)
    with pytest.raises(GumihoError, match="could not load /x: ValueError: not a model"):
        service.load_model("/x", None)
    assert service.engine is before

    target = tiny.tiny_target(eos=False)
    fresh = Engine(target, None)
    monkeypatch.setattr(loading, "load_engine", lambda model, heads: (fresh, "none here"))
    service.load_model(" /models/other ", "")
    assert (service.engine, service.model_name, service.heads_note, service.tree) == (
        fresh, "/models/other", "none here", None)
    assert not service.has_heads and len(service.queue) == 0


def test_ui_binds_handlers_as_gradio_reads_them(service):
    """Gradio finds gr.Request and the /chat API's types by type hints; the bound handlers keep them."""
    from gradio import helpers, utils

    from app import ui

    demo = ui.build_ui(service)
    fns = {f.name: f for f in demo.fns.values()}
    assert fns["send"].types_generator and not fns["edit_last"].types_generator
    assert helpers.special_args(fns["send"].fn, list(range(9)), request="REQ")[0][-1] == "REQ"
    assert helpers.special_args(fns["stop"].fn, [], request="REQ")[0] == ["REQ"]
    params = utils.get_function_params(fns["chat_api"].fn)
    assert [(name, hint) for name, _, _, hint in params] == [
        ("message", str), ("system", str), ("speculative", bool), ("max_new_tokens", int), ("temperature", float),
        ("top_p", float)]
