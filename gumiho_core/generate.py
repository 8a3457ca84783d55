"""One generation loop, two modes: Gumiho speculative decoding, or plain decoding.

Plain decoding is the same loop with a tree that holds only the root, so the baseline and
the speculative path share every line of caching, sampling and stopping code.

Per step (speculative):
  1. the serial head reads the newly accepted tokens (with the target features that go
     with them), and the draft tree is built below the root (the target's last token);
  2. the target verifies the whole tree in one pass;
  3. the accepted path and the target's bonus token are emitted; the target cache keeps
     only the path's entries.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .context_lookup import LookupLength, continuation
from .cpu_matmul import fast_cpu_copy, pack_for_rows
from .draft_tree import DraftTree, build_draft_tree
from .errors import ContextTooLong, GumihoError
from .events import DoneEvent, GenerationStats, StepEvent, TokenPiece
from .heads import DraftHead, GumihoHeads
from .sampling import TokenChooser
from .settings import GenerationSettings
from .verify import accept, keep_path_in_cache, run_target, tree_attention_mask


class Detokenizer:
    """Incremental decoding: each token's share of the text, whole characters only."""

    def __init__(self, tokenizer, prompt_tail: list[int]):
        self.tokenizer = tokenizer
        # A little prompt context so the first token's leading space is decoded right.
        self.ids = list(prompt_tail)
        self.prefix = 0
        self.read = len(self.ids)
        self.text = ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.ids[self.prefix :], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            piece = after[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)
            self.text += piece
            return piece
        return ""


