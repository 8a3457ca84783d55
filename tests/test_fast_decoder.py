"""The fast decoder (fast_decoder.py) in every precision it offers (quantize.py).

Lossless is checked the same way as for the transformers path: speculative == plain, token
for token under greedy, with untrained heads and with an oracle drafter that drives long
accepted paths through the static cache's in-place moves. In float32 the fast decoder does
transformers' arithmetic, so it also matches transformers' own `generate`.
"""
from __future__ import annotations

import random

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from gumiho_core import Engine, GenerationSettings, TreeSettings, new_heads, run_to_end
from gumiho_core.cpu_matmul import bf16_packing_available, fast_linear
from gumiho_core.errors import GumihoError
from gumiho_core.fast_decoder import FastDecoder, StaticKVCache
from gumiho_core.quantize import PRECISIONS, Int4WeightOnlyLinear, Int8WeightOnlyLinear, check_precision
from gumiho_core.target import Target, attach_fast_decoder
from gumiho_core.verify import TransformersCache
from oracle import OracleDrafter
from tiny import hf_greedy, random_prompts, tiny_target, tiny_tokenizer

# blocked_attention.py relies on float32 products whose bits do not depend on the row count,
# measured on CPUs with bfloat16 support (AVX-512), the only ones where the engine takes it:
# elsewhere a low precision needs the C kernels (quantize.check_precision).
BLOCKED_ATTENTION_UNUSED = "blocked_attention.py runs only on CPUs with bfloat16 support; this one has none"
TREE = TreeSettings(top_k=3, total_tokens=10, depth=4, mlp_topk=2, pruning=4, fta=True, fta_tokens=2)


def fast_target(precision: str, seed: int = 0, attention: str = "kernel") -> Target:
    """attention: the low precisions' row-invariant attention, "kernel" (cpu_kernels.c, where
    this machine builds it) or "pytorch" (blocked_attention.py)."""
    target = attach_fast_decoder(tiny_target(seed=seed, eos=False), precision)
    if attention == "pytorch":
        target.fast.kernels = None
    elif precision != "float32" and target.fast.kernels is None:
        pytest.skip(f"no kernels on this machine: {target.fast.kernels_note}")
    return target


