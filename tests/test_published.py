"""Heads in the layout of the published amd/Gumiho-* checkpoints load into GumihoHeads exactly.

The test writes such a checkpoint itself (tiny sizes matching `tiny_target()`), with random,
distinct values in every tensor, so a tensor landing in the wrong place cannot go unseen.
"""
from __future__ import annotations

import argparse
import json

import pytest
import torch
import torch.nn.functional as F

from gumiho_core import Engine, GenerationSettings, GumihoError, HeadCheckpoint, TreeSettings, new_heads, run_to_end
from gumiho_core.loading import load_heads
from tiny import random_prompts, tiny_target

H, HEADS, KV, INTER, VOCAB, LAYERS = 64, 4, 2, 128, 96, 2
MLP_HEADS, MLP_LINEARS = 5, 6  # per head: the input Linear(2H->H) and 5 residual blocks


def published_config(hidden=H, layers=LAYERS) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": hidden, "num_attention_heads": HEADS, "num_key_value_heads": KV,
        "intermediate_size": INTER, "num_hidden_layers": layers, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "rope_scaling": None, "vocab_size": VOCAB, "torch_dtype": "float16",
    }


def published_state(seed=0, hidden=H, layers=LAYERS, embed=True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hd = hidden // HEADS
    shapes = {"fc.weight": (hidden, 2 * hidden), "fc.bias": (hidden,)}
    for n in range(layers):
        p = f"layers.{n}."
        shapes.update({
            p + "self_attn.q_proj.weight": (HEADS * hd, hidden),
            p + "self_attn.k_proj.weight": (KV * hd, hidden),
            p + "self_attn.v_proj.weight": (KV * hd, hidden),
            p + "self_attn.o_proj.weight": (hidden, HEADS * hd),
            p + "mlp.gate_proj.weight": (INTER, hidden),
            p + "mlp.up_proj.weight": (INTER, hidden),
            p + "mlp.down_proj.weight": (hidden, INTER),
            p + "post_attention_layernorm.weight": (hidden,),
        })
        if n > 0:
            shapes[p + "input_layernorm.weight"] = (hidden,)
    for j in range(MLP_HEADS):
        for i in range(MLP_LINEARS):
            shapes[f"mlp.mlp.{j}.{i}.linear.weight"] = (hidden, 2 * hidden if i == 0 else hidden)
            shapes[f"mlp.mlp.{j}.{i}.linear.bias"] = (hidden,)
    if embed:
        shapes["embed_tokens.weight"] = (VOCAB, hidden)
    state = {}
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=g) * 0.1
        if name.endswith("layernorm.weight"):
            t = 1.0 + t
        state[name] = t
    return state


def write_published(folder, state, config=None, fmt="bin", shards=1):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or published_config()))
    names = sorted(state)
    parts = [names[k::shards] for k in range(shards)]
    ext = "bin" if fmt == "bin" else "safetensors"
    stem = "pytorch_model" if fmt == "bin" else "model"
    files = [f"{stem}.{ext}"] if shards == 1 else [f"{stem}-{k + 1:05d}-of-{shards:05d}.{ext}" for k in range(shards)]
    for file, part in zip(files, parts):
        tensors = {n: state[n].half().contiguous() for n in part}  # published heads are float16
        if fmt == "bin":
            torch.save(tensors, folder / file)
        else:
            from safetensors.torch import save_file

            save_file(tensors, str(folder / file))
    if shards > 1:
        index = {"metadata": {}, "weight_map": {n: f for f, part in zip(files, parts) for n in part}}
        (folder / f"{stem}.{ext}.index.json").write_text(json.dumps(index))
    return folder


def module_for(heads, name):
    """The parameter of our module that a published tensor must land in, by attribute access."""
    kind = name.rsplit(".", 1)[1]
    parts = name.split(".")
    if parts[0] == "mlp":
        j, i = int(parts[2]), int(parts[3])
        head = heads.mlp_heads[j]
        return getattr(head.inp if i == 0 else head.blocks[i - 1], kind)
    if parts[0] == "fc":
        return getattr(heads.fc, kind)
    obj = heads.layers[int(parts[1])]
    for attr in parts[2:]:
        obj = getattr(obj, attr)
    return obj


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=0, eos=False)


@pytest.fixture(scope="module")
def state():
    return published_state(seed=3)


@pytest.mark.parametrize("fmt,shards", [("bin", 1), ("safetensors", 1), ("safetensors", 3), ("bin", 2)])
def test_every_tensor_lands_where_it_should(tmp_path, target, state, fmt, shards):
    folder = write_published(tmp_path / "pub", state, fmt=fmt, shards=shards)
    heads = load_heads(folder, target)
    c = heads.config
    assert (c.num_layers, c.num_mlp_heads, c.mlp_blocks, c.serial_depth) == (LAYERS, MLP_HEADS, MLP_LINEARS - 1, 2)
    assert (c.hidden_size, c.vocab_size, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size) == (
        H, VOCAB, HEADS, KV, INTER)
    assert c.target == {} and c.rms_norm_eps == 1e-6 and heads.dtype == torch.float32
    assert isinstance(heads.layers[0].input_layernorm, torch.nn.Identity)
    # Distinct values: no two published tensors of the same shape are equal, so a swap shows.
    seen = set()
    for name, tensor in state.items():
        if name == "embed_tokens.weight":
            continue
        param = module_for(heads, name)
        assert torch.equal(param, tensor.half().float()), name
        seen.add(id(param))
    assert seen == {id(p) for p in heads.parameters()}, "every parameter of our module comes from the file"
    assert len(state) - 1 == len(list(heads.parameters()))


