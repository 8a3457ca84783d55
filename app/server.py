"""One FastAPI app with the Gradio chat at / and the OpenAI route at /v1.

`create_app` takes an already-built Engine (gumiho_core.loading builds one; tests inject
a tiny model); `python launch.py serve` (gumiho_core/cli/serve.py) runs it with uvicorn.
"""
from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import signal
import sys
import threading
from pathlib import Path

from gumiho_core import GumihoError

ASSETS = Path(__file__).resolve().parent.parent / "assets"


AUTH_ENV = "GUMIHO_AUTH"
# "0" (or "no", "false", "off"): answers to /chat and /v1 are not stored as sessions.
STORE_API_ENV = "GUMIHO_STORE_API"
# After a SIGTERM / Ctrl-C, open connections get this long to end on their own (streams are
# stopped at once, so they do); then the server stops without waiting for the rest.
SHUTDOWN_GRACE_S = 3.0


def parse_auth(value: str | None) -> tuple[str, str] | None:
    """"user:pass" -> ("user", "pass"); None or "" -> no auth."""
    if not value:
        return None
    user, sep, password = value.partition(":")
    if not sep or not user or not password:
        raise GumihoError("--auth (or GUMIHO_AUTH) must be USER:PASSWORD, both non-empty")
    return user, password


def store_api_default() -> bool:
    return os.environ.get(STORE_API_ENV, "1").strip().lower() not in ("0", "no", "false", "off")


def create_app(engine, db_path: str | Path | None = None, model_name: str = "default", heads_note: str = "",
               auth: tuple[str, str] | None = None, store=None, tree=None, store_api: bool | None = None):
    """The FastAPI app serving `engine`, with sessions in `store` (or a Store at `db_path`).

    With `auth` = (user, password), the Gradio UI asks for a login and the OpenAI route
    wants HTTP basic auth (or `Authorization: Bearer PASSWORD`). `store_api` (default: the
    GUMIHO_STORE_API environment variable, on unless "0") stores /chat and /v1 answers as
    sessions marked by their source."""
    import gradio as gr
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError

    from .chat import ChatService
    from .openai_api import install
    from .store import Store, default_db_path
    from .ui import build_ui

    store = store or Store(db_path or default_db_path())
    for note in store.notes:  # an empty file taken as new, a nearly full disk: said once, at startup
        print(note, file=sys.stderr)
    service = ChatService(engine, store, model_name=model_name, heads_note=heads_note, tree=tree)
    service.record_requests = store_api_default() if store_api is None else store_api
    app = FastAPI(title="gumiho-chat", lifespan=_lifespan(service))
    # The OpenAI route first: Gradio mounted at "/" would otherwise answer every path.
    install(app, service, auth=auth)
    app.state.service = service
    demo = build_ui(service)
    app = gr.mount_gradio_app(
        app, demo, path="", css_paths=[ASSETS / "app.css"], js=(ASSETS / "app.js").read_text(),
        footer_links=["api"], auth=[auth] if auth else None,
    )
    app.state.gradio_app = next(r.app for r in app.routes if getattr(r, "path", None) == "" and hasattr(r, "app"))
    for part in (app, app.state.gradio_app):
        part.add_exception_handler(RequestValidationError, _validation_failed)
    return app


def _validation_failed(request, exc):
    """A 422 that says where and what, without the input: FastAPI's own handler echoes the
    input back, and an overflowing number (1e400 is read as inf) cannot be written as JSON (a 500)."""
    from fastapi.responses import JSONResponse

    errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")} for e in exc.errors()]
    return JSONResponse({"detail": errors}, status_code=422)


def _lifespan(service):
    @contextlib.asynccontextmanager
    async def lifespan(app):
        _stop_answers_on_signals(app, service, asyncio.get_running_loop())
        yield
        service.close()  # a stop without a signal (tests, an embedding program)
        service.exports.remove()

    return lifespan


def _stop_answers_on_signals(app, service, loop) -> None:
    """On SIGINT / SIGTERM, end what keeps connections open, then let uvicorn stop as usual.

    uvicorn's own handler stops taking requests and then waits for every open connection:
    a running answer, requests waiting in the queue, each browser tab's heartbeat stream.
    So ours runs first: it stops the answers (each saves its partial answer, as Stop does),
    closes Gradio's heartbeat streams, and gives any other connection SHUTDOWN_GRACE_S.
    uvicorn has installed its handlers when the lifespan starts, and puts back the ones it
    found when it ends, so nothing of ours outlives the server.
    """
    if threading.current_thread() is not threading.main_thread():
        return  # a server run in a thread (tests) gets no signals; service.close() is called directly

    def stop_everything() -> None:
        service.close()
        loop.call_soon_threadsafe(app.state.gradio_app.stop_event.set)

    for sig in (signal.SIGINT, signal.SIGTERM):
        previous = signal.getsignal(sig)

        def handler(signum, frame, previous=previous):
            stop_everything()
            if callable(previous):
                previous(signum, frame)
            server = getattr(previous, "__self__", None)  # uvicorn's Server, whose handle_exit this is
            if server is not None and hasattr(server, "force_exit"):
                timer = threading.Timer(SHUTDOWN_GRACE_S, setattr, (server, "force_exit", True))
                timer.daemon = True
                timer.start()

        signal.signal(sig, handler)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
