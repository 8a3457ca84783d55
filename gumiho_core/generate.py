"""One generation loop for every drafter: Gumiho speculative decoding, plain decoding, any other.

The loop keeps the target's side only: its KV cache, its features of the cached tokens,
the tokens so far, sampling and stopping. What proposes the tokens is a `Drafter`
(drafter.py): the Gumiho heads with the context-lookup branch, or plain decoding, whose
tree holds only the root, so the baseline and the speculative path share every line of
caching, sampling and stopping code. The loop does not know which drafter it runs.

Per step:
  1. the drafter proposes a tree below the root (the target's last token);
  2. the target verifies the whole tree in one pass (verify.TargetPasses);
  3. the accepted path and the target's bonus token are emitted, up to where the stop
     rule ends the generation; the target cache keeps only the path's entries, and the
     drafter is told what was accepted.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .draft_tree import DraftTree
from .drafter import Drafter, DraftStep, GumihoDrafter, PlainDrafter, common_prefix_length
from .errors import ContextTooLong, GumihoError
from .events import DoneEvent, GenerationStats, StepEvent, TokenPiece
from .heads import GumihoHeads
from .quantize import drafting_copy
from .sampling import TokenChooser
from .settings import GenerationSettings
from .verify import TargetPasses, accept


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


class StopRule:
    """When a generation is finished, and why: decided after each emitted token and each step."""

    def __init__(self, settings: GenerationSettings, eos_ids, max_context: int):
        self.settings, self.eos, self.max_context = settings, eos_ids, max_context

    def after_token(self, token: int, new_tokens: int, text: str) -> str | None:
        """The finish reason once `token` (the `new_tokens`-th) is out and the text reads `text`."""
        if token in self.eos:
            return "eos"
        if new_tokens >= self.settings.max_new_tokens:
            return "length"
        if self.stop_string_at(text) is not None:
            return "stop"
        return None

    def stop_string_at(self, text: str) -> int | None:
        """Where the answer's text ends at the first stop string found in it (list order)."""
        for stop in self.settings.stop_strings:
            at = text.find(stop)
            if at >= 0:
                return at
        return None

    def after_step(self, context_tokens: int) -> str | None:
        # The next step's root (the last context token, not yet read) needs a position of its
        # own: 0 .. max_context - 1. The token that step makes needs none.
        return "context" if context_tokens >= self.max_context else None


@dataclass
class PrefixState:
    """What the last generation leaves for the next: the target's KV cache of a token sequence.

    A follow-up message re-renders the whole chat; its longest common prefix with `ids`
    is reused instead of re-read, so time to first token does not grow with the chat.
    An edit or a regenerate simply shares a shorter prefix. (A drafter keeps its own state
    for the prefix it shares: drafter.Drafter.begin.)
    """

    ids: list[int]  # the tokens whose keys/values the target cache holds
    cache: object  # TargetPasses.new_cache(): a StaticKVCache or a TransformersCache
    features: "GrowingRows"  # the target's features of those tokens, one row each

    def shared_with(self, prompt_ids: list[int]) -> int:
        """How many of `prompt_ids` can come from here. At least one prompt token is left to
        prefill: its logits give the first new token."""
        return min(common_prefix_length(self.ids, prompt_ids), len(prompt_ids) - 1)


