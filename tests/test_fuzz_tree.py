"""Property-based tests (hypothesis) of tree building, masks, acceptance and cache trimming."""
from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from gumiho_core import SamplingSettings, TreeSettings, new_heads
from gumiho_core.draft_tree import DraftTree, build_draft_tree
from gumiho_core.heads import DraftVocabProjection
from gumiho_core.sampling import TokenChooser
from gumiho_core.verify import accept, keep_path_in_cache, tree_attention_mask
from tiny import tiny_target

VOCAB = 12


@st.composite
def trees(draw):
    n = draw(st.integers(1, 20))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    depths = [0]
    for p in parents[1:]:
        depths.append(depths[p] + 1)
    tokens = draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))
    return DraftTree(torch.tensor(tokens), parents, depths, ["root"] + ["serial"] * (n - 1))


def ancestors(tree, node):
    out = {node}
    while tree.parents[node] >= 0:
        node = tree.parents[node]
        out.add(node)
    return out


@settings(max_examples=150, deadline=None)
@given(trees(), st.integers(0, 2**31 - 1), st.integers(0, 30))
def test_greedy_acceptance_follows_argmax(tree, seed, past):
    logits = torch.randn(len(tree), VOCAB, generator=torch.Generator().manual_seed(seed))
    result = accept(tree, logits, TokenChooser(SamplingSettings()), torch.tensor([], dtype=torch.long))
    tokens = tree.tokens.tolist()
    assert result.path[0] == 0
    for a, b in zip(result.path, result.path[1:]):
        assert tree.parents[b] == a and tokens[b] == int(logits[a].argmax())
    last = result.path[-1]
    assert result.bonus == int(logits[last].argmax())
    assert all(tokens[c] != result.bonus for c in tree.children[last])
    mask = tree_attention_mask(tree, past, torch.float32, "cpu")[0, 0]
    for i in range(len(tree)):
        allowed = {j for j in range(len(tree)) if mask[i, past + j] == 0}
        assert allowed == ancestors(tree, i)
        assert (mask[i, :past] == 0).all()


@settings(max_examples=100, deadline=None)
@given(trees(), st.integers(0, 2**31 - 1), st.floats(0.3, 2.0), st.floats(0.3, 1.0))
def test_sampled_acceptance_is_well_formed(tree, seed, temperature, top_p):
    logits = torch.randn(len(tree), VOCAB, generator=torch.Generator().manual_seed(seed)) * 2
    s = SamplingSettings(temperature=temperature, top_p=top_p, seed=seed)
    chooser = TokenChooser(s)
    result = accept(tree, logits, chooser, torch.tensor([], dtype=torch.long))
    tokens = tree.tokens.tolist()
    for a, b in zip(result.path, result.path[1:]):
        assert tree.parents[b] == a
        assert chooser.probs(logits[a], torch.tensor([]).long())[tokens[b]] > 0  # never outside the support
    probs = chooser.probs(logits[result.path[-1]], torch.tensor([]).long())
    assert probs[result.bonus] > 0
    assert result.bonus not in result.rejected  # a refused candidate is never resampled


@settings(max_examples=100, deadline=None)
@given(trees(), st.integers(0, 2**31 - 1), st.integers(0, 10))
def test_cache_keeps_exactly_the_path(tree, seed, past):
    from transformers import DynamicCache
    from transformers.models.llama import LlamaConfig

    cache = DynamicCache(config=LlamaConfig(num_hidden_layers=2, hidden_size=8, num_attention_heads=2))
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, 2, past + len(tree), 4, generator=g)
    for layer in range(2):
        cache.update(k + layer, k - layer, layer)
    logits = torch.randn(len(tree), VOCAB, generator=g)
    path = accept(tree, logits, TokenChooser(SamplingSettings()), torch.tensor([], dtype=torch.long)).path
    keep_path_in_cache(cache, past, path)
    want = torch.cat([k[:, :, :past], k[:, :, [past + i for i in path]]], dim=2)
    for layer_index, layer in enumerate(cache.layers):
        assert torch.equal(layer.keys, want + layer_index) and torch.equal(layer.values, want - layer_index)


_TARGET = tiny_target(seed=5)
_HEADS = new_heads(_TARGET)
with torch.no_grad():
    for p in _HEADS.mlp_heads.parameters():
        p.normal_(0, 0.3)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 6), st.integers(2, 40), st.integers(1, 7), st.integers(1, 6), st.integers(1, 12),
    st.booleans(), st.integers(0, 4), st.integers(1, 30), st.integers(0, 2**31 - 1),
)
def test_built_trees_are_well_formed(top_k, total, depth, mlp_topk, pruning, fta, fta_tokens, context, seed):
    fta_tokens = min(fta_tokens, total - 2)
    s = TreeSettings(top_k=top_k, total_tokens=total, depth=depth, mlp_topk=mlp_topk, pruning=pruning,
                     fta=fta, fta_tokens=fta_tokens)
    g = torch.Generator().manual_seed(seed)
    cache = _HEADS.new_cache()
    tokens = torch.randint(3, 90, (context,), generator=g)
    u = _HEADS.fc_input(_TARGET.embed_tokens(tokens), torch.randn(context, 64, generator=g))
    with torch.no_grad():
        out = _HEADS.serial(u[None], torch.arange(context), cache)[0]
        tree = build_draft_tree(_HEADS, _TARGET.embed_tokens, DraftVocabProjection(_TARGET.lm_head), cache, 4,
                                out[-1], u[-1], s)
    assert len(cache) == context
    assert 1 <= len(tree) <= total and tree.max_depth <= depth
    for node in range(1, len(tree)):
        assert 0 <= tree.parents[node] < node and tree.depths[node] == tree.depths[tree.parents[node]] + 1
    if not fta:
        assert "fta" not in tree.sources
    assert sum(map(len, tree.children)) == len(tree) - 1
