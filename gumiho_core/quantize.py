"""Weight precision of the fast decoder, applied once at load time.

A small model's decoding pass is bound by reading its weights: SmolLM2-135M is 540 MB in
float32, read once per pass. Weight-only quantization stores them smaller and multiplies
with activations in bfloat16 (the CPU's AVX512-BF16 / AMX units; a GPU's tensor cores):
- "int8": one int8 per weight, one scale per output row (`aten._weight_int8pack_mm`, the
  kernel gpt-fast's int8 mode uses); 4x less to read than float32;
- "int4": 4-bit weights in groups of 32 along the input, each group with its own scale and
  offset. This is the layout of the default GGUF's Q4_1 blocks (4-bit, asymmetric, groups
  of 32): quantizing the weights that file de-quantized to recovers its own grid. On an x86 CPU
  with AVX2 (or AVX512-VNNI) and a C compiler the products run on groupwise_matmul.c (`GroupwiseLinear`: activations
  quantized to int8 per group of 32, as llama.cpp's Q4_1 x Q8_1; the lm_head 8-bit the same
  way); elsewhere on PyTorch's `_weight_int4pack_mm_for_cpu` / `_weight_int4pack_mm` (CUDA)
  with bfloat16 activations and an int8 lm_head;
- "bfloat16": the weights halved in size, no quantization, re-laid out once for oneDNN
  (cpu_matmul.PackedBF16Linear): on AMX a 16-row product costs ~1.25x a 1-row one, where the
  int8 / int4 kernels' cost grows with every 4 rows - the precision in which trees pay most;
- "float32": the weights as loaded, in the CPU-friendly layouts of cpu_matmul.py.

Only the fast decoder's linear layers and its lm_head change; norms and the rotary table
stay exact, and every pass - plain or speculative - runs the same kernels, so speculative
output still equals plain output of the same precision (docs/fast_decoder.md: row counts).
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from .cpu_matmul import bf16_packing_available, fast_cpu_copy, fast_linear, use_fast_cpu_layouts
from .errors import GumihoError

PRECISIONS = ("float32", "bfloat16", "int8", "int4")
INT4_GROUP = 32


class Int8WeightOnlyLinear(nn.Module):
    """y = x @ (int8 weight * per-row scale).T, activations in bfloat16."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.register_buffer("weight", torch.round(w / scales[:, None]).clamp(-128, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(torch.bfloat16))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().bfloat16(), False)
        self.out_features = w.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        y = torch.ops.aten._weight_int8pack_mm(rows, self.weight, self.scales)
        y = y if self.bias is None else y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


class Int4WeightOnlyLinear(nn.Module):
    """4-bit weights in groups of 32 inputs, each group w = (q - 8) * scale + zero, on
    PyTorch's kernels (bfloat16 activations): where GroupwiseLinear's kernels do not run."""

    def __init__(self, linear: nn.Linear, group: int = INT4_GROUP):
        super().__init__()
        q, scales, low = quantize_groups(linear.weight, bits=4)
        # The kernel reads w = (q - 8) * scale + zero, so zero = low + 8 * scale.
        scales_and_zeros = torch.stack([scales, low + 8 * scales], dim=-1).transpose(0, 1).contiguous()
        self.on_cuda = q.is_cuda  # not `cuda`: that is nn.Module's own method
        self.register_buffer("weight", self._pack(q))
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(torch.bfloat16))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().bfloat16(), False)
        self.out_features, self.group = q.shape[0], group

    def _pack(self, q: torch.Tensor) -> torch.Tensor:
        if self.on_cuda:
            as_bytes = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
            return torch.ops.aten._convert_weight_to_int4pack(as_bytes, 8)
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self.on_cuda:
            y = torch.ops.aten._weight_int4pack_mm(rows, self.weight, self.group, self.scales_and_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.weight, self.group, self.scales_and_zeros)
        y = y if self.bias is None else y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


