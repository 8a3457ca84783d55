"""The training forward predicts exactly what the engine drafts (so validation accuracy = acceptance).

With top_k = mlp_topk = pruning = 1 the engine's draft tree is a single chain d1..d7. Feed
the training forward the same context followed by d1, d2 (teacher forcing on the drafted
tokens, which is what the engine conditions on), and make the target's "true" token at each
depth d_k: every depth must then count as correct at the context's last position. Any
off-by-one in the training indexing (serial depth 2 input, MLP pair, shifts) breaks this.
"""
from __future__ import annotations

import torch

from gumiho_core.draft_tree import build_draft_tree
from gumiho_core.heads import DraftVocabProjection
from gumiho_core.settings import TreeSettings
from gumiho_core.train import DraftTrainer, new_trainable_heads
from tiny import random_prompts, tiny_target

CHAIN = TreeSettings(top_k=1, total_tokens=8, depth=7, mlp_topk=1, pruning=1, fta=False, fta_tokens=0)


def engine_chain(target, heads, context: list[int]) -> list[int]:
    """d1..d7 as the engine drafts them below root context[-1] (as drafter.GumihoDrafter.draft does)."""
    ids = torch.tensor(context)
    with torch.no_grad():
        features = target.base(input_ids=ids[None, :-1]).last_hidden_state[0]
        cache = heads.new_cache()
        u = heads.fc_input(target.embed_tokens(ids[1:]), features)
        out = heads.serial(u[None], torch.arange(len(ids) - 1), cache)[0]
        tree = build_draft_tree(heads, target.embed_tokens, DraftVocabProjection(target.lm_head, heads.draft_vocab), cache,
                                int(ids[-1]), out[-1], u[-1], CHAIN)
    assert tree.depths == list(range(8))  # a chain
    return tree.tokens[1:].tolist(), features


def training_says_correct(trainer, target, context, chain, features) -> list[bool]:
    L = len(context) - 1  # f_0..f_{L-1} are real; root x_L; then the drafted tokens
    ids = torch.tensor(context + chain)[None]
    f = torch.zeros(1, ids.shape[1], target.hidden_size)
    f[0, :L] = features
    # The target's token at depth k comes from f_{L-1+k}: make it d_k (a row of lm_head
    # points at its own token; checked below).
    for k, d in enumerate(chain, start=1):
        f[0, L - 1 + k] = target.lm_head.weight[d]
    assert (f[0, L:L + 7] @ target.lm_head.weight.T).argmax(-1).tolist() == chain
    batch = {"input_ids": ids, "features": f, "loss_mask": torch.ones(ids.shape)}
    with torch.no_grad():
        correct = trainer(batch, measure=True)["correct"]
    return [bool(correct[depth][0][0, L - 1]) for depth in sorted(correct)]


def test_training_forward_matches_engine_drafting():
    target = tiny_target(seed=4)
    heads = new_trainable_heads(target, draft_vocab=list(range(0, 96, 2)) + [1, 3], seed=1)
    torch.manual_seed(2)
    with torch.no_grad():  # every weight nonzero, so each input really matters
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    heads.eval()
    trainer = DraftTrainer(heads, target.embed_tokens.weight, target.lm_head.weight)
    for context in random_prompts(5, seed=11):
        chain, features = engine_chain(target, heads, context)
        assert training_says_correct(trainer, target, context, chain, features) == [True] * 7
        # And the check can fail: the same drafts one depth later are not what it predicts.
        assert training_says_correct(trainer, target, context, chain[-1:] + chain[:-1], features) != [True] * 7
