"""The serial draft head's layers in one C call (fast_heads.py) on an int4 target's drafting copy.

Drafting arithmetic may change what is proposed, never what is accepted; these tests check
that the one-call path computes what the PyTorch layers compute (up to bfloat16 roundings),
that drafting takes it, that what it cannot express goes through the layers on the same
cache, and that the answers stay plain decoding's.
"""
from __future__ import annotations

import pytest
import torch

from gumiho_core import Engine, GenerationSettings, TreeSettings, new_heads, run_to_end
from gumiho_core.fast_heads import StaticDraftCache
from gumiho_core.heads import DecoderLayer, DraftCache
from gumiho_core.quantize import drafting_copy
from gumiho_core.target import attach_fast_decoder
from tiny import random_prompts, tiny_target

TREE = TreeSettings(top_k=3, total_tokens=10, depth=4, mlp_topk=2, pruning=4)
CLOSE = {"atol": 5e-2, "rtol": 5e-2}  # bfloat16 roundings in a different order


def int4_target():
    target = attach_fast_decoder(tiny_target(seed=0, eos=False), "int4")
    if drafting_copy(new_heads(target), target).one_call is None:
        pytest.skip("groupwise_matmul.c does not run here (no AVX2 or no C compiler)")
    return target


def drafting_heads(target, **config):
    torch.manual_seed(0)
    return drafting_copy(new_heads(target, **config), target)


def serial_both_ways(heads, u, positions, mask=None, prefix=None):
    """The serial layers on u as drafting runs them (a StaticDraftCache) and through the
    PyTorch layers on a DraftCache, each cache holding the fc inputs `prefix` first.
    Returns (drafting's output, the layers' output, the static cache, the dynamic cache)."""
    static, dynamic = heads.new_cache(), DraftCache(heads.config.num_layers)
    one_call, results = heads.one_call, []
    for cache, path in ((static, one_call), (dynamic, None)):
        heads.one_call = path
        try:
            heads.serial(prefix, torch.arange(prefix.shape[1]), cache)
            results.append(heads.serial(u, positions, cache, mask))
        finally:
            heads.one_call = one_call
    return results[0], results[1], static, dynamic


def no_layers(*args):
    pytest.fail("the serial head ran its PyTorch layers")


def test_the_one_call_path_computes_what_the_layers_compute(monkeypatch):
    """The causal read of new tokens and depth 2's beams (each sees the whole cache and
    itself) both run in one call, and give the layers' outputs and cache entries."""
    heads = drafting_heads(int4_target())
    h = heads.config.hidden_size
    prefix, u = torch.randn(1, 20, h).bfloat16(), torch.randn(1, 3, h).bfloat16()
    beams = torch.cat([torch.ones(3, 23, dtype=torch.bool), torch.eye(3, dtype=torch.bool)], dim=1)
    with torch.inference_mode():
        for positions, mask in ((torch.arange(20, 23), None), (torch.full((3,), 23), beams[None, None])):
            with monkeypatch.context() as patch:
                patch.setattr(DecoderLayer, "forward", no_layers)
                static = heads.new_cache()
                heads.serial(prefix, torch.arange(20), static)
                if mask is not None:  # depth 2 reads after the 3 causal rows
                    heads.serial(u, torch.arange(20, 23), static)
                fast = heads.serial(u, positions, static, mask)
            assert isinstance(static, StaticDraftCache) and len(static) == 23 + (3 if mask is not None else 0)
            one_call, heads.one_call = heads.one_call, None
            dynamic = DraftCache(heads.config.num_layers)
            heads.serial(prefix, torch.arange(20), dynamic)
            if mask is not None:
                heads.serial(u, torch.arange(20, 23), dynamic)
            layers = heads.serial(u, positions, dynamic, mask)
            heads.one_call = one_call
            torch.testing.assert_close(fast.float(), layers.float(), **CLOSE)
            for layer in range(heads.config.num_layers):
                torch.testing.assert_close(static.keys[layer, :, : len(static)].float(),
                                           dynamic.keys[layer][0].float(), **CLOSE)


def test_a_mask_the_kernel_cannot_express_runs_the_layers_on_the_same_cache(monkeypatch):
    """Depth 3's beams see only their own depth-2 entries: the PyTorch layers run, reading
    and writing the static cache as they would a DraftCache."""
    heads = drafting_heads(int4_target())
    h = heads.config.hidden_size
    prefix, u = torch.randn(1, 20, h).bfloat16(), torch.randn(1, 2, h).bfloat16()
    # Cached: 18 context entries and 2 beams' depth-2 entries; each new row sees the context,
    # its own beam's entry and itself.
    mask = torch.ones(2, 22, dtype=torch.bool)
    mask[0, 19] = mask[1, 18] = False
    mask[:, 20:] = torch.eye(2, dtype=torch.bool)
    calls = []
    real = DecoderLayer.forward
    monkeypatch.setattr(DecoderLayer, "forward", lambda *args: calls.append(1) or real(*args))
    with torch.inference_mode():
        fast, layers, static, _ = serial_both_ways(heads, u, torch.full((2,), 20), mask[None, None], prefix)
    # The layers ran for the masked pass on the static cache, and for both passes on the DraftCache.
    assert len(calls) == 3 * heads.config.num_layers
    assert len(static) == 22 and static.lengths == [22] * heads.config.num_layers
    torch.testing.assert_close(fast.float(), layers.float(), **CLOSE)


def test_the_static_draft_cache_grows_without_changing_a_bit():
    heads = drafting_heads(int4_target())
    u = torch.randn(1, 30, heads.config.hidden_size).bfloat16()
    outputs = []
    with torch.inference_mode():
        for capacity in (8, 512):
            c = heads.config
            cache = StaticDraftCache(c.num_layers, c.num_key_value_heads, c.attn_head_dim, capacity)
            heads.serial(u[:, :5], torch.arange(5), cache)
            outputs.append(torch.cat([heads.serial(u[:, i : i + 1], torch.tensor([i]), cache) for i in range(5, 30)], 1))
    assert cache.keys.shape[2] == 512
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 3}])
def test_drafting_in_one_call_keeps_the_answers_plain_decodings(sampling, monkeypatch):
    """The engine's drafter reads and drafts through the one-call path (the layers never run)
    and its answers stay plain decoding's, greedy and sampled with a seed."""
    from gumiho_core.settings import SamplingSettings

    target = int4_target()
    engine = Engine(target, new_heads(target))
    assert isinstance(engine.drafter.cache, StaticDraftCache)
    monkeypatch.setattr(DecoderLayer, "forward", no_layers)
    for prompt in random_prompts(3, seed=21) + random_prompts(1, seed=22, lo=80, hi=100):
        settings = GenerationSettings(max_new_tokens=48, tree=TREE, sampling=SamplingSettings(**sampling))
        spec = run_to_end(engine, prompt, settings, reuse_prefix=False)
        plain = run_to_end(engine, prompt, settings.with_(speculative=False), reuse_prefix=False)
        assert spec.token_ids == plain.token_ids
