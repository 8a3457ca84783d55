"""Draft sources: whatever proposes the tree that the target verifies in one pass.

The generation loop (generate.py) keeps the target's side only (its KV cache, its
features, the tokens so far) and asks a `Drafter` for each step's tree, the way
transformers' assisted generation asks a `CandidateGenerator` (get_candidates /
update_candidate_strategy):

- `begin(prompt_ids, shared, settings)`: a generation starts; the first `shared` prompt
  tokens are the ones the last generation's target cache holds, so a drafter may keep
  its own state for them;
- `draft(step)`: the tree below the root (`DraftStep`: the tokens so far and the target's
  features of the cached ones);
- `observe(tree, path)`: the nodes the target accepted;
- `tree_sizes(tree_settings)`: the row counts its trees have, so the target pass can be
  prepared for them (verify.TargetPasses).

Because the target verifies every tree against its own choices, a drafter can only change
speed, never the output: a test's oracle, a recorder, or plain decoding (`PlainDrafter`,
a tree of the root alone) all go through the same loop.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from .context_lookup import Chain, ContextIndex, LookupLength
from .cpu_matmul import pack_for_rows
from .draft_guard import DraftGuard
from .draft_tree import DraftTree, build_draft_tree
from .heads import DraftVocabProjection, GumihoHeads
from .quantize import drafting_copy
from .settings import GenerationSettings, TreeSettings

# A heads step after a stretch of root or lookup steps reads only this many of the answer's
# tokens it skipped (the latest), leaving a gap in the serial head's cache: reading them all
# cost ~0.25 ms a token on the AVX2 machine (a try of the heads after 200 root steps: 49 ms,
# four root steps' time). The prompt is always read whole. A gap changes what is drafted,
# never what is accepted.
CATCH_UP_TOKENS = 64


@dataclass
class DraftStep:
    """What the target side shows a drafter at one step."""

    context: torch.Tensor  # every token so far, prompt first; the last is the root
    features: torch.Tensor  # (len(context) - 1, H): the target's features of the cached tokens
    room: int  # the deepest draft the target's context still has room for (0: the root only)

    @property
    def root(self) -> int:
        return int(self.context[-1])


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Drafter:
    """The interface, and the plain drafter's behaviour: propose the root alone."""

    def begin(self, prompt_ids: list[int], shared: int, settings: GenerationSettings) -> None:
        """A generation starts. shared: prompt tokens the target keeps from the last one."""

    def draft(self, step: DraftStep) -> DraftTree:
        return DraftTree.root_only(step.root)

    def observe(self, tree: DraftTree, path: list[int]) -> None:
        """The target accepted `path` (tree nodes, the root first) of `tree`."""

    def tree_sizes(self, tree: TreeSettings) -> tuple[int, ...]:
        """The row counts its trees have under `tree` (at most, but for rare longer ones),
        smallest first: the target pass is prepared for them, a tree padded up to the next."""
        return (1,)


class PlainDrafter(Drafter):
    """Plain decoding: every tree is the root alone, one token per target pass."""


