"""Training the Gumiho heads by self-distillation: `python launch.py train --data DIR --out DIR`.

Reads top to bottom: data -> model -> losses -> loop. Indexing follows the engine exactly
(f_t = target feature after token x_t; see draft_tree.py and generate.py):

  serial, depth 1:  u_t  = fc(embed(x_{t+1}), f_t + noise)   -> g_t  ~ f_{t+1}
  serial, depth 2:  u'_t = fc(embed(x_{t+2}), g_t)            -> g2_t ~ f_{t+2}
                    (the head reads its own output, as when drafting; this pass attends to
                     the teacher-forced context of positions <= t and to itself only)
  MLP head j:       cat(u'_t, fc(embed(x_{t+3}), g2_t))       -> ~ f_{t+3+j}

Each prediction gets the Gumiho loss: SmoothL1 against the target feature (weight 1.0)
plus cross-entropy against the target's next-token distribution (weight 0.1, `--token-weight`). The
cross-entropy is taken over the heads' draft vocabulary (the most frequent tokens of the
training data), the same vocabulary the engine drafts from; on this CPU the full 49k
vocabulary for 4 predictions per token would cost ~6x more, and verification always uses
the full vocabulary, so output stays lossless whatever the heads predict.

Built on Hugging Face accelerate: the same command runs on this CPU or, through
`accelerate launch` and its config, on several GPUs (DDP / DeepSpeed).
"""
from __future__ import annotations

import json
import math
import random
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from .errors import GumihoError
from .heads import GumihoHeads, HeadCheckpoint, HeadConfig, causal_mask, with_draft_vocab

DRAFT_VOCAB_SIZE = 4096  # fresh heads' draft vocabulary: ~91 % of the default model's answer tokens
V_WEIGHT, P_WEIGHT = 1.0, 0.1  # Gumiho: features loss 1.0, distribution loss 0.1
NOISE_STD = 0.2  # uniform noise on input features, scaled by 512 / hidden as in the reference


# -- data -----------------------------------------------------------------------------------


def frequent_tokens(conversations: list[dict], size: int, always: set[int]) -> list[int]:
    """The draft vocabulary: `always` (e.g. EOS), then the most frequent answer tokens, then
    the lowest ids never seen (BPE vocabularies list frequent merges first)."""
    counts = Counter()
    for c in conversations:
        counts.update(c["input_ids"][c["loss_mask"]].tolist())
    ids = set(always)
    ranked = [int(t) for t, _ in counts.most_common()]
    for token in ranked + list(range(size + len(ranked))):
        if len(ids) >= size:
            break
        ids.add(token)
    return sorted(ids)


def batches(conversations: list[dict], batch_size: int, max_len: int, seed: int, epoch: int):
    """Right-padded batches in an order fixed by (seed, epoch), so a resumed run sees the same data."""
    order = list(EpochOrder(len(conversations), seed, epoch))
    for start in range(0, len(order), batch_size):
        chunk = [conversations[i] for i in order[start : start + batch_size]]
        yield collate(chunk, max_len)


class EpochOrder(torch.utils.data.Sampler):
    """A shuffle fixed by (seed, epoch): a resumed run sees the same data in the same order.

    Given the conversations' lengths, batches are made of similar lengths (sorted within
    windows of 16 batches, then the batches shuffled): right padding to the longest row
    otherwise wastes about a third of the compute on chat data.
    """

    def __init__(self, n: int, seed: int, epoch: int = 0, lengths: list[int] | None = None, batch_size: int = 1):
        self.n, self.seed, self.epoch = n, seed, epoch
        self.lengths, self.batch_size = lengths, batch_size

    def set_epoch(self, epoch: int) -> None:  # accelerate's prepared loader forwards this
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        rng = random.Random(self.seed * 1000 + self.epoch)
        order = list(range(self.n))
        rng.shuffle(order)
        if self.lengths is not None and self.batch_size > 1 and self.n:
            bs, window = self.batch_size, self.batch_size * 16
            groups = []
            for start in range(0, self.n, window):
                chunk = sorted(order[start : start + window], key=lambda i: self.lengths[i])
                groups += [chunk[k : k + bs] for k in range(0, len(chunk), bs)]
            tail = [groups.pop()] if len(groups[-1]) < bs else []  # a short batch stays last
            rng.shuffle(groups)
            order = [i for g in groups + tail for i in g]
        return iter(order)


