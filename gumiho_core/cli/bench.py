"""`bench`: speed side by side (plain, Gumiho, transformers), the paper's way (benchmark.py)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from ..benchmark import DEFAULT_METHODS, METHODS, benchmark, format_table, read_prompts
from ..errors import GumihoError
from ..mkl_on_amd import active as mkl_on_amd_active
from ..peers import METHOD as PEER, peer_gguf
from ..settings import GenerationSettings, SamplingSettings
from ..tree_budget import choose_tree, format_budget
from .options import add_model_args, add_tree_args, check_tree, engine_from_args, tree_from_args


def register(sub) -> None:
    b = sub.add_parser("bench", help="speed: plain vs Gumiho vs transformers, side by side")
    b.add_argument("--prompts", action="append", required=True, help="JSONL with 'turns' (repeatable)")
    b.add_argument("--limit", type=int, default=None, help="first N prompts of each file")
    b.add_argument("--max-new-tokens", type=int, default=256)
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"among {', '.join(METHODS)}")
    b.add_argument("--threads", type=int, default=None)
    b.add_argument("--json", default=None, help="write the full report here")
    add_model_args(b)
    add_tree_args(b)
    b.set_defaults(func=run)


def run(args) -> int:
    prompt_sets = {Path(p).stem: read_prompts(p, args.limit) for p in args.prompts}
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens, tree=check_tree(args),
                                  sampling=SamplingSettings(temperature=args.temperature, seed=args.seed))
    methods = tuple(args.methods.split(","))
    if set(methods) - set(METHODS) or "plain" not in methods:
        raise GumihoError(f"--methods must include plain and be among {', '.join(METHODS)}")
    gguf = peer_gguf(args.model) if PEER in methods else None  # refused before a model loads
    torch.set_num_threads(args.threads or torch.get_num_threads())
    # transformers' own layers stay loaded only for the methods that run them
    engine, heads_note = engine_from_args(args, keep_transformers=any(m.startswith("hf") for m in methods))
    mkl = "MKL AVX-512/AVX2 path on AMD (mkl_on_amd)" if mkl_on_amd_active() else "MKL default path"
    print(f"target {engine.target.name}, heads {heads_note}, threads {torch.get_num_threads()}, {mkl}", file=sys.stderr)
    # The measured cost curve and the budget it implies are always printed; they are used
    # with --auto-tree (explicit tree flags still win).
    _, budget = choose_tree(engine)
    print(format_budget(budget))
    settings = settings.with_(tree=tree_from_args(engine, args))
    print(f"tree used: {settings.tree}")
    report = benchmark(engine, prompt_sets, settings, methods, log=lambda s: print(s, file=sys.stderr), gguf=gguf)
    report.update(heads=heads_note, tree_budget=budget, target=engine.target.name, mkl_on_amd=mkl_on_amd_active())
    print(format_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0
