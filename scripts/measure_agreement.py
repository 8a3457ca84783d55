"""How often a precision's greedy answers are the float32 target's, token for token.

    python scripts/measure_agreement.py int4 20 128     # precision, mt_bench prompts, new tokens

Plain decoding in float32 and in the given precision on the same prompts; prints how many
answers are identical and where the others first part. A 135M model's greedy path turns at
its first near-tie, so this counts near-ties more than it grades quality.
"""
import sys

from gumiho_core import GenerationSettings, run_to_end
from gumiho_core.benchmark import read_prompts
from gumiho_core.loading import load_engine


def answers(precision: str, prompts: list[str], new_tokens: int) -> list[list[int]]:
    options = {"dtype": "bfloat16", "quantize": None} if precision == "bfloat16" else \
        {"quantize": None if precision == "float32" else precision}
    engine, _ = load_engine(None, need_heads=False, **options)
    settings = GenerationSettings(max_new_tokens=new_tokens, speculative=False)
    chat = engine.target.chat_prompt
    return [run_to_end(engine, chat([{"role": "user", "content": p}]), settings, reuse_prefix=False).token_ids
            for p in prompts]


def main(precision: str, count: int, new_tokens: int) -> None:
    prompts = read_prompts("../shared/bench/mt_bench.jsonl", count)
    reference, other = answers("float32", prompts, new_tokens), answers(precision, prompts, new_tokens)
    same = sum(a == b for a, b in zip(reference, other))
    parted = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
              for a, b in zip(reference, other) if a != b]
    print(f"{precision}: {same}/{count} answers identical to float32's; the others part at tokens "
          f"{sorted(parted)} of {new_tokens}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
