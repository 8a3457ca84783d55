"""Choosing the draft tree for the machine at hand, from measurements rather than GPU lore.

Two measurements, both cached under the user cache folder:
1. the cost curve: milliseconds of one target pass as a function of the number of tree
   tokens verified, at a typical context length, on this device;
2. the heads' acceptance: a short calibration generation with a large tree records, per
   step, every node's score and the path the target accepted.
Because the tree of budget n is the n best-scored nodes of the same candidate pool (and
the target's choices along the path do not depend on which other nodes are in the tree),
one large-tree run tells what any smaller tree or shallower depth would have accepted.
Expected speed for (top_k, total_tokens, depth) = expected tau / (verify cost + draft cost),
and the best one is chosen. Explicit tree settings always override it.
"""
from __future__ import annotations

import hashlib
import json
import statistics
import time
from dataclasses import asdict

import torch

from .cpu_matmul import PACKING_AVAILABLE
from .draft_tree import DraftTree
from .drafter import RecordingDrafter
from .generate import Engine, run_to_end
from .mkl_on_amd import active as mkl_on_amd_active
from .settings import GenerationSettings, TreeSettings
from .target import cache_dir
from .verify import TargetPasses

# Small sizes matter: where a pass over 2-3 tokens costs about as much as over one (MKL's
# vector kernels on a CPU), a one- or two-token draft is the tree that pays.
COST_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)
DEPTHS = (1, 2, 3, 4, 5, 7)
# A larger pass timed below this share of a smaller one, and by more than this many ms (a
# tiny model's sub-millisecond passes jitter by more than a third): the machine was busy.
DISTURBED_BELOW, DISTURBED_MS = 2 / 3, 1.0
CALIBRATION_TOKENS = 80  # per prompt: long enough to leave the easy opening words
CALIBRATION_PROMPTS = [
    "Explain how a bicycle works, step by step.",
    "Write a short email inviting a colleague to lunch on Friday.",
    "def fibonacci(n):\n    # return the n-th Fibonacci number\n",
    "A shop sells pens at 3 dollars each. How much do 7 pens cost? Explain.",
    "Describe a rainy evening in a small harbour town, in the voice of an old fisherman.",
    "What are the main causes of inflation, and how do central banks respond to it?",
]


def _cache_file(kind: str, key: dict):
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "tree_budget" / f"{kind}-{digest}.json"


@torch.inference_mode()
def measure_cost_curve(target, sizes=COST_SIZES, context: int = 256, reps: int = 7, use_cache=True) -> dict:
    """{tree tokens: median ms of one verification pass} at `context` cached tokens, through the
    same passes generation runs (TargetPasses: the fast decoder or transformers' forward)."""
    key = {**_machine_key(target), "sizes": list(sizes), "context": context}
    path = _cache_file("cost", key)
    if use_cache and path.is_file():
        cached = {int(k): v for k, v in json.loads(path.read_text()).items()}
        if not disturbed(cached):  # one cached before this check was made may be
            return cached
    curve = _time_passes(target, sizes, context, reps)
    if disturbed(curve):  # other work ran meanwhile: once more, and kept only if it looks right
        curve = _time_passes(target, sizes, context, reps)
    if not disturbed(curve):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(curve))
    return curve


def disturbed(curve: dict) -> bool:
    """Whether a cost curve was timed while other work took the CPU: a pass of more tokens timed
    well below one of fewer (seen: 94 ms for 2 tokens, 56 for 3, from a curve then cached and
    shown by every later bench). Such a curve is measured again rather than kept."""
    times = [curve[n] for n in sorted(curve, key=int)]
    return any(later < DISTURBED_BELOW * earlier and earlier - later > DISTURBED_MS
               for i, earlier in enumerate(times) for later in times[i + 1:])


