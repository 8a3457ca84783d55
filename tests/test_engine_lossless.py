"""Lossless is the law: speculative output == plain output == transformers `generate`.

Tiny random Llama targets built here keep this fast on a CPU. Untrained heads rarely
guess right, so a second family of tests swaps in an *oracle* drafter that knows the
target's greedy continuation (and corrupts it at random depths): that drives long
accepted paths, EOS and max_new_tokens inside an accepted path, and paths that are not a
prefix of the tree's layout, through the same verification and cache code.
"""
from __future__ import annotations

import random

import pytest
import torch

from gumiho_core import Engine, GenerationSettings, TreeSettings, new_heads, run_to_end
from gumiho_core import drafter as drafter_module
from gumiho_core import verify as verify_module
from oracle import OracleDrafter
from tiny import EOS, hf_greedy, random_prompts, tiny_target

TREES = [
    TreeSettings(),
    TreeSettings(top_k=2, total_tokens=6, depth=3, mlp_topk=2, pruning=3, fta=False, fta_tokens=0),
    TreeSettings(top_k=5, total_tokens=24, depth=7, mlp_topk=5, pruning=10, fta=True, fta_tokens=4),
    TreeSettings(top_k=1, total_tokens=4, depth=2, mlp_topk=1, pruning=1, fta=True, fta_tokens=1),
    TreeSettings(top_k=3, total_tokens=12, depth=1, fta=False, fta_tokens=0),
]


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=0, eos=False)


@pytest.fixture(scope="module")
def engine(target):
    return Engine(target, new_heads(target))


@pytest.mark.parametrize("tree", TREES, ids=lambda t: f"k{t.top_k}-n{t.total_tokens}-d{t.depth}-fta{int(t.fta)}")
def test_greedy_speculative_equals_plain_and_hf_generate(engine, target, tree):
    for prompt in random_prompts(6, seed=tree.total_tokens):
        settings = GenerationSettings(max_new_tokens=24, tree=tree)
        spec = run_to_end(engine, prompt, settings)
        plain = run_to_end(engine, prompt, settings.with_(speculative=False))
        assert spec.token_ids == plain.token_ids == hf_greedy(target, prompt, 24)
        assert plain.stats.forward_passes == 24 and plain.stats.tau == 1.0
        assert spec.finish_reason == plain.finish_reason == "length"


def test_eos_stops_like_hf_generate():
    target = tiny_target(seed=3, eos=True, vocab=24)  # small vocabulary: EOS comes soon
    engine = Engine(target, new_heads(target))
    saw_eos = 0
    for prompt in random_prompts(12, seed=5, vocab=24):
        spec = run_to_end(engine, prompt, GenerationSettings(max_new_tokens=40))
        plain = run_to_end(engine, prompt, GenerationSettings(max_new_tokens=40, speculative=False))
        assert spec.token_ids == plain.token_ids == hf_greedy(target, prompt, 40)
        if spec.finish_reason == "eos":
            saw_eos += 1
            assert spec.token_ids[-1] == EOS and EOS not in spec.token_ids[:-1]
    assert saw_eos > 0, "the test should exercise EOS"


# -- an oracle drafter: the target's own continuation, corrupted at random depths -------------


@pytest.fixture
def oracle():
    """A drafter for run_to_end(..., drafter=oracle): the target's continuation, corrupted."""
    return OracleDrafter()


