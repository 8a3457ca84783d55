"""Median microseconds of each part of a decoding step, timed inside the real loop.

    python scripts/time_step_parts.py                # plain decoding, greedy, 4 mt_bench prompts
    python scripts/time_step_parts.py 1.0 spec 8     # temperature, plain|spec, prompts

Each function named below is wrapped in a timer for the run. Timed alone, these parts run on
warm caches and look cheap; in the loop each runs right after a pass has streamed the weights
through the caches, and costs many times more (docs/fast_decoder.md, "The glue around a
pass", quotes the figures). What is left of `step` beyond its parts is the loop's own work.
"""
import collections
import json
import statistics
import sys
import time

from gumiho_core import drafter as drafter_module
from gumiho_core import generate, verify
from gumiho_core.cpu_kernels import CpuKernels
from gumiho_core.loading import draft_tree_for, load_engine
from gumiho_core.settings import GenerationSettings, SamplingSettings

TIMES = collections.defaultdict(list)


def timed(name: str, function):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = function(*args, **kwargs)
        TIMES[name].append(time.perf_counter() - start)
        return result
    return wrapper


def wrap_parts(speculative: bool) -> None:
    generate._Generation._step = timed("step (all of it)", generate._Generation._step)
    generate._Generation._step_event = timed("the step's event", generate._Generation._step_event)
    generate.GrowingRows.append = timed("features append", generate.GrowingRows.append)
    generate.accept = timed("accept", generate.accept)
    verify.TargetPasses.verify = timed("TargetPasses.verify", verify.TargetPasses.verify)
    CpuKernels.decoder_pass = timed("  C: decoder_pass", CpuKernels.decoder_pass)
    CpuKernels.groupwise_matmul = timed("  C: groupwise_matmul (lm_head)", CpuKernels.groupwise_matmul)
    drafter = drafter_module.GumihoDrafter if speculative else drafter_module.PlainDrafter
    drafter.draft = timed("drafter.draft", drafter.draft)
    drafter.observe = timed("drafter.observe", drafter.observe)


def main(temperature: float, speculative: bool, count: int) -> None:
    engine, _ = load_engine()
    tree, tokenizer = draft_tree_for(engine), engine.target.tokenizer
    wrap_parts(speculative)
    with open("../shared/bench/mt_bench.jsonl") as lines:
        prompts = [json.loads(line)["turns"][0] for line in lines][:count]
    for seed, prompt in enumerate(prompts):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        settings = GenerationSettings(max_new_tokens=256, speculative=speculative, tree=tree,
                                      sampling=SamplingSettings(temperature=temperature, seed=seed))
        generate.run_to_end(engine, ids, settings, reuse_prefix=False)
    for name, times in TIMES.items():  # the lm_head's product: one call a step after the prefill's
        print(f"{name:34s} {len(times):6d} calls, median {statistics.median(times) * 1e6:8.1f} us")


if __name__ == "__main__":
    arguments = sys.argv[1:]
    main(float(arguments[0]) if arguments else 0.0, len(arguments) > 1 and arguments[1] == "spec",
         int(arguments[2]) if len(arguments) > 2 else 4)
