"""A real server process (`launch.py serve` on a tiny model saved to disk) under load, on loopback.

20 requests, 4 at once, to the OpenAI route; each answer must equal the single-user
(greedy) answer to the same request, i.e. no tokens or caches are shared between clients.
"""
import http.client
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import tiny

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["w5 w6", "w10 w11 w12", "w40", "w70 w71 w72 w73", "w33 w34"]
N_REQUESTS, CONCURRENCY, MAX_TOKENS, DEADLINE_S = 20, 4, 24, 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float, proc) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(url)


def start(args: list[str], folder: Path):
    port = free_port()
    log = open(folder / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "launch.py", "serve", *args, "--port", str(port),
                             "--db", str(folder / "chat.db")], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models", 300, proc)
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-model")
    target = tiny.tiny_target(eos=False)
    target.model.save_pretrained(folder / "model")
    target.tokenizer.save_pretrained(folder / "model")
    yield from start(["--model", str(folder / "model")], folder)


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    yield from start([], tmp_path_factory.mktemp("default-model"))


def ask(base: str, prompt: str, speculative: bool = True, max_tokens: int = MAX_TOKENS, timeout: float = 60) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "speculative": speculative}
    req = urllib.request.Request(f"{base}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def load(base: str, proc, prompts: list[str], max_tokens: int, deadline: float) -> dict:
    """Single-user answers first, then N_REQUESTS at CONCURRENCY at once; every answer must match."""
    assert base.startswith("http://127.0.0.1:")  # loopback only
    single = {p: ask(base, p, max_tokens=max_tokens)["choices"][0]["message"]["content"] for p in prompts}
    assert all(single.values())
    jobs = [(prompts[i % len(prompts)], i % 3 != 0) for i in range(N_REQUESTS)]  # a third with speculation off
    t0 = time.time()
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        futures = [pool.submit(ask, base, p, spec, max_tokens) for p, spec in jobs]
        results = [f.result(timeout=deadline) for f in futures]
    elapsed = time.time() - t0
    print(f"\nload: {N_REQUESTS} requests, {CONCURRENCY} at once, {elapsed:.1f} s, "
          f"{sum(r['usage']['completion_tokens'] for r in results)} tokens")
    assert elapsed < deadline
    for (prompt, spec), result in zip(jobs, results):
        assert result["choices"][0]["message"]["content"] == single[prompt], prompt
        assert result["usage"]["speculative"] is spec
    assert proc.poll() is None  # still serving
    return single


def test_load_20_requests_4_at_once_equal_single_user_answers(server):
    base, proc = server
    single = load(base, proc, PROMPTS, MAX_TOKENS, DEADLINE_S)
    # A bad request under load is answered clearly and does not disturb the next one.
    req = urllib.request.Request(f"{base}/v1/chat/completions", data=b'{"messages": [], "top_p": 9}',
                                 headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert info.value.code == 400
    assert ask(base, PROMPTS[0])["choices"][0]["message"]["content"] == single[PROMPTS[0]]


@pytest.mark.slow
def test_load_on_the_default_model(default_server):
    base, proc = default_server
    load(base, proc, ["Say hi.", "Name a colour.", "What is 2+2?", "One word: sky?"], 8, 300)


# -- issue 19: a client that goes away, and a shutdown, never hold the others -----------------------
@pytest.fixture
def slow_server(tmp_path):
    """tests/serve_tiny.py: a tiny model that sleeps 0.2 s after each step, so requests overlap."""
    port = free_port()
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "tests/serve_tiny.py", "--port", str(port), "--db", str(tmp_path / "chat.db"),
                             "--slow", "0.2"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models", 300, proc)
        yield port, proc, tmp_path / "chat.db"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=20)
        log.close()


def open_stream(port: int, data_lines: int, max_tokens: int = 400, path: str = "/v1/chat/completions"):
    """A connection mid-stream: the request sent and `data_lines` server-sent events read."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": max_tokens, "stream": True}
    conn.request("POST", path, body=json.dumps(body), headers={"content-type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    seen = 0
    while seen < data_lines:
        seen += response.readline().startswith(b"data: ")
    return conn, response


def timed_answer(port: int, timeout: float) -> float:
    t0 = time.time()
    ask(f"http://127.0.0.1:{port}", "w9 w10", max_tokens=4, timeout=timeout)
    return time.time() - t0


def test_a_dropped_client_releases_the_engine_at_once(slow_server):
    port, proc, _ = slow_server
    # A stream that is generating, and one waiting behind it, both dropped by their clients.
    generating, _ = open_stream(port, data_lines=3)
    waiting, _ = open_stream(port, data_lines=1)  # only the role chunk: it is in the queue
    generating.sock.shutdown(socket.SHUT_RDWR)
    generating.close()
    waiting.close()
    assert timed_answer(port, timeout=10) < 10
    # A client of a plain (non-streaming) request that hangs up mid-answer releases it too.
    plain = socket.create_connection(("127.0.0.1", port))
    body = json.dumps({"messages": [{"role": "user", "content": "w7"}], "max_tokens": 400}).encode()
    plain.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    time.sleep(1.5)  # generating by now
    plain.close()
    assert timed_answer(port, timeout=10) < 10
    assert proc.poll() is None


def test_sigterm_with_a_stream_a_queued_request_and_an_open_tab_stops_within_5_s(slow_server):
    port, proc, db = slow_server
    tab = http.client.HTTPConnection("127.0.0.1", port, timeout=60)  # what an idle browser tab keeps open
    tab.request("GET", "/gradio_api/heartbeat/a-tab")
    assert tab.getresponse().status == 200
    stream, response = open_stream(port, data_lines=4)
    queued = ThreadPoolExecutor(1).submit(lambda: urllib.request.urlopen(urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", headers={"content-type": "application/json"},
        data=json.dumps({"messages": [{"role": "user", "content": "w8"}], "max_tokens": 5}).encode()), timeout=30))
    # The second request is waiting in the queue by then. (After 1 s it once had not reached
    # the server on a loaded 2-core machine: refused at the socket, not the 503 asked of it.)
    time.sleep(3.0)
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    elapsed = time.time() - t0
    print(f"\nSIGTERM with a stream, a queued request and a tab open: exited in {elapsed:.1f} s")
    assert elapsed < 5
    rest = response.read().decode()  # the stream was told, and ended properly
    assert "shutting down" in rest and rest.rstrip().endswith("data: [DONE]")
    with pytest.raises(urllib.error.HTTPError) as info:
        queued.result(timeout=10)
    assert info.value.code == 503
    from app.store import Store

    store = Store(db)
    [session] = [s for s in store.sessions() if s["source"] == "openai"]
    user, answer = store.messages(session["id"])
    assert user["text"] == "w5 w6" and answer["text"] and answer["finish_reason"] == "cancelled"
    store.close()
