"""The stream a generation yields: what a UI renders, what tests read.

A generation yields `StepEvent`s (one per target forward pass) and ends with one
`DoneEvent`. Everything is a plain dataclass that `asdict` turns into JSON.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

# Where a token came from: accepted from the serial head, from an MLP head, from a Full
# Tree Attention supplement, copied from the context (context_lookup.py), or the target's
# own (bonus) token.
ORIGINS = ("serial", "mlp", "fta", "lookup", "target")


@dataclass
class TokenPiece:
    id: int
    text: str  # this token's share of the decoded text (may be "" mid-character)
    origin: str  # one of ORIGINS
    depth: int  # draft depth (1 = first draft token); 0 for the target's own token


@dataclass
class StepEvent:
    tokens: list[TokenPiece]  # accepted drafts in order, then the target's token
    rejected: list[TokenPiece]  # draft candidates refused where the accepted path stopped
    tree_size: int  # nodes verified in this pass (0 for prefill)
    draft_ms: float
    verify_ms: float
    kind: str = "step"

    @property
    def text(self) -> str:
        return "".join(t.text for t in self.tokens)


@dataclass
class GenerationStats:
    speculative: bool
    prompt_tokens: int
    reused_prompt_tokens: int = 0  # prompt tokens whose KV cache came from the previous turn
    new_tokens: int = 0
    forward_passes: int = 0  # target passes, prefill included
    ttft_s: float = 0.0  # time to first token
    total_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    accepted_at_depth: list[int] = field(default_factory=list)  # steps whose path reached depth d+1
    offered_at_depth: list[int] = field(default_factory=list)  # steps that reached depth d with a child to try
    tree: dict = field(default_factory=dict)

    @property
    def tau(self) -> float:
        """Tokens per target forward pass (plain decoding: 1.0)."""
        return self.new_tokens / self.forward_passes if self.forward_passes else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def acceptance_per_depth(self) -> list[float]:
        """P(draft at depth d accepted | the path reached depth d-1 and a candidate was there)."""
        return [a / o if o else 0.0 for a, o in zip(self.accepted_at_depth, self.offered_at_depth)]

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(tau=self.tau, tokens_per_s=self.tokens_per_s, acceptance_per_depth=self.acceptance_per_depth)
        return d


@dataclass
class DoneEvent:
    text: str
    token_ids: list[int]  # new tokens only (an EOS that ended the answer included)
    finish_reason: str  # "eos", "length", "stop", "context" or "cancelled"
    stats: GenerationStats
    kind: str = "done"

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(),
        }
