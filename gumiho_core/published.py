"""Load heads from either our checkpoint format or the layout of the published amd/Gumiho-* heads.

Published layout (amd/Gumiho-vicuna-7b, -llama3-8b, ...): a folder with a Llama-style
`config.json` and the weights as `pytorch_model.bin` or `model.safetensors` (either may be
sharded, with a `*.index.json` naming the shards). Their names map onto `GumihoHeads`:

    fc.{weight,bias}                       -> fc.{weight,bias}
    layers.N.*                             -> layers.N.*   (no input_layernorm for N = 0)
    mlp.mlp.J.0.linear.{weight,bias}       -> mlp_heads.J.inp.*        (Linear 2H->H, SiLU)
    mlp.mlp.J.I.linear.{weight,bias}, I>0  -> mlp_heads.J.blocks.{I-1}.*  (x + SiLU(Linear H->H))
    embed_tokens.weight                    -> dropped (we use the target's own embedding)

Every other tensor is refused by name, and every parameter of our module must be supplied.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from .errors import GumihoError
from .heads import GumihoHeads, HeadConfig, check_heads_match, place

PUBLISHED_CONFIG = "config.json"
# Single files, then their sharded forms (an index json that maps names to shard files).
SAFETENSORS_FILE = "model.safetensors"
TORCH_FILE = "pytorch_model.bin"
WEIGHT_CHOICES = (SAFETENSORS_FILE, SAFETENSORS_FILE + ".index.json", TORCH_FILE, TORCH_FILE + ".index.json")

_MLP_KEY = re.compile(r"^mlp\.mlp\.(\d+)\.(\d+)\.linear\.(weight|bias)$")
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")
_ROTARY_KEY = re.compile(r"^layers\.(\d+)\.self_attn\.rotary_emb\.inv_freq$")
DROPPED = {"embed_tokens.weight"}


def load_published(folder, target=None, device=None, dtype=None) -> GumihoHeads:
    folder = Path(folder)
    published = read_published_weights(folder)
    config = published_config(folder, published)
    if target is not None:
        check_heads_match(config, target, str(folder))
    heads = GumihoHeads(config)
    state = map_published_state(published, config, heads, str(folder))
    heads.load_state_dict(state)
    return place(heads, target, device, dtype)


def weights_file(folder: Path) -> Path | None:
    for name in WEIGHT_CHOICES:
        if (folder / name).is_file():
            return folder / name
    return None


def read_published_weights(folder: Path) -> dict[str, torch.Tensor]:
    first = weights_file(folder)
    if first is None:
        raise GumihoError(f"{folder}: no weights found (expected one of {', '.join(WEIGHT_CHOICES)})")
    if first.name.endswith(".index.json"):
        try:
            weight_map = json.loads(first.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise GumihoError(f"{first} is not a valid weights index: {exc}") from exc
        files = [folder / name for name in shards]
        for file in files:
            if not file.is_file():
                raise GumihoError(f"{first} names the shard {file.name}, which is not in {folder}")
    else:
        files = [first]
    state: dict[str, torch.Tensor] = {}
    for file in files:
        part = _read_file(file)
        repeated = sorted(set(part) & set(state))
        if repeated:
            raise GumihoError(f"{folder}: tensors stored in more than one shard: {repeated[:3]}")
        state.update(part)
    return state


def _read_file(file: Path) -> dict[str, torch.Tensor]:
    try:
        if file.name.endswith(".safetensors"):
            from safetensors.torch import load_file

            state = load_file(str(file))
        else:
            state = torch.load(str(file), map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle, zip and safetensors errors of all kinds
        raise GumihoError(f"could not read {file}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise GumihoError(f"{file} does not hold a state dict of tensors")
    return state


def published_config(folder: Path, state: dict[str, torch.Tensor]) -> HeadConfig:
    """HeadConfig from config.json; the MLP head count and depth come from the tensor names."""
    path = folder / PUBLISHED_CONFIG
    try:
        cfg = json.loads(path.read_text())
        if not isinstance(cfg, dict):
            raise TypeError("not a JSON object")
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        values = dict(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            head_dim=int(cfg["head_dim"]) if cfg.get("head_dim") else None,
        )
        vocab = cfg.get("vocab_size")
    except (ValueError, KeyError, TypeError) as exc:
        raise GumihoError(f"{path} is not a valid Llama-style heads config: missing or bad {exc}") from exc
    scaling = cfg.get("rope_scaling")
    if scaling and (not isinstance(scaling, dict) or float(scaling.get("factor", 1.0)) != 1.0):
        raise GumihoError(f"{path}: rope_scaling {scaling} is not supported by these heads")
    if vocab is None and "embed_tokens.weight" in state:
        vocab = state["embed_tokens.weight"].shape[0]
    if vocab is None:
        raise GumihoError(f"{path} has no vocab_size")
    mlp = [_MLP_KEY.match(k) for k in state]
    mlp = [(int(m.group(1)), int(m.group(2))) for m in mlp if m]
    if not mlp:
        raise GumihoError(f"{folder}: no MLP head weights (mlp.mlp.J.I.linear.*) in the checkpoint")
    num_mlp_heads = max(j for j, _ in mlp) + 1
    mlp_blocks = max(i for _, i in mlp)  # I = 0 is the input layer, 1..n the residual blocks
    return HeadConfig(
        vocab_size=int(vocab), num_mlp_heads=num_mlp_heads, mlp_blocks=mlp_blocks, serial_depth=2,
        target={}, **values,
    )


def our_name(name: str) -> str | None:
    """Our state-dict name for a published one (None: not a name of the published layout)."""
    m = _MLP_KEY.match(name)
    if m:
        j, i, kind = int(m.group(1)), int(m.group(2)), m.group(3)
        return f"mlp_heads.{j}.inp.{kind}" if i == 0 else f"mlp_heads.{j}.blocks.{i - 1}.{kind}"
    if name in ("fc.weight", "fc.bias") or _LAYER_KEY.match(name):
        return name
    return None


def published_name(name: str) -> str:
    """The published name of one of our parameters (for messages about missing tensors)."""
    m = re.match(r"^mlp_heads\.(\d+)\.(inp|blocks\.(\d+))\.(weight|bias)$", name)
    if m:
        i = 0 if m.group(2) == "inp" else int(m.group(3)) + 1
        return f"mlp.mlp.{m.group(1)}.{i}.linear.{m.group(4)}"
    return name


def map_published_state(
    published: dict[str, torch.Tensor], config: HeadConfig, heads: GumihoHeads, where: str
) -> dict[str, torch.Tensor]:
    """Published tensors renamed to ours; refuses unknown, missing and mis-shaped tensors."""
    expected = heads.state_dict()
    state: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for name, tensor in published.items():
        if name in DROPPED:
            if tensor.dim() != 2 or tensor.shape[1] != config.hidden_size:
                raise GumihoError(f"{where}: {name} has shape {tuple(tensor.shape)}, not (vocab, {config.hidden_size})")
            continue
        if _ROTARY_KEY.match(name):  # a derived buffer some old exports saved: check it, drop it
            _check_inv_freq(name, tensor, config, where)
            continue
        ours = our_name(name)
        if ours is None or ours not in expected:
            unexpected.append(name)
            continue
        state[ours] = tensor
    if unexpected:
        unexpected.sort()
        raise GumihoError(
            f"{where}: unexpected tensors in a published Gumiho checkpoint "
            f"({len(unexpected)}): {', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}"
        )
    missing = sorted(published_name(k) for k in set(expected) - set(state))
    if missing:
        raise GumihoError(
            f"{where}: tensors missing from a published Gumiho checkpoint "
            f"({len(missing)}): {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
        )
    for ours, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[ours].shape):
            raise GumihoError(
                f"{where}: tensor {published_name(ours)} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(expected[ours].shape)} from {PUBLISHED_CONFIG}"
            )
        if not tensor.dtype.is_floating_point:
            raise GumihoError(f"{where}: tensor {published_name(ours)} has dtype {tensor.dtype}, expected a float")
    return state


def _check_inv_freq(name: str, tensor: torch.Tensor, config: HeadConfig, where: str) -> None:
    hd = config.attn_head_dim
    ours = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
    if tuple(tensor.shape) != tuple(ours.shape) or not torch.allclose(tensor.float(), ours, rtol=1e-3):
        raise GumihoError(f"{where}: {name} does not match rope_theta {config.rope_theta} of {PUBLISHED_CONFIG}")
