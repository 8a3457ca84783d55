"""A lean decoder for Llama-family targets: what the engine runs where the architecture allows.

transformers' forward is general, and a small model pays for that on every pass: ~20 Python
ops per layer of dispatch, masks built over the whole context, a cache that grows by
concatenation (every step copies every layer's keys and values). This file does the same
arithmetic as transformers' Llama (RMSNorm, rotary positions, grouped-query attention, SiLU
MLP) with:
- a KV cache allocated once for the context (`StaticKVCache`), grown by doubling only when a
  long chat outgrows it; keeping a tree's accepted path moves its entries in place;
- q/k/v and gate/up fused into one matrix each: two products fewer per layer;
- tree attention through PyTorch's flash kernel over the cache as it lies (float32), or, where
  the activations are bfloat16 (bfloat16 / int8 / int4), through an attention whose result
  for a row does not depend on the other rows of its pass: a tree pass then decides every
  near-tie exactly as plain decoding's one-token pass does. That is cpu_kernels.c (one call
  a layer) where the machine compiles it, blocked_attention.py (PyTorch operations) elsewhere;
- weights in the precision chosen at load (quantize.py), applied once, invisible here.

`FastDecoder.from_model` builds one from a loaded transformers model, or returns the reason it
cannot (another architecture, rotary scaling, sliding windows): the engine then keeps the
generic transformers path, with the same event stream (verify.TargetPasses).
"""
from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import cpu_kernels
from .blocked_attention import BlockLayout, block_layout, blocked_attention

MADV_DONTNEED = 4  # linux/mman.h

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class StaticKVCache:
    """Keys and values of every layer, (layers, kv_heads, capacity, head_dim), and how many
    positions hold real entries. The tree's rows are written after `length` and dropped or
    moved down by `keep_path`; nothing is ever concatenated."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype, device, capacity: int = 512):
        shape = (layers, kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def get_seq_length(self) -> int:
        return self.length

    def reserve(self, needed: int) -> None:
        """Room for `needed` positions: doubling, so a long chat re-allocates a few times at most."""
        if needed <= self.capacity:
            return
        capacity = self.capacity
        while capacity < needed:
            capacity *= 2
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[0], old.shape[1], capacity, old.shape[3])
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def keep_path(self, past_len: int, path: list[int]) -> None:
        """Keep the context and the accepted path's entries (tree nodes `path`, written at
        past_len + node); the rest of the tree is left behind `length` to be overwritten."""
        if path != list(range(len(path))):
            rows = torch.tensor(path, device=self.keys.device) + past_len
            end = past_len + len(path)
            # Advanced indexing copies first, so overlapping source and target rows are safe.
            self.keys[:, :, past_len:end] = self.keys[:, :, rows]
            self.values[:, :, past_len:end] = self.values[:, :, rows]
        self.length = past_len + len(path)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # PyTorch's fused kernel: one op where transformers' LlamaRMSNorm takes seven (30 layers,
    # two norms each, every pass). It accumulates in float32 as transformers does; in float32
    # its result is the same bits, in bfloat16 it rounds once where transformers rounds twice.
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions, transformers' half-split layout: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


@dataclass
class KernelPlan:
    """A decoding pass's attention through cpu_kernels.c: which new rows each row sees."""

    ancestors: torch.Tensor  # (n, n) uint8, rows in depth order, itself included


ONE_ROW_SEES_ITSELF = torch.ones(1, 1, dtype=torch.uint8)  # read by C, never written


