"""An adversarial pass over a real gumiho-chat server on loopback (issue 19's figures).

    .venv/bin/python tests/adversarial_server.py

Starts tests/serve_tiny.py (a tiny random model, 0.1 s per engine step) on a fresh
database, then:
  * bad inputs: every body / method / header below against the OpenAI route; handled
    cleanly = a 4xx in OpenAI's error shape with a one-line message (never a 500 or a
    traceback), and the server still answers a normal request with the same text after;
  * faults: clients that drop a stream / a queued stream / a plain request, a database locked
    by another program mid-answer, SIGTERM with a stream + a queued request + a tab open,
    SIGKILL mid-answer and a restart; survived = the next request is answered within 10 s
    (or the server stopped within 5 s when told to); lost = a message stored before the
    fault that is gone after it, or an answer the server said it saved that is not there.
Prints the figures and exits 1 if anything was not handled.
"""
from __future__ import annotations

import http.client
import json
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
USER = [{"role": "user", "content": "w5 w6"}]
GOOD = {"messages": USER, "max_tokens": 6}


def bad_inputs() -> list[tuple[str, str, bytes, dict]]:
    """(label, method, raw body, extra headers)."""
    j = lambda body: json.dumps(body).encode()  # noqa: E731
    raw = lambda text: text.encode()  # noqa: E731
    cases = [("not json", "POST", b"{nope", {}), ("bad utf-8", "POST", b"\xff\xfe{}", {}),
             ("empty body", "POST", b"", {}), ("a list", "POST", b"[1, 2]", {}), ("a string", "POST", b'"hi"', {}),
             ("5000-digit int", "POST", raw('{"messages": [], "max_tokens": %s}' % ("9" * 5000)), {}),
             ("deep nesting", "POST", b"[" * 100000 + b"]" * 100000, {})]
    for field in ("max_tokens", "max_completion_tokens", "temperature", "top_p", "seed"):
        for literal in ("1e400", "-1e400", "Infinity", "-Infinity", "NaN", "true", "false", '"7"', "[1]", "{}"):
            cases.append((f"{field}={literal}", "POST", raw('{"messages": %s, "%s": %s}' % (json.dumps(USER), field,
                                                                                           literal)), {}))
    for value in (-1, 0, 1.5):
        cases.append((f"temperature/top_p/max_tokens={value}", "POST",
                      j({**GOOD, "top_p": value, "temperature": -1 if value == 0 else 0, "max_tokens": value}), {}))
    for body in ({"messages": []}, {"messages": "x"}, {"messages": [1]}, {"messages": [{"role": "robot", "content": "x"}]},
                 {"messages": [{"role": "tool", "content": "x"}]}, {"messages": [{"role": "user"}]},
                 {"messages": [{"role": "user", "content": None}]}, {"messages": [{"role": "user", "content": 5}]},
                 {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
                 {"messages": [{"role": "user", "content": "x", "name": "ann"}]},
                 {"messages": [{"role": "system", "content": "only a system message"}]},
                 {"messages": [{"role": "user", "content": "   "}]},
                 {"messages": [{"role": "user", "content": " ".join(["w5"] * 700)}]},
                 {**GOOD, "n": 2}, {**GOOD, "n": 0}, {**GOOD, "stop": ["a", "b", "c", "d", "e"]}, {**GOOD, "stop": ""},
                 {**GOOD, "stop": [3]}, {**GOOD, "stream": "yes"}, {**GOOD, "speculative": 1}, {**GOOD, "tools": []},
                 {**GOOD, "frequency_penalty": 1}, {**GOOD, "logprobs": True}, {**GOOD, "model": "gpt-4o"},
                 {**GOOD, "model": 3}, {**GOOD, "max_tokens": 10**12}, {**GOOD, "max_tokens": 4, "max_completion_tokens": 5},
                 {**GOOD, "seed": 3, "temperature": 1.0}, {**GOOD, "response_format": {"type": "json_object"}}):
        cases.append((json.dumps(body)[:60], "POST", j(body), {}))
    for method in ("GET", "PUT", "PATCH", "DELETE"):
        cases.append((method, method, b"", {}))
    return cases


def request(port: int, method: str, body: bytes = b"", headers: dict | None = None, timeout: float = 60):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request(method, "/v1/chat/completions", body=body, headers={"content-type": "application/json",
                                                                      **(headers or {})})
    response = conn.getresponse()
    return response.status, response.read().decode("utf-8", "replace")


def clean_refusal(status: int, text: str) -> bool:
    try:
        error = json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return 400 <= status < 500 and "\n" not in error["message"] and "Traceback" not in text


class Server:
    """tests/serve_tiny.py on a free port; `stop(sig)` returns how long it took to exit."""

    def __init__(self, db: Path, slow: float = 0.1):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = open(db.with_suffix(".log"), "a")
        self.proc = subprocess.Popen([sys.executable, "tests/serve_tiny.py", "--port", str(self.port), "--db", str(db),
                                      "--slow", str(slow)], cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                request(self.port, "GET", timeout=2)
                return
            except OSError:
                time.sleep(0.3)
        raise TimeoutError("the server did not start")

    def stop(self, sig=signal.SIGTERM) -> float:
        t0 = time.time()
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        return time.time() - t0


def answered_within(port: int, seconds: float = 10) -> bool:
    t0 = time.time()
    try:
        status, _ = request(port, "POST", json.dumps(GOOD).encode(), timeout=seconds)
    except OSError:
        return False
    return status == 200 and time.time() - t0 < seconds


def open_stream(port: int, lines: int, max_tokens: int = 300):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/chat/completions", headers={"content-type": "application/json"},
                 body=json.dumps({"messages": USER, "max_tokens": max_tokens, "stream": True}))
    response = conn.getresponse()
    seen = 0
    while seen < lines:
        seen += response.readline().startswith(b"data: ")
    return conn, response


def stored_messages(db: Path) -> list[tuple]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT session_id, position, role, text, finish_reason FROM messages").fetchall()
    finally:
        conn.close()


def run_bad_inputs(server: Server) -> tuple[int, int, list[str]]:
    reference = json.loads(request(server.port, "POST", json.dumps(GOOD).encode())[1])["choices"]
    cases = bad_inputs()
    failed = [label for label, method, body, headers in cases
              if not clean_refusal(*request(server.port, method, body, headers))]
    after = json.loads(request(server.port, "POST", json.dumps(GOOD).encode())[1])["choices"]
    if after != reference or server.proc.poll() is not None:
        failed.append("the normal request after them changed or failed")
    return len(cases), len(cases) - len(failed), failed


def drop_faults(server: Server) -> list[tuple[str, bool]]:
    results = []
    for label in ("drop a stream mid-answer", "drop a stream mid-answer (again)"):
        conn, _ = open_stream(server.port, lines=4)
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        results.append((label, answered_within(server.port)))
    generating, _ = open_stream(server.port, lines=3)
    queued, _ = open_stream(server.port, lines=1)
    queued.close()
    generating.close()
    results.append(("drop a queued stream and the one ahead of it", answered_within(server.port)))
    plain = socket.create_connection(("127.0.0.1", server.port))
    body = json.dumps({"messages": USER, "max_tokens": 300}).encode()
    plain.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    time.sleep(1.5)
    plain.close()
    results.append(("drop a plain request mid-answer", answered_within(server.port)))
    return results


def lock_fault(server: Server, db: Path) -> tuple[str, bool]:
    """Another program holds the database while an answer is stored: answered, not stored, said."""
    other = sqlite3.connect(db, isolation_level=None, timeout=10)
    other.execute("BEGIN EXCLUSIVE")
    try:
        ok = answered_within(server.port, seconds=15)  # the store waits its 5 s timeout, then gives up
    finally:
        other.execute("ROLLBACK")
        other.close()
    said = "the database is locked" in db.with_suffix(".log").read_text()
    return "database locked by another program mid-answer", ok and said and answered_within(server.port)


def stop_faults(db: Path) -> tuple[list[tuple[str, bool]], int]:
    """SIGTERM with a stream, a queued request and a tab; SIGKILL mid-answer; restarts. Returns (results, lost)."""
    server = Server(db)
    tab = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    tab.request("GET", "/gradio_api/heartbeat/a-tab")
    tab.getresponse()
    open_stream(server.port, lines=4)
    threading.Thread(target=lambda: request(server.port, "POST", json.dumps(GOOD).encode()), daemon=True).start()
    time.sleep(1.0)
    before = stored_messages(db)
    took = server.stop(signal.SIGTERM)
    after = stored_messages(db)
    partial = [m for m in after if m not in before and m[2] == "assistant" and m[4] == "cancelled"]
    results = [(f"SIGTERM with a stream, a queued request and a tab open ({took:.1f} s)", took < 5 and bool(partial))]
    server = Server(db)
    open_stream(server.port, lines=4)
    kept = stored_messages(db)
    server.stop(signal.SIGKILL)
    server = Server(db)
    results.append(("SIGKILL mid-answer, then a restart on the same file", answered_within(server.port)))
    server.stop()
    lost = len([m for m in before + kept if m not in stored_messages(db)])
    return results, lost


def main() -> int:
    folder = Path(tempfile.mkdtemp(prefix="gumiho-adversarial-"))
    db = folder / "chat.db"
    server = Server(db)
    try:
        tried, clean, failed = run_bad_inputs(server)
        before = stored_messages(db)
        faults = drop_faults(server) + [lock_fault(server, db)]
    finally:
        server.stop()
    lost = len([m for m in before if m not in stored_messages(db)])
    more, lost_more = stop_faults(db)
    faults += more
    print(f"bad inputs: {tried} tried, {clean} handled cleanly")
    for label in failed:
        print(f"  not clean: {label}")
    survived = sum(ok for _, ok in faults)
    print(f"faults: {len(faults)} injected, {survived} survived, {lost + lost_more} stored messages lost")
    for label, ok in faults:
        print(f"  {'ok  ' if ok else 'FAIL'} {label}")
    return 0 if clean == tried and survived == len(faults) and not lost + lost_more else 1


if __name__ == "__main__":
    sys.exit(main())
