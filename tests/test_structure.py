"""The shape of the code the architecture issue asked for, checked so it stays that way.

- no function in gumiho_core/ or app/ longer than 100 lines (about 60 is the aim);
- the command line (gumiho_core/cli/) sits on top: nothing else imports it;
- no import by name string (`__import__`, `importlib.import_module`): imports a reader can follow.
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CLI = ROOT / "gumiho_core" / "cli"
SOURCES = sorted([*(ROOT / "gumiho_core").rglob("*.py"), *(ROOT / "app").rglob("*.py")])
MAX_LINES = 100


def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def imported_modules(tree: ast.Module, path: Path) -> set[str]:
    """Every module `path` imports, as an absolute dotted name."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    if path.name == "__init__.py":
        package = ".".join(path.relative_to(ROOT).parts[:-1])
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def test_the_checks_see_the_code():
    assert len(SOURCES) > 20 and any(p.is_relative_to(CLI) for p in SOURCES)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_function_over_100_lines(path):
    long = [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)" for node in ast.walk(parsed(path))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_LINES]
    assert not long, long


@pytest.mark.parametrize("path", [p for p in SOURCES if not p.is_relative_to(CLI)],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_below_the_command_line_imports_it(path):
    cli_imports = [m for m in imported_modules(parsed(path), path) if m == "gumiho_core.cli" or
                   m.startswith("gumiho_core.cli.")]
    assert not cli_imports, cli_imports


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_import_by_name_string(path):
    calls = [ast.unparse(node.func) for node in ast.walk(parsed(path)) if isinstance(node, ast.Call)
             and ast.unparse(node.func) in ("__import__", "importlib.import_module", "import_module")]
    assert not calls, calls


def test_the_import_check_catches_a_cli_import(tmp_path):
    """The check above can fail: a relative import of the CLI from inside gumiho_core is seen."""
    fake = ROOT / "gumiho_core" / "fake_module.py"
    tree = ast.parse("from .cli.options import add_model_args\nfrom . import cli\n")
    assert "gumiho_core.cli.options" in imported_modules(tree, fake)
    assert "gumiho_core.cli" in imported_modules(tree, fake)
