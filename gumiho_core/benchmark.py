"""Speed, measured the paper's way: methods side by side in one process, interleaved.

`python launch.py bench --prompts FILE [--prompts FILE2 ...] [--limit N] [--max-new-tokens N]
[--temperature T] [--json OUT]` runs, for each prompt (first turn, through the chat
template), every method in turn after a warm-up:
- plain:   our engine, speculative decoding off (the baseline);
- gumiho:  our engine with the heads, and the context-lookup branch (context_lookup.py);
- gumiho-heads: the same with the lookup off, so the heads' own share is visible;
- gumiho-always: gumiho with the draft guard off (draft_guard.py): under sampling it drafts
  the full tree at every step, so the guard's own effect is measured side by side;
- hf:      transformers `generate`;
- hf-pld:  transformers assisted generation with prompt lookup (a draft-free peer);
- llama.cpp: llama-cpp-python on the same GGUF file, plain decoding (peers.py; optional).
It reports per method the median tokens/s, speedup vs plain (ratio of medians) and, with
llama.cpp in the run, vs llama.cpp; tau, acceptance per depth and peak memory. It prints a
paper-style table (speedup / tau per prompt file), and under greedy decoding checks that
every method of ours produced the same tokens (llama.cpp computes with other arithmetic:
its answers are compared with ours separately, as a share of identical answers).
"""
from __future__ import annotations

import json
import statistics
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from .errors import GumihoError
from .drafter import GumihoDrafter
from .generate import Engine, run_to_end
from .peers import METHOD as PEER, LlamaCppPeer, agreement
from .settings import GenerationSettings

METHODS = ("plain", "gumiho", "gumiho-heads", "gumiho-always", "hf", "hf-pld", PEER)
ENGINE_METHODS = ("plain", "gumiho", "gumiho-heads", "gumiho-always")
DEFAULT_METHODS = ("plain", "gumiho", "hf", "hf-pld")


def read_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    path = Path(path)
    if not path.is_file():
        raise GumihoError(f"prompt file not found: {path}")
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            prompts.append(record["turns"][0] if "turns" in record else record["prompt"])
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise GumihoError(f"{path}:{n}: expected a JSON object with 'turns' or 'prompt' ({exc})") from exc
    return prompts[:limit] if limit else prompts


class PeakRSS:
    """Highest resident memory of this process while the block runs.

    On Linux the kernel keeps the high-water mark (VmHWM) and resets it on request, so
    nothing runs beside the measured code. Elsewhere a thread samples every 100 ms: waking
    every 5 ms, it slowed a plain step from 36.7 to 43.8 ms on a short check here.
    """

    STATUS, CLEAR = Path("/proc/self/status"), Path("/proc/self/clear_refs")

    def __enter__(self):
        self._thread = None
        try:
            self.CLEAR.write_text("5")  # "5": reset the peak RSS to the current RSS
            self.peak = self._kernel_peak()
        except OSError:
            import psutil

            self.process = psutil.Process()
            self.peak = self.process.memory_info().rss
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._watch, daemon=True)
            self._thread.start()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        return self

    def _kernel_peak(self) -> int:
        for line in self.STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise OSError("no VmHWM line")

    def _watch(self):
        while not self._stop.wait(0.1):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __exit__(self, *exc):
        if self._thread is None:
            self.peak = self._kernel_peak()
        else:
            self._stop.set()
            self._thread.join()
        self.gpu_peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
        return False


@dataclass
class Run:
    tokens: list[int]
    seconds: float
    forward_passes: int | None = None
    stats: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


def run_method(method: str, engine: Engine, prompt_ids: list[int], settings: GenerationSettings,
               extras: dict | None = None) -> Run:
    """One answer by `method`. extras: what a method needs besides the engine, made once
    (method_extras): the llama.cpp model, the drafter without a guard."""
    extras = extras or {}
    if method == PEER:
        return Run(*extras[PEER].run(prompt_ids, settings, engine.target.eos_token_ids))
    if method in ENGINE_METHODS:
        if method == "gumiho-heads":
            settings = settings.with_(tree=replace(settings.tree, lookup_tokens=0))
        # Every method pays for its own prefill: no KV cache carried over from the method
        # that ran the same prompt just before.
        drafter = extras.get(method)  # gumiho-always: the drafter without a guard
        done = run_to_end(engine, prompt_ids, settings.with_(speculative=method != "plain"), reuse_prefix=False,
                          drafter=drafter)
        s = done.stats
        return Run(done.token_ids, s.total_s, s.forward_passes, s.to_dict())
    return _run_hf(engine.target, prompt_ids, settings, prompt_lookup=method == "hf-pld")


