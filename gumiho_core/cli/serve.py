"""`serve` (the default command): the chat UI, `/chat` and the OpenAI route on one local server."""
from __future__ import annotations

import os
import sys

from ..errors import GumihoError
from .options import add_model_args, add_tree_args, check_tree, engine_from_args, tree_from_args


def register(sub) -> None:
    from app.server import AUTH_ENV

    p = sub.add_parser("serve", help="serve the chat in the browser (the default command)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--db", default=None, help="SQLite file for sessions (default: per-user data folder)")
    p.add_argument("--auth", default=None, metavar="USER:PASSWORD",
                   help=f"ask for this login in the UI and the API (or set {AUTH_ENV}); use it with --host")
    add_model_args(p)
    add_tree_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    import uvicorn

    from app.server import AUTH_ENV, create_app, is_loopback, parse_auth
    from app.store import Store, default_db_path

    auth = parse_auth(args.auth or os.environ.get(AUTH_ENV))
    if not is_loopback(args.host):
        print(_exposed_warning(args.host, auth), file=sys.stderr)
    check_tree(args)
    # The database first: a corrupt or locked file is reported before minutes of model loading.
    store = Store(args.db or default_db_path())
    print("loading the model…", file=sys.stderr)
    engine, heads_note = _load(args)
    if args.auto_tree and engine.heads is not None:
        print("choosing the draft tree for this machine (measured once, then cached)…", file=sys.stderr)
    tree = tree_from_args(engine, args)
    app = create_app(engine, store=store, model_name=args.model or "default", heads_note=heads_note, auth=auth,
                     tree=tree)
    print(f"gumiho-chat on http://{args.host}:{args.port}  (OpenAI API at /v1/chat/completions)", file=sys.stderr)
    # Never a public share link: this is a local app.
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def _exposed_warning(host: str, auth) -> str:
    if auth:
        return f"warning: listening on {host}: the chat asks for a login, but traffic is plain HTTP."
    return (f"warning: listening on {host}: anyone who can reach this machine can use the chat and read its "
            "history. Use --host 127.0.0.1 to keep it local, or --auth USER:PASSWORD.")


def _load(args):
    try:
        return engine_from_args(args)
    except GumihoError:
        raise
    except Exception as exc:  # not a model, unreadable, mismatched heads: one line, no traceback
        raise GumihoError(f"could not load the model {args.model or 'default'}"
                          f"{' with heads ' + str(args.heads) if args.heads else ''}: "
                          f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}") from None
