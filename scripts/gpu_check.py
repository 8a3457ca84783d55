"""One prepared GPU check (for a session lent a CUDA machine): run it with
    python scripts/gpu_check.py --out $OUT/gpu.json
It builds Llama targets from configs on the GPU (no weights travel), and reports:
losslessness (speculative == plain token ids) in fp16 / bf16, bitsandbytes 4-bit/8-bit on
CUDA, flash-attn prefill if installed, and the verification cost curve (ms per target pass
by tree tokens) for a ~1B-shaped target.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from gumiho_core import Engine, GenerationSettings, TreeSettings, new_heads, run_to_end  # noqa: E402
from gumiho_core.target import Target  # noqa: E402
from gumiho_core.tree_budget import measure_cost_curve  # noqa: E402


def llama(hidden, layers, heads, kv, inter, vocab, dtype, device="cuda", attn="sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM
    from tiny import tiny_tokenizer

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096,
                      initializer_range=0.05, eos_token_id=None, attn_implementation=attn)
    model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval().requires_grad_(False)
    model.generation_config.eos_token_id = None
    return Target(model, tiny_tokenizer(min(vocab, 96)), f"gpu-llama-{hidden}x{layers}")


def lossless(target, trees, prompts=6, new=48):
    engine = Engine(target, new_heads(target))
    g = torch.Generator().manual_seed(1)
    ok, tau = True, []
    for tree in trees:
        for _ in range(prompts):
            ids = torch.randint(3, target.vocab_size, (32,), generator=g).tolist()
            s = GenerationSettings(max_new_tokens=new, tree=tree)
            a, b = run_to_end(engine, ids, s), run_to_end(engine, ids, s.with_(speculative=False))
            ok &= a.token_ids == b.token_ids
            tau.append(a.stats.tau)
    return {"lossless": ok, "tau_untrained": sum(tau) / len(tau)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="gpu.json")
    args = p.parse_args()
    report = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    trees = [TreeSettings(), TreeSettings.gpu()]
    checks = {}
    for name, dtype in [("fp16", torch.float16), ("bf16", torch.bfloat16)]:
        checks[f"lossless_{name}"] = lambda dtype=dtype: lossless(llama(512, 8, 8, 4, 1536, 32000, dtype), trees)
    checks["cost_curve_1b_bf16"] = lambda: measure_cost_curve(
        llama(2048, 16, 32, 8, 5632, 32000, torch.bfloat16), sizes=(1, 2, 4, 8, 16, 32, 48, 64, 96, 128),
        context=512, reps=10, use_cache=False)

    def bnb(bits):
        from transformers import BitsAndBytesConfig, LlamaForCausalLM
        import tempfile
        t = llama(512, 8, 8, 4, 1536, 32000, torch.float16)
        folder = tempfile.mkdtemp()
        t.model.save_pretrained(folder)
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float16) \
            if bits == 4 else BitsAndBytesConfig(load_in_8bit=True)
        m = LlamaForCausalLM.from_pretrained(folder, quantization_config=q, device_map="cuda", dtype=torch.float16)
        m.generation_config.eos_token_id = None
        return lossless(Target(m.eval(), t.tokenizer, "bnb"), trees[:1], prompts=3)
    checks["bnb_4bit"] = lambda: bnb(4)
    checks["bnb_8bit"] = lambda: bnb(8)

    def flash():
        import flash_attn  # noqa: F401
        t = llama(512, 8, 8, 4, 1536, 32000, torch.bfloat16, attn="flash_attention_2")
        ids = torch.randint(3, 32000, (1, 2048), device="cuda")
        torch.cuda.synchronize(); s = time.perf_counter()
        t.base(input_ids=ids)
        torch.cuda.synchronize()
        return {"prefill_2048_ms": (time.perf_counter() - s) * 1e3}
    checks["flash_attn_prefill"] = flash

    for name, fn in checks.items():
        start = time.perf_counter()
        try:
            report[name] = fn()
        except Exception as exc:  # report and go on: one failed check must not hide the others
            report[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-800:]}
        print(name, report[name] if "cost" not in name else "", f"({time.perf_counter() - start:.0f} s)", flush=True)
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps({k: v for k, v in report.items()}, default=str)[:4000])


if __name__ == "__main__":
    main()
