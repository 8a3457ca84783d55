"""Command line: `python launch.py [serve]`, `generate`, and the commands other modules add.

Errors the user can fix print one line (`error: ...`) and exit with status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .errors import GumihoError

PROJECT_ROOT = Path(__file__).resolve().parent.parent
SHIPPED_HEADS = PROJECT_ROOT / "assets" / "heads" / "smollm2-135m-instruct"


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder, .gguf file or hub id (default: embedded SmolLM2-135M)")
    p.add_argument("--heads", default=None, help="heads checkpoint folder (default: shipped heads for the default model)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--quantize", default=None, choices=["4bit", "8bit"], help="bitsandbytes quantization")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto")


def add_tree_args(p: argparse.ArgumentParser) -> None:
    from .settings import TreeSettings

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


TREE_FLAGS = ("top_k", "total_tokens", "depth", "mlp_topk", "pruning", "lookup_tokens")


def tree_from_args(args, base=None):
    """Tree settings: explicit flags over `base` (the measured choice, or the defaults)."""
    from dataclasses import replace

    from .settings import TreeSettings

    tree = base or TreeSettings()
    given = {f: getattr(args, f) for f in TREE_FLAGS if getattr(args, f, None) is not None}
    tree = replace(tree, **given)
    if getattr(args, "fta_tokens", None) is not None:
        tree = replace(tree, fta=args.fta_tokens > 0, fta_tokens=args.fta_tokens)
    if args.no_fta:
        tree = replace(tree, fta=False, fta_tokens=0)
    return replace(tree, fta_tokens=min(tree.fta_tokens, max(0, tree.total_tokens - 2)))


def chosen_tree(engine, args, log=None):
    """--auto-tree: the measured best tree (cached), with explicit flags on top."""
    if not getattr(args, "auto_tree", False) or engine.heads is None:
        return tree_from_args(args)
    from .tree_budget import choose_tree, format_budget

    tree, report = choose_tree(engine)
    if log:
        log(format_budget(report))
    return tree_from_args(args, base=tree)


def load_engine(args, need_heads: bool = True):
    """Target + heads from CLI arguments. Returns (engine, heads_note)."""
    from .generate import Engine
    from .heads import HeadCheckpoint, new_heads
    from .target import load_target

    if args.heads:
        from .published import heads_layout, load_heads

        heads_layout(Path(args.heads))  # a wrong path fails before the target loads
    target = load_target(args.model, dtype=args.dtype, quantize=args.quantize, device=args.device)
    heads, note = None, ""
    if args.heads:
        heads = load_heads(args.heads, target)
        note = str(args.heads)
    elif args.model is None and SHIPPED_HEADS.exists():
        heads = HeadCheckpoint.load(SHIPPED_HEADS, target)
        note = "shipped"
    elif need_heads:
        heads = new_heads(target)
        note = "untrained"
        print("note: no trained heads for this model; drafting with untrained heads (lossless, slow)", file=sys.stderr)
    return Engine(target, heads), note


def cmd_generate(args) -> int:
    from .events import DoneEvent, StepEvent
    from .settings import GenerationSettings, SamplingSettings

    settings = GenerationSettings(
        max_new_tokens=args.max_new_tokens,
        speculative=not args.no_speculative,
        sampling=SamplingSettings(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.sample_top_k,
            repetition_penalty=args.repetition_penalty,
            seed=args.seed,
        ),
        tree=tree_from_args(args),
        stop_strings=tuple(args.stop or ()),
        on_overflow="truncate" if args.truncate else "error",
    )
    settings.validate()  # before the model loads: a typo should not cost a load
    engine, heads_note = load_engine(args, need_heads=not args.no_speculative)
    if args.auto_tree:
        settings = settings.with_(tree=chosen_tree(engine, args, log=lambda s: print(s, file=sys.stderr)))
    messages = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    messages.append({"role": "user", "content": args.prompt})
    prompt_ids = engine.target.chat_prompt(messages) if not args.raw else engine.target.encode(args.prompt)
    done = None
    for event in engine.generate(prompt_ids, settings):
        if isinstance(event, StepEvent) and not args.json:
            print(event.text, end="", flush=True)
        elif isinstance(event, DoneEvent):
            done = event
    stats = done.stats
    if args.json:
        print(
            json.dumps(
                {
                    "text": done.text,
                    "token_ids": done.token_ids,
                    "new_tokens": stats.new_tokens,
                    "forward_passes": stats.forward_passes,
                    "tau": round(stats.tau, 4),
                    "tokens_per_s": round(stats.tokens_per_s, 3),
                    "ttft_s": round(stats.ttft_s, 4),
                    "speculative": stats.speculative,
                    "finish_reason": done.finish_reason,
                    "acceptance_per_depth": [round(a, 4) for a in stats.acceptance_per_depth],
                    "heads": heads_note,
                }
            )
        )
    else:
        print(
            f"\n[{stats.new_tokens} tokens, {stats.tokens_per_s:.1f} tok/s, tau {stats.tau:.2f}, "
            f"{stats.forward_passes} target passes, ttft {stats.ttft_s * 1e3:.0f} ms, {done.finish_reason}]",
            file=sys.stderr,
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="launch.py", description="gumiho-chat: local chat with Gumiho decoding")
    sub = parser.add_subparsers(dest="command")

    g = sub.add_parser("generate", help="answer one prompt from the command line")
    g.add_argument("prompt")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--sample-top-k", type=int, default=0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--system", default=None, help="system prompt")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--raw", action="store_true", help="no chat template: the prompt is plain text")
    g.add_argument("--truncate", action="store_true", help="drop the oldest prompt tokens if it is too long")
    g.add_argument("--no-speculative", action="store_true", help="plain decoding (the baseline)")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_args(g)
    add_tree_args(g)
    g.set_defaults(func=cmd_generate)

    for register in _extra_commands():
        register(sub)
    return parser


def _extra_commands():
    """Commands that live beside the engine (UI, training, benchmark), if present."""
    registrars = []
    for module in ("app.server", "gumiho_core.train_data", "gumiho_core.train", "gumiho_core.benchmark"):
        try:
            mod = __import__(module, fromlist=["register_cli"])
        except ModuleNotFoundError as exc:
            if exc.name and module.startswith(exc.name):
                continue
            raise
        registrars.append(mod.register_cli)
    return registrars


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["serve", *argv]  # `python launch.py` opens the chat
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args) or 0
    except GumihoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
