"""The SQLite layer against a real file: create, reopen, partial answers, export, migration."""
import json
import sqlite3

import pytest
import sqlite_utils

from app.store import SCHEMA_VERSION, Store, StoreWriteError, _v1

STATS = {"speculative": True, "new_tokens": 5, "forward_passes": 3, "tau": 5 / 3, "tokens_per_s": 12.5,
         "ttft_s": 0.1, "acceptance_per_depth": [0.8, 0.5], "tree": {"top_k": 4}}
STEPS = [{"tokens": [["Hi", "target", 0]], "rejected": []},
         {"tokens": [[" there", "serial", 1], ["!", "target", 0]], "rejected": ["?"]}]


def test_create_and_reopen(tmp_path):
    path = tmp_path / "chat.db"
    store = Store(path)
    sid = store.create_session("First chat", model="default", heads="shipped", settings={"system": "Be brief."})
    store.add_message(sid, "user", "hello")
    mid = store.add_message(sid, "assistant", "Hi there!", steps=STEPS, speculative=True, finish_reason="eos")
    store.add_stats(sid, mid, STATS, "eos", model="default")
    store.close()

    again = Store(path)
    assert again.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert again.version() == SCHEMA_VERSION
    [session] = again.sessions()
    assert session["title"] == "First chat" and session["heads"] == "shipped"
    assert again.session(sid)["settings"] == {"system": "Be brief."}
    user, answer = again.messages(sid)
    assert (user["role"], user["text"]) == ("user", "hello")
    assert answer["steps"] == STEPS  # enough to redraw the colours
    [stats] = again.stats(sid)
    assert stats["acceptance"] == [0.8, 0.5] and stats["speculative"] == 1 and stats["model"] == "default"


def test_stopped_answer_is_kept(tmp_path):
    store = Store(tmp_path / "chat.db")
    sid = store.create_session("stopped")
    store.add_message(sid, "user", "count to 100")
    store.add_message(sid, "assistant", "1, 2, 3", steps=STEPS[:1], speculative=True, finish_reason="cancelled")
    store.close()
    [_, answer] = Store(tmp_path / "chat.db").messages(sid)
    assert answer["text"] == "1, 2, 3" and answer["finish_reason"] == "cancelled"


def test_rename_delete_and_parameters(tmp_path):
    store = Store(tmp_path / "chat.db")
    sid = store.create_session("a")
    other = store.create_session("b")
    store.rename_session(sid, "Robert'); DROP TABLE sessions;--")  # a title, not SQL
    assert store.session(sid)["title"] == "Robert'); DROP TABLE sessions;--"
    mid = store.add_message(sid, "assistant", "x", steps=STEPS)
    store.add_stats(sid, mid, STATS, "eos")
    store.delete_session(sid)
    assert [s["id"] for s in store.sessions()] == [other]
    assert store.messages(sid) == [] and store.stats(sid) == []


def test_export_json_and_markdown(tmp_path):
    store = Store(tmp_path / "chat.db")
    sid = store.create_session("Export me", settings={"system": "You are terse."})
    store.add_message(sid, "user", "What is 2+2?")
    mid = store.add_message(sid, "assistant", "**4**", steps=STEPS, speculative=True, finish_reason="eos")
    store.add_stats(sid, mid, STATS, "eos")
    data = json.loads(store.export_json(sid))
    assert data["session"]["title"] == "Export me"
    assert [m["text"] for m in data["messages"]] == ["What is 2+2?", "**4**"]
    assert data["stats"][0]["tau"] == STATS["tau"]
    md = store.export_markdown(sid)
    assert md.startswith("# Export me") and "### User" in md and "**4**" in md and "You are terse." in md


def test_old_schema_is_migrated(tmp_path):
    path = tmp_path / "old.db"
    db = sqlite_utils.Database(sqlite3.connect(path))
    _v1(db)
    db["sessions"].insert({"title": "from before", "created": "2026", "updated": "2026", "settings": "{}"})
    db.execute("PRAGMA user_version = 1")
    db.conn.commit()
    db.conn.close()
    store = Store(path)
    assert store.version() == SCHEMA_VERSION
    assert "model" in store.db["answer_stats"].columns_dict
    [old] = store.sessions()
    assert old["source"] == "ui"  # sessions from before sources were recorded all came from the UI


def test_a_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    store = Store(tmp_path / "chat.db")
    sid = store.create_session("t")
    mid = store.add_message(sid, "assistant", "x")
    store.add_stats(sid, mid, STATS, "eos")
    real = store.db.execute

    def fail_on_messages(sql, *args):
        if sql.startswith("DELETE FROM messages"):
            raise sqlite3.OperationalError("disk I/O error")
        return real(sql, *args)

    monkeypatch.setattr(store.db, "execute", fail_on_messages)
    with pytest.raises(StoreWriteError, match="could not be written"):
        store.delete_session(sid)
    monkeypatch.undo()
    assert len(store.stats(sid)) == 1 and len(store.messages(sid)) == 1  # the stats delete was rolled back
