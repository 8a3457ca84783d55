"""Loading: a target model, the heads that draft for it, and the draft tree they run with.

The one place every front end (command line, chat UI and its model picker, `serve`, the
benchmark) turns "which model, which heads, which precision, which device" into an Engine.
Heads come in two layouts, ours (heads.json + heads.safetensors) and the published
amd/Gumiho-* one (published.py); `heads_layout` tells them apart before seconds are spent
loading the target. The default model (no `model` given) drafts with the heads shipped in
assets/heads/.
"""
from __future__ import annotations

import ctypes
import sys
from dataclasses import replace
from pathlib import Path

from .errors import GumihoError
from .generate import Engine
from .cpu_matmul import bf16_packing_available
from .quantize import groupwise_kernels
from .heads import CONFIG_FILE, WEIGHTS_FILE, GumihoHeads, HeadCheckpoint, new_heads
from .published import PUBLISHED_CONFIG, WEIGHT_CHOICES, load_published, weights_file
from .settings import TreeSettings
from .target import load_target

PROJECT_ROOT = Path(__file__).resolve().parent.parent
SHIPPED_HEADS = PROJECT_ROOT / "assets" / "heads" / "smollm2-135m-instruct"
# The embedded default model's precision when none is asked for, where int4 runs well (a CPU
# with bfloat16 support, or AVX2 and the engine's CPU kernels): int4, its GGUF's own 4-bit grid.
# Measured on mt_bench (20 x 256, docs/fast_decoder.md): plain 1.40x and Gumiho 1.14x float32's,
# peak memory under 1 GB (docs/benchmarks.md), speculative == plain in every answer (blocked
# attention); on an AVX2-only CPU plain 2.4x float32's (docs/benchmarks.md). Elsewhere float32.
DEFAULT_MODEL_QUANTIZE = "int4"


def load_engine(model: str | None = None, heads: str | None = None, dtype: str = "float32",
                quantize: str | None = "auto", device: str = "cpu", need_heads: bool = True,
                warn=lambda text: print(text, file=sys.stderr), fast: bool = True,
                keep_transformers: bool = False) -> tuple[Engine, str]:
    """Target + heads. Returns (engine, heads note: "shipped", the heads path, "untrained" or "").

    quantize "auto": DEFAULT_MODEL_QUANTIZE for the embedded default model in float32 on a CPU,
    else none. Where the fast decoder runs the passes, transformers' own decoder layers are released
    (memory) unless `keep_transformers` (the benchmark's `hf` methods run them).

    Without `heads`: the default model gets its shipped heads; another model gets untrained
    heads if `need_heads` (drafting stays lossless, only slow: `warn` says so), else none.
    """
    if heads:
        heads_layout(Path(heads))  # a wrong path fails before the target loads
    if quantize == "auto":
        default_case = model is None and dtype == "float32" and device == "cpu" and fast and int4_runs_well()
        quantize = DEFAULT_MODEL_QUANTIZE if default_case else None
    target = load_target(model, dtype=dtype, quantize=quantize, device=device, fast=fast,
                         release_transformers=not keep_transformers)
    if target.fast_note:
        warn(f"note: {target.fast_note}; passes run on transformers' forward")
    if target.fast is not None and target.fast.kernels_note:
        warn(f"note: {target.fast.kernels_note}")
    _return_freed_memory()
    if heads:
        return Engine(target, load_heads(heads, target)), str(heads)
    if model is None and SHIPPED_HEADS.exists():
        return Engine(target, HeadCheckpoint.load(SHIPPED_HEADS, target)), "shipped"
    if need_heads:
        warn("note: no trained heads for this model; drafting with untrained heads (lossless, slow)")
        return Engine(target, new_heads(target)), "untrained"
    return Engine(target, None), ""


def int4_runs_well() -> bool:
    """int4 on groupwise_matmul.c (AVX2 / AVX-512), or on PyTorch's kernel where the CPU runs
    bfloat16; elsewhere its bfloat16 activations would be emulated, slower than float32."""
    return bf16_packing_available() or groupwise_kernels()[0] is not None


