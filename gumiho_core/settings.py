"""Every knob of a generation, in one place, with the defaults chosen for this hardware.

`TreeSettings` shapes the draft tree; `SamplingSettings` says how the target's next
token is chosen; `GenerationSettings` bundles them with the stopping rules. All are
plain dataclasses so the CLI, the UI, the benchmark and the tests share one source.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from .errors import GumihoError


@dataclass(frozen=True)
class TreeSettings:
    """The dynamic draft tree (EAGLE-2 style, with Gumiho's parallel MLP depths).

    Defaults fit the CPU default model: they are the tree the measured budget
    (tree_budget.py, `--auto-tree`) chose on this project's 2-core machine, where a target
    pass over 6 tokens costs ~1.3x a one-token pass, over 16 tokens ~1.8x, and the serial
    head's first two depths are accepted far more often than deeper guesses pay for. So
    the MLP heads join when `depth` goes past 2 and FTA when turned on (e.g. on a GPU,
    where the paper uses top_k 10, total_tokens 60, mlp_topk 35, pruning 35, FTA:
    `TreeSettings.gpu()`).
    """

    top_k: int = 6  # beams kept at each serial depth, and children per beam
    total_tokens: int = 6  # tree nodes verified in one target pass, root included
    depth: int = 2  # deepest draft token: serial depths first, then one MLP head per depth
    mlp_topk: int = 6  # candidates per node at each MLP depth
    pruning: int = 12  # nodes kept at each MLP depth, by cumulative log-probability
    fta: bool = False  # Full Tree Attention: extend short paths with tokens from longer ones
    fta_tokens: int = 0  # at most this many of total_tokens are spent on FTA supplements
    # Context lookup (context_lookup.py): up to this many tokens that followed the last
    # occurrence of the context's tail join the tree as one more branch, beyond
    # total_tokens (more while the answer repeats the context); 0 turns it off.
    lookup_tokens: int = 8

    @classmethod
    def gpu(cls) -> "TreeSettings":
        return cls(top_k=10, total_tokens=60, depth=7, mlp_topk=35, pruning=35, fta=True, fta_tokens=4)

    def validate(self) -> None:
        checks = [
            (self.top_k >= 1, "top_k must be at least 1"),
            (self.total_tokens >= 2, "total_tokens must be at least 2 (the root and one draft)"),
            (self.depth >= 1, "depth must be at least 1"),
            (self.mlp_topk >= 1, "mlp_topk must be at least 1"),
            (self.pruning >= 1, "pruning must be at least 1"),
            (0 <= self.fta_tokens < self.total_tokens - 1, "fta_tokens must be in [0, total_tokens - 1)"),
            (self.lookup_tokens >= 0, "lookup_tokens must be at least 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise GumihoError(f"invalid tree setting: {message}")


@dataclass(frozen=True)
class SamplingSettings:
    """How the target's token is chosen. temperature 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filter
    repetition_penalty: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        if not self.temperature >= 0:
            raise GumihoError(f"temperature must be >= 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise GumihoError(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            raise GumihoError(f"top_k must be >= 0 (got {self.top_k})")
        if not self.repetition_penalty > 0:
            raise GumihoError(f"repetition_penalty must be > 0 (got {self.repetition_penalty})")


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 256
    speculative: bool = True
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    tree: TreeSettings = field(default_factory=TreeSettings)
    stop_strings: tuple[str, ...] = ()
    # What to do when prompt + max_new_tokens exceeds the target's context:
    # "error" refuses with a clear message, "truncate" drops the oldest prompt tokens.
    on_overflow: str = "error"

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise GumihoError(f"max_new_tokens must be at least 1 (got {self.max_new_tokens})")
        if self.on_overflow not in ("error", "truncate"):
            raise GumihoError(f"on_overflow must be 'error' or 'truncate' (got {self.on_overflow!r})")
        self.sampling.validate()
        self.tree.validate()

    def with_(self, **changes) -> "GenerationSettings":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)
