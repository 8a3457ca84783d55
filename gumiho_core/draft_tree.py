"""Building the draft tree that the target verifies in one pass.

Node 0 is the root: the last token the target chose, not yet in its KV cache. Below it:
- serial depths (1..serial_depth): the serial head expands `top_k` beams by cumulative
  log-probability, EAGLE-2 style; each depth keeps the `top_k` best of top_k x top_k;
- MLP depths: the MLP heads predict every later depth at once for each final serial beam;
  each depth gives every frontier node `mlp_topk` children from its beam's prediction and
  keeps the best `pruning` by cumulative score;
- the best `total_tokens - 1` nodes overall are kept. Scores only fall along a path and
  parents come before children, so a stable sort keeps every kept node's parent too;
- Full Tree Attention (FTA): a kept leaf that stops short of the tree's depth gets one
  more child, the token that longer paths carry at that depth. Unlike a mask-only trick
  (which would let the leaf attend to a token outside its own context and change its
  logits), the supplement is a real node with its own row in the mask, so verification
  stays exact.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from .heads import DraftCache, DraftVocabProjection, GumihoHeads
from .settings import TreeSettings

SERIAL, MLP, FTA, LOOKUP = "serial", "mlp", "fta", "lookup"


@dataclass
class DraftTree:
    tokens: torch.Tensor  # (N,) long; tokens[0] is the root
    parents: list[int]  # parents[0] == -1
    depths: list[int]  # depths[0] == 0
    sources: list[str]  # "root", "serial", "mlp", "fta" or "lookup"
    scores: list[float] | None = None  # cumulative draft log-probability per node
    children: list[list[int]] = field(default_factory=list)  # best first

    def __post_init__(self):
        if not self.children:
            self.children = [[] for _ in self.parents]
            for node, parent in enumerate(self.parents):
                if parent >= 0:
                    self.children[parent].append(node)

    def __len__(self) -> int:
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @classmethod
    def root_only(cls, token: int, device=None) -> "DraftTree":
        return cls(torch.tensor([token], device=device), [-1], [0], ["root"])

    def ancestor_mask(self) -> torch.Tensor:
        """(N, N) bool: row i may attend to column j iff j is i or an ancestor of i."""
        n = len(self)
        mask = torch.eye(n, dtype=torch.bool)
        for node in range(1, n):
            mask[node] |= mask[self.parents[node]]
        return mask

    def add_chain(self, chain: list[int], source: str = LOOKUP) -> "DraftTree":
        """This tree with `chain` (tokens after the root) as one more path.

        The chain follows existing nodes while their tokens agree and continues as new
        nodes, so a guess the heads made too is verified once. New nodes go after every
        existing one (their parents come first, as verification's layout requires) and
        rank last among their siblings; they have no draft probability of their own, so
        their score is their parent's.
        """
        tokens, parents, depths = self.tokens.tolist(), list(self.parents), list(self.depths)
        sources, children = list(self.sources), [list(kids) for kids in self.children]
        scores = list(self.scores) if self.scores is not None else [0.0] * len(tokens)
        node = 0
        for token in chain:
            same = next((c for c in children[node] if tokens[c] == token), None)
            if same is None:
                tokens.append(token)
                parents.append(node)
                depths.append(depths[node] + 1)
                sources.append(source)
                scores.append(scores[node])
                children.append([])
                children[node].append(len(tokens) - 1)
                same = len(tokens) - 1
            node = same
        if len(tokens) == len(self):
            return self
        return DraftTree(torch.tensor(tokens, device=self.tokens.device), parents, depths, sources, scores, children)

    def retrieve_paths(self) -> list[list[int]]:
        """Root-to-leaf node paths, one per leaf."""
        paths = []
        for node in range(len(self)):
            if not self.children[node]:
                path = [node]
                while self.parents[path[-1]] >= 0:
                    path.append(self.parents[path[-1]])
                paths.append(path[::-1])
        return paths


class _Candidates:
    """The candidate pool, node by node: parents always come before their children."""

    def __init__(self, root_token: int):
        self.tokens, self.parents, self.depths = [root_token], [-1], [0]
        self.sources, self.scores = ["root"], [0.0]

    def add(self, tokens: list[int], parents: list[int], scores: list[float], depth: int, source: str) -> list[int]:
        first = len(self.tokens)
        self.tokens.extend(tokens)
        self.parents.extend(parents)
        self.scores.extend(scores)
        self.depths.extend([depth] * len(tokens))
        self.sources.extend([source] * len(tokens))
        return list(range(first, len(self.tokens)))


@dataclass
class _Beams:
    """The serial head's best top_k nodes at its latest depth."""

    nodes: list[int]
    tokens: torch.Tensor
    scores: torch.Tensor  # cumulative log-probabilities
    producer: torch.Tensor  # (k, H) the serial output that predicted each beam's token
    parent_input: torch.Tensor  # (k, H) the fc input of each beam's parent


@torch.no_grad()
def build_draft_tree(
    heads: GumihoHeads,
    embed,
    projection: DraftVocabProjection,
    cache: DraftCache,
    root_token: int,
    last_output: torch.Tensor,
    last_input: torch.Tensor,
    settings: TreeSettings,
    max_depth: int | None = None,
    next_position: int | None = None,
) -> DraftTree:
    """Draft a tree below `root_token`.

    projection: draft features -> log-probabilities over the draft vocabulary.
    cache: the serial head's cache over the accepted context (L positions; the last one
    read the root token). last_output: the serial head's output there (H,), which predicts
    depth 1; last_input: its fc input there (H,), the u_1 the MLP heads may need.
    The cache is restored to L positions before returning. next_position: the position the
    cache reads next, where depth 2 reads depth 1's tokens (default L; more where the cache
    has a gap, drafter.py).
    """
    cfg = heads.config
    depth_limit = min(settings.depth, cfg.max_depth, max_depth or cfg.max_depth)
    serial_depth = min(cfg.serial_depth, depth_limit)
    context_len = len(cache)
    pool = _Candidates(root_token)
    try:
        # Depth 1, from the output at the root.
        logp = projection.log_probs(last_output[None])[0]
        top = torch.topk(logp, settings.top_k)
        beam_tokens = projection.tokens(top.indices)
        beams = _Beams(pool.add(beam_tokens.tolist(), [0] * settings.top_k, top.values.tolist(), 1, SERIAL),
                       beam_tokens, top.values, last_output[None].expand(settings.top_k, -1),
                       last_input[None].expand(settings.top_k, -1))
        beams = _serial_depths(heads, embed, projection, cache, pool, beams, settings, serial_depth,
                               context_len if next_position is None else next_position)
        if depth_limit > serial_depth:
            _mlp_depths(heads, embed, projection, pool, beams, settings, serial_depth, depth_limit - serial_depth)
    finally:
        cache.crop(context_len)
    return _select(pool.tokens, pool.parents, pool.depths, pool.sources, pool.scores, settings, last_output.device)


def _serial_depths(heads, embed, projection, cache: DraftCache, pool: _Candidates, beams: _Beams,
                   settings: TreeSettings, serial_depth: int, next_position: int) -> _Beams:
    """Depths 2..serial_depth: each beam's top_k children, the best top_k of them kept.
    next_position: the position depth 2 reads at."""
    device, context_len = beams.scores.device, len(cache)
    # Tree-phase cache entries each beam may attend to (its ancestors' entries).
    ancestry = torch.zeros(settings.top_k, 0, dtype=torch.bool, device=device)
    for depth in range(2, serial_depth + 1):
        u = heads.fc_input(embed(beams.tokens), beams.producer)  # (k, H)
        position = next_position + depth - 2
        own = torch.eye(len(beams.nodes), dtype=torch.bool, device=device)
        mask = torch.cat(
            [torch.ones(len(beams.nodes), context_len, dtype=torch.bool, device=device), ancestry, own], dim=1
        )
        positions = torch.full((len(beams.nodes),), position, device=device)
        out = heads.serial(u[None], positions, cache, mask[None, None])[0]  # (k, H)
        logp = projection.log_probs(out)
        top = torch.topk(logp, settings.top_k, dim=-1)
        cumulative = (beams.scores[:, None] + top.values).view(-1)
        best = torch.topk(cumulative, settings.top_k)
        from_beam = best.indices // settings.top_k
        new_tokens = projection.tokens(top.indices.view(-1)[best.indices])
        new_parents = [beams.nodes[i] for i in from_beam.tolist()]
        nodes = pool.add(new_tokens.tolist(), new_parents, best.values.tolist(), depth, SERIAL)
        ancestry = torch.cat([ancestry, own], dim=1)[from_beam]
        beams = _Beams(nodes, new_tokens, best.values, out[from_beam], u[from_beam])
    return beams


def _mlp_depths(heads, embed, projection, pool: _Candidates, beams: _Beams, settings: TreeSettings,
                serial_depth: int, mlp_depths: int) -> None:
    """The later depths at once from the MLP heads; each keeps the best `pruning` candidates."""
    u_next = heads.fc_input(embed(beams.tokens), beams.producer)  # u_{s+1} per beam
    predicted = heads.parallel(torch.cat([beams.parent_input, u_next], dim=-1), mlp_depths)
    logp = projection.log_probs(predicted)  # (D, k, V)
    top = torch.topk(logp, settings.mlp_topk, dim=-1)
    frontier_nodes = beams.nodes
    frontier_beam = torch.arange(len(beams.nodes), device=beams.scores.device)
    frontier_scores = beams.scores
    for j in range(mlp_depths):
        cand_scores = frontier_scores[:, None] + top.values[j, frontier_beam]  # (F, mlp_topk)
        cand_tokens = projection.tokens(top.indices[j, frontier_beam])
        keep = torch.topk(cand_scores.view(-1), min(settings.pruning, cand_scores.numel()))
        from_frontier = keep.indices // settings.mlp_topk
        new_parents = [frontier_nodes[i] for i in from_frontier.tolist()]
        frontier_nodes = pool.add(cand_tokens.view(-1)[keep.indices].tolist(), new_parents, keep.values.tolist(),
                                  serial_depth + 1 + j, MLP)
        frontier_beam = frontier_beam[from_frontier]
        frontier_scores = keep.values


def _select(tokens, parents, depths, sources, scores, settings: TreeSettings, device) -> DraftTree:
    n_fta = settings.fta_tokens if settings.fta else 0
    budget = settings.total_tokens - 1
    ranked = sorted(range(1, len(tokens)), key=lambda i: (-scores[i], i))
    kept = sorted([0, *ranked[: budget - n_fta]])
    kept_set = set(kept)
    assert all(parents[i] in kept_set for i in kept[1:]), "draft tree selection lost a parent"

    remap = {old: new for new, old in enumerate(kept)}
    out = {
        "tokens": [tokens[i] for i in kept],
        "parents": [-1] + [remap[parents[i]] for i in kept[1:]],
        "depths": [depths[i] for i in kept],
        "sources": [sources[i] for i in kept],
        "scores": [scores[i] for i in kept],
    }
    if n_fta:
        _add_fta(out, n_fta)
    # FTA budget it could not use goes back to the next-best ordinary nodes.
    for i in ranked[budget - n_fta :][: budget + 1 - len(out["tokens"])]:
        remap[i] = len(out["tokens"])
        for key, value in zip(out, (tokens[i], remap[parents[i]], depths[i], sources[i], scores[i])):
            out[key].append(value)

    tree = DraftTree(
        torch.tensor(out["tokens"], device=device), out["parents"], out["depths"], out["sources"], out["scores"]
    )
    # Children best-first, so verification tries the likeliest candidate first.
    for kids in tree.children:
        kids.sort(key=lambda c: -out["scores"][c])
    return tree


def _add_fta(tree: dict, n_fta: int) -> None:
    """Full Tree Attention, as real nodes: extend short leaves with tokens from longer paths."""
    tokens, depths, scores = tree["tokens"], tree["depths"], tree["scores"]
    max_depth = max(depths)
    has_child = {p for p in tree["parents"] if p >= 0}
    # At each depth, the token the kept paths agree on most (best score breaks ties).
    agreed: dict[int, int] = {}
    for depth in range(2, max_depth + 1):
        at_depth = [(t, s) for t, d, s in zip(tokens, depths, scores) if d == depth]
        counts = Counter(t for t, _ in at_depth)
        best = {t: max(s for tt, s in at_depth if tt == t) for t in counts}
        agreed[depth] = max(counts, key=lambda t: (counts[t], best[t]))
    short_leaves = [i for i in range(1, len(tokens)) if i not in has_child and depths[i] < max_depth]
    short_leaves.sort(key=lambda i: -scores[i])
    for leaf in short_leaves[:n_fta]:
        for key, value in zip(
            tree, (agreed[depths[leaf] + 1], leaf, depths[leaf] + 1, FTA, scores[leaf] - 1e-3)
        ):
            tree[key].append(value)
