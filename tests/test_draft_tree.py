"""The draft tree is well formed: parents first, masks = ancestry, budget respected."""
from __future__ import annotations

import pytest
import torch

from gumiho_core import TreeSettings, new_heads
from gumiho_core.draft_tree import build_draft_tree
from gumiho_core.heads import DraftVocabProjection
from gumiho_core.verify import tree_attention_mask
from tiny import tiny_target


@pytest.fixture(scope="module")
def setup():
    target = tiny_target(seed=1)
    heads = new_heads(target)
    # Randomise the zero-initialised MLP heads so their candidates differ by depth.
    torch.manual_seed(0)
    with torch.no_grad():
        for p in heads.mlp_heads.parameters():
            p.normal_(0, 0.2)
    return target, heads


def draft(target, heads, settings, context=12):
    cache = heads.new_cache()
    feats = torch.randn(context, target.hidden_size)
    tokens = torch.randint(3, 90, (context,))
    u = heads.fc_input(target.embed_tokens(tokens), feats)
    out = heads.serial(u[None], torch.arange(context), cache)[0]
    tree = build_draft_tree(heads, target.embed_tokens, DraftVocabProjection(target.lm_head, heads.draft_vocab), cache, 5, out[-1], u[-1], settings)
    assert len(cache) == context, "the draft cache must be restored"
    return tree


@pytest.mark.parametrize("settings", [
    TreeSettings(),
    TreeSettings(top_k=6, total_tokens=40, depth=7, mlp_topk=6, pruning=12, fta=True, fta_tokens=5),
    TreeSettings(top_k=2, total_tokens=5, depth=7, mlp_topk=2, pruning=2, fta=False, fta_tokens=0),
    TreeSettings(top_k=3, total_tokens=9, depth=2, fta=True, fta_tokens=2),
])
def test_tree_is_well_formed(setup, settings):
    target, heads = setup
    tree = draft(target, heads, settings)
    assert len(tree) <= settings.total_tokens
    assert tree.parents[0] == -1 and tree.depths[0] == 0 and int(tree.tokens[0]) == 5
    for node in range(1, len(tree)):
        parent = tree.parents[node]
        assert 0 <= parent < node
        assert tree.depths[node] == tree.depths[parent] + 1
    assert tree.max_depth <= settings.depth
    mask = tree.ancestor_mask()
    for node in range(len(tree)):
        ancestors, n = {node}, node
        while tree.parents[n] >= 0:
            n = tree.parents[n]
            ancestors.add(n)
        assert set(torch.nonzero(mask[node]).flatten().tolist()) == ancestors
    for path in tree.retrieve_paths():
        assert path[0] == 0 and not tree.children[path[-1]]
        assert all(tree.parents[b] == a for a, b in zip(path, path[1:]))
    full = tree_attention_mask(tree, 7, torch.float32, "cpu")
    assert full.shape == (1, 1, len(tree), 7 + len(tree))
    assert (full[0, 0, :, :7] == 0).all()
    if not settings.fta:
        assert "fta" not in tree.sources


def test_serial_then_mlp_depths(setup):
    target, heads = setup
    tree = draft(target, heads, TreeSettings(top_k=4, total_tokens=30, depth=7, mlp_topk=4, pruning=8))
    for depth, source in zip(tree.depths[1:], tree.sources[1:]):
        if source == "serial":
            assert depth <= heads.config.serial_depth
        elif source == "mlp":
            assert depth > heads.config.serial_depth
    assert tree.max_depth > heads.config.serial_depth


def test_fta_extends_short_leaves_with_real_nodes(setup):
    target, heads = setup
    tree = draft(target, heads, TreeSettings(top_k=4, total_tokens=16, depth=6, mlp_topk=2, pruning=3, fta=True, fta_tokens=3))
    fta_nodes = [n for n, s in enumerate(tree.sources) if s == "fta"]
    assert fta_nodes, "this tree has short leaves, so FTA should extend some"
    for n in fta_nodes:
        # Its token is one a longer path carries at that depth.
        same_depth = [int(tree.tokens[m]) for m in range(len(tree)) if tree.depths[m] == tree.depths[n] and m != n]
        assert int(tree.tokens[n]) in same_depth
