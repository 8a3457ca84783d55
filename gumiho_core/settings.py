"""Every knob of a generation, in one place, with the defaults chosen for this hardware.

`TreeSettings` shapes the draft tree; `SamplingSettings` says how the target's next
token is chosen; `GenerationSettings` bundles them with the stopping rules. All are
frozen dataclasses that check themselves when built, so a setting the engine would refuse
cannot exist, and every front end (CLI, UI, OpenAI route, benchmark) gets the same one-line
message for it. Values typed into a form or sent as JSON go through `settings_from_fields`,
the one converter from strings and loose numbers.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace

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
    # Under greedy decoding too, draft only as far as drafting pays lately (draft_guard.py:
    # the full tree, the looked-up chain, or the root alone). Off where the heads' trees
    # pay at greedy (the guard's probes cost a little); on where a tree row costs a large
    # share of a pass (`int4_cpu_without_amx`).
    guard_greedy: bool = False

    def __post_init__(self):
        self.validate()

    @classmethod
    def gpu(cls) -> "TreeSettings":
        return cls(top_k=10, total_tokens=60, depth=7, mlp_topk=35, pruning=35, fta=True, fta_tokens=4)

    @classmethod
    def weight_only_cpu(cls) -> "TreeSettings":
        """For int8 / int4 targets on a CPU with AMX (or PyTorch's kernels), where a pass over
        3 tokens costs 1.15x a one-token pass but 6 tokens 1.7x (SmolLM2-135M int4, 2 Intel Xeon
        cores): the tree the measured budget chose there (mt_bench 20 x 256: top_k 4, 3 nodes,
        depth 1, plus the lookup branch)."""
        return cls(top_k=4, total_tokens=3, depth=1, mlp_topk=4, pruning=8)

    @classmethod
    def int4_cpu_without_amx(cls) -> "TreeSettings":
        """For int4 targets on a CPU without AMX (groupwise_matmul.c on AVX2, or on AVX512-VNNI
        as AMD's Zen 4 has it), where each row of a pass costs 30-40% of a one-token pass
        (SmolLM2-135M, 2 AMD EPYC cores: ~3 ms a row on AVX2, ~1.5 ms on VNNI): the best draft
        token and a shorter looked-up chain, guarded under greedy decoding too. Measured
        (mt_bench 20 x 256, docs/benchmarks.md): AVX2, drafting every step 0.91x plain (tau
        2.42), guarded 0.98x; VNNI, against the AMX machine's tree (0.84x, paired 0.90x) and
        other guarded ones, interleaved: 1.15x and 1.21x (paired 1.12x, 1.13x) in two runs."""
        return cls(top_k=2, total_tokens=2, depth=1, mlp_topk=4, pruning=8, lookup_tokens=4, guard_greedy=True)

    def with_overrides(self, **given) -> "TreeSettings":
        """These settings with the values a user gave (None = not given) on top.

        The one place a tree is put together from parts: `fta_tokens` given turns FTA on
        or off with it, and a budget made smaller than the FTA share it inherited keeps
        FTA within it rather than failing on a value the user never typed.
        """
        given = {k: v for k, v in given.items() if v is not None}
        if "fta_tokens" in given and "fta" not in given:
            given["fta"] = given["fta_tokens"] > 0
        if given.get("fta") is False:
            given["fta_tokens"] = 0
        if "fta_tokens" not in given:
            total = given.get("total_tokens", self.total_tokens)
            given["fta_tokens"] = min(self.fta_tokens, max(0, whole_number("total_tokens", total) - 2))
        return replace(self, **given)

    def validate(self) -> None:
        for f in fields(self):
            if f.name not in ("fta", "guard_greedy"):
                whole_number(f.name, getattr(self, f.name))
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

    def __post_init__(self):
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        if not real_number("temperature", self.temperature) >= 0:
            raise GumihoError(f"temperature must be 0 or more (got {self.temperature})")
        if not 0 < real_number("top_p", self.top_p) <= 1:
            raise GumihoError(f"top_p must be more than 0 and at most 1 (got {self.top_p})")
        if whole_number("top-k", self.top_k) < 0:
            raise GumihoError(f"top-k must be 0 (off) or more (got {self.top_k})")
        if not real_number("repetition penalty", self.repetition_penalty) > 0:
            raise GumihoError(f"repetition penalty must be more than 0 (got {self.repetition_penalty})")
        if self.seed is not None:
            whole_number("seed", self.seed)


OVERFLOW_RULES = ("error", "truncate")


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

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        if whole_number("max new tokens", self.max_new_tokens) < 1:
            raise GumihoError(f"max new tokens must be a whole number, at least 1 (got {self.max_new_tokens})")
        if self.on_overflow not in OVERFLOW_RULES:
            raise GumihoError(f"on_overflow must be 'error' or 'truncate' (got {self.on_overflow!r})")
        if not isinstance(self.stop_strings, tuple) or not all(isinstance(s, str) and s for s in self.stop_strings):
            raise GumihoError("stop strings must be a tuple of non-empty texts")
        if not isinstance(self.sampling, SamplingSettings) or not isinstance(self.tree, TreeSettings):
            raise GumihoError("sampling and tree must be SamplingSettings and TreeSettings")

    def with_(self, **changes) -> "GenerationSettings":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)


# -- values from a form, a JSON body or a command line -----------------------------------------


def real_number(name: str, value) -> float:
    """`value` as a finite float; a GumihoError naming `name` for anything else.

    Booleans are refused although Python counts them as numbers: `"max_tokens": true`
    is a mistake, not a request for one token. Strings are read as numbers ("0.7").
    """
    if isinstance(value, bool) or value is None:
        raise GumihoError(f"{name} must be a number (got {value!r})")
    try:
        number = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError, OverflowError):
        raise GumihoError(f"{name} must be a number (got {_shown(value)})") from None
    if not math.isfinite(number):
        raise GumihoError(f"{name} must be a finite number (got {_shown(value)})")
    return number


def whole_number(name: str, value) -> int:
    """`value` as an int; whole floats (3.0, "3") pass, 2.5 / NaN / inf / True do not."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    try:
        number = real_number(name, value)
    except GumihoError:
        number = None
    if number is None or number != int(number):
        raise GumihoError(f"{name} must be a whole number (got {_shown(value)})")
    return int(number)


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def settings_from_fields(*, max_new_tokens, temperature=0.0, top_p=1.0, speculative=True, stop_strings=(),
                         tree: TreeSettings | None = None, on_overflow: str = "error") -> GenerationSettings:
    """Settings from loose values (UI boxes, JSON fields): the one converter every front end uses.

    Raises GumihoError with one line naming the field for a value that is not a number, not
    finite, not whole where it must be, or out of the engine's range.
    """
    if not isinstance(speculative, bool):
        raise GumihoError(f"speculative must be true or false (got {_shown(speculative)})")
    sampling = SamplingSettings(temperature=real_number("temperature", temperature),
                                top_p=real_number("top_p", top_p))
    return GenerationSettings(max_new_tokens=whole_number("max new tokens", max_new_tokens),
                              speculative=speculative, sampling=sampling, tree=tree or TreeSettings(),
                              stop_strings=tuple(stop_strings), on_overflow=on_overflow)
