"""Under sampling, speculative decoding must give exactly the target's distribution.

Chi-square tests with fixed seeds: the correct acceptance rule passes, a deliberately
broken one (a drafted token taken where either of two draws picks it) fails. And since each
emitted token takes one draw, as in plain decoding, the tokens themselves are plain
decoding's for the same seed.
"""
from __future__ import annotations

import random

import pytest
import torch

from gumiho_core import Engine, GenerationSettings, SamplingSettings, TreeSettings, new_heads, run_to_end
from gumiho_core import generate as generate_module
from gumiho_core.draft_tree import DraftTree
from gumiho_core.drafter import RecordingDrafter
from gumiho_core.sampling import TokenChooser, apply_repetition_penalty, warp
from gumiho_core.verify import Acceptance, accept
from oracle import OracleDrafter
from tiny import random_prompts, tiny_target


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.001 point of chi-square(df), Wilson-Hilferty approximation (df 7: 24.3)."""
    a = 2 / (9 * df)
    return df * (1 - a + z * a**0.5) ** 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic, pooling cells with tiny expectations into one."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    stat = (((counts[big] - expected[big]) ** 2) / expected[big]).sum()
    rest_c, rest_e = counts[~big].sum(), expected[~big].sum()
    cells = int(big.sum())
    if rest_e > 0:
        stat += (rest_c - rest_e) ** 2 / rest_e
        cells += 1
    return float(stat), cells - 1


def over_accepting(tree, logits, chooser, context) -> Acceptance:
    """A wrong rule: a drafted token is taken where either of two draws picks it."""
    tokens, node, path = tree.tokens.tolist(), 0, [0]
    while True:
        probs = chooser.probs(logits[node], context)
        draws = [chooser.sample(probs), chooser.sample(probs)]
        taken = [c for c in tree.children[node] if tokens[c] in draws]
        if not taken:
            return Acceptance(path, draws[0], [], [tokens[c] for c in path[1:]])
        node = taken[0]
        path.append(node)


def _broken(monkeypatch):
    monkeypatch.setattr(generate_module, "accept", over_accepting)


def first_token_counts(n_samples: int, vocab: int = 8, seed: int = 0, rule=accept) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, vocab, generator=g) * 1.5
    # root -> candidates 3, 1, 5 (best first); node of 3 -> candidate 2
    tree = DraftTree(torch.tensor([0, 3, 1, 5, 2]), [-1, 0, 0, 0, 1], [0, 1, 1, 1, 2], ["root"] + ["serial"] * 4)
    logits = torch.cat([logits, logits[:1]])
    chooser = TokenChooser(SamplingSettings(temperature=1.0, seed=seed))
    counts = torch.zeros(vocab)
    tokens = tree.tokens.tolist()
    for _ in range(n_samples):
        result = rule(tree, logits, chooser, torch.tensor([], dtype=torch.long))
        first = tokens[result.path[1]] if len(result.path) > 1 else result.bonus
        counts[first] += 1
    return counts, torch.softmax(logits[0], -1)


def test_accept_rule_reproduces_target_distribution():
    counts, probs = first_token_counts(20000)
    stat, df = chi_square(counts, probs)
    assert stat < chi2_critical(df), (stat, counts, probs * counts.sum())


def test_broken_accept_rule_is_detected():
    counts, probs = first_token_counts(20000, rule=over_accepting)
    stat, df = chi_square(counts, probs)
    assert stat > chi2_critical(df), "a rule that over-accepts drafts must fail this test"


# -- end to end through the engine: the distribution of the second new token ---------------

VOCAB = 16
PROMPT = [1, 5, 9, 4, 12]
SAMPLING = dict(temperature=0.9, top_p=0.95)


@pytest.fixture(scope="module")
def small():
    target = tiny_target(seed=4, vocab=VOCAB, eos=False, std=0.4)
    engine = Engine(target, new_heads(target))
    # Every step drafts its tree: these tests check the acceptance rule on trees, which the
    # draft guard (draft_guard.py) would soon stop offering, as untrained heads do not pay.
    engine.drafter.guard = None
    return target, engine


# Every (9, x) pair occurs in this prompt, which ends with 9: whatever the first new token,
# the context lookup finds the tail and offers its continuation below it.
LOOKUP_PROMPT = [1] + [t for x in range(3, VOCAB) for t in (9, x, (5 * x + 3) % VOCAB)] + [9]


def exact_second_token(target, prompt=PROMPT) -> torch.Tensor:
    """P(t2) = sum over t1 of p(t1 | prompt) p(t2 | prompt, t1), with the same warping."""
    settings = SamplingSettings(**SAMPLING)
    chooser = TokenChooser(settings)
    with torch.no_grad():
        base = target.model(torch.tensor([prompt])).logits[0, -1]
        p1 = chooser.probs(base, torch.tensor(prompt))
        batch = torch.tensor([prompt + [t] for t in range(VOCAB)])
        logits = target.model(batch).logits[:, -1]
    p2 = torch.stack([chooser.probs(logits[t], batch[t]) for t in range(VOCAB)])
    return (p1[:, None] * p2).sum(0)


def second_token_counts(engine, n: int, prompt=PROMPT, lookup_tokens: int = 0) -> torch.Tensor:
    counts = torch.zeros(VOCAB)
    tree = TreeSettings(top_k=3, total_tokens=8, depth=3, mlp_topk=2, pruning=3, fta=True, fta_tokens=1,
                        lookup_tokens=lookup_tokens)
    looked_up = 0
    for seed in range(n):
        settings = GenerationSettings(
            max_new_tokens=2, tree=tree, sampling=SamplingSettings(seed=seed, **SAMPLING)
        )
        recorder = RecordingDrafter(engine.drafter)
        done = run_to_end(engine, prompt, settings, drafter=recorder)
        counts[done.token_ids[1]] += 1
        looked_up += any("lookup" in t.sources for t, _ in recorder.steps)
    if lookup_tokens:  # the lookup branch must really have been offered, or this tests nothing new
        assert looked_up > n // 2, looked_up
    return counts


def test_speculative_sampling_matches_target_distribution(small):
    target, engine = small
    stat, df = chi_square(second_token_counts(engine, 2500), exact_second_token(target))
    assert stat < chi2_critical(df), stat


def test_speculative_sampling_with_context_lookup_matches_target_distribution(small):
    target, engine = small
    counts = second_token_counts(engine, 2500, LOOKUP_PROMPT, lookup_tokens=4)
    stat, df = chi_square(counts, exact_second_token(target, LOOKUP_PROMPT))
    assert stat < chi2_critical(df), stat


class TakingTurns:
    """A draft guard that gives the drafter's modes a step each in turn: heads, lookup, root, ..."""

    def __init__(self):
        self.turn, self.modes = 0, ()

    def begin(self, key, modes, label=""):
        self.modes = modes

    def pick(self, situation="", modes=None):
        self.turn += 1
        mode = self.modes[self.turn % len(self.modes)]
        return mode if modes is None or mode in modes else modes[-1]  # e.g. no chain found: no "lookup"

    def record(self, mode, tokens, seconds):
        pass


