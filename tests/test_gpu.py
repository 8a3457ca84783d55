"""The CUDA path: fp16/bf16 targets, bitsandbytes on CUDA, losslessness on the GPU.

Skipped where no GPU is available (CI here has none); scripts/gpu_check.py runs the same
checks plus the cost curve on a lent GPU machine.
"""
from __future__ import annotations

import pytest
import torch

from gumiho_core import Engine, GenerationSettings, TreeSettings, new_heads, run_to_end
from tiny import random_prompts, tiny_target

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def on_cuda(target):
    target.model.to("cuda")
    return target


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_lossless_on_gpu(dtype):
    target = on_cuda(tiny_target(seed=0, eos=False, dtype=dtype))
    engine = Engine(target, new_heads(target))
    for tree in (TreeSettings(), TreeSettings.gpu()):
        for prompt in random_prompts(4):
            settings = GenerationSettings(max_new_tokens=24, tree=tree)
            spec = run_to_end(engine, prompt, settings)
            plain = run_to_end(engine, prompt, settings.with_(speculative=False))
            assert spec.token_ids == plain.token_ids
