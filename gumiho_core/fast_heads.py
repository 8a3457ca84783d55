"""The serial draft head's layers in one C call, where its drafting copy's products run on
groupwise_matmul.c (quantize.drafting_copy sets it up once; drafting does not see it).

Why: the serial head is two decoder layers, but through PyTorch each is ~20 small calls
(seven 8-bit products through ctypes, norms, rotary positions, attention in bfloat16, a cache
grown by torch.cat): 2.8-3.7 ms a draft step on the AVX2 machine, a third of a one-token
target pass, and 40-45 ms when a heads step follows a stretch of root steps. The head's layers
have the target's shape (RMSNorm, rotary grouped-query attention, SiLU-gated MLP) but for the
first one reading fc's output without a norm, so decoder_layers.c runs them as it runs the
target's: every layer in one call, into a preallocated cache. Drafting arithmetic changes what
is proposed, never what is accepted (verify.accept).

`GumihoHeads.serial` takes this path whenever its cache is a `StaticDraftCache` and the mask is
one decoder_layers.c can express (every row sees the whole cache, and among the new rows
whichever the mask says: the causal read of new tokens, depth 2's beams); anything else (a
deeper serial depth's ancestry) goes through the PyTorch layers on the same cache.
"""
from __future__ import annotations

import math

import torch

from . import cpu_kernels
from .fast_decoder import fuse_linears
from .heads import rotary
from .quantize import GroupwiseLinear

BITS = 8  # the drafting copy's products (quantize.drafting_copy)


class StaticDraftCache:
    """The serial head's keys / values, (layers, kv_heads, capacity, head_dim) bfloat16 each as
    decoder_layers.c writes them, doubled when a chat outgrows it. It keeps heads.DraftCache's
    interface for the PyTorch layers: append a layer's new entries, crop, len."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int = 512):
        self.keys = torch.zeros(layers, kv_heads, capacity, head_dim, dtype=torch.bfloat16)
        self.values = torch.zeros_like(self.keys)
        self.lengths = [0] * layers  # per layer: the PyTorch layers append one layer at a time

    def __len__(self) -> int:
        return self.lengths[0]

    def reserve(self, needed: int) -> None:
        capacity = self.keys.shape[2]
        if needed <= capacity:
            return
        while capacity < needed:
            capacity *= 2
        filled = max(self.lengths)
        for name in ("keys", "values"):
            old = getattr(self, name)
            grown = old.new_zeros(*old.shape[:2], capacity, old.shape[3])
            grown[:, :, :filled] = old[:, :, :filled]
            setattr(self, name, grown)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (1, kv_heads, t, head_dim): stored after this layer's entries; returns the layer's
        keys and values so far, (1, kv_heads, length, head_dim) views."""
        start, t = self.lengths[layer], k.shape[2]
        self.reserve(start + t)
        self.keys[layer, :, start : start + t] = k[0]
        self.values[layer, :, start : start + t] = v[0]
        self.lengths[layer] = start + t
        return self.keys[layer, :, : start + t][None], self.values[layer, :, : start + t][None]

    def crop(self, length: int) -> None:
        self.lengths = [min(filled, length) for filled in self.lengths]


class SerialInOneCall:
    """The serial head's layers as decoder_layers.c takes them: fused q/k/v and gate/up
    products, 8-bit groupwise like the rest of the drafting copy."""

    def __init__(self, heads, kernels):
        c = heads.config
        self.kernels, self.config = kernels, c
        self.products = []  # kept alive: the C structs below point into them
        self.norms = []
        self.layers = (cpu_kernels.LayerWeights * len(heads.layers))()
        for slot, layer in zip(self.layers, heads.layers):
            attention, mlp = layer.self_attn, layer.mlp
            products = {"qkv": [attention.q_proj, attention.k_proj, attention.v_proj], "out": [attention.o_proj],
                        "gate_up": [mlp.gate_proj, mlp.up_proj], "down": [mlp.down_proj]}
            for name, linears in products.items():
                product = GroupwiseLinear(fuse_linears(linears), BITS, kernels)
                self.products.append(product)
                setattr(slot, name, product.weight.data_ptr())
                setattr(slot, f"{name}_scales", product.scales_and_lows.data_ptr())
            norm = getattr(layer.input_layernorm, "weight", None)  # the first layer has none
            self.norms += [n.detach().bfloat16().contiguous() for n in (norm, layer.post_attention_layernorm.weight)
                           if n is not None]
            slot.attn_norm = None if norm is None else self.norms[-2].data_ptr()
            slot.mlp_norm = self.norms[-1].data_ptr()
        self.shape = cpu_kernels.DecoderShape(c.num_layers, c.hidden_size, c.num_attention_heads,
                                              c.num_key_value_heads, c.attn_head_dim, c.intermediate_size,
                                              c.rms_norm_eps, 1 / math.sqrt(c.attn_head_dim), BITS)

    def new_cache(self) -> StaticDraftCache:
        c = self.config
        return StaticDraftCache(c.num_layers, c.num_key_value_heads, c.attn_head_dim)

    def ancestors(self, cache, mask: torch.Tensor | None, n: int) -> torch.Tensor | None:
        """decoder_layers.c's (n, n) uint8 view of `mask` over n new rows ((..., n, len(cache) + n)
        bool, None: causal), or None where this path cannot run it: another kind of cache, or
        new rows that do not all see the whole cache."""
        if not isinstance(cache, StaticDraftCache) or len(set(cache.lengths)) != 1:
            return None
        if mask is None:
            return torch.ones(n, n, dtype=torch.uint8).tril()
        mask = mask.reshape(mask.shape[-2:])
        start = len(cache)
        if mask.shape[1] != start + mask.shape[0] or not bool(mask[:, :start].all()):
            return None
        return mask[:, start:].to(torch.uint8).contiguous()

    def __call__(self, u: torch.Tensor, positions: torch.Tensor, cache: StaticDraftCache,
                 ancestors: torch.Tensor) -> torch.Tensor:
        """The layers' output (1, n, H) for fc inputs u (1, n, H); their keys and values go into
        the cache after its entries. ancestors: as ancestors() gave it."""
        x = u[0].to(torch.bfloat16).contiguous().clone()  # decoder_layers.c works in place
        n, start, c = x.shape[0], len(cache), self.config
        cache.reserve(start + n)
        cos, sin = rotary(positions, c.attn_head_dim, c.rope_theta, torch.float32)
        self.kernels.decoder_layers(self.layers, self.shape, x, cos.contiguous(), sin.contiguous(), cache.keys,
                                    cache.values, start, ancestors)
        cache.lengths = [start + n] * len(cache.lengths)
        return x[None].to(u.dtype)


def serial_in_one_call(heads, kernels) -> SerialInOneCall | None:
    """The one-call path for these heads (float linear layers, before the drafting copy
    replaces them), or None where decoder_layers.c does not cover them."""
    c = heads.config
    linears = [module for layer in heads.layers for module in (*layer.self_attn.children(), *layer.mlp.children())]
    if (kernels is None or not kernels.groupwise or not cpu_kernels.supports(c.attn_head_dim)
            or c.hidden_size % 32 or c.intermediate_size % 32
            or any(type(m) is not torch.nn.Linear or m.bias is not None or m.weight.device.type != "cpu"
                   for m in linears)):
        return None
    return SerialInOneCall(heads, kernels)
