"""What the UI's buttons do: plain functions of the chat service, one per event.

A handler takes the `ChatService` first (those that need it), then the values of its
input components in the order app/ui.py lists them, and returns (or, while an answer
streams, yields) the new values of its output components; `gr.skip()` leaves one as it
is. ui.py binds the service in and wires them; tests call them directly with a service.

Per-browser state is {"session_id": int | None, "messages": [...]}; every message that is
in the database carries its row "id".
"""
from __future__ import annotations

import functools
import threading
from dataclasses import replace

import gradio as gr

from gumiho_core import GenerationSettings, GumihoError

from . import render
from .chat import Answer, ChatService, Options, clean_text
from .store import StoreError, StoreWriteError, export_path

# Stop buttons find the running generation by the browser session's hash.
_cancels: dict[str, threading.Event] = {}


def new_state() -> dict:
    return {"session_id": None, "messages": []}


# -- helpers the handlers share -------------------------------------------------------------------
def session_choices(service: ChatService) -> list[tuple[str, int]]:
    if service.store is None:
        return []
    return [(f"{s['title']}  ·  {s['created'][:16].replace('T', ' ')}"
             + ("" if s.get("source", "ui") == "ui" else f"  ·  via {s['source']}"), s["id"])
            for s in service.store.sessions()]


def in_words(handler):
    """A handler whose database failure (full, locked) is a message in words, not Gradio's bare "Error"."""
    @functools.wraps(handler)
    def wrapped(*args, **kwargs):
        try:
            return handler(*args, **kwargs)
        except StoreError as exc:
            raise gr.Error(f"{exc}: nothing was changed.") from None

    return wrapped


def draw(st: dict, view_name, rej, messages: list[dict] | None = None) -> str:
    """The chat of this state (or `messages`, e.g. with the answer still growing), carrying its
    session id, which assets/app.js writes into the page address (/?session=ID)."""
    session = "" if st["session_id"] is None else str(st["session_id"])
    return render.chat_html(st["messages"] if messages is None else messages, view_name, rej, session=session)


def legend(service: ChatService) -> str:
    """The colour legend for the tree and heads answers use now (after a model load too)."""
    heads = service.engine.heads
    serial_depth = heads.config.serial_depth if heads is not None else 2
    return render.legend_html(service.tree, serial_depth=serial_depth, has_heads=heads is not None)


def sessions_update(service: ChatService, selected) -> dict:
    return gr.update(choices=session_choices(service), value=selected)


def load_messages(service: ChatService, session_id: int) -> list[dict]:
    """A stored session as UI messages, each answer with the stats of its (last) run."""
    stats_by_message = {}
    for row in service.store.stats(session_id):
        stats_by_message[row["message_id"]] = {
            **row, "acceptance_per_depth": row["acceptance"], "speculative": bool(row["speculative"]),
        }
    return [{"id": m["id"], "role": m["role"], "text": m["text"], "steps": m["steps"],
             "finish_reason": m["finish_reason"], "stats": stats_by_message.get(m["id"])}
            for m in service.store.messages(session_id)]


def read_options(service: ChatService, spec_on, system_text, temp, p, n) -> tuple[Options, GenerationSettings]:
    """The panel's values as Options and the engine's settings; GumihoError for a bad value."""
    opts = Options(system=clean_text(system_text), speculative=bool(spec_on), temperature=temp, top_p=p,
                   max_new_tokens=n)
    settings = service.settings(opts)
    # The session row keeps the numbers the engine got, not the form's raw values.
    return replace(opts, temperature=settings.sampling.temperature, top_p=settings.sampling.top_p,
                   max_new_tokens=settings.max_new_tokens), settings


def settings_problem(exc: GumihoError) -> str:
    return f"**Settings: {render.esc(str(exc))}**"


def auto_title(text: str) -> str:
    """A new session's title: the start of its first message."""
    return " ".join(text.split())[:48] or "New chat"


def ensure_session(service: ChatService, st: dict, title: str, opts: Options) -> None:
    if service.store is None:
        return
    if st["session_id"] is None:
        st["session_id"] = service.store.create_session(
            auto_title(title), model=service.model_name, heads=service.heads_note, settings=opts.__dict__,
        )
    elif st.pop("retitle", False):  # the first message was edited: the title follows it
        service.store.update_session(st["session_id"], settings=opts.__dict__, title=auto_title(title))
    else:
        service.store.update_session(st["session_id"], settings=opts.__dict__)


