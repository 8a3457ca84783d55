"""Issue 6: bad input, faults, concurrency, security — on tiny random models, no browser.

The Gradio handlers (app/handlers.py) are called directly with a service, so the same
code the browser runs is exercised without one; tests/test_server_process.py and
tests/test_browser_reliability.py do the same through real processes and chromium.
"""
import base64
import json
import os
import re
import sqlite3
import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

import tiny
from app import handlers
from app.chat import ChatService, Options, clean_text, last
from app.server import create_app, parse_auth
from app.store import Store, StoreError, export_path, markdown_safe, safe_filename
from gumiho_core import ContextTooLong, Engine, GumihoError, new_heads

from test_app_chat import engine, service  # noqa: E402,F401  (shared fixtures: tiny engine, chat service)

ROOT = Path(__file__).resolve().parent.parent
BAD_CONTROL = "a\x00b\x01c\x07d\x1be\x7ff\x85g\u0090h"


def status_of(outputs) -> str:
    return outputs[3] if isinstance(outputs[3], str) else ""


SETTINGS = dict(spec_on=True, system_text="", temp=0.0, p=1.0, n=8, view_name="colours", rej=False, request=None)


def send(service, st, text, **kw):
    return last(handlers.send(service, text, st, **{**SETTINGS, **kw}))


def reference(engine, text, n=8):
    """The single-user greedy answer, plain decoding on a fresh service."""
    return last(ChatService(engine, None).stream([{"role": "user", "text": text}],
                                                 Options(speculative=False, max_new_tokens=n))).text


# -- 1. bad input ---------------------------------------------------------------------------------
def test_clean_text_strips_controls_and_bad_bytes():
    assert clean_text(BAD_CONTROL) == "abcdefgh"
    assert clean_text("tab\tnew\nline\r\nend\rx") == "tab\tnew\nline\nend\nx"
    assert clean_text(b"ok \xff\xfe bytes") == "ok \ufffd\ufffd bytes"
    assert clean_text("lone \ud800 surrogate") == "lone \ufffd surrogate"
    assert clean_text(None) == ""
    assert clean_text("w5 héllo 日本 🦊") == "w5 héllo 日本 🦊"


BAD_SETTINGS = [  # (temperature, top_p, max new tokens, word in the message)
    (-0.1, 1.0, 8, "temperature"), (float("nan"), 1.0, 8, "temperature"), (float("inf"), 1.0, 8, "temperature"),
    (0.0, 0.0, 8, "top_p"), (0.0, -1.0, 8, "top_p"), (0.0, 1.5, 8, "top_p"), (0.0, float("nan"), 8, "top_p"),
    (0.0, 1.0, 0, "max new tokens"), (0.0, 1.0, -5, "max new tokens"), (0.0, 1.0, 2.5, "max new tokens"),
    ("hot", 1.0, 8, "number"), (0.0, 1.0, "many", "max new tokens"),
]


@pytest.mark.parametrize("temperature,top_p,n,word", BAD_SETTINGS)
def test_invalid_settings_are_one_clear_line(service, temperature, top_p, n, word):
    opts = Options(temperature=temperature, top_p=top_p, max_new_tokens=n)
    with pytest.raises(GumihoError, match=word) as info:
        opts.settings()
    assert "\n" not in str(info.value)
    final = last(service.stream([{"role": "user", "text": "w5"}], opts))
    assert final.finish_reason == "error" and word in final.error and not final.steps


def test_ui_empty_and_invalid_input_store_nothing(service):
    st = handlers.new_state()
    for text in ("", "   ", "\n\t \n", "\x00\x01\x7f", None):
        out = send(service, st, text)
        assert "empty message is not sent" in status_of(out)
    for temp, p, n, word in BAD_SETTINGS[:10]:
        out = send(service, st, "w5 w6", temp=temp, p=p, n=n)
        assert word in status_of(out) and out[2] is not None  # the message stays in the box (gr.skip)
    assert st == handlers.new_state() and service.store.sessions() == []
    # Control characters are removed before storing; the answer comes and is saved.
    out = send(service, st, "w5" + BAD_CONTROL + " w6")
    rows = service.store.messages(st["session_id"])
    assert [r["role"] for r in rows] == ["user", "assistant"] and rows[0]["text"] == "w5abcdefgh w6"
    assert rows[1]["finish_reason"] == "length"


