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
    assert r.status_code == 400 and "top_p" in r.json()["detail"]


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
    finally:
        server.should_exit = True
        thread.join(timeout=10)
