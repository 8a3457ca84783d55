"""Chat sessions in one SQLite file, through sqlite-utils.

Three tables:
  sessions     - one row per conversation (title, model, heads, settings as JSON)
  messages     - the turns, in order; an answer keeps its token provenance as JSON so
                 the colours can be redrawn when a session is reopened
  answer_stats - one row per generation (a "compare" makes two), for the stats tab

The schema version lives in `PRAGMA user_version`; `MIGRATIONS[i]` takes a file from
version i to i+1, so an old file is upgraded in place when the app opens it.
All SQL takes its values as parameters; writes happen inside transactions.
"""
from __future__ import annotations

import json
import os
import sqlite3
import sys
import threading
from datetime import datetime, timezone
from pathlib import Path

import sqlite_utils


def default_db_path() -> Path:
    """A per-user data folder, as each OS expects it."""
    if sys.platform == "win32":
        base = Path(os.environ.get("APPDATA", Path.home() / "AppData" / "Roaming"))
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Application Support"
    else:
        base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return base / "gumiho-chat" / "chat.db"


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _v1(db: sqlite_utils.Database) -> None:
    db["sessions"].create(
        {"id": int, "title": str, "created": str, "updated": str, "model": str, "heads": str, "settings": str},
        pk="id",
    )
    db["messages"].create(
        {
            "id": int, "session_id": int, "position": int, "role": str, "text": str,
            "steps": str,  # JSON: [{"tokens": [[text, origin, depth], ...], "rejected": [text, ...]}]
            "speculative": int, "finish_reason": str, "created": str,
        },
        pk="id",
        foreign_keys=[("session_id", "sessions", "id")],
    )
    db["messages"].create_index(["session_id", "position"])
    db["answer_stats"].create(
        {
            "id": int, "session_id": int, "message_id": int, "speculative": int, "new_tokens": int,
            "forward_passes": int, "tau": float, "tokens_per_s": float, "ttft_s": float,
            "acceptance": str, "tree": str, "finish_reason": str, "created": str,
        },
        pk="id",
        foreign_keys=[("session_id", "sessions", "id"), ("message_id", "messages", "id")],
    )


def _v2(db: sqlite_utils.Database) -> None:
    # The stats tab compares models, so each stats row says which model produced it.
    db["answer_stats"].add_column("model", str)


MIGRATIONS = [_v1, _v2]
SCHEMA_VERSION = len(MIGRATIONS)