def add_user(service: ChatService, st: dict, text: str) -> None:
    mid = service.store.add_message(st["session_id"], "user", text) if service.store else None
    st["messages"].append({"id": mid, "role": "user", "text": text})


def drop_last_answer(service: ChatService, st: dict) -> None:
    """Take the last message out (and out of the database) if it is an answer."""
    if st["messages"] and st["messages"][-1]["role"] == "assistant":
        if service.store and st["messages"][-1].get("id"):  # first: if the database refuses, the chat stays
            service.store.delete_messages([st["messages"][-1]["id"]])
        st["messages"].pop()


def keep_answer(service: ChatService, st: dict, answer: Answer, speculative: bool) -> str:
    """Add a finished (or partial) answer to the chat and, in a session, to the database.

    Returns "" or, when the database refused it, what happened in words; the answer is
    then still shown, marked "not saved", never as if it were kept.
    """
    message = answer.as_message()
    problem = ""
    if service.store is not None and st["session_id"] is not None:
        try:
            message["id"] = service.save_answer(st["session_id"], answer, speculative)
        except StoreWriteError as exc:
            problem, message["unsaved"] = f"{exc}: this answer was not saved.", True
    st["messages"].append(message)
    return problem


def not_stored(exc: StoreError) -> str:
    """The status line when the user's message could not be stored (it stays in the box)."""
    return f"**{render.esc(str(exc))}: your message was not sent; it is still in the box.**"


def stream_answer(service: ChatService, st: dict, opts: Options, settings: GenerationSettings, view_name, rej,
                  request: gr.Request | None):
    """Yield outputs while the answer grows; save it (complete or partial) at the end."""
    key = request.session_hash if request else "default"
    cancel = _cancels[key] = threading.Event()
    answer = Answer()
    problem = ""
    try:
        for answer in service.stream(st["messages"], opts, cancel=cancel, settings=settings):
            # The input box is left alone (gr.skip()): what the user types while an
            # answer streams is theirs, and a Send pressed meanwhile runs next with it.
            if answer.waiting:
                yield gr.skip(), st, gr.skip(), f"*waiting: {answer.waiting} ahead…*", gr.skip()
                continue
            shown = st["messages"] + [answer.as_message()]
            note = f"*generating…* {render.esc(answer.notice)}".strip()
            yield draw(st, view_name, rej, shown), st, gr.skip(), note, gr.skip()
    finally:
        # Also reached when the browser goes away mid-answer: the partial text is kept, as Stop keeps it.
        _cancels.pop(key, None)
        if not answer.done and answer.steps:
            answer.finish_reason = "cancelled"
        if answer.steps or answer.error:
            problem = keep_answer(service, st, answer, settings.speculative)
    note = f"**{render.esc(answer.error)}**" if answer.error else ""
    if answer.error and answer.steps and not problem:
        note += " The partial answer was saved."
    if problem:
        note = f"{note} **{render.esc(problem)}**".strip()
    if answer.notice:
        note = f"{note} {render.esc(answer.notice)}".strip()
    yield (draw(st, view_name, rej), st, gr.skip(), note,
           sessions_update(service, st["session_id"]))


# -- the Chat tab ---------------------------------------------------------------------------------
# send and regenerate output (chat, state, message box, status, sessions list).
def send(service: ChatService, text, st, spec_on, system_text, temp, p, n, view_name, rej,
         request: gr.Request | None):
    text = clean_text(text).strip()
    if not text:
        yield gr.skip(), st, "", "Type a message first: an empty message is not sent.", gr.skip()
        return
    try:
        opts, settings = read_options(service, spec_on, system_text, temp, p, n)
    except GumihoError as exc:  # nothing stored; the message stays in the box
        yield gr.skip(), st, gr.skip(), settings_problem(exc), gr.skip()
        return
    try:
        ensure_session(service, st, text, opts)
        add_user(service, st, text)
    except StoreError as exc:  # disk full, database locked: nothing is sent, the text stays in the box
        yield gr.skip(), st, gr.skip(), not_stored(exc), gr.skip()
        return
    # The message is taken: empty the box once, now, and show it in the chat.
    yield draw(st, view_name, rej), st, "", "*generating…*", gr.skip()
    yield from stream_answer(service, st, opts, settings, view_name, rej, request)