class Engine:
    """A target model with (optionally) Gumiho heads, producing event streams."""

    def __init__(self, target, heads: GumihoHeads | None = None):
        self.target = target
        self.heads = None if heads is None else drafting_copy(heads, target)  # quantize.py
        self.lock = threading.Lock()  # one generation at a time: caches are per call, compute is not
        self.prefix: PrefixState | None = None
        self.drafter: Drafter = PlainDrafter() if heads is None else GumihoDrafter(target, self.heads)
        self.passes = TargetPasses(target)

    @property
    def seed_repeats_drafted_sampling(self) -> bool:
        """Whether a seed repeats sampled answers with drafting on. Every emitted token is one
        seeded draw (verify.accept), so the answer is plain decoding's for that seed wherever a
        tree pass gives each row the bits a one-row pass gives it: the fast decoder's
        row-invariant CPU path (docs/fast_decoder.md), not PyTorch's attention or a GPU's."""
        fast = self.target.fast
        return fast is not None and fast.row_invariant and self.target.device.type == "cpu"

    def generate(
        self,
        prompt_ids: list[int],
        settings: GenerationSettings | None = None,
        cancel: threading.Event | None = None,
        *,
        drafter: Drafter | None = None,
        reuse_prefix: bool = True,
    ) -> Iterator[StepEvent | DoneEvent]:
        """Stream one answer. drafter: a draft source in place of the engine's own (heads when
        settings.speculative, else plain). reuse_prefix=False reads the whole prompt afresh
        (a benchmark's runs must each pay their own prefill)."""
        settings = settings or GenerationSettings()  # checked when it was built (settings.py)
        if drafter is None and settings.speculative and self.heads is None:
            raise GumihoError("speculative decoding needs draft heads, and none are loaded")
        if drafter is None:
            drafter = self.drafter if settings.speculative else PlainDrafter()
        prompt_ids = self._fit_context(list(prompt_ids), settings)
        with self.lock:
            yield from _each_step_in_inference_mode(self._generate(prompt_ids, settings, drafter, reuse_prefix, cancel))

    def _generate(self, prompt_ids, settings, drafter, reuse_prefix, cancel) -> Iterator[StepEvent | DoneEvent]:
        """generate's body, once the engine is this call's."""
        reuse, self.prefix = (self.prefix if reuse_prefix else None), None
        shared = 0 if reuse is None else reuse.shared_with(prompt_ids)
        drafter.begin(prompt_ids, shared, settings)
        self.passes.prepare(drafter.tree_sizes(settings.tree))
        run = _Generation(self.target, self.passes, drafter, prompt_ids, settings, cancel)
        if shared > 0:
            run.reuse(reuse, shared)
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


class GrowingRows:
    """Rows appended a step at a time (the target's features of the cached tokens) in a buffer
    that doubles when full: a step writes its own rows instead of copying every row before
    them, as torch.cat did: 0.06 ms a step at 300 tokens of context, 1.7 ms at 1000 (a fresh
    allocation of that size each step), against 0.014 ms for an append."""

    def __init__(self, width: int, device):
        self.buffer = torch.zeros(256, width, device=device)
        self.length = 0

    @property
    def rows(self) -> torch.Tensor:
        return self.buffer[: self.length]

    def append(self, rows: torch.Tensor) -> None:
        end = self.length + len(rows)
        if end > len(self.buffer):
            bigger = self.buffer.new_zeros(max(end, 2 * len(self.buffer)), self.buffer.shape[1])
            bigger[: self.length] = self.rows
            self.buffer = bigger
        self.buffer[self.length : end] = rows
        self.length = end

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)


def _each_step_in_inference_mode(steps: Iterator) -> Iterator:
    """`steps`, each advanced under torch.inference_mode. Inference mode is per thread, and a web
    server resumes a streaming generator from whichever worker thread is free (Gradio does):
    entered once around the loop it was off for every step resumed elsewhere, so those steps
    paid autograd's bookkeeping, and an in-place write to a tensor made under it failed."""
    try:
        while True:
            with torch.inference_mode():
                event = next(steps, None)
            if event is None:
                return
            yield event
    finally:
        with torch.inference_mode():
            steps.close()  # a generation closed early still leaves its caches for the next