def data_loader(conversations: list[dict], batch_size: int, max_len: int, seed: int):
    """A DataLoader, so accelerate can shard it across processes and knows where an epoch ends."""
    lengths = [min(len(c["input_ids"]), max_len) for c in conversations]
    return torch.utils.data.DataLoader(
        conversations, batch_size=batch_size,
        sampler=EpochOrder(len(conversations), seed, lengths=lengths, batch_size=batch_size),
        collate_fn=lambda chunk: collate(chunk, max_len))


def collate(chunk: list[dict], max_len: int) -> dict:
    length = min(max_len, max(len(c["input_ids"]) for c in chunk))
    hidden = chunk[0]["features"].shape[1]
    ids = torch.zeros(len(chunk), length, dtype=torch.long)
    feats = torch.zeros(len(chunk), length, hidden)
    mask = torch.zeros(len(chunk), length)
    for row, c in enumerate(chunk):
        n = min(length, len(c["input_ids"]))
        ids[row, :n] = c["input_ids"][:n]
        feats[row, :n] = c["features"][:n]
        mask[row, :n] = c["loss_mask"][:n].float()
    return {"input_ids": ids, "features": feats, "loss_mask": mask}


# -- model ------------------------------------------------------------------------------------


class DraftTrainer(nn.Module):
    """The heads plus the target's frozen embedding and (draft-vocabulary) lm_head."""

    def __init__(self, heads: GumihoHeads, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                 token_weight: float = P_WEIGHT):
        super().__init__()
        self.heads = heads
        self.token_weight = token_weight
        vocab = heads.draft_vocab
        self.register_buffer("embed_weight", embed_weight.detach().float().clone(), persistent=False)
        self.register_buffer("head_weight", lm_head_weight.detach().float()[vocab].clone(), persistent=False)
        self.register_buffer("full_head_weight", lm_head_weight.detach().float(), persistent=False)

    def embed(self, ids):
        return F.embedding(ids, self.embed_weight)

    def forward(self, batch: dict, noise: torch.Tensor | None = None, measure: bool = False) -> dict:
        ids, f, m = batch["input_ids"], batch["features"], batch["loss_mask"]
        b, t, h = f.shape
        heads = self.heads
        positions = torch.arange(t, device=f.device)
        f_in = f if noise is None else f + noise

        # serial, depth 1 (teacher forcing over the whole sequence, with a cache for depth 2)
        cache = heads.new_cache()
        u = heads.fc_input(self.embed(ids[:, 1:]), f_in[:, :-1])  # (b, t-1, h)
        g = heads.serial(u, positions[: t - 1], cache)
        # serial, depth 2: query q (position q+1) sees cached positions <= q and itself
        q = t - 2
        u2 = heads.fc_input(self.embed(ids[:, 2:]), g[:, :q])
        mask = torch.cat([causal_mask(q, 0, f.device)[:, :q], torch.zeros(q, 1, dtype=torch.bool, device=f.device),
                          torch.eye(q, dtype=torch.bool, device=f.device)], dim=1)
        g2 = heads.serial(u2, positions[1 : q + 1], cache, mask=mask[None, None])
        # MLP heads on [u'_t, fc(embed(x_{t+3}), g2_t)]
        pair = torch.cat([u2[:, : t - 3], heads.fc_input(self.embed(ids[:, 3:]), g2[:, : t - 3])], dim=-1)
        mlp_out = heads.parallel(pair)  # (heads, b, t-3, h)

        predictions = [(g, 1), (g2, 2)] + [(mlp_out[j, :, : t - 3 - j], 3 + j) for j in range(mlp_out.shape[0])]
        # The teacher's side in float32 even under bf16 autocast: its argmax is what the
        # target would pick, and rounding it would blur the soft labels.
        with torch.no_grad(), torch.autocast(f.device.type, enabled=False):
            target_logp = torch.log_softmax(f @ self.head_weight.T, dim=-1)  # (b, t, V')
            target_token = (f @ self.full_head_weight.T).argmax(-1) if measure else None
        losses, metrics = [], {}
        for pred, shift in predictions:
            n = pred.shape[1]
            want, w = f[:, shift : shift + n], m[:, shift : shift + n]
            denom = w.sum() + 1e-5
            v = (F.smooth_l1_loss(pred, want, reduction="none").mean(-1) * w).sum() / denom
            logp = torch.log_softmax(pred @ self.head_weight.T, dim=-1)
            p = -((target_logp[:, shift : shift + n].exp() * logp).sum(-1) * w).sum() / denom
            losses.append(V_WEIGHT * v + self.token_weight * p)
            if measure:
                drafted = self.heads.draft_vocab[logp.argmax(-1)]
                metrics[shift] = (drafted == target_token[:, shift : shift + n], w)
        out = {"loss": torch.stack(losses).sum()}
        if measure:
            out["correct"] = metrics
        return out


