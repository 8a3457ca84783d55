"""A real server process (`launch.py serve` on a tiny model saved to disk) under load, on loopback.

20 requests, 4 at once, to the OpenAI route; each answer must equal the single-user
(greedy) answer to the same request, i.e. no tokens or caches are shared between clients.
"""
import json
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


def ask(base: str, prompt: str, speculative: bool = True, max_tokens: int = MAX_TOKENS) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "speculative": speculative}
    req = urllib.request.Request(f"{base}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
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
