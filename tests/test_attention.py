"""Packed grouped-query tree attention (attention.py) equals transformers' own, and stays lossless."""
from __future__ import annotations

import copy

import torch
from transformers import DynamicCache

from gumiho_core import Engine, TreeSettings, new_heads
from gumiho_core.attention import NAME, use_packed_gqa
from gumiho_core.draft_tree import DraftTree
from gumiho_core.verify import run_target, tree_attention_mask
from tiny import assert_lossless, random_prompts, tiny_target


def tree_logits(target, prompt, tree):
    cache = DynamicCache(config=target.config)
    run_target(target, cache, torch.tensor(prompt), torch.arange(len(prompt)))
    mask = tree_attention_mask(tree, len(prompt), torch.float32, "cpu")
    return run_target(target, cache, tree.tokens, len(prompt) + torch.tensor(tree.depths), mask)


def test_tree_pass_equals_transformers_sdpa():
    target = tiny_target(seed=2)  # 4 query heads over 2 KV heads
    reference = copy.deepcopy(target)
    assert use_packed_gqa(target.model) and target.config._attn_implementation == NAME
    tree = DraftTree(torch.randint(3, 96, (9,)), [-1, 0, 0, 1, 1, 2, 3, 3, 5], [0, 1, 1, 2, 2, 2, 3, 3, 3],
                     ["root"] + ["serial"] * 8)
    for prompt in random_prompts(3, seed=5):
        feats, logits = tree_logits(target, prompt, tree)
        ref_feats, ref_logits = tree_logits(reference, prompt, tree)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(feats, ref_feats, rtol=1e-5, atol=1e-5)


def test_decoding_with_packed_attention_is_lossless():
    target = tiny_target(seed=0, eos=False)
    use_packed_gqa(target.model)
    engine = Engine(target, new_heads(target))
    tree = TreeSettings(top_k=3, total_tokens=12, depth=4, mlp_topk=3, pruning=6)
    assert_lossless(engine, random_prompts(4, seed=22), tree)


def test_other_attention_choices_are_left_alone():
    target = tiny_target(seed=1)
    target.model.set_attn_implementation("eager")
    assert not use_packed_gqa(target.model) and target.config._attn_implementation == "eager"