class _Generation:
    """The target side of one generation call: its cache, features, tokens, counters."""

    def __init__(self, target, passes: TargetPasses, drafter: Drafter, prompt_ids: list[int],
                 settings: GenerationSettings, cancel):
        self.target, self.passes, self.drafter = target, passes, drafter
        self.settings, self.cancel = settings, cancel
        self.device = target.device
        self.cache = passes.new_cache()
        self.features = GrowingRows(target.hidden_size, self.device)  # one row per cached token
        self.chooser = TokenChooser(settings.sampling, device=self.device)
        # Every token so far: the prompt, the answer, and last the root (the target's newest
        # token, not yet in its cache). It is the repetition-penalty context of the root.
        self.context = torch.tensor(prompt_ids, device=self.device)
        self.new_ids: list[int] = []
        self.detok = Detokenizer(target.tokenizer, prompt_ids[-4:])
        self.stop = StopRule(settings, target.eos_token_ids, target.max_context)
        self.stats = GenerationStats(
            speculative=settings.speculative, prompt_tokens=len(prompt_ids), tree=settings.tree.__dict__.copy()
        )
        self.finish_reason: str | None = None
        self.consistent = False  # the caches match the tokens (true between steps)

    def reuse(self, prefix: PrefixState, n: int) -> None:
        """Start from the first `n` tokens' cache and features of the last generation."""
        self.cache = prefix.cache
        self.cache.crop(n)
        self.features = prefix.features
        self.features.crop(n)
        self.stats.reused_prompt_tokens = n

    def prefix_state(self) -> PrefixState:
        n = self.cache.get_seq_length()
        return PrefixState(self.context[:n].tolist(), self.cache, self.features)

    # -- the loop ---------------------------------------------------------------------
    def events(self) -> Iterator[StepEvent | DoneEvent]:
        start = time.perf_counter()
        root = self._prefill()
        self.stats.ttft_s = time.perf_counter() - start
        self.consistent = True
        yield self._step_event([(root, "target", 0)], [], tree_size=0, draft_ms=0.0,
                               verify_ms=self.stats.ttft_s * 1e3)
        while self.finish_reason is None:
            if self.cancel is not None and self.cancel.is_set():
                self.finish_reason = "cancelled"
                break
            yield self._step()
        self.stats.total_s = time.perf_counter() - start
        yield DoneEvent(self.detok.text, list(self.new_ids), self.finish_reason, self.stats)

    def _prefill(self) -> int:
        done = self.cache.get_seq_length()  # the reused prefix
        features, logits = self.passes.prefill(self.cache, self.context, done)
        self.features.append(features)
        self.stats.forward_passes += 1
        root = self.chooser.choose(logits[0], self.context)
        self.context = torch.cat([self.context, self._tensor([root])])
        return root

    def _step(self) -> StepEvent:
        """Draft, verify in one target pass, keep the accepted path."""
        past_len = self.cache.get_seq_length()
        t0 = time.perf_counter()
        self.consistent = False
        room = self.target.max_context - past_len - 1  # the root sits at past_len
        tree = self.drafter.draft(DraftStep(self.context, self.features.rows, room))
        t1 = time.perf_counter()
        features, logits = self.passes.verify(self.cache, tree, past_len)
        result = accept(tree, logits, self.chooser, self.context)
        self.cache.keep_path(past_len, result.path)
        t2 = time.perf_counter()
        self.drafter.observe(tree, result.path)
        self.stats.forward_passes += 1
        self.stats.draft_s += t1 - t0
        self.stats.verify_s += t2 - t1
        self._count_acceptance(tree, result.path)
        self.features.append(features[result.path])
        self.context = torch.cat([self.context, self._tensor([*result.accepted, result.bonus])])
        self.consistent = True
        pieces = [(token, tree.sources[n], tree.depths[n]) for token, n in zip(result.accepted, result.path[1:])]
        return self._step_event([*pieces, (result.bonus, "target", 0)], result.rejected, tree_size=len(tree),
                                draft_ms=(t1 - t0) * 1e3, verify_ms=(t2 - t1) * 1e3)

    def _tensor(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    # -- what comes out -------------------------------------------------------------------
    def _step_event(self, tokens, rejected, tree_size, draft_ms, verify_ms) -> StepEvent:
        """The step's tokens (token, origin, depth), up to the one that ends the generation."""
        pieces = []
        for token, origin, depth in tokens:
            pieces.append(TokenPiece(token, self.detok.push(token), origin, depth))
            self.new_ids.append(token)
            self.finish_reason = self.stop.after_token(token, len(self.new_ids), self.detok.text)
            if self.finish_reason is not None:
                break
        if self.finish_reason == "stop":  # the answer's text ends before the stop string
            self.detok.text = self.detok.text[: self.stop.stop_string_at(self.detok.text)]
        self.finish_reason = self.finish_reason or self.stop.after_step(len(self.context))
        self.stats.new_tokens = len(self.new_ids)
        decode = self.target.tokenizer.decode
        refused = [TokenPiece(t, decode([t]), "rejected", 0) for t in rejected]
        return StepEvent(pieces, refused, tree_size, draft_ms, verify_ms)

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


def run_to_end(
    engine: Engine,
    prompt_ids: list[int],
    settings: GenerationSettings | None = None,
    on_step: Callable[[StepEvent], None] | None = None,
    **options,
) -> DoneEvent:
    """Drain a generation to its final event (scripts, tests, benchmarks, front ends).

    on_step: called with each StepEvent as it comes. options: what Engine.generate takes
    besides the prompt and settings (cancel, drafter, reuse_prefix).
    """
    done = None
    for event in engine.generate(prompt_ids, settings, **options):
        if isinstance(event, DoneEvent):
            done = event
        elif on_step is not None:
            on_step(event)
    return done
