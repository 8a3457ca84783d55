"""How many target passes run on a CPU weight pack (cpu_matmul.py), and tokens/s.

Default model and heads, the first N mt_bench prompts through the chat template, default
settings (128 new tokens). It only watches the target's lm_head, which every target pass
calls once with all its rows, so it runs on older checkouts too (from their root):
  LD_PRELOAD="$(.venv/bin/python -m gumiho_core.mkl_on_amd)" .venv/bin/python scripts/measure_pass_rows.py [N] [REPEATS]
"""
import collections, json, statistics, sys
sys.path.insert(0, ".")
from gumiho_core.target import load_target
from gumiho_core.heads import HeadCheckpoint
from gumiho_core.generate import Engine, run_to_end
from gumiho_core.settings import GenerationSettings

n_prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 8
repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 1
target = load_target(None)
heads = HeadCheckpoint.load("assets/heads/smollm2-135m-instruct", target)
engine = Engine(target, heads)
lm = target.lm_head
calls = []
orig = lm.forward
def watched(x):
    rows = x.reshape(-1, x.shape[-1]).shape[0]
    packs = getattr(lm, "packs", None)  # the new engine: one pack per prepared size
    if packs is None:
        packed = getattr(lm, "packed", None)
        packs = {packed[0]: None} if packed else {}
    calls.append((rows, rows in packs))
    return orig(x)
lm.forward = watched
prompts = [json.loads(l)["turns"][0] for l in open(sys.argv[3] if len(sys.argv) > 3 else "/work/shared/bench/mt_bench.jsonl")][:n_prompts]
ids = [target.chat_prompt([{"role": "user", "content": p}]) for p in prompts]
settings = GenerationSettings(max_new_tokens=128)
run_to_end(engine, ids[0], settings.with_(max_new_tokens=16))  # warm-up
results = []
rows_hist = collections.Counter()
for rep in range(repeats):
    for i, prompt in enumerate(ids):
        calls.clear()
        if hasattr(engine, "prefix"):
            engine.prefix = None  # every prompt pays its own prefill, before and after alike
        done = run_to_end(engine, prompt, settings)
        decode = calls[1:]  # the first call is the prefill's one row
        rows_hist.update(r for r, _ in decode)
        results.append({"prompt": i, "tokens": len(done.token_ids), "tau": done.stats.tau,
                        "tokens_per_s": done.stats.tokens_per_s, "passes": len(decode),
                        "packed_share": sum(p for _, p in decode) / max(1, len(decode)),
                        "tokens_hash": hash(tuple(done.token_ids))})
        print(json.dumps(results[-1]), flush=True)
print(json.dumps({
    "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in results),
    "median_packed_share": statistics.median(r["packed_share"] for r in results),
    "all_passes_packed_share": sum(r["packed_share"] * r["passes"] for r in results) / sum(r["passes"] for r in results),
    "tau": sum(r["tokens"] for r in results[:len(ids)]) / sum(r["passes"] + 1 for r in results[:len(ids)]),
    "rows_histogram": dict(sorted(rows_hist.items())),
}))
