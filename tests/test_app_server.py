"""The `serve` command: loopback by default, a warning elsewhere, never a public share link."""
from pathlib import Path

import pytest

import tiny
from gumiho_core import Engine, new_heads
from gumiho_core.cli import build_parser


@pytest.fixture
def fake_serve(monkeypatch):
    """cmd_serve with a tiny engine and uvicorn.run recorded instead of run."""
    import uvicorn

    from gumiho_core import loading

    target = tiny.tiny_target()
    monkeypatch.setattr(loading, "load_engine", lambda *a, **k: (Engine(target, new_heads(target)), "untrained"))
    calls = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: calls.append(kw))
    return calls


def test_defaults_are_local(tmp_path):
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.db, args.model) == ("127.0.0.1", 7860, None, None)


def test_serve_on_loopback_is_quiet(fake_serve, tmp_path, capsys):
    args = build_parser().parse_args(["serve", "--db", str(tmp_path / "c.db"), "--port", "7999"])
    assert args.func(args) == 0
    assert fake_serve == [{"host": "127.0.0.1", "port": 7999, "log_level": "warning"}]
    assert "warning" not in capsys.readouterr().err
    assert (tmp_path / "c.db").exists()


def test_serve_elsewhere_warns(fake_serve, tmp_path, capsys):
    args = build_parser().parse_args(["serve", "--host", "0.0.0.0", "--db", str(tmp_path / "c.db")])
    args.func(args)
    assert "warning: listening on 0.0.0.0" in capsys.readouterr().err


def test_no_share_links_in_the_app():
    for source in (Path(__file__).resolve().parent.parent / "app").glob("*.py"):
        assert "share=True" not in source.read_text(), source
