"""The Gradio Blocks: chat, settings, sessions sidebar, stats tab, and the `/chat` API.

The conversation is drawn by us (app.render) into one gr.HTML, not by gr.Chatbot, because
each token needs its own coloured span and every byte of model text must be escaped by
code we test. Per-browser state is {"session_id": int | None, "messages": [...]}; every
message that is in the database carries its row "id".
"""
from __future__ import annotations

import tempfile
import threading
from pathlib import Path

import gradio as gr

from gumiho_core import GumihoError

from . import models, render
from .chat import Answer, ChatService, Options, clean_text
from .store import export_path

# Stop buttons find the running generation by the browser session's hash.
_cancels: dict[str, threading.Event] = {}


def _new_state() -> dict:
    return {"session_id": None, "messages": []}


def _session_choices(service: ChatService) -> list[tuple[str, int]]:
    if service.store is None:
        return []
    return [(f"{s['title']}  ·  {s['created'][:16].replace('T', ' ')}", s["id"]) for s in service.store.sessions()]


def load_messages(service: ChatService, session_id: int) -> list[dict]:
    """A stored session as UI messages, each answer with the stats of its (last) run."""
    stats_by_message = {}
    for row in service.store.stats(session_id):
        stats_by_message[row["message_id"]] = {
            **row, "acceptance_per_depth": row["acceptance"], "speculative": bool(row["speculative"]),
        }
    out = []
    for m in service.store.messages(session_id):
        out.append({"id": m["id"], "role": m["role"], "text": m["text"], "steps": m["steps"],
                    "finish_reason": m["finish_reason"], "stats": stats_by_message.get(m["id"])})
    return out


