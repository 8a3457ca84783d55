"""Drafting by looking back: the tokens that followed the last time the context's tail appeared.

Chat answers repeat their own words and the prompt's: names, code identifiers, list
structure, whole sentences when a small model loops. Where the last few tokens (the
n-gram ending with the root) occurred before, the tokens that followed them then are a
free guess for what follows now (prompt lookup decoding, Saxena 2023; transformers'
`prompt_lookup_num_tokens`). The Gumiho drafter (drafter.py) adds that guess to its tree
as one more branch (draft_tree.add_chain), so the target verifies heads' guesses and
looked-up ones in the same pass, and output stays exactly the target's.

Measured on this project's bench answers (SmolLM2-135M greedy, 256 tokens; the analysis
that chose the defaults is in docs/benchmarks.md): a match of 2-3 tokens is found at 23 % of the
steps on mt_bench and then 3.9 tokens are accepted on average; a 1-token match is found at
57 % but buys ~1 token. 1-token matches are still tried, because `LookupLength` shortens
the chain after refusals, so a poor guess costs few tree rows (mt_bench, 10 prompts: tau
2.76 -> 2.82 at the same verification cost). In int4 (scripts/measure_lookup.py: every
position of 20 greedy answers per file, a chain of 4) 3-token matches came at 47-57 % of
positions with 2.3-3.3 tokens accepted, 1-token ones with 0.3-0.8: `look_up` says the
match, so where rows are dear the draft guard judges each kind of chain by its own record.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Chain:
    """Looked-up tokens, and how many context tokens their source matched (0: none found)."""

    tokens: list[int]
    match: int


def look_up(context: torch.Tensor, length: int, max_ngram: int = 3, min_ngram: int = 1) -> Chain:
    """Up to `length` tokens that followed the latest earlier occurrence of the context's tail.

    The longest tail (max_ngram tokens, down to min_ngram) that occurred before wins; among
    its occurrences the latest, since a loop or a list repeats its most recent form.
    """
    context = context.flatten()
    n_ctx = context.shape[0]
    for n in range(max_ngram, min_ngram - 1, -1):
        if n_ctx <= n:
            continue
        tail = context[-n:]
        # Windows starting at 0 .. n_ctx - n - 1: every occurrence but the tail itself.
        windows = context[:-1].unfold(0, n, 1)
        hits = (windows == tail).all(dim=1).nonzero()
        if len(hits):
            start = int(hits[-1]) + n
            return Chain(context[start : start + length].tolist(), n)
    return Chain([], 0)


class ContextIndex:
    """look_up's answers for a context that only grows, without rescanning it: the latest end
    of every 1..max_ngram-token run, kept as tokens arrive.

    The drafter looks up at every step, the root-alone ones too (the match names the kind of
    step for the draft guard); look_up's scan of the whole context cost 0.2-0.5 ms a step at
    chat lengths, 3-4 % of a one-token pass. Runs ending at the last token are indexed only
    when the next token comes, so the tail never finds itself.
    """

    def __init__(self, max_ngram: int = 3):
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self.latest: dict[tuple[int, ...], int] = {}  # run -> index of its last token

    def reset(self, tokens: list[int]) -> None:
        self.tokens, self.latest = [], {}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            end = len(self.tokens) - 1  # the runs ending at the current last token join now
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                self.latest[tuple(self.tokens[end - n + 1 : end + 1])] = end
            self.tokens.append(token)

    def follow(self, context: torch.Tensor) -> None:
        """Catch up with `context`: the tokens so far and more, as within a generation (checked
        at the last known token only: a wrong guess could only cost speed); else afresh."""
        known = len(self.tokens)
        if 0 < known <= len(context) and int(context[known - 1]) == self.tokens[-1]:
            self.extend(context[known:].tolist())
        else:
            self.reset(context.tolist())

    def look_up(self, length: int, min_ngram: int = 1) -> Chain:
        """As look_up(context, length, self.max_ngram, min_ngram) on the tokens so far."""
        tokens = self.tokens
        for n in range(self.max_ngram, min_ngram - 1, -1):
            if len(tokens) <= n:
                continue
            end = self.latest.get(tuple(tokens[-n:]))
            if end is not None:
                return Chain(tokens[end + 1 : end + 1 + length], n)
        return Chain([], 0)


class LookupLength:
    """How many tokens to look up this step, from how the last chain fared.

    - accepted whole: double, up to `base * MAX_GROWTH`. The answer is most likely
      repeating a stretch of the context (a list's pattern, code, a small model's loop) and
      the next stretch will repeat too: a longer chain costs a few more tree rows and
      saves whole target passes;
    - refused at its first token: halve, down to MIN_TOKENS. Such chains mostly cost rows
      (with sampling, far more chains are refused than under greedy decoding);
    - partly accepted: back to `base`.
    """

    MAX_GROWTH = 4
    MIN_TOKENS = 2

    def __init__(self, base: int):
        self.base = self.tokens = base

    @property
    def repeating(self) -> bool:
        """The last looked-up chain was accepted whole."""
        return self.tokens > self.base

    def update(self, accepted: int, offered: int) -> None:
        if accepted == offered:
            self.tokens = min(2 * self.tokens, self.base * self.MAX_GROWTH)
        elif accepted == 0:
            self.tokens = min(self.base, max(self.MIN_TOKENS, self.tokens // 2))
        else:
            self.tokens = self.base
