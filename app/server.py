"""`python launch.py serve`: one FastAPI app with the Gradio chat at / and the OpenAI route at /v1.

`create_app` takes an already-built Engine so tests can inject a tiny model; the CLI
builds one from the model arguments.
"""
from __future__ import annotations

import ipaddress
import os
import sys
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


def create_app(engine=None, db_path: str | Path | None = None, model_name: str = "default", heads_note: str = "",
               args=None, auth: tuple[str, str] | None = None, store=None, tree=None):
    """The FastAPI app. Without `engine`, one is loaded from `args` (the CLI's model args).

    With `auth` = (user, password), the Gradio UI asks for a login and the OpenAI route
    wants HTTP basic auth (or `Authorization: Bearer PASSWORD`)."""
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


def cmd_serve(args) -> int:
    import uvicorn

    from gumiho_core.cli import load_engine

    from .store import Store, default_db_path

    auth = parse_auth(getattr(args, "auth", None) or os.environ.get(AUTH_ENV))
    if not is_loopback(args.host):
        if auth:
            print(f"warning: listening on {args.host}: the chat asks for a login, but traffic is plain HTTP.",
                  file=sys.stderr)
        else:
            print(f"warning: listening on {args.host}: anyone who can reach this machine can use the chat "
                  "and read its history. Use --host 127.0.0.1 to keep it local, or --auth USER:PASSWORD.",
                  file=sys.stderr)
    # The database first: a corrupt or locked file is reported before minutes of model loading.
    store = Store(args.db or default_db_path())
    print("loading the model…", file=sys.stderr)
    try:
        engine, heads_note = load_engine(args)
    except GumihoError:
        raise
    except Exception as exc:  # not a model, unreadable, mismatched heads: one line, no traceback
        raise GumihoError(f"could not load the model {args.model or 'default'}"
                          f"{' with heads ' + str(args.heads) if args.heads else ''}: "
                          f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}") from None
    tree = None
    if args.auto_tree and engine.heads is not None:
        from gumiho_core.tree_budget import choose_tree, format_budget

        print("choosing the draft tree for this machine (measured once, then cached)…", file=sys.stderr)
        tree, report = choose_tree(engine)
        print(format_budget(report), file=sys.stderr)
    app = create_app(engine, args.db, model_name=args.model or "default", heads_note=heads_note, auth=auth,
                     store=store, tree=tree)
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
    p.add_argument("--auth", default=None, metavar="USER:PASSWORD",
                   help=f"ask for this login in the UI and the API (or set {AUTH_ENV}); use it with --host")
    p.add_argument("--auto-tree", action="store_true",
                   help="measure this machine's cost curve and the heads' acceptance, answer with the best tree")
    add_model_args(p)
    p.set_defaults(func=cmd_serve)
