"""The benchmark runs every method side by side and checks their outputs agree."""
from __future__ import annotations

import json

import pytest

from gumiho_core import Engine, GenerationSettings, SamplingSettings, new_heads
from gumiho_core.benchmark import METHODS, benchmark, format_table, read_prompts
from gumiho_core.errors import GumihoError
from tiny import tiny_target


def test_benchmark_report_on_a_tiny_target():
    target = tiny_target(seed=0, eos=False)
    engine = Engine(target, new_heads(target))
    prompts = {"tiny": ["w5 w6 w7", "w9 w10 w11 w12", "w40 w3"]}
    ours = tuple(m for m in METHODS if m != "llama.cpp")  # the peer needs a GGUF file: test_peers.py
    report = benchmark(engine, prompts, GenerationSettings(max_new_tokens=12), methods=ours, log=lambda s: None)
    bench = report["benchmarks"]["tiny"]
    assert bench["mismatches"] == [] and bench["prompts"] == 3
    for method in ("plain", "gumiho", "gumiho-heads", "gumiho-always", "hf", "hf-pld"):
        entry = bench["methods"][method]
        assert entry["tokens_per_s_median"] > 0 and entry["new_tokens"] == 36
        assert entry["peak_memory_mb"] > 0
        assert [r["new_tokens"] for r in entry["per_prompt"]] == [12, 12, 12]
    gumiho = bench["methods"]["gumiho"]
    assert sum(r["new_tokens"] for r in gumiho["per_prompt"]) / sum(
        r["forward_passes"] for r in gumiho["per_prompt"]) == pytest.approx(gumiho["tau"])
    assert bench["methods"]["hf"]["per_prompt"][0]["forward_passes"] is None
    assert bench["methods"]["plain"]["speedup_vs_plain"] == bench["methods"]["plain"]["speedup_vs_plain_paired"] == 1.0
    assert bench["methods"]["plain"]["tau"] == 1.0
    table = format_table(report)
    assert "| gumiho |" in table and "| gumiho-heads |" in table and "outputs identical" in table
    assert "tiny gumiho-heads: d1" in table  # acceptance per depth, for both engine methods
    json.dumps(report)


def test_mismatch_is_reported_loudly(monkeypatch):
    from gumiho_core import benchmark as bm

    target = tiny_target(seed=0, eos=False)
    engine = Engine(target, new_heads(target))
    real = bm._run_hf

    def wrong(*a, **k):
        run = real(*a, **k)
        run.tokens[-1] = (run.tokens[-1] + 1) % 90
        return run

    monkeypatch.setattr(bm, "_run_hf", wrong)
    logs = []
    report = benchmark(engine, {"t": ["w5 w6"]}, GenerationSettings(max_new_tokens=6), log=logs.append)
    assert report["benchmarks"]["t"]["mismatches"]
    assert any("MISMATCH" in line for line in logs)
    assert "OUTPUT MISMATCHES" in format_table(report)


def test_sampled_answers_of_the_engines_methods_are_compared_seed_for_seed(monkeypatch):
    """Under sampling with a seed every engine method draws plain decoding's tokens (one draw
    per token: verify.accept), so they are compared as under greedy; transformers' `generate`
    draws from a generator of its own and is left out."""
    from gumiho_core import benchmark as bm

    target = tiny_target(seed=0, eos=False)
    engine = Engine(target, new_heads(target))
    settings = GenerationSettings(max_new_tokens=12, sampling=SamplingSettings(temperature=0.9, seed=4))
    methods = ("plain", "gumiho", "gumiho-always", "hf")
    report = benchmark(engine, {"t": ["w5 w6 w7", "w9 w10"]}, settings, methods=methods, log=lambda s: None)
    assert report["benchmarks"]["t"]["mismatches"] == []
    assert "outputs identical across the engine's methods" in format_table(report)
    real = bm.run_method

    def wrong(method, *a, **k):
        run = real(method, *a, **k)
        if method == "gumiho-always":
            run.tokens[-1] = (run.tokens[-1] + 1) % 90
        return run

    monkeypatch.setattr(bm, "run_method", wrong)
    report = benchmark(engine, {"t": ["w5 w6 w7"]}, settings, methods=methods, log=lambda s: None)
    assert report["benchmarks"]["t"]["mismatches"] == [{"prompt": 0, "method": "gumiho-always"}]
    assert "OUTPUT MISMATCHES" in format_table(report)


def test_each_prompt_is_also_compared_with_plain_on_the_same_prompt():
    """The ratio of medians mixes prompts of different speeds; the paired ratio does not."""
    from gumiho_core.benchmark import Run, summarise

    def runs(rates):
        return [Run(tokens=[0] * 10, seconds=10 / rate) for rate in rates]

    report = summarise({"plain": runs([10, 20, 100]), "gumiho": runs([20, 21, 110])}, {"plain": 0, "gumiho": 0}, [])
    gumiho = report["methods"]["gumiho"]
    assert gumiho["speedup_vs_plain"] == pytest.approx(21 / 20)
    assert gumiho["speedup_vs_plain_paired"] == pytest.approx(1.1)  # of 2.0, 1.05 and 1.1


def test_prompt_files(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"turns": ["a", "b"]}\n{"turns": ["c"]}\n')
    assert read_prompts(f) == ["a", "c"] and read_prompts(f, 1) == ["a"]
    f.write_text("not json\n")
    with pytest.raises(GumihoError, match="p.jsonl:1"):
        read_prompts(f)


def test_peak_memory_is_per_block_and_needs_no_sampler():
    from gumiho_core.benchmark import PeakRSS

    import mmap
    import time

    with PeakRSS() as big:
        # Fresh anonymous pages, written so they are resident, and returned to the kernel on
        # close: a bytearray may instead reuse heap memory that earlier tests left resident,
        # which raises no mark at all.
        buffer = mmap.mmap(-1, 200 * 2**20)
        for start in range(0, len(buffer), 2**20):
            buffer[start : start + 2**20] = b"x" * 2**20
        time.sleep(0.3)  # long enough for the 100 ms sampler, where the kernel's mark is not available
        buffer.close()
    with PeakRSS() as small:
        pass
    assert big.peak - small.peak > 150 * 2**20  # the second block's peak was reset, not the process's
    try:
        PeakRSS.CLEAR.write_text("5")
    except OSError:
        return  # no resettable high-water mark here (not Linux, or not allowed): the sampler was used
    assert big._thread is None  # Linux: the kernel's high-water mark, nothing runs beside the code


def test_sampled_run_reports_the_draft_guard_beside_always_drafting():
    target = tiny_target(seed=0, eos=False)
    engine = Engine(target, new_heads(target))
    settings = GenerationSettings(max_new_tokens=24, sampling=SamplingSettings(temperature=1.0, seed=0))
    report = benchmark(engine, {"t": ["w5 w6 w7", "w9 w10"]}, settings, methods=("plain", "gumiho", "gumiho-always"),
                       log=lambda s: None)
    guarded = report["draft_guard"]  # these sampling settings and tree, per kind of step met
    assert guarded and all(entry["key"].startswith("temperature 1.0") for entry in guarded)
    assert all(sum(m["steps"] for m in entry["modes"].values()) > 0 for entry in guarded)
    assert report["benchmarks"]["t"]["methods"]["gumiho-always"]["new_tokens"] == 48  # its own drafter, no guard
    assert "draft guard, temperature 1.0" in format_table(report)