def regenerate(service: ChatService, text, st, spec_on, system_text, temp, p, n, view_name, rej,
               request: gr.Request | None):
    if not st["messages"]:
        yield gr.skip(), st, gr.skip(), "Nothing to regenerate.", gr.skip()
        return
    try:
        opts, settings = read_options(service, spec_on, system_text, temp, p, n)
    except GumihoError as exc:
        yield gr.skip(), st, gr.skip(), settings_problem(exc), gr.skip()
        return
    try:
        drop_last_answer(service, st)
        ensure_session(service, st, st["messages"][-1]["text"], opts)
    except StoreError as exc:
        yield gr.skip(), st, gr.skip(), f"**{render.esc(str(exc))}: nothing was regenerated.**", gr.skip()
        return
    yield from stream_answer(service, st, opts, settings, view_name, rej, request)


def stop(request: gr.Request | None):
    event = _cancels.get(request.session_hash if request else "default")
    if event:
        event.set()
    return "*stopping…*"


@in_words
def edit_last(service: ChatService, st, view_name, rej):
    """Take the last user message (and its answer) out, back into the input box."""
    users = [i for i, m in enumerate(st["messages"]) if m["role"] == "user"]
    if not users:
        return gr.skip(), st, gr.skip(), "No message to edit."
    cut = users[-1]
    removed = st["messages"][cut:]
    if service.store:  # first: if the database refuses, the chat stays as it is
        service.store.delete_messages([m["id"] for m in removed if m.get("id")])
        row = service.store.session(st["session_id"]) if st["session_id"] is not None else None
        # Editing the first message of a session still titled after it: the next Send retitles it.
        first = removed[0]["text"]
        st["retitle"] = cut == 0 and row is not None and row["title"] in (auto_title(first), first[:48])
    st["messages"] = st["messages"][:cut]
    return (draw(st, view_name, rej), st, removed[0]["text"],
            "Edit the message and press Send.")


def clear(view_name, rej):
    """A fresh chat: (chat, state, message box, status, sessions list, compare box)."""
    return draw(new_state(), view_name, rej), new_state(), "", "", gr.update(value=None), ""


def redraw(st, view_name, rej):
    return draw(st, view_name, rej)


def compare(service: ChatService, text, st, system_text, n, view_name, rej):
    """The message (or the last one again) answered plain, then with Gumiho, greedy both times."""
    text = clean_text(text).strip()
    try:
        opts, _ = read_options(service, True, system_text, 0.0, 1.0, n)
    except GumihoError as exc:
        yield gr.skip(), st, gr.skip(), settings_problem(exc), gr.skip(), ""
        return
    if not service.has_heads:
        yield gr.skip(), st, gr.skip(), "**Compare needs draft heads.**", gr.skip(), ""
        return
    try:
        if text:
            ensure_session(service, st, text, opts)
            add_user(service, st, text)
        else:
            drop_last_answer(service, st)
    except StoreError as exc:
        yield gr.skip(), st, gr.skip(), not_stored(exc), gr.skip(), ""
        return
    if not st["messages"]:
        yield gr.skip(), st, gr.skip(), "Type a prompt to compare.", gr.skip(), ""
        return
    yield draw(st, view_name, rej), st, "", "*comparing: plain, then Gumiho…*", gr.skip(), ""
    for plain, gumiho in service.compare_stream(st["messages"], opts):
        phase = "plain decoding" if not plain.done else "Gumiho"
        yield gr.skip(), st, gr.skip(), f"*comparing: {phase}…*", gr.skip(), render.compare_html(plain, gumiho)
    problem = keep_answer(service, st, gumiho, True)
    if st["session_id"] is not None and service.store is not None and plain.stats and not problem:
        try:
            service.store.add_stats(st["session_id"], None, plain.stats, plain.finish_reason or "",
                                    model=service.model_name)
        except StoreWriteError as exc:
            problem = f"{exc}: the plain run's stats were not saved."
    yield (draw(st, view_name, rej), st, "", f"**{render.esc(problem)}**" if problem else "",
           sessions_update(service, st["session_id"]), render.compare_html(plain, gumiho))