def _time_passes(target, sizes, context: int, reps: int) -> dict:
    """{tree tokens: median ms of a verification pass}, sizes timed in turn, `reps` rounds."""
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, target.vocab_size, (context,), generator=g).to(target.device)
    passes = TargetPasses(target)
    cache = passes.new_cache()
    passes.prefill(cache, prefix, 0)
    # A chain is as costly as any tree of n nodes: the cost depends on n, not the shape.
    trees = {n: DraftTree(torch.randint(0, target.vocab_size, (n,), generator=g), [-1, *range(n - 1)],
                          list(range(n)), ["root"] + ["serial"] * (n - 1)) for n in sizes}
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for rep in range(reps + 1):
        for n in sizes:  # sizes interleaved, so a burst of other work spreads over all of them
            passes.prepare((n,))  # as generation prepares for its tree size (not timed)
            _sync(target)
            start = time.perf_counter()
            _, logits = passes.verify(cache, trees[n], context)
            logits.argmax(-1).tolist()  # the greedy choices a step makes
            _sync(target)
            if rep:  # the first round warms up
                times[n].append((time.perf_counter() - start) * 1e3)
            cache.crop(context)  # back to the prefix for the next pass
    return {n: statistics.median(times[n]) for n in sizes}


def _machine_key(target) -> dict:
    """What a measured cost depends on besides the model: cached results are keyed on it."""
    fast = target.fast
    return {"target": target.name, "device": str(target.device), "dtype": str(target.base.dtype),
            "threads": torch.get_num_threads(),
            "mkl_on_amd": mkl_on_amd_active(),  # MKL's AVX-512 path changes the whole curve
            "lm_head": type(target.lm_head).__name__,  # so do the weight layouts (cpu_matmul.py)
            "packed_sgemm": PACKING_AVAILABLE,
            "attention": getattr(target.config, "_attn_implementation", None),  # and attention.py
            # and the fast decoder, by its precision (quantize.py)
            "decoder": None if fast is None else f"fast-{fast.dtype}-{type(fast.layers[0].down).__name__}",
            # and its glue and attention: cpu_kernels.c, or PyTorch operations
            "kernels": None if fast is None or fast.kernels is None else fast.kernels.version}


def _sync(target):
    if target.device.type == "cuda":
        torch.cuda.synchronize()


def accepted_length(tree: DraftTree, path: list[int], budget: int, depth: int) -> int:
    """Drafts the sub-tree of the `budget - 1` best nodes within `depth` would have accepted."""
    eligible = [i for i in range(1, len(tree)) if tree.depths[i] <= depth and tree.sources[i] != "fta"]
    kept = set(sorted(eligible, key=lambda i: (-tree.scores[i], i))[: budget - 1])
    n = 0
    for node in path[1:]:
        if node not in kept:
            break
        n += 1
    return n


def _tree(top_k: int, total_tokens: int, depth: int, lookup_tokens: int = 0) -> TreeSettings:
    # Calibration drafts with the heads alone (lookup 0): it measures what the heads accept.
    return TreeSettings(top_k=top_k, total_tokens=total_tokens, depth=depth, mlp_topk=top_k, pruning=2 * top_k,
                        fta=False, fta_tokens=0, lookup_tokens=lookup_tokens)


def calibrate(engine: Engine, top_ks=(2, 4, 6), big: int = 48,
              max_new_tokens: int = CALIBRATION_TOKENS) -> dict:
    """Per top_k: the traced (tree, path) steps of a large-tree run over the built-in prompts,
    and the drafting time per step at each depth (a depth-1 draft skips the second serial
    step and the MLP heads, so it costs a fraction of a depth-7 one)."""
    ids = [engine.target.chat_prompt([{"role": "user", "content": p}]) for p in CALIBRATION_PROMPTS]
    traces = {k: trace_steps(engine, ids, k, big, max_new_tokens) for k in top_ks}
    draft_ms = {f"{k}/{depth}": drafting_ms(engine, ids[0], k, depth) for k in top_ks for depth in DEPTHS}
    return {"traces": traces, "draft_ms": draft_ms}


