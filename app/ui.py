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
from .chat import ChatService

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
        ui = SimpleNamespace(new=gr.Button("New chat", size="sm"))
        ui.sessions = gr.Radio(label="Past sessions", choices=[], elem_id="session-list")
        ui.rename_box = gr.Textbox(label="Rename selected", placeholder="new title", elem_id="rename-box")
        with gr.Row():
            ui.rename = gr.Button("Rename", size="sm")
            ui.delete = gr.Button("Delete", size="sm", variant="stop")
        with gr.Row():
            ui.export_json = gr.Button("Export JSON", size="sm")
            ui.export_md = gr.Button("Export Markdown", size="sm")
        ui.export_file = gr.File(label="Export", interactive=False, elem_id="export-file")
    return ui


def _chat_tab(service: ChatService) -> SimpleNamespace:
    with gr.Tab("Chat"):
        gr.HTML(render.legend_html(), js_on_load=None)
        ui = SimpleNamespace(chat=gr.HTML(render.chat_html([]), elem_id="chat", js_on_load=None))
        ui.status = gr.Markdown("", elem_id="status")
        ui.compare_box = gr.HTML("", elem_id="compare", js_on_load=None)
        with gr.Row():
            ui.msg = gr.Textbox(placeholder="Message (Enter to send)", show_label=False, scale=6, elem_id="msg",
                                lines=1)
            ui.send = gr.Button("Send", variant="primary", scale=1, elem_id="send")
        with gr.Row():
            ui.stop = gr.Button("Stop", elem_id="stop")
            ui.regen = gr.Button("Regenerate", elem_id="regen")
            ui.edit = gr.Button("Edit last", elem_id="edit")
            ui.clear = gr.Button("Clear", elem_id="clear")
            ui.compare = gr.Button("Compare off/on", elem_id="compare-btn")
        _settings_panel(service, ui)
        _model_panel(service, ui)
    return ui


def _settings_panel(service: ChatService, ui: SimpleNamespace) -> None:
    with gr.Accordion("Settings", open=True):
        with gr.Row():
            ui.spec = gr.Checkbox(value=service.has_heads, label="Speculative decoding (Gumiho)", elem_id="spec")
            ui.view = gr.Radio([("Colours", "colours"), ("Raw tokens", "tokens"), ("Markdown", "markdown")],
                               value="colours", label="View", elem_id="view")
            ui.show_rej = gr.Checkbox(value=False, label="Show rejected drafts (struck through)", elem_id="show-rej")
        ui.system = gr.Textbox(label="System prompt", value="You are a helpful assistant.", lines=2)
        with gr.Row():
            ui.temperature = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="Temperature (0 = greedy)")
            ui.top_p = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="top_p")
            ui.max_new = gr.Slider(1, 2048, value=256, step=1, label="Max new tokens", elem_id="max-new")


def _model_panel(service: ChatService, ui: SimpleNamespace) -> None:
    with gr.Accordion("Model", open=False):
        ui.model_status = gr.Markdown(handlers.model_note(service))
        with gr.Row():
            # Suggestions from models/, assets/heads/ and runs/; any local path can be typed.
            ui.model_path = gr.Dropdown(["", *models.model_choices()], value="", allow_custom_value=True,
                                        label="Model folder or .gguf (empty = default)", elem_id="model-path")
            ui.heads_path = gr.Dropdown(["", *models.heads_choices()], value="", allow_custom_value=True,
                                        label="Heads folder (empty = shipped or untrained)", elem_id="heads-path")
        ui.load = gr.Button("Load model")


def _stats_tab() -> SimpleNamespace:
    with gr.Tab("Stats") as tab:
        gr.Markdown("Speed and τ of every stored answer, speculative vs plain.")
        ui = SimpleNamespace(tab=tab, refresh=gr.Button("Refresh", size="sm"))
        speed = gr.LinePlot(x="n", y="tokens_per_s", color="mode", title="tokens/s per answer", x_title="answer #")
        tau = gr.LinePlot(x="n", y="tau", color="mode", title="τ (tokens per target pass)", x_title="answer #")
        ui.outputs = [speed, tau, gr.Dataframe(interactive=False)]
    return ui