class GroupwiseLinear(nn.Module):
    """4- or 8-bit weights in groups of 32 inputs, w = q * scale + low, on groupwise_matmul.c
    (AVX2, or AVX512-VNNI and AMX for many rows), activations quantized to int8 per group of 32 as
    llama.cpp does: a pass over 16 tree rows costs ~2.5x a one-row pass, where PyTorch's int4
    kernel costs ~5x."""

    def __init__(self, linear: nn.Linear, bits: int, kernels, out_dtype=torch.bfloat16):
        """out_dtype float32: outputs as the kernel sums them (the lm_head: logits rounded to
        bfloat16 tie at a spacing of 0.125 around 25, and greedy decoding would pick among
        ties by token id)."""
        super().__init__()
        # A few thousand outputs at a time: the float32 and int32 copies of a whole lm_head
        # (49k x 576) would add ~0.5 GB to the chat's peak memory at load.
        parts = [groupwise_layout(*quantize_groups(rows, bits), bits) for rows in linear.weight.detach().split(2048)]
        weights, scales_and_lows = (torch.cat(column) for column in zip(*parts))
        self.kernels, self.bits, self.out_dtype = kernels, bits, out_dtype
        self.register_buffer("weight", weights)
        self.register_buffer("scales_and_lows", scales_and_lows.to(torch.bfloat16))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().bfloat16(), False)
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.is_contiguous() and self.bias is None:  # the decoder's layers: no reshaping
            return self.kernels.groupwise_matmul(x, self.weight, self.bits, self.scales_and_lows, self.out_dtype)
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        y = self.kernels.groupwise_matmul(rows, self.weight, self.bits, self.scales_and_lows, self.out_dtype)
        y = y if self.bias is None else y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def quantize_groups(weight: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q (out, in) int32 in 0 .. 2^bits - 1, scales, lows (out, in / 32)): w ~ q * scale + low."""
    w = weight.detach().float()
    groups = w.reshape(w.shape[0], w.shape[1] // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    levels = 2**bits - 1
    scales = ((high - low) / levels).clamp(min=1e-12)
    q = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, levels).to(torch.int32)
    return q.reshape(w.shape), scales, low


def groupwise_layout(q: torch.Tensor, scales: torch.Tensor, lows: torch.Tensor,
                     bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """groupwise_matmul.c's layout of q (out, in) and per-group scales / lows (out, in / 32):
    (weights (out / 16, in / 32, 32 * bits) uint8, scales and lows (out / 16, in / 32, 2, 16))."""
    blocks, groups = q.shape[0] // 16, q.shape[1] // INT4_GROUP
    # A group's tile row p holds, for outputs 0..15, inputs 4p .. 4p + 3: element 64 p + 4 out + i.
    tile = q.view(blocks, 16, groups, 8, 4).permute(0, 2, 3, 1, 4).reshape(blocks, groups, 512)
    weights = tile if bits == 8 else tile[..., :256] | tile[..., 256:] << 4
    per_block = [t.view(blocks, 16, groups).transpose(1, 2) for t in (scales, lows)]
    return weights.to(torch.uint8).contiguous(), torch.stack(per_block, dim=2).contiguous()


def groupwise_kernels():
    """(cpu_kernels, "") where groupwise_matmul.c runs on this machine (AVX2 or AVX-512, a C
    compiler), else (None, why not)."""
    from .cpu_kernels import load

    kernels, why = load()
    if kernels is not None and not kernels.groupwise:
        return None, "this CPU has no AVX2 / FMA"
    return kernels, why


def _groupwise_kernels(linear: nn.Linear):
    """cpu_kernels where groupwise_matmul.c runs this layer (groupwise_kernels(), sizes in whole
    groups and blocks), else None."""
    if linear.weight.device.type != "cpu" or linear.in_features % INT4_GROUP or linear.out_features % 16:
        return None
    return groupwise_kernels()[0]


def check_precision(precision: str, device: str = "cpu") -> None:
    """A clear line for a precision this machine cannot run (before anything loads)."""
    if precision not in PRECISIONS:
        raise GumihoError(f"unknown precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    if device != "cpu" or bf16_packing_available():
        return
    kernels, why = groupwise_kernels()
    if precision == "int4" and kernels is None:
        raise GumihoError("int4 needs a CPU with bfloat16 support (AVX512-BF16 or AMX), or the engine's CPU "
                          f"kernels on AVX2, and here neither runs ({why}): use float32")
    if precision in ("int8", "bfloat16"):
        raise GumihoError(f"{precision} needs a CPU with bfloat16 support (AVX512-BF16 or AMX); "
                          "this one has none: use float32" + (" or int4" if kernels is not None else ""))


def convert_layer(layer: nn.Module, precision: str) -> nn.Module:
    """One decoder layer's linear layers (and norms) in `precision`, in place; returns it."""
    if precision == "float32":
        if _on_cpu(layer):
            use_fast_cpu_layouts(layer)
        return layer
    if precision != "bfloat16":
        # Quantized from the float32 weights, before anything is rounded to bfloat16.
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear and _quantizable(child, precision):
                    setattr(parent, name, _quantized(child, precision))
    layer.to(torch.bfloat16)  # norms, biases, layers left unquantized: bfloat16 activations
    if _on_cpu(layer):
        use_fast_cpu_layouts(layer)  # bfloat16 products on oneDNN's pre-packed weights
    return layer


