"""The draft guard: under sampling the drafter drafts only as far as it pays, measured as it runs."""
from __future__ import annotations

import pytest
import torch

from gumiho_core import Engine, GenerationSettings, SamplingSettings, TreeSettings, new_heads, run_to_end
from gumiho_core.draft_guard import FIRST_STEPS, PROBE_EVERY, PROBE_EVERY_MAX, TRY_EVERY_LOSS, DraftGuard, ModeChoice
from gumiho_core.drafter import RecordingDrafter
from tiny import VOCAB, tiny_target

MODES = ("heads", "lookup", "root")


def feed(choice: ModeChoice, tokens: dict, seconds: dict, steps: int) -> list[str]:
    """Let `choice` pick `steps` times; each mode's step gives its tokens in its seconds."""
    picked = []
    for _ in range(steps):
        mode = choice.pick()
        choice.add(mode, tokens[mode], seconds[mode])
        picked.append(mode)
    return picked


def test_every_mode_is_timed_first_then_the_fastest_wins_with_probes_of_the_others():
    choice = ModeChoice(MODES)
    # Tokens per time unit: heads 1.4 / 1.6 = 0.88, lookup 1.05 / 1.1 = 0.95, root 1.
    waits = [PROBE_EVERY, 2 * PROBE_EVERY, 4 * PROBE_EVERY]  # tries that change nothing get rarer
    picked = feed(choice, {"heads": 1.4, "lookup": 1.05, "root": 1}, {"heads": 1.6, "lookup": 1.1, "root": 1.0},
                  3 * FIRST_STEPS + sum(waits) + 3)
    assert picked[: 3 * FIRST_STEPS] == ["heads"] * FIRST_STEPS + ["lookup"] * FIRST_STEPS + ["root"] * FIRST_STEPS
    after = picked[3 * FIRST_STEPS :]
    tries = [i for i, m in enumerate(after) if m != "root"]
    assert [after[i] for i in tries] == ["heads", "lookup", "heads"]  # the others, in turn
    assert [b - a - 1 for a, b in zip([-1] + tries, tries)] == waits


def test_the_wait_between_tries_stops_doubling_and_starts_over_when_the_best_changes():
    choice = ModeChoice(("heads", "root"))
    # A cheap loss (0.05 of a step), so the step count, not the time, sets when a try is due.
    picked = feed(choice, {"heads": 1, "root": 1}, {"heads": 1.05, "root": 1.0}, 2 * FIRST_STEPS + 3000)
    tries = [i for i, m in enumerate(picked) if m == "heads"][FIRST_STEPS:]
    gaps = [b - a - 1 for a, b in zip(tries, tries[1:])]
    assert max(gaps) == PROBE_EVERY_MAX and gaps[-1] == PROBE_EVERY_MAX
    assert choice.probe_every == PROBE_EVERY_MAX
    feed(choice, {"heads": 4, "root": 1}, {"heads": 1.0, "root": 1.0}, 2 * PROBE_EVERY_MAX)  # drafting pays now
    assert choice.best() == "heads" and choice.probe_every < PROBE_EVERY_MAX


def test_a_dear_try_waits_until_its_loss_is_a_small_share_of_the_time():
    """A heads step losing 2 s against the root (the serial head's catch-up, say) is tried only
    after 100x that of other steps, so tries cost ~1% of the time; a cheap try (lookup, losing
    0.1 s) still comes when the step count says."""
    choice = ModeChoice(MODES)
    tokens, seconds = {"heads": 1, "lookup": 1, "root": 1}, {"heads": 3.0, "lookup": 1.1, "root": 1.0}
    picked = feed(choice, tokens, seconds, 3 * FIRST_STEPS + 10000)[3 * FIRST_STEPS :]
    clock, last, waits = 0.0, {"heads": None, "lookup": None}, {"heads": [], "lookup": []}
    for mode in picked:
        if mode != "root":
            if last[mode] is not None:
                waits[mode].append(clock - last[mode])
            last[mode] = clock + seconds[mode]
        clock += seconds[mode]
    assert waits["heads"] and min(waits["heads"]) >= TRY_EVERY_LOSS * 2.0
    tries = [mode for mode in picked if mode != "root"]
    assert tries[:3] == ["lookup"] * 3  # the cheap try is not held back while the dear one waits
    lost = picked.count("heads") * 2.0 + picked.count("lookup") * 0.1
    assert lost / clock < 0.015


