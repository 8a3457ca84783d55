"""How far the heads' trees could speed greedy decoding up on this machine, at best.

    python scripts/speedup_bound.py 20 128      # mt_bench prompts, new tokens each

Measures what the tree budget measures (tree_budget.py), on mt_bench prompts instead of the
built-in calibration ones: the cost of a target pass by rows, the drafting cost by top_k and
depth, and what the target accepted of a large tree at every step (any smaller tree's
acceptance follows from it). Then, for every tree, the expected speed against plain decoding's
pass, under four assumptions, each kinder than the last:

    measured       the pass and the drafting as timed here
    free drafting  the heads cost nothing (nor does the glue around a pass)
    peak rows      and each extra row costs PEAK_ROW_SHARE of what it costs now: the kernels
                   at the integer unit's peak (docs/fast_decoder.md: ~0.8 of it today)
    every draft    and every drafted node on the path is accepted (a perfect drafter):
                   a chain as long as the tree, a pure bound on what rows can buy

and prints the best tree under each; then, per tree size, the heads' best tau against the tau
that GOAL times plain decoding would need with free drafting and peak rows. The looked-up
chain is left out: it pays only where the answer repeats its context, and the benchmark
measures it as it is.
"""
import statistics
import sys

from gumiho_core.benchmark import read_prompts
from gumiho_core.loading import load_engine
from gumiho_core.tree_budget import DEPTHS, accepted_length, drafting_ms, measure_cost_curve, trace_steps

PEAK_ROW_SHARE = 0.8
GOAL = 1.6  # issue 18's bar: Gumiho at 1.6x plain decoding
TOP_KS = (2, 4, 6)
BIG_TREE = 48


def main(count: int, new_tokens: int) -> None:
    engine, _ = load_engine()
    prompts = [engine.target.chat_prompt([{"role": "user", "content": text}])
               for text in read_prompts("../shared/bench/mt_bench.jsonl", count)]
    curve = measure_cost_curve(engine.target, reps=25, use_cache=False)  # the 1-row pass sets every ratio
    print("pass ms by rows:", {n: round(ms, 2) for n, ms in curve.items()})
    one = curve[1]
    peak = {n: one + PEAK_ROW_SHARE * (ms - one) for n, ms in curve.items()}  # each row at the unit's peak
    best = {name: (0.0, "") for name in ("measured", "free drafting", "peak rows", "every draft")}
    best_tau = dict.fromkeys((size for size in curve if size > 1), 1.0)
    for k in TOP_KS:
        steps = trace_steps(engine, prompts, k, BIG_TREE, new_tokens)
        for depth in DEPTHS:
            drafting = drafting_ms(engine, prompts[0], k, depth)
            for n in (size for size in curve if size > 1):
                tau = 1 + statistics.mean(accepted_length(t, p, n, depth) for t, p in steps)
                best_tau[n] = max(best_tau[n], tau)
                ratios = {"measured": tau * one / (curve[n] + drafting), "free drafting": tau * one / curve[n],
                          "peak rows": tau * one / peak[n], "every draft": min(n, depth + 1) * one / peak[n]}
                for name, ratio in ratios.items():
                    if ratio > best[name][0]:
                        best[name] = (ratio, f"{k}/{n}/{depth} tau {tau:.2f}, drafting {drafting:.1f} ms")
        print(f"top_k {k}: {len(steps)} steps traced", flush=True)
    for name, (ratio, tree) in best.items():
        print(f"{name:>14}: best {ratio:.2f}x plain's pass ({tree})")
    for n, tau in best_tau.items():
        needed = GOAL * peak[n] / one
        print(f"{n:>3} rows: the heads' best tau {tau:.2f}; {GOAL}x would need {needed:.2f}"
              + (" (more than the rows can hold)" if needed > n else ""))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20, int(sys.argv[2]) if len(sys.argv) > 2 else 128)