class Store:
    """All reads and writes of the chat database. Safe to share between threads."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Gradio and uvicorn call us from worker threads; one connection guarded by a lock
        # is simpler than a pool and plenty for one local user.
        conn = sqlite3.connect(str(self.path), check_same_thread=False)
        self.db = sqlite_utils.Database(conn)
        self.lock = threading.RLock()
        self.db.execute("PRAGMA journal_mode=WAL")  # readers never wait for the writer
        self.db.execute("PRAGMA foreign_keys=ON")
        self.migrate()

    def close(self) -> None:
        self.db.conn.close()

    # -- schema -------------------------------------------------------------------------
    def version(self) -> int:
        return self.db.execute("PRAGMA user_version").fetchone()[0]

    def migrate(self) -> None:
        with self.lock:
            version = self.version()
            if version > SCHEMA_VERSION:
                raise RuntimeError(f"{self.path} was written by a newer gumiho-chat (schema {version})")
            for step in range(version, SCHEMA_VERSION):
                with self.db.atomic():  # each migration commits whole or not at all
                    MIGRATIONS[step](self.db)
                    # PRAGMA takes no parameters; `step + 1` is our own integer.
                    self.db.execute(f"PRAGMA user_version = {int(step + 1)}")

    # -- sessions -------------------------------------------------------------------------
    def create_session(self, title: str, model: str = "", heads: str = "", settings: dict | None = None) -> int:
        with self.lock, self.db.atomic():
            row = {"title": title, "created": now(), "updated": now(), "model": model, "heads": heads,
                   "settings": json.dumps(settings or {})}
            return self.db["sessions"].insert(row).last_pk

    def sessions(self) -> list[dict]:
        """Newest first."""
        with self.lock:
            return list(self.db.query("SELECT * FROM sessions ORDER BY updated DESC, id DESC"))

    def session(self, session_id: int) -> dict | None:
        with self.lock:
            rows = list(self.db.query("SELECT * FROM sessions WHERE id = ?", [session_id]))
        if not rows:
            return None
        row = rows[0]
        row["settings"] = json.loads(row["settings"] or "{}")
        return row

    def rename_session(self, session_id: int, title: str) -> None:
        with self.lock, self.db.atomic():
            self.db["sessions"].update(session_id, {"title": title, "updated": now()})

    def update_session(self, session_id: int, **fields) -> None:
        if "settings" in fields:
            fields["settings"] = json.dumps(fields["settings"])
        with self.lock, self.db.atomic():
            self.db["sessions"].update(session_id, {**fields, "updated": now()})

    def delete_session(self, session_id: int) -> None:
        with self.lock, self.db.atomic():
            self.db.execute("DELETE FROM answer_stats WHERE session_id = ?", [session_id])
            self.db.execute("DELETE FROM messages WHERE session_id = ?", [session_id])
            self.db.execute("DELETE FROM sessions WHERE id = ?", [session_id])

    # -- messages -----------------------------------------------------------------------
    def add_message(self, session_id: int, role: str, text: str, steps: list | None = None,
                    speculative: bool | None = None, finish_reason: str | None = None) -> int:
        with self.lock, self.db.atomic():
            position = self.db.execute(
                "SELECT COALESCE(MAX(position), -1) + 1 FROM messages WHERE session_id = ?", [session_id]
            ).fetchone()[0]
            row = {"session_id": session_id, "position": position, "role": role, "text": text,
                   "steps": json.dumps(steps or []), "speculative": None if speculative is None else int(speculative),
                   "finish_reason": finish_reason, "created": now()}
            message_id = self.db["messages"].insert(row).last_pk
            self.db.execute("UPDATE sessions SET updated = ? WHERE id = ?", [now(), session_id])
            return message_id

    def messages(self, session_id: int) -> list[dict]:
        with self.lock:
            rows = list(self.db.query(
                "SELECT * FROM messages WHERE session_id = ? ORDER BY position", [session_id]
            ))
        for row in rows:
            row["steps"] = json.loads(row["steps"] or "[]")
        return rows

    def delete_messages(self, message_ids: list[int]) -> None:
        """Drop turns (edit / regenerate replace them) with their stats."""
        with self.lock, self.db.atomic():
            for message_id in message_ids:
                self.db.execute("DELETE FROM answer_stats WHERE message_id = ?", [message_id])
                self.db.execute("DELETE FROM messages WHERE id = ?", [message_id])

    # -- stats ----------------------------------------------------------------------------
    def add_stats(self, session_id: int, message_id: int | None, stats: dict, finish_reason: str,
                  model: str = "") -> int:
        """`stats` is GenerationStats.to_dict()."""
        with self.lock, self.db.atomic():
            row = {
                "session_id": session_id, "message_id": message_id, "speculative": int(stats["speculative"]),
                "new_tokens": stats["new_tokens"], "forward_passes": stats["forward_passes"],
                "tau": stats["tau"], "tokens_per_s": stats["tokens_per_s"], "ttft_s": stats["ttft_s"],
                "acceptance": json.dumps(stats.get("acceptance_per_depth", [])),
                "tree": json.dumps(stats.get("tree", {})), "finish_reason": finish_reason,
                "created": now(), "model": model,
            }
            return self.db["answer_stats"].insert(row).last_pk

    def stats(self, session_id: int | None = None) -> list[dict]:
        """Oldest first, for plotting over time."""
        with self.lock:
            if session_id is None:
                rows = self.db.query("SELECT * FROM answer_stats ORDER BY id")
            else:
                rows = self.db.query("SELECT * FROM answer_stats WHERE session_id = ? ORDER BY id", [session_id])
            rows = list(rows)
        for row in rows:
            row["acceptance"] = json.loads(row["acceptance"] or "[]")
            row["tree"] = json.loads(row["tree"] or "{}")
        return rows

    # -- export -------------------------------------------------------------------------------
    def export_json(self, session_id: int) -> str:
        session = self.session(session_id)
        if session is None:
            raise KeyError(session_id)
        return json.dumps(
            {"session": session, "messages": self.messages(session_id), "stats": self.stats(session_id)},
            indent=2, ensure_ascii=False,
        )

    def export_markdown(self, session_id: int) -> str:
        session = self.session(session_id)
        if session is None:
            raise KeyError(session_id)
        lines = [f"# {session['title']}", "", f"*{session['created']} · model {session['model'] or 'default'}*", ""]
        system = session["settings"].get("system")
        if system:
            lines += ["**System:** " + system, ""]
        for m in self.messages(session_id):
            who = {"user": "User", "assistant": "Assistant"}.get(m["role"], m["role"])
            note = " *(stopped)*" if m["finish_reason"] in ("cancelled", "error") else ""
            lines += [f"### {who}{note}", "", m["text"], ""]
        return "\n".join(lines)
