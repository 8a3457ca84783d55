"""Context lookup: the tokens that followed the context's tail before join the draft tree.

The lookup itself (context_lookup.look_up), the merge into the tree
(DraftTree.add_chain), and losslessness when looked-up tokens are verified and accepted.
"""
from __future__ import annotations

import torch

from gumiho_core import Engine, GenerationSettings, TreeSettings, new_heads, run_to_end
from gumiho_core.context_lookup import LookupLength, look_up
from gumiho_core.draft_tree import DraftTree
from gumiho_core.drafter import RecordingDrafter
from tiny import hf_greedy, random_prompts, tiny_target


def ids(*tokens):
    return torch.tensor(tokens)


def continuation(context, length, min_ngram=1):
    """The looked-up tokens alone."""
    return look_up(context, length, min_ngram=min_ngram).tokens


def test_longest_tail_wins_and_latest_occurrence_among_equals():
    # tail (7, 8, 9): the 3-gram occurred once (-> 20); the 2-gram (8, 9) later (-> 30).
    ctx = ids(7, 8, 9, 20, 21, 8, 9, 30, 31, 7, 8, 9)
    assert continuation(ctx, 2) == [20, 21]
    # Only 2-grams: the latest of two occurrences.
    ctx = ids(5, 6, 40, 41, 5, 6, 50, 51, 0, 5, 6)
    assert continuation(ctx, 3) == [50, 51, 0]


def test_no_match_the_tail_itself_and_short_contexts_give_nothing():
    assert continuation(ids(1, 2, 3, 4, 5), 4) == []  # nothing repeats
    assert continuation(ids(3, 4), 4) == []  # the tail's only occurrence is itself
    assert continuation(ids(9), 4) == []
    # A 1-token tail is enough by default, not with min_ngram=2.
    assert continuation(ids(4, 11, 12, 4), 2) == [11, 12]
    assert continuation(ids(4, 11, 12, 4), 2, min_ngram=2) == []


def test_continuation_may_run_into_the_tail_and_stops_at_the_context_end():
    # A loop "a b a b": the tail (a, b) last occurred two tokens back; what followed is the tail itself.
    assert continuation(ids(1, 2, 1, 2), 8) == [1, 2]
    assert continuation(ids(1, 2, 1, 2, 1, 2), 3) == [1, 2]


def _tree():
    # root 0 -> {a:10, b:11}; a -> c:12
    return DraftTree(torch.tensor([0, 10, 11, 12]), [-1, 0, 0, 1], [0, 1, 1, 2],
                     ["root", "serial", "serial", "serial"], [0.0, -0.1, -0.5, -0.3])


def test_add_chain_follows_existing_nodes_then_adds_new_ones():
    tree = _tree().add_chain([10, 12, 13, 14])
    assert tree.tokens.tolist() == [0, 10, 11, 12, 13, 14]
    assert tree.parents == [-1, 0, 0, 1, 3, 4]
    assert tree.depths == [0, 1, 1, 2, 3, 4]
    assert tree.sources[4:] == ["lookup", "lookup"]
    assert tree.children[3] == [4] and tree.children[4] == [5]
    # The mask lets each new node see exactly its ancestors.
    mask = tree.ancestor_mask()
    assert mask[5].nonzero().flatten().tolist() == [0, 1, 3, 4, 5]


def test_add_chain_branches_where_it_disagrees_and_ranks_last_among_siblings():
    tree = _tree().add_chain([10, 20])
    assert tree.tokens.tolist() == [0, 10, 11, 12, 20]
    assert tree.parents[4] == 1 and tree.children[1] == [3, 4]
    assert tree.scores[4] == tree.scores[1]
    same = _tree()
    assert same.add_chain([10, 12]) is same and same.add_chain([]) is same


def _repeating_prompts():
    # Prompts that repeat a phrase: the tail of the context has occurred before.
    out = []
    for p in random_prompts(6, seed=21, lo=4, hi=7):
        out.append(p + p[1:] + p[1:])
    return out


def test_lookup_is_lossless_and_its_tokens_get_accepted():
    target = tiny_target(seed=4, eos=False)
    engine = Engine(target, new_heads(target))  # untrained heads: accepted runs come from the lookup
    engine.drafter.guard = None  # every step drafts: what the lookup gets accepted is measured here
    tree = TreeSettings(top_k=2, total_tokens=4, depth=2, mlp_topk=2, pruning=2, fta=False, fta_tokens=0,
                        lookup_tokens=6)
    looked_up = chain_only = 0
    for prompt in _repeating_prompts():
        recorder = RecordingDrafter(engine.drafter)
        spec = run_to_end(engine, prompt, GenerationSettings(max_new_tokens=40, tree=tree), drafter=recorder)
        trees = [t for t, _ in recorder.steps]
        plain = run_to_end(engine, prompt, GenerationSettings(max_new_tokens=40, speculative=False))
        assert spec.token_ids == plain.token_ids == hf_greedy(target, prompt, 40)
        looked_up += spec.stats.forward_passes < plain.stats.forward_passes
        # After a chain accepted whole, the heads sit out: a tree of the root and the chain.
        chain_only += sum(set(t.sources) == {"root", "lookup"} for t in trees)
    # Random tiny models fall into loops, which the lookup copies: fewer target passes.
    assert looked_up >= 3, "the lookup should have been accepted on most prompts"
    assert chain_only > 0, "repeating stretches should have been drafted by the lookup alone"


def test_lookup_off_adds_no_lookup_nodes():
    target = tiny_target(seed=4, eos=False)
    engine = Engine(target, new_heads(target))
    for lookup in (0, 6):
        tree = TreeSettings(top_k=2, total_tokens=4, depth=2, fta=False, fta_tokens=0, lookup_tokens=lookup)
        recorder = RecordingDrafter(engine.drafter)
        run_to_end(engine, _repeating_prompts()[0], GenerationSettings(max_new_tokens=30, tree=tree), drafter=recorder)
        sources = {s for t, _ in recorder.steps for s in t.sources}
        assert ("lookup" in sources) == (lookup > 0)
        assert all(len(t) <= 4 + lookup for t, _ in recorder.steps)


def test_lookup_length_grows_on_whole_chains_shrinks_on_refusals_and_resets_otherwise():
    length = LookupLength(8)
    seen = []
    for accepted in (8, 16, 32, 32, 3, 0, 0, 0, 1, 8):  # the chain offered is length.tokens long
        length.update(accepted, length.tokens)
        seen.append(length.tokens)
    assert seen == [16, 32, 32, 32, 8, 4, 2, 2, 8, 16]
    off = LookupLength(0)
    off.update(0, 0)
    assert off.tokens == 0


def test_the_context_index_answers_as_the_scan_does_as_the_context_grows():
    """ContextIndex (the drafter's lookup at every step) gives look_up's chain and match at every
    length of a growing context, whether it is extended a token or a stretch at a time."""
    from gumiho_core.context_lookup import ContextIndex

    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        context = torch.randint(0, 4 + trial % 5, (60,), generator=g)  # few symbols: many repeats
        index = ContextIndex()
        index.reset(context[:1].tolist())
        end = 1
        while end < len(context):
            end = min(len(context), end + 1 + trial % 3)
            index.follow(context[:end])
            for length, min_ngram in ((4, 1), (2, 2), (16, 1)):
                assert index.look_up(length, min_ngram) == look_up(context[:end], length, 3, min_ngram), (trial, end)
    index.follow(torch.tensor([9, 8, 9]))  # another context altogether: starts afresh
    assert index.tokens == [9, 8, 9] and index.look_up(4).tokens == [8, 9]
