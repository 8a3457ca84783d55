"""The Gradio Blocks: the layout, and which handler (app/handlers.py) each event runs.

The conversation is drawn by us (app.render) into one gr.HTML, not by gr.Chatbot, because
each token needs its own coloured span and every byte of model text must be escaped by
code we test. What the buttons do lives in handlers.py as plain functions of the chat
service; this file only places the components and connects them.
"""
from __future__ import annotations

import inspect
from types import SimpleNamespace

import gradio as gr

from . import handlers, models, render
from .chat import TEMPERATURE_MAX, TOP_P_MIN, ChatService

PRIVATE = {"api_visibility": "private"}
# No Gradio-side limit on generations: ChatService.queue serves them (UI and API together)
# one at a time and says "waiting: N ahead" to each tab.
QUEUED = {**PRIVATE, "concurrency_limit": None}


def build_ui(service: ChatService) -> gr.Blocks:
    with gr.Blocks(title="gumiho-chat") as demo:
        state = gr.State(handlers.new_state())
        sidebar = _sidebar()
        with gr.Tabs():
            chat = _chat_tab(service)
            stats = _stats_tab()
        _wire_chat(service, state, chat, sidebar)
        _wire_sessions(service, demo, state, chat, sidebar)
        _wire_stats(service, demo, stats)
        gr.api(bind(handlers.chat_api, service), api_name="chat")
    return demo


def bind(handler, service: ChatService):
    """`handler` with the service as its first argument, for Gradio to call.

    Not functools.partial: Gradio reads a handler's type hints (that is how it finds the
    gr.Request parameter, and the /chat API's types) and whether it is a generator (whose
    outputs it streams), and a partial hides the hints. So the bound function carries the
    handler's signature, minus `service`, with its hints resolved, and its kind.
    """
    if inspect.isgeneratorfunction(handler):
        def bound(*args):
            yield from handler(service, *args)
    else:
        def bound(*args):
            return handler(service, *args)
    signature = inspect.signature(handler, eval_str=True)
    bound.__signature__ = signature.replace(parameters=list(signature.parameters.values())[1:])
    bound.__annotations__ = {name: p.annotation for name, p in bound.__signature__.parameters.items()
                             if p.annotation is not p.empty}
    if signature.return_annotation is not signature.empty:
        bound.__annotations__["return"] = signature.return_annotation
    bound.__name__ = bound.__qualname__ = handler.__name__
    bound.__doc__ = handler.__doc__
    return bound


# -- layout ---------------------------------------------------------------------------------------
def _sidebar() -> SimpleNamespace:
    with gr.Sidebar(label="Sessions", open=True, elem_id="sidebar"):
        gr.Markdown("### Sessions")
        sidebar = SimpleNamespace(new=gr.Button("New chat", size="sm"))
        sidebar.sessions = gr.Radio(label="Past sessions", choices=[], elem_id="session-list")
        sidebar.rename_box = gr.Textbox(label="Rename selected", placeholder="new title", elem_id="rename-box")
        with gr.Row():
            sidebar.rename = gr.Button("Rename", size="sm")
            sidebar.delete = gr.Button("Delete", size="sm", variant="stop")
        with gr.Row():
            sidebar.export_json = gr.Button("Export JSON", size="sm")
            sidebar.export_md = gr.Button("Export Markdown", size="sm")
        # Shown once there is a file: an empty file box took a third of the sidebar.
        sidebar.export_file = gr.File(label="Export", interactive=False, elem_id="export-file", visible=False)
    return sidebar


