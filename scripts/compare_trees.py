"""Draft trees side by side in one process: plain decoding and each tree, interleaved per prompt.

    python scripts/compare_trees.py 0 20 mt_bench 2/2/1+4g 4/3/1+8 4/3/1+4g
    #                           temperature, prompts, ../shared/bench set, trees

A tree is top_k/total_tokens/depth+lookup_tokens, with a trailing g for the draft guard under
greedy decoding too (guard_greedy). Each tree gets its own drafter, so its guard learns from its
own steps; the order of the methods alternates from prompt to prompt, so a noisy machine's drift
falls on all alike. Prints each prompt's tokens/s and whether every answer equals plain
decoding's, then ratios to plain: of the medians, and the median of each prompt's ratio.
docs/fast_decoder.md quotes its figures.
"""
import statistics
import sys
from dataclasses import replace

from gumiho_core.benchmark import read_prompts, run_method
from gumiho_core.drafter import GumihoDrafter
from gumiho_core.loading import load_engine
from gumiho_core.settings import GenerationSettings, SamplingSettings, TreeSettings


def parse_tree(text: str) -> TreeSettings:
    shape, lookup = text.rstrip("g").split("+")
    top_k, total, depth = (int(part) for part in shape.split("/"))
    return replace(TreeSettings.weight_only_cpu(), top_k=top_k, total_tokens=total, depth=depth,
                   lookup_tokens=int(lookup), guard_greedy=text.endswith("g"))


def main(temperature: float, count: int, bench: str, trees: list[str]) -> None:
    engine, _ = load_engine()
    prompts = [engine.target.chat_prompt([{"role": "user", "content": text}])
               for text in read_prompts(f"../shared/bench/{bench}.jsonl", count)]
    sampling = SamplingSettings(temperature=temperature, seed=0) if temperature > 0 else SamplingSettings()
    settings = GenerationSettings(max_new_tokens=256, sampling=sampling)
    methods = {"plain": ("plain", settings, None)}
    for text in trees:
        methods[text] = ("gumiho", settings.with_(tree=parse_tree(text)),
                         {"gumiho": GumihoDrafter(engine.target, engine.heads)})
    for method, method_settings, extras in methods.values():  # warm-up
        run_method(method, engine, prompts[0], method_settings.with_(max_new_tokens=8), extras)
    rates = {name: [] for name in methods}
    for i, ids in enumerate(prompts):
        answers = {}
        for name in (list(methods) if i % 2 == 0 else list(reversed(methods))):
            method, method_settings, extras = methods[name]
            run = run_method(method, engine, ids, method_settings, extras)
            rates[name].append(run.tokens_per_s)
            answers[name] = run.tokens
        same = all(tokens == answers["plain"] for tokens in answers.values())
        print(i, {name: round(r[-1], 1) for name, r in rates.items()}, "same" if same else "DIFFERENT", flush=True)
    plain = statistics.median(rates["plain"])
    for name in trees:
        paired = statistics.median(a / b for a, b in zip(rates[name], rates["plain"]))
        print(f"{name}: {statistics.median(rates[name]) / plain:.3f}x plain (paired {paired:.3f}x)")


if __name__ == "__main__":
    main(float(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:])