def test_a_dear_mode_that_keeps_losing_is_tried_ever_more_rarely_and_sooner_again_when_things_change():
    """Every try that changes nothing lengthens the time before the next one, as it does the
    steps: a fixed wait of 100x the loss cost ~1% of the time for each dear mode for as long as
    the chat ran (int4, temperature 1: heads tries ~1.6% of a run). Once the best mode changes,
    tries come at the first wait again."""
    choice = ModeChoice(("heads", "root"))
    seconds = {"heads": 3.0, "root": 1.0}  # a heads step loses 2 s against the root
    picked = feed(choice, {"heads": 1, "root": 1}, seconds, 2 * FIRST_STEPS + 60000)[2 * FIRST_STEPS :]
    times, clock = [], 0.0
    for mode in picked:
        if mode == "heads":
            times.append(clock)
        clock += seconds[mode]
    waits = [b - a for a, b in zip(times, times[1:])]
    assert waits[0] >= TRY_EVERY_LOSS * 2.0 and waits[-1] >= 16 * TRY_EVERY_LOSS * 2.0  # 16x the first rule's
    assert all(later >= earlier for earlier, later in zip(waits, waits[1:]))
    late = picked[len(picked) // 2 :]
    assert 2.0 * late.count("heads") / len(late) < 0.002  # what tries cost late in a long chat
    for _ in range(200):  # the root turns slow: heads wins
        feed(choice, {"heads": 1, "root": 1}, {"heads": 3.0, "root": 4.0}, 1)
        if choice.last_best == "heads":
            break
    assert choice.try_wait("root", "heads") == TRY_EVERY_LOSS * choice.loss("root", "heads") > 0


def test_even_modes_go_to_the_cheaper_one():
    choice = ModeChoice(("heads", "root"))
    feed(choice, {"heads": 2, "root": 1}, {"heads": 2.0, "root": 1.0}, 2 * FIRST_STEPS)
    assert choice.best() == "root"  # it risks less when the two are even


def test_a_tree_that_pays_keeps_drafting():
    choice = ModeChoice(("heads", "root"))
    picked = feed(choice, {"heads": 3.0, "root": 1}, {"heads": 1.5, "root": 1.0}, 2 * FIRST_STEPS + 4 * PROBE_EVERY)
    after = picked[2 * FIRST_STEPS :]
    assert after.count("heads") >= len(after) - 4


def test_the_choice_follows_a_change_in_what_drafting_buys():
    choice = ModeChoice(("heads", "root"))
    feed(choice, {"heads": 3.0, "root": 1}, {"heads": 1.5, "root": 1.0}, 2 * FIRST_STEPS + 10)
    assert choice.best() == "heads"
    # Drafts stop being accepted (e.g. the answer turns to free text at a high temperature):
    # the probes of the heads show it, and plain steps take over.
    feed(choice, {"heads": 1.0, "root": 1}, {"heads": 1.5, "root": 1.0}, 40)
    assert choice.best() == "root"


def test_a_try_that_beats_the_best_clearly_is_judged_on_its_fresh_steps():
    """A mode that lost for a long time (chains refused) and then wins a try by far (the answer
    starts repeating its context) takes the next steps at once, not after many more tries."""
    choice = ModeChoice(("lookup", "root"))
    feed(choice, {"lookup": 1, "root": 1}, {"lookup": 3.0, "root": 1.0}, 2 * FIRST_STEPS + 200)
    assert choice.best() == "root" and len(choice.records["lookup"].steps) >= FIRST_STEPS
    picked = feed(choice, {"lookup": 5, "root": 1}, {"lookup": 1.5, "root": 1.0}, 2 * PROBE_EVERY_MAX)
    first_try = picked.index("lookup")
    assert picked[first_try:] == ["lookup"] * (len(picked) - first_try)
    assert choice.best() == "lookup"


def test_records_are_kept_per_key_across_generations():
    guard = DraftGuard()
    guard.begin(("t=1",), ("heads", "root"))
    for _ in range(3):
        guard.record(guard.pick(), 1, 1.0)
    guard.begin(("t=0.7",), ("heads", "root"))
    assert guard.pick() == "heads" and sum(len(r.steps) for r in guard.current.records.values()) == 0
    guard.begin(("t=1",), ("heads", "root"))  # a new generation at the first settings goes on from there
    assert len(guard.current.records["heads"].steps) == 3
    guard.record(guard.pick(), 1, 1.0)
    summary = {entry["key"]: entry["modes"] for entry in guard.summary()}
    assert summary[str(("t=1",))]["heads"]["steps"] == 4 and str(("t=0.7",)) not in summary  # no step there


def test_each_situation_keeps_its_own_records():
    """Chains matched on 3 context tokens pay, steps without a chain do not: each kind of step
    gets the mode that pays for it, not the average of both."""
    guard = DraftGuard()
    guard.begin(("t=0",), MODES)
    strong = {"heads": (2, 2.0), "lookup": (4, 1.5), "root": (1, 1.0)}  # (tokens, seconds) per step
    none = {"heads": (1.2, 2.0), "root": (1, 1.0)}
    for _ in range(300):
        mode = guard.pick("3-token match")
        guard.record(mode, *strong[mode])
        mode = guard.pick("no match", ("heads", "root"))
        guard.record(mode, *none[mode])
    summary = {entry["key"]: entry["modes"] for entry in guard.summary()}
    with_chain, without = summary["('t=0',), 3-token match"], summary["('t=0',), no match"]
    assert with_chain["lookup"]["steps"] > 250 and without["root"]["steps"] > 250
    assert "lookup" not in without


class FixedGuard:
    """Always the same mode; remembers what each step gave."""

    def __init__(self, mode):
        self.mode, self.recorded, self.modes = mode, [], None
        self.situations = []  # (situation, modes offered) of each step

    def begin(self, key, modes, label=""):
        self.modes = modes

    def pick(self, situation="", modes=None):
        self.situations.append((situation, modes))
        return self.mode if modes is None or self.mode in modes else modes[-1]

    def record(self, mode, tokens, seconds):
        self.recorded.append((mode, tokens, seconds))


@pytest.fixture(scope="module")
def engine():
    target = tiny_target(seed=0, eos=False)
    return Engine(target, new_heads(target))


SAMPLED = SamplingSettings(temperature=1.0, seed=3)


def trees(engine, sampling, guard, lookup_tokens=4, prompt=(3, 4, 5, 3, 4, 5, 3, 4), guard_greedy=False):
    engine.drafter.guard = guard
    recorder = RecordingDrafter(engine.drafter)
    tree = TreeSettings(top_k=3, total_tokens=6, depth=2, lookup_tokens=lookup_tokens, guard_greedy=guard_greedy)
    try:
        done = run_to_end(engine, list(prompt), GenerationSettings(max_new_tokens=16, sampling=sampling, tree=tree),
                          drafter=recorder, reuse_prefix=False)
    finally:
        engine.drafter.guard = DraftGuard()
    return done, recorder.trees


def test_root_mode_is_plain_decodings_step(engine):
    guard = FixedGuard("root")
    done, drafted = trees(engine, SAMPLED, guard)
    # The prefill gives the first token, each step one more.
    assert all(len(t) == 1 for t in drafted) and done.stats.forward_passes == 16
    assert guard.modes == MODES
    assert [(m, n) for m, n, _ in guard.recorded] == [("root", 1)] * 15 and all(s > 0 for *_, s in guard.recorded)


def test_lookup_mode_offers_the_chain_without_the_heads(engine):
    # Every token occurs in this prompt, so whatever is drawn, the lookup finds a chain.
    _, drafted = trees(engine, SAMPLED, FixedGuard("lookup"), prompt=tuple(range(3, VOCAB)))
    assert any(len(t) > 1 for t in drafted)
    assert all(set(t.sources) <= {"root", "lookup"} for t in drafted)


def test_heads_mode_and_greedy_decoding_draft_the_full_tree(engine):
    guard = FixedGuard("root")
    _, drafted = trees(engine, SamplingSettings(), guard)  # greedy: the guard is not asked
    assert guard.modes is None and all("serial" in t.sources for t in drafted)
    guard = FixedGuard("heads")
    _, drafted = trees(engine, SAMPLED, guard, lookup_tokens=0)
    assert guard.modes == ("heads", "root") and all("serial" in t.sources for t in drafted)
    assert sum(n for _, n, _ in guard.recorded) >= 15  # every step's tokens (the last may run past)


class TakingTurns(FixedGuard):
    """The modes in turn, one step each: heads, lookup, root, heads, ..."""

    def pick(self, situation="", modes=None):
        self.mode = self.modes[len(self.recorded) % len(self.modes)]
        return self.mode if modes is None or self.mode in modes else modes[-1]


def test_a_tree_that_guards_greedy_decoding_asks_the_guard_and_keeps_the_answer(engine):
    """guard_greedy (the AVX2 default tree): greedy steps in the modes the guard picks, and
    the answer is plain decoding's, token for token."""
    prompt = (3, 4, 5, 3, 4, 5, 3, 4)
    plain = run_to_end(engine, list(prompt), GenerationSettings(max_new_tokens=16, speculative=False))
    guard = TakingTurns("heads")
    done, drafted = trees(engine, SamplingSettings(), guard, prompt=prompt, guard_greedy=True)
    assert guard.modes == MODES and {mode for mode, _, _ in guard.recorded} == set(MODES)
    assert all(len(t) == 1 for t, (mode, _, _) in zip(drafted, guard.recorded) if mode == "root")
    assert done.token_ids == plain.token_ids


def test_switching_modes_mid_answer_keeps_the_answer(engine):
    """At a temperature so low that the target's choice carries all the probability, the
    sampled answer is the greedy one, whatever mode each step drafted in."""
    plain = run_to_end(engine, [3, 4, 5, 3, 4, 5, 3, 4], GenerationSettings(max_new_tokens=16, speculative=False))
    guard = TakingTurns("heads")
    done, drafted = trees(engine, SamplingSettings(temperature=1e-4, seed=0), guard)
    assert done.token_ids == plain.token_ids
    assert {m for m, _, _ in guard.recorded} == set(MODES)


def test_the_guard_judges_each_step_by_how_long_a_match_the_lookup_found(engine):
    """The drafter tells the guard, before each step, what kind of step it is: no chain found
    (no "lookup" mode offered: the root alone would be that step), a chain matched on 1-3
    context tokens, or the answer repeating its context (the chain of the step before accepted
    whole)."""
    from gumiho_core.context_lookup import LookupLength, look_up

    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    guard = FixedGuard("lookup")
    engine.drafter.guard = guard
    recorder = RecordingDrafter(engine.drafter)
    tree = TreeSettings(top_k=3, total_tokens=6, depth=2, lookup_tokens=4, guard_greedy=True)
    try:
        done = run_to_end(engine, prompt, GenerationSettings(max_new_tokens=64, tree=tree), drafter=recorder,
                          reuse_prefix=False)
    finally:
        engine.drafter.guard = DraftGuard()
    emitted, length, seen = 1, LookupLength(4), set()  # the prefill's token; the drafter's chain rule
    chained = False  # whether the step before offered a chain
    for (situation, modes), (drafted, path) in zip(guard.situations, recorder.steps):
        found = look_up(torch.tensor(prompt + done.token_ids[:emitted]), 4)
        repeating, chained = chained and length.repeating, bool(found.tokens)
        if not found.tokens:
            assert (situation, modes) == ("no match", ("heads", "root")) and len(drafted) == 1
        else:
            expected = ("repeating", ("lookup", "root")) if repeating else (f"{found.match}-token match", None)
            assert (situation, modes) == expected
            assert drafted.sources[1:] and set(drafted.sources[1:]) == {"lookup"}
            length.update(len(path) - 1, len(drafted) - 1)  # the root and the chain alone
        seen.add(situation)
        emitted += len(path)
    assert "no match" in seen and len(seen) > 1 and len(recorder.steps) == len(guard.situations)


@pytest.mark.parametrize("context, situation", [
    ([1, 2, 3, 9, 1, 2, 3], "3-token match"),
    ([7, 1, 2, 9, 8, 1, 2], "2-token match"),
    ([7, 1, 9, 8, 1], "1-token match"),
    ([1, 2, 3, 4], "no match"),
])
def test_each_kind_of_step_is_named_to_the_guard(engine, context, situation):
    from gumiho_core.drafter import DraftStep

    drafter, guard = engine.drafter, FixedGuard("lookup")
    drafter.guard = guard
    settings = GenerationSettings(tree=TreeSettings(top_k=3, total_tokens=6, depth=2, lookup_tokens=4,
                                                    guard_greedy=True))
    try:
        drafter.begin(context, 0, settings)
        step = DraftStep(torch.tensor(context), torch.zeros(len(context) - 1, engine.target.hidden_size), room=8)
        drafter.draft(step)
        drafter.lookup.tokens = 8  # the last chain was accepted whole: the answer repeats its context
        drafter.draft(step)
    finally:
        drafter.guard = DraftGuard()
    repeating = ("repeating", ("lookup", "root")) if situation != "no match" else ("no match", ("heads", "root"))
    assert guard.situations == [(situation, ("heads", "root") if situation == "no match" else None), repeating]


class RootThenHeads(FixedGuard):
    """The root alone for the first `root_steps` steps, the heads after."""

    def __init__(self, root_steps: int):
        super().__init__("root")
        self.root_steps = root_steps

    def pick(self, situation="", modes=None):
        self.mode = "root" if len(self.recorded) < self.root_steps else "heads"
        return super().pick(situation, modes)


def test_heads_after_a_stretch_of_root_steps_read_only_the_latest_skipped_tokens(engine, monkeypatch):
    """The serial head reads the prompt whole but, of the answer's tokens that root steps
    skipped, only the last CATCH_UP_TOKENS, at their own positions; the answer is plain
    decoding's, and the next generation keeps only the head's cache entries before the gap."""
    from gumiho_core.drafter import CATCH_UP_TOKENS

    drafter, prompt = engine.drafter, list(range(3, 13))
    reads, real = [], drafter.heads.serial

    def serial(u, positions, cache=None, mask=None):
        if mask is None:  # the catch-up reads (a deeper depth's beams carry a mask)
            reads.append(positions.tolist())
        return real(u, positions, cache, mask)

    monkeypatch.setattr(drafter.heads, "serial", serial)
    tree = TreeSettings(top_k=3, total_tokens=6, depth=2, lookup_tokens=0, guard_greedy=True)
    settings = GenerationSettings(max_new_tokens=CATCH_UP_TOKENS + 40, tree=tree)
    drafter.guard = RootThenHeads(CATCH_UP_TOKENS + 20)
    try:
        done = run_to_end(engine, prompt, settings, reuse_prefix=False)
    finally:
        drafter.guard = DraftGuard()
    plain = run_to_end(engine, prompt, settings.with_(speculative=False), reuse_prefix=False)
    assert done.token_ids == plain.token_ids
    end = reads[0][-1] + 1  # the root's position: the first heads step's
    assert end == len(prompt) + CATCH_UP_TOKENS + 20
    assert reads[0] == list(range(len(prompt))) + list(range(end - CATCH_UP_TOKENS, end))
    assert all(later[0] == earlier[-1] + 1 for earlier, later in zip(reads, reads[1:]))  # no gap after
    assert drafter.whole == len(prompt) and len(drafter.cache) > len(prompt)
    context = prompt + done.token_ids
    drafter.begin(context, len(context), settings)  # a next turn sharing the whole context
    assert len(drafter.cache) == drafter.whole == drafter.next_position == len(prompt)


def test_while_no_try_is_due_the_guard_asks_again_only_every_few_steps(monkeypatch):
    """Asking whether another mode's try is due sums its window (ModeChoice.loss): asked at every
    step of a long stretch of the best mode, it was most of the guard's cost. It is asked every
    RECHECK_EVERY steps, and the dear modes are still tried once their wait is over."""
    from gumiho_core.draft_guard import RECHECK_EVERY

    choice, asked = ModeChoice(MODES), []
    real_loss = ModeChoice.loss
    monkeypatch.setattr(ModeChoice, "loss", lambda self, mode, best: asked.append(mode) or real_loss(self, mode, best))
    picked = feed(choice, {"heads": 1, "lookup": 1, "root": 1}, {"heads": 0.07, "lookup": 0.07, "root": 0.008}, 3000)
    asks_per_mode = len(asked) / 2  # heads and lookup are asked about together
    assert RECHECK_EVERY >= 4 and asks_per_mode <= 3000 / 4  # asked at every step: ~2900
    assert [i for i, mode in enumerate(picked) if mode != "root" and i > 100]  # still tried now and then