class FastLayer(nn.Module):
    def __init__(self, layer, shape: dict):
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.heads, self.kv_heads, self.head_dim = shape["heads"], shape["kv_heads"], shape["head_dim"]
        self.eps = shape["eps"]
        self.attn_norm = _copy(layer.input_layernorm.weight)
        self.mlp_norm = _copy(layer.post_attention_layernorm.weight)
        self.qkv = fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        self.q_norm = _copy(getattr(getattr(attn, "q_norm", None), "weight", None))  # Qwen3
        self.k_norm = _copy(getattr(getattr(attn, "k_norm", None), "weight", None))
        self.out = fuse_linears([attn.o_proj])
        self.gate_up = fuse_linears([mlp.gate_proj, mlp.up_proj])
        self.down = fuse_linears([mlp.down_proj])
        self.scale = attn.scaling
        self.kernels: cpu_kernels.CpuKernels | None = None  # set by FastDecoder where they run

    def forward(self, x, cos, sin, cache: StaticKVCache, index: int, start: int, plan):
        if self.kernels is not None:
            return self._forward_on_kernels(x, cos, sin, cache, index, start, plan)
        n, d, heads, kv_heads = x.shape[0], self.head_dim, self.heads, self.kv_heads
        qkv = self.qkv(rms_norm(x, self.attn_norm, self.eps)).view(n, heads + 2 * kv_heads, d)
        qk, v = qkv[:, : heads + kv_heads], qkv[:, heads + kv_heads :]
        if self.q_norm is not None:
            qk = torch.cat([rms_norm(qk[:, :heads], self.q_norm, self.eps),
                            rms_norm(qk[:, heads:], self.k_norm, self.eps)], dim=1)
        qk = rotate(qk, cos, sin)  # queries and keys in one go: they lie side by side
        end = start + n
        cache.keys[index, :, start:end] = qk[:, heads:].transpose(0, 1)
        cache.values[index, :, start:end] = v.transpose(0, 1)
        if isinstance(plan, BlockLayout):  # row-count invariant (blocked_attention.py)
            attn = blocked_attention(qk[:, :heads], cache.keys[index], cache.values[index], plan, self.scale)
        else:
            attn = self._flash_attention(qk[:, :heads], cache, index, end, plan)
        x = x + self.out(attn.to(x.dtype))
        gate, up = self.gate_up(rms_norm(x, self.mlp_norm, self.eps)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)

    def _forward_on_kernels(self, x, cos, sin, cache: StaticKVCache, index: int, start: int, plan):
        """forward's arithmetic with the glue in cpu_kernels.c: a norm, rotary positions and the
        cache writes, and a decoding pass's attention are one call each (cos / sin float32 (n, d))."""
        n, kernels = x.shape[0], self.kernels
        qkv = self.qkv(kernels.add_rms_norm(x, None, self.attn_norm, self.eps))
        qkv = qkv.view(n, self.heads + 2 * self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            qkv[:, : self.heads] = rms_norm(qkv[:, : self.heads], self.q_norm, self.eps)
            qkv[:, self.heads : self.heads + self.kv_heads] = rms_norm(qkv[:, self.heads : -self.kv_heads],
                                                                       self.k_norm, self.eps)
        keys, values = cache.keys[index], cache.values[index]
        q = kernels.rotate_and_store(qkv, cos, sin, keys, values, start, self.heads)
        if isinstance(plan, KernelPlan):  # row-count invariant, one call
            attn = kernels.tree_attention(q, keys, values, start, plan.ancestors, self.scale)
        else:  # a prefill: the flash kernel
            attn = self._flash_attention(q, cache, index, start + n, plan).to(x.dtype)
        hidden = kernels.add_rms_norm(x, self.out(attn), self.mlp_norm, self.eps)  # x += attention's output
        gate, up = self.gate_up(hidden).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)

    def _flash_attention(self, q, cache: StaticKVCache, index: int, end: int, mask):
        # Query heads sharing a KV head stacked along the query axis: one SDPA call per KV head
        # over the cache as it lies, no copy of it per query head (attention.py explains).
        n, d, kv_heads = q.shape[0], self.head_dim, self.kv_heads
        rep = self.heads // kv_heads
        q = q.reshape(n, kv_heads, rep, d).permute(1, 2, 0, 3).reshape(1, kv_heads, rep * n, d)
        # float32 whatever the cache holds: a prompt's attention keeps float32's precision
        keys, values = cache.keys[index : index + 1, :, :end].float(), cache.values[index : index + 1, :, :end].float()
        attn = F.scaled_dot_product_attention(q.float(), keys, values, attn_mask=mask, scale=self.scale)
        return attn.view(kv_heads, rep, n, d).permute(2, 0, 1, 3).reshape(n, self.heads * d)