def _return_freed_memory() -> None:
    """Loading makes float32 copies it frees again (conversion, quantization, released layers);
    glibc keeps such memory for reuse unless asked to hand it back (int4 chat after one answer:
    1.70 -> 1.47 GB resident)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def load_heads(path, target=None, device=None, dtype=None) -> GumihoHeads:
    """Heads from a folder in our format or in the published amd/Gumiho-* layout."""
    folder = Path(path)
    if heads_layout(folder) == "ours":
        return HeadCheckpoint.load(folder, target, device, dtype)
    return load_published(folder, target, device, dtype)


def _rows_are_dear(target) -> bool:
    """int8 / int4 weight-only kernels on a CPU: a pass's cost grows with every few rows."""
    fast = getattr(target, "fast", None)
    return fast is not None and fast.precision in ("int8", "int4") and target.device.type == "cpu"


def _default_tree(target) -> TreeSettings:
    """The built-in tree for this target's passes: smaller where rows are dear, smallest where
    groupwise_matmul.c runs without AMX (each row ~3 ms on AVX2 and ~1.5 ms on AMD's
    AVX512-VNNI, 30-40% of a one-token pass, against ~0.5 ms with AMX)."""
    if not _rows_are_dear(target):
        return TreeSettings()
    kernels, _ = groupwise_kernels()  # the unit the int4 / 8-bit products run on
    if kernels is not None and not kernels.amx:
        return TreeSettings.int4_cpu_without_amx()
    return TreeSettings.weight_only_cpu()


def heads_layout(folder: Path) -> str:
    """Which layout a heads folder holds, "ours" or "published"; a clear error for anything else."""
    folder = Path(folder)
    if not folder.exists():
        raise GumihoError(f"heads not found: {folder}")
    if not folder.is_dir():
        raise GumihoError(f"heads must be a folder, got the file {folder}")
    if (folder / CONFIG_FILE).is_file() or (folder / WEIGHTS_FILE).is_file():
        return "ours"
    if (folder / PUBLISHED_CONFIG).is_file() and weights_file(folder) is not None:
        return "published"
    raise GumihoError(
        f"{folder} is not a heads checkpoint: expected {CONFIG_FILE} + {WEIGHTS_FILE} (ours) or "
        f"{PUBLISHED_CONFIG} + {' / '.join(WEIGHT_CHOICES)} (amd/Gumiho-* layout)"
    )


def draft_tree_for(engine: Engine, auto: bool = False, log=None, **given) -> TreeSettings:
    """The tree an engine answers with: the one place the default tree is decided.

    The built-in defaults (smaller where the target's passes grow dear with rows), or with
    `auto` the tree measured best on this machine for these heads (tree_budget.py, cached);
    values the user gave (`given`, None = not given) win.
    """
    base = _default_tree(engine.target)
    if auto and engine.heads is not None:
        from .tree_budget import choose_tree, format_budget  # measures only when asked

        measured, report = choose_tree(engine)
        base = measured_shape_on(base, measured, report)
        if log:
            log(format_budget(report))
    return base.with_overrides(**given)


# The budget's expected speed leaves out what a heads step costs in the loop beyond its pass
# and drafting (the serial head catching up on tokens it skipped, the guard): on the AMD EPYC
# without AMX it expected 2/3/1 at 1.03x plain, and drafting it at every step ran at 0.84-0.90x.
GUARD_UNLESS_EXPECTED = 1.1


def measured_shape_on(base: TreeSettings, measured: TreeSettings, report: dict) -> TreeSettings:
    """The budget's tree shape (heads' beams, nodes, depth) with the default's other choices:
    the budget times the heads' trees alone, so the looked-up chain's length stays the
    default's, and greedy steps are guarded where the default guards them or where the best
    tree is not expected to beat plain decoding clearly (the guard then drafts only where it
    measures a gain)."""
    clear_gain = report["best"]["tokens_per_s"] >= GUARD_UNLESS_EXPECTED * report["plain_tokens_per_s"]
    return replace(measured, lookup_tokens=base.lookup_tokens, guard_greedy=base.guard_greedy or not clear_gain)
