"""Whether drafting pays at the sampling settings in use, judged from the steps it times.

A drafted tree speeds decoding up only if the target accepts enough of it: a tree step
costs more than a one-row step (a wider target pass, and the heads' drafting), and buys
1 + the accepted drafts. Under greedy decoding the shipped heads get ~3 tokens a pass; under
sampling far fewer are accepted (mt_bench, temperature 1: tau 1.44), and speculation
ran at 0.90x plain. How much a tree step costs depends on the engine and the machine, and
what it buys on the temperature, the text and the heads, so the guard measures both while
it runs instead of trusting numbers measured elsewhere.

The drafter offers modes, dearest first (e.g. "heads": the full tree; "lookup": the root
and a looked-up chain, no heads; "root": the root alone, i.e. plain decoding's step). For
the settings in use the guard keeps each mode's latest steps (tokens emitted, seconds from
drafting to the accepted path), picks the mode with the most tokens per second, and now
and then tries another one, so the choice follows the answer and the machine (a busy
machine slows every mode alike). Tries get rarer while they change nothing, and a mode
whose steps lose much (a heads step after a stretch of root steps: the serial head reads
all it skipped) is tried only once its loss is a small share of the time since. Statistics
are kept per sampling settings and tree, across generations, so a chat learns once per
setting, and per kind of step the drafter names (`pick(situation)`: e.g. how long a match
its context lookup found).

Lossless whatever it picks: the target verifies any tree against its own choices
(verify.accept), so a mode changes how many passes an answer takes, never its tokens or
their distribution.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

WINDOW = 24  # steps per mode the rate is taken over: long enough to average tau's spread
FIRST_STEPS = 4  # steps each mode gets before the guard compares them
PROBE_EVERY = 16  # steps of the best mode before the first try of another one
# Each try that leaves the best mode as it was doubles the wait before the next, up to this:
# every try of a losing mode costs time (int4, temperature 1: a heads step 38 ms for 1.1
# tokens against 19 ms for 1), and 1 try in 17 steps cost ~2% of the answer's speed.
PROBE_EVERY_MAX = 256
RESET_MARGIN = 1.5  # a try this much faster than the best lately brings the next tries closer
# And a mode is tried only when the time since its last step is this many times what a step of
# it loses lately against the best: a dear try waits longer. A heads step after a stretch of
# root steps pays for the serial head reading what it skipped, at most the latest 64 tokens
# (drafter.py; int4, temperature 1: ~40 ms against 11 for a root step); tried every 256 steps,
# that cost ~2% of the answer's speed.
TRY_EVERY_LOSS = 100
# While no other mode's try is due yet, whether one is is asked again only after this many
# steps: asking means summing every other mode's window (loss), and asked at every step it was
# most of the guard's own cost (10.7 us a pick and record on warm caches, 0.1 ms a step in the
# loop). A try is late by at most this many steps against waits of seconds.
RECHECK_EVERY = 8


@dataclass
class ModeSteps:
    """The latest steps of one mode: tokens emitted and seconds taken, with their totals kept
    as steps come and go: the guard asks every mode's rate at every step, and summing the
    windows made a step's pick and record 12-14 us against 3-4 us now (warm caches; right
    after a pass has streamed the weights through them, Python runs several times slower)."""

    steps: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    tokens: int = 0
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        if len(self.steps) == self.steps.maxlen:  # the oldest step leaves the window
            old_tokens, old_seconds = self.steps[0]
            self.tokens, self.seconds = self.tokens - old_tokens, self.seconds - old_seconds
        self.steps.append((tokens, seconds))
        self.tokens, self.seconds = self.tokens + tokens, self.seconds + seconds

    def rate(self) -> float:
        """Tokens per second over the window (0 before any step)."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def tokens_per_step(self) -> float:
        return self.tokens / len(self.steps) if self.steps else 0.0


