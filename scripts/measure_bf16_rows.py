"""How often speculative answers part from plain ones in bfloat16 with and without one-row padding.

    python scripts/measure_bf16_rows.py 20          # the first 20 mt_bench prompts, 128 tokens each

oneDNN's one-row bfloat16 kernel sums some shapes' rows in another order than its many-row kernel
on CPUs without AMX, so a row's bits in a one-token pass and in a tree pass could differ
(cpu_matmul.PackedBF16Linear pads those shapes' single rows to two). This runs the default model
in bfloat16 with the tree drafted at every step, once with the padding switched off and once as
shipped, and counts the answers that part from plain decoding's. docs/fast_decoder.md quotes it.
"""
import sys

from gumiho_core import Engine, GenerationSettings, load_target, run_to_end
from gumiho_core.benchmark import read_prompts
from gumiho_core.cpu_matmul import PackedBF16Linear
from gumiho_core.heads import HeadCheckpoint
from gumiho_core.loading import SHIPPED_HEADS


def parted_at(engine, target, prompts) -> list[int]:
    """For each answer where speculative and plain decoding part, the first token they differ at."""
    parted = []
    for prompt in prompts:
        ids = target.chat_prompt([{"role": "user", "content": prompt}])
        spec = run_to_end(engine, ids, GenerationSettings(max_new_tokens=128), reuse_prefix=False).token_ids
        plain = run_to_end(engine, ids, GenerationSettings(max_new_tokens=128, speculative=False),
                           reuse_prefix=False).token_ids
        if spec != plain:
            parted.append(next(i for i, (a, b) in enumerate(zip(spec + [-1], plain + [-2])) if a != b))
    return sorted(parted)


def main(count: int) -> None:
    target = load_target(None, dtype="bfloat16")
    engine = Engine(target, HeadCheckpoint.load(SHIPPED_HEADS, target))
    engine.drafter.guard = None  # every step a tree pass
    prompts = read_prompts("../shared/bench/mt_bench.jsonl", count)
    layers = [m for m in target.fast.modules() if isinstance(m, PackedBF16Linear)]
    padded = [m.one_row_as_two for m in layers]
    for m in layers:
        m.one_row_as_two = False
    before = parted_at(engine, target, prompts)
    for m, pad in zip(layers, padded):
        m.one_row_as_two = pad
    print(f"without padding: {len(before)} of {count} answers parted, at tokens {before}")
    now = parted_at(engine, target, prompts)
    print(f"padded where a shape needs it ({sum(padded)} of {len(layers)} products): "
          f"{len(now)} of {count} parted, at tokens {now}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