def method_extras(engine: Engine, methods, encoded: dict, settings: GenerationSettings, gguf) -> dict:
    """What the methods need besides the engine, made once for the whole run."""
    extras = {}
    if PEER in methods:
        longest = max(len(ids) for prompts in encoded.values() for ids in prompts)
        extras[PEER] = LlamaCppPeer(gguf, torch.get_num_threads(), longest + settings.max_new_tokens + 8)
    if "gumiho-always" in methods:
        extras["gumiho-always"] = GumihoDrafter(engine.target, engine.heads)
        extras["gumiho-always"].guard = None  # every step drafts the full tree
    return extras


@torch.inference_mode()
def _run_hf(target, prompt_ids, settings: GenerationSettings, prompt_lookup: bool) -> Run:
    ids = torch.tensor([prompt_ids], device=target.device)
    s = settings.sampling
    kwargs = dict(
        max_new_tokens=settings.max_new_tokens,
        attention_mask=torch.ones_like(ids),
        pad_token_id=target.tokenizer.pad_token_id or next(iter(target.eos_token_ids), 0),
        do_sample=not s.greedy,
    )
    if not s.greedy:
        kwargs.update(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k or None)
    if s.repetition_penalty != 1.0:
        kwargs["repetition_penalty"] = s.repetition_penalty
    if prompt_lookup:
        kwargs["prompt_lookup_num_tokens"] = 10
    start = time.perf_counter()
    out = target.model.generate(ids, **kwargs)
    seconds = time.perf_counter() - start
    return Run(out[0, len(prompt_ids) :].tolist(), seconds)


def benchmark(
    engine: Engine,
    prompt_sets: dict[str, list[str]],
    settings: GenerationSettings,
    methods=DEFAULT_METHODS,
    log=print,
    gguf: Path | None = None,
) -> dict:
    """Run every method on every prompt, interleaved. Returns the JSON-able report.

    gguf: the file the llama.cpp method reads (peers.peer_gguf), needed when it is asked for.
    """
    target = engine.target
    encoded = {
        name: [target.chat_prompt([{"role": "user", "content": p}]) for p in prompts]
        for name, prompts in prompt_sets.items()
    }
    extras = method_extras(engine, methods, encoded, settings, gguf)
    # Warm-up: first calls pay for lazy initialisation and allocator growth.
    warm = next(iter(encoded.values()))[0]
    for method in methods:
        run_method(method, engine, warm, settings.with_(max_new_tokens=8), extras)

    report = {"settings": settings.to_dict(), "benchmarks": {}}
    for name, prompts in encoded.items():
        runs = {m: [] for m in methods}
        peaks = {m: 0 for m in methods}
        mismatches = []
        for i, ids in enumerate(prompts):
            for method in methods:
                with PeakRSS() as mem:
                    runs[method].append(run_method(method, engine, ids, settings, extras))
                peaks[method] = max(peaks[method], mem.peak, mem.gpu_peak)
            if settings.sampling.greedy or settings.sampling.seed is not None:
                mismatches += _compare_outputs(runs, name, i, log, settings.sampling.greedy)
            line = "  ".join(f"{m} {runs[m][-1].tokens_per_s:6.1f}" for m in methods)
            log(f"[{name} {i + 1}/{len(prompts)}] tok/s  {line}")
        report["benchmarks"][name] = summarise(runs, peaks, mismatches, settings.sampling.greedy)
    guard = getattr(engine.drafter, "guard", None)
    if guard is not None and guard.choices:  # under sampling: how often it drafted (draft_guard.py)
        report["draft_guard"] = guard.summary()
    return report


