"""The model + heads picker's choices: local folders found in the usual places.

Any other path can still be typed in; these are only suggestions.
"""
from __future__ import annotations

from pathlib import Path

from gumiho_core.loading import PROJECT_ROOT
from gumiho_core.heads import CONFIG_FILE, WEIGHTS_FILE

# Where heads land: shipped ones in assets/heads, fresh training runs in runs/.
HEADS_ROOTS = [PROJECT_ROOT / "assets" / "heads", PROJECT_ROOT / "runs"]
MODEL_ROOTS = [PROJECT_ROOT / "models"]


def _folders_with(roots: list[Path], required: tuple[str, ...], depth: int = 3) -> list[str]:
    found = []
    for root in roots:
        if not root.is_dir():
            continue
        candidates = [root] + [f for level in range(1, depth + 1) for f in root.glob("/".join(["*"] * level))]
        for folder in candidates:
            if folder.is_dir() and all((folder / name).is_file() for name in required):
                found.append(str(folder))
    return sorted(set(found))


def heads_choices() -> list[str]:
    return _folders_with(HEADS_ROOTS, (CONFIG_FILE, WEIGHTS_FILE))


def model_choices() -> list[str]:
    folders = _folders_with(MODEL_ROOTS, ("config.json",))
    ggufs = [str(p) for root in MODEL_ROOTS if root.is_dir() for p in root.rglob("*.gguf")]
    return sorted(folders + ggufs)