# -- wiring ---------------------------------------------------------------------------------------
def _wire_chat(service: ChatService, state: gr.State, ui: SimpleNamespace, sidebar: SimpleNamespace) -> None:
    look = [ui.view, ui.show_rej]  # how the chat is drawn: every redraw needs these
    gen_inputs = [ui.msg, state, ui.spec, ui.system, ui.temperature, ui.top_p, ui.max_new, *look]
    gen_outputs = [ui.chat, state, ui.msg, ui.status, sidebar.sessions]
    fresh_outputs = [ui.chat, state, ui.msg, ui.status, sidebar.sessions, ui.compare_box]
    send = bind(handlers.send, service)
    # always_last: a Send pressed while the previous answer is still finishing (its stats
    # shown, the save not yet done) runs when it ends instead of being dropped (Gradio's
    # default "once" ignores it). The inputs are read then, so the box's text is current.
    ui.send.click(send, gen_inputs, gen_outputs, trigger_mode="always_last", **QUEUED)
    ui.msg.submit(send, gen_inputs, gen_outputs, trigger_mode="always_last", **QUEUED)
    ui.regen.click(bind(handlers.regenerate, service), gen_inputs, gen_outputs, **QUEUED)
    ui.stop.click(handlers.stop, None, ui.status, concurrency_limit=None, **PRIVATE)
    ui.edit.click(bind(handlers.edit_last, service), [state, *look], [ui.chat, state, ui.msg, ui.status], **PRIVATE)
    ui.clear.click(handlers.clear, look, fresh_outputs, **PRIVATE)
    ui.compare.click(bind(handlers.compare, service), [ui.msg, state, ui.system, ui.max_new, *look], fresh_outputs,
                     **QUEUED)
    ui.view.change(handlers.redraw, [state, *look], ui.chat, **PRIVATE)
    ui.show_rej.change(handlers.redraw, [state, *look], ui.chat, **PRIVATE)
    ui.load.click(bind(handlers.load_model, service), [ui.model_path, ui.heads_path], [ui.model_status, ui.spec],
                  **PRIVATE)


def _wire_sessions(service: ChatService, demo: gr.Blocks, state: gr.State, chat: SimpleNamespace,
                   ui: SimpleNamespace) -> None:
    look = [chat.view, chat.show_rej]
    ui.new.click(handlers.clear, look, [chat.chat, state, chat.msg, chat.status, ui.sessions, chat.compare_box],
                 **PRIVATE)
    ui.sessions.input(bind(handlers.open_session, service), [ui.sessions, *look],
                      [chat.chat, state, chat.status, chat.system], **PRIVATE)
    ui.rename.click(bind(handlers.rename, service), [ui.sessions, ui.rename_box, state], [ui.sessions, chat.status],
                    **PRIVATE)
    ui.delete.click(bind(handlers.delete, service), [ui.sessions, state, *look],
                    [ui.sessions, state, chat.chat, chat.status], **PRIVATE)
    ui.export_json.click(lambda s: handlers.export(service, s, "json"), ui.sessions, ui.export_file, **PRIVATE)
    ui.export_md.click(lambda s: handlers.export(service, s, "md"), ui.sessions, ui.export_file, **PRIVATE)
    demo.load(bind(handlers.list_sessions, service), None, ui.sessions, **PRIVATE)


def _wire_stats(service: ChatService, demo: gr.Blocks, ui: SimpleNamespace) -> None:
    stats = bind(handlers.stats_outputs, service)
    ui.refresh.click(stats, None, ui.outputs, **PRIVATE)
    ui.tab.select(stats, None, ui.outputs, **PRIVATE)
    demo.load(stats, None, ui.outputs, **PRIVATE)
