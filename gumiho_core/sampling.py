"""Turning target logits into the next token, exactly as Hugging Face `generate` would.

Order as in transformers: repetition penalty, then temperature, top-k, top-p.
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
        sorted_logits, order = torch.sort(logits, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        remove_sorted = cumulative <= (1 - s.top_p)
        remove_sorted[-1] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


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
        return int(torch.argmax(self.processed(logits, context)))

    def probs(self, logits: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return torch.softmax(warp(self.processed(logits, context), self.settings), dim=-1)

    def uniform(self) -> float:
        return float(torch.rand((), generator=self.generator, device=self.generator.device))

    def sample(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def choose(self, logits: torch.Tensor, context: torch.Tensor) -> int:
        if self.settings.greedy:
            return self.greedy_token(logits, context)
        return self.sample(self.probs(logits, context))
