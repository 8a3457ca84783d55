"""`train-data`, `train` and `export-heads`: making heads by self-distillation (train_data.py, train.py)."""
from __future__ import annotations

import sys

import torch

from ..errors import GumihoError
from ..target import load_target
from ..train import DRAFT_VOCAB_SIZE, P_WEIGHT, V_WEIGHT, export_heads, train
from ..prompts import builtin_prompts
from ..train_data import generate_dataset, read_prompt_file, self_prompts_for
from .options import add_model_args, training_quantize


def register(sub) -> None:
    _register_train_data(sub)
    _register_train(sub)
    e = sub.add_parser("export-heads", help="copy a heads checkpoint with float16 weights (for shipping)")
    e.add_argument("source", help="heads folder, e.g. RUN/heads")
    e.add_argument("dest", help="output folder, e.g. assets/heads/smollm2-135m-instruct")
    e.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    e.set_defaults(func=run_export)


def _register_train_data(sub) -> None:
    p = sub.add_parser("train-data", help="self-distil training data for the heads (target answers prompts)")
    p.add_argument("--out", required=True, help="output folder (rerun the same command to resume)")
    p.add_argument("--num-prompts", type=int, default=512, help="built-in generated prompts (0 = none)")
    p.add_argument("--prompts", default=None, help="JSONL file of extra prompts ({'turns': [...]} a line)")
    p.add_argument("--self-prompts", type=int, default=0,
                   help="prompts written by the target itself (sampled once into OUT/self_prompts.jsonl)")
    p.add_argument("--seed", type=int, default=0, help="seed of the built-in prompt generator and of --self-prompts")
    p.add_argument("--max-new-tokens", type=int, default=192, help="answer length cap per turn")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--shard-size", type=int, default=64, help="conversations per shard file")
    p.add_argument("--mask", default="answer", choices=["answer", "all"], help="which tokens the loss counts")
    p.add_argument("--feature-dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--system", default=None, help="system prompt for every conversation")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    add_model_args(p)
    p.set_defaults(func=run_train_data)


def _register_train(sub) -> None:
    p = sub.add_parser("train", help="train Gumiho heads on data made by train-data")
    p.add_argument("--data", required=True, action="append",
                   help="folder written by `train-data` (repeat to train on several)")
    p.add_argument("--out", required=True, help="run folder: heads/ each epoch, state/ for resuming")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--draft-vocab", type=int, default=None,
                   help=f"draft vocabulary size, the data's most frequent tokens (default {DRAFT_VOCAB_SIZE}; "
                        "with --init: theirs unless given)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-resume", action="store_true", help="start over even if the run folder has a state")
    p.add_argument("--mixed-precision", default="no", choices=["no", "bf16"],
                   help="autocast the matmuls (bf16: faster on CPUs with AVX512-BF16 and on GPUs)")
    p.add_argument("--init", default=None,
                   help="start from these trained heads (a heads folder) instead of fresh ones")
    p.add_argument("--token-weight", type=float, default=P_WEIGHT,
                   help=f"weight of the cross-entropy against the target's next-token distribution "
                        f"(the features' SmoothL1 weighs {V_WEIGHT}; default {P_WEIGHT}, Gumiho's)")
    p.add_argument("--threads", type=int, default=None)
    add_model_args(p)
    p.set_defaults(func=run_train)


def run_train_data(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = builtin_prompts(args.num_prompts, args.seed) if args.num_prompts > 0 else []
    if args.prompts:
        prompts += read_prompt_file(args.prompts)
    if not prompts and args.self_prompts <= 0:
        raise GumihoError("no prompts: give --num-prompts > 0, --self-prompts > 0 or --prompts FILE")
    target = load_target(args.model, dtype=args.dtype, quantize=training_quantize(args), device=args.device, fast=False)
    if args.self_prompts > 0:
        prompts += self_prompts_for(target, args.out, args.self_prompts, args.seed, args.batch_size)
    manifest = generate_dataset(target, args.out, prompts, args.max_new_tokens, args.batch_size, args.shard_size,
                                args.mask, args.feature_dtype, args.system)
    tokens = sum(s["tokens"] for s in manifest["shards"])
    conversations = sum(s["conversations"] for s in manifest["shards"])
    print(f"{conversations} conversations, {tokens} tokens in {args.out}")
    return 0


def run_train(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.model, dtype=args.dtype, quantize=training_quantize(args), device=args.device, fast=False)
    result = train(target, args.data, args.out, epochs=args.epochs, batch_size=args.batch_size,
                   grad_accum=args.grad_accum, lr=args.lr, warmup_steps=args.warmup_steps, max_len=args.max_len,
                   draft_vocab_size=args.draft_vocab, seed=args.seed, resume=not args.no_resume,
                   mixed_precision=args.mixed_precision, init=args.init,
                   token_weight=args.token_weight, log=lambda s: print(s, file=sys.stderr, flush=True),
                   progress=True)
    print(f"heads written to {result['heads']}")
    return 0


def run_export(args) -> int:
    print(f"wrote {export_heads(args.source, args.dest, args.dtype)}")
    return 0
