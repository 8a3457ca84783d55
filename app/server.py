"""`python launch.py serve`: one FastAPI app with the Gradio chat at / and the OpenAI route at /v1.

`create_app` takes an already-built Engine so tests can inject a tiny model; the CLI
builds one from the model arguments.
"""
from __future__ import annotations

import ipaddress
import sys
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "assets"


def create_app(engine=None, db_path: str | Path | None = None, model_name: str = "default", heads_note: str = "",
               args=None):
    """The FastAPI app. Without `engine`, one is loaded from `args` (the CLI's model args)."""
    import gradio as gr
    from fastapi import FastAPI

    from .chat import ChatService
    from .openai_api import make_router
    from .store import Store, default_db_path
    from .ui import build_ui

    if engine is None:
        from gumiho_core.cli import load_engine

        engine, heads_note = load_engine(args)
        model_name = getattr(args, "model", None) or "default"
    store = Store(db_path or default_db_path())
    service = ChatService(engine, store, model_name=model_name, heads_note=heads_note)
    app = FastAPI(title="gumiho-chat")
    # The OpenAI route first: Gradio mounted at "/" would otherwise answer every path.
    app.include_router(make_router(service))
    app.state.service = service
    demo = build_ui(service)
    return gr.mount_gradio_app(
        app, demo, path="", css_paths=[ASSETS / "app.css"], js=(ASSETS / "app.js").read_text(),
        footer_links=["api"],
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cmd_serve(args) -> int:
    import uvicorn

    from gumiho_core.cli import load_engine

    if not is_loopback(args.host):
        print(f"warning: listening on {args.host}: anyone who can reach this machine can use the chat "
              "and read its history. Use --host 127.0.0.1 to keep it local.", file=sys.stderr)
    print("loading the model…", file=sys.stderr)
    engine, heads_note = load_engine(args)
    app = create_app(engine, args.db, model_name=args.model or "default", heads_note=heads_note)
    print(f"gumiho-chat on http://{args.host}:{args.port}  (OpenAI API at /v1/chat/completions)", file=sys.stderr)
    # Never a public share link: this is a local app.
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def register_cli(subparsers) -> None:
    from gumiho_core.cli import add_model_args

    p = subparsers.add_parser("serve", help="open the chat in the browser (the default command)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--db", default=None, help="SQLite file for sessions (default: per-user data folder)")
    add_model_args(p)
    p.set_defaults(func=cmd_serve)
