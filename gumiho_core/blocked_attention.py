"""Attention whose result for a row does not depend on the other rows of its pass.

Under bfloat16 / int8 / int4 the products give a row the same bits however many rows share
the pass (cpu_matmul.py, quantize.py), but PyTorch's flash attention does not: it sums a
row's keys over a range that depends on the pass (a tree pass has masked tree nodes between
a row's keys, a one-token pass has none, and a key range's tail is summed differently from
masked padding). One changed bit in bfloat16 is enough to flip a near-tie, and speculative
answers then part from plain ones. Here every row sums its keys in the order a one-token
pass at its position sums them:

- a row's keys are numbered by their position in the row's own sequence (the prefix, then
  its ancestors in the tree), not by their cache slot, and cut into blocks of BLOCK;
- each block is reduced on its own: scores, max, exp-sum and weighted values over exactly
  BLOCK keys (masked padding at the end), with products whose bits do not depend on how
  many rows share them (float32, at least two query rows; checked in tests);
- blocks are merged left to right by a cumulative sum: one fixed order for any block count.

Blocks lying whole in the cache before the pass are read in place, once for all rows; from
the block holding the pass's first position on, each row's keys are gathered (the prefix's
tail, then its ancestors). Keys, values and the arithmetic are float32 (the cache holds them
so); queries arrive in the activations' precision.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 64
MASKED = -1e30  # a score no key can reach; finite, see _partials
# float32 matmul gives a row the same bits for any row count from 3 up (measured 3-48 here);
# 1 and 2 rows take other kernels, so fewer query rows are padded with zero rows.
MIN_ROWS = 3


@dataclass
class BlockLayout:
    """Where each row of one pass finds its keys, block by block."""

    shared: int  # blocks [0, shared) lie whole in the cache before the pass: read in place
    tail_slots: torch.Tensor  # (n, tail * BLOCK) cache slot of each row's key from block `shared` on
    tail_bias: torch.Tensor  # (1, n, tail, 1, BLOCK) 0 where the row sees that key, MASKED elsewhere


def block_layout(start: int, positions: torch.Tensor, ancestors: torch.Tensor | None) -> BlockLayout:
    """Layout for rows at `positions` written at cache slots start.. (start + n), each seeing
    the cache before `start` and its ancestors among the new rows (None: causal)."""
    n, device = len(positions), positions.device
    if ancestors is None:
        ancestors = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    shared = start // BLOCK
    tail = int(positions.max()) // BLOCK - shared + 1
    logical = shared * BLOCK + torch.arange(tail * BLOCK, device=device)  # a row's key numbers
    # Row r's ancestors in depth order: node indices ascend from the root (n marks "none").
    nodes = torch.arange(n, device=device).expand(n, n)
    path = torch.where(ancestors.to(device), nodes, n).sort(dim=1).values
    depth = (logical - start).clamp(0, n - 1)
    node = path[:, depth]  # (n, keys): the ancestor holding key number start + depth
    in_prefix = (logical < start).expand(n, -1)
    seen = (logical[None] <= positions[:, None]) & (in_prefix | (node < n))
    slots = torch.where(in_prefix, logical.expand(n, -1), start + node.clamp(max=n - 1))
    slots = torch.where(seen, slots, 0)
    bias = torch.zeros(n, tail * BLOCK, device=device).masked_fill(~seen, MASKED)
    return BlockLayout(shared, slots, bias.view(1, n, tail, 1, BLOCK))


def blocked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layout: BlockLayout,
                      scale: float) -> torch.Tensor:
    """q (n, heads, d); keys / values (kv_heads, capacity, d) float32, one layer's cache.
    Returns (n, heads * d) float32: grouped-query attention, each row over its own keys."""
    n, heads, d = q.shape
    kv_heads = keys.shape[0]
    rep = heads // kv_heads
    q = (q.float() * scale).view(n, kv_heads, rep, d).transpose(0, 1)  # (kv, n, rep, d), scaled once
    parts = [_tail_blocks(q, keys, values, layout)]
    if layout.shared:
        parts.insert(0, _shared_blocks(q, keys, values, layout.shared))
    m, total, weighted = (torch.cat(p, dim=2) for p in zip(*parts))  # blocks along dim 2
    # Merge blocks left to right; a block masked whole is weighed 0 and adds exact zeros.
    w = torch.exp(m - m.amax(dim=2, keepdim=True))
    total = (total * w).cumsum(dim=2)[:, :, -1]
    out = (weighted * w).cumsum(dim=2)[:, :, -1] / total  # (kv, n * rep, d)
    return out.view(kv_heads, n, rep, d).transpose(0, 1).reshape(n, heads * d)


def _shared_blocks(q, keys, values, blocks: int):
    """Per-block partials over the cache's whole blocks, every query row at once."""
    kv_heads, n, rep, d = q.shape
    rows = _at_least(q.reshape(kv_heads, n * rep, d), dim=1)
    length = blocks * BLOCK
    scores = torch.bmm(rows, keys[:, :length].transpose(1, 2)).view(kv_heads, -1, blocks, BLOCK)
    values = values[:, :length].reshape(kv_heads, blocks, BLOCK, d)
    m = scores.amax(dim=-1, keepdim=True)
    e = torch.exp(scores - m)  # (kv, rows, blocks, B)
    weighted = (e.transpose(1, 2) @ values).transpose(1, 2)  # per block: (rows, B) @ (B, d)
    return tuple(t[:, : n * rep] for t in (m, e.sum(dim=-1, keepdim=True), weighted))  # (kv, rows, blocks, .)


def _tail_blocks(q, keys, values, layout: BlockLayout):
    """Per-block partials over each row's own keys from block `shared` on (gathered)."""
    kv_heads, n, rep, d = q.shape
    tail = layout.tail_bias.shape[2]
    rows = _at_least(q, dim=2)[:, :, None]
    k = keys[:, layout.tail_slots].view(kv_heads, n, tail, BLOCK, d)
    v = values[:, layout.tail_slots].view(kv_heads, n, tail, BLOCK, d)
    scores = rows @ k.transpose(-1, -2) + layout.tail_bias  # (kv, n, tail, rows, B)
    m, total, weighted = _partials(scores, v)
    return tuple(t[:, :, :, :rep].transpose(2, 3).reshape(kv_heads, n * rep, tail, -1) for t in (m, total, weighted))


def _at_least(rows: torch.Tensor, dim: int) -> torch.Tensor:
    """`rows` padded with zero rows up to MIN_ROWS along `dim`."""
    missing = MIN_ROWS - rows.shape[dim]
    if missing <= 0:
        return rows
    shape = list(rows.shape)
    shape[dim] = missing
    return torch.cat([rows, rows.new_zeros(shape)], dim=dim)


def _partials(scores: torch.Tensor, values: torch.Tensor):
    """A block's max, exp-sum and exp-weighted values. A block masked whole has max MASKED,
    so the merge weighs it exp(MASKED - max) = 0 (finite throughout: no NaN from -inf - -inf)."""
    m = scores.amax(dim=-1, keepdim=True)
    e = torch.exp(scores - m)
    return m, e.sum(dim=-1, keepdim=True), e @ values
