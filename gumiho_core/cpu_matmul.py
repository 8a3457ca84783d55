"""Weight layouts that keep a small model's matmuls fast on the CPU for a few rows at once.

A tree verification pass multiplies 2-48 rows by every weight matrix. nn.Linear computes
x @ W.T with W stored (out, in), and MKL's sgemm for that layout falls off a cliff between
3 and 16 rows: on this 2-core machine a (576 -> 1536 -> 576) MLP product at 16 rows costs
6x its 8-row cost, so a 16-token tree pass of SmolLM2-135M took 4x a one-token pass.
The same product with the weight stored transposed, x @ W_t, stays near the one-row cost
(16 rows: 0.14 ms instead of 0.93 ms). The lm_head is usually tied to the embedding, whose
lookup needs the (vocab, hidden) layout, so it is computed as (W @ x.T).T instead: no copy of
the 49k-row matrix, and 2x faster than x @ W.T from 4 rows on.

Where PyTorch is built with MKL, a tree pass of a known size goes further: MKL's packed
sgemm (the weight re-laid out once for exactly that many rows, `pack_for_rows`) keeps a
4-row product at about a 1-row product's cost, while x @ W_t still costs 1.4x. Measured over
all 30 layers' weights (not cache-resident): 1 row 18 ms with x @ W_t; 4 rows 25 ms with
x @ W_t, 18 ms packed; 8 rows 37 / 22 ms. Each packing is another copy of the weights (~540 MB for SmolLM2-135M),
so only the two tree sizes a drafter names are packed, the budget and the budget plus a
looked-up chain, and a tree is padded up to the next of them (verify.TargetPasses).
Every other row count takes the x @ W_t path.

Only the layout changes: every output element is still a float32 dot product of the same
numbers (bit-equal in our checks, within float32 rounding by contract), and the benchmark
checks that speculative and plain outputs stay identical. The benchmark's cost curve
(tree_budget.py) shows the effect on whole passes.
"""
from __future__ import annotations

import copy
import functools

import torch
import torch.nn as nn

# MKL's packed sgemm, reachable through PyTorch's own ops (what inductor's freezing uses).
PACKING_AVAILABLE = torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


class _PackableLinear(nn.Module):
    """Shared by both layouts: optional MKL-packed copies of the weight, one per row count."""

    packs: dict[int, torch.Tensor] = {}  # rows -> packed weight (replaced, never changed in place)

    @property
    def packed(self) -> tuple[int, torch.Tensor] | None:
        """(rows, packed weight) of the smallest packed row count, or None."""
        return (min(self.packs), self.packs[min(self.packs)]) if self.packs else None

    def pack(self, rows: int | tuple[int, ...] | None) -> None:
        # One row: x @ W_t is faster than the packed kernel. A size packed already is kept.
        wanted = sorted({n for n in _row_counts(rows) if n >= 2})
        self.packs = {n: self.packs[n] if n in self.packs else
                      torch.ops.mkl._mkl_reorder_linear_weight(self.weight.detach(), n) for n in wanted}

    def _packed_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        rows = x.reshape(-1, x.shape[-1])
        packed = self.packs.get(rows.shape[0])
        if packed is None:
            return None
        y = torch.ops.mkl._mkl_linear(rows, packed, self.weight, self.bias, rows.shape[0])
        return y.reshape(*x.shape[:-1], self.out_features)