def test_draft_guard_modes_keep_the_distribution(small):
    """Whatever mode the guard picks for a step (the full tree, the looked-up chain alone, the
    root alone), the target's distribution is what comes out."""
    target, engine = small
    guard = engine.drafter.guard = TakingTurns()
    try:
        counts = second_token_counts(engine, 2400, LOOKUP_PROMPT, lookup_tokens=4)
    finally:
        engine.drafter.guard = None
    assert guard.modes == ("heads", "lookup", "root") and guard.turn == 2400  # one step each generation
    stat, df = chi_square(counts, exact_second_token(target, LOOKUP_PROMPT))
    assert stat < chi2_critical(df), stat


def test_engine_with_broken_rule_is_detected(small, monkeypatch):
    target, engine = small
    _broken(monkeypatch)
    stat, df = chi_square(second_token_counts(engine, 2500), exact_second_token(target))
    assert stat > chi2_critical(df), stat


def test_warping_matches_transformers():
    from transformers.generation.logits_process import (
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(1, 50, generator=g) * 3
        context = torch.randint(0, 50, (1, 12), generator=g)
        s = SamplingSettings(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.3)
        ours = warp(apply_repetition_penalty(logits[0], context[0], 1.3), s)
        ref = RepetitionPenaltyLogitsProcessor(1.3)(context, logits.clone())
        for w in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.8)):
            ref = w(context, ref)
        assert torch.equal(torch.isinf(ours), torch.isinf(ref[0]))
        finite = ~torch.isinf(ours)
        torch.testing.assert_close(ours[finite], ref[0][finite])


def test_greedy_repetition_penalty_matches_hf_generate():
    target = tiny_target(seed=2, eos=False)
    engine = Engine(target, new_heads(target))
    prompt = [1, 7, 8, 9, 7, 8]
    settings = GenerationSettings(max_new_tokens=20, sampling=SamplingSettings(repetition_penalty=1.4))
    spec = run_to_end(engine, prompt, settings)
    ref = target.model.generate(
        torch.tensor([prompt]), max_new_tokens=20, do_sample=False, repetition_penalty=1.4, pad_token_id=0
    )[0, len(prompt):].tolist()
    assert spec.token_ids == ref


# -- the same seed, the same tokens ---------------------------------------------------------


