"""Verifying a draft tree with one target pass, choosing what to keep, trimming the KV cache.

The whole tree goes through the standard Hugging Face forward: a 4D attention mask lets
each node see the cached context and its own ancestors only, position ids are context
length + depth. `TargetPasses` runs those passes (and the prefill) at the row counts the
CPU weight packs are prepared for (see its docstring). Acceptance then walks down from the
root: the target chooses its own token at each node exactly as plain decoding would at that
position (the argmax, or one draw from its warped distribution), and the path goes on into
the child drafted with that token, as far as it goes; the first choice no child holds is the
bonus token. Every emitted token is thus the target's own choice given the tokens before it:
the same tokens as plain decoding under greedy, the same distribution under sampling, and,
since each emitted token takes exactly one draw from the seeded generator as in plain
decoding, the same tokens for the same seed wherever the pass gives a node the logits plain
decoding's one-row pass gives it (the CPU kernels: docs/fast_decoder.md). The chance to go
on is the sum of the children's probabilities, as with recursive rejection sampling of
point-mass drafts (SpecInfer, EAGLE), which this rule replaces at no cost in acceptance.
Then only the KV entries of the root and the accepted path are kept (`keep_path_in_cache`;
`crop_cache` is the one helper that cuts a cache back to a prefix).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .cpu_matmul import pack_for_rows
from .draft_tree import DraftTree
from .errors import GumihoError
from .sampling import TokenChooser, first_argmax


@dataclass
class Acceptance:
    path: list[int]  # tree nodes kept: root first, then the accepted drafts
    bonus: int  # the target's own token after the path
    rejected: list[int]  # candidate tokens refused at the node where the path stopped
    accepted: list[int]  # the accepted drafts' tokens (path[1:]'s)


def tree_attention_mask(tree: DraftTree, past_len: int, dtype: torch.dtype, device, padding: int = 0) -> torch.Tensor:
    """(1, 1, N + padding, past_len + N + padding) additive mask: 0 where attention is allowed,
    -inf-ish elsewhere. Padding rows (TargetPasses) see only themselves, and no node sees them."""
    n = len(tree)
    allowed = torch.zeros(n + padding, past_len + n + padding, dtype=torch.bool)
    allowed[:n, :past_len] = True
    allowed[:, past_len:] = padded_ancestors(tree, padding)
    allowed = allowed.to(device)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


@torch.no_grad()
def run_target(target, cache, input_ids: torch.Tensor, position_ids: torch.Tensor, mask=None, logits_for=None):
    """One target forward pass. Returns (last-layer features (T, H), logits (T', V)).

    logits_for: indices of the rows that need logits (None = all). The lm_head over a
    large vocabulary is a big part of a small model's cost, so prefill asks for one row.
    """
    if not target.transformers_layers:
        raise GumihoError("this engine was loaded for the fast decoder alone (transformers' layers released)")
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


class TargetPasses:
    """The target's forward passes for an engine: prefills, and tree verifications padded up to
    a row count its CPU weight packs are prepared for.

    MKL's packed sgemm is fast for exactly the row count the weights were packed for
    (cpu_matmul.py); a product of any other count falls back to the slower x @ W_t path.
    Tree sizes vary: the heads fill `total_tokens` rows and the context-lookup branch adds up
    to `lookup_tokens` more (SmolLM2-135M, mt_bench: 38 % of passes had 7-14 rows while the
    only pack was for the 6 of the budget). So the weights are packed for the sizes the
    drafter names (`Drafter.tree_sizes`: the budget, and the budget plus a chain) and a tree
    is padded up to the next of them. Padding rows see only themselves and no node sees
    them, so no real row's numbers change; their logits and features are dropped here and
    their cache entries with the rest of the tree (keep_path_in_cache): they are never
    candidates. A tree beyond the largest size (a long looked-up chain while the answer
    repeats itself) runs as it is.
    """

    def __init__(self, target):
        self.target = target
        self.sizes: tuple[int, ...] = ()  # tree passes are padded up to the next of these

    def prepare(self, sizes: tuple[int, ...]) -> None:
        """Get ready for trees of these row counts. Plain decoding (one row) leaves the packs in
        place for the next speculative call; no pack possible (a GPU, no MKL): no padding."""
        sizes = tuple(n for n in sizes if n > 1)
        if not sizes:
            self.sizes = ()
        else:
            # The layers the passes run: the fast decoder's (float32 only: quantized kernels
            # need no packs) or the transformers model's.
            layers = self.target.fast if self.target.fast is not None else self.target.model
            self.sizes = sizes if pack_for_rows(layers, sizes) else ()

    def new_cache(self):
        """An empty KV cache for this target: the fast decoder's static one, or transformers'."""
        fast = self.target.fast
        return fast.new_cache() if fast is not None else TransformersCache(self.target.config)

    def prefill(self, cache, context: torch.Tensor, start: int):
        """Read context[start:] into the cache. Returns (its features, the last token's logits)."""
        positions = torch.arange(start, len(context), device=context.device)
        return self._run(cache, context[start:], positions, logits_for=[-1])

    def verify(self, cache, tree: DraftTree, past_len: int):
        """One pass over `tree` below `past_len` cached tokens: (features, logits) of its nodes."""
        device, n = self.target.device, len(tree)
        padding = next((size - n for size in self.sizes if size >= n), 0) if n > 1 else 0
        # Few ops: each runs cold right after a pass (docs/fast_decoder.md, "The glue around a pass").
        tokens = tree.tokens.to(device)
        positions = torch.tensor([past_len + depth for depth in tree.depths] + [past_len] * padding, device=device)
        if padding:
            tokens = torch.cat([tokens, tokens[:1].expand(padding)])
        features, logits = self._run(cache, tokens, positions, tree=tree, padding=padding)
        return (features[:n], logits[:n]) if padding else (features, logits)

    def _run(self, cache, tokens, positions, tree=None, padding=0, logits_for=None):
        fast = self.target.fast
        if fast is None:
            mask = None
            if tree is not None and len(tree) > 1:
                mask = tree_attention_mask(tree, cache.length, self.target.base.dtype, self.target.device,
                                           padding)
            return run_target(self.target, cache.inner, tokens, positions, mask, logits_for)
        with torch.no_grad():
            ancestors = None if tree is None or len(tree) == 1 else padded_ancestors(tree, padding)
            features = fast(tokens, positions, cache, ancestors)
            rows = features if logits_for is None else features[logits_for]
            return features.float(), fast.logits(rows)


def padded_ancestors(tree: DraftTree, padding: int) -> torch.Tensor:
    """(N + padding)^2 bool: each node sees its ancestors and itself; a padding row only itself."""
    n = len(tree)
    allowed = torch.eye(n + padding, dtype=torch.bool)
    allowed[:n, :n] = tree.ancestor_mask()
    return allowed


class TransformersCache:
    """transformers' DynamicCache behind the interface of fast_decoder.StaticKVCache."""

    def __init__(self, config):
        from transformers import DynamicCache

        self.inner = DynamicCache(config=config)

    @property
    def length(self) -> int:
        return self.inner.get_seq_length()

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, length: int) -> None:
        crop_cache(self.inner, length)

    def keep_path(self, past_len: int, path: list[int]) -> None:
        keep_path_in_cache(self.inner, past_len, path)


def accept(
    tree: DraftTree, logits: torch.Tensor, chooser: TokenChooser, context: torch.Tensor
) -> Acceptance:
    """Walk the tree from the root, following the target's own choice at each node."""
    tokens = tree.tokens.tolist()
    node, path = 0, [0]
    argmax = None
    if chooser.settings.greedy and chooser.settings.repetition_penalty == 1.0:
        argmax = first_argmax(logits)  # one vectorised argmax for every node
    while True:
        if argmax is not None:
            choice = argmax[node]
        else:  # the repetition penalty reads the node's own context: the tokens so far and its ancestors
            node_context = context
            if chooser.settings.repetition_penalty != 1.0:  # (three ops a node, cold after a pass: only if read)
                node_context = torch.cat([context, tree.tokens[path[1:]].to(context.device)])
            choice = chooser.choose(logits[node], node_context)
        kids = tree.children[node]
        nxt = next((c for c in kids if tokens[c] == choice), None)
        if nxt is None:
            refused = dict.fromkeys(tokens[c] for c in kids)  # in draft order, each token once
            return Acceptance(path, choice, list(refused), [tokens[c] for c in path[1:]])
        node = nxt
        path.append(node)


def crop_cache(cache, length: int) -> None:
    """Keep the first `length` positions of a transformers cache (every layer's keys/values).

    Works on the layers' key/value tensors directly: (batch, kv_heads, seq, head_dim).
    """
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:, :, :length], layer.values[:, :, :length]


def keep_path_in_cache(cache, past_len: int, path: list[int]) -> None:
    """Keep the context and the accepted path's entries; drop the rest of the tree (and any
    padding rows after it)."""
    if path == list(range(len(path))):  # the path lies first in the tree's layout
        crop_cache(cache, past_len + len(path))
        return
    index = torch.tensor([past_len + i for i in path])
    for layer in cache.layers:
        idx = index.to(layer.keys.device)
        layer.keys = torch.cat([layer.keys[:, :, :past_len], layer.keys.index_select(2, idx)], dim=2)
        layer.values = torch.cat([layer.values[:, :, :past_len], layer.values.index_select(2, idx)], dim=2)
