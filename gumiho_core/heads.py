"""The Gumiho draft model: a serial Transformer head and parallel MLP heads.

Feature-level drafting as in EAGLE: the serial head reads u = fc([embed(token), feature])
(2H -> H) and runs `num_layers` Llama decoder layers (the first without input norm) to
predict the next feature; the target's own lm_head turns features into logits. It drafts
the first `serial_depth` tokens one after another. The `num_mlp_heads` MLP heads then predict
the later depths all at once from the last two serial inputs [u_s, u_{s+1}] (2H -> H).

Embeddings and lm_head are the target's, shared and frozen: they are passed in, never
stored in a checkpoint. `HeadCheckpoint` saves and loads our format (safetensors + JSON).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .cpu_matmul import fast_linear
from .errors import GumihoError

WEIGHTS_FILE = "heads.safetensors"
CONFIG_FILE = "heads.json"
FORMAT_VERSION = 1


@dataclass
class HeadConfig:
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    num_layers: int = 2  # serial decoder layers
    serial_depth: int = 2  # draft depths produced by the serial head
    num_mlp_heads: int = 5  # one MLP head per later depth
    mlp_blocks: int = 5  # residual blocks per MLP head
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    head_dim: int | None = None
    # Drafting over the whole vocabulary costs a 49k-row lm_head per draft row on the
    # default model; heads may carry a list of frequent token ids to draft from instead
    # (0 = the whole vocabulary). Verification always uses the full vocabulary.
    draft_vocab_size: int = 0
    target: dict = field(default_factory=dict)  # name / sizes of the target trained for

    @property
    def attn_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def max_depth(self) -> int:
        return self.serial_depth + self.num_mlp_heads

    @classmethod
    def for_target(cls, target, **overrides) -> "HeadConfig":
        """Sizes taken from the target, so the heads fit whatever model is loaded."""
        cfg = target.config
        values = dict(
            hidden_size=cfg.hidden_size,
            vocab_size=target.vocab_size,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            intermediate_size=cfg.intermediate_size,
            rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-5)),
            rope_theta=float(_rope_theta(cfg)),
            head_dim=getattr(cfg, "head_dim", None),
            target=target_signature(target),
        )
        values.update(overrides)
        return cls(**values)


def _rope_theta(cfg) -> float:
    theta = getattr(cfg, "rope_theta", None)
    if theta is None:
        params = getattr(cfg, "rope_parameters", None) or {}
        theta = params.get("rope_theta", 10000.0)
    return theta


def target_signature(target) -> dict:
    return {"name": target.name, "hidden_size": target.hidden_size, "vocab_size": target.vocab_size}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary(positions: torch.Tensor, head_dim: int, theta: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class Attention(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.attn_head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.n_heads * self.hd, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.n_kv * self.hd, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.n_kv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.hd, c.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask, cache: "DraftCache | None", layer: int):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.hd).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if cache is not None:
            k, v = cache.append(layer, k, v)
        # enable_gqa: query heads share KV heads inside SDPA, no repeated copy of the cache.
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_kv != self.n_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: HeadConfig, index: int):
        super().__init__()
        # The first layer reads fc's output directly: fc already mixes a normed feature
        # with an embedding, and EAGLE/Gumiho drop this norm.
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps) if index > 0 else nn.Identity()
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)
        self.index = index

    def forward(self, x, cos, sin, mask, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, self.index)
        return x + self.mlp(self.post_attention_layernorm(x))


class ParallelHead(nn.Module):
    """One MLP head: Linear(2H->H)+SiLU, then residual blocks x + SiLU(Linear(H->H)).

    Weights start at zero (as in Gumiho) so an untrained head predicts a constant and
    training moves it away gently.
    """

    def __init__(self, hidden: int, blocks: int):
        super().__init__()
        self.inp = nn.Linear(2 * hidden, hidden)
        self.blocks = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(blocks))
        for layer in [self.inp, *self.blocks]:
            nn.init.zeros_(layer.weight)

    def forward(self, x):
        x = F.silu(self.inp(x))
        for block in self.blocks:
            x = x + F.silu(block(x))
        return x


class DraftCache:
    """Per-layer keys/values of the serial head: (1, kv_heads, T, head_dim) each."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def __len__(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def crop(self, length: int) -> None:
        for i, k in enumerate(self.keys):
            if k is not None:
                self.keys[i] = k[:, :, :length]
                self.values[i] = self.values[i][:, :, :length]


