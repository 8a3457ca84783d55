"""Interleaved, one process: plain and Gumiho on transformers float32 (the old floor), the fast
decoder in float32, int8 and int4; mt_bench prompts, greedy; medians of tokens/s."""
import json, sys, statistics
from gumiho_core.loading import load_engine
from gumiho_core.target import attach_fast_decoder
from gumiho_core.benchmark import read_prompts
from gumiho_core import GenerationSettings, run_to_end
n, new = int(sys.argv[1]), int(sys.argv[2])
e, _ = load_engine(None, None, quantize=None, fast=False)
t = e.target
decs = {"hf-float32": None}
for p in sys.argv[3].split(","):
    attach_fast_decoder(t, p); decs[p] = t.fast
res = {}
for text in read_prompts("../shared/bench/mt_bench.jsonl", n):
    ids = t.chat_prompt([{"role": "user", "content": text}])
    for p, d in decs.items():
        t.fast = d
        e.passes.sizes = ()
        outs = {}
        for spec in (False, True):
            done = run_to_end(e, ids, GenerationSettings(max_new_tokens=new, speculative=spec), reuse_prefix=False)
            r = res.setdefault(f"{p} {'gumiho' if spec else 'plain'}", {"tok_s": [], "tau": [], "tokens": 0, "passes": 0, "same": 0})
            r["tok_s"].append(done.stats.new_tokens / done.stats.total_s)
            r["tokens"] += done.stats.new_tokens; r["passes"] += done.stats.forward_passes
            outs[spec] = done.token_ids
        res[f"{p} gumiho"]["same"] += outs[True] == outs[False]
    print("prompt done", flush=True)
base = statistics.median(res["hf-float32 plain"]["tok_s"])
for k, r in res.items():
    med = statistics.median(r["tok_s"])
    print(f"{k:22s} {med:6.1f} tok/s  {med/base:4.2f}x hf-float32 plain  tau {r['tokens']/r['passes']:.2f}  spec==plain {r['same'] if 'gumiho' in k else '-'}/{n}")
json.dump(res, open(sys.argv[4], "w"))
