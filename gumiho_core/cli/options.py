"""Flags several subcommands share: which model and heads to load, and the draft tree."""
from __future__ import annotations

import argparse
import sys

from .. import loading
from ..errors import GumihoError
from ..settings import TreeSettings

TREE_FLAGS = ("top_k", "total_tokens", "depth", "mlp_topk", "pruning", "fta_tokens", "lookup_tokens")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder, .gguf file or hub id (default: embedded SmolLM2-135M)")
    p.add_argument("--heads", default=None, help="heads checkpoint folder (default: shipped heads for the default model)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--quantize", default="auto", choices=["auto", "none", "int8", "int4", "4bit", "8bit"],
                   help="weight-only int8 / int4 on the fast decoder (CPU or GPU; int4 on the engine's own "
                        "AVX2 / AVX512-VNNI / AMX kernels where they build), "
                        "bitsandbytes 4bit / 8bit (CUDA), none; auto (default): int4 for the embedded "
                        "model where int4 runs well (those kernels, or a CPU with bfloat16), else none "
                        "(docs/fast_decoder.md)")
    p.add_argument("--no-fast", dest="fast", action="store_false",
                   help="run every pass through transformers' forward instead of the fast decoder")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto")


def add_tree_args(p: argparse.ArgumentParser) -> None:
    d = TreeSettings()
    # Defaults are None so we can tell "not given" from "given": the measured budget
    # (--auto-tree) applies only where the user did not choose.
    p.add_argument("--top-k", type=int, default=None, help=f"draft beams per serial depth ({d.top_k})")
    p.add_argument("--total-tokens", type=int, default=None, help=f"tree nodes verified per step ({d.total_tokens})")
    p.add_argument("--depth", type=int, default=None, help=f"deepest draft token ({d.depth})")
    p.add_argument("--mlp-topk", type=int, default=None, help=f"candidates per node at MLP depths ({d.mlp_topk})")
    p.add_argument("--pruning", type=int, default=None, help=f"nodes kept per MLP depth ({d.pruning})")
    p.add_argument("--no-fta", action="store_true", help="disable Full Tree Attention supplements")
    p.add_argument("--fta-tokens", type=int, default=None,
                   help=f"tree nodes spent on Full Tree Attention supplements, 0 = off ({d.fta_tokens})")
    p.add_argument("--lookup-tokens", type=int, default=None,
                   help=f"tokens copied from the context as one more tree branch, 0 = off ({d.lookup_tokens})")
    p.add_argument("--auto-tree", action="store_true",
                   help="measure this machine's cost curve and the heads' acceptance, use the best tree")


def given_tree(args) -> dict:
    """The tree values typed on the command line (None = not given)."""
    given = {flag: getattr(args, flag, None) for flag in TREE_FLAGS}
    if getattr(args, "no_fta", False):
        given["fta"] = False
    return given


def check_tree(args) -> TreeSettings:
    """The tree the flags ask for, checked before a model loads: a typo should not cost a load."""
    return TreeSettings().with_overrides(**given_tree(args))


def engine_from_args(args, need_heads: bool = True, keep_transformers: bool = False):
    """(engine, heads note) for the model flags."""
    quantize = None if args.quantize == "none" else args.quantize
    return loading.load_engine(args.model, args.heads, dtype=args.dtype, quantize=quantize,
                               device=args.device, need_heads=need_heads, fast=args.fast,
                               keep_transformers=keep_transformers)


def training_quantize(args) -> str | None:
    """Training reads transformers' forward (features, gradients): bitsandbytes or nothing.
    "auto" is the chat's choice of precision, not training's."""
    if args.quantize in ("int8", "int4"):
        raise GumihoError(f"--quantize {args.quantize} is for the chat's fast decoder; "
                          "training reads the float model (or bitsandbytes 4bit / 8bit)")
    return None if args.quantize in ("auto", "none") else args.quantize


def tree_from_args(engine, args) -> TreeSettings:
    """The tree flags applied to this engine (measured first with --auto-tree)."""
    return loading.draft_tree_for(engine, auto=getattr(args, "auto_tree", False),
                                  log=lambda text: print(text, file=sys.stderr), **given_tree(args))