@dataclass
class PrefixState:
    """What the last generation leaves for the next: the KV caches of a token sequence.

    A follow-up message re-renders the whole chat; its longest common prefix with `ids`
    is reused instead of re-read, so time to first token does not grow with the chat.
    An edit or a regenerate simply shares a shorter prefix.
    """

    ids: list[int]  # the tokens whose keys/values the target cache holds
    cache: object  # transformers DynamicCache
    features: torch.Tensor  # (len(ids), H) target features of those tokens
    draft_cache: object | None  # the serial head's cache (None after plain decoding)
    heads: object | None  # the heads that filled draft_cache


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Engine:
    """A target model with (optionally) Gumiho heads, producing event streams."""

    def __init__(self, target, heads: GumihoHeads | None = None):
        self.target = target
        self.heads = None if heads is None else fast_cpu_copy(heads)  # see cpu_matmul.py
        self.lock = threading.Lock()  # one generation at a time: caches are per call, compute is not
        self.last_run: _Run | None = None
        self.trace_trees = False  # keep every (tree, accepted path): the tree-budget calibration reads them
        self.reuse_prefix = True
        self.prefix: PrefixState | None = None
        self.draft_head = None if heads is None else DraftHead(target.lm_head, heads.draft_vocab)

    def generate(
        self,
        prompt_ids: list[int],
        settings: GenerationSettings | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[StepEvent | DoneEvent]:
        settings = settings or GenerationSettings()
        settings.validate()
        if settings.speculative and self.heads is None:
            raise GumihoError("speculative decoding needs draft heads, and none are loaded")
        prompt_ids = self._fit_context(list(prompt_ids), settings)
        with self.lock, torch.inference_mode():
            if settings.speculative:  # the row counts most products will have (cpu_matmul.py):
                pack_for_rows(self.target.model, settings.tree.total_tokens)  # tree passes
                pack_for_rows(self.heads, settings.tree.top_k)  # drafting below depth 1: one row per beam
                if self.draft_head.project is not self.target.lm_head:  # a draft vocabulary of its own
                    pack_for_rows(self.draft_head.project, settings.tree.top_k)
            reuse, self.prefix = (self.prefix if self.reuse_prefix else None), None
            run = _Run(self, prompt_ids, settings, cancel, reuse)
            self.last_run = run  # kept for inspection: its target cache, its counters
            try:
                yield from run.events()
            finally:
                # Only a run stopped between steps leaves caches that match its tokens;
                # one that failed inside a forward pass leaves nothing to reuse.
                if run.consistent:
                    self.prefix = run.prefix_state()

    def _fit_context(self, prompt_ids: list[int], settings: GenerationSettings) -> list[int]:
        if not prompt_ids:
            raise GumihoError("the prompt is empty")
        limit = self.target.max_context
        need = len(prompt_ids) + settings.max_new_tokens
        if need <= limit:
            return prompt_ids
        if settings.on_overflow == "truncate" and settings.max_new_tokens < limit:
            return prompt_ids[need - limit :]
        raise ContextTooLong(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({settings.max_new_tokens}) "
            f"exceeds the model's context of {limit} tokens"
        )


class _Run:
    """The state of one generation call."""

    def __init__(self, engine: Engine, prompt_ids: list[int], settings: GenerationSettings, cancel, reuse=None):
        from transformers import DynamicCache

        self.target, self.heads, self.settings, self.cancel = engine.target, engine.heads, settings, cancel
        self.draft_head = engine.draft_head
        self.trace: list[tuple[DraftTree, list[int]]] | None = [] if engine.trace_trees else None
        self.device = self.target.device
        self.cache = DynamicCache(config=self.target.config)
        self.chooser = TokenChooser(settings.sampling, device=self.device)
        self.prompt = prompt_ids
        # Every token so far: the prompt, the answer, and last the root (the target's newest
        # token, not yet in its cache). It is the repetition-penalty context of the root.
        self.context = torch.tensor(prompt_ids, device=self.device)
        self.new_ids: list[int] = []
        self.detok = Detokenizer(self.target.tokenizer, prompt_ids[-4:])
        self.eos = self.target.eos_token_ids
        self.stats = GenerationStats(
            speculative=settings.speculative, prompt_tokens=len(prompt_ids), tree=settings.tree.__dict__.copy()
        )
        self.finish_reason: str | None = None
        self.draft_cache = self.heads.new_cache() if settings.speculative else None
        self.features = torch.zeros(0, self.target.hidden_size, device=self.device)  # one row per cached token
        self.consistent = False
        self.lookup_length = LookupLength(settings.tree.lookup_tokens)
        self.chain: list[int] = []  # the looked-up tokens offered in this step's tree
        self.reused = 0
        if reuse is not None:
            self._reuse(reuse)

    def _reuse(self, prefix: PrefixState) -> None:
        # Keep at least one prompt token to prefill: its logits give the first new token.
        n = min(common_prefix_length(prefix.ids, self.prompt), len(self.prompt) - 1)
        if n <= 0:
            return
        self.cache = prefix.cache
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[:, :, :n], layer.values[:, :, :n]
        self.features = prefix.features[:n]
        if self.draft_cache is not None and prefix.draft_cache is not None and prefix.heads is self.heads:
            # Draft position i read (token i+1, feature i): valid while token i+1 is shared.
            self.draft_cache = prefix.draft_cache
            self.draft_cache.crop(min(len(self.draft_cache), n - 1))
        self.reused = n
        self.stats.reused_prompt_tokens = n

    def prefix_state(self) -> PrefixState:
        n = self.cache.get_seq_length()
        return PrefixState(self.context[:n].tolist(), self.cache, self.features, self.draft_cache, self.heads)

    # -- the loop ---------------------------------------------------------------------
    def events(self) -> Iterator[StepEvent | DoneEvent]:
        start = time.perf_counter()
        root = self._prefill()
        self.stats.ttft_s = time.perf_counter() - start
        self.consistent = True
        yield self._emit([], root, [], tree_size=0, draft_ms=0.0, verify_ms=self.stats.ttft_s * 1e3)
        while self.finish_reason is None:
            if self.cancel is not None and self.cancel.is_set():
                self.finish_reason = "cancelled"
                break
            past_len = self.cache.get_seq_length()
            t0 = time.perf_counter()
            self.consistent = False
            tree = self._draft(root, past_len) if self.settings.speculative else DraftTree.root_only(root)
            t1 = time.perf_counter()
            tree_tokens = tree.tokens.to(self.device)
            positions = past_len + torch.tensor(tree.depths, device=self.device)
            mask = None
            if len(tree) > 1:
                mask = tree_attention_mask(tree, past_len, self.target.base.dtype, self.device)
            features, logits = run_target(self.target, self.cache, tree_tokens, positions, mask)
            result = accept(tree, logits, self.chooser, self.context)
            keep_path_in_cache(self.cache, past_len, result.path)
            t2 = time.perf_counter()
            self.stats.forward_passes += 1
            self.stats.draft_s += t1 - t0
            self.stats.verify_s += t2 - t1
            self._count_acceptance(tree, result.path)
            if self.trace is not None:
                self.trace.append((tree, result.path))
            self.features = torch.cat([self.features, features[result.path]])
            drafted = result.path[1:]
            if self.chain:
                self.lookup_length.update(common_prefix_length(tree_tokens[drafted].tolist(), self.chain), len(self.chain))
            root = result.bonus
            self.context = torch.cat([self.context, tree_tokens[drafted], self._tensor([root])])
            self.consistent = True
            yield self._emit(
                [(int(tree_tokens[n]), tree.sources[n], tree.depths[n]) for n in drafted],
                root,
                result.rejected,
                tree_size=len(tree),
                draft_ms=(t1 - t0) * 1e3,
                verify_ms=(t2 - t1) * 1e3,
            )
        self.stats.total_s = time.perf_counter() - start
        yield DoneEvent(self.detok.text, list(self.new_ids), self.finish_reason, self.stats)

    def _prefill(self) -> int:
        ids = self.context
        positions = torch.arange(self.reused, len(ids), device=self.device)
        features, logits = run_target(self.target, self.cache, ids[self.reused :], positions, logits_for=[-1])
        self.features = torch.cat([self.features, features])
        self.stats.forward_passes += 1
        root = self.chooser.choose(logits[0], ids)
        self.context = torch.cat([ids, self._tensor([root])])
        return root

    def _tensor(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def _draft(self, root: int, past_len: int) -> DraftTree:
        """Look up a chain in the context, feed the serial head what it has not read yet,
        and draft below `root`."""
        room = self.target.max_context - past_len - 1
        self.chain = []
        if self.lookup_length.tokens:
            self.chain = continuation(self.context, min(self.lookup_length.tokens, max(1, room)))
            if self.chain and self.lookup_length.repeating:
                # The answer is repeating the context and the last chain was accepted whole:
                # the heads are skipped (they would cost more than their branch gains). The
                # serial head reads the tokens it missed at its next turn.
                return DraftTree.root_only(root, self.device).add_chain(self.chain)
        heads, cache = self.heads, self.draft_cache
        start = len(cache)
        pending = self.features[start:]
        # Draft position i reads (token i+1, target feature i): the tokens shifted by one,
        # which ends with the root.
        shifted = self.context[start + 1 :]
        u = heads.fc_input(self.target.embed_tokens(shifted), pending.to(heads.dtype))
        positions = torch.arange(start, start + len(shifted), device=self.device)
        out = heads.serial(u[None], positions, cache)[0]
        tree = build_draft_tree(
            heads,
            self.target.embed_tokens,
            self.draft_head,
            cache,
            root,
            out[-1],
            u[-1],
            self.settings.tree,
            max_depth=max(1, room),
        )
        return tree.add_chain(self.chain)

    # -- bookkeeping ----------------------------------------------------------------------
    def _count_acceptance(self, tree: DraftTree, path: list[int]) -> None:
        if len(tree) == 1:
            return
        for depth, node in enumerate(path):
            if not tree.children[node]:
                break
            self._grow(depth + 1)
            self.stats.offered_at_depth[depth] += 1
            if depth + 1 < len(path):
                self.stats.accepted_at_depth[depth] += 1

    def _grow(self, n: int) -> None:
        for name in ("accepted_at_depth", "offered_at_depth"):
            counts = getattr(self.stats, name)
            counts.extend([0] * (n - len(counts)))

    def _emit(self, drafted, bonus, rejected, tree_size, draft_ms, verify_ms) -> StepEvent:
        pieces = []
        for token, origin, depth in [*drafted, (bonus, "target", 0)]:
            if self.finish_reason is not None:
                break
            pieces.append(TokenPiece(token, self.detok.push(token), origin, depth))
            self.new_ids.append(token)
            self._check_stop(token)
        self.stats.new_tokens = len(self.new_ids)
        if self.finish_reason is None and len(self.context) + 1 >= self.target.max_context:
            self.finish_reason = "context"
        decode = self.target.tokenizer.decode
        refused = [TokenPiece(t, decode([t]), "rejected", 0) for t in rejected]
        return StepEvent(pieces, refused, tree_size, draft_ms, verify_ms)

    def _check_stop(self, token: int) -> None:
        if token in self.eos:
            self.finish_reason = "eos"
        elif len(self.new_ids) >= self.settings.max_new_tokens:
            self.finish_reason = "length"
        elif self.settings.stop_strings:
            text = self.detok.text
            for stop in self.settings.stop_strings:
                at = text.find(stop)
                if at >= 0:
                    self.detok.text = text[:at]
                    self.finish_reason = "stop"
                    return


def run_to_end(engine: Engine, prompt_ids: list[int], settings: GenerationSettings | None = None) -> DoneEvent:
    """Consume a generation and return its final event (for scripts, tests, benchmarks)."""
    done = None
    for event in engine.generate(prompt_ids, settings):
        if isinstance(event, DoneEvent):
            done = event
    return done