def load_model(service: ChatService, path, heads):
    """The Model accordion: (model note, speculative checkbox, legend, max new tokens slider)."""
    try:
        service.load_model(path, heads)
    except GumihoError as exc:  # not a model, unreadable, mismatched: the old model stays
        return f"**error:** {render.esc(str(exc))}", gr.skip(), gr.skip(), gr.skip()
    return (model_note(service), gr.update(value=service.has_heads), legend(service),
            gr.update(maximum=service.max_new_tokens_limit))


def model_note(service: ChatService) -> str:
    heads = service.heads_note or ("none" if not service.has_heads else "loaded")
    return f"Model: **{render.esc(service.model_name)}** · heads: **{render.esc(heads)}**"


# -- the sessions sidebar -------------------------------------------------------------------------
def list_sessions(service: ChatService):
    return gr.update(choices=session_choices(service))


def open_session(service: ChatService, session_id, view_name, rej):
    """(chat, state, status, system prompt, Delete button) of a stored session; the new state
    forgets a Delete that was waiting for its confirmation, so the button says Delete again."""
    if session_id is None or service.store is None:
        return gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip()
    row = service.store.session(int(session_id))
    if row is None:
        return gr.skip(), gr.skip(), "Session not found.", gr.skip(), gr.skip()
    st = {"session_id": row["id"], "messages": load_messages(service, row["id"])}
    system_text = row["settings"].get("system", gr.skip())
    return draw(st, view_name, rej), st, "", system_text, gr.update(value="Delete")


def open_address(service: ChatService, view_name, rej, request: gr.Request | None):
    """Page load: (sessions list, chat, state, status, system prompt), with the session the
    address names (/?session=ID) open, so a reload or a bookmark comes back to it."""
    wanted = (request.query_params.get("session") if request is not None else None) or ""
    if not wanted or service.store is None:
        return list_sessions(service), gr.skip(), gr.skip(), gr.skip(), gr.skip()
    row = service.store.session(int(wanted)) if wanted.isdigit() else None
    if row is None:  # deleted, or a mistyped address: a fresh chat (app.js clears the address)
        return (list_sessions(service), draw(new_state(), view_name, rej), new_state(),
                f"Session {render.esc(wanted[:20])} was not found: it may have been deleted.", gr.skip())
    log, st, status, system_text, _ = open_session(service, row["id"], view_name, rej)
    return sessions_update(service, row["id"]), log, st, status, system_text


@in_words
def rename(service: ChatService, session_id, title, st):
    title = clean_text(title).replace("\n", " ").replace("\t", " ").strip()
    if session_id is None or not title:
        return gr.skip(), "Pick a session and type a title."
    service.store.rename_session(int(session_id), title[:200])
    return sessions_update(service, session_id), "Renamed."


@in_words
def delete(service: ChatService, session_id, st, view_name, rej):
    """(sessions list, state, chat, status, Delete button). The first press asks; the second,
    on the same session, deletes it with its messages (nothing can bring it back)."""
    if session_id is None:
        return gr.skip(), st, gr.skip(), "Pick a session to delete.", gr.skip()
    row = service.store.session(int(session_id))
    if row is None:
        return sessions_update(service, st["session_id"]), st, gr.skip(), "Session not found.", gr.skip()
    if st.get("confirm_delete") != row["id"]:
        st["confirm_delete"] = row["id"]
        return (gr.skip(), st, gr.skip(), f"Delete “{render.esc(row['title'])}” and its messages? "
                "Press **Confirm delete** to delete it; it cannot be undone.", gr.update(value="Confirm delete"))
    service.store.delete_session(row["id"])
    st.pop("confirm_delete", None)
    if st["session_id"] == row["id"]:
        st = new_state()
    return (sessions_update(service, st["session_id"]), st, draw(st, view_name, rej), "Deleted.",
            gr.update(value="Delete"))


