"""The llama.cpp method of the benchmark: the same GGUF, the same prompt ids, reported beside ours.

Most of these run without llama-cpp-python (a stand-in peer); the ones that need the real
package skip where it is not installed (`pip install -e '.[peers]'`), so CI never needs it.
"""
from __future__ import annotations

import importlib.util

import pytest

from gumiho_core import Engine, GenerationSettings, SamplingSettings, new_heads
from gumiho_core import benchmark as bm
from gumiho_core import peers
from gumiho_core.errors import GumihoError
from tiny import tiny_target


def test_agreement_counts_identical_answers_and_where_others_part():
    ours = [[1, 2, 3], [1, 2, 3], [4, 5], [7, 8, 9]]
    theirs = [[1, 2, 3], [1, 9, 3], [4, 5, 6], [7, 8, 9]]
    result = peers.agreement(ours, theirs)
    assert result["identical_share"] == 0.5
    assert result["first_divergence"] == [None, 1, 2, None]  # [4, 5] ended where the other went on


class StandInPeer:
    """Answers every prompt with its last tokens reversed: never what our engine says."""

    calls: list = []

    def __init__(self, gguf, threads, context):
        StandInPeer.calls.append((gguf, threads, context))

    def run(self, prompt_ids, settings, eos_ids):
        return list(reversed(prompt_ids))[: settings.max_new_tokens], 0.01


def test_peer_is_reported_beside_ours_and_not_counted_as_a_mismatch(monkeypatch):
    monkeypatch.setattr(bm, "LlamaCppPeer", StandInPeer)
    target = tiny_target(seed=0, eos=False)
    engine = Engine(target, new_heads(target))
    report = bm.benchmark(engine, {"t": ["w5 w6 w7", "w9 w10"]}, GenerationSettings(max_new_tokens=6),
                          methods=("plain", "gumiho", peers.METHOD), log=lambda s: None, gguf="model.gguf")
    bench = report["benchmarks"]["t"]
    assert bench["mismatches"] == []  # its answers differ from ours, yet our lossless check holds
    assert bench["llama_cpp_agreement"]["identical_share"] == 0.0
    assert bench["llama_cpp_agreement"]["first_divergence"] == [0, 0]
    peer, plain = bench["methods"][peers.METHOD], bench["methods"]["plain"]
    assert peer["speedup_vs_llama_cpp"] == 1.0
    assert plain["speedup_vs_llama_cpp"] == pytest.approx(plain["tokens_per_s_median"] / peer["tokens_per_s_median"])
    gguf, threads, context = StandInPeer.calls[-1]
    assert gguf == "model.gguf" and threads >= 1 and context > 6  # the longest prompt and its answer fit
    table = bm.format_table(report)
    assert "x llama.cpp)" in table and "llama.cpp's answers equal ours in 0% of prompts" in table
    assert "outputs identical" in table


def test_sampled_runs_say_the_peer_is_not_compared(monkeypatch):
    monkeypatch.setattr(bm, "LlamaCppPeer", StandInPeer)
    target = tiny_target(seed=0, eos=False)
    engine = Engine(target, new_heads(target))
    settings = GenerationSettings(max_new_tokens=4, sampling=SamplingSettings(temperature=1.0, seed=0))
    report = bm.benchmark(engine, {"t": ["w5 w6"]}, settings, methods=("plain", peers.METHOD),
                          log=lambda s: None, gguf="model.gguf")
    assert "llama_cpp_agreement" not in report["benchmarks"]["t"]
    assert "its outputs are not compared" in bm.format_table(report)


def test_only_a_gguf_model_has_a_peer(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(peers.importlib.util, "find_spec", lambda name, *a: object() if name == "llama_cpp" else real(name, *a))
    folder = tmp_path / "hf-model"
    folder.mkdir()
    with pytest.raises(GumihoError, match=r"needs a \.gguf model: the default model or --model FILE\.gguf"):
        peers.peer_gguf(str(folder))
    weights = tmp_path / "m.gguf"
    weights.write_bytes(b"GGUF")
    assert peers.peer_gguf(str(weights)) == weights


def test_missing_package_is_one_clear_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(peers.importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    with pytest.raises(GumihoError, match=r"needs llama-cpp-python: pip install -e '\.\[peers\]'"):
        peers.peer_gguf(None)


@pytest.mark.slow
def test_llama_cpp_reads_our_prompt_ids_on_the_default_gguf():
    pytest.importorskip("llama_cpp")
    gguf = peers.peer_gguf(None)
    peer = peers.LlamaCppPeer(gguf, threads=2, context=256)
    prompt = peer.llm.tokenize(b"<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
                               add_bos=False, special=True)
    settings = GenerationSettings(max_new_tokens=12)
    first, seconds = peer.run(prompt, settings, eos_ids={peer.llm.token_eos()})
    again, _ = peer.run(prompt, settings, eos_ids={peer.llm.token_eos()})
    assert 0 < len(first) <= 12 and seconds > 0
    assert again == first  # greedy, and the second run did not continue from the first one's cache
    eos_at_first = peer.run(prompt, settings, eos_ids={first[0]})[0]
    assert eos_at_first == first[:1]  # the EOS rule: its token is emitted, then it stops
