"""cpu_kernels.c: attention whose result for a row does not depend on the other rows of its pass."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gumiho_core import cpu_kernels
from test_blocked_attention import random_tree

KV_HEADS = 3


@pytest.fixture(scope="module")
def kernels():
    built, why = cpu_kernels.load()
    if built is None:
        pytest.skip(f"no kernels on this machine: {why}")
    return built


def cache_with(keys_and_values: int, head_dim: int, seed: int):
    """A layer's cache (kv_heads, capacity, d) in bfloat16, as the decoder's, with spare
    capacity after the entries in use."""
    g = torch.Generator().manual_seed(seed)
    shape = (KV_HEADS, keys_and_values + 40, head_dim)
    return torch.randn(shape, generator=g).bfloat16(), torch.randn(shape, generator=g).bfloat16()


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("rep", [1, 3])
@pytest.mark.parametrize("start", [0, 5, 63, 64, 250])
def test_a_tree_row_is_the_same_bits_as_the_row_alone(kernels, start, rep, head_dim):
    """Each row of a random tree against the one-token pass at its position, where its keys
    lie in order in the cache; and against PyTorch's attention over the same keys."""
    n, scale = 12, head_dim ** -0.5
    ancestors, _ = random_tree(n, seed=start + rep)
    keys, values = cache_with(start + n, head_dim, seed=start)
    # Queries as the decoder hands them over: rows strided inside the fused q/k/v output.
    q = torch.randn(n, KV_HEADS * (rep + 2), head_dim).bfloat16()[:, : KV_HEADS * rep]
    in_tree = kernels.tree_attention(q, keys, values, start, ancestors.to(torch.uint8).contiguous(), scale)
    for r in range(n):
        path = ancestors[r].nonzero().flatten().tolist()
        order = list(range(start)) + [start + node for node in path]
        k_alone, v_alone = keys.clone(), values.clone()
        k_alone[:, : len(order)], v_alone[:, : len(order)] = keys[:, order], values[:, order]
        position = len(order) - 1
        row = kernels.tree_attention(q[r : r + 1], k_alone, v_alone, position, torch.ones(1, 1, dtype=torch.uint8),
                                     scale)
        assert torch.equal(row, in_tree[r : r + 1]), r
        reference = F.scaled_dot_product_attention(q[r].float().view(KV_HEADS, rep, head_dim), keys[:, order].float(),
                                                   values[:, order].float(), scale=scale)
        # bfloat16 output: within its rounding of the float32 result
        torch.testing.assert_close(row.float(), reference.reshape(1, -1), rtol=1e-2, atol=1e-2)


def test_many_query_heads_per_kv_head_are_taken_in_groups(kernels):
    """More query heads per KV head than the kernel takes at once (8): the same bits as each
    head computed alone (one query head per KV head, the same keys)."""
    rep, d, start = 12, 64, 30
    keys, values = cache_with(start + 1, d, seed=1)
    q = torch.randn(1, KV_HEADS * rep, d).bfloat16()
    together = kernels.tree_attention(q, keys, values, start, torch.ones(1, 1, dtype=torch.uint8), 0.125)
    for h in range(KV_HEADS * rep):
        kv = h // rep
        one = kernels.tree_attention(q[:, h : h + 1], keys[kv : kv + 1].contiguous(), values[kv : kv + 1].contiguous(),
                                     start, torch.ones(1, 1, dtype=torch.uint8), 0.125)
        assert torch.equal(one, together[:, h * d : (h + 1) * d]), h


