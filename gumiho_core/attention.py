"""Tree attention for grouped-query models without copying the KV cache.

transformers' SDPA path, given an explicit mask (the draft tree's) and more than one query,
repeats every key/value head for each query head sharing it (`repeat_kv`): a full copy of
the layer's cache, every layer, every verification pass. For SmolLM2-135M (9 query heads,
3 KV heads) that is ~10 ms of a ~90 ms 16-token pass on this CPU.

Instead the query heads that share a KV head are stacked along the query axis:
(B, H, T, d) -> (B, H_kv, n_rep * T, d), the mask repeated n_rep times along that axis,
and one SDPA call over the KV heads does the same dot products, softmaxes and weighted sums as
before, each query row over exactly the same keys with the same mask row. transformers does
this itself for one query token (`pack_gqa`); this extends it to trees.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "gumiho_sdpa"


def packed_gqa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    n_rep = getattr(module, "num_key_value_groups", 1)
    b, h, q_len, d = query.shape
    # One query, no mask or a per-head mask (it cannot be shared across a group): transformers' own path.
    if (n_rep == 1 or q_len == 1 or attention_mask is None or attention_mask.shape[1] != 1
            or kwargs.get("position_bias") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    q = query.reshape(b, h // n_rep, n_rep * q_len, d)  # head kv*n_rep + r -> rows r*T .. r*T+T-1
    # (B, 1, n_rep * T, kv): row r*T + t is query t's row
    mask = attention_mask.expand(b, 1, q_len, -1).repeat(1, 1, n_rep, 1)
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling)
    return out.reshape(b, h, q_len, d).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, packed_gqa_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)  # prefill and plain steps build SDPA's masks


def use_packed_gqa(model) -> bool:
    """Switch a model that runs transformers' SDPA attention to the packed form; True if switched."""
    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False  # eager, flash-attn or another choice of the user's stays as it is
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(NAME)
    else:
        config._attn_implementation = NAME
    return True