def convert_output(linear: nn.Linear, precision: str) -> nn.Module:
    """The lm_head in `precision`. It stays 8-bit under int4: 4 bits over the vocabulary cost
    the most agreement for the fewest bytes (default model, teacher-forced on its float32
    answers: top-1 agreement 0.897 with it in int4, 0.977 in int8; docs/fast_decoder.md)."""
    if precision == "float32":
        return fast_linear(linear) if _on_cpu(linear) else linear
    if precision == "bfloat16":
        return fast_linear(linear.to(torch.bfloat16))
    kernels = _groupwise_kernels(linear) if precision == "int4" else None
    return Int8WeightOnlyLinear(linear) if kernels is None else GroupwiseLinear(linear, 8, kernels, torch.float32)


def _quantized(linear: nn.Linear, precision: str) -> nn.Module:
    if precision == "int8":
        return Int8WeightOnlyLinear(linear)
    kernels = _groupwise_kernels(linear)
    return GroupwiseLinear(linear, 4, kernels) if kernels is not None else Int4WeightOnlyLinear(linear)


def _quantizable(linear: nn.Linear, precision: str) -> bool:
    # int4 packs groups of 32 inputs and tiles of output rows; a layer that does not divide
    # evenly stays in bfloat16 (none in Llama-family models of usual sizes).
    if precision == "int4":
        return linear.in_features % INT4_GROUP == 0 and linear.out_features % 8 == 0
    return True


def _on_cpu(module: nn.Module) -> bool:
    return next(module.parameters()).device.type == "cpu"


def drafting_copy(module: nn.Module, target) -> nn.Module:
    """An inference copy of draft layers (the heads, the draft vocabulary's rows of the lm_head)
    for drafting beside `target`. Where the target's int4 passes run on groupwise_matmul.c,
    their linear layers go 8-bit groupwise there too: a draft step's products cost about half
    of oneDNN's bfloat16 ones, and drafting's arithmetic only changes what is proposed, never
    what is accepted. Elsewhere cpu_matmul's fast layouts (fast_cpu_copy)."""
    fast = getattr(target, "fast", None)
    kernels = getattr(getattr(fast, "lm_head", None), "kernels", None)
    if kernels is None:
        return fast_cpu_copy(module)
    if type(module) is nn.Linear:
        return GroupwiseLinear(module, 8, kernels) if _groupwise_kernels(module) else fast_cpu_copy(module)
    module = copy.deepcopy(module)
    if hasattr(module, "one_call"):  # the heads: their serial layers in one call where they can
        from .fast_heads import serial_in_one_call  # builds on this file's GroupwiseLinear

        module.one_call = serial_in_one_call(module, kernels)
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and _groupwise_kernels(child):
                setattr(parent, name, GroupwiseLinear(child, 8, kernels))
    return fast_cpu_copy(module)  # what is left (sizes not in whole groups) in the fast layouts