def trace_steps(engine: Engine, prompts: list[list[int]], top_k: int, big: int, max_new_tokens: int) -> list:
    """Every (tree, accepted path) of the engine's heads drafting a `big`-node tree, depth 7,
    over `prompts`."""
    recorder = RecordingDrafter(engine.drafter)
    for prompt in prompts:
        settings = GenerationSettings(max_new_tokens=max_new_tokens, tree=_tree(top_k, big, 7))
        run_to_end(engine, prompt, settings, drafter=recorder)
    return recorder.steps


def drafting_ms(engine: Engine, prompt: list[int], top_k: int, depth: int) -> float:
    """Milliseconds of drafting a step at this top_k and depth (short runs: only the drafting
    time is read). The fastest of three: other work on the machine only ever adds time, and
    one disturbed run must not make a cheap tree look dear."""
    runs = [run_to_end(engine, prompt, GenerationSettings(max_new_tokens=16, tree=_tree(top_k, 8, depth)))
            for _ in range(3)]
    return min(r.stats.draft_s / max(r.stats.forward_passes - 1, 1) * 1e3 for r in runs)


def choose_tree(engine: Engine, use_cache: bool = True, log=None) -> tuple[TreeSettings, dict]:
    """The tree that maximises expected tokens/s here. Returns (settings, report)."""
    heads = engine.heads
    fingerprint = float(sum(p.double().sum() for p in heads.parameters())) if heads is not None else 0.0
    layers = sorted({type(m).__name__ for m in heads.modules()}) if heads is not None else []
    key = {**_machine_key(engine.target), "heads": fingerprint, "draft_layers": layers, "depths": list(DEPTHS),
           "calibration": [CALIBRATION_PROMPTS, CALIBRATION_TOKENS]}  # a new calibration must not reuse an old choice
    path = _cache_file("choice", key)
    if use_cache and path.is_file():
        report = json.loads(path.read_text())
        if not disturbed(report["cost_curve_ms"]):
            return TreeSettings(**report["chosen"]), report
    curve = measure_cost_curve(engine.target)
    cal = calibrate(engine)
    candidates = []
    for k, steps in cal["traces"].items():
        for n in [s for s in curve if s > 1]:
            for depth in DEPTHS:
                tau = 1 + statistics.mean(accepted_length(t, p, n, depth) for t, p in steps) if steps else 1.0
                ms = curve[n] + cal["draft_ms"][f"{k}/{depth}"]
                candidates.append({"top_k": k, "total_tokens": n, "depth": depth, "tau": tau,
                                   "step_ms": ms, "tokens_per_s": tau / ms * 1e3})
    plain_tps = 1e3 / curve[1]
    best = max(candidates, key=lambda c: c["tokens_per_s"])
    chosen = _tree(best["top_k"], best["total_tokens"], best["depth"], TreeSettings().lookup_tokens)
    report = {"cost_curve_ms": curve, "draft_ms": cal["draft_ms"], "plain_tokens_per_s": plain_tps,
              "best": best, "chosen": asdict(chosen),
              "top": sorted(candidates, key=lambda c: -c["tokens_per_s"])[:8]}
    if not disturbed(curve):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))
    return chosen, report


def format_budget(report: dict) -> str:
    curve = report["cost_curve_ms"]
    lines = ["target pass cost (ms) by tree tokens: " + ", ".join(f"{n}: {ms:.0f}" for n, ms in curve.items()),
             "draft cost (ms/step) by top_k/depth: " + ", ".join(f"{k}: {ms:.0f}" for k, ms in report["draft_ms"].items()),
             "best expected: " + ", ".join(f"{c['top_k']}/{c['total_tokens']}/{c['depth']} tau {c['tau']:.2f} "
                                         f"{c['tokens_per_s']:.1f} tok/s" for c in report["top"][:4]),
             f"chosen tree: top_k {report['chosen']['top_k']}, total_tokens {report['chosen']['total_tokens']}, "
             f"depth {report['chosen']['depth']} (plain would be {report['plain_tokens_per_s']:.1f} tok/s)"]
    return "\n".join(lines)
