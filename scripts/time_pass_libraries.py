"""Median milliseconds of the default model's whole decoding pass by row count, per kernel library.

    python scripts/time_pass_libraries.py OLD.so            # OLD against this machine's build
    python scripts/time_pass_libraries.py OLD.so 1000       # ... after 1000 tokens of context

A pass is what a decoding step runs: every layer (decoder_layers.c), the final norm and the
lm_head, for `rows` new tokens in a causal chain (as a tree pass) after `context` cached
ones; the cache is cropped back between passes. The libraries take turns within each
repetition, so a noisy machine's drift falls on both alike (scripts/time_products.py does
the same for the weight products alone). docs/fast_decoder.md quotes its figures.
"""
import sys
import time
from pathlib import Path

import torch

from gumiho_core.cpu_kernels import CpuKernels, load
from gumiho_core.loading import load_engine


def use(decoder, kernels) -> None:
    """Run the decoder's layers and its products (the lm_head's included) on `kernels`."""
    decoder.kernels = kernels
    for module in decoder.modules():
        if module is not decoder and hasattr(module, "kernels"):
            module.kernels = kernels


def main(old: str, context: int) -> None:
    engine, _ = load_engine(None, need_heads=False)
    decoder = engine.target.fast
    if decoder is None or decoder.kernels is None:
        sys.exit("the default model's passes do not run on cpu_kernels.c here")
    libraries = [(Path(old).name, CpuKernels(Path(old))), ("this machine's build", load()[0])]
    with torch.inference_mode():
        cache = decoder.new_cache(2048)
        decoder(torch.randint(0, 1000, (context,)), torch.arange(context), cache)
        for rows in (1, 2, 3, 4, 6, 8, 11, 16):
            ancestors = torch.ones(rows, rows, dtype=torch.bool).tril()
            times = {name: [] for name, _ in libraries}
            for _ in range(25):
                for name, kernels in libraries:
                    use(decoder, kernels)
                    cache.crop(context)
                    start = time.perf_counter()
                    tokens, positions = torch.randint(0, 1000, (rows,)), torch.arange(context, context + rows)
                    decoder.logits(decoder(tokens, positions, cache, ancestors))
                    times[name].append(time.perf_counter() - start)
            print(f"rows {rows}: " + ", ".join(f"{name} {sorted(t)[len(t) // 2] * 1e3:.2f} ms"
                                               for name, t in times.items()), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 300)