class PackedBF16Linear(nn.Module):
    """nn.Linear in bfloat16 with its weight reordered once into oneDNN's blocked layout.

    nn.Linear hands oneDNN the plain (out, in) bfloat16 weight, which it reorders on every
    call: a 576 -> 1536 product costs ~78 us on this CPU whatever the row count. Reordered
    once at load (as inductor's freezing does), the same product takes ~32 us for one row and
    ~40 us for sixteen (AMX tiles): a tree pass costs about what a one-token pass does, and a
    row's bits do not depend on how many rows share the pass (tested).

    Where a shape needs it, one row goes through as two (the row twice, the first answer
    kept): oneDNN takes another kernel for a single row, which on a CPU without AMX (AMD EPYC,
    AVX512-BF16) sums a 1536-long row in another order than the many-row one (19 of 115200
    outputs one bfloat16 step apart), and speculative answers parted from plain ones on the
    default model. Two rows and more agree with each other. Which shapes need it is measured
    once per shape (_one_row_sums_differently): padding every product cost a one-token
    pass 13% (17.2 -> 19.3 ms), the down products alone ~0.5 ms."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().to(torch.bfloat16).contiguous()
        # A plain attribute, not a buffer: the blocked tensor must not be moved or cast.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().bfloat16(), False)
        self.one_row_as_two = _one_row_sums_differently(self.in_features, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.one_row_as_two and x.numel() == self.in_features:  # as the first of two (see above)
            y = _onednn_product(x.reshape(1, -1).expand(2, -1), self.packed, self.bias)
            return y[0].reshape(*x.shape[:-1], self.out_features)
        return _onednn_product(x, self.packed, self.bias)


def _onednn_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T (+ bias) in bfloat16 on oneDNN, W reordered once (_reorder_linear_weight)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@functools.cache
def _one_row_sums_differently(in_features: int, out_features: int) -> bool:
    """Whether oneDNN's one-row bfloat16 kernel for this shape sums a row in another order than
    its many-row kernel on this CPU: random rows, each alone and as the first of two, ~130k
    outputs. Where the orders differ some outputs come out a step apart (1536 -> 576 on the
    AMD EPYC: ~1.6e-4 of them, so ~20 here); where they are the same, none can."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
    rows = max(8, 2**17 // out_features)
    x = (torch.randn(rows + 1, in_features, generator=generator) * 4).bfloat16()
    with torch.inference_mode():
        return any(not torch.equal(_onednn_product(x[r : r + 1], packed, None)[0],
                                   _onednn_product(x[r : r + 2], packed, None)[0]) for r in range(rows))


def bf16_packing_available() -> bool:
    """oneDNN with native (or AVX-512 emulated) bfloat16: what PackedBF16Linear runs on."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _row_counts(rows: int | tuple[int, ...] | None) -> tuple[int, ...]:
    return () if rows is None else (rows,) if isinstance(rows, int) else tuple(rows)


class TransposedLinear(_PackableLinear):
    """nn.Linear with its weight stored (in, out): forward is x @ weight_t (+ bias)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_t = nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)
        self.bias = linear.bias

    @property
    def weight(self) -> torch.Tensor:
        """The (out, in) view nn.Linear users expect (read-only use: a transposed view)."""
        return self.weight_t.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._packed_forward(x)
        if y is not None:
            return y
        y = torch.matmul(x, self.weight_t)
        return y if self.bias is None else y + self.bias


class WeightFirstLinear(_PackableLinear):
    """nn.Linear computed as (W @ x.T).T: same weight tensor (tied embeddings stay tied)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._packed_forward(x)
        if y is not None:
            return y
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] < 4:  # one to three rows: nn.Linear's own path is as fast
            return nn.functional.linear(x, self.weight, self.bias)
        y = torch.mm(self.weight, rows.t()).t()
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def use_fast_cpu_layouts(model: nn.Module) -> int:
    """Swap a float32 CPU model's nn.Linear layers for the layouts above; returns how many.

    Only exact nn.Linear instances are touched: quantized layers (bitsandbytes subclasses)
    and anything on a GPU keep their own kernels.
    """
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _swappable(child) and child is lm_head:
                setattr(parent, name, WeightFirstLinear(child))
            elif _swappable(child) or _bf16_packable(child):
                setattr(parent, name, fast_linear(child))
            else:
                continue
            swapped += 1
    return swapped


def pack_for_rows(model: nn.Module, rows: int | tuple[int, ...] | None) -> int:
    """Pack every fast layer of `model` for products of exactly `rows` rows (one count or a few;
    None: drop packs). Each count is a full copy of the weights, so keep to one or two.

    Returns how many layers hold a pack. Repacking for the sizes already packed costs
    nothing; a new size takes ~0.25 s for SmolLM2-135M and replaces the packs of sizes no
    longer asked for.
    """
    if not PACKING_AVAILABLE:
        return 0
    layers = [m for m in model.modules() if isinstance(m, _PackableLinear)]
    for layer in layers:
        layer.pack(rows)
    return sum(layer.packed is not None for layer in layers)


def fast_linear(linear: nn.Linear) -> nn.Module:
    """`linear` in the fast layout where one applies (for a layer the caller owns), else itself."""
    if _swappable(linear):
        return TransposedLinear(linear)
    return PackedBF16Linear(linear) if _bf16_packable(linear) else linear


def fast_cpu_copy(module: nn.Module) -> nn.Module:
    """An inference copy of `module` in the fast layouts, or `module` itself if none applies.

    A copy, not a swap in place: a caller may still train or save the module it passed,
    and an optimizer holding its old parameters would silently stop updating what runs.
    """
    if not any(_swappable(m) or _bf16_packable(m) for m in module.modules()):
        return module
    fast = copy.deepcopy(module)
    use_fast_cpu_layouts(fast)
    return fast


def _swappable(layer: nn.Module) -> bool:
    return type(layer) is nn.Linear and layer.weight.device.type == "cpu" and layer.weight.dtype == torch.float32


def _bf16_packable(layer: nn.Module) -> bool:
    return (type(layer) is nn.Linear and layer.weight.device.type == "cpu"
            and layer.weight.dtype == torch.bfloat16 and bf16_packing_available())