class GumihoDrafter(Drafter):
    """The Gumiho heads, with the context-lookup branch (context_lookup.py) added to their tree.

    It owns everything that only drafting needs: the heads, the serial head's cache, the
    draft-vocabulary projection, the lookup's length and its index of the context. Its cache
    is kept between generations for the tokens the next prompt shares with what it read.

    Under sampling it drafts only as far as drafting pays (draft_guard.py): each step is
    the full tree ("heads"), the root and a looked-up chain ("lookup"), or the root alone
    ("root", plain decoding's step), whichever gave the most tokens per second lately at
    these settings (where the guard decides greedy steps: lately in steps like this one, see
    _pick_mode). Under greedy decoding it drafts the full tree (unless the tree says
    `guard_greedy`, as on AVX2-only CPUs, where rows are dear): the tree budget
    (tree_budget.py) measured what these heads are accepted at exactly that rule, and
    guarding greedy decoding too was measured slower (float32, mt_bench 20 x 256: 1.34x plain
    guarded against 1.52x always drafting: a heads step after root steps pays for the serial
    head reading what it skipped, so the guard kept choosing the root).
    `guard = None` drafts every step under sampling too (tests of the acceptance rule).
    """

    def __init__(self, target, heads: GumihoHeads):
        self.target, self.heads = target, heads
        self.projection = DraftVocabProjection(target.lm_head, heads.draft_vocab, heads.dtype,
                                               layout=lambda rows: drafting_copy(rows, target))
        self.cache = heads.new_cache()
        # The context at the cache's last read: draft position i read token i+1 with target
        # feature i. Kept as a tensor, turned into a list only when a generation begins.
        self.read = torch.zeros(0, dtype=torch.long)
        self.next_position = 0  # the first context position the cache has not read
        self.whole = 0  # its first entries, up to the first gap, are positions 0 .. whole - 1
        self.prompt_length = 0
        self.tree = TreeSettings()
        self.lookup = LookupLength(0)
        self.index = ContextIndex()  # the context's runs, for the lookup at every step
        self.chain: list[int] = []  # the looked-up tokens offered in this step's tree
        self.repeating = False  # ... after a chain accepted whole in the step before
        self.guard: DraftGuard | None = DraftGuard()
        self.guarded = False  # the guard picks this generation's modes
        self.by_match = False  # ... judging each step by its looked-up chain's match (greedy)
        self.mode = "heads"  # this step's mode, and when its drafting started
        self.started = 0.0

    def begin(self, prompt_ids: list[int], shared: int, settings: GenerationSettings) -> None:
        self.tree = settings.tree
        self.lookup, self.chain = LookupLength(self.tree.lookup_tokens), []
        self.index.reset(prompt_ids)
        self.guarded = self.guard is not None and (not settings.sampling.greedy or self.tree.guard_greedy)
        self.by_match = settings.sampling.greedy
        if self.guarded:
            self._guard_begin(settings)
        # Below depth 1, drafting multiplies one row per beam (cpu_matmul.py).
        pack_for_rows(self.heads, self.tree.top_k)
        if self.projection.project is not self.target.lm_head:  # a draft vocabulary of its own
            pack_for_rows(self.projection.project, self.tree.top_k)
        # Position i stays valid while token i+1 is one this cache read and the new prompt
        # repeats, and feature i one the target side keeps (its first `shared` tokens).
        # Entries past a gap stand for other positions: they go too.
        keep = min(common_prefix_length(self.read.tolist(), prompt_ids), shared, self.whole + 1) - 1
        if keep <= 0:
            self.cache = self.heads.new_cache()
        else:
            self.cache.crop(min(len(self.cache), keep))
        self.next_position = self.whole = len(self.cache)
        self.prompt_length = len(prompt_ids)

    def _guard_begin(self, settings: GenerationSettings) -> None:
        """Tell the guard which settings this generation runs at, and the modes it may pick."""
        # The seed changes which tokens are drawn, not how many are accepted on average.
        sampling, tree = replace(settings.sampling, seed=None), self.tree
        label = (f"temperature {sampling.temperature}, top_p {sampling.top_p}, "
                 f"tree {tree.top_k}/{tree.total_tokens}/{tree.depth} + lookup {tree.lookup_tokens}")
        modes = ("heads", "lookup", "root") if tree.lookup_tokens else ("heads", "root")
        self.guard.begin((sampling, tree), modes, label)

    def tree_sizes(self, tree: TreeSettings) -> tuple[int, ...]:
        # The heads' best total_tokens nodes (62 % of mt_bench passes: no chain, or one the
        # heads guessed too), and those with a looked-up chain of the base length. Padding
        # those to the larger size alone made most passes dearer (SmolLM2-135M: 77 ms at
        # 14 rows against 61 ms at 6). While the answer repeats itself a chain grows past
        # it (up to 4x) and replaces the heads' nodes; such steps are rare (1 in 523 passes
        # of 8 mt_bench answers) and run unpadded.
        return tuple(sorted({tree.total_tokens, tree.total_tokens + tree.lookup_tokens}))

    def draft(self, step: DraftStep) -> DraftTree:
        """Look up a chain in the context, feed the serial head what it has not read yet,
        and draft below the root (as far as this step's mode goes)."""
        self.started = time.perf_counter()
        # The answer repeats its context while each step's chain is accepted whole: a step
        # without one (the root alone, or no match) ends the run for the guard's records,
        # though LookupLength keeps the chain's grown length for the next one.
        self.repeating = bool(self.chain) and self.lookup.repeating
        self.chain = []
        root_only = DraftTree.root_only(step.root, step.context.device)
        if step.room < 1:
            self.mode = "root"
            return root_only
        # Greedy steps are judged by what the lookup found; sampled ones all alike, so there
        # the guard picks first and a root step skips the lookup.
        found = self._look_up(step) if self.by_match or not self.guarded else None
        self.mode = self._pick_mode(found)
        if self.mode == "root":
            return root_only
        if found is None:
            found = self._look_up(step)
        self.chain = found.tokens if found is not None else []
        if self.mode == "lookup" or (self.chain and self.repeating):
            # Either the guard found the heads not worth their cost lately, or the answer is
            # repeating the context and the last chain was accepted whole (the heads would
            # cost more than their branch gains). The serial head reads the tokens it missed
            # at its next turn.
            return root_only.add_chain(self.chain)
        return self._heads_tree(step).add_chain(self.chain)

    def _look_up(self, step: DraftStep) -> Chain | None:
        """The chain the context lookup offers at this step (None: the lookup is off)."""
        if not self.lookup.tokens:
            return None
        self.index.follow(step.context)
        return self.index.look_up(min(self.lookup.tokens, step.room))

    def _pick_mode(self, found: Chain | None) -> str:
        """The full tree unless guarded; else the guard's pick for a step like this one: no
        chain found (then "lookup" would be the root alone), the answer repeating its context
        (the last chain accepted whole: the chain goes alone, as draft() says, so "heads"
        would be "lookup"), or a chain matched on 1, 2 or 3 context tokens. Under sampling one
        record for all: chains are seldom accepted whole whatever their match (mt_bench,
        temperature 1: 1.7 tokens a step even on 3-token matches, slower than the root alone),
        and five records' trial steps cost more than they found (0.96x plain against 0.99x)."""
        if not self.guarded:
            return "heads"
        if found is None or not self.by_match:  # the lookup is off, or sampling (as said above)
            return self.guard.pick()
        if not found.tokens:
            return self.guard.pick("no match", ("heads", "root"))
        if self.repeating:
            return self.guard.pick("repeating", ("lookup", "root"))
        return self.guard.pick(f"{found.match}-token match")

    def _heads_tree(self, step: DraftStep) -> DraftTree:
        heads, cache, embed = self.heads, self.cache, self.target.embed_tokens
        start, end = self.next_position, len(step.features)
        read, in_order_to = self._positions_to_read(start, end)
        read = read.to(step.context.device)
        # Draft position i reads (token i+1, target feature i); the last one read is the root.
        u = heads.fc_input(embed(step.context[read + 1]), step.features[read].to(heads.dtype))
        out = heads.serial(u[None], read, cache)[0]
        if self.whole == start:  # no gap yet: the positions read in order extend the gap-free entries
            self.whole = in_order_to
        self.read, self.next_position = step.context, end
        return build_draft_tree(heads, embed, self.projection, cache, step.root, out[-1], u[-1], self.tree,
                                max_depth=step.room, next_position=end)

    def _positions_to_read(self, start: int, end: int) -> tuple[torch.Tensor, int]:
        """The context positions the serial head reads at a heads step: every one from `start`
        (where its cache left off) to `end`, but of the answer's own positions skipped by root
        and lookup steps only the last CATCH_UP_TOKENS. Also where the in-order stretch from
        `start` ends (`end`, or where a gap begins)."""
        gap_from, gap_to = max(start, self.prompt_length), end - CATCH_UP_TOKENS
        if gap_to <= gap_from:
            return torch.arange(start, end), end
        return torch.cat([torch.arange(start, gap_from), torch.arange(gap_to, end)]), gap_from

    def observe(self, tree: DraftTree, path: list[int]) -> None:
        if self.chain:
            drafted = tree.tokens[path[1:]].tolist()
            self.lookup.update(common_prefix_length(drafted, self.chain), len(self.chain))
        if self.guarded:  # the step gave the path and the target's own token, in this time
            self.guard.record(self.mode, len(path), time.perf_counter() - self.started)


class RecordingDrafter(Drafter):
    """Another drafter, unchanged, that keeps every (tree, accepted path) it saw.

    The tree-budget calibration reads them (tree_budget.py), and so do tests.
    """

    def __init__(self, inner: Drafter):
        self.inner = inner
        self.steps: list[tuple[DraftTree, list[int]]] = []

    @property
    def trees(self) -> list[DraftTree]:
        return [tree for tree, _ in self.steps]

    def begin(self, prompt_ids: list[int], shared: int, settings: GenerationSettings) -> None:
        self.inner.begin(prompt_ids, shared, settings)

    def draft(self, step: DraftStep) -> DraftTree:
        return self.inner.draft(step)

    def observe(self, tree: DraftTree, path: list[int]) -> None:
        self.steps.append((tree, path))
        self.inner.observe(tree, path)

    def tree_sizes(self, tree: TreeSettings) -> tuple[int, ...]:
        return self.inner.tree_sizes(tree)
