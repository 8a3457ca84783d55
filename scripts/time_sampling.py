"""Median microseconds to choose one sampled token over the default model's 49152-token vocabulary.

    python scripts/time_sampling.py

The engine's TokenChooser (sampling.py: one uniform number inverting the cumulative sum, and
top-p sorting only the most likely tokens) beside what it replaced: torch.multinomial and a
sort of the whole vocabulary (transformers' TopPLogitsWarper). On the default model's own
logits at every position of two sampled answers, and on random logits as flat as a
distribution gets (the top-p path's worst case); docs/benchmarks.md quotes the figures.
"""
import statistics
import time

import torch

from gumiho_core.generate import run_to_end
from gumiho_core.loading import load_engine
from gumiho_core.sampling import TokenChooser
from gumiho_core.settings import GenerationSettings, SamplingSettings

VOCAB = 49152


def median_us(choose, logits_list, repeats: int = 200) -> float:
    times = []
    for i in range(repeats):
        logits = logits_list[i % len(logits_list)]
        start = time.perf_counter()
        choose(logits)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def replaced(settings: SamplingSettings, generator: torch.Generator):
    """torch.multinomial after transformers' own temperature and top-p warpers."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    warpers = [TemperatureLogitsWarper(settings.temperature)]
    if settings.top_p < 1.0:
        warpers.append(TopPLogitsWarper(settings.top_p))

    def choose(logits):
        scores = logits[None].clone()
        for warp in warpers:
            scores = warp(None, scores)
        return int(torch.multinomial(scores.softmax(-1)[0], 1, generator=generator))

    return choose


def model_logits() -> list[torch.Tensor]:
    """The default model's logits at every position of two answers sampled at temperature 0.7."""
    engine, _ = load_engine()
    seen, real_choose = [], TokenChooser.choose

    def choose_and_keep(self, logits, context):
        seen.append(logits.clone())
        return real_choose(self, logits, context)

    TokenChooser.choose = choose_and_keep
    try:
        for question in ("Write a short story about a lighthouse keeper.", "Explain how a hash table works."):
            ids = engine.target.chat_prompt([{"role": "user", "content": question}])
            settings = GenerationSettings(max_new_tokens=128, speculative=False,
                                          sampling=SamplingSettings(temperature=0.7, seed=0))
            run_to_end(engine, ids, settings)
    finally:
        TokenChooser.choose = real_choose
    return seen


def main() -> None:
    g = torch.Generator().manual_seed(0)
    cases = {"the model's logits": model_logits(), "flat random logits": [torch.randn(VOCAB, generator=g)]}
    print(f"{'logits':20s} {'settings':28s} {'engine (us)':>12s} {'multinomial + sort (us)':>24s}")
    for name, logits_list in cases.items():
        for settings in (SamplingSettings(temperature=1.0, seed=0), SamplingSettings(temperature=0.7, top_p=0.95, seed=0)):
            chooser = TokenChooser(settings)
            context = torch.zeros(0, dtype=torch.long)
            ours = median_us(lambda logits: chooser.choose(logits, context), logits_list)
            theirs = median_us(replaced(settings, torch.Generator().manual_seed(0)), logits_list)
            label = f"temperature {settings.temperature}, top_p {settings.top_p}"
            print(f"{name:20s} {label:28s} {ours:12.0f} {theirs:24.0f}")


if __name__ == "__main__":
    main()
