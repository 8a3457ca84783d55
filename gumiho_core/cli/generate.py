"""`generate`: answer one prompt from the command line, streaming it or as one JSON object."""
from __future__ import annotations

import json
import sys

from ..events import DoneEvent, StepEvent
from ..settings import GenerationSettings, SamplingSettings
from .options import add_model_args, add_tree_args, check_tree, engine_from_args, tree_from_args


def register(sub) -> None:
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
    g.set_defaults(func=run)


def run(args) -> int:
    # Built (and so checked) before the model loads: a typo should not cost a load.
    settings = GenerationSettings(
        max_new_tokens=args.max_new_tokens,
        speculative=not args.no_speculative,
        sampling=SamplingSettings(temperature=args.temperature, top_p=args.top_p, top_k=args.sample_top_k,
                                  repetition_penalty=args.repetition_penalty, seed=args.seed),
        tree=check_tree(args),
        stop_strings=tuple(args.stop or ()),
        on_overflow="truncate" if args.truncate else "error",
    )
    engine, heads_note = engine_from_args(args, need_heads=not args.no_speculative)
    if args.auto_tree:
        settings = settings.with_(tree=tree_from_args(engine, args))
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": args.prompt})
    prompt_ids = engine.target.encode(args.prompt) if args.raw else engine.target.chat_prompt(messages)
    done = None
    for event in engine.generate(prompt_ids, settings):
        if isinstance(event, StepEvent) and not args.json:
            print(event.text, end="", flush=True)
        elif isinstance(event, DoneEvent):
            done = event
    if args.json:
        print(_json_line(done, heads_note))
    else:
        s = done.stats
        print(f"\n[{s.new_tokens} tokens, {s.tokens_per_s:.1f} tok/s, tau {s.tau:.2f}, {s.forward_passes} target "
              f"passes, ttft {s.ttft_s * 1e3:.0f} ms, {done.finish_reason}]", file=sys.stderr)
    return 0


def _json_line(done: DoneEvent, heads_note: str) -> str:
    stats = done.stats
    return json.dumps({
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
    })
