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

import atexit
import html
import json
import os
import re
import shutil
import sqlite3
import sys
import tempfile
import threading
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import sqlite_utils

from gumiho_core import GumihoError


class StoreError(GumihoError):
    """The chat database cannot be used (corrupt, locked, too new); one line, file untouched."""


class StoreWriteError(StoreError):
    """A write failed (disk full, database locked, read-only): nothing of it was stored.

    The message says what happened in words ("the database is full ..."), so a front end
    can add what was lost ("this answer was not saved") and show it as it is.
    """


# Below this much free space on the database's disk, starting the app warns: the next
# answers may not fit, and a user should hear that before typing, not after.
LOW_SPACE_BYTES = 32 * 1024 * 1024
SIDECARS = ("-wal", "-shm", "-journal")


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


def _v3(db: sqlite_utils.Database) -> None:
    # Answers to /chat and the OpenAI route are stored too; the sidebar says where each came from.
    db["sessions"].add_column("source", str, not_null_default="ui")


MIGRATIONS = [_v1, _v2, _v3]
SCHEMA_VERSION = len(MIGRATIONS)


class Store:
    """All reads and writes of the chat database. Safe to share between threads."""

    def __init__(self, path: str | Path, timeout: float = 5.0):
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.notes: list[str] = []  # what `serve` and the UI tell the user at startup
        present = {suffix for suffix in SIDECARS if Path(f"{self.path}{suffix}").exists()}
        try:
            self._open(timeout)
        except StoreError:
            # SQLite creates -wal / -shm beside a WAL-mode file it reads; a refused file
            # must be left exactly as it was found, so only the ones it did not have go.
            for suffix in set(SIDECARS) - present:
                Path(f"{self.path}{suffix}").unlink(missing_ok=True)
            raise
        self._check_space()

    def _open(self, timeout: float) -> None:
        # An existing file is checked read-only first: a corrupt one is reported, never rewritten.
        # An empty (0-byte) file is what SQLite itself calls a new database: used as one, and said.
        if self.path.exists() and self.path.stat().st_size == 0:
            self.notes.append(f"note: {self.path} was empty (0 bytes); it is used as a new chat database")
        elif self.path.exists():
            self._check_readable(timeout)
        # Gradio and uvicorn call us from worker threads; one connection guarded by a lock
        # is simpler than a pool and plenty for one local user.
        conn = None
        try:
            conn = sqlite3.connect(str(self.path), check_same_thread=False, timeout=timeout)
            self.db = sqlite_utils.Database(conn)
            self.lock = threading.RLock()
            # A write lock held elsewhere shows now, as a clear error, not at the first message.
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("ROLLBACK")
            self.db.execute("PRAGMA journal_mode=WAL")  # readers never wait for the writer; crash-safe
            self.db.execute("PRAGMA synchronous=FULL")  # a committed message survives a killed process
            self.db.execute("PRAGMA foreign_keys=ON")
            self.migrate()
        except sqlite3.DatabaseError as exc:  # OperationalError (locked, unreadable) is one kind of it
            if conn is not None:
                conn.close()
            if isinstance(exc, sqlite3.OperationalError):
                raise StoreError(self._explain(exc)) from None
            raise StoreError(f"{self.path} is not a usable chat database ({exc}); it was left untouched. "
                             "Move it away or pass --db another file.") from None

    def _check_space(self) -> None:
        free = shutil.disk_usage(self.path.parent).free
        if free < LOW_SPACE_BYTES:
            self.notes.append(f"warning: the disk holding {self.path} has only {free / 2**20:.1f} MB free: "
                              "new messages may not be saved")

    @contextmanager
    def writing(self):
        """One write transaction (nested ones are savepoints inside it).

        A failed write is rolled back whole and raised as a StoreWriteError that says what
        happened in words; callers never see a half-stored answer.
        """
        with self.lock:
            try:
                with self.db.atomic():
                    yield self.db
            except sqlite3.Error as exc:
                raise StoreWriteError(self._write_problem(exc)) from None

    def _write_problem(self, exc: sqlite3.Error) -> str:
        text = str(exc)
        if "full" in text:
            return f"the database is full (no space left on the disk holding {self.path})"
        if "locked" in text or "busy" in text:
            return f"the database is locked by another program ({self.path})"
        if "readonly" in text or "read-only" in text:
            return f"the database is read-only ({self.path})"
        return f"the database could not be written ({self.path}: {text})"

    def _explain(self, exc: Exception) -> str:
        if "locked" in str(exc) or "busy" in str(exc):
            return (f"{self.path} is locked by another program (another gumiho-chat?); it was left untouched. "
                    "Close that program or pass --db another file.")
        return f"cannot open the chat database {self.path}: {exc}"

    def _check_readable(self, timeout: float) -> None:
        uri = "file:" + self.path.resolve().as_posix().replace("?", "%3f").replace("#", "%23") + "?mode=ro"
        try:
            probe = sqlite3.connect(uri, uri=True, timeout=timeout)
        except sqlite3.Error as exc:
            raise StoreError(self._explain(exc)) from None
        try:
            probe.execute("SELECT count(*) FROM sqlite_master").fetchone()
            result = probe.execute("PRAGMA quick_check").fetchone()[0]
            if result != "ok":
                raise StoreError(f"{self.path} is damaged (integrity check: {result}); it was left untouched. "
                                 "Move it away or pass --db another file.")
        except sqlite3.OperationalError as exc:
            raise StoreError(self._explain(exc)) from None
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{self.path} is not a chat database ({exc}); it was left untouched. "
                             "Move it away or pass --db another file.") from None
        finally:
            probe.close()

    def close(self) -> None:
        self.db.conn.close()

    # -- schema -------------------------------------------------------------------------
    def version(self) -> int:
        return self.db.execute("PRAGMA user_version").fetchone()[0]

    def migrate(self) -> None:
        with self.lock:
            version = self.version()
            if version > SCHEMA_VERSION:
                raise StoreError(f"{self.path} was written by a newer gumiho-chat (schema {version})")
            for step in range(version, SCHEMA_VERSION):
                with self.db.atomic():  # each migration commits whole or not at all
                    MIGRATIONS[step](self.db)
                    # PRAGMA takes no parameters; `step + 1` is our own integer.
                    self.db.execute(f"PRAGMA user_version = {int(step + 1)}")

    # -- sessions -------------------------------------------------------------------------
    def create_session(self, title: str, model: str = "", heads: str = "", settings: dict | None = None,
                       source: str = "ui") -> int:
        """A new conversation; `source` says where it came from: "ui", "/chat" or "openai"."""
        with self.writing():
            row = {"title": title, "created": now(), "updated": now(), "model": model, "heads": heads,
                   "settings": json.dumps(settings or {}), "source": source}
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
        with self.writing():
            self.db["sessions"].update(session_id, {"title": title, "updated": now()})

    def update_session(self, session_id: int, **fields) -> None:
        if "settings" in fields:
            fields["settings"] = json.dumps(fields["settings"])
        with self.writing():
            self.db["sessions"].update(session_id, {**fields, "updated": now()})

    def delete_session(self, session_id: int) -> None:
        with self.writing():
            self.db.execute("DELETE FROM answer_stats WHERE session_id = ?", [session_id])
            self.db.execute("DELETE FROM messages WHERE session_id = ?", [session_id])
            self.db.execute("DELETE FROM sessions WHERE id = ?", [session_id])

    # -- messages -----------------------------------------------------------------------
    def add_message(self, session_id: int, role: str, text: str, steps: list | None = None,
                    speculative: bool | None = None, finish_reason: str | None = None) -> int:
        with self.writing():
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
        with self.writing():
            for message_id in message_ids:
                self.db.execute("DELETE FROM answer_stats WHERE message_id = ?", [message_id])
                self.db.execute("DELETE FROM messages WHERE id = ?", [message_id])

    # -- stats ----------------------------------------------------------------------------
    def add_stats(self, session_id: int, message_id: int | None, stats: dict, finish_reason: str,
                  model: str = "") -> int:
        """`stats` is GenerationStats.to_dict()."""
        with self.writing():
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
        # Raw HTML in a title or a message must stay text in whatever renders this file.
        title = html.escape(" ".join(session["title"].split()), quote=False)
        lines = [f"# {title}", "", f"*{session['created']} · model {html.escape(session['model'] or 'default')}*", ""]
        system = session["settings"].get("system")
        if system:
            lines += ["**System:** " + markdown_safe(system), ""]
        for m in self.messages(session_id):
            who = {"user": "User", "assistant": "Assistant"}.get(m["role"], m["role"])
            note = " *(stopped)*" if m["finish_reason"] in ("cancelled", "error") else ""
            lines += [f"### {html.escape(who)}{note}", "", markdown_safe(m["text"]), ""]
        return "\n".join(lines)