def test_long_history_drops_oldest_turns_and_says_which(engine, tmp_path):
    target = tiny.tiny_target(eos=False, max_positions=64)
    small = ChatService(Engine(target, new_heads(target)), Store(tmp_path / "c.db"))
    history = []
    for i in range(6):  # 6 turns of ~12 tokens each: far over 64 with 8 new tokens
        history += [{"role": "user", "text": " ".join(f"w{3 + (i * 7 + j) % 90}" for j in range(6))},
                    {"role": "assistant", "text": "w9 w9 w9 w9 w9"}]
    history.append({"role": "user", "text": "w40 w41 w42"})
    prompt, kept, dropped = small.fit("w7 w8", history, 8)
    assert dropped >= 1 and len(prompt) + 8 <= 64
    assert kept[-1] == history[-1] and kept == history[-len(kept):] and kept[0]["role"] == "user"
    assert small.prompt_ids("w7 w8", kept)[:len(small.prompt_ids("w7 w8", []))] == small.prompt_ids("w7 w8", [])
    final = last(small.stream(history, Options(system="w7 w8", max_new_tokens=8)))
    assert final.error is None and final.stats["new_tokens"] == 8
    assert f"turns 1–{dropped} (of 7)" in final.notice or (dropped == 1 and "turn 1 (of 7)" in final.notice)
    # Through the UI: the note is in the status line after the answer.
    st = {"session_id": None, "messages": [dict(m) for m in history[:-1]]}
    out = send(small, st, "w40 w41 w42", system_text="w7 w8")
    assert "left out of the prompt" in status_of(out) and st["messages"][-1]["finish_reason"] == "length"
    # One message longer than the whole context: a clear message, nothing generated.
    huge = " ".join(["w5"] * 80)
    with pytest.raises(ContextTooLong, match="too long"):
        small.fit("", [{"role": "user", "text": huge}], 8)
    out = send(small, handlers.new_state(), huge)
    assert "the message is too long for the model" in status_of(out)
    assert "Shorten the message" in status_of(out)


def test_api_bad_input(engine, tmp_path):
    client = TestClient(create_app(engine, tmp_path / "api.db", model_name="tiny"))
    url = "/v1/chat/completions"
    user = [{"role": "user", "content": "w5 w6"}]
    bad = [
        ({"messages": []}, "user message"),
        ({"messages": [{"role": "system", "content": "w4"}]}, "user message"),
        ({"messages": [{"role": "user", "content": "   "}]}, "empty"),
        ({"messages": user, "temperature": -1}, "temperature"),
        ({"messages": user, "top_p": 0}, "top_p"),
        ({"messages": user, "top_p": 1.01}, "top_p"),
        ({"messages": user, "max_tokens": 0}, "max new tokens"),
        ({"messages": user, "max_completion_tokens": -3}, "max new tokens"),
        ({"messages": [{"role": "user", "content": " ".join(["w5"] * 600)}], "max_tokens": 4}, "too long"),
    ]
    for body, word in bad:
        r = client.post(url, json=body)
        assert r.status_code == 400 and word in r.json()["error"]["message"], (body, r.text)
    assert client.post(url, json={"messages": "nope"}).status_code == 400
    assert client.post(url, content=b"\xff\xfe{not json", headers={"content-type": "application/json"}).status_code == 400
    # Control characters and a lone surrogate (what undecodable bytes become) are answered.
    raw = '{"messages": [{"role": "user", "content": "w5\\u0000\\u001b w6 \\ud800"}], "max_tokens": 4}'
    r = client.post(url, content=raw.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    # A long conversation is answered with its oldest turns dropped.
    long_chat = [{"role": "user" if i % 2 == 0 else "assistant", "content": " ".join(["w7"] * 60)} for i in range(15)]
    r = client.post(url, json={"messages": long_chat, "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] + 4 <= 512


def test_bad_model_and_heads_paths_keep_the_app_running(service, tmp_path):
    from gumiho_core import HeadCheckpoint

    not_model = tmp_path / "not-a-model"
    not_model.mkdir()
    (not_model / "notes.txt").write_text("hello")
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "config.json").write_bytes(os.urandom(200))  # unreadable as JSON
    bin_file = tmp_path / "weights.bin"
    bin_file.write_bytes(os.urandom(300))
    fake_gguf = tmp_path / "model.gguf"
    fake_gguf.write_bytes(b"GGUF" + os.urandom(300))
    # Heads trained for another model (hidden size 32, not 64): a mismatch, not a crash.
    from transformers import LlamaConfig, LlamaForCausalLM

    wide = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1)).eval()
    other = tiny.Target(model=wide, tokenizer=tiny.tiny_tokenizer(), name="wide")
    mismatched = HeadCheckpoint.save(new_heads(other), tmp_path / "heads-32")
    heads_garbage = tmp_path / "heads-garbage"
    heads_garbage.mkdir()
    (heads_garbage / "config.json").write_text("{\"not\": \"heads\"}")
    before = service.engine
    tried = [
        ("/no/such/model", ""), (str(not_model), ""), (str(garbage), ""), (str(bin_file), ""), (str(fake_gguf), ""),
        ("", "/no/such/heads"), ("", str(heads_garbage)), ("", str(bin_file)), ("", str(mismatched)),
    ]
    for path, heads in tried:
        note, *_ = handlers.load_model(service, path, heads)
        assert note.startswith("**error:**") and "\n" not in note and "Traceback" not in note, (path, heads, note)
        assert service.engine is before
    out = send(service, handlers.new_state(), "still alive")
    assert out[1]["messages"][-1]["finish_reason"] == "length"