def new_trainable_heads(target, draft_vocab: list[int], seed: int = 0, **overrides) -> GumihoHeads:
    """Fresh heads for `target`: the serial head starts as "the next feature is this one"."""
    torch.manual_seed(seed)
    config = HeadConfig.for_target(target, draft_vocab_size=len(draft_vocab), **overrides)
    heads = GumihoHeads(config)
    h = config.hidden_size
    with torch.no_grad():
        heads.fc.weight.zero_()
        heads.fc.weight[:, h:] = torch.eye(h)  # u = f at first
        heads.fc.weight[:, :h].normal_(0, 0.02)
        heads.fc.bias.zero_()
        for layer in heads.layers:  # residual branches start closed
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        heads.draft_vocab.copy_(torch.tensor(draft_vocab))
    return heads


# -- evaluation ---------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(model: DraftTrainer, conversations: list[dict], batch_size: int, max_len: int) -> dict:
    """Greedy chain accuracy per depth (what the engine's top beam would get accepted) and tau."""
    model.eval()
    chains, offered = None, None
    loss_sum, n_batches = 0.0, 0
    for start in range(0, len(conversations), batch_size):
        batch = collate(conversations[start : start + batch_size], max_len)
        out = model(batch, measure=True)
        loss_sum += float(out["loss"])
        n_batches += 1
        correct = out["correct"]
        depths = sorted(correct)
        n = min(c.shape[1] for c, _ in correct.values())  # positions where every depth exists
        alive = torch.ones_like(correct[depths[0]][0][:, :n], dtype=torch.bool)
        weight = correct[depths[0]][1][:, :n] > 0
        if chains is None:
            chains, offered = [0.0] * len(depths), [0.0] * len(depths)
        for i, d in enumerate(depths):
            offered[i] += float((alive & weight).sum())
            alive = alive & correct[d][0][:, :n]
            chains[i] += float((alive & weight).sum())
    model.train()
    positions = offered[0] or 1.0
    accuracy = [c / o if o else 0.0 for c, o in zip(chains, offered)]  # P(depth d right | d-1 right)
    return {"loss": loss_sum / max(n_batches, 1), "accuracy_per_depth": accuracy,
            "tau_estimate": 1.0 + sum(c / positions for c in chains)}


# -- the loop -------------------------------------------------------------------------------------