def test_mlp_heads_compute_the_published_function(tmp_path, target, state):
    """Linear(2H->H)+SiLU, then x + SiLU(Linear(H->H)) per block, head J = published J."""
    heads = load_heads(write_published(tmp_path / "pub", state), target)
    x = torch.randn(3, 2 * H)
    out = heads.parallel(x)
    for j in range(MLP_HEADS):
        w = lambda i, k: state[f"mlp.mlp.{j}.{i}.linear.{k}"].half().float()  # noqa: E731
        y = F.silu(x @ w(0, "weight").T + w(0, "bias"))
        for i in range(1, MLP_LINEARS):
            y = y + F.silu(y @ w(i, "weight").T + w(i, "bias"))
        torch.testing.assert_close(out[j], y)


def hf_greedy(target, prompt, max_new_tokens):
    out = target.model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
    )
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("tree", [
    TreeSettings(),
    TreeSettings(top_k=3, total_tokens=16, depth=7, mlp_topk=3, pruning=6, fta=True, fta_tokens=3),
], ids=["default", "deep-fta"])
def test_generation_with_published_heads_is_lossless(tmp_path, target, state, tree):
    heads = load_heads(write_published(tmp_path / "pub", state, fmt="safetensors"), target)
    engine = Engine(target, heads)
    for prompt in random_prompts(3, seed=17):
        settings = GenerationSettings(max_new_tokens=20, tree=tree)
        spec = run_to_end(engine, prompt, settings)
        plain = run_to_end(engine, prompt, settings.with_(speculative=False))
        assert spec.token_ids == plain.token_ids == hf_greedy(target, prompt, 20)


def test_our_format_still_loads(tmp_path, target):
    heads = new_heads(target)
    HeadCheckpoint.save(heads, tmp_path / "ours")
    loaded = load_heads(tmp_path / "ours", target)
    for (a, x), (b, y) in zip(heads.state_dict().items(), loaded.state_dict().items()):
        assert a == b and torch.equal(x, y)


def test_load_engine_reads_published_heads(tmp_path, target, state, monkeypatch):
    from gumiho_core import loading

    monkeypatch.setattr(loading, "load_target", lambda *a, **k: target)
    folder = write_published(tmp_path / "pub", state)
    engine, note = loading.load_engine("tiny", str(folder))
    assert note == str(folder)
    torch.testing.assert_close(engine.heads.fc.weight, state["fc.weight"].half().float(), rtol=0, atol=0)


def test_missing_tensor_is_named(tmp_path, target, state):
    broken = {k: v for k, v in state.items() if k not in ("layers.1.input_layernorm.weight", "mlp.mlp.2.3.linear.bias")}
    folder = write_published(tmp_path / "pub", broken)
    with pytest.raises(GumihoError, match=r"missing .*\(2\): layers\.1\.input_layernorm\.weight, mlp\.mlp\.2\.3\.linear\.bias"):
        load_heads(folder, target)


def test_missing_whole_layer_is_named(tmp_path, target):
    folder = write_published(tmp_path / "pub", published_state(layers=1), config=published_config(layers=2))
    with pytest.raises(GumihoError, match=r"missing .*layers\.1\."):
        load_heads(folder, target)


def test_unexpected_tensor_is_named(tmp_path, target, state):
    extra = {**state, "lm_head.weight": torch.randn(VOCAB, H), "layers.0.input_layernorm.weight": torch.ones(H)}
    folder = write_published(tmp_path / "pub", extra, fmt="safetensors")
    with pytest.raises(GumihoError, match=r"unexpected tensors .*\(2\): layers\.0\.input_layernorm\.weight, lm_head\.weight"):
        load_heads(folder, target)


def test_wrong_shape_is_named(tmp_path, target, state):
    bad = {**state, "layers.0.mlp.up_proj.weight": torch.randn(INTER + 1, H)}
    with pytest.raises(GumihoError, match=r"layers\.0\.mlp\.up_proj\.weight has shape \(129, 64\)"):
        load_heads(write_published(tmp_path / "pub", bad), target)


def test_hidden_size_mismatch_with_target(tmp_path, target):
    folder = write_published(tmp_path / "pub", published_state(hidden=32), config=published_config(hidden=32))
    with pytest.raises(GumihoError, match=r"do not match the target tiny-llama-0: they expect hidden size 32"):
        load_heads(folder, target)


def test_unknown_folder_says_what_was_expected(tmp_path, target):
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text("{}")  # a config but no weights
    with pytest.raises(GumihoError, match=r"not a heads checkpoint: expected heads\.json \+ heads\.safetensors .*config\.json \+ model\.safetensors") as err:
        load_heads(tmp_path / "odd", target)
    assert "\n" not in str(err.value)
    with pytest.raises(GumihoError, match="heads not found"):
        load_heads(tmp_path / "nowhere", target)


def test_unreadable_weights_and_bad_config(tmp_path, target, state):
    folder = write_published(tmp_path / "pub", state)
    (folder / "pytorch_model.bin").write_bytes(b"not a checkpoint")
    with pytest.raises(GumihoError, match="could not read .*pytorch_model.bin"):
        load_heads(folder, target)
    folder = write_published(tmp_path / "pub2", state)
    cfg = published_config()
    del cfg["intermediate_size"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(GumihoError, match="not a valid Llama-style heads config.*intermediate_size"):
        load_heads(folder, target)


def test_pickled_code_is_refused(tmp_path, target, state):
    """torch.load runs with weights_only=True: a pickle that is not plain tensors is refused."""
    folder = write_published(tmp_path / "pub", state)
    torch.save({"fc.weight": state["fc.weight"], "hook": argparse.Namespace(x=1)}, folder / "pytorch_model.bin")
    with pytest.raises(GumihoError, match="could not read"):
        load_heads(folder, target)