def test_without_a_compiler_the_decoder_keeps_pytorch_attention(monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(cpu_kernels.shutil, "which", lambda name: None)
    cpu_kernels.load.cache_clear()
    try:
        built, why = cpu_kernels.load()
        assert built is None and "no C compiler" in why and "\n" not in why
    finally:
        cpu_kernels.load.cache_clear()


def test_a_broken_compiler_is_one_line_not_a_traceback(monkeypatch, tmp_path):
    monkeypatch.setenv("GUMIHO_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    cpu_kernels.load.cache_clear()
    try:
        built, why = cpu_kernels.load()
        assert built is None and why.startswith("building the CPU kernels failed") and "\n" not in why
    finally:
        cpu_kernels.load.cache_clear()


@pytest.mark.parametrize("bits", [4, 8])
def test_groupwise_products_are_row_invariant_and_close_to_the_float_product(kernels, bits):
    """groupwise_matmul.c: each row alone gives the bits it gets among 1-40 rows (one-token
    passes, trees, a prefill's blocks of 16), and the product is the de-quantized weights'
    within int8 activations' rounding."""
    from gumiho_core.quantize import GroupwiseLinear, quantize_groups

    if not kernels.groupwise:
        pytest.skip("this CPU has no AVX2 / FMA")
    torch.manual_seed(bits)
    linear = torch.nn.Linear(576, 960, bias=False)
    layer = GroupwiseLinear(linear, bits, kernels)
    # Rows of every size from 1e-3 to 1e2: a one-row pass takes its own loop (groupwise_matmul.c).
    x = (torch.randn(40, 576) * torch.logspace(-3, 2, 40)[:, None]).bfloat16()
    together = layer(x)
    for rows in (1, 3, 8, 9, 16, 17):
        assert torch.equal(layer(x[:rows]), together[:rows]), rows
    for r in range(40):
        assert torch.equal(layer(x[r : r + 1]), together[r : r + 1]), r
    q, scales, lows = quantize_groups(linear.weight, bits)
    weights = (q.view(960, 18, 32) * scales.bfloat16().float()[..., None] + lows.bfloat16().float()[..., None])
    reference = x.float() @ weights.view(960, 576).t()
    assert ((together.float() - reference).norm() / reference.norm()) < 0.02


def test_vnni_and_amx_give_the_same_bits(kernels):
    """Few rows take VNNI, many AMX: both sum the integers exactly."""
    import ctypes

    from gumiho_core.quantize import GroupwiseLinear

    if not kernels.amx:
        pytest.skip("this CPU or kernel gives no AMX")
    layer = GroupwiseLinear(torch.nn.Linear(1536, 576, bias=False), 4, kernels)
    x = torch.randn(16, 1536).bfloat16()
    threshold = ctypes.c_int.in_dll(kernels.library, "amx_from_rows")
    saved = threshold.value
    try:
        threshold.value = 1
        on_amx = layer(x)
        threshold.value = 1 << 30
        on_vnni = layer(x)
    finally:
        threshold.value = saved
    assert torch.equal(on_amx, on_vnni)


@pytest.mark.parametrize("bits", [4, 8])
def test_avx2_and_avx512_give_the_same_bits(kernels, bits):
    """The AVX2 path (CPUs without AVX-512) sums the same integers and takes the same float
    steps as VNNI / AMX: a machine's answers do not depend on which of them it has."""
    import ctypes

    from gumiho_core.quantize import GroupwiseLinear

    if not kernels.avx512:
        pytest.skip("this CPU has no AVX512-VNNI / AVX512-BF16 to compare AVX2 with")
    layer = GroupwiseLinear(torch.nn.Linear(1536, 576, bias=False), bits, kernels, torch.float32)
    x = torch.randn(20, 1536).bfloat16() * torch.logspace(-3, 2, 20)[:, None].bfloat16()
    unit = ctypes.c_int.in_dll(kernels.library, "use_avx512")
    try:
        on_avx512 = layer(x)
        unit.value = 0
        on_avx2 = layer(x)
        row_by_row_on_avx2 = torch.cat([layer(x[r : r + 1]) for r in range(len(x))])  # AVX2's one-row loop
    finally:
        unit.value = 1
    assert torch.equal(on_avx512, on_avx2)
    assert torch.equal(on_avx512, row_by_row_on_avx2)


def test_an_int4_decoder_runs_its_products_on_the_kernels(kernels):
    """Where groupwise_matmul.c runs, the int4 layers and the 8-bit lm_head (float32 logits)
    are on it, so the engine's lossless tests in int4 exercise it."""
    from gumiho_core.quantize import GroupwiseLinear
    from gumiho_core.target import attach_fast_decoder
    from tiny import tiny_target

    if not kernels.groupwise:
        pytest.skip("this CPU has no AVX2 / FMA")
    decoder = attach_fast_decoder(tiny_target(seed=0, eos=False), "int4").fast
    assert all(type(layer.qkv) is GroupwiseLinear and layer.qkv.bits == 4 for layer in decoder.layers)
    assert type(decoder.lm_head) is GroupwiseLinear and decoder.lm_head.bits == 8
    with torch.inference_mode():
        logits = decoder.logits(decoder(torch.tensor([3, 4, 5]), torch.arange(3), decoder.new_cache()))
    assert logits.dtype == torch.float32