def build_ui(service: ChatService) -> gr.Blocks:
    with gr.Blocks(title="gumiho-chat") as demo:
        state = gr.State(_new_state())

        with gr.Sidebar(label="Sessions", open=True, elem_id="sidebar"):
            gr.Markdown("### Sessions")
            new_btn = gr.Button("New chat", size="sm")
            sessions = gr.Radio(label="Past sessions", choices=[], elem_id="session-list")
            rename_box = gr.Textbox(label="Rename selected", placeholder="new title", elem_id="rename-box")
            with gr.Row():
                rename_btn = gr.Button("Rename", size="sm")
                delete_btn = gr.Button("Delete", size="sm", variant="stop")
            with gr.Row():
                export_json_btn = gr.Button("Export JSON", size="sm")
                export_md_btn = gr.Button("Export Markdown", size="sm")
            export_file = gr.File(label="Export", interactive=False, elem_id="export-file")

        with gr.Tabs():
            with gr.Tab("Chat"):
                gr.HTML(render.legend_html(), js_on_load=None)
                chat = gr.HTML(render.chat_html([]), elem_id="chat", js_on_load=None)
                status = gr.Markdown("", elem_id="status")
                compare_box = gr.HTML("", elem_id="compare", js_on_load=None)
                with gr.Row():
                    msg = gr.Textbox(placeholder="Message (Enter to send)", show_label=False, scale=6,
                                     elem_id="msg", lines=1)
                    send_btn = gr.Button("Send", variant="primary", scale=1, elem_id="send")
                with gr.Row():
                    stop_btn = gr.Button("Stop", elem_id="stop")
                    regen_btn = gr.Button("Regenerate", elem_id="regen")
                    edit_btn = gr.Button("Edit last", elem_id="edit")
                    clear_btn = gr.Button("Clear", elem_id="clear")
                    compare_btn = gr.Button("Compare off/on", elem_id="compare-btn")
                with gr.Accordion("Settings", open=True):
                    with gr.Row():
                        spec = gr.Checkbox(value=service.has_heads, label="Speculative decoding (Gumiho)",
                                           elem_id="spec")
                        view = gr.Radio([("Colours", "colours"), ("Raw tokens", "tokens"), ("Markdown", "markdown")],
                                        value="colours",
                                        label="View", elem_id="view")
                        show_rej = gr.Checkbox(value=False, label="Show rejected drafts (struck through)",
                                               elem_id="show-rej")
                    system = gr.Textbox(label="System prompt", value="You are a helpful assistant.", lines=2)
                    with gr.Row():
                        temperature = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="Temperature (0 = greedy)")
                        top_p = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="top_p")
                        max_new = gr.Slider(1, 2048, value=256, step=1, label="Max new tokens", elem_id="max-new")
                with gr.Accordion("Model", open=False):
                    model_status = gr.Markdown(_model_note(service))
                    with gr.Row():
                        # Suggestions from models/, assets/heads/ and runs/; any local path can be typed.
                        model_path = gr.Dropdown(["", *models.model_choices()], value="", allow_custom_value=True,
                                                 label="Model folder or .gguf (empty = default)", elem_id="model-path")
                        heads_path = gr.Dropdown(["", *models.heads_choices()], value="", allow_custom_value=True,
                                                 label="Heads folder (empty = shipped or untrained)",
                                                 elem_id="heads-path")
                    load_btn = gr.Button("Load model")
            with gr.Tab("Stats") as stats_tab:
                gr.Markdown("Speed and τ of every stored answer, speculative vs plain.")
                refresh_btn = gr.Button("Refresh", size="sm")
                speed_plot = gr.LinePlot(x="n", y="tokens_per_s", color="mode", title="tokens/s per answer",
                                         x_title="answer #")
                tau_plot = gr.LinePlot(x="n", y="tau", color="mode", title="τ (tokens per target pass)",
                                       x_title="answer #")
                stats_table = gr.Dataframe(interactive=False)

        gen_inputs = [msg, state, spec, system, temperature, top_p, max_new, view, show_rej]
        gen_outputs = [chat, state, msg, status, sessions]

        def options(spec_on, system_text, temp, p, n):
            return Options(system=system_text or "", speculative=bool(spec_on), temperature=float(temp),
                           top_p=float(p), max_new_tokens=int(n))

        def ensure_session(st, title, opts: Options):
            if service.store is None:
                return
            if st["session_id"] is None:
                st["session_id"] = service.store.create_session(
                    title[:48] or "New chat", model=service.model_name, heads=service.heads_note,
                    settings=opts.__dict__,
                )
            else:
                service.store.update_session(st["session_id"], settings=opts.__dict__)

        def add_user(st, text):
            mid = service.store.add_message(st["session_id"], "user", text) if service.store else None
            st["messages"].append({"id": mid, "role": "user", "text": text})

        def stream_answer(st, opts: Options, view_name, rej, request: gr.Request | None):
            """Yield outputs while the answer grows; save it (complete or partial) at the end."""
            key = request.session_hash if request else "default"
            cancel = _cancels[key] = threading.Event()
            answer = Answer()
            try:
                for answer in service.stream(st["messages"], opts, cancel=cancel):
                    # The input box is left alone (gr.skip()): what the user types while an
                    # answer streams is theirs, and a Send pressed meanwhile runs next with it.
                    if answer.waiting:
                        note = f"*waiting: {answer.waiting} ahead…*"
                        yield gr.skip(), st, gr.skip(), note, gr.skip()
                        continue
                    shown = st["messages"] + [answer.as_message()]
                    note = f"*generating…* {render.esc(answer.notice)}".strip()
                    yield render.chat_html(shown, view_name, rej), st, gr.skip(), note, gr.skip()
            finally:
                # Also reached when the browser goes away mid-answer: the partial text is kept.
                _cancels.pop(key, None)
                if answer.steps or answer.error:
                    message = answer.as_message()
                    if service.store is not None and st["session_id"] is not None:
                        message["id"] = service.save_answer(st["session_id"], answer, opts.speculative)
                    st["messages"].append(message)
            note = f"**{render.esc(answer.error)}**" if answer.error else ""
            if answer.error and answer.steps:
                note += " The partial answer was saved."
            if answer.notice:
                note = f"{note} {render.esc(answer.notice)}".strip()
            yield (render.chat_html(st["messages"], view_name, rej), st, gr.skip(), note,
                   gr.update(choices=_session_choices(service), value=st["session_id"]))

        def checked_options(spec_on, system_text, temp, p, n):
            """(Options, None) or (None, a one-line message for the status)."""
            try:
                opts = Options(system=clean_text(system_text), speculative=bool(spec_on), temperature=temp,
                               top_p=p, max_new_tokens=n)
                opts.validate()
            except GumihoError as exc:
                return None, f"**Settings: {render.esc(str(exc))}**"
            opts.temperature, opts.top_p, opts.max_new_tokens = float(temp), float(p), int(n)
            return opts, None

        def send(text, st, spec_on, system_text, temp, p, n, view_name, rej, request: gr.Request):
            text = clean_text(text).strip()
            if not text:
                yield gr.skip(), st, "", "Type a message first: an empty message is not sent.", gr.skip()
                return
            opts, problem = checked_options(spec_on, system_text, temp, p, n)
            if problem:  # nothing stored; the message stays in the box
                yield gr.skip(), st, gr.skip(), problem, gr.skip()
                return
            ensure_session(st, text, opts)
            add_user(st, text)
            # The message is taken: empty the box once, now, and show it in the chat.
            yield render.chat_html(st["messages"], view_name, rej), st, "", "*generating…*", gr.skip()
            yield from stream_answer(st, opts, view_name, rej, request)

        def regenerate(text, st, spec_on, system_text, temp, p, n, view_name, rej, request: gr.Request):
            if not st["messages"]:
                yield gr.skip(), st, gr.skip(), "Nothing to regenerate.", gr.skip()
                return
            opts, problem = checked_options(spec_on, system_text, temp, p, n)
            if problem:
                yield gr.skip(), st, gr.skip(), problem, gr.skip()
                return
            if st["messages"][-1]["role"] == "assistant":
                dropped = st["messages"].pop()
                if service.store and dropped.get("id"):
                    service.store.delete_messages([dropped["id"]])
            ensure_session(st, st["messages"][-1]["text"], opts)
            yield from stream_answer(st, opts, view_name, rej, request)

        def edit_last(st, view_name, rej):
            """Take the last user message (and its answer) out, back into the input box."""
            users = [i for i, m in enumerate(st["messages"]) if m["role"] == "user"]
            if not users:
                return gr.skip(), st, gr.skip(), "No message to edit."
            cut = users[-1]
            removed = st["messages"][cut:]
            st["messages"] = st["messages"][:cut]
            if service.store:
                service.store.delete_messages([m["id"] for m in removed if m.get("id")])
            return (render.chat_html(st["messages"], view_name, rej), st, removed[0]["text"],
                    "Edit the message and press Send.")

        def stop(request: gr.Request):
            event = _cancels.get(request.session_hash if request else "default")
            if event:
                event.set()
            return "*stopping…*"

        def clear(view_name, rej):
            st = _new_state()
            return render.chat_html([], view_name, rej), st, "", "", gr.update(value=None), ""

        def redraw(st, view_name, rej):
            return render.chat_html(st["messages"], view_name, rej)

        def compare(text, st, system_text, n, view_name, rej):
            text = clean_text(text).strip()
            opts, problem = checked_options(True, system_text, 0.0, 1.0, n)
            if problem:
                yield gr.skip(), st, gr.skip(), problem, gr.skip(), ""
                return
            if not service.has_heads:
                yield gr.skip(), st, gr.skip(), "**Compare needs draft heads.**", gr.skip(), ""
                return
            if text:
                ensure_session(st, text, opts)
                add_user(st, text)
            elif st["messages"] and st["messages"][-1]["role"] == "assistant":
                dropped = st["messages"].pop()
                if service.store and dropped.get("id"):
                    service.store.delete_messages([dropped["id"]])
            if not st["messages"]:
                yield gr.skip(), st, gr.skip(), "Type a prompt to compare.", gr.skip(), ""
                return
            yield (render.chat_html(st["messages"], view_name, rej), st, "", "*comparing: plain, then Gumiho…*",
                   gr.skip(), "")
            plain, gumiho = service.compare(st["messages"], opts)
            if st["session_id"] is not None and service.store is not None:
                if plain.stats:
                    service.store.add_stats(st["session_id"], None, plain.stats, plain.finish_reason or "",
                                            model=service.model_name)
            message = gumiho.as_message()
            if service.store is not None and st["session_id"] is not None:
                message["id"] = service.save_answer(st["session_id"], gumiho, True)
            st["messages"].append(message)
            yield (render.chat_html(st["messages"], view_name, rej), st, "", "", 
                   gr.update(choices=_session_choices(service), value=st["session_id"]),
                   compare_html(plain, gumiho))

        def open_session(session_id, view_name, rej):
            if session_id is None or service.store is None:
                return gr.skip(), gr.skip(), gr.skip(), gr.skip()
            row = service.store.session(int(session_id))
            if row is None:
                return gr.skip(), gr.skip(), "Session not found.", gr.skip()
            st = {"session_id": row["id"], "messages": load_messages(service, row["id"])}
            system_text = row["settings"].get("system", gr.skip())
            return render.chat_html(st["messages"], view_name, rej), st, "", system_text

        def rename(session_id, title, st):
            title = clean_text(title).replace("\n", " ").replace("\t", " ").strip()
            if session_id is None or not title:
                return gr.skip(), "Pick a session and type a title."
            service.store.rename_session(int(session_id), title[:200])
            return gr.update(choices=_session_choices(service), value=session_id), "Renamed."

        def delete(session_id, st, view_name, rej):
            if session_id is None:
                return gr.skip(), st, gr.skip(), "Pick a session to delete."
            service.store.delete_session(int(session_id))
            if st["session_id"] == int(session_id):
                st = _new_state()
            return (gr.update(choices=_session_choices(service), value=st["session_id"]), st,
                    render.chat_html(st["messages"], view_name, rej), "Deleted.")

        def export(session_id, kind):
            if session_id is None:
                return None
            row = service.store.session(int(session_id))
            if row is None:
                return None
            text = service.store.export_json(row["id"]) if kind == "json" else service.store.export_markdown(row["id"])
            folder = Path(tempfile.mkdtemp(prefix="gumiho-export-"))
            path = export_path(folder, row["title"], "json" if kind == "json" else "md")
            path.write_text(text, encoding="utf-8")
            return str(path)

        def load_model(path, heads, st):
            try:
                service.engine, service.heads_note = _load_engine(path, heads)
                service.tree = None  # a tree measured for the old heads says nothing about these
                service.model_name = (path or "").strip() or "default"
            except GumihoError as exc:
                return f"**error:** {render.esc(str(exc))}", gr.skip()
            except Exception as exc:  # not a model, unreadable, mismatched: the old model stays
                return (f"**error:** could not load {render.esc((path or '').strip() or 'the default model')}: "
                        f"{render.esc(type(exc).__name__)}: {render.esc(' '.join(str(exc).split())[:300])}"), gr.skip()
            return _model_note(service), gr.update(value=service.has_heads)

        def stats_outputs():
            rows = service.store.stats() if service.store else []
            return _stats_frames(rows)

        private = {"api_visibility": "private"}
        # No Gradio-side limit on generations: ChatService.turns queues them (UI and API
        # together) and says "waiting: N ahead" to each tab.
        queued = {**private, "concurrency_limit": None}
        # always_last: a Send pressed while the previous answer is still finishing (its stats
        # shown, the save not yet done) runs when it ends instead of being dropped (Gradio's
        # default "once" ignores it). The inputs are read then, so the box's text is current.
        send_btn.click(send, gen_inputs, gen_outputs, trigger_mode="always_last", **queued)
        msg.submit(send, gen_inputs, gen_outputs, trigger_mode="always_last", **queued)
        regen_btn.click(regenerate, gen_inputs, gen_outputs, **queued)
        stop_btn.click(stop, None, status, concurrency_limit=None, **private)
        edit_btn.click(edit_last, [state, view, show_rej], [chat, state, msg, status], **private)
        clear_btn.click(clear, [view, show_rej], [chat, state, msg, status, sessions, compare_box], **private)
        new_btn.click(clear, [view, show_rej], [chat, state, msg, status, sessions, compare_box], **private)
        compare_btn.click(compare, [msg, state, system, max_new, view, show_rej],
                          [chat, state, msg, status, sessions, compare_box], **queued)
        view.change(redraw, [state, view, show_rej], chat, **private)
        show_rej.change(redraw, [state, view, show_rej], chat, **private)
        sessions.input(open_session, [sessions, view, show_rej], [chat, state, status, system], **private)
        rename_btn.click(rename, [sessions, rename_box, state], [sessions, status], **private)
        delete_btn.click(delete, [sessions, state, view, show_rej], [sessions, state, chat, status], **private)
        export_json_btn.click(lambda s: export(s, "json"), sessions, export_file, **private)
        export_md_btn.click(lambda s: export(s, "md"), sessions, export_file, **private)
        load_btn.click(load_model, [model_path, heads_path, state], [model_status, spec], **private)
        refresh_btn.click(stats_outputs, None, [speed_plot, tau_plot, stats_table], **private)
        stats_tab.select(stats_outputs, None, [speed_plot, tau_plot, stats_table], **private)
        demo.load(lambda: gr.update(choices=_session_choices(service)), None, sessions, **private)
        demo.load(stats_outputs, None, [speed_plot, tau_plot, stats_table], **private)

        def chat_api(message: str, system: str = "", speculative: bool = True, max_new_tokens: int = 128,
                     temperature: float = 0.0, top_p: float = 1.0) -> dict:
            """One answer to `message`: {"text", "finish_reason", "stats", "error"}."""
            message = clean_text(message).strip()
            if not message:
                return {"text": "", "finish_reason": "error", "stats": None, "error": "the message is empty"}
            opts = Options(system=clean_text(system), speculative=speculative, temperature=temperature, top_p=top_p,
                           max_new_tokens=max_new_tokens)
            answer = None
            for answer in service.stream([{"role": "user", "text": message}], opts):
                pass
            return {"text": answer.text, "finish_reason": answer.finish_reason, "stats": answer.stats,
                    "error": answer.error}

        gr.api(chat_api, api_name="chat")
    return demo


