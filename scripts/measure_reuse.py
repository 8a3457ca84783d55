"""How often a follow-up's answer changes with how the chat so far was read.

    python scripts/measure_reuse.py int4 20 64     # precision, mt_bench prompts, new tokens

A follow-up message reuses the KV cache of the turn before: the previous answer's tokens as
decoding computed them, one pass per step. Read afresh, the same tokens go through one
prefill pass. Both are the target's own arithmetic, but in bfloat16 / int8 / int4 a prefill's
attention (the flash kernel over many rows) and a decoding pass's (blocked attention) round
differently in the last bits, so a near-tie may go either way. This counts, per precision,
how many second answers (greedy, plain decoding) are identical both ways, and where the
others part. docs/fast_decoder.md quotes it.
"""
import sys

from gumiho_core import GenerationSettings, run_to_end
from gumiho_core.benchmark import read_prompts
from gumiho_core.loading import load_engine

FOLLOW_UP = "Now say it again in one sentence."


def main(precision: str, prompts: int, new_tokens: int) -> None:
    options = {"dtype": "bfloat16", "quantize": None} if precision == "bfloat16" else \
        {"quantize": None if precision == "float32" else precision}
    engine, _ = load_engine(None, **options)
    target, settings = engine.target, GenerationSettings(max_new_tokens=new_tokens, speculative=False)
    same, parted, reused_tokens = 0, [], 0
    for text in read_prompts("../shared/bench/mt_bench.jsonl", prompts):
        chat = [{"role": "user", "content": text}]
        first = run_to_end(engine, target.chat_prompt(chat), settings, reuse_prefix=False)
        chat += [{"role": "assistant", "content": first.text}, {"role": "user", "content": FOLLOW_UP}]
        ids = target.chat_prompt(chat)
        reused = run_to_end(engine, ids, settings)  # the first turn's cache, as the chat does
        reused_tokens += reused.stats.reused_prompt_tokens
        fresh = run_to_end(engine, ids, settings, reuse_prefix=False)
        if reused.token_ids == fresh.token_ids:
            same += 1
        else:
            parted.append(next(i for i, (a, b) in enumerate(zip(reused.token_ids, fresh.token_ids)) if a != b))
    print(f"{precision}: {same}/{prompts} follow-up answers identical reused or read afresh; "
          f"the others part at tokens {sorted(parted)} of {new_tokens} "
          f"({reused_tokens / prompts:.0f} prompt tokens reused per follow-up)")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