def _chat_tab(service: ChatService) -> SimpleNamespace:
    with gr.Tab("Chat"):
        legend = gr.HTML(handlers.legend(service), js_on_load=None)
        chat = SimpleNamespace(legend=legend, log=gr.HTML(render.chat_html([]), elem_id="chat", js_on_load=None))
        # A startup warning (nearly full disk, an empty database file taken as new) shows until the first answer.
        notes = service.store.notes if service.store is not None else []
        chat.status = gr.Markdown(" ".join(render.esc(n) for n in notes), elem_id="status")
        chat.compare_box = gr.HTML("", elem_id="compare", js_on_load=None)
        with gr.Row():
            chat.msg = gr.Textbox(placeholder="Message (Enter to send)", show_label=False, scale=6, elem_id="msg",
                                  lines=1)
            chat.send = gr.Button("Send", variant="primary", scale=1, elem_id="send")
        with gr.Row():
            chat.stop = gr.Button("Stop", elem_id="stop")
            chat.regen = gr.Button("Regenerate", elem_id="regen")
            chat.edit = gr.Button("Edit last", elem_id="edit")
            chat.clear = gr.Button("Clear", elem_id="clear")
            chat.compare = gr.Button("Compare off/on", elem_id="compare-btn")
        _settings_panel(service, chat)
        _model_panel(service, chat)
    return chat


def _settings_panel(service: ChatService, chat: SimpleNamespace) -> None:
    with gr.Accordion("Settings", open=True):
        with gr.Row(elem_id="look-row"):
            chat.spec = gr.Checkbox(value=service.has_heads, label="Speculative decoding (Gumiho)", elem_id="spec")
            chat.view = gr.Radio([("Colours", "colours"), ("Raw tokens", "tokens"), ("Markdown", "markdown")],
                                 value="colours", label="View", elem_id="view")
            chat.show_rej = gr.Checkbox(value=False, label="Show rejected drafts", elem_id="show-rej")
        chat.system = gr.Textbox(label="System prompt", value="You are a helpful assistant.", lines=2)
        # The sliders' ranges are the ones every answer is checked against (chat.Options.settings);
        # assets/app.js keeps a number typed into a slider's box within them.
        with gr.Row():
            chat.temperature = gr.Slider(0.0, TEMPERATURE_MAX, value=0.0, step=0.05, label="Temperature (0 = greedy)",
                                         elem_id="temperature")
            chat.top_p = gr.Slider(TOP_P_MIN, 1.0, value=1.0, step=0.01, label="top_p", elem_id="top-p")
            chat.max_new = gr.Slider(1, service.max_new_tokens_limit, value=min(256, service.max_new_tokens_limit),
                                     step=1, label="Max new tokens", elem_id="max-new")


def _model_panel(service: ChatService, chat: SimpleNamespace) -> None:
    with gr.Accordion("Model", open=False):
        chat.model_status = gr.Markdown(handlers.model_note(service))
        with gr.Row():
            # Suggestions from models/, assets/heads/ and runs/; any local path can be typed.
            # The empty choice carries words: Gradio draws an empty label as a lone check mark.
            chat.model_path = gr.Dropdown([("(the default model)", ""), *models.model_choices()], value="",
                                          allow_custom_value=True, label="Model folder or .gguf",
                                          elem_id="model-path")
            chat.heads_path = gr.Dropdown([("(shipped heads, or none)", ""), *models.heads_choices()], value="",
                                          allow_custom_value=True, label="Heads folder", elem_id="heads-path")
        chat.load = gr.Button("Load model")


def _stats_tab() -> SimpleNamespace:
    with gr.Tab("Stats") as tab:
        gr.Markdown("Speed and τ of every stored answer, speculative vs plain, and where each answer's "
                    "tokens came from (context lookup, draft heads, the target itself).")
        stats = SimpleNamespace(tab=tab, refresh=gr.Button("Refresh", size="sm"))
        summary = gr.Markdown(elem_id="speed-summary")
        # Hovering a point shows its session, prompt and token sources (tooltip="all").
        speed = gr.LinePlot(x="n", y="tokens_per_s", color="mode", title="tokens/s per answer", x_title="answer #",
                            x_axis_format="d", tooltip="all")
        tau = gr.LinePlot(x="n", y="tau", color="mode", title="τ (tokens per target pass)", x_title="answer #",
                          x_axis_format="d", tooltip="all")
        stats.outputs = [summary, speed, tau, gr.Dataframe(interactive=False, elem_id="stats-table")]
    return stats