def compare_html(plain: Answer, gumiho: Answer) -> str:
    if plain.error or gumiho.error:
        return f'<div class="compare error">{render.esc(plain.error or gumiho.error)}</div>'
    p, g = plain.stats, gumiho.stats
    same = plain.text == gumiho.text
    speedup = g["tokens_per_s"] / p["tokens_per_s"] if p["tokens_per_s"] else 0.0
    verdict = ("texts identical ✓" if same else "texts differ ✗ (should not happen with greedy decoding)")
    return (
        f'<div class="compare {"same" if same else "differ"}">'
        f"<b>Compare (greedy):</b> plain {p['tokens_per_s']:.1f} tok/s ({p['forward_passes']} passes) · "
        f"Gumiho {g['tokens_per_s']:.1f} tok/s ({g['forward_passes']} passes, τ {g['tau']:.2f}) · "
        f"speed-up ×{speedup:.2f} · <span class=\"verdict\">{verdict}</span></div>"
    )


def _stats_frames(rows: list[dict]):
    import pandas as pd

    frame = pd.DataFrame(
        [{"n": i + 1, "mode": "Gumiho" if r["speculative"] else "plain", "tokens_per_s": round(r["tokens_per_s"], 2),
          "tau": round(r["tau"], 3), "ttft_ms": round(r["ttft_s"] * 1e3), "new_tokens": r["new_tokens"],
          "forward_passes": r["forward_passes"], "model": r.get("model") or "", "when": r["created"]}
         for i, r in enumerate(rows)],
        columns=["n", "mode", "tokens_per_s", "tau", "ttft_ms", "new_tokens", "forward_passes", "model", "when"],
    )
    return frame, frame, frame


def _model_note(service: ChatService) -> str:
    heads = service.heads_note or ("none" if not service.has_heads else "loaded")
    return f"Model: **{render.esc(service.model_name)}** · heads: **{render.esc(heads)}**"


def _load_engine(path: str, heads: str):
    """The model picker: a local folder / .gguf and optional heads, like the CLI does."""
    import argparse

    from gumiho_core.cli import load_engine

    args = argparse.Namespace(model=(path or "").strip() or None, heads=(heads or "").strip() or None,
                              dtype="float32", quantize=None, device="cpu")
    return load_engine(args)
