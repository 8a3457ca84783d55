"""The HTTP side: OpenAI-compatible route (plain and SSE) and the Gradio `/chat` endpoint."""
import json
import socket
import threading
import time

import pytest
from fastapi.testclient import TestClient

import tiny
from app.server import create_app, is_loopback
from gumiho_core import Engine, new_heads


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    target = tiny.tiny_target(eos=False)
    return create_app(Engine(target, new_heads(target)), tmp_path_factory.mktemp("db") / "chat.db", model_name="tiny")


@pytest.fixture(scope="module")
def client(app):
    return TestClient(app)


BODY = {"messages": [{"role": "system", "content": "w4"}, {"role": "user", "content": "w5 w6"}], "max_tokens": 10}


def test_completion_with_usage_and_tau(client):
    r = client.post("/v1/chat/completions", json=BODY)
    assert r.status_code == 200
    data = r.json()
    assert data["object"] == "chat.completion" and data["choices"][0]["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == 10 and data["usage"]["tau"] >= 1.0
    assert data["usage"]["speculative"] is True
    plain = client.post("/v1/chat/completions", json={**BODY, "speculative": False}).json()
    assert plain["usage"]["tau"] == 1.0 and plain["usage"]["speculative"] is False
    assert plain["choices"][0]["message"]["content"] == data["choices"][0]["message"]["content"]  # greedy: lossless


def test_streaming_sse(client):
    with client.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and "tau" in chunks[-1]["usage"]
    whole = client.post("/v1/chat/completions", json=BODY).json()
    assert text == whole["choices"][0]["message"]["content"]


def test_bad_requests(client):
    assert client.post("/v1/chat/completions", json={"messages": []}).status_code == 400
    r = client.post("/v1/chat/completions", json={**BODY, "top_p": 5})
    assert r.status_code == 400 and "top_p" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "top_p" and r.json()["error"]["type"] == "invalid_request_error"


URL = "/v1/chat/completions"
USER = [{"role": "user", "content": "w5 w6"}]


def refused(r, status: int, *words: str) -> dict:
    """The OpenAI error shape, with `status` and every word in its one-line message."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and "\n" not in error["message"]
    assert all(w in error["message"] for w in words), (words, error["message"])
    return error


@pytest.mark.parametrize("field,literal", [("max_tokens", "1e400"), ("max_tokens", "Infinity"),
                                           ("max_tokens", "-Infinity"), ("max_completion_tokens", "1e400"),
                                           ("temperature", "1e400"), ("temperature", "NaN"), ("top_p", "Infinity"),
                                           ("seed", "1e400"), ("max_tokens", "1" * 5000)])
def test_overflowing_numbers_are_a_clear_400(client, field, literal):
    raw = '{"messages": [{"role": "user", "content": "w5"}], "%s": %s}' % (field, literal)
    r = client.post(URL, content=raw.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"], r.text


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "temperature", "top_p", "seed"])
def test_booleans_and_strings_are_not_numbers(client, field):
    for value in (True, False, "7", [1]):
        refused(client.post(URL, json={"messages": USER, field: value}), 400, field)


def answer_text(client, **extra) -> tuple[str, str]:
    data = client.post(URL, json={**BODY, "max_tokens": 30, **extra}).json()
    return data["choices"][0]["message"]["content"], data["choices"][0]["finish_reason"]


def streamed(client, **extra) -> tuple[str, str]:
    with client.stream("POST", URL, json={**BODY, "max_tokens": 30, "stream": True, **extra}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks), chunks[-1]["choices"][0]["finish_reason"]


def test_stop_strings_end_the_answer_without_them(client):
    whole, reason = answer_text(client)
    assert reason == "length"
    words = whole.split()
    stop = f"{words[3]} {words[4]}"  # a stop string across two tokens, mid-answer
    want = whole[:whole.index(stop)]
    assert answer_text(client, stop=stop) == (want, "stop")
    assert streamed(client, stop=stop) == (want, "stop")  # the stream never sends what the stop takes back
    assert answer_text(client, stop=["w95 w95", stop, "nothing", words[6]]) == (want, "stop")
    assert answer_text(client, stop=[]) == (whole, "length")
    assert answer_text(client, stop=["never said"]) == (whole, "length")
    for bad in (["a", "b", "c", "d", "e"], "", [""], [3], {"x": 1}):
        refused(client.post(URL, json={**BODY, "stop": bad}), 400, "stop")


def test_one_choice_only_and_no_silently_dropped_parameters(client):
    assert answer_text(client, n=1)[1] == "length"
    for field, value in (("n", 2), ("n", 0), ("n", True), ("frequency_penalty", 0.5), ("presence_penalty", -1),
                         ("logprobs", True), ("tools", []), ("response_format", {"type": "json_object"}),
                         ("best_of", 2), ("logit_bias", {"5": 10})):
        refused(client.post(URL, json={**BODY, field: value}), 400, field)
    # Their no-op values (and nulls, as OpenAI's clients send them) change nothing.
    same = answer_text(client, frequency_penalty=0, presence_penalty=0.0, logprobs=False, user="ann", n=None,
                       stream_options=None)
    assert same == answer_text(client)


def test_roles_and_content_parts(client):
    for role in ("robot", "tool", "function", None, 3):
        refused(client.post(URL, json={"messages": [{"role": role, "content": "w5"}, *USER]}), 400, "role")
    parts = [{"role": "user", "content": [{"type": "text", "text": "w5"}, {"type": "text", "text": "w6"}]}]
    r = client.post(URL, json={"messages": parts, "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    as_text = client.post(URL, json={"messages": [{"role": "user", "content": "w5\nw6"}], "max_tokens": 4})
    assert r.json()["choices"] == as_text.json()["choices"]
    developer = client.post(URL, json={**BODY, "messages": [{"role": "developer", "content": "w4"}, *BODY["messages"][1:]]})
    assert developer.json()["choices"] == client.post(URL, json=BODY).json()["choices"]  # developer = system
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    refused(client.post(URL, json={"messages": image}), 400, "text parts")
    refused(client.post(URL, json={"messages": [{"role": "user", "content": "w5", "name": "ann"}]}), 400, "name")
    refused(client.post(URL, json={"messages": [{"role": "user", "content": None}]}), 400, "content")


def test_model_ids(client):
    served = client.get("/v1/models").json()["data"][0]["id"]
    assert served == "tiny"
    for model in ("tiny", "default", None):
        r = client.post(URL, json={**BODY, "model": model})
        assert r.status_code == 200 and r.json()["model"] == "tiny"
    error = refused(client.post(URL, json={**BODY, "model": "gpt-4o"}), 404, "gpt-4o", "tiny", "also called 'default'")
    assert error["code"] == "model_not_found" and error["param"] == "model"


def test_a_server_named_default_names_itself_once():
    from app.openai_api import ApiError, _check_model

    with pytest.raises(ApiError) as refusal:
        _check_model("gpt-4o", "default")
    assert "serves 'default';" in refusal.value.message and "also called" not in refusal.value.message


def test_other_methods_are_405(client):
    for method in ("GET", "PUT", "PATCH", "DELETE"):
        r = client.request(method, URL)
        assert r.status_code == 405 and r.headers["allow"] == "POST", method


def test_auth_comes_before_the_body_is_read(engine_and_app_with_auth):
    client = engine_and_app_with_auth
    for body in (b"{not json", b'{"messages": "x", "max_tokens": 1e400}', b"\xff"):
        r = client.post(URL, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert "json" not in r.text.lower() and "messages" not in r.text
    refused(client.post(URL, content=b"{not json", headers={"Authorization": "Bearer pw"}), 400, "not valid JSON")
    assert client.get(URL).status_code == 401  # a stranger does not even learn the method


@pytest.fixture(scope="module")
def engine_and_app_with_auth(tmp_path_factory):
    target = tiny.tiny_target(eos=False)
    return TestClient(create_app(Engine(target, new_heads(target)), tmp_path_factory.mktemp("auth") / "chat.db",
                                 model_name="tiny", auth=("ann", "pw")))


def test_seed_makes_sampling_repeatable(client):
    sampled = {answer_text(client, temperature=1.0, seed=7, speculative=False)[0] for _ in range(3)}
    assert len(sampled) == 1
    assert answer_text(client, seed=7) == answer_text(client)  # greedy: the seed changes nothing
    refused(client.post(URL, json={**BODY, "seed": 1.5}), 400, "seed")
    # This engine's passes (transformers' float32 attention) may round a row otherwise in a tree
    # than alone: a seed with sampling and speculation might not repeat, so it is refused.
    refused(client.post(URL, json={**BODY, "seed": 7, "temperature": 1.0}), 400, "seed", "speculative")


def test_seed_repeats_speculative_sampling_where_passes_are_row_invariant(tmp_path):
    """An int8 fast decoder on the CPU computes each row alone: with a seed, drafted sampling
    repeats, and gives plain decoding's answer (every emitted token is one seeded draw)."""
    from gumiho_core.target import attach_fast_decoder

    target = attach_fast_decoder(tiny.tiny_target(eos=False), "int8")
    if target.fast is None or not target.fast.row_invariant:
        pytest.skip("no int8 fast decoder here")
    engine = Engine(target, new_heads(target))
    assert engine.seed_repeats_drafted_sampling
    client = TestClient(create_app(engine, tmp_path / "chat.db", model_name="tiny"))
    sampled = {answer_text(client, temperature=1.0, seed=7) for _ in range(3)}
    assert len(sampled) == 1 and sampled == {answer_text(client, temperature=1.0, seed=7, speculative=False)}
    assert answer_text(client, temperature=1.0, seed=8) != sampled.pop()  # the seed does choose the answer


def test_api_answers_are_stored_as_sessions_marked_openai(app, client):
    store = app.state.service.store
    before = {s["id"] for s in store.sessions()}
    text, _ = answer_text(client, messages=[{"role": "system", "content": "w4"}, {"role": "user", "content": "w9 w8"},
                                            {"role": "assistant", "content": "w7"}, {"role": "user", "content": "w6"}])
    [new] = [s for s in store.sessions() if s["id"] not in before]
    assert new["source"] == "openai" and new["title"] == "w6"
    rows = store.messages(new["id"])
    assert [(m["role"], m["text"]) for m in rows] == [("user", "w9 w8"), ("assistant", "w7"), ("user", "w6"),
                                                      ("assistant", text)]
    assert rows[-1]["finish_reason"] == "length" and store.session(new["id"])["settings"]["system"] == "w4"


def test_loopback_detection():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.4")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_gradio_client_chat_endpoint(app):
    import uvicorn
    from gradio_client import Client

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(100):
            if server.started:
                break
            time.sleep(0.1)
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        result = client.predict("w7 w8", "", True, 6, 0.0, 1.0, api_name="/chat")
        assert result["finish_reason"] == "length" and result["stats"]["new_tokens"] == 6
        assert result["error"] is None and isinstance(result["text"], str)
        # Stored as a session of its own, marked as coming from /chat.
        store = app.state.service.store
        [session] = [s for s in store.sessions() if s["source"] == "/chat"]
        assert [m["text"] for m in store.messages(session["id"])] == ["w7 w8", result["text"]]
    finally:
        server.should_exit = True
        thread.join(timeout=10)