def cpu_has_native_bf16() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def train(
    target,
    data_dir: str | Path | list,
    out_dir: str | Path,
    epochs: int = 4,
    batch_size: int = 8,
    grad_accum: int = 1,
    lr: float = 1e-3,
    warmup_steps: int = 50,
    max_len: int = 512,
    draft_vocab_size: int | None = None,
    val_fraction: float = 0.05,
    seed: int = 0,
    resume: bool = True,
    mixed_precision: str = "no",
    init: str | Path | None = None,
    token_weight: float = P_WEIGHT,
    log=print,
    progress: bool = False,
) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    folders = [Path(d) for d in (data_dir if isinstance(data_dir, (list, tuple)) else [data_dir])]
    out_dir = Path(out_dir)
    val, train_set = _split_data(target, folders, val_fraction, seed)
    if mixed_precision not in ("no", "bf16"):
        raise GumihoError(f"mixed_precision must be 'no' or 'bf16' (got {mixed_precision!r})")
    accelerator = Accelerator(gradient_accumulation_steps=grad_accum, cpu=not torch.cuda.is_available())
    if mixed_precision == "bf16" and accelerator.device.type == "cpu" and not cpu_has_native_bf16():
        log("warning: this CPU has no native bf16 (AVX512-BF16 or AMX), so bf16 autocast is emulated "
            "and far slower (95 s instead of 2.8 s a batch on an AVX2 machine): use --mixed-precision no")
    set_seed(seed)
    heads = _starting_heads(target, train_set, init, draft_vocab_size, seed, log)
    model = DraftTrainer(heads, target.embed_tokens.weight, target.lm_head.weight, token_weight)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    # Each process reads its share of the batches; an epoch ends with an optimizer step.
    loader = data_loader(train_set, batch_size, max_len, seed)
    steps_per_epoch = math.ceil(math.ceil(len(loader) / accelerator.num_processes) / grad_accum)
    schedule = _warmup_cosine(warmup_steps, max(1, steps_per_epoch * epochs))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    run = _Run(accelerator, model, optimizer, scheduler, loader, out_dir, epochs, seed, mixed_precision, log)
    start_epoch, history = run.resume() if resume else (0, [])
    start_metrics = None
    if init is not None and val and start_epoch == 0:
        # The yardstick for a warm start: the same validation of the heads it starts from, so
        # the log says whether the new data improves on them (or the restart hurt them).
        start_metrics = evaluate(accelerator.unwrap_model(model), val, batch_size, max_len)
        log(f"starting heads: {_format_metrics(start_metrics)}")
    step = start_epoch * steps_per_epoch
    record = {"data": [str(f) for f in folders], "init": str(init) if init is not None else None,
              "conversations": len(train_set), "tokens": sum(len(c["input_ids"]) for c in train_set),
              "lr": lr, "batch_size": batch_size, "token_weight": token_weight}
    for epoch in range(start_epoch, epochs):
        started = time.time()
        losses, step = run.epoch(epoch, step, target.hidden_size, progress)
        metrics = evaluate(accelerator.unwrap_model(model), val, batch_size, max_len) if val else {}
        entry = {"epoch": epoch + 1, "step": step, "train_loss": sum(losses) / max(len(losses), 1),
                 "seconds": time.time() - started, **metrics}
        history.append(entry)
        log(f"epoch {epoch + 1}/{epochs}: train loss {entry['train_loss']:.4f}, {_format_metrics(metrics)} "
            f"({entry['seconds']:.0f} s)")
        run.save(epoch, step, history, record, start_metrics)
    return {"history": history, "heads": str(out_dir / "heads"), "start": start_metrics}