# -- 2. faults ------------------------------------------------------------------------------------
def test_stop_mid_step_leaves_engine_clean(service):
    want = reference(service.engine, "w20 w21", n=30)
    forward = service.engine.target.base.forward
    for delay in (0.0, 0.003, 0.01, 0.03):
        cancel = threading.Event()
        calls = {"n": 0}

        def slow_forward(*a, **k):  # the Stop lands while a forward pass is running
            calls["n"] += 1
            if calls["n"] == 3:
                threading.Timer(delay, cancel.set).start()
                time.sleep(delay + 0.02)
            return forward(*a, **k)

        service.engine.target.base.forward = slow_forward
        try:
            final = last(service.stream([{"role": "user", "text": "w3 w4"}], Options(max_new_tokens=200), cancel=cancel))
        finally:
            del service.engine.target.base.forward
        assert final.finish_reason == "cancelled" and 0 < final.stats["new_tokens"] < 200
        assert not service.engine.lock.locked() and len(service.queue) == 0
        again = last(service.stream([{"role": "user", "text": "w20 w21"}], Options(max_new_tokens=30)))
        assert again.text == want and again.error is None


def test_exception_inside_a_step_saves_partial_and_next_works(service):
    st = handlers.new_state()
    send(service, st, "w5 w6 w7")  # an earlier turn, so the fault is mid-conversation
    want = reference(service.engine, "w30 w31", n=8)
    forward = service.engine.target.base.forward
    for fault_at, exc in ((4, RuntimeError("CUDA out of memory")), (2, ValueError("bad tensor")),
                          (6, MemoryError())):
        calls = {"n": 0}

        def broken(*a, **k):
            calls["n"] += 1
            if calls["n"] == fault_at:
                raise exc
            return forward(*a, **k)

        service.engine.target.base.forward = broken
        try:
            out = send(service, st, "w8 w9", n=40)
        finally:
            del service.engine.target.base.forward
        assert "generation failed" in status_of(out) and "partial answer was saved" in status_of(out)
        stored = service.store.messages(st["session_id"])[-1]
        assert stored["role"] == "assistant" and stored["finish_reason"] == "error" and stored["text"]
        assert not service.engine.lock.locked()
        out = send(service, handlers.new_state(), "w30 w31")
        assert out[1]["messages"][-1]["text"] == want
    roles = [m["role"] for m in service.store.messages(st["session_id"])]
    assert roles == ["user", "assistant"] * 4


def test_corrupt_database_is_reported_and_left_untouched(tmp_path):
    for name, content in (("random.db", os.urandom(8192)),
                          ("header.db", b"SQLite format 3\x00" + os.urandom(4080)),
                          ("text.db", b"just some notes\n" * 50)):
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(StoreError, match="left untouched") as info:
            Store(path)
        assert "\n" not in str(info.value)
        assert path.read_bytes() == content
        assert not Path(str(path) + "-wal").exists() or Path(str(path) + "-wal").stat().st_size == 0


