"""load_target on a saved folder: the target it returns is the one that was saved."""
from __future__ import annotations

import torch

from gumiho_core import load_target
from tiny import tiny_target


def test_loaded_folder_keeps_the_saved_arithmetic_and_fetches_no_hub_kernels(tmp_path):
    saved = tiny_target(seed=3)
    saved.model.save_pretrained(tmp_path)
    saved.tokenizer.save_pretrained(tmp_path)

    loaded = load_target(tmp_path)

    # transformers >= 5.2x kernelizes by default (layers swapped for kernels from the hub at
    # load time); we load with use_kernels=False so the target stays offline and as saved.
    assert loaded.model.use_kernels is False
    ids = torch.tensor([[1, 5, 9, 17, 33, 4]])
    torch.testing.assert_close(loaded.model(input_ids=ids).logits, saved.model(input_ids=ids).logits,
                               atol=1e-5, rtol=1e-5)
