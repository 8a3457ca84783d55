"""One prepared GPU check (for a session lent a CUDA machine): run it with
    python scripts/gpu_check.py --out $OUT/gpu.json
It builds Llama targets from configs (no weights travel), saves the small ones to a folder
and loads them back through `load_target`, the code path users take, and reports:
losslessness (speculative == plain token ids) in fp16 / bf16 / bitsandbytes 4-bit and 8-bit
on CUDA, flash-attn prefill (or, where flash-attn is not installed, PyTorch's own flash SDPA
kernel against its math kernel), and the verification cost curve (ms per target pass by
tree tokens) for targets shaped like SmolLM2-135M, a 1B Llama and Llama-2-7B / Vicuna-7B, and
for the same three shapes in bfloat16: plain and Gumiho (the paper's tree) decoding speed on
both eager paths, transformers' forward and the lean decoder (fast_decoder.py), with the step
costs and what they project at the paper's tau. (No compiled path exists yet: torch.compile
did not pay on the CPU, docs/fast_decoder.md; CUDA graphs are what a GPU would need.)

`--device cpu --quick` runs the same code on small sizes here, to check the script itself.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from gumiho_core import Engine, GenerationSettings, TreeSettings, load_target, new_heads, run_to_end  # noqa: E402
from gumiho_core.attention import use_packed_gqa  # noqa: E402
from gumiho_core.target import Target, attach_fast_decoder  # noqa: E402
from gumiho_core.tree_budget import _sync, measure_cost_curve  # noqa: E402

# name: (hidden, layers, heads, kv heads, intermediate, vocab)
SHAPES = {
    "small": (512, 8, 8, 4, 1536, 32000),
    "smollm2-135m": (576, 30, 9, 3, 1536, 49152),
    "llama-1b": (2048, 16, 32, 8, 5632, 32000),
    "llama2-7b": (4096, 32, 32, 32, 11008, 32000),
}


def llama_config(shape, attn="sdpa"):
    from transformers import LlamaConfig

    hidden, layers, heads, kv, inter, vocab = SHAPES[shape]
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096,
                       initializer_range=0.05, eos_token_id=None, attn_implementation=attn)


def built_target(shape, dtype, device, attn="sdpa"):
    """A random target made straight on the device (large shapes: nothing is saved)."""
    from transformers import LlamaForCausalLM
    from tiny import tiny_tokenizer

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(llama_config(shape, attn)).to(dtype).eval().requires_grad_(False)
    model.generation_config.eos_token_id = None
    use_packed_gqa(model)  # as load_target does
    return Target(model, tiny_tokenizer(96), f"gpu-{shape}")


def saved_folder(shape="small") -> str:
    """A random target saved as a Hugging Face folder, for load_target to read back."""
    from transformers import LlamaForCausalLM
    from tiny import tiny_tokenizer

    torch.manual_seed(0)
    folder = tempfile.mkdtemp()
    model = LlamaForCausalLM(llama_config(shape))
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    tiny_tokenizer(96).save_pretrained(folder)
    return folder


def lossless(target, trees, prompts=6, new=48):
    engine = Engine(target, new_heads(target))
    g = torch.Generator().manual_seed(1)
    tau, divergences = [], []
    for tree in trees:
        for _ in range(prompts):
            ids = torch.randint(3, target.vocab_size, (32,), generator=g).tolist()
            s = GenerationSettings(max_new_tokens=new, tree=tree)
            a, b = run_to_end(engine, ids, s), run_to_end(engine, ids, s.with_(speculative=False))
            tau.append(a.stats.tau)
            if a.token_ids != b.token_ids:
                divergences.append(divergence(target, ids, a.token_ids, b.token_ids))
    return {"lossless": not divergences, "generations_compared": len(tau), "tau_untrained_heads": sum(tau) / len(tau),
            "dtype": str(target.base.dtype), "device": str(target.device), "divergences": divergences}


@torch.no_grad()
def divergence(target, prompt, spec, plain):
    """Where two outputs part, and whether the target was at a near-tie there.

    In float16/bfloat16 a pass over a tree and a pass over one token round differently, so
    two logits closer than the rounding error can swap places: the acceptance rule is still
    exact, the target's own arithmetic is not shape-invariant. The logit gap at the first
    difference (from one uncached pass over the common prefix) tells the two causes apart.
    """
    i = next(k for k, (x, y) in enumerate(zip(spec, plain)) if x != y)
    ids = torch.tensor([prompt + plain[:i]], device=target.device)
    logits = target.model(input_ids=ids).logits[0, -1].float()
    top = logits.topk(2)
    return {"at": i, "of": len(plain), "top2_gap": round(float(top.values[0] - top.values[1]), 5),
            "spec_minus_plain_logit": round(float(logits[spec[i]] - logits[plain[i]]), 5),
            "logit_scale": round(float(logits.abs().max()), 3)}


PAPER_TAU = 5.29  # Gumiho, Vicuna 7B, MT-Bench (../shared/GUMIHO.md)


def decode_speed(target, prompts=3, new=64):
    """Plain and Gumiho (the paper's tree, untrained heads) on `target`: tokens/s, ms a step,
    and what the steps' costs project at the paper's tau (random weights accept ~nothing, so
    the measured tau says nothing; the cost of a tree step does)."""
    engine = Engine(target, new_heads(target))
    g = torch.Generator().manual_seed(2)
    methods = {"plain": GenerationSettings(max_new_tokens=new, speculative=False),
               "gumiho": GenerationSettings(max_new_tokens=new, tree=TreeSettings.gpu())}
    for settings in methods.values():  # warm-up
        run_to_end(engine, list(range(3, 35)), settings.with_(max_new_tokens=8))
    runs, same, result = {label: [] for label in methods}, 0, {}
    for _ in range(prompts):
        ids = torch.randint(3, target.vocab_size, (64,), generator=g).tolist()
        done = {label: run_to_end(engine, ids, settings) for label, settings in methods.items()}
        same += done["plain"].token_ids == done["gumiho"].token_ids
        for label, event in done.items():
            runs[label].append(event.stats)
    for label, stats in runs.items():
        steps = [(s.total_s - s.ttft_s) / max(s.forward_passes - 1, 1) * 1e3 for s in stats]
        result[label] = {"tokens_per_s": statistics.median(s.tokens_per_s for s in stats),
                         "ms_per_step": statistics.median(steps), "tau": statistics.median(s.tau for s in stats)}
    result["identical_answers"] = f"{same}/{prompts}"
    result["projected_speedup_at_paper_tau"] = round(
        PAPER_TAU * result["plain"]["ms_per_step"] / result["gumiho"]["ms_per_step"], 2)
    return result


def prefill_ms(target, tokens, reps=5):
    ids = torch.randint(3, target.vocab_size, (1, tokens), device=target.device)
    times = []
    for rep in range(reps + 1):
        _sync(target)
        start = time.perf_counter()
        target.base(input_ids=ids)
        _sync(target)
        if rep:
            times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def lossless_checks(dev: str, quick: bool) -> dict:
    """Speculative == plain on a saved random target, loaded as users load one, per precision."""
    trees, prompts, folder = [TreeSettings(), TreeSettings.gpu()], 2 if quick else 6, saved_folder()
    checks = {}
    for name in ("float16", "bfloat16", "float32"):
        checks[f"lossless_{name}"] = lambda name=name: lossless(load_target(folder, dtype=name, device=dev),
                                                                trees, prompts=prompts)
    for bits in ("4bit", "8bit"):
        checks[f"lossless_bnb_{bits}"] = lambda bits=bits: lossless(
            load_target(folder, dtype="float16", quantize=bits, device=dev), trees, prompts=prompts)
    return checks


def flash_prefill(dev: str, quick: bool) -> dict:
    dtype = torch.bfloat16
    try:
        import flash_attn  # noqa: F401
        t = built_target("llama-1b", dtype, dev, attn="flash_attention_2")
        return {"flash_attn": flash_attn.__version__, "prefill_2048_ms": prefill_ms(t, 2048)}
    except ImportError:
        pass
    # No flash-attn package (it needs a CUDA build): PyTorch's SDPA carries FlashAttention-2
    # kernels of its own; compare them with the math kernel on the same prefill.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    t = built_target("llama-1b", dtype, dev)
    t.model.set_attn_implementation("sdpa")  # plain SDPA for a prefill: the packed form is for trees
    result = {"flash_attn": "not installed (needs a CUDA build); PyTorch SDPA kernels compared"}
    for label, backend in [("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_math", SDPBackend.MATH)]:
        with sdpa_kernel(backend):
            result[f"{label}_prefill_2048_ms"] = prefill_ms(t, 256 if quick else 2048)
    return result


def shape_checks(dev: str, quick: bool) -> dict:
    """Per target shape: the verification cost curve, and decoding speed on both eager paths."""
    sizes = (1, 2, 4, 8) if quick else (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
    dtype = torch.float32 if dev == "cpu" else torch.bfloat16

    def free_gpu_memory() -> None:  # what the last target held, once the caller has let it go
        torch.cuda.empty_cache() if dev == "cuda" else None

    def curve(shape):
        t = built_target(shape, dtype, dev)
        ms = measure_cost_curve(t, sizes=sizes, context=512, reps=10, use_cache=False)
        del t
        free_gpu_memory()
        return {"ms_by_tree_tokens": ms, "relative_to_1": {n: round(v / ms[1], 3) for n, v in ms.items()}}

    def speed(shape, path):
        t = built_target(shape, dtype, dev)
        if path == "fast":
            attach_fast_decoder(t, str(dtype).removeprefix("torch."))
            if t.fast is None:
                return {"skipped": t.fast_note}
        result = decode_speed(t, prompts=1 if quick else 3, new=16 if quick else 64)
        del t
        free_gpu_memory()
        return result

    checks = {}
    for shape in ["small"] if quick else ["smollm2-135m", "llama-1b", "llama2-7b"]:
        checks[f"cost_curve_{shape}_bf16"] = lambda shape=shape: curve(shape)
        for path in ("transformers", "fast"):
            checks[f"decode_speed_{shape}_{path}"] = lambda shape=shape, path=path: speed(shape, path)
    return checks


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="gpu.json")
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="small sizes: check the script, not the GPU")
    p.add_argument("--only", default="", help="run only the checks whose names contain this")
    args = p.parse_args()
    dev = args.device
    import transformers

    report = {"device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu",
              "torch": torch.__version__, "transformers": transformers.__version__}
    checks = {**lossless_checks(dev, args.quick), "flash_prefill": lambda: flash_prefill(dev, args.quick),
              **shape_checks(dev, args.quick)}
    for name, fn in checks.items():
        if args.only not in name:
            continue
        start = time.perf_counter()
        try:
            report[name] = fn()
        except Exception as exc:  # report and go on: one failed check must not hide the others
            report[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-1500:]}
        print(name, json.dumps(report[name], default=str)[:1500], f"({time.perf_counter() - start:.0f} s)",
              flush=True)
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