def test_locked_database_is_reported_and_left_untouched(tmp_path):
    path = tmp_path / "chat.db"
    store = Store(path)
    sid = store.create_session("keep me")
    store.add_message(sid, "user", "w5")
    store.close()
    before = path.read_bytes()
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")  # another program holds the write lock
    try:
        with pytest.raises(StoreError, match="locked"):
            Store(path, timeout=0.2)
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert path.read_bytes() == before
    assert [m["text"] for m in Store(path).messages(sid)] == ["w5"]


def test_serve_refuses_a_corrupt_database_with_one_line(tmp_path, monkeypatch, capsys):
    from gumiho_core import loading
    from gumiho_core.cli import main

    loaded = []
    monkeypatch.setattr(loading, "load_engine", lambda *args, **kwargs: loaded.append(1))
    path = tmp_path / "bad.db"
    content = os.urandom(5000)
    path.write_bytes(content)
    assert main(["serve", "--db", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "left untouched" in err[-1] and not loaded
    assert path.read_bytes() == content


# -- 3. concurrency -------------------------------------------------------------------------------
def test_two_clients_are_served_in_order_with_positions(service):
    prompts = ["w10 w11", "w40 w41 w42", "w60", "w70 w71"]
    want = {p: reference(service.engine, p, n=25) for p in prompts}
    seen: dict[str, list] = {p: [] for p in prompts}
    results = {}

    def client(p):
        for answer in service.stream([{"role": "user", "text": p}], Options(max_new_tokens=25)):
            if answer.waiting:
                seen[p].append(answer.waiting)
        results[p] = answer.text

    # Hold the queue with one slow answer so the others must wait behind it.
    gate = threading.Event()
    first_started = threading.Event()

    def first():
        for answer in service.stream([{"role": "user", "text": prompts[0]}], Options(max_new_tokens=25)):
            first_started.set()
            gate.wait(5)
        results[prompts[0]] = answer.text

    threads = [threading.Thread(target=first)]
    threads[0].start()
    assert first_started.wait(10)
    for p in prompts[1:]:
        threads.append(threading.Thread(target=client, args=(p,)))
        threads[-1].start()
        time.sleep(0.3)  # join the queue in this order
    time.sleep(0.5)
    assert service.queue.ahead(max(service.queue._queue)) == 3  # the last one sees 3 ahead
    gate.set()
    for t in threads:
        t.join(30)
    assert results == want  # every answer equals its single-user answer: nothing interleaved
    assert seen[prompts[1]][0] == 1 and seen[prompts[2]][0] == 2 and seen[prompts[3]][0] == 3
    assert all(s == sorted(s, reverse=True) for s in seen.values())  # positions only go down
    assert len(service.queue) == 0


def test_stop_while_waiting_leaves_the_queue(service):
    cancel = threading.Event()
    gate = threading.Event()
    started = threading.Event()

    def holder():
        for _ in service.stream([{"role": "user", "text": "w5"}], Options(max_new_tokens=10)):
            started.set()
            gate.wait(5)

    t = threading.Thread(target=holder)
    t.start()
    started.wait(10)
    waiter = service.stream([{"role": "user", "text": "w6"}], Options(max_new_tokens=10), cancel=cancel)
    first = next(waiter)
    assert first.waiting == 1
    cancel.set()
    final = last(waiter)
    assert final.done and final.finish_reason == "cancelled" and not final.steps
    gate.set()
    t.join(10)
    assert len(service.queue) == 0


# -- 4. security ----------------------------------------------------------------------------------
HOSTILE_TITLES = ["../../etc/x", "/etc/passwd", "..", ".", "a/../../b", "C:\\Windows\\x", "nul\x00byte/../../x",
                  "~/.ssh/id", "\u202e..\u2215..\u2215x", "con", "", "   ", '<img src=x onerror="alert(1)">']


def test_export_names_stay_in_the_folder(tmp_path):
    folder = tmp_path / "exports"
    folder.mkdir()
    for title in HOSTILE_TITLES:
        for ext in ("json", "md", "../../sh"):
            path = export_path(folder, title, ext)
            assert path.parent == folder.resolve(), (title, path)
            assert re.fullmatch(r"[A-Za-z0-9-]+\.[a-z]+", path.name), path.name
    assert safe_filename("Renamed chat") == "Renamed-chat" and safe_filename("../..") == "session"


def test_exports_through_the_ui_escape_html_and_stay_in_folder(service, tmp_path):
    for title in HOSTILE_TITLES[:9] + [HOSTILE_TITLES[-1]]:
        sid = service.store.create_session(title)
        service.store.add_message(sid, "user", '<script>alert(1)</script> and `a<b` code')
        service.store.add_message(sid, "assistant", '<img src=x onerror=alert(2)>\n```\nif a < b: pass\n```')
        for kind in ("json", "md"):
            path = Path(handlers.export(service, sid, kind))
            assert path.exists() and path.parent.parent == service.exports.root
            assert service.exports.root.name.startswith("gumiho-export-")
            assert re.fullmatch(r"[A-Za-z0-9-]+\.(json|md)", path.name)
            text = path.read_text()
            if kind == "md":
                assert "<img" not in text and "<script" not in text and "&lt;img src=x" in text
                assert "`a<b`" in text and "if a < b: pass" in text  # code stays as written
            else:
                assert json.loads(text)["session"]["title"] == title
    assert markdown_safe("x <b>y</b>") == "x &lt;b&gt;y&lt;/b&gt;"


def test_sql_is_only_built_from_parameters():
    """No f-string / % / .format SQL in app/: the one f-string PRAGMA formats our own int."""
    sql_call = re.compile(r"\.(execute|executescript|query)\(\s*(f[\"']|[\"'][^\"']*[\"']\s*(%|\.format))")
    offenders = []
    for source in (ROOT / "app").glob("*.py"):
        for n, line in enumerate(source.read_text().splitlines(), 1):
            if sql_call.search(line) and "PRAGMA user_version = {int(" not in line:
                offenders.append(f"{source.name}:{n}: {line.strip()}")
    assert offenders == []


def test_hostile_text_is_data_in_the_database(tmp_path):
    store = Store(tmp_path / "c.db")
    evil = "x'); DROP TABLE messages; --"
    sid = store.create_session(evil)
    store.add_message(sid, "user", evil)
    store.rename_session(sid, evil + "2")
    assert store.session(sid)["title"] == evil + "2" and store.messages(sid)[0]["text"] == evil


def test_auth_protects_ui_and_api(engine, tmp_path):
    app = create_app(engine, tmp_path / "auth.db", model_name="tiny", auth=("ann", "s3cret"))
    client = TestClient(app)
    body = {"messages": [{"role": "user", "content": "w5"}], "max_tokens": 3}
    url = "/v1/chat/completions"
    basic = lambda u, p: {"Authorization": "Basic " + base64.b64encode(f"{u}:{p}".encode()).decode()}
    for headers in ({}, basic("ann", "wrong"), basic("bob", "s3cret"), {"Authorization": "Bearer nope"},
                    {"Authorization": "Basic !!!"}, {"Authorization": "Digest x"}):
        r = client.post(url, json=body, headers=headers)
        assert r.status_code == 401 and "WWW-Authenticate" in r.headers, headers
        assert client.get("/v1/models", headers=headers).status_code == 401
    for headers in (basic("ann", "s3cret"), {"Authorization": "Bearer s3cret"}, {"Authorization": "Bearer ann:s3cret"}):
        assert client.post(url, json=body, headers=headers).status_code == 200
    # Gradio: the config and the API refuse without a login, work after one.
    assert client.get("/config").status_code == 401
    assert client.post("/login", data={"username": "ann", "password": "bad"}).status_code >= 400
    assert client.post("/login", data={"username": "ann", "password": "s3cret"}).status_code == 200
    assert client.get("/config").status_code == 200
    # Without auth the local app stays open.
    open_client = TestClient(create_app(engine, tmp_path / "open.db", model_name="tiny"))
    assert open_client.post(url, json=body).status_code == 200


def test_auth_option_and_env(monkeypatch, tmp_path, capsys):
    import uvicorn

    from gumiho_core import loading
    from gumiho_core.cli import build_parser

    assert parse_auth("a:b:c") == ("a", "b:c") and parse_auth(None) is None
    for bad in ("nocolon", ":pass", "user:"):
        with pytest.raises(GumihoError, match="USER:PASSWORD"):
            parse_auth(bad)
    target = tiny.tiny_target()
    monkeypatch.setattr(loading, "load_engine", lambda *a, **k: (Engine(target, new_heads(target)), "untrained"))
    apps = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: apps.append((app, kw)))
    args = build_parser().parse_args(["serve", "--host", "0.0.0.0", "--db", str(tmp_path / "a.db"), "--auth", "u:p"])
    args.func(args)
    assert "asks for a login" in capsys.readouterr().err
    monkeypatch.setenv("GUMIHO_AUTH", "envuser:envpass")
    args = build_parser().parse_args(["serve", "--db", str(tmp_path / "b.db")])
    args.func(args)
    client = TestClient(apps[-1][0])
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer envpass"}).status_code == 200
    monkeypatch.delenv("GUMIHO_AUTH")
    args = build_parser().parse_args(["serve", "--host", "192.168.1.4", "--db", str(tmp_path / "c.db")])
    args.func(args)
    assert "--auth USER:PASSWORD" in capsys.readouterr().err
    assert all(kw["host"] in ("0.0.0.0", "127.0.0.1", "192.168.1.4") for _, kw in apps)


def test_serve_with_a_broken_model_is_one_line(tmp_path, capsys):
    from gumiho_core.cli import main

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama", "vocab_size": "many"}')
    for model in ("/no/such/model", str(broken)):
        assert main(["serve", "--model", model, "--db", str(tmp_path / "c.db")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("error: ") and "Traceback" not in "\n".join(err), err


# -- issue 19: storage failures are said in words, nothing shown as saved that is not --------------
def fill_up(store: Store) -> None:
    """A real SQLITE_FULL from now on for anything that needs a new page: the database's
    size is capped at what it has (small rows still fit in the free room of its pages)."""
    pages = store.db.execute("PRAGMA page_count").fetchone()[0]
    store.db.execute(f"PRAGMA max_page_count = {int(pages)}")


def test_a_full_disk_keeps_the_message_and_says_the_answer_was_not_saved(engine, tmp_path):
    small = ChatService(engine, Store(tmp_path / "full.db"))
    st = handlers.new_state()
    send(small, st, "w5 w6")  # a session with one saved exchange
    fill_up(small.store)
    long_message = " ".join(["w7"] * 3000)  # does not fit in what is left: the user's own text is refused
    out = send(small, st, long_message)
    assert "the database is full" in status_of(out) and "still in the box" in status_of(out)
    assert out[2] is not None and out[2] != "" and len(st["messages"]) == 2  # the box keeps the text (gr.skip)
    # The user message fits, the answer (with its token steps) does not: it is shown, marked, and said.
    out = send(small, st, "w8", n=150)
    assert "the database is full" in status_of(out) and "this answer was not saved" in status_of(out)
    assert "saved." not in status_of(out).replace("not saved.", "")
    assert st["messages"][-1]["unsaved"] and "not saved" in out[0]
    stored = small.store.messages(st["session_id"])
    assert [m["text"] for m in stored] == ["w5 w6", stored[1]["text"], "w8"]  # no answer row for w8


def test_a_database_locked_mid_session_is_said_and_the_next_message_works(engine, tmp_path):
    path = tmp_path / "locked.db"
    small = ChatService(engine, Store(path, timeout=0.3))
    st = handlers.new_state()
    outputs = handlers.send(small, "w5 w6", st, **SETTINGS)
    next(outputs)  # the user message is stored, the answer is being generated ...
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")  # ... when another program locks the file
    try:
        out = last(outputs)
        assert "the database is locked by another program" in status_of(out)
        assert "this answer was not saved" in status_of(out) and st["messages"][-1]["unsaved"]
        for handler, args in ((handlers.rename, (st["session_id"], "new title", st)),
                              # Delete's second press (the first only asks)
                              (handlers.delete, (st["session_id"], {**st, "confirm_delete": st["session_id"]},
                                                 "colours", False)),
                              (handlers.edit_last, (st, "colours", False))):
            with pytest.raises(Exception, match="the database is locked") as info:
                handler(small, *args)
            assert type(info.value).__name__ == "Error"  # gr.Error: Gradio shows its words, not "Error"
    finally:
        other.execute("ROLLBACK")
        other.close()
    out = send(small, st, "w9")
    assert status_of(out) == "" and st["messages"][-1].get("id")
    rows = small.store.messages(st["session_id"])  # the unsaved answer is the one thing missing
    assert [(m["role"], m["text"]) for m in rows[:2]] == [("user", "w5 w6"), ("user", "w9")]
    assert len(rows) == 3 and rows[2]["role"] == "assistant" and rows[2]["finish_reason"] == "length"


def test_a_restart_on_a_nearly_full_disk_warns(engine, tmp_path, monkeypatch, capsys):
    import shutil as shutil_module

    Store(tmp_path / "chat.db").close()
    usage = shutil_module.disk_usage(tmp_path)
    monkeypatch.setattr("app.store.shutil.disk_usage", lambda p: usage._replace(free=3 * 2**20))
    app = create_app(engine, tmp_path / "chat.db", model_name="tiny")
    err = capsys.readouterr().err
    assert "warning: the disk holding" in err and "3.0 MB free" in err and "may not be saved" in err
    assert app.state.service.store.notes and "3.0 MB free" in app.state.service.store.notes[0]


def test_an_api_answer_that_cannot_be_stored_still_reaches_its_client(engine, tmp_path, capsys):
    app = create_app(engine, tmp_path / "api.db", model_name="tiny")
    fill_up(app.state.service.store)
    r = TestClient(app).post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w5"}],
                                                           "max_tokens": 200})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 200
    assert "the database is full" in capsys.readouterr().err
    assert app.state.service.store.sessions() == []  # all of the exchange or none of it


# -- issue 19: fitting a long history costs time linear in its length ------------------------------
def chat_of(turns: int, words: int = 3) -> list[dict]:
    history = []
    for i in range(turns):
        history += [{"role": "user", "text": " ".join(f"w{3 + (i + j) % 90}" for j in range(words))},
                    {"role": "assistant", "text": " ".join(f"w{3 + (i * 3 + j) % 90}" for j in range(words))}]
    return history + [{"role": "user", "text": "w40 w41"}]


def test_fitting_a_long_history_is_linear_and_a_hopeless_one_is_refused_at_once(service):
    for turns in (500, 1500):  # 1001 and 3001 messages, as in the issue
        t0 = time.perf_counter()
        prompt, kept, dropped = service.fit("w4", chat_of(turns), 16)
        elapsed = time.perf_counter() - t0
        assert len(prompt) + 16 <= service.engine.target.max_context and kept[-1]["text"] == "w40 w41"
        assert dropped > turns - 100 and elapsed < 1.5, (turns, elapsed)
    huge = chat_of(1500)[:-1] + [{"role": "user", "text": " ".join(["w5"] * 600)}]
    t0 = time.perf_counter()
    with pytest.raises(ContextTooLong, match="too long"):
        service.fit("", huge, 16)
    assert time.perf_counter() - t0 < 0.5


def test_fitting_keeps_as_many_turns_as_the_exact_search(service):
    """Counting is checked against the slow, exact way (render every candidate prompt)."""
    limit = service.engine.target.max_context
    for turns, words, need in ((40, 3, 16), (30, 9, 100), (60, 5, 300), (5, 2, 8)):
        history = chat_of(turns, words)
        starts = [0] + [i for i, m in enumerate(history) if m["role"] == "user" and i > 0]
        exact = next(k for k, start in enumerate(starts)
                     if len(service.prompt_ids("w4", history[start:])) + need <= limit)
        prompt, kept, dropped = service.fit("w4", history, need)
        assert dropped in (exact, exact + 1) and kept == history[starts[dropped]:], (turns, exact, dropped)
        assert prompt == service.prompt_ids("w4", kept) and len(prompt) + need <= limit


# -- issue 19: smaller things ---------------------------------------------------------------------
def test_an_empty_database_file_is_taken_as_new_and_said(engine, tmp_path, capsys):
    path = tmp_path / "empty.db"
    path.write_bytes(b"")
    app = create_app(engine, path, model_name="tiny")
    assert "was empty (0 bytes); it is used as a new chat database" in capsys.readouterr().err
    store = app.state.service.store
    sid = store.create_session("works")
    assert store.session(sid)["title"] == "works" and store.notes[0].startswith("note: ")
    store.close()
    assert Store(path).notes == []  # a file with content is simply opened


def test_a_refused_database_keeps_no_wal_or_shm_beside_it(tmp_path):
    good = tmp_path / "good.db"
    Store(good).close()
    for name, damage in (("wal-header.db", lambda b: b[:100] + os.urandom(len(b) - 100)),
                         ("half.db", lambda b: b[: len(b) // 2])):
        path = tmp_path / name
        path.write_bytes(damage(good.read_bytes()))
        before = path.read_bytes()
        with pytest.raises(StoreError, match="left untouched"):
            Store(path)
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(name)) == [name]
        assert path.read_bytes() == before
    # A -wal that was there already (another program's) is never touched.
    locked = tmp_path / "locked.db"
    Store(locked).close()
    other = sqlite3.connect(locked, isolation_level=None)
    other.execute("PRAGMA journal_mode=WAL")
    other.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(StoreError, match="locked"):
            Store(locked, timeout=0.2)
        assert Path(f"{locked}-wal").exists()
    finally:
        other.execute("ROLLBACK")
        other.close()


def test_exports_leave_no_temporary_folders_behind(engine, tmp_path):
    import tempfile

    def export_folders() -> set[str]:
        return {p.name for p in Path(tempfile.gettempdir()).glob("gumiho-export-*")}

    before = export_folders()
    with TestClient(create_app(engine, tmp_path / "e.db", model_name="tiny")) as client:
        service = client.app.state.service
        sid = service.store.create_session("export me")
        service.store.add_message(sid, "user", "w5")
        paths = [Path(handlers.export(service, sid, kind)) for kind in ("json", "md") * 10]
        assert all(p.name in ("export-me.json", "export-me.md") for p in paths) and paths[-1].exists()
        assert len(export_folders() - before) == 1  # one folder for the app ...
        assert len(list(service.exports.root.iterdir())) <= service.exports.keep  # ... holding the newest few
    assert export_folders() == before  # and gone when the app stops


def test_sessions_say_where_they_came_from_and_api_storage_is_a_setting(engine, tmp_path, monkeypatch):
    body = {"messages": [{"role": "user", "content": "w5"}], "max_tokens": 3}
    app = create_app(engine, tmp_path / "s.db", model_name="tiny")
    service = app.state.service
    send(service, handlers.new_state(), "w6 from the ui")
    assert TestClient(app).post("/v1/chat/completions", json=body).status_code == 200
    handlers.chat_api(service, "w7 from gradio_client", max_new_tokens=3)
    assert sorted(s["source"] for s in service.store.sessions()) == ["/chat", "openai", "ui"]
    labels = [label for label, _ in handlers.session_choices(service)]
    assert sum("via openai" in x for x in labels) == 1 and sum("via /chat" in x for x in labels) == 1
    assert any(x.startswith("w6 from the ui") and "via" not in x for x in labels)
    for off in (create_app(engine, tmp_path / "off.db", model_name="tiny", store_api=False),
                monkeypatch.setenv("GUMIHO_STORE_API", "0") or create_app(engine, tmp_path / "env.db", model_name="t")):
        assert TestClient(off).post("/v1/chat/completions", json=body).status_code == 200
        handlers.chat_api(off.state.service, "w7", max_new_tokens=3)
        assert off.state.service.store.sessions() == []


def test_overflowing_numbers_on_gradio_routes_are_a_422_not_a_500(engine, tmp_path):
    client = TestClient(create_app(engine, tmp_path / "g.db", model_name="tiny"), raise_server_exceptions=False)
    for raw in (b'{"data": [], "fn_index": 1e400, "session_hash": "x"}',
                b'{"data": [], "fn_index": Infinity, "trigger_id": NaN, "session_hash": "x"}'):
        r = client.post("/gradio_api/queue/join", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"], r.text
        assert all(set(e) == {"loc", "msg", "type"} for e in r.json()["detail"])  # the input is not echoed back