def _compare_outputs(runs: dict[str, list[Run]], name: str, i: int, log, greedy: bool = True) -> list[dict]:
    """Our methods' latest answers against the first method's: any difference is a mismatch.
    (llama.cpp is not one of ours: summarise() reports its agreement instead.) Under sampling
    with a seed the engine's methods draw the same tokens (verify.accept); transformers'
    `generate` draws from its own generator, so only the engine's are compared."""
    ours = [m for m in runs if m != PEER and (greedy or m in ENGINE_METHODS)]
    reference = runs[ours[0]][-1].tokens
    mismatches = []
    for method in ours[1:]:
        if runs[method][-1].tokens != reference:
            mismatches.append({"prompt": i, "method": method})
            log(f"!!! MISMATCH on {name} prompt {i}: {method} differs from {ours[0]}")
    return mismatches


def summarise(runs: dict[str, list[Run]], peaks: dict, mismatches: list, greedy: bool = True) -> dict:
    out = {"methods": {}, "mismatches": mismatches, "prompts": len(next(iter(runs.values())))}
    plain_tps = statistics.median(r.tokens_per_s for r in runs["plain"]) if "plain" in runs else None
    peer_tps = statistics.median(r.tokens_per_s for r in runs[PEER]) if PEER in runs else None
    if peer_tps is not None and greedy and "plain" in runs:
        out["llama_cpp_agreement"] = agreement([r.tokens for r in runs["plain"]], [r.tokens for r in runs[PEER]])
    for method, rs in runs.items():
        tps = statistics.median(r.tokens_per_s for r in rs)
        entry = {
            "tokens_per_s_median": tps,
            "speedup_vs_plain": tps / plain_tps if plain_tps else None,
            # Each prompt's speed against plain's on the same prompt, the median of those: the
            # prompts' own spread (prompt length, answer length) cancels, which the ratio of
            # the medians above keeps (mt_bench, temperature 1, the same tokens: 0.93x against 1.00x).
            "speedup_vs_plain_paired": statistics.median(
                r.tokens_per_s / p.tokens_per_s for r, p in zip(rs, runs["plain"]) if p.tokens_per_s > 0
            ) if plain_tps else None,
            "speedup_vs_llama_cpp": tps / peer_tps if peer_tps else None,
            "new_tokens": sum(len(r.tokens) for r in rs),
            "peak_memory_mb": peaks[method] / 2**20,
            # per prompt, so runs can be compared on a common subset (e.g. the first 20 of 80)
            "per_prompt": [{"new_tokens": len(r.tokens), "tokens_per_s": r.tokens_per_s,
                            "forward_passes": r.forward_passes} for r in rs],
        }
        if rs[0].forward_passes is not None:
            tokens = sum(len(r.tokens) for r in rs)
            passes = sum(r.forward_passes for r in rs)
            entry["tau"] = tokens / passes
            accepted = _sum_lists([r.stats["accepted_at_depth"] for r in rs])
            offered = _sum_lists([r.stats["offered_at_depth"] for r in rs])
            entry["acceptance_per_depth"] = [a / o if o else 0.0 for a, o in zip(accepted, offered)]
            steps = max(1, passes - len(rs))  # decoding passes, prefills excluded
            entry["draft_ms_per_step"] = sum(r.stats["draft_s"] for r in rs) / steps * 1e3
            entry["verify_ms_per_step"] = sum(r.stats["verify_s"] for r in rs) / steps * 1e3
            entry["ttft_ms_median"] = statistics.median(r.stats["ttft_s"] for r in rs) * 1e3
        out["methods"][method] = entry
    return out


def _sum_lists(lists: list[list[int]]) -> list[int]:
    n = max((len(l) for l in lists), default=0)
    return [sum(l[i] for l in lists if i < len(l)) for i in range(n)]


