"""export-heads: float16 copies for shipping load back (cast) and still decode losslessly."""
from __future__ import annotations

import torch

from gumiho_core import Engine, GenerationSettings, HeadCheckpoint, run_to_end
from gumiho_core.heads import WEIGHTS_FILE
from gumiho_core.train import export_heads, new_trainable_heads
from tiny import random_prompts, tiny_target


def test_float16_export_halves_the_file_and_loads_as_float32(tmp_path):
    target = tiny_target(seed=0)
    heads = new_trainable_heads(target, draft_vocab=list(range(0, 96, 3)), seed=0)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    HeadCheckpoint.save(heads, tmp_path / "full")
    export_heads(tmp_path / "full", tmp_path / "small", "float16")
    full, small = (tmp_path / d / WEIGHTS_FILE for d in ("full", "small"))
    assert small.stat().st_size < 0.55 * full.stat().st_size
    loaded = HeadCheckpoint.load(tmp_path / "small", target)
    assert loaded.dtype == torch.float32
    assert loaded.draft_vocab.dtype == torch.long and loaded.draft_vocab.tolist() == list(range(0, 96, 3))
    for name, value in heads.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name].float(), value.float(), atol=1e-3, rtol=1e-3)
    engine = Engine(target, loaded)
    for prompt in random_prompts(3, seed=5):
        spec = run_to_end(engine, prompt, GenerationSettings(max_new_tokens=16))
        plain = run_to_end(engine, prompt, GenerationSettings(max_new_tokens=16, speculative=False))
        assert spec.token_ids == plain.token_ids