_INLINE_CODE = re.compile(r"(`+)(?:.+?)\1", re.S)


def markdown_safe(text: str) -> str:
    """Markdown with its raw HTML escaped: outside code spans and fenced blocks, & < > become
    entities (shown as typed by any renderer); code is left as written (it is never HTML there)."""
    out, fenced = [], False
    for line in text.split("\n"):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            out.append(line)
        elif fenced:
            out.append(line)
        else:
            parts, last = [], 0
            for m in _INLINE_CODE.finditer(line):
                parts.append(html.escape(line[last:m.start()], quote=False))
                parts.append(m.group(0))
                last = m.end()
            parts.append(html.escape(line[last:], quote=False))
            out.append("".join(parts))
    return "\n".join(out)


def safe_filename(title: str, limit: int = 40) -> str:
    """A file name from a session title: ASCII letters, digits and dashes only, never empty.

    "../../etc/x", "/abs/path", "C:\\x", NUL bytes and dot names cannot leave the folder.
    """
    name = re.sub(r"[^A-Za-z0-9]+", "-", title or "").strip("-")[:limit].strip("-")
    return name or "session"


def export_path(folder: str | Path, title: str, ext: str) -> Path:
    """Where an export of `title` goes: always a direct child of `folder`."""
    folder = Path(folder).resolve()
    path = (folder / f"{safe_filename(title)}.{re.sub(r'[^a-z]', '', ext) or 'txt'}").resolve()
    if path.parent != folder:  # cannot happen with safe_filename; checked anyway
        raise ValueError(f"export path {path} is outside {folder}")
    return path


class ExportFolder:
    """Where exports are written: one temporary folder per app, a fresh subfolder per export.

    Gradio copies a returned file into its own cache, so only the newest `keep` exports
    are kept here, and the folder goes when the app stops (or the process exits).
    """

    def __init__(self, keep: int = 8):
        self.keep = keep
        self.root: Path | None = None
        self._lock = threading.Lock()

    def new(self) -> Path:
        with self._lock:
            if self.root is None or not self.root.exists():
                self.root = Path(tempfile.mkdtemp(prefix="gumiho-export-"))
                atexit.register(shutil.rmtree, self.root, ignore_errors=True)
            folders = sorted(self.root.iterdir(), key=lambda p: p.stat().st_mtime)
            for old in folders[: max(0, len(folders) - self.keep + 1)]:
                shutil.rmtree(old, ignore_errors=True)
            return Path(tempfile.mkdtemp(dir=self.root))

    def remove(self) -> None:
        with self._lock:
            if self.root is not None:
                shutil.rmtree(self.root, ignore_errors=True)
                self.root = None
