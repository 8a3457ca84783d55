"""A real gumiho-chat server process on a tiny random model, for tests that need a process
to kill or to load: `python tests/serve_tiny.py --port P --db FILE [--slow S] [--auth U:P]`.

--slow S sleeps S seconds after each engine step (so a test can act mid-answer).
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--db", required=True)
    p.add_argument("--slow", type=float, default=0.0)
    p.add_argument("--auth", default=None)
    args = p.parse_args()

    import uvicorn

    import tiny
    from app.server import create_app, parse_auth
    from gumiho_core import Engine, new_heads

    target = tiny.tiny_target(eos=False)
    engine = Engine(target, new_heads(target))
    if args.slow:
        real = engine.generate

        def slow_generate(*a, **k):
            for event in real(*a, **k):
                yield event
                time.sleep(args.slow)

        engine.generate = slow_generate
    app = create_app(engine, args.db, model_name="tiny", auth=parse_auth(args.auth))
    print("ready", flush=True)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