def format_table(report: dict) -> str:
    """Paper style: one row per method, `speedup / tau` per benchmark, and the mean."""
    names = list(report["benchmarks"])
    methods = list(next(iter(report["benchmarks"].values()))["methods"])
    header = f"| method | {' | '.join(names)} | mean |"
    lines = [header, "|" + "---|" * (len(names) + 2)]
    for m in methods:
        cells, speedups = [], []
        for n in names:
            e = report["benchmarks"][n]["methods"][m]
            speedups.append(e["speedup_vs_plain"])
            tau = f" / {e['tau']:.2f}" if "tau" in e else ""
            peer = f", {e['speedup_vs_llama_cpp']:.2f}x llama.cpp" if e.get("speedup_vs_llama_cpp") else ""
            cells.append(f"{e['speedup_vs_plain']:.2f}x{tau} ({e['tokens_per_s_median']:.1f} tok/s{peer})")
        lines.append(f"| {m} | {' | '.join(cells)} | {statistics.mean(speedups):.2f}x |")
    lines.append("")
    for n in names:
        paired = ", ".join(f"{m} {e['speedup_vs_plain_paired']:.2f}x"
                           for m, e in report["benchmarks"][n]["methods"].items() if m != "plain")
        lines.append(f"{n}, each prompt's speed over plain's on it (median): {paired}")
    for n in names:
        for m in methods:
            e = report["benchmarks"][n]["methods"][m]
            if "draft_ms_per_step" in e:
                lines.append(f"{n} {m}: draft {e['draft_ms_per_step']:.1f} ms/step, target pass "
                             f"{e['verify_ms_per_step']:.1f} ms/step, ttft {e['ttft_ms_median']:.0f} ms, "
                             f"peak {e['peak_memory_mb']:.0f} MB")
    acc = []
    for n in names:
        for m in ("gumiho", "gumiho-heads", "gumiho-always"):
            g = report["benchmarks"][n]["methods"].get(m)
            if g:
                acc.append(f"{n} {m}: " + " ".join(f"d{i + 1} {a:.2f}" for i, a in enumerate(g["acceptance_per_depth"])))
    if acc:
        lines.append("")
        lines.append("acceptance per depth (P(accept depth d | reached d-1)):")
        lines.extend("  " + a for a in acc)
    mism = sum(len(b["mismatches"]) for b in report["benchmarks"].values())
    lines.append("")
    lines.extend(_peer_lines(report))
    lines.extend(_guard_lines(report))
    sampling = report["settings"]["sampling"]
    if sampling["temperature"] > 0 and sampling["seed"] is None:  # every method draws its own tokens
        lines.append("outputs not compared (sampling without a seed)")
    else:
        same = "the engine's " if sampling["temperature"] > 0 else ""
        lines.append(f"outputs identical across {same}methods" if mism == 0 else f"!!! {mism} OUTPUT MISMATCHES !!!")
    return "\n".join(lines)


def _peer_lines(report: dict) -> list[str]:
    """How llama.cpp's greedy answers compare with ours (its arithmetic is not our target's)."""
    lines = []
    for name, bench in report["benchmarks"].items():
        agree = bench.get("llama_cpp_agreement")
        if agree:
            parted = sorted(f for f in agree["first_divergence"] if f is not None)
            where = f", first divergence at new token {', '.join(map(str, parted))}" if parted else ""
            lines.append(f"{name}: llama.cpp's answers equal ours in {agree['identical_share']:.0%} of prompts"
                         f"{where} (other arithmetic: not a lossless check)")
    sampled = report["settings"]["sampling"]["temperature"] > 0
    if sampled and any(PEER in b["methods"] for b in report["benchmarks"].values()):
        lines.append("llama.cpp sampled with the same temperature / top_p: its outputs are not compared")
    return lines


def _guard_lines(report: dict) -> list[str]:
    """Under sampling: the share of steps the drafter spent in each mode (draft_guard.py)."""
    lines = []
    for entry in report.get("draft_guard", []):
        modes = entry["modes"]
        total = sum(m["steps"] for m in modes.values()) or 1
        shares = ", ".join(f"{mode} {m['steps'] / total:.0%} ({m['tokens_per_step']:.2f} tok/step, "
                           f"{m['tokens_per_s']:.1f} tok/s lately)" for mode, m in modes.items())
        lines.append(f"draft guard, {entry['key']}: {shares} of {total} steps")
    return lines
