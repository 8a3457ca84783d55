"""Median milliseconds of one eager pass of the default model by row count, in a precision.

    python scripts/time_passes.py int4 300     # precision (float32, bfloat16, int8, int4), context

Each pass reads `rows` new tokens (a causal chain, as a tree pass does) after `context` cached
ones, lm_head included; the cache is cropped back between passes. The figures quoted in
docs/fast_decoder.md (flash against blocked attention) come from it.
"""
import sys
import time

import torch

from gumiho_core.loading import load_engine


def main(precision: str, context: int) -> None:
    options = {"dtype": "bfloat16", "quantize": None} if precision == "bfloat16" else \
        {"quantize": None if precision == "float32" else precision}
    engine, _ = load_engine(None, need_heads=False, **options)
    decoder = engine.target.fast
    with torch.inference_mode():
        cache = decoder.new_cache(2048)
        decoder(torch.randint(0, 1000, (context,)), torch.arange(context), cache)
        for rows in (1, 4, 8, 16):
            ancestors = torch.ones(rows, rows, dtype=torch.bool).tril()
            times = []
            for _ in range(15):
                cache.crop(context)
                start = time.perf_counter()
                features = decoder(torch.randint(0, 1000, (rows,)), torch.arange(context, context + rows), cache,
                                   ancestors)
                decoder.logits(features)
                times.append(time.perf_counter() - start)
            print(f"{precision} context {context} rows {rows}: {sorted(times)[len(times) // 2] * 1e3:.1f} ms")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 300)