# -- wiring ---------------------------------------------------------------------------------------
def _wire_chat(service: ChatService, state: gr.State, chat: SimpleNamespace, sidebar: SimpleNamespace) -> None:
    look = [chat.view, chat.show_rej]  # how the chat is drawn: every redraw needs these
    gen_inputs = [chat.msg, state, chat.spec, chat.system, chat.temperature, chat.top_p, chat.max_new, *look]
    gen_outputs = [chat.log, state, chat.msg, chat.status, sidebar.sessions]
    fresh_outputs = [chat.log, state, chat.msg, chat.status, sidebar.sessions, chat.compare_box]
    send = bind(handlers.send, service)
    # always_last: a Send pressed while the previous answer is still finishing (its stats
    # shown, the save not yet done) runs when it ends instead of being dropped (Gradio's
    # default "once" ignores it). The inputs are read then, so the box's text is current.
    chat.send.click(send, gen_inputs, gen_outputs, trigger_mode="always_last", **QUEUED)
    chat.msg.submit(send, gen_inputs, gen_outputs, trigger_mode="always_last", **QUEUED)
    chat.regen.click(bind(handlers.regenerate, service), gen_inputs, gen_outputs, **QUEUED)
    chat.stop.click(handlers.stop, None, chat.status, concurrency_limit=None, **PRIVATE)
    chat.edit.click(bind(handlers.edit_last, service), [state, *look], [chat.log, state, chat.msg, chat.status],
                    **PRIVATE)
    chat.clear.click(handlers.clear, look, fresh_outputs, **PRIVATE)
    chat.compare.click(bind(handlers.compare, service), [chat.msg, state, chat.system, chat.max_new, *look],
                       fresh_outputs, **QUEUED)
    chat.view.change(handlers.redraw, [state, *look], chat.log, **PRIVATE)
    chat.show_rej.change(handlers.redraw, [state, *look], chat.log, **PRIVATE)
    chat.load.click(bind(handlers.load_model, service), [chat.model_path, chat.heads_path],
                    [chat.model_status, chat.spec, chat.legend, chat.max_new], **PRIVATE)


def _wire_sessions(service: ChatService, demo: gr.Blocks, state: gr.State, chat: SimpleNamespace,
                   sidebar: SimpleNamespace) -> None:
    look = [chat.view, chat.show_rej]
    sessions = sidebar.sessions
    sidebar.new.click(handlers.clear, look, [chat.log, state, chat.msg, chat.status, sessions, chat.compare_box],
                      **PRIVATE)
    sessions.input(bind(handlers.open_session, service), [sessions, *look],
                   [chat.log, state, chat.status, chat.system, sidebar.delete], **PRIVATE)
    sidebar.rename.click(bind(handlers.rename, service), [sessions, sidebar.rename_box, state],
                         [sessions, chat.status], **PRIVATE)
    sidebar.delete.click(bind(handlers.delete, service), [sessions, state, *look],
                         [sessions, state, chat.log, chat.status, sidebar.delete], **PRIVATE)
    for button, kind in ((sidebar.export_json, "json"), (sidebar.export_md, "md")):
        button.click(lambda s, kind=kind: _file(handlers.export(service, s, kind)), sessions, sidebar.export_file,
                     **PRIVATE)
    # The session in the page's address (/?session=ID) comes back on load and reload.
    demo.load(bind(handlers.open_address, service), look, [sessions, chat.log, state, chat.status, chat.system],
              **PRIVATE)


def _file(path: str | None) -> dict:
    return gr.update(value=path, visible=path is not None)


def _wire_stats(service: ChatService, demo: gr.Blocks, stats: SimpleNamespace) -> None:
    show_stats = bind(handlers.stats_outputs, service)
    stats.refresh.click(show_stats, None, stats.outputs, **PRIVATE)
    stats.tab.select(show_stats, None, stats.outputs, **PRIVATE)
    demo.load(show_stats, None, stats.outputs, **PRIVATE)
