"""train_tiny_heads: heads that guess a tiny random target well enough for deep accepted paths."""
from __future__ import annotations

import time

from gumiho_core import Engine, GenerationSettings, TreeSettings, run_to_end
from gumiho_core.train import train_tiny_heads
from tiny import random_prompts, tiny_target


def test_tiny_heads_are_fast_accepted_deep_and_lossless():
    target = tiny_target(seed=0, eos=False)
    start = time.time()
    heads = train_tiny_heads(target, steps=150)
    assert time.time() - start < 30
    engine = Engine(target, heads)
    engine.drafter.guard = None  # every step drafts the full tree: the heads' acceptance is measured
    # A deep tree with the MLP heads, and no context lookup: what is accepted is the heads'.
    tree = TreeSettings(top_k=4, total_tokens=16, depth=7, mlp_topk=4, pruning=8, fta=True, fta_tokens=2,
                        lookup_tokens=0)
    taus, deepest = [], 0
    for prompt in random_prompts(4, seed=99):
        spec = run_to_end(engine, prompt, GenerationSettings(max_new_tokens=40, tree=tree))
        plain = run_to_end(engine, prompt, GenerationSettings(max_new_tokens=40, speculative=False))
        assert spec.token_ids == plain.token_ids
        taus.append(spec.stats.tau)
        deepest = max(deepest, sum(1 for a in spec.stats.accepted_at_depth if a))
    # Untrained heads give tau ~1.0 here; these reach ~1.6 with depth-3 acceptances.
    assert sum(taus) / len(taus) > 1.3
    assert deepest >= 3
