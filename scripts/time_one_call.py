"""Median milliseconds of an int4 decoding pass of the default model, every layer in one C call
(decoder_layers.c) against the per-layer path, interleaved, with whether their greedy tokens agree.

    python scripts/time_one_call.py 300     # context length before the pass

Each pass reads `rows` new tokens (a causal chain, as a tree pass does), lm_head included; the
cache is cropped back between passes. docs/fast_decoder.md quotes its figures.
"""
import sys
import time

import torch

from gumiho_core.loading import load_engine


def main(context: int) -> None:
    engine, _ = load_engine(None, need_heads=False, quantize="int4")
    decoder = engine.target.fast
    one_call = decoder.layers_in_one_call
    if one_call is None:
        sys.exit("decoder_layers.c does not run here (no int4 on groupwise_matmul.c)")
    with torch.inference_mode():
        cache = decoder.new_cache(2048)
        decoder(torch.randint(0, 1000, (context,)), torch.arange(context), cache)
        for rows in (1, 4, 8, 16):
            ancestors = torch.ones(rows, rows, dtype=torch.bool).tril()
            times, same = {"one call": [], "per layer": []}, True
            for _ in range(21):
                tokens, tops = torch.randint(0, 1000, (rows,)), []
                for path, layers in (("one call", one_call), ("per layer", None)):
                    decoder.layers_in_one_call = layers
                    cache.crop(context)
                    start = time.perf_counter()
                    logits = decoder.logits(decoder(tokens, torch.arange(context, context + rows), cache, ancestors))
                    times[path].append(time.perf_counter() - start)
                    tops.append(logits.argmax(-1))
                same &= torch.equal(*tops)
            decoder.layers_in_one_call = one_call
            median = {path: sorted(t)[len(t) // 2] * 1e3 for path, t in times.items()}
            print(f"context {context} rows {rows}: one call {median['one call']:.1f} ms, per layer "
                  f"{median['per layer']:.1f} ms, greedy tokens agree: {same}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 300)
