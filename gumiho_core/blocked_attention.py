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
- a row's scores and their one maximum are the same bits however many rows share the pass
  (float32 products of at least MIN_ROWS query rows; a maximum is exact in any order), so
  each key's weight exp(score - max) is too;
- each block's weights and weighted values are summed alone over exactly BLOCK keys (masked
  keys weigh 0), and the blocks added left to right by a cumulative sum: one fixed order
  for any block count, with any number of empty blocks after the last.

Blocks lying whole in the cache before the pass are read in place, once for all rows; from
the block holding the pass's first position on, each row's keys are gathered (the prefix's
tail, then its ancestors). Keys, values and the arithmetic are float32 (the cache holds them
so); queries arrive in the activations' precision.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 64
MASKED = -1e30  # a score no key can reach; finite, so a masked key weighs exp(MASKED - max) = 0, no NaN
# float32 matmul gives a row the same bits for any row count from 3 up (measured 3-48 here);
# 1 and 2 rows take other kernels, so fewer query rows are padded with zero rows.
MIN_ROWS = 3


@dataclass
class BlockLayout:
    """Where each row of one pass finds its keys, block by block."""

    shared: int  # blocks [0, shared) lie whole in the cache before the pass: read in place
    tail_slots: torch.Tensor  # (n, tail * BLOCK) cache slot of each row's key from block `shared` on
    tail_bias: torch.Tensor  # (1, n, 1, tail * BLOCK) 0 where the row sees that key, MASKED elsewhere


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
    return BlockLayout(shared, slots, bias.view(1, n, 1, tail * BLOCK))


def blocked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layout: BlockLayout,
                      scale: float) -> torch.Tensor:
    """q (n, heads, d); keys / values (kv_heads, capacity, d) float32, one layer's cache.
    Returns (n, heads * d) float32: grouped-query attention, each row over its own keys."""
    n, heads, d = q.shape
    kv_heads = keys.shape[0]
    rep = heads // kv_heads
    q = _at_least((q.float() * scale).view(n, kv_heads, rep, d).transpose(0, 1), dim=2)  # (kv, n, rows, d)
    rows, prefix = q.shape[2], layout.shared * BLOCK  # keys read in place
    if n == 1 and prefix + layout.tail_slots.shape[1] <= keys.shape[1]:
        return _one_row(q[:, 0], keys, values, layout)[:, :rep].reshape(1, heads * d)
    tail_keys, tail_values = _gather(keys, layout.tail_slots), _gather(values, layout.tail_slots)  # (kv, n, tail keys, d)
    scores = q @ tail_keys.transpose(-1, -2) + layout.tail_bias  # (kv, n, rows, tail keys)
    if prefix:
        before = torch.bmm(q.reshape(kv_heads, n * rows, d), keys[:, :prefix].transpose(1, 2))
        scores = torch.cat([before.view(kv_heads, n, rows, prefix), scores], dim=-1)
    # One max per row over every key it sees (exact in any order), so each key's weight is final;
    # then each block is summed alone over its BLOCK keys and the blocks added left to right.
    weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True)).view(kv_heads, n, rows, -1, BLOCK)
    weighted = _weighted_blocks(weights, values[:, :prefix], tail_values, layout.shared)
    total = weights.sum(dim=-1).cumsum(dim=-1)[..., -1:]  # (kv, n, rows, 1)
    out = weighted.cumsum(dim=3)[:, :, :, -1] / total  # (kv, n, rows, d)
    return out[:, :, :rep].transpose(0, 1).reshape(n, heads * d)


def _one_row(q, keys, values, layout: BlockLayout) -> torch.Tensor:
    """A one-token pass (q (kv, rows, d)): its keys lie in order in the cache, so every block is
    read in place, no gather. The same products, maximum and sums as blocked_attention's, in
    fewer operations (a plain decoding step runs one per layer). Returns (kv, rows, d)."""
    kv_heads, rows, d = q.shape
    prefix, length = layout.shared * BLOCK, layout.shared * BLOCK + layout.tail_slots.shape[1]
    scores = torch.bmm(q, keys[:, :length].transpose(1, 2))  # (kv, rows, length)
    scores[:, :, prefix:] += layout.tail_bias.view(-1)  # keys after the row's position
    weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True)).view(kv_heads, rows, -1, BLOCK)
    per_block = weights.transpose(1, 2) @ values[:, :length].view(kv_heads, -1, BLOCK, d)  # (kv, blocks, rows, d)
    total = weights.sum(dim=-1).cumsum(dim=-1)[..., -1:]  # (kv, rows, 1)
    return per_block.cumsum(dim=1)[:, -1] / total


def _weighted_blocks(weights, shared_values, tail_values, shared: int) -> torch.Tensor:
    """Each block's weighted values, (kv, n, rows, blocks, d): the cache's whole blocks with
    every query row at once, each row's own blocks from `shared` on with its gathered values."""
    kv_heads, n, rows, _, _ = weights.shape
    d = tail_values.shape[-1]
    tail = tail_values.view(kv_heads, n, -1, BLOCK, d)  # (kv, n, tail blocks, B, d)
    parts = [(weights[:, :, :, shared:].transpose(2, 3) @ tail).transpose(2, 3)]
    if shared:
        per_block = weights[:, :, :, :shared].reshape(kv_heads, n * rows, shared, BLOCK).transpose(1, 2)
        before = per_block @ shared_values.view(kv_heads, shared, BLOCK, d)  # (kv, blocks, n * rows, d)
        parts.insert(0, before.transpose(1, 2).reshape(kv_heads, n, rows, shared, d))
    return torch.cat(parts, dim=3) if shared else parts[0]


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[:, slots] for slots (n, keys): index_select copies whole rows, where advanced
    indexing took ~10x longer at a thousand keys."""
    return cache.index_select(1, slots.flatten()).view(cache.shape[0], *slots.shape, cache.shape[-1])


def _at_least(rows: torch.Tensor, dim: int) -> torch.Tensor:
    """`rows` padded with zero rows up to MIN_ROWS along `dim`."""
    missing = MIN_ROWS - rows.shape[dim]
    if missing <= 0:
        return rows
    shape = list(rows.shape)
    shape[dim] = missing
    return torch.cat([rows, rows.new_zeros(shape)], dim=dim)