class FastDecoder(nn.Module):
    """The decoder stack (embedding -> layers -> final norm) over a StaticKVCache."""

    def __init__(self, model, precision: str = "float32", discard_originals: bool = False):
        """discard_originals: the transformers layers are released once this is built (the
        chat): each one's memory is handed back as soon as it is copied (peak memory)."""
        from .quantize import convert_layer, convert_output  # quantize.py builds on this file's layers

        super().__init__()
        config, base = model.config, model.base_model
        self.shape = decoder_shape(config)
        # The embedding table is shared with the transformers model, as a plain tensor so that
        # changing the decoder's precision (quantize.py) never touches it: a lookup, its rows
        # cast to the decoder's dtype. Everything else is the decoder's own copy.
        self.embedding = base.embed_tokens.weight.detach()
        # Each layer copied and turned into its precision before the next is copied: the
        # float32 copies never all exist at once (peak memory at load).
        self.layers = nn.ModuleList()
        for layer in base.layers:
            self.layers.append(convert_layer(FastLayer(layer, self.shape), precision))  # its own copies
            if discard_originals:
                hand_back_pages(layer)
        self.norm = _copy(base.norm.weight.to(torch.float32 if precision == "float32" else torch.bfloat16))
        self.lm_head = convert_output(fuse_linears([model.get_output_embeddings()]), precision)
        self.rope = RotaryTable(self.shape["head_dim"], self.shape["rope_theta"])
        self.precision = precision
        # Row-invariant attention in one call a layer where the machine builds the kernel.
        self.kernels, self.kernels_note = None, ""
        if self.row_invariant and self.norm.device.type == "cpu" and cpu_kernels.supports(self.shape["head_dim"]):
            self.kernels, self.kernels_note = cpu_kernels.load()
        self.layers_in_one_call = self._layers_in_one_call()

    @property
    def kernels(self) -> cpu_kernels.CpuKernels | None:
        """cpu_kernels.c where the decoder runs it (bfloat16 activations on a CPU that built it)."""
        return self.layers[0].kernels

    @kernels.setter
    def kernels(self, kernels: cpu_kernels.CpuKernels | None) -> None:
        for layer in self.layers:
            layer.kernels = kernels

    @property
    def row_invariant(self) -> bool:
        # Where activations are bfloat16 (bfloat16, int8, int4), the flash kernel's last bit
        # flips near-ties between tree and one-token passes: decoding takes blocked attention.
        return self.precision != "float32"

    @classmethod
    def from_model(cls, model, precision: str = "float32",
                   discard_originals: bool = False) -> tuple[FastDecoder | None, str]:
        """(decoder in `precision` (quantize.py), "") or (None, why the transformers path stays)."""
        why = unsupported_reason(model)
        return (None, why) if why else (cls(model, precision, discard_originals), "")

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype

    def new_cache(self, capacity: int = 512) -> StaticKVCache:
        s = self.shape
        # bfloat16 where cpu_kernels.c reads it: the keys and values are bfloat16 numbers in
        # these precisions, so it is the same values in half the bytes a pass reads (at 1500
        # tokens of context the float32 cache was more than the int4 weights). Elsewhere
        # float32: blocked attention computes in float32 from it, and float32 keeps it as it is.
        dtype = torch.bfloat16 if self.kernels is not None else torch.float32
        return StaticKVCache(len(self.layers), s["kv_heads"], s["head_dim"], dtype, self.norm.device, capacity)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache,
                ancestors: torch.Tensor | None = None) -> torch.Tensor:
        """Features (n, H) of `tokens`, written into the cache after its `length` entries.

        ancestors: (n, n) bool, which of the new rows each row sees (a tree's ancestor mask,
        itself included); None = causal (prefill, one token). The cache's length grows by n;
        a tree pass is trimmed to its accepted path afterwards (StaticKVCache.keep_path)."""
        n, start = len(tokens), cache.length
        cache.reserve(start + n)
        # Decoding steps (one token, or a tree): a row's bits do not depend on the pass.
        # A prefill keeps the flash kernel: plain and speculative decoding share it.
        decoding = self.row_invariant and (n == 1 or ancestors is not None)
        if decoding and self.kernels is not None and self.layers_in_one_call is not None:  # one C call
            self.rope.cover(cache.capacity)  # every position the cache can hold
            plan = self._row_invariant_plan(start, positions, ancestors)
            features = self.kernels.decoder_pass(*self.layers_in_one_call, tokens, self.embedding, self.rope.cos,
                                                 self.rope.sin, positions, cache.keys, cache.values, start,
                                                 plan.ancestors, self.norm)
            cache.length = start + n  # as a transformers cache: the new rows are in, kept or not
            return features
        cos, sin = self.rope(positions, torch.float32 if self.kernels else self.dtype)
        plan = self._row_invariant_plan(start, positions, ancestors) if decoding else self._mask(n, start, ancestors)
        x = F.embedding(tokens, self.embedding).to(self.dtype)
        for index, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, index, start, plan)
        cache.length = start + n
        if self.kernels is not None:  # the layers' own norm kernel: one call, where PyTorch's ran cold
            return self.kernels.add_rms_norm(x.contiguous(), None, self.norm, self.shape["eps"])
        return rms_norm(x, self.norm, self.shape["eps"])

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        return self.lm_head(features).float()

    def _layers_in_one_call(self) -> tuple | None:
        """(layer weights, shape) for decoder_layers.c where it covers this decoder: int4 on
        groupwise_matmul.c, no biases, no q / k norms (Qwen3). Decoding passes then run every
        layer in one call; a prefill keeps the per-layer path (the flash kernel)."""
        from .quantize import GroupwiseLinear  # quantize.py builds on this file's layers

        names = ("qkv", "out", "gate_up", "down")

        def covered(product) -> bool:
            return type(product) is GroupwiseLinear and product.bits == 4 and product.bias is None

        if self.kernels is None or any(layer.q_norm is not None or not all(covered(getattr(layer, name))
                                                                           for name in names)
                                       for layer in self.layers):
            return None
        weights = (cpu_kernels.LayerWeights * len(self.layers))()
        for slot, layer in zip(weights, self.layers):
            slot.attn_norm, slot.mlp_norm = layer.attn_norm.data_ptr(), layer.mlp_norm.data_ptr()
            for name in names:
                setattr(slot, name, getattr(layer, name).weight.data_ptr())
                setattr(slot, f"{name}_scales", getattr(layer, name).scales_and_lows.data_ptr())
        first, s = self.layers[0], self.shape
        shape = cpu_kernels.DecoderShape(len(self.layers), first.attn_norm.shape[0], s["heads"], s["kv_heads"],
                                         s["head_dim"], first.gate_up.out_features // 2, s["eps"], first.scale, 4)
        return weights, shape

    def _row_invariant_plan(self, start: int, positions: torch.Tensor, ancestors: torch.Tensor | None):
        if self.kernels is None:
            return block_layout(start, positions, ancestors)
        n = len(positions)
        if n == 1:  # a one-token pass (plain decoding's every step): one constant, no ops
            return KernelPlan(ONE_ROW_SEES_ITSELF)
        seen = ancestors if ancestors is not None else torch.ones(n, n, dtype=torch.bool).tril()
        return KernelPlan(seen.to(torch.uint8).contiguous())

    def _mask(self, n: int, start: int, ancestors: torch.Tensor | None) -> torch.Tensor | None:
        """SDPA's boolean mask (rep * n, start + n) or None when every row sees everything."""
        if n == 1:
            return None  # one new token sees the whole cache and itself
        own = ancestors if ancestors is not None else torch.ones(n, n, dtype=torch.bool).tril()
        rep = self.shape["heads"] // self.shape["kv_heads"]
        mask = torch.ones(n, start + n, dtype=torch.bool)
        mask[:, start:] = own
        return mask.repeat(rep, 1).to(self.norm.device)


class RotaryTable(nn.Module):
    """cos/sin per position, as transformers computes them (float32, then the model's dtype).

    Kept for every position so far and looked up: computing a pass's rows took seven small
    PyTorch ops, and each op right after a pass has streamed the weights through the caches
    runs cold (~0.2 ms a one-token step on the AVX2 EPYC). The table's rows are the same
    elementwise arithmetic, so the same numbers whichever pass asks."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.cos = self.sin = torch.zeros(0, head_dim)  # float32, one row per position

    def forward(self, positions: torch.Tensor, dtype):
        self.cover(int(positions.max()) + 1, positions.device)
        # (n, 1, d): broadcast over the heads of (n, heads, d)
        return self.cos[positions].to(dtype)[:, None], self.sin[positions].to(dtype)[:, None]

    def cover(self, length: int, device=torch.device("cpu")) -> None:
        """Rows for positions 0 .. length - 1 in the table, on `device` (the CPU: for C to look up)."""
        if length > len(self.cos) or self.cos.device != torch.device(device):
            length = max(length, 2 * len(self.cos), 256)
            freqs = torch.arange(length, device=device).float()[:, None] * self.inv_freq.to(device)[None, :]
            emb = torch.cat([freqs, freqs], dim=-1)
            self.cos, self.sin = emb.cos(), emb.sin()


def decoder_shape(config) -> dict:
    heads = config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    return {
        "heads": heads,
        "kv_heads": getattr(config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
        "eps": config.rms_norm_eps,
        "rope_theta": rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)),
    }


def unsupported_reason(model) -> str:
    config = model.config
    kind = getattr(config, "model_type", "?")
    if kind not in SUPPORTED_TYPES:
        return f"the fast decoder covers {', '.join(SUPPORTED_TYPES)} models, not {kind}"
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        return f"rotary scaling {rope.get('rope_type')!r} is not covered by the fast decoder"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention is not covered by the fast decoder"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} is not covered by the fast decoder"
    if any(type(m).__name__.startswith("Linear8bit") or type(m).__name__.startswith("Linear4bit")
           for m in model.modules()):
        return "bitsandbytes layers keep the transformers path"
    return ""


def hand_back_pages(module: nn.Module) -> None:
    """Let the OS drop the memory pages lying wholly inside `module`'s CPU tensors, which must
    never be read again (their contents are lost: zeros, or the file they were mapped from).

    The default model's float32 weights are memory-mapped from its converted file, and every
    page the conversion reads would otherwise stay resident until the last layer is done
    (SmolLM2-135M: ~430 MB of layers at the load's peak). Pages shared with a neighbouring
    tensor are left alone."""
    if not sys.platform.startswith("linux"):
        return
    page = os.sysconf("SC_PAGE_SIZE")
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            continue
        start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
        first, last = -(-start // page) * page, end // page * page
        if last > first:
            madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_DONTNEED)


def _copy(weight: torch.Tensor | None) -> nn.Parameter | None:
    return None if weight is None else nn.Parameter(weight.detach().clone(), requires_grad=False)


def fuse_linears(linears: list[nn.Module]) -> nn.Linear:
    """A new nn.Linear whose output is the given layers' outputs side by side (one layer: a copy).
    Any layer with an (out, in) `weight` will do, cpu_matmul's layouts included."""
    weight = torch.cat([layer.weight.detach() for layer in linears]).contiguous()
    biases = [layer.bias for layer in linears]
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=biases[0] is not None,
                      dtype=weight.dtype, device=weight.device)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if biases[0] is not None:
        fused.bias = nn.Parameter(torch.cat([b.detach() for b in biases]), requires_grad=False)
    return fused
