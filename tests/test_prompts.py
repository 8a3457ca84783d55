"""The built-in prompt generator of `train-data`: varied, distinct, reproducible, never the benchmark."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from gumiho_core import prompts
from gumiho_core.train_data import read_prompt_file

BENCH = Path(__file__).resolve().parents[2] / "shared" / "bench"


def test_prompts_are_distinct_and_reproducible():
    a = prompts.builtin_prompts(3000, seed=0)
    assert len(a) == 3000 and len({tuple(p) for p in a}) == 3000
    assert a == prompts.builtin_prompts(3000, seed=0)
    assert a[:100] != prompts.builtin_prompts(100, seed=1)
    assert prompts.builtin_prompts(50, seed=0) == a[:50]  # a longer list extends a shorter one


def test_every_category_is_asked():
    # One prompt of each category per cycle: the first len(MAKERS) prompts come one from each.
    first = prompts.builtin_prompts(len(prompts.MAKERS), seed=4)
    assert all(turns and all(isinstance(t, str) and t.strip() for t in turns) for turns in first)
    assert len(first[-1]) == 2  # the last category is the multi-turn one: a question and a follow-up
    words = " ".join(t for turns in prompts.builtin_prompts(600, seed=4) for t in turns)
    for marker in ["Pretend you are", "Solve for x", "def ", "as JSON", "Explain", "Summarize", "essay"]:
        assert marker in words, marker


@pytest.mark.skipif(not BENCH.is_dir(), reason="benchmark files not present")
def test_no_benchmark_question_is_generated():
    bench = {json.loads(line)["turns"][0] for f in BENCH.glob("*.jsonl") for line in f.read_text().splitlines()
             if line.strip()}
    generated = {t for turns in prompts.builtin_prompts(3000) for t in turns}
    assert not bench & generated


@pytest.mark.skipif(not BENCH.is_dir(), reason="benchmark files not present")
def test_benchmark_files_are_refused_as_training_prompts():
    from gumiho_core.errors import GumihoError

    with pytest.raises(GumihoError, match="benchmark"):
        read_prompt_file(BENCH / "mt_bench.jsonl")
