"""The CPU weight layouts (cpu_matmul.py) compute what nn.Linear computes, and decoding stays lossless."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gumiho_core import Engine, GenerationSettings, TreeSettings, new_heads, run_to_end
from gumiho_core.cpu_matmul import (PACKING_AVAILABLE, PackedBF16Linear, TransposedLinear, WeightFirstLinear,
                                    bf16_packing_available, fast_cpu_copy, fast_linear, pack_for_rows,
                                    use_fast_cpu_layouts)
from gumiho_core.drafter import RecordingDrafter
from tiny import assert_lossless, hf_greedy, random_prompts, tiny_target


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("layout", [TransposedLinear, WeightFirstLinear])
def test_layouts_compute_what_linear_computes(layout, bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    fast = layout(linear)
    torch.testing.assert_close(fast.weight, linear.weight, rtol=0, atol=0)
    assert_computes_like(linear, fast, [(1, 48), (3, 48), (16, 48), (1, 5, 48), (2, 7, 48)])


def assert_computes_like(linear, fast, shapes):
    for shape in shapes:
        x = torch.randn(shape)
        torch.testing.assert_close(fast(x), linear(x), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not bf16_packing_available(), reason="no oneDNN bfloat16 on this CPU")
@pytest.mark.parametrize("bias", [False, True])
def test_packed_bfloat16_computes_what_a_bfloat16_linear_computes(bias):
    torch.manual_seed(2)
    linear = nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
    fast = fast_linear(linear)
    assert isinstance(fast, PackedBF16Linear)
    for shape in [(1, 96), (7, 96), (16, 96), (2, 5, 96)]:
        x = torch.randn(shape).bfloat16()
        # Both accumulate in float32 and round once; the summation order may differ.
        torch.testing.assert_close(fast(x), linear(x), rtol=1.6e-2, atol=1e-2)
    module = nn.Sequential(linear, nn.ReLU())
    fast_module = fast_cpu_copy(module)
    assert isinstance(fast_module[0], PackedBF16Linear) and type(module[0]) is nn.Linear  # a copy


@pytest.mark.skipif(not bf16_packing_available(), reason="no oneDNN bfloat16 on this CPU")
def test_a_packed_bfloat16_row_has_the_same_bits_alone_and_among_others():
    """oneDNN's one-row kernel summed a 1536-long row in another order than its many-row kernel
    on an AMD CPU with AVX512-BF16 (19 of 115200 outputs one bfloat16 step apart), which parted
    speculative answers from plain ones: a one-row pass and a tree pass must give a row the
    same bits."""
    torch.manual_seed(0)
    fast = PackedBF16Linear(nn.Linear(1536, 576, bias=False))
    x = (torch.randn(200, 1536) * torch.rand(200, 1) * 4).bfloat16()
    alone = torch.cat([fast(x[r : r + 1]) for r in range(200)])
    for rows in (2, 3, 8, 16):
        among = torch.cat([fast(x[r : r + rows])[:1] for r in range(200 - rows)])
        assert torch.equal(among, alone[: 200 - rows]), rows
    assert torch.equal(fast(x[0]), alone[0])  # a 1-D row too


needs_packing = pytest.mark.skipif(not PACKING_AVAILABLE, reason="PyTorch built without MKL")


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("layout", [TransposedLinear, WeightFirstLinear])
def test_packed_weights_compute_what_linear_computes(layout, bias):
    torch.manual_seed(1)
    linear = nn.Linear(48, 80, bias=bias)
    fast = layout(linear)
    fast.pack(5)
    assert fast.packed[0] == 5
    assert_computes_like(linear, fast, [(5, 48), (1, 5, 48), (4, 48), (6, 48), (1, 48)])  # packed size, fallbacks
    fast.pack(None)
    assert fast.packed is None


@needs_packing
def test_engine_packs_the_tree_size_and_stays_lossless():
    target = tiny_target(seed=3, eos=False, tied=True)
    use_fast_cpu_layouts(target.model)
    engine = Engine(target, new_heads(target))
    engine.drafter.guard = None  # every step drafts the full tree: each pass's size is checked
    # Lookup off: a looked-up branch adds nodes beyond total_tokens (not packed, by design).
    tree = TreeSettings(top_k=3, total_tokens=6, depth=3, mlp_topk=3, pruning=6, fta=False, fta_tokens=0,
                        lookup_tokens=0)
    assert_lossless(engine, random_prompts(4, seed=5), tree)
    assert target.lm_head.packed[0] == 6
    recorder = RecordingDrafter(engine.drafter)
    run_to_end(engine, random_prompts(1, seed=6)[0], GenerationSettings(max_new_tokens=12, tree=tree), drafter=recorder)
    assert all(len(t) == 6 for t, _ in recorder.steps)  # so every pass took the packed kernel
    assert pack_for_rows(target.model, None) == 0


@needs_packing
def test_tree_passes_with_the_lookup_branch_run_on_the_pack(monkeypatch):
    """The lookup branch grows trees past total_tokens; each is padded up to a packed size."""
    target = tiny_target(seed=4, eos=False, tied=True)
    use_fast_cpu_layouts(target.model)
    engine = Engine(target, new_heads(target))
    engine.drafter.guard = None  # every step drafts: each tree pass's size is checked
    tree = TreeSettings(top_k=2, total_tokens=4, depth=2, mlp_topk=2, pruning=2, fta=False, fta_tokens=0,
                        lookup_tokens=6)
    layer = target.base.layers[0].mlp.down_proj  # a target weight: one product per target pass
    passes = []  # (rows, took the pack) per target pass
    real = layer.forward

    def watched(x):
        rows = x.reshape(-1, x.shape[-1]).shape[0]
        passes.append((rows, rows in layer.packs))
        return real(x)

    monkeypatch.setattr(layer, "forward", watched)
    prepared = engine.drafter.tree_sizes(tree)
    assert prepared == (4, 10)  # the budget, and the budget with a looked-up chain
    sizes = set()
    for p in random_prompts(4, seed=21, lo=4, hi=7):
        prompt = p + p[1:] + p[1:]  # the context's tail has occurred before: chains get looked up
        reference = hf_greedy(target, prompt, 30)
        passes.clear()
        recorder = RecordingDrafter(engine.drafter)
        done = run_to_end(engine, prompt, GenerationSettings(max_new_tokens=30, tree=tree), drafter=recorder)
        assert done.token_ids == reference
        assert len(passes) == 1 + len(recorder.steps)  # the prefill, then one pass per tree
        for t, (rows, packed) in zip(recorder.trees, passes[1:]):
            sizes.add(len(t))
            if len(t) <= prepared[-1]:
                assert rows == min(size for size in prepared if size >= len(t)) and packed
    assert any(tree.total_tokens < n <= prepared[-1] for n in sizes), "the lookup should have grown some trees"


def test_target_swap_keeps_logits_and_tied_embeddings():
    target = tiny_target(seed=4, tied=True)
    reference = copy.deepcopy(target.model)
    swapped = use_fast_cpu_layouts(target.model)
    assert swapped == 7 * 2 + 1  # q k v o gate up down per layer, and the lm_head
    assert isinstance(target.lm_head, WeightFirstLinear)
    assert target.lm_head.weight is target.embed_tokens.weight  # still tied: no 2nd copy of the vocabulary
    ids = torch.tensor([random_prompts(1, seed=9)[0]])
    torch.testing.assert_close(target.model(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)


def test_decoding_with_swapped_target_is_lossless():
    target = tiny_target(seed=0, eos=False)
    use_fast_cpu_layouts(target.model)
    engine = Engine(target, new_heads(target))
    tree = TreeSettings(top_k=3, total_tokens=12, depth=4, mlp_topk=3, pruning=6)
    assert_lossless(engine, random_prompts(4, seed=21), tree)


def test_engine_copies_heads_and_leaves_the_callers_module_alone():
    target = tiny_target(seed=1)
    heads = new_heads(target)
    engine = Engine(target, heads)
    assert type(heads.fc) is nn.Linear  # the caller may still train or save these
    assert isinstance(engine.heads.fc, TransposedLinear)
    assert engine.heads.state_dict().keys() != heads.state_dict().keys()  # a separate inference copy
    half = copy.deepcopy(heads).half()
    assert fast_cpu_copy(half) is half  # float16 keeps nn.Linear's own kernels