def test_oracle_long_paths_are_lossless_and_cache_matches_plain(target, engine, oracle):
    for i, prompt in enumerate(random_prompts(8, seed=11)):
        reference = hf_greedy(target, prompt, 60)
        oracle.update(truth=reference + [5] * 10, rng=random.Random(i), size=4 + 3 * i, depth=1 + i % 6)
        spec = run_to_end(engine, prompt, GenerationSettings(max_new_tokens=60), drafter=oracle)
        spec_cache = engine.prefix.cache
        assert spec.token_ids == reference
        assert spec.stats.tau > 1.5, "the oracle should produce long accepted paths"
        # No prefix reuse: the plain run fills a cache of its own rather than cropping this one.
        run_to_end(engine, prompt, GenerationSettings(max_new_tokens=60, speculative=False), reuse_prefix=False)
        plain_cache = engine.prefix.cache
        n = plain_cache.get_seq_length()
        assert spec_cache.get_seq_length() >= n
        for a, b in zip(spec_cache.inner.layers, plain_cache.inner.layers):  # transformers' DynamicCache
            torch.testing.assert_close(a.keys[:, :, :n], b.keys, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(a.values[:, :, :n], b.values, atol=1e-5, rtol=1e-4)


def test_the_loop_runs_any_drafter_even_without_heads(target, oracle):
    """The loop knows drafters only through their interface: no heads needed for one."""
    engine = Engine(target, None)
    prompt = random_prompts(1, seed=13)[0]
    reference = hf_greedy(target, prompt, 30)
    oracle.update(truth=reference + [5] * 6, rng=random.Random(3), size=8, depth=4)
    spec = run_to_end(engine, prompt, GenerationSettings(max_new_tokens=30), drafter=oracle)
    assert spec.token_ids == reference and spec.stats.tau > 1.5


def test_max_new_tokens_inside_an_accepted_path(target, engine, oracle):
    prompt = random_prompts(1, seed=21)[0]
    reference = hf_greedy(target, prompt, 40)
    for limit in (1, 2, 3, 7, 11, 13):
        oracle.update(truth=reference, rng=random.Random(limit), size=10, depth=6)
        spec = run_to_end(engine, prompt, GenerationSettings(max_new_tokens=limit), drafter=oracle)
        assert spec.token_ids == reference[:limit]
        assert spec.finish_reason == "length"


def test_eos_inside_an_accepted_path(oracle):
    target = tiny_target(seed=3, eos=True, vocab=24)
    engine = Engine(target, new_heads(target))
    hits = 0
    for i, prompt in enumerate(random_prompts(12, seed=5, vocab=24)):
        reference = hf_greedy(target, prompt, 40)
        # The oracle keeps drafting past EOS, so EOS sits inside accepted paths.
        oracle.update(truth=reference + [7, 8, 9, 10, 11, 12], rng=random.Random(i), size=10, depth=6, vocab=24)
        spec = run_to_end(engine, prompt, GenerationSettings(max_new_tokens=40), drafter=oracle)
        assert spec.token_ids == reference
        if reference[-1] == EOS:
            hits += 1
            assert spec.finish_reason == "eos"
    assert hits > 0


def test_stop_string_cuts_text(target, engine):
    prompt = random_prompts(1, seed=2)[0]
    full = run_to_end(engine, prompt, GenerationSettings(max_new_tokens=12, speculative=False))
    word = full.text.split()[5]
    stopped = run_to_end(engine, prompt, GenerationSettings(max_new_tokens=12, stop_strings=(word,)))
    assert stopped.finish_reason == "stop"
    assert word not in stopped.text and full.text.startswith(stopped.text)


def test_cancel_stops_between_steps(target, engine):
    import threading

    cancel = threading.Event()
    events = []
    for event in engine.generate(random_prompts(1)[0], GenerationSettings(max_new_tokens=50), cancel=cancel):
        events.append(event)
        if len(events) == 3:
            cancel.set()
    assert events[-1].kind == "done" and events[-1].finish_reason == "cancelled"
    assert 1 <= len(events[-1].token_ids) < 50
    # The engine is clean for the next call.
    again = run_to_end(engine, random_prompts(1)[0], GenerationSettings(max_new_tokens=10))
    assert again.token_ids == hf_greedy(target, random_prompts(1)[0], 10)


def test_float64_targets_and_gqa_free_heads():
    """A different dtype and attention layout stay lossless too."""
    target = tiny_target(seed=7, eos=False, dtype=torch.float64)
    engine = Engine(target, new_heads(target))
    for prompt in random_prompts(3, seed=9):
        spec = run_to_end(engine, prompt, GenerationSettings(max_new_tokens=16))
        assert spec.token_ids == hf_greedy(target, prompt, 16)


def test_reduced_draft_vocabulary_stays_lossless(target, tmp_path):
    from gumiho_core import HeadCheckpoint
    from gumiho_core.heads import with_draft_vocab

    heads = with_draft_vocab(new_heads(target), range(3, 40))
    HeadCheckpoint.save(heads, tmp_path / "h")
    loaded = HeadCheckpoint.load(tmp_path / "h", target)
    assert loaded.draft_vocab.tolist() == list(range(3, 40))
    engine = Engine(target, loaded)
    drafted = set()
    original = drafter_module.build_draft_tree

    def spy(*args, **kwargs):
        tree = original(*args, **kwargs)
        drafted.update(tree.tokens[1:].tolist())
        return tree

    drafter_module.build_draft_tree = spy
    try:
        for prompt in random_prompts(4, seed=3):
            spec = run_to_end(engine, prompt, GenerationSettings(max_new_tokens=20))
            assert spec.token_ids == hf_greedy(target, prompt, 20)
    finally:
        drafter_module.build_draft_tree = original
    assert drafted and drafted <= set(range(3, 40))


def test_context_limit_error_or_truncation():
    from gumiho_core import ContextTooLong

    target = tiny_target(seed=0, eos=False, max_positions=40)
    engine = Engine(target, new_heads(target))
    prompt = random_prompts(1, seed=4, lo=30, hi=31)[0]  # 31 tokens
    with pytest.raises(ContextTooLong, match="exceeds the model's context of 40 tokens"):
        run_to_end(engine, prompt, GenerationSettings(max_new_tokens=20))
    for speculative in (True, False):  # plain steps fill the window to its last position too
        done = run_to_end(engine, prompt, GenerationSettings(max_new_tokens=20, on_overflow="truncate",
                                                             speculative=speculative))
        assert done.stats.prompt_tokens == 20 and len(done.token_ids) == 20
        assert done.token_ids == hf_greedy(target, prompt[-20:], 20)


def test_prefix_cache_across_turns_is_lossless(target):
    """A follow-up reuses the chat's KV caches; edits and regenerates share less of them."""
    engine = Engine(target, new_heads(target))
    fresh = Engine(target, engine.heads)  # always run without prefix reuse (below)
    turn1 = random_prompts(1, seed=30)[0]
    a1 = run_to_end(engine, turn1, GenerationSettings(max_new_tokens=15))
    turn2 = turn1 + a1.token_ids + [7, 8, 9]
    for speculative in (True, False, True):
        settings = GenerationSettings(max_new_tokens=15, speculative=speculative)
        a2 = run_to_end(engine, turn2, settings)
        assert a2.stats.reused_prompt_tokens >= len(turn1)
        again = run_to_end(fresh, turn2, settings, reuse_prefix=False)
        assert a2.token_ids == again.token_ids == hf_greedy(target, turn2, 15)
    edited = turn1[:3] + [11, 12] + turn1[3:]  # an edit early in the chat
    a3 = run_to_end(engine, edited, GenerationSettings(max_new_tokens=15))
    assert a3.stats.reused_prompt_tokens == 3
    assert a3.token_ids == hf_greedy(target, edited, 15)
    again = run_to_end(engine, edited, GenerationSettings(max_new_tokens=15))  # regenerate
    assert again.token_ids == a3.token_ids and again.stats.reused_prompt_tokens == len(edited) - 1


def test_failure_inside_a_step_leaves_the_engine_clean(target, monkeypatch):
    engine = Engine(target, new_heads(target))
    prompt = random_prompts(1, seed=40)[0]
    expected = hf_greedy(target, prompt, 20)
    real = verify_module.run_target  # every target pass goes through it
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:  # inside the third speculative step: the cache already holds tree entries
            real(*args, **kwargs)
            raise RuntimeError("injected fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(verify_module, "run_target", flaky)
    got = []
    with pytest.raises(RuntimeError, match="injected fault"):
        for event in engine.generate(prompt, GenerationSettings(max_new_tokens=20)):
            got.extend(t.id for t in getattr(event, "tokens", []))
    assert got == expected[: len(got)] and engine.prefix is None  # nothing half-done is reused
    monkeypatch.setattr(verify_module, "run_target", real)
    assert run_to_end(engine, prompt, GenerationSettings(max_new_tokens=20)).token_ids == expected


def test_growing_rows_hold_what_concatenation_would():
    """The features of the cached tokens grow a step at a time, past the buffer's first size,
    and a reused prefix is cropped: the rows are always what torch.cat of the steps gives."""
    from gumiho_core.generate import GrowingRows

    rows, reference = GrowingRows(3, torch.device("cpu")), torch.zeros(0, 3)
    for step in range(120):
        new = torch.randn(1 + step % 5, 3)
        rows.append(new)
        reference = torch.cat([reference, new])
        assert torch.equal(rows.rows, reference)
    rows.crop(100)
    rows.append(torch.ones(2, 3))
    assert torch.equal(rows.rows, torch.cat([reference[:100], torch.ones(2, 3)]))


def test_a_generation_resumed_from_other_threads_runs_each_step_in_inference_mode(target):
    """A web server resumes a streaming generator from whichever worker thread is free (Gradio
    does), and torch's inference mode is per thread: entered once around the generator, it is
    off for every step resumed elsewhere, and an in-place write to a tensor made under it then
    fails (this hung the second of two chat tabs once). Every step must run under it, and two
    answers sharing a prefix, each advanced a step per thread, give plain decoding's tokens."""
    import threading

    engine = Engine(target, new_heads(target))
    seen, real_draft = [], engine.drafter.draft

    def draft_and_note(step):
        seen.append(torch.is_inference_mode_enabled())
        return real_draft(step)

    engine.drafter.draft = draft_and_note
    turn1 = random_prompts(1, seed=50)[0]

    def in_threads(prompt):
        events, tokens = engine.generate(prompt, GenerationSettings(max_new_tokens=12)), []
        while True:
            box = []
            worker = threading.Thread(target=lambda: box.append(next(events, None)))
            worker.start()
            worker.join()
            if box[0] is None:
                return tokens
            tokens.extend(t.id for t in getattr(box[0], "tokens", []))

    a1 = in_threads(turn1)
    turn2 = turn1 + a1 + [5, 6]
    assert a1 == hf_greedy(target, turn1, 12)
    assert in_threads(turn2) == hf_greedy(target, turn2, 12) and engine.prefix is not None
    assert seen and all(seen)
