"""Turning target logits into the next token, by Hugging Face `generate`'s rules.

Order as in transformers: repetition penalty, then temperature, top-k, top-p. The draw
itself is the engine's own: one uniform number from a seeded generator per token.
The penalty depends on the context, and in a tree each node has its own context (the
conversation plus its ancestors), so callers pass that context per node.
"""
from __future__ import annotations

import torch

from .settings import SamplingSettings


def apply_repetition_penalty(logits: torch.Tensor, context: torch.Tensor, penalty: float) -> torch.Tensor:
    if penalty == 1.0 or context.numel() == 0:
        return logits
    logits = logits.clone()
    picked = logits.gather(-1, context)
    picked = torch.where(picked < 0, picked * penalty, picked / penalty)
    return logits.scatter(-1, context, picked)


def warp(logits: torch.Tensor, s: SamplingSettings) -> torch.Tensor:
    """Temperature, top-k and top-p on (V,) logits; filtered entries become -inf."""
    logits = logits.float() / s.temperature
    if s.top_k > 0:
        kth = torch.topk(logits, min(s.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1.0:
        logits = logits.masked_fill(~_nucleus(logits, s.top_p), float("-inf"))
    return logits


def _nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """(V,) bool: the tokens top-p keeps, as transformers' TopPLogitsWarper chooses them.

    The rule: a token is dropped where the probability of it and all less likely ones is at
    most 1 - top_p; the most likely token always stays. transformers sorts the whole
    vocabulary for it (~5 ms for SmolLM2's 49152 on this CPU, half a decoding pass), but the
    kept tokens are only the most likely ones: the largest k are taken (k = 64, 512, 4096
    until they hold top_p of the mass) and only they are sorted. A flatter distribution is
    sorted whole, after tries that cost up to ~25% over one sort; the default model's own logits
    never needed that at temperature 0.7-1.3, top_p 0.95 (docs/benchmarks.md). The sum of a token and the less likely ones is taken here as 1 minus
    the mass of the more likely ones, added up in float64 (transformers adds the other way, in
    float32): the kept set can differ only at a token where that sum lies within float32
    rounding of 1 - top_p (~1e-6 at top_p 0.999 over ~17000 kept tokens).
    """
    probs = logits.softmax(-1)
    vocab = probs.shape[-1]
    k = 64
    while True:
        if 8 * k > vocab:  # a flat distribution: sorting everything costs no more than a larger k
            k = vocab
        top, order = torch.topk(probs, k) if k < vocab else torch.sort(probs, descending=True)
        above = top.double().cumsum(-1) - top  # the mass of the more likely ones
        kept = 1 - above > 1 - top_p
        if k == vocab or not kept[-1]:  # the k-th token is dropped, and so is every one after it
            break
        k *= 8
    kept[0] = True
    keep = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
    keep[order[kept]] = True
    return keep


def first_argmax(logits: torch.Tensor) -> list[int] | int:
    """Each row's argmax (the first maximum, as torch.argmax), a list for (N, V) logits, an
    int for (V,). On a CPU through NumPy: torch's argmax over the default model's 49152 logits
    took 137 us warm, NumPy's 10 (and ~190 against ~60 us right after a pass, in the loop)."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64) and not logits.requires_grad:
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


class TokenChooser:
    """The target's decision rule at one position: argmax (greedy) or a distribution."""

    def __init__(self, settings: SamplingSettings, device="cpu"):
        self.settings = settings
        self.generator = None
        if not settings.greedy:
            self.generator = torch.Generator(device=device)
            if settings.seed is not None:
                self.generator.manual_seed(settings.seed)
            else:
                self.generator.seed()

    def processed(self, logits: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return apply_repetition_penalty(logits, context, self.settings.repetition_penalty)

    def greedy_token(self, logits: torch.Tensor, context: torch.Tensor) -> int:
        return first_argmax(self.processed(logits, context))

    def probs(self, logits: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return torch.softmax(warp(self.processed(logits, context), self.settings), dim=-1)

    def sample(self, probs: torch.Tensor) -> int:
        """One token drawn from `probs` by inverting its cumulative sum at one uniform draw.

        Exactly one draw per token, whatever the probabilities, so a speculative step that
        emits n tokens takes the generator as far as n plain steps do (verify.accept). And
        cheap: torch.multinomial took 1.4 ms over SmolLM2's 49152 tokens on this CPU (it
        draws one number per token), an eighth of a decoding pass; this takes ~0.1 ms.
        """
        cumulative = probs.double().cumsum(-1)
        u = torch.rand((), generator=self.generator, dtype=torch.float64, device=probs.device)
        # The first token whose cumulative sum passes u * total: never one of probability 0.
        token = int(torch.searchsorted(cumulative, u * cumulative[-1], right=True))
        if token == len(cumulative):  # u * total rounded up to the total: the last possible token
            token = int(probs.nonzero()[-1])
        return token

    def choose(self, logits: torch.Tensor, context: torch.Tensor) -> int:
        if self.settings.greedy:
            return self.greedy_token(logits, context)
        return self.sample(self.probs(logits, context))