class GumihoHeads(nn.Module):
    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.mlp_heads = nn.ModuleList(ParallelHead(h, config.mlp_blocks) for _ in range(config.num_mlp_heads))
        if config.draft_vocab_size:
            self.register_buffer("draft_vocab", torch.arange(config.draft_vocab_size))
        else:
            self.draft_vocab = None
        # The serial layers in one C call (fast_heads.py), set on a drafting copy where it runs.
        self.one_call = None

    @property
    def dtype(self) -> torch.dtype:
        # A norm's weight: an inference copy's linear layers may hold a packed weight only.
        return self.layers[0].post_attention_layernorm.weight.dtype

    def new_cache(self) -> DraftCache:
        return DraftCache(self.config.num_layers) if self.one_call is None else self.one_call.new_cache()

    def fc_input(self, token_embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """u = fc([embed(token), feature]): the serial head's input, also the MLP heads' input."""
        return self.fc(torch.cat([token_embeds.to(features.dtype), features], dim=-1))

    def serial(
        self,
        u: torch.Tensor,
        positions: torch.Tensor,
        cache: DraftCache | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the serial decoder layers on fc inputs u (1, T, H).

        mask: bool (T, cache_len + T), True = may attend. None = causal over cache + new.
        """
        ancestors = None if self.one_call is None else self.one_call.ancestors(cache, mask, u.shape[1])
        if ancestors is not None:
            return self.one_call(u, positions, cache, ancestors)
        cos, sin = rotary(positions, self.config.attn_head_dim, self.config.rope_theta, u.dtype)
        cos, sin = cos[None, None], sin[None, None]
        t = u.shape[1]
        past = 0 if cache is None else len(cache)
        if mask is None:
            mask = causal_mask(t, past, u.device)
        x = u
        for layer in self.layers:
            x = layer(x, cos, sin, mask, cache)
        return x

    def parallel(self, u_pair: torch.Tensor, count: int | None = None) -> torch.Tensor:
        """The first `count` MLP heads (default all) on [u_s, u_{s+1}] (..., 2H) -> (count, ..., H).
        A shallow draft tree asks for few: each head is six products of its own."""
        return torch.stack([head(u_pair) for head in self.mlp_heads[:count]])


def with_draft_vocab(heads: GumihoHeads, token_ids) -> GumihoHeads:
    """Copy of `heads` that drafts only from `token_ids` (e.g. the most frequent tokens)."""
    ids = torch.as_tensor(sorted(set(int(t) for t in token_ids)), dtype=torch.long)
    config = HeadConfig(**{**asdict(heads.config), "draft_vocab_size": len(ids)})
    out = GumihoHeads(config).to(device=heads.fc.weight.device, dtype=heads.dtype)
    state = {k: v for k, v in heads.state_dict().items() if k != "draft_vocab"}
    out.load_state_dict({**state, "draft_vocab": ids.to(heads.fc.weight.device)})
    out.eval().requires_grad_(False)
    return out


class DraftVocabProjection:
    """The target's lm_head restricted to the heads' draft vocabulary: draft logits from features.

    Not a head of its own: the rows of the target's lm_head for the draft vocabulary's
    tokens (or the whole lm_head, shared, when the heads draft over every token).
    """

    def __init__(self, lm_head: nn.Module, token_ids: torch.Tensor | None = None, dtype=None, layout=fast_linear):
        """dtype: the draft rows' precision (the heads'); default the lm_head's. layout: the
        draft rows' layer from an nn.Linear (default cpu_matmul's fast layout)."""
        self.token_ids = token_ids
        self.dtype = lm_head.weight.dtype if token_ids is None else (dtype or lm_head.weight.dtype)
        self.project = lm_head  # the full vocabulary: the target's own lm_head as it is
        if token_ids is not None:
            bias = getattr(lm_head, "bias", None)
            rows = nn.Linear(lm_head.weight.shape[1], len(token_ids), bias=bias is not None,
                             device=lm_head.weight.device, dtype=self.dtype)
            rows.weight.data = lm_head.weight.detach()[token_ids].to(self.dtype).contiguous()
            if bias is not None:
                rows.bias.data = bias.detach()[token_ids].to(self.dtype)
            self.project = layout(rows.requires_grad_(False))  # our own layer: no copy needed

    def log_probs(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.project(x.to(self.dtype)).float(), dim=-1)

    def tokens(self, index: torch.Tensor) -> torch.Tensor:
        """Positions in the draft vocabulary -> token ids of the target."""
        return index if self.token_ids is None else self.token_ids[index]


def causal_mask(t: int, past: int, device) -> torch.Tensor:
    mask = torch.ones(t, past + t, dtype=torch.bool, device=device)
    return mask.tril(diagonal=past)


class HeadCheckpoint:
    """Our checkpoint format: a folder with heads.safetensors and heads.json.

    heads.json: {"format": 1, "config": HeadConfig fields, "training": {...}}.
    """

    @staticmethod
    def save(heads: GumihoHeads, folder: str | Path, training: dict | None = None) -> Path:
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in heads.state_dict().items()}
        save_file(state, str(folder / WEIGHTS_FILE))
        meta = {"format": FORMAT_VERSION, "config": asdict(heads.config), "training": training or {}}
        (folder / CONFIG_FILE).write_text(json.dumps(meta, indent=2))
        return folder

    @staticmethod
    def read_config(folder: str | Path) -> tuple[HeadConfig, dict]:
        folder = Path(folder)
        if not folder.exists():
            raise GumihoError(f"heads not found: {folder}")
        if not (folder / CONFIG_FILE).is_file() or not (folder / WEIGHTS_FILE).is_file():
            raise GumihoError(f"{folder} is not a heads checkpoint (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
        try:
            meta = json.loads((folder / CONFIG_FILE).read_text())
            config = HeadConfig(**meta["config"])
        except (ValueError, KeyError, TypeError) as exc:
            raise GumihoError(f"{folder / CONFIG_FILE} is not a valid heads config: {exc}") from exc
        return config, meta.get("training", {})

    @staticmethod
    def load(folder: str | Path, target=None, device=None, dtype=None) -> GumihoHeads:
        from safetensors.torch import load_file

        folder = Path(folder)
        config, _ = HeadCheckpoint.read_config(folder)
        if target is not None:
            check_heads_match(config, target, str(folder))
        heads = GumihoHeads(config)
        try:
            state = load_file(str(folder / WEIGHTS_FILE))
        except Exception as exc:  # safetensors raises its own error types
            raise GumihoError(f"could not read {folder / WEIGHTS_FILE}: {exc}") from exc
        load_state_strict(heads, state, str(folder))
        return place(heads, target, device, dtype)


def place(heads: GumihoHeads, target=None, device=None, dtype=None) -> GumihoHeads:
    if target is not None:
        device = device or target.device
        dtype = dtype or _float_dtype(target)
    heads.to(device=device or "cpu", dtype=dtype or torch.float32)
    heads.eval()
    heads.requires_grad_(False)
    return heads


def _float_dtype(target) -> torch.dtype:
    # Heads draft in the activations' precision of the passes they feed: bfloat16 where the
    # fast decoder runs bfloat16 / int8 / int4 (half the bytes a draft step reads; drafting's
    # arithmetic changes what is proposed, never what is accepted).
    fast = getattr(target, "fast", None)
    if fast is not None and fast.dtype == torch.bfloat16:
        return torch.bfloat16
    dtype = target.embed_tokens.weight.dtype
    return dtype if dtype.is_floating_point else torch.float32


def load_state_strict(heads: GumihoHeads, state: dict, where: str) -> None:
    expected = heads.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise GumihoError(
            f"{where}: heads weights do not fit their config "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise GumihoError(
                f"{where}: tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(expected[name].shape)}"
            )
    heads.load_state_dict(state)


def check_heads_match(config: HeadConfig, target, where: str) -> None:
    """Refuse heads trained for another target, with a message that says which."""
    if config.hidden_size != target.hidden_size or config.vocab_size != target.vocab_size:
        raise GumihoError(
            f"heads {where} do not match the target {target.name}: they expect hidden size "
            f"{config.hidden_size} and vocabulary {config.vocab_size}, the target has "
            f"{target.hidden_size} and {target.vocab_size}"
        )
    trained_for = config.target.get("name")
    if trained_for and trained_for != target.name:
        raise GumihoError(f"heads {where} were trained for {trained_for}, not for the loaded target {target.name}")


def new_heads(target, **overrides) -> GumihoHeads:
    """Untrained heads sized for `target` (lossless, but they rarely guess right)."""
    torch.manual_seed(overrides.pop("seed", 0))
    heads = GumihoHeads(HeadConfig.for_target(target, **overrides))
    # Near-identity fc start: u ~ the target feature, so the serial head begins close to
    # "predict the feature back" rather than noise.
    with torch.no_grad():
        h = heads.config.hidden_size
        heads.fc.weight.normal_(0, 1 / math.sqrt(2 * h))
        heads.fc.bias.zero_()
    return place(heads, target)
