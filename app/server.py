"""One FastAPI app with the Gradio chat at / and the OpenAI route at /v1.

`create_app` takes an already-built Engine (gumiho_core.loading builds one; tests inject
a tiny model); `python launch.py serve` (gumiho_core/cli/serve.py) runs it with uvicorn.
"""
from __future__ import annotations

import ipaddress
from pathlib import Path

from gumiho_core import GumihoError

ASSETS = Path(__file__).resolve().parent.parent / "assets"


AUTH_ENV = "GUMIHO_AUTH"


def parse_auth(value: str | None) -> tuple[str, str] | None:
    """"user:pass" -> ("user", "pass"); None or "" -> no auth."""
    if not value:
        return None
    user, sep, password = value.partition(":")
    if not sep or not user or not password:
        raise GumihoError("--auth (or GUMIHO_AUTH) must be USER:PASSWORD, both non-empty")
    return user, password


def create_app(engine, db_path: str | Path | None = None, model_name: str = "default", heads_note: str = "",
               auth: tuple[str, str] | None = None, store=None, tree=None):
    """The FastAPI app serving `engine`, with sessions in `store` (or a Store at `db_path`).

    With `auth` = (user, password), the Gradio UI asks for a login and the OpenAI route
    wants HTTP basic auth (or `Authorization: Bearer PASSWORD`)."""
    import gradio as gr
    from fastapi import FastAPI

    from .chat import ChatService
    from .openai_api import make_router
    from .store import Store, default_db_path
    from .ui import build_ui

    store = store or Store(db_path or default_db_path())
    service = ChatService(engine, store, model_name=model_name, heads_note=heads_note, tree=tree)
    app = FastAPI(title="gumiho-chat")
    # The OpenAI route first: Gradio mounted at "/" would otherwise answer every path.
    app.include_router(make_router(service, auth=auth))
    app.state.service = service
    demo = build_ui(service)
    return gr.mount_gradio_app(
        app, demo, path="", css_paths=[ASSETS / "app.css"], js=(ASSETS / "app.js").read_text(),
        footer_links=["api"], auth=[auth] if auth else None,
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