def test_sampled_speculative_tokens_equal_plain_decodings_for_the_same_seed():
    """Each emitted token is the target's one draw at its position, whatever the tree: long
    accepted paths (an oracle drafting plain decoding's own answer, corrupted at random depths)
    and the engine's heads with the lookup give plain decoding's tokens, seed for seed."""
    target = tiny_target(seed=6, eos=False, vocab=96, std=0.4)
    engine = Engine(target, new_heads(target))
    engine.drafter.guard = None  # every step drafts its tree
    oracle, taken = OracleDrafter(), 0
    for i, prompt in enumerate(random_prompts(6, seed=21, vocab=96)):
        sampling = SamplingSettings(temperature=[0.6, 1.0, 1.3][i % 3], top_p=[1.0, 0.9][i % 2], seed=i,
                                    repetition_penalty=[1.0, 1.2][i % 2])
        settings = GenerationSettings(max_new_tokens=40, sampling=sampling,
                                      tree=TreeSettings(top_k=3, total_tokens=8, depth=3, lookup_tokens=4))
        plain = run_to_end(engine, prompt, settings.with_(speculative=False))
        oracle.update(truth=plain.token_ids + [5] * 8, rng=random.Random(i), size=10, depth=1 + i % 5)
        with_oracle = run_to_end(engine, prompt, settings, drafter=oracle)
        with_heads = run_to_end(engine, prompt + prompt, settings)  # repeats itself: the lookup finds chains
        assert with_oracle.token_ids == plain.token_ids
        assert with_heads.token_ids == run_to_end(engine, prompt + prompt, settings.with_(speculative=False)).token_ids
        taken += with_oracle.stats.new_tokens - with_oracle.stats.forward_passes
    assert taken > 60, "the oracle's drafts should have been taken often"


def test_a_draw_takes_one_number_and_never_an_impossible_token():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    chooser = TokenChooser(SamplingSettings(temperature=1.0, seed=3))
    counts = torch.zeros(6)
    for _ in range(6000):
        counts[chooser.sample(probs)] += 1
    assert counts[probs == 0].sum() == 0
    stat, df = chi_square(counts[probs > 0], probs[probs > 0])
    assert stat < chi2_critical(df), (stat, counts)
    # one uniform per token, whatever the distribution: two choosers stay in step
    a, b = (TokenChooser(SamplingSettings(temperature=1.0, seed=9)) for _ in range(2))
    for spread in (0.1, 1.0, 10.0, 100.0):
        a.sample(torch.softmax(torch.randn(50) * spread, -1))
        b.sample(torch.softmax(torch.randn(50000) / spread, -1))
        assert torch.equal(a.generator.get_state(), b.generator.get_state())


@pytest.mark.parametrize("top_p", [0.3, 0.8, 0.95, 0.999])
def test_top_p_keeps_what_transformers_keeps_on_a_large_vocabulary(top_p):
    """Peaked and flat distributions over 20000 tokens: the kept set is found among the most
    likely few or after growing the candidates several times, and is the one transformers
    keeps but at a token where the mass of the more likely ones is within float32 rounding
    of top_p (transformers adds 20000 float32 numbers up)."""
    from transformers.generation.logits_process import TopPLogitsWarper

    g = torch.Generator().manual_seed(int(top_p * 1000))
    for spread in (0.05, 0.5, 2.0, 8.0):
        logits = torch.randn(20000, generator=g) * spread
        ours = torch.isinf(warp(logits, SamplingSettings(temperature=1.0, top_p=top_p)))
        ref = torch.isinf(TopPLogitsWarper(top_p)(None, logits[None].clone())[0])
        probs = logits.double().softmax(-1)
        above = {int(t): float(probs[probs > probs[t]].sum()) for t in torch.nonzero(ours != ref)}
        assert all(abs(mass - top_p) < 1e-5 for mass in above.values()), (spread, above)
        assert len(above) <= 2


def test_first_argmax_is_torch_argmax_on_ties_nan_and_every_dtype():
    """Greedy decoding's choice (NumPy's argmax on a CPU, sampling.first_argmax) is torch.argmax's:
    the first of tied maxima, the first NaN, per row and for one row."""
    from gumiho_core.sampling import first_argmax

    logits = torch.randn(6, 49152, generator=torch.Generator().manual_seed(0))
    logits[1, 5] = logits[1, 40000] = 50.0  # a tie: the first wins
    logits[2, 300] = logits[2, 20] = float("nan")
    logits[3, 7] = float("inf")
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        rows = logits.to(dtype)
        assert first_argmax(rows) == rows.argmax(-1).tolist()
        assert [first_argmax(row) for row in rows] == [int(row.argmax()) for row in rows]
