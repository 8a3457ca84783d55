"""blocked_attention.py: a row's result does not depend on the other rows of its pass."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gumiho_core.blocked_attention import BLOCK, block_layout, blocked_attention
from gumiho_core.cpu_matmul import bf16_packing_available

# Its row invariance rests on float32 products measured row-count invariant on CPUs with
# bfloat16 support, the only ones where the engine takes this path (elsewhere the low
# precisions need the C kernels: quantize.check_precision). AVX2-only CPUs sum differently.
ONLY_WITH_BF16 = pytest.mark.skipif(not bf16_packing_available(),
                                    reason="blocked_attention.py runs only on CPUs with bfloat16 support")

KV_HEADS, HEAD_DIM = 3, 64


def random_tree(n: int, seed: int) -> tuple[torch.Tensor, list[int]]:
    """(ancestors (n, n), depths) of a random tree whose parents come before their children."""
    g = torch.Generator().manual_seed(seed)
    parent = [-1] + [int(torch.randint(0, i, (), generator=g)) for i in range(1, n)]
    ancestors, depths = torch.zeros(n, n, dtype=torch.bool), [0] * n
    for i in range(n):
        j = i
        while j >= 0:
            ancestors[i, j], j = True, parent[j]
        depths[i] = 0 if parent[i] < 0 else depths[parent[i]] + 1
    return ancestors, depths


def alone(q_row, keys, values, start: int, path: list[int], scale: float) -> torch.Tensor:
    """The row as plain decoding computes it: one row, its keys in order in the cache."""
    order = list(range(start)) + [start + node for node in path]
    position = len(order) - 1
    spare = torch.zeros(KV_HEADS, BLOCK, HEAD_DIM)
    k, v = torch.cat([keys[:, order], spare], 1), torch.cat([values[:, order], spare], 1)
    return blocked_attention(q_row, k, v, block_layout(position, torch.tensor([position]), None), scale)


@ONLY_WITH_BF16
@pytest.mark.parametrize("rep", [1, 3])
@pytest.mark.parametrize("start", [5, 60, 63, 64, 120, 130, 250])
def test_a_tree_row_is_the_same_bits_as_the_row_alone(start, rep):
    """Trees straddling 64-key block boundaries included; a row's ancestors sit among other
    tree nodes in the cache, and alone they sit in order."""
    torch.manual_seed(start)
    n, scale = 12, 0.125
    ancestors, depths = random_tree(n, seed=start)
    keys, values = torch.randn(KV_HEADS, start + n + BLOCK, HEAD_DIM), torch.randn(KV_HEADS, start + n + BLOCK, HEAD_DIM)
    q = torch.randn(n, KV_HEADS * rep, HEAD_DIM).bfloat16()
    layout = block_layout(start, torch.tensor(depths) + start, ancestors)
    in_tree = blocked_attention(q, keys, values, layout, scale)
    for r in range(n):
        path = ancestors[r].nonzero().flatten().tolist()
        row = alone(q[r : r + 1], keys, values, start, path, scale)
        assert torch.equal(row, in_tree[r : r + 1]), r
        # ... and it is attention: the flash kernel over the same keys, within float32 rounding
        order = list(range(start)) + [start + node for node in path]
        reference = F.scaled_dot_product_attention(
            q[r].float().view(KV_HEADS, rep, HEAD_DIM), keys[:, order],
            values[:, order], scale=scale)
        torch.testing.assert_close(row, reference.reshape(1, -1), rtol=1e-5, atol=2e-6)


def test_the_layout_masks_what_a_row_must_not_see():
    ancestors, depths = random_tree(6, seed=1)
    layout = block_layout(70, torch.tensor(depths) + 70, ancestors)
    assert layout.shared == 1  # keys 0..63 are read in place
    seen = layout.tail_bias[0, :, 0] == 0
    for r in range(6):
        path = ancestors[r].nonzero().flatten().tolist()
        assert int(seen[r].sum()) == 70 - BLOCK + len(path)
        expected = list(range(BLOCK, 70)) + [70 + node for node in path]
        assert layout.tail_slots[r][seen[r]].tolist() == expected