def _split_data(target, folders: list[Path], val_fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(validation, training) conversations from several train-data folders read as one set."""
    from .train_data import load_conversations, read_manifest

    conversations = []
    for folder in folders:
        manifest = read_manifest(folder)
        if manifest["target"]["hidden_size"] != target.hidden_size or manifest["target"]["vocab_size"] != target.vocab_size:
            raise GumihoError(f"{folder} was made with {manifest['target']['name']}, not with {target.name}")
        conversations += [c for c in load_conversations(folder) if len(c["input_ids"]) >= 8]
    random.Random(seed).shuffle(conversations)
    n_val = max(1, int(len(conversations) * val_fraction)) if len(conversations) > 1 else 0
    return conversations[:n_val], conversations[n_val:] or conversations


def _starting_heads(target, train_set: list[dict], init, draft_vocab_size: int | None, seed: int, log) -> GumihoHeads:
    def draft_vocab(size: int) -> list[int]:  # the training answers' most frequent tokens
        return frequent_tokens(train_set, min(size, target.vocab_size), target.eos_token_ids)

    if init is None:
        return new_trainable_heads(target, draft_vocab(draft_vocab_size or DRAFT_VOCAB_SIZE), seed)
    # Warm start: a new run (fresh optimizer and schedule) from trained heads, e.g. the
    # shipped ones on a larger data set. Their draft vocabulary and shape are kept.
    heads = HeadCheckpoint.load(init, target, device="cpu", dtype=torch.float32)
    if draft_vocab_size:  # the weights do not depend on it: it only picks rows of the frozen lm_head
        heads = with_draft_vocab(heads, draft_vocab(draft_vocab_size))
    heads.train()
    heads.requires_grad_(True)
    log(f"starting from the heads in {init} (draft vocabulary {heads.config.draft_vocab_size})")
    return heads


def _warmup_cosine(warmup_steps: int, total_steps: int):
    def schedule(step):  # linear warm-up, cosine decay to 10%
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return schedule


class _Run:
    """One training run's moving parts: an epoch of steps, and the state saved after it."""

    def __init__(self, accelerator, model, optimizer, scheduler, loader, out_dir: Path, epochs: int, seed: int,
                 mixed_precision: str, log):
        self.accelerator, self.model, self.optimizer, self.scheduler, self.loader = (
            accelerator, model, optimizer, scheduler, loader)
        self.state_dir, self.progress_file = out_dir / "state", out_dir / "progress.json"
        self.heads_dir = out_dir / "heads"
        self.epochs, self.seed, self.mixed_precision, self.log = epochs, seed, mixed_precision, log

    def resume(self) -> tuple[int, list]:
        """(epochs done, history) from the run folder; (0, []) if it holds no state."""
        if not (self.progress_file.is_file() and self.state_dir.is_dir()):
            return 0, []
        progress = json.loads(self.progress_file.read_text())
        self.accelerator.load_state(str(self.state_dir))
        self.log(f"resuming after epoch {progress['epoch']} (step {progress['step']})")
        planned = progress.get("planned_epochs", self.epochs)
        if planned != self.epochs:  # the cosine schedule spans the planned epochs
            self.log(f"note: this run was planned for {planned} epochs and now runs {self.epochs}: the learning-"
                     "rate schedule changes from here on, so it will not equal an uninterrupted run of either length")
        return progress["epoch"], progress["history"]

    def epoch(self, epoch: int, step: int, hidden: int, progress: bool) -> tuple[list[float], int]:
        """One pass over the training batches. Returns (losses, optimizer steps so far)."""
        accelerator, model, losses = self.accelerator, self.model, []
        self.loader.set_epoch(epoch)
        bar = tqdm(self.loader, desc=f"epoch {epoch + 1}/{self.epochs}", unit="batch", leave=False,
                   disable=not (progress and accelerator.is_main_process))
        for micro, batch in enumerate(bar):
            # Noise drawn from a generator seeded by position in the run: a resumed run
            # draws exactly what an uninterrupted one would.
            rank = accelerator.process_index
            gen = torch.Generator().manual_seed(self.seed * 100_003 + epoch * 10_007 + micro + rank * 1_000_003)
            noise = (torch.rand(batch["features"].shape, generator=gen) - 0.5) * NOISE_STD * 512 / hidden
            # bf16 autocast of the heads' matmuls: ~1.6x faster on a CPU with AVX512-BF16 (and
            # on GPUs); parameters and optimizer state stay float32, so no loss scaling is needed.
            # (Our own autocast, not Accelerator(mixed_precision=...): accelerate keeps that
            # setting process-wide, so a second run in one process could not change it.)
            with accelerator.accumulate(model):
                with torch.autocast(accelerator.device.type, dtype=torch.bfloat16,
                                    enabled=self.mixed_precision == "bf16"):
                    loss = model(batch, noise=noise.to(accelerator.device))["loss"]
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 0.5)
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad()
            losses.append(float(loss.detach()))
            bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}", refresh=False)
            if accelerator.sync_gradients:
                step += 1
        return losses, step

    def save(self, epoch: int, step: int, history: list, record: dict, start_metrics: dict | None) -> None:
        """The resumable state (every process), the heads and the progress file (main process)."""
        accelerator = self.accelerator
        accelerator.save_state(str(self.state_dir))  # every process: RNG files per rank, sharded optimizers
        if accelerator.is_main_process:
            heads_out = accelerator.unwrap_model(self.model).heads
            HeadCheckpoint.save(heads_out, self.heads_dir,
                                training={**record, "epochs": epoch + 1, "history": history})
            progress = {"epoch": epoch + 1, "step": step, "planned_epochs": self.epochs, "history": history}
            if start_metrics is not None:
                progress["start"] = start_metrics
            self.progress_file.write_text(json.dumps(progress, indent=1))
        accelerator.wait_for_everyone()


