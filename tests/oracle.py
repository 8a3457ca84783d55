"""An oracle drafter for the lossless tests: it knows the target's continuation and drafts it,
corrupted at random depths and hidden among random siblings, so a test drives long accepted
paths, EOS and max_new_tokens inside a path, and paths that are not a prefix of the tree's
layout through the engine's real verification and cache code."""
from __future__ import annotations

import random

import torch

from gumiho_core.draft_tree import DraftTree
from gumiho_core.drafter import Drafter


def oracle_tree(root: int, truth: list[int], rng: random.Random, vocab: int, size: int) -> DraftTree:
    """A tree whose true path is `truth` up to a random corruption, with random siblings,
    laid out in a shuffled (but parents-first) order."""
    depth = len(truth)
    corrupt_at = rng.choice([None, None, *range(depth)])  # often fully right
    path = [t if i != corrupt_at else (t + 1 + rng.randrange(vocab - 4)) % vocab for i, t in enumerate(truth)]
    nodes = [(0, -1, root)]  # (depth, parent index in `nodes`, token)
    parent = 0
    for d, token in enumerate(path, start=1):
        nodes.append((d, parent, token))
        parent = len(nodes) - 1
    while len(nodes) < size:  # distractors hanging anywhere
        p = rng.randrange(len(nodes))
        if nodes[p][0] < depth + 1:
            nodes.append((nodes[p][0] + 1, p, rng.randrange(3, vocab)))
    # Shuffle within each depth, keep depth order so parents come first.
    order = sorted(range(len(nodes)), key=lambda i: (nodes[i][0], rng.random()))
    order.remove(0)
    order = [0, *order]
    new_index = {old: new for new, old in enumerate(order)}
    tokens = [nodes[i][2] for i in order]
    parents = [-1] + [new_index[nodes[i][1]] for i in order[1:]]
    depths = [nodes[i][0] for i in order]
    sources = ["root"] + ["serial" if d <= 2 else "mlp" for d in depths[1:]]
    return DraftTree(torch.tensor(tokens), parents, depths, sources)


class OracleDrafter(Drafter):
    """Drafts `oracle_tree`s; `truth` is the full plain answer."""

    def __init__(self):
        self.update(truth=[], rng=random.Random(0), size=12, depth=5, vocab=96)
        self.prompt_length = 0

    def update(self, **state):
        self.__dict__.update(state)

    def begin(self, prompt_ids, shared, settings):
        self.prompt_length = len(prompt_ids)

    def draft(self, step):
        k = len(step.context) - self.prompt_length  # the root is new token k-1; its continuation starts at k
        truth = self.truth[k : k + self.depth]
        if not truth:
            return DraftTree.root_only(step.root)
        return oracle_tree(step.root, truth, self.rng, self.vocab, self.size)