def export(service: ChatService, session_id, kind: str) -> str | None:
    """The session as a JSON or Markdown file in a fresh folder; its path, for gr.File."""
    if session_id is None:
        return None
    row = service.store.session(int(session_id))
    if row is None:
        return None
    text = service.store.export_json(row["id"]) if kind == "json" else service.store.export_markdown(row["id"])
    path = export_path(service.exports.new(), row["title"], "json" if kind == "json" else "md")
    path.write_text(text, encoding="utf-8")
    return str(path)


# -- the Stats tab --------------------------------------------------------------------------------
def stats_outputs(service: ChatService):
    """(summary, speed plot, tau plot, table): one frame of every stored answer feeds all three."""
    import pandas as pd

    rows = stats_rows(service)
    columns = ["n", "mode", "tokens_per_s", "tau", "looked_up_%", "heads_%", "target_%", "session", "prompt",
               "ttft_ms", "new_tokens", "forward_passes", "model", "when"]
    frame = pd.DataFrame(rows, columns=columns)
    return speed_summary(rows), frame, frame, frame


def stats_rows(service: ChatService) -> list[dict]:
    """One row per stored answer: its numbers, the share of its tokens from each source, and the
    session and prompt it answered (so an outlier, say a question asked twice, explains itself)."""
    if service.store is None:
        return []
    titles = {s["id"]: s["title"] for s in service.store.sessions()}
    messages: dict[int, list[dict]] = {}  # per session, loaded once
    rows = []
    for i, r in enumerate(service.store.stats()):
        if r["session_id"] not in messages:
            messages[r["session_id"]] = service.store.messages(r["session_id"])
        chat = messages[r["session_id"]]
        at = next((k for k, m in enumerate(chat) if m["id"] == r["message_id"]), len(chat))
        prompt = next((m["text"] for m in reversed(chat[:at]) if m["role"] == "user"), "")
        counts = render.token_sources(chat[at]["steps"] if at < len(chat) else [])
        total = sum(counts.values()) or 1
        rows.append({
            "n": i + 1, "mode": "Gumiho" if r["speculative"] else "plain", "tokens_per_s": round(r["tokens_per_s"], 2),
            "tau": round(r["tau"], 3), "looked_up_%": round(100 * counts["lookup"] / total),
            "heads_%": round(100 * counts["heads"] / total), "target_%": round(100 * counts["target"] / total),
            "session": titles.get(r["session_id"], ""), "prompt": " ".join(prompt.split())[:60],
            "ttft_ms": round(r["ttft_s"] * 1e3), "new_tokens": r["new_tokens"], "forward_passes": r["forward_passes"],
            "model": r.get("model") or "", "when": r["created"],
        })
    return rows


def speed_summary(rows: list[dict]) -> str:
    """The one line a reader wants: how much faster speculative answers are than plain ones here."""
    import statistics

    speeds = {mode: [r["tokens_per_s"] for r in rows if r["mode"] == mode and r["tokens_per_s"] > 0]
              for mode in ("Gumiho", "plain")}
    if not speeds["Gumiho"] or not speeds["plain"]:
        return ("No speed-up to show yet: it needs answers with speculative decoding on and off "
                "(Compare makes one of each).")
    fast, slow = statistics.median(speeds["Gumiho"]), statistics.median(speeds["plain"])
    return (f"**Speculative ×{fast / slow:.2f} the speed of plain decoding on this machine** (median "
            f"{fast:.1f} tok/s over {len(speeds['Gumiho'])} Gumiho answers, {slow:.1f} tok/s over "
            f"{len(speeds['plain'])} plain ones; answers differ in length and prompt, so Compare is the fair test).")


# -- the /chat API (gradio_client) ----------------------------------------------------------------
def chat_api(service: ChatService, message: str, system: str = "", speculative: bool = True,
             max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0) -> dict:
    """One answer to `message`: {"text", "finish_reason", "stats", "error"}; stored as a session marked "/chat"."""
    message = clean_text(message).strip()
    if not message:
        return {"text": "", "finish_reason": "error", "stats": None, "error": "the message is empty"}
    opts = Options(system=clean_text(system), speculative=speculative, temperature=temperature, top_p=top_p,
                   max_new_tokens=max_new_tokens)
    history = [{"role": "user", "text": message}]
    answer = service.answer(history, opts)
    service.record("/chat", history, opts, answer)
    return {"text": answer.text, "finish_reason": answer.finish_reason, "stats": answer.stats, "error": answer.error}