def _format_metrics(metrics: dict) -> str:
    acc = " ".join(f"d{i + 1} {a:.2f}" for i, a in enumerate(metrics.get("accuracy_per_depth", [])))
    return f"val loss {metrics.get('loss', 0):.4f}, accuracy {acc}, tau estimate {metrics.get('tau_estimate', 0):.2f}"


# -- tiny heads for engine tests -------------------------------------------------------------------


def train_tiny_heads(target, steps: int = 200, prompts: list[list[int]] | None = None, max_new_tokens: int = 48,
                     lr: float = 1e-3, seed: int = 0) -> GumihoHeads:
    """Heads that guess a tiny target well, for tests that need deep accepted paths (< 30 s).

    A random target's greedy text is a function of its weights only, so no small data set
    teaches it. Instead the serial head starts as a copy of the target's own decoder layers
    (as many serial layers as the target has), with fc passing the token embedding through
    scaled to unit RMS (our first layer has no input norm); shifted by one position that
    computes nearly the target's next feature. A short self-distillation run then tunes it
    and trains the MLP heads. Only for targets small enough to copy (tests).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: extra threads only fight over a shared CPU
    try:
        return _train_tiny_heads(target, steps, prompts, max_new_tokens, lr, seed)
    finally:
        torch.set_num_threads(threads)


def _train_tiny_heads(target, steps, prompts, max_new_tokens, lr, seed) -> GumihoHeads:
    import tempfile

    from .heads import place
    from .train_data import generate_dataset, load_conversations

    base_state = target.base.state_dict()
    torch.manual_seed(seed)
    if prompts is None:
        g = torch.Generator().manual_seed(seed)
        vocab = target.vocab_size
        prompts = [[1] + torch.randint(3, vocab, (int(torch.randint(3, 16, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(64)]
    with tempfile.TemporaryDirectory() as folder:
        generate_dataset(target, folder, prompts, max_new_tokens=max_new_tokens, batch_size=32, shard_size=len(prompts),
                         mask="all", progress=False)
        conversations = load_conversations(folder)

    draft_vocab = list(range(target.vocab_size))
    heads = new_trainable_heads(target, draft_vocab, seed, num_layers=target.config.num_hidden_layers)
    h = target.hidden_size
    with torch.no_grad():
        rms = target.embed_tokens.weight.float().pow(2).mean(-1).sqrt().mean()
        heads.fc.weight.zero_()
        heads.fc.weight[:, :h] = torch.diag(base_state["layers.0.input_layernorm.weight"].float()) / rms
        heads.fc.bias.zero_()
        for i, layer in enumerate(heads.layers):
            for name, param in layer.named_parameters():
                param.copy_(base_state[f"layers.{i}.{name}"].float())

    model = DraftTrainer(heads, target.embed_tokens.weight, target.lm_head.weight)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=lr, betas=(0.9, 0.95))
    step, epoch = 0, 0
    while step < steps:
        for batch in batches(conversations, 8, 512, seed, epoch):
            loss = model(batch)["loss"]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(heads.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step >= steps:
                break
        epoch += 1
    return place(heads, target)


# -- shipping -------------------------------------------------------------------------------------


def export_heads(source: str | Path, dest: str | Path, dtype: str = "float16") -> Path:
    """Copy a heads checkpoint with its float weights stored in float16/bfloat16.

    The default model's heads are ~19M parameters: 78 MB in float32, over the 50 MB the
    repository ships. Loading casts back (load_state_dict copies into float32 parameters;
    `place` then moves them to the target's dtype); the draft vocabulary stays int64.
    """
    import copy

    dtypes = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
    if dtype not in dtypes:
        raise GumihoError(f"unknown dtype {dtype!r}: use float16, bfloat16 or float32")
    heads = HeadCheckpoint.load(source)
    _, training = HeadCheckpoint.read_config(source)
    compact = copy.deepcopy(heads).to(dtypes[dtype])  # Module.to(dtype) leaves integer buffers alone
    return HeadCheckpoint.save(compact, dest, training={**training, "stored_dtype": dtype, "exported_from": str(source)})