@pytest.mark.parametrize("attention", ["kernel", "pytorch"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_speculative_equals_plain_in_every_precision(precision, attention):
    """Token for token in every precision: in bfloat16 / int8 / int4 a row's bits do not depend
    on the rows beside it in a pass (row-invariant products and attention), so a tree pass
    decides every near-tie as a one-token pass does. Prompts and answers run past several of
    blocked attention's 64-key blocks, so trees straddle block boundaries."""
    if precision == "float32" and attention == "pytorch":
        pytest.skip("float32 takes the flash kernel either way")
    if attention == "pytorch" and not bf16_packing_available():
        pytest.skip(BLOCKED_ATTENTION_UNUSED)
    target = fast_target(precision, attention=attention)
    assert target.fast is not None
    engine = Engine(target, new_heads(target))
    for prompt in random_prompts(4, seed=3) + random_prompts(2, seed=4, lo=100, hi=140):
        # Both from a fresh read of the prompt (test_default_model.py says why).
        spec = run_to_end(engine, prompt, GenerationSettings(max_new_tokens=90, tree=TREE), reuse_prefix=False)
        plain = run_to_end(engine, prompt, GenerationSettings(max_new_tokens=90, speculative=False),
                           reuse_prefix=False)
        assert spec.token_ids == plain.token_ids


def test_float32_fast_decoder_is_transformers_arithmetic():
    target = fast_target("float32")
    engine = Engine(target, new_heads(target))
    for prompt in random_prompts(6, seed=5):
        spec = run_to_end(engine, prompt, GenerationSettings(max_new_tokens=24, tree=TREE))
        assert spec.token_ids == hf_greedy(target, prompt, 24)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_static_cache_after_long_paths_equals_plain_decoding(precision):
    """The oracle's long accepted paths (often not the tree's first nodes) are moved in place;
    the cache afterwards must hold what plain decoding wrote, position by position."""
    target = fast_target(precision)
    engine, oracle = Engine(target, None), OracleDrafter()
    for i, prompt in enumerate(random_prompts(6, seed=11)):
        reference = run_to_end(engine, prompt, GenerationSettings(max_new_tokens=50, speculative=False),
                               reuse_prefix=False)
        plain_cache = engine.prefix.cache
        oracle.update(truth=reference.token_ids + [5] * 10, rng=random.Random(i), size=4 + 3 * i, depth=1 + i % 6)
        spec = run_to_end(engine, prompt, GenerationSettings(max_new_tokens=50), drafter=oracle, reuse_prefix=False)
        assert spec.token_ids == reference.token_ids
        assert spec.stats.tau > 1.5, "the oracle should produce long accepted paths"
        spec_cache, n = engine.prefix.cache, plain_cache.length
        assert isinstance(spec_cache, StaticKVCache) and spec_cache.length >= n
        if precision == "float32":  # the flash kernel: equal within float32 rounding
            torch.testing.assert_close(spec_cache.keys[:, :, :n], plain_cache.keys[:, :, :n])
            torch.testing.assert_close(spec_cache.values[:, :, :n], plain_cache.values[:, :, :n])
        else:  # blocked attention: the same bits
            assert torch.equal(spec_cache.keys[:, :, :n], plain_cache.keys[:, :, :n])
            assert torch.equal(spec_cache.values[:, :, :n], plain_cache.values[:, :, :n])


def test_prefix_reuse_across_turns_on_the_static_cache():
    target = fast_target("float32")
    engine = Engine(target, new_heads(target))
    turn1 = random_prompts(1, seed=2)[0]
    first = run_to_end(engine, turn1, GenerationSettings(max_new_tokens=12, tree=TREE))
    turn2 = turn1 + first.token_ids + [7, 8, 9]
    again = run_to_end(engine, turn2, GenerationSettings(max_new_tokens=15, tree=TREE))
    assert again.stats.reused_prompt_tokens > len(turn1)
    assert again.token_ids == hf_greedy(target, turn2, 15)


def test_static_cache_grows_past_its_first_capacity():
    target = fast_target("float32")
    engine = Engine(target, None)
    prompt = random_prompts(1, seed=4, lo=300, hi=301)[0]
    done = run_to_end(engine, prompt, GenerationSettings(max_new_tokens=40, speculative=False))
    assert engine.prefix.cache.capacity >= len(prompt) + 40 > 512 // 2
    assert done.token_ids == hf_greedy(target, prompt, 40)


def test_transformers_path_has_the_same_cache_interface():
    target = tiny_target(seed=0, eos=False)
    engine = Engine(target, new_heads(target))
    prompt = random_prompts(1, seed=9)[0]
    run_to_end(engine, prompt, GenerationSettings(max_new_tokens=10, tree=TREE))
    assert isinstance(engine.prefix.cache, TransformersCache)
    assert engine.prefix.cache.length == len(engine.prefix.ids)


def test_an_architecture_it_does_not_cover_keeps_the_transformers_path():
    config = GPT2Config(vocab_size=96, n_embd=32, n_layer=1, n_head=2, n_positions=64)
    target = Target(model=GPT2LMHeadModel(config).eval(), tokenizer=tiny_tokenizer(), name="tiny-gpt2")
    attach_fast_decoder(target, "int8")
    assert target.fast is None
    assert "gpt2" in target.fast_note and "\n" not in target.fast_note
    engine = Engine(target, None)
    prompt = random_prompts(1, seed=1)[0]
    assert run_to_end(engine, prompt, GenerationSettings(max_new_tokens=5, speculative=False)).token_ids


def test_rotary_scaling_is_refused_by_the_fast_decoder():
    target = tiny_target(seed=0)
    target.model.config.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0}
    decoder, why = FastDecoder.from_model(target.model)
    assert decoder is None and "yarn" in why


def test_a_precision_the_cpu_cannot_run_is_one_clear_line(monkeypatch):
    from gumiho_core import quantize

    monkeypatch.setattr(quantize, "bf16_packing_available", lambda: False)
    with pytest.raises(GumihoError, match="int8 needs a CPU with bfloat16 support"):
        check_precision("int8")
    check_precision("float32")  # always runs
    with pytest.raises(GumihoError, match="unknown precision"):
        check_precision("int3")
    # int4 runs on the engine's kernels (AVX2 or AVX-512) without bfloat16 units; with neither,
    # the line says why the kernels do not run.
    monkeypatch.setattr(quantize, "groupwise_kernels", lambda: (object(), ""))
    check_precision("int4")
    monkeypatch.setattr(quantize, "groupwise_kernels", lambda: (None, "no C compiler found"))
    with pytest.raises(GumihoError, match=r"int4 needs .*\(.+\): use float32$"):
        check_precision("int4")


@pytest.mark.parametrize("layer_type", [Int8WeightOnlyLinear, Int4WeightOnlyLinear, "bfloat16"])
def test_quantized_products_do_not_depend_on_the_row_count(layer_type):
    """A row's product is the same bits whether its pass had 1 row or 14: the weight-only
    kernels cannot make a tree pass (many rows) decide a near-tie differently from plain
    decoding (one row). (Attention is not covered: its blocked softmax may differ in the last
    bit; the benchmark counts the answers where that flipped a token.)"""
    torch.manual_seed(0)
    linear = torch.nn.Linear(576, 1536, bias=False)
    # bfloat16: the layer the fast decoder runs (oneDNN's pre-packed weight where it can).
    layer = fast_linear(linear.to(torch.bfloat16)) if layer_type == "bfloat16" else layer_type(linear)
    x = torch.randn(16, 576).bfloat16()
    one_by_one = torch.cat([layer(x[i : i + 1]) for i in range(16)])
    for rows in (2, 3, 6, 8, 14, 16):
        assert torch.equal(layer(x[:rows]), one_by_one[:rows]), rows


@pytest.mark.parametrize("attention", ["kernel", "pytorch"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_tree_pass_matches_one_token_passes(precision, attention):
    """Three tokens read one pass each, as one causal pass, or inside a padded tree pass (as
    TargetPasses pads) give the same features: up to the attention's rounding in float32 and
    in a prefill, bit for bit for decoding passes in the low precisions."""
    decoder = fast_target(precision, attention=attention).fast
    prompt, chain = torch.tensor(random_prompts(1, seed=8)[0]), torch.tensor([5, 17, 42])
    with torch.inference_mode():
        cache = decoder.new_cache()
        decoder(prompt, torch.arange(len(prompt)), cache)
        one_by_one = torch.cat([decoder(chain[i : i + 1], torch.tensor([len(prompt) + i]), cache) for i in range(3)])
        cache.crop(len(prompt))
        together = decoder(chain, torch.arange(len(prompt), len(prompt) + 3), cache)
        cache.crop(len(prompt))
        padded = torch.cat([chain, chain[:1].expand(5)])
        ancestors = torch.eye(8, dtype=torch.bool)
        ancestors[:3, :3] = torch.ones(3, 3, dtype=torch.bool).tril()
        in_tree = decoder(padded, torch.cat([torch.arange(3), torch.zeros(5, dtype=torch.long)]) + len(prompt),
                          cache, ancestors)[:3]
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if precision == "float32" else {"atol": 3e-2, "rtol": 3e-2}
    torch.testing.assert_close(together, one_by_one, **tolerance)  # a causal prefill: the flash kernel
    if precision == "float32":
        torch.testing.assert_close(in_tree, one_by_one, **tolerance)
    else:  # decoding passes on row-invariant attention: a row's bits whatever the pass
        assert torch.equal(in_tree, one_by_one)


def test_handing_back_a_modules_pages_spares_its_neighbours():
    """hand_back_pages drops only pages lying wholly inside the module's tensors: a tensor
    sharing its first and last pages with others leaves those bytes as they were."""
    from gumiho_core.fast_decoder import hand_back_pages

    page = 4096 // 4  # float32 values a page holds
    memory = torch.full((20 * page,), 7.0)
    inner = torch.nn.Linear(1, 1)
    inner.weight = torch.nn.Parameter(memory[page // 2 : 10 * page + page // 2].view(-1, 1), requires_grad=False)
    hand_back_pages(inner)
    assert torch.all(memory[: page // 2] == 7) and torch.all(memory[10 * page + page // 2 :] == 7)
    # The pages wholly inside: anonymous memory handed back reads as zeros again.
    assert torch.all(memory[2 * page : 9 * page] == 0)


@pytest.mark.parametrize("precision", ["float32", "int4"])
def test_a_decoder_that_discards_the_originals_decodes_the_same(precision):
    """The chat's load (each transformers layer's memory handed back once copied, then the
    layers released) gives the same decoder as one built beside intact layers."""
    kept = fast_target(precision, seed=5)
    target = tiny_target(seed=5, eos=False)
    attach_fast_decoder(target, precision, discard_originals=True)
    target.release_transformers_layers()
    prompt = random_prompts(1, seed=9)[0]
    settings = GenerationSettings(max_new_tokens=30, speculative=False)
    assert run_to_end(Engine(target, None), prompt, settings).token_ids == \
        run_to_end(Engine(kept, None), prompt, settings).token_ids


def test_without_the_cpu_kernels_int4_runs_on_pytorch_and_stays_lossless(monkeypatch):
    """No C compiler (or GUMIHO_NATIVE_KERNELS=0): PyTorch's int4 and int8 kernels and blocked
    attention, the same event stream, speculative == plain."""
    from gumiho_core import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "load", lambda: (None, "no C compiler found"))
    target = fast_target("int4", attention="pytorch")
    decoder = target.fast
    assert decoder.kernels is None and decoder.kernels_note == "no C compiler found"
    assert type(decoder.layers[0].qkv) is Int4WeightOnlyLinear and type(decoder.lm_head) is Int8WeightOnlyLinear
    engine = Engine(target, new_heads(target))
    prompt = random_prompts(1, seed=11)[0]
    spec = run_to_end(engine, prompt, GenerationSettings(max_new_tokens=40, tree=TREE), reuse_prefix=False)
    plain = run_to_end(engine, prompt, GenerationSettings(max_new_tokens=40, speculative=False), reuse_prefix=False)
    assert spec.token_ids == plain.token_ids


def tree_after_a_prompt(seed: int):
    """(prompt, tree tokens, their positions, ancestors): a 5-node tree, two branches of depth 2
    below its root, after a random prompt."""
    prompt, tree = torch.tensor(random_prompts(1, seed=seed)[0]), torch.tensor([5, 17, 42, 9, 60])
    positions = torch.tensor([0, 1, 1, 2, 2]) + len(prompt)
    ancestors = torch.eye(5, dtype=torch.bool)
    ancestors[1:, 0] = ancestors[3, 1] = ancestors[4, 2] = True
    return prompt, tree, positions, ancestors


def test_int4_decoding_passes_run_every_layer_in_one_call(monkeypatch):
    """decoder_layers.c: where the int4 products run on groupwise_matmul.c, a decoding pass (a
    tree here) is one call for every layer, never the per-layer path; it computes what that
    path computes (its SiLU is its own: equal up to a last bit) and writes the same first
    layer's cache."""
    from gumiho_core.fast_decoder import FastLayer

    decoder = fast_target("int4").fast
    if decoder.layers_in_one_call is None:
        pytest.skip("groupwise_matmul.c does not run here (no AVX2)")
    prompt, tree, positions, ancestors = tree_after_a_prompt(seed=12)
    with torch.inference_mode():
        cache = decoder.new_cache()
        decoder(prompt, torch.arange(len(prompt)), cache)
        with monkeypatch.context() as patch:
            patch.setattr(FastLayer, "forward", lambda *args: pytest.fail("a decoding pass took the per-layer path"))
            in_one_call = decoder(tree, positions, cache, ancestors)
        keys = cache.keys[:, :, : len(prompt) + 5].clone()
        cache.crop(len(prompt))
        one_call, decoder.layers_in_one_call = decoder.layers_in_one_call, None
        per_layer = decoder(tree, positions, cache, ancestors)
        decoder.layers_in_one_call = one_call
    assert torch.equal(cache.keys[0, :, : len(prompt) + 5], keys[0])
    torch.testing.assert_close(in_one_call, per_layer, atol=3e-2, rtol=3e-2)


def test_decoding_in_one_call_past_the_caches_capacity():
    """The cache re-allocates when a chat outgrows it (doubling); decoding passes in one call
    read the new tensors, and give the bits of a cache that never grew."""
    decoder = fast_target("int4").fast
    prompt, steps = torch.tensor(random_prompts(1, seed=13, lo=6, hi=7)[0]), torch.tensor([5, 17, 42, 9, 60] * 4)
    outputs, caches = [], [decoder.new_cache(8), decoder.new_cache(512)]
    with torch.inference_mode():
        for cache in caches:
            decoder(prompt, torch.arange(len(prompt)), cache)
            outputs.append(torch.cat([decoder(steps[i : i + 1], torch.tensor([len(prompt) + i]), cache)
                                      for i in range(len(steps))]))
    assert caches[0].capacity == 32 and caches[1].capacity == 512  # 8 -> 16 -> 32 for 26 positions
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize("table", ["float32", "bfloat16"])
def test_a_decoding_pass_in_one_call_is_the_bits_of_its_parts(table):
    """decoder_pass (decoder_layers.c) looks up the rows' embeddings and rotary rows and applies
    the final norm in C, where PyTorch did it around decoder_layers: the same bits as those parts
    called one by one; a token outside the vocabulary is refused in words, not read past the table."""
    import torch.nn.functional as F

    decoder = fast_target("int4").fast
    if decoder.layers_in_one_call is None:
        pytest.skip("groupwise_matmul.c does not run here (no AVX2)")
    decoder.embedding = decoder.embedding.to(getattr(torch, table))
    prompt, tree, positions, ancestors = tree_after_a_prompt(seed=14)
    with torch.inference_mode():
        cache = decoder.new_cache()
        decoder(prompt, torch.arange(len(prompt)), cache)
        in_one_call = decoder(tree, positions, cache, ancestors)
        cache.crop(len(prompt))
        x = F.embedding(tree, decoder.embedding).to(torch.bfloat16)
        cos, sin = decoder.rope(positions, torch.float32)
        decoder.kernels.decoder_layers(*decoder.layers_in_one_call, x, cos.contiguous(), sin.contiguous(),
                                       cache.keys, cache.values, len(prompt), ancestors.to(torch.uint8).contiguous())
        by_parts = decoder.kernels.add_rms_norm(x, None, decoder.norm, decoder.shape["eps"])
        assert torch.equal(in_one_call, by_parts)
        cache.crop(len(prompt))
        with pytest.raises(RuntimeError, match="outside the vocabulary"):
            decoder(torch.tensor([len(decoder.embedding)]), torch.tensor([len(prompt)]), cache)
