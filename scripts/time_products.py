"""Median milliseconds of the default model's weight products by row count, per kernel library.

    python scripts/time_products.py                      # the library this machine builds
    python scripts/time_products.py OLD.so NEW.so        # two builds, timed interleaved

One "pass" of products: 30 layers x (q/k/v 576 -> 960, out 576 -> 576, gate/up 576 -> 3072,
down 1536 -> 576) in 4 bits and the lm_head 576 -> 49152 in 8 bits (GroupwiseLinear on
groupwise_matmul.c), random weights. Libraries are timed in turn within each repetition, so
a noisy machine's drift falls on both alike. docs/fast_decoder.md quotes its figures.
"""
import sys
import time
from pathlib import Path

import torch
from torch import nn

from gumiho_core.cpu_kernels import CpuKernels, load
from gumiho_core.quantize import GroupwiseLinear

SHAPES = [(576, 960, 4), (576, 576, 4), (576, 3072, 4), (1536, 576, 4), (576, 49152, 8)]


def products(layers, inputs) -> float:
    start = time.perf_counter()
    for _ in range(30):
        for layer, (width, _, _) in zip(layers[:4], SHAPES[:4]):
            layer(inputs[width])
    layers[4](inputs[576])
    return time.perf_counter() - start


def main(paths: list[str]) -> None:
    libraries = [(Path(p).name, CpuKernels(Path(p))) for p in paths] or [("this machine's build", load()[0])]
    if libraries[0][1] is None or not all(kernels.groupwise for _, kernels in libraries):
        sys.exit("groupwise_matmul.c does not run here (no compiler, or no AVX2)")
    torch.manual_seed(0)
    linears = [nn.Linear(i, o, bias=False) for i, o, _ in SHAPES]
    sets = [[GroupwiseLinear(linear, bits, kernels) for linear, (_, _, bits) in zip(linears, SHAPES)]
            for _, kernels in libraries]
    for rows in (1, 2, 4, 8, 16):
        inputs = {width: torch.randn(rows, width).bfloat16() for width in (576, 1536)}
        times = [[] for _ in sets]
        for _ in range(15):
            for layers, timed in zip(sets, times):
                timed.append(products(layers, inputs))
        medians = [f"{name} {sorted(t)[len(t) // 2] * 1e3:.1f} ms" for (name, _), t in zip(libraries, times)]
        print(f"rows {rows}: " + ", ".join(medians))


if __name__ == "__main__":
    main(sys.argv[1:])
