"""Verifying a draft tree with one target pass, choosing what to keep, trimming the KV cache.

The whole tree goes through the standard Hugging Face forward: a 4D attention mask lets
each node see the cached context and its own ancestors only, position ids are context
length + depth. Acceptance then walks down from the root:
- greedy: follow the child whose token is the target's argmax, as far as it goes;
- sampling: multi-candidate speculative sampling. At each node the candidates (children,
  best first) are tried in turn: candidate x is accepted with probability p(x); if not,
  p(x) is set to 0 and p renormalised before the next one; if all are refused, the
  target's token is sampled from what is left. The candidates do not depend on the
  random draws at this node, so the token that comes out has exactly the distribution p
  (the SpecInfer/EAGLE recursive-rejection argument with a point-mass draft).
Then only the KV entries of the root and the accepted path are kept.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .draft_tree import DraftTree
from .sampling import TokenChooser


@dataclass
class Acceptance:
    path: list[int]  # tree nodes kept: root first, then the accepted drafts
    bonus: int  # the target's own token after the path
    rejected: list[int]  # candidate tokens refused at the node where the path stopped


def tree_attention_mask(tree: DraftTree, past_len: int, dtype: torch.dtype, device) -> torch.Tensor:
    """(1, 1, N, past_len + N) additive mask: 0 where attention is allowed, -inf-ish elsewhere."""
    allowed = torch.cat(
        [torch.ones(len(tree), past_len, dtype=torch.bool), tree.ancestor_mask()], dim=1
    ).to(device)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


@torch.no_grad()
def run_target(target, cache, input_ids: torch.Tensor, position_ids: torch.Tensor, mask=None, logits_for=None):
    """One target forward pass. Returns (last-layer features (T, H), logits (T', V)).

    logits_for: indices of the rows that need logits (None = all). The lm_head over a
    large vocabulary is a big part of a small model's cost, so prefill asks for one row.
    """
    out = target.base(
        input_ids=input_ids[None],
        position_ids=position_ids[None],
        attention_mask=mask,
        cache=cache,
        use_cache=True,
    )
    features = out.last_hidden_state[0]
    rows = features if logits_for is None else features[logits_for]
    logits = target.lm_head(rows).float()
    return features, logits


def accept(
    tree: DraftTree, logits: torch.Tensor, chooser: TokenChooser, context: torch.Tensor
) -> Acceptance:
    """Walk the tree from the root with the target's decision rule."""
    tokens = tree.tokens.tolist()
    node, path = 0, [0]
    greedy = chooser.settings.greedy
    plain_argmax = greedy and chooser.settings.repetition_penalty == 1.0
    if plain_argmax:  # one vectorised argmax for every node
        choice = logits.argmax(-1).tolist()
    while True:
        node_context = torch.cat([context, tree.tokens[path[1:]].to(context.device)])
        kids = tree.children[node]
        if greedy:
            y = choice[node] if plain_argmax else chooser.greedy_token(logits[node], node_context)
            nxt = next((c for c in kids if tokens[c] == y), None)
            if nxt is None:
                return Acceptance(path, y, [tokens[c] for c in kids])
        else:
            probs = chooser.probs(logits[node], node_context)
            nxt, tried = None, []
            for c in kids:
                x = tokens[c]
                if x in tried:  # already refused here: its probability is now 0
                    continue
                if chooser.uniform() < float(probs[x]):
                    nxt = c
                    break
                tried.append(x)
                probs[x] = 0.0
                probs = probs / probs.sum()
            if nxt is None:
                return Acceptance(path, chooser.sample(probs), tried)
        node = nxt
        path.append(node)


def keep_path_in_cache(cache, past_len: int, path: list[int]) -> None:
    """Keep the context and the accepted path's entries; drop the rest of the tree.

    Works on the layers' key/value tensors directly: (batch, kv_heads, seq, head_dim).
    """
    prefix = path == list(range(len(path)))  # the path lies first in the tree's layout
    index = None if prefix else torch.tensor([past_len + i for i in path])
    for layer in cache.layers:
        if prefix:
            layer.keys = layer.keys[:, :, : past_len + len(path)]
            layer.values = layer.values[:, :, : past_len + len(path)]
        else:
            idx = index.to(layer.keys.device)
            layer.keys = torch.cat([layer.keys[:, :, :past_len], layer.keys.index_select(2, idx)], dim=2)
            layer.values = torch.cat([layer.values[:, :, :past_len], layer.values.index_select(2, idx)], dim=2)
