"""Entry point: `python launch.py` opens the chat; `python launch.py --help` lists the commands."""
from gumiho_core.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