class ModeChoice:
    """The modes' records for one (sampling settings, tree) key, and whose turn it is."""

    def __init__(self, modes: tuple[str, ...], label: str = ""):
        self.modes, self.label = modes, label
        self.records = {mode: ModeSteps() for mode in modes}
        self.taken = dict.fromkeys(modes, 0)  # steps in each mode, all told (for reports)
        self.since_probe = 0
        self.probe_every, self.last_best = PROBE_EVERY, ""
        self.next_probe = 0  # where in `modes` the turn of the next try starts
        self.since_tried = dict.fromkeys(modes, 0.0)  # seconds of steps since each mode's last step

    def best(self) -> str:
        # Ties go to the cheaper mode (later in the list): it risks less if both are even.
        return max(reversed(self.modes), key=lambda mode: self.records[mode].rate())

    def add(self, mode: str, tokens: int, seconds: float) -> None:
        self.records[mode].add(tokens, seconds)
        self.taken[mode] += 1
        for other in self.modes:
            self.since_tried[other] += seconds
        self.since_tried[mode] = 0.0
        best = self.records.get(self.last_best)  # none while every mode is first timed
        if best is not None and mode != self.last_best and tokens > RESET_MARGIN * best.rate() * seconds:
            # A try beat the best clearly: the answer has changed under it (it started repeating
            # its context, say), so its older steps say little. Judge it afresh: its record
            # starts from this step, so it takes the next FIRST_STEPS - 1 steps too (pick), and
            # keeps them while it stays ahead. (Without this a mode that had lost often needed
            # many tries, one every 16-256 steps, to outweigh its old steps: mt_bench, 3-token
            # matches, looked-up chains 227 tok/s lately against the root's 94, yet 6% of steps.)
            self.records[mode] = ModeSteps()
            self.records[mode].add(tokens, seconds)
            self.probe_every, self.since_tried[mode] = PROBE_EVERY, float("inf")

    def pick(self) -> str:
        for mode in self.modes:  # every mode is timed first, dearest (most speculative) first
            if len(self.records[mode].steps) < FIRST_STEPS:
                return mode
        best = self.best()
        if best != self.last_best:  # the answer or the machine changed: look around sooner again
            self.last_best, self.probe_every = best, PROBE_EVERY
        self.since_probe += 1
        if self.since_probe <= self.probe_every or len(self.modes) == 1:
            return best
        in_turn = [self.modes[(self.next_probe + i) % len(self.modes)] for i in range(len(self.modes))]
        due = [mode for mode in in_turn if mode != best and self.since_tried[mode] >= self.try_wait(mode, best)]
        if not due:  # every other mode's try would cost too much yet
            self.since_probe -= RECHECK_EVERY
            return best
        self.since_probe = 0
        self.probe_every = min(2 * self.probe_every, PROBE_EVERY_MAX)
        self.next_probe = self.modes.index(due[0]) + 1  # the next try starts after this one, in turn
        return due[0]

    def try_wait(self, mode: str, best: str) -> float:
        """Seconds of steps since `mode`'s last step before it is tried again: TRY_EVERY_LOSS times
        what a step of it loses lately, and more the more tries in a row changed nothing, as the
        steps between tries (probe_every) grow: up to 16x, so a mode that keeps losing costs a
        share of the time that falls as the chat goes on instead of a fixed ~1% per dear mode."""
        return TRY_EVERY_LOSS * self.loss(mode, best) * self.probe_every / PROBE_EVERY

    def loss(self, mode: str, best: str) -> float:
        """Seconds a step of `mode` took lately beyond what `best` takes for the same tokens."""
        steps, best_rate = self.records[mode].steps, self.records[best].rate()
        if not steps or best_rate <= 0:
            return 0.0
        extra = sum(seconds - tokens / best_rate for tokens, seconds in steps)
        return max(0.0, extra / len(steps))


class DraftGuard:
    """Picks a drafter's mode for each step and learns from what each step gave.

    A step's situation is what the drafter knows before it drafts, such as how long a match
    the context lookup found: a chain whose source matched the context's last 3 tokens is
    accepted far more often than one matched on a single token (docs/benchmarks.md), so each
    situation keeps records of its own, and a step in one is judged by the steps like it.
    """

    def __init__(self):
        self.choices: dict[tuple, ModeChoice] = {}
        self.key: tuple = ()
        self.modes: tuple[str, ...] = ()
        self.label = ""
        self.current: ModeChoice | None = None
        self.by_situation: dict[tuple, ModeChoice] = {}  # the current key's choices (begin)

    def begin(self, key: tuple, modes: tuple[str, ...], label: str = "") -> None:
        """A generation starts under `key` (its sampling settings and tree), drafting in `modes`;
        `label` names the key in reports."""
        self.key, self.modes, self.label = key, modes, label or str(key)
        # This key's choices by (situation, modes): hashing the key's settings at every step
        # cost more than the rest of a pick.
        self.by_situation = {}
        self.current = self._choice("", modes)

    def pick(self, situation: str = "", modes: tuple[str, ...] | None = None) -> str:
        """This step's mode among `modes` (default: the generation's) in `situation`."""
        self.current = self._choice(situation, modes or self.modes)
        return self.current.pick()

    def record(self, mode: str, tokens: int, seconds: float) -> None:
        """What the step just picked gave: tokens emitted, in seconds."""
        self.current.add(mode, tokens, seconds)

    def _choice(self, situation: str, modes: tuple[str, ...]) -> ModeChoice:
        choice = self.by_situation.get((situation, modes))
        if choice is None:
            key = (self.key, modes, situation)
            if key not in self.choices:
                self.choices[key] = ModeChoice(modes, f"{self.label}, {situation}" if situation else self.label)
            choice = self.by_situation[(situation, modes)] = self.choices[key]
        return choice

    def summary(self) -> list[dict]:
        """Per key and situation met so far: each mode's steps all told, and its tokens per step and
        per second lately."""
        return [{"key": choice.label, "modes": {mode: {"steps": choice.taken[mode], "tokens_per_step": r.tokens_per_step(),
                                                   "tokens_per_s": r.rate()} for mode, r in choice.records.items()}}
                for choice in self.choices.values() if any(choice.taken.values())]
