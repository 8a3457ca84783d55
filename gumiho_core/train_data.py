"""Self-distilled training data for the Gumiho heads: `python launch.py train-data ...`.

The heads must imitate the *target*, so the data is the target talking to itself: it
answers a set of prompts (greedy, batched with left padding) through its own chat
template, and for every finished conversation we store
  - input_ids: the whole conversation (prompt + answer), int32;
  - features:  the target's last-layer hidden states, post final norm
               (`target.base(...).last_hidden_state`, exactly what the heads read at
               draft time), float16 by default;
  - loss_mask: 1 where training should count (the answer tokens, or every token).

Layout of an output folder:
  manifest.json           {"format", "target", "mask", "shards": [...], "done": [...]}
  shard-00000.safetensors  conversations concatenated; `offsets` marks where each starts

Interrupting and rerunning the same command resumes: prompts already in a shard are
skipped (the manifest lists their indices), and a shard appears in the manifest only once
it is fully written.

Prompts come from a built-in generator (chat, writing, coding, math word problems,
summarisation, factual questions, multi-turn), from the target itself (`--self-prompts N`:
it writes user requests when given only the opening of a user turn), and/or a JSONL file
the user gives. The
benchmark question files (/work/shared/bench, or any file named like them) are refused:
training on the test set would make tau meaningless.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import GumihoError

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
BENCH_NAMES = {"mt_bench.jsonl", "humaneval.jsonl", "gsm8k.jsonl"}


# ---------------------------------------------------------------------------------------
# Prompts: the built-in generator lives in prompts.py; here, the user's JSONL file
# ---------------------------------------------------------------------------------------


def read_prompt_file(path: str | Path) -> list[list[str]]:
    """A JSONL file of prompts: each line {"turns": [...]}, {"prompt": "..."}, or a JSON string."""
    path = Path(path)
    if path.name in BENCH_NAMES or "bench" in path.parts:
        raise GumihoError(f"{path} looks like a benchmark question file: never train on the benchmark")
    if not path.is_file():
        raise GumihoError(f"prompt file not found: {path}")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise GumihoError(f"{path}:{n} is not valid JSON: {exc}") from exc
        turns = item if isinstance(item, str) else item.get("turns") or item.get("prompt")
        turns = [turns] if isinstance(turns, str) else turns
        if not turns or not all(isinstance(t, str) for t in turns):
            raise GumihoError(f"{path}:{n}: expected a string, or an object with 'turns' or 'prompt'")
        out.append(turns)
    return out


# ---------------------------------------------------------------------------------------
# Prompts written by the target itself (--self-prompts)
# ---------------------------------------------------------------------------------------
SELF_PROMPTS = "self_prompts.jsonl"


def user_turn_opening(target) -> list[int]:
    """Token ids of a conversation up to where the user's first message would begin."""
    marker = "\u2063GUMIHO\u2063"  # text no model writes on its own
    text = target.chat_text([{"role": "user", "content": marker}])
    if marker not in text:
        raise GumihoError(f"{target.name}'s chat template does not show the user's message: use --prompts instead")
    return target.encode(text[: text.index(marker)])


@torch.inference_mode()
def self_written_prompts(target, n: int, seed: int = 0, batch_size: int = 32, max_tokens: int = 96,
                         temperature: float = 1.0, top_p: float = 0.95, progress: bool = True) -> list[list[str]]:
    """`n` distinct user prompts sampled from the target itself.

    Given only the opening of a user turn, an instruction-tuned model writes the kind of
    request it was tuned on (the "Magpie" trick, Xu et al. 2024). Measured on the default
    model, the template prompts of prompts.py are narrow: heads trained on them alone had a
    greedy depth-1 accuracy of 0.56 on held-out template conversations but 0.42 on real chat
    questions. Only turns the model finished (an end-of-turn token before `max_tokens`) are
    kept; sampling is seeded per batch, so a seed gives the same list on the same machine.
    """
    from tqdm import tqdm

    opening = torch.tensor([user_turn_opening(target)], device=target.device)
    stop = target.eos_token_ids  # a property that builds the set: read it once
    eos = sorted(stop)
    if not eos:
        raise GumihoError(f"{target.name} has no end-of-sequence token, so it cannot finish a prompt of its own")
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else eos[0]
    out, seen, batch_no = [], set(), 0
    bar = tqdm(total=n, desc="self-written prompts", unit="prompt", disable=not progress)
    while len(out) < n:
        if batch_no >= 20 + 10 * n // max(batch_size, 1):  # nearly nothing usable: say so, do not spin
            raise GumihoError(f"{target.name} finished only {len(out)} of {n} prompts of its own; use --prompts")
        torch.manual_seed(seed * 1_000_003 + batch_no)
        batch_no += 1
        ids = opening.expand(batch_size, -1)
        rows = target.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                     temperature=temperature, top_p=top_p, top_k=None, max_new_tokens=max_tokens,
                                     eos_token_id=eos, pad_token_id=pad)[:, ids.shape[1]:].tolist()
        for row in rows:
            end = next((i for i, t in enumerate(row) if t in stop), None)
            text = target.decode(row[:end]).strip() if end is not None else ""
            if len(text.split()) >= 3 and text not in seen and len(out) < n:
                seen.add(text)
                out.append([text])
                bar.update(1)
    bar.close()
    return out


def self_prompts_for(target, folder: str | Path, n: int, seed: int, batch_size: int) -> list[list[str]]:
    """The self-written prompts of a data folder: sampled once, then read back, so a resumed
    run answers exactly the prompts it started with (sampling can differ across machines)."""
    path = Path(folder) / SELF_PROMPTS
    stored = read_prompt_file(path) if path.is_file() else []
    if len(stored) < n:
        stored = self_written_prompts(target, n, seed, batch_size)
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_text_atomic(path, "".join(json.dumps({"turns": t}, ensure_ascii=False) + "\n" for t in stored))
    return stored[:n]


# ---------------------------------------------------------------------------------------
# Generation and feature extraction
# ---------------------------------------------------------------------------------------


@dataclass
class Conversation:
    index: int  # position in the prompt list (what the manifest remembers)
    input_ids: list[int]
    answer_start: int  # first token of the final answer (loss mask "answer" starts here)
    features: torch.Tensor | None = None  # (len(input_ids), H), caught while generating


def _greedy_answers(target, prompts: list[list[int]], max_new_tokens: int) -> list[tuple[list[int], torch.Tensor]]:
    """Greedy answers to a batch of token-id prompts, left-padded; each cut after its EOS.

    Returns (answer, features) per prompt: the last-layer features of prompt + answer are
    caught from generation's own forward passes (a hook on the base model), instead of a
    second pass over every conversation, which took as long as generating them (48
    conversations of ~220 tokens: 64 s to generate, 67 s more for the second pass). The token
    generated at the batch's last step is never fed back, so it has no feature: an answer
    that runs to that step (cut at max_new_tokens, or the batch's longest) loses that token.
    """
    tok = target.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else next(iter(target.eos_token_ids), 0)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for row, p in enumerate(prompts):  # left padding: every prompt ends at the same column
        ids[row, width - len(p):] = torch.tensor(p)
        attention[row, width - len(p):] = 1
    eos = sorted(target.eos_token_ids)
    steps: list[torch.Tensor] = []  # (B, T, H) per forward pass: the prompt, then one column a step
    hook = target.base.register_forward_hook(lambda module, args, out: steps.append(out.last_hidden_state))
    try:
        with torch.inference_mode():
            out = target.model.generate(
                input_ids=ids.to(target.device),
                attention_mask=attention.to(target.device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                pad_token_id=pad,
                eos_token_id=eos or None,
            )
    finally:
        hook.remove()
    fed = torch.cat(steps, dim=1).float().cpu()  # column c: the feature of the token fed at column c
    results = []
    for row, (p, generated) in enumerate(zip(prompts, out[:, width:].tolist())):
        cut = next((i + 1 for i, t in enumerate(generated) if t in target.eos_token_ids), len(generated))
        answer = generated[:cut]
        have = min(len(answer), fed.shape[1] - width)  # answer tokens that were fed back
        results.append((answer, fed[row, width - len(p): width + have]))
    return results


def answer_prompts(target, conversations: list[tuple[int, list[str]]], max_new_tokens: int,
                   system: str | None = None) -> list[Conversation]:
    """Let the target answer every user turn in order; return the full token sequences.

    Turn k+1 of a multi-turn conversation is asked after the target's own answer to turn k.
    Earlier turns are re-rendered by the chat template; the "answer" mask covers the last answer.
    """
    messages = {i: ([{"role": "system", "content": system}] if system else []) for i, _ in conversations}
    result = {}
    turns = dict(conversations)
    for k in range(max(1 if _is_ids(t) else len(t) for t in turns.values())):
        active = [i for i in turns if k < (1 if _is_ids(turns[i]) else len(turns[i]))]
        for i in active:
            if not _is_ids(turns[i]):
                messages[i].append({"role": "user", "content": turns[i][k]})
        # A prompt given as token ids (tests, raw base-model text) skips the chat template.
        prompt_ids = [list(turns[i]) if _is_ids(turns[i]) else target.chat_prompt(messages[i]) for i in active]
        answers = _greedy_answers(target, prompt_ids, max_new_tokens)
        for i, p, (a, features) in zip(active, prompt_ids, answers):
            messages[i].append({"role": "assistant", "content": target.decode(a)})  # the whole answer
            result[i] = Conversation(i, (p + a)[: len(features)], len(p), features)  # what has features
    return [result[i] for i, _ in conversations]


def _is_ids(turns) -> bool:
    return bool(turns) and isinstance(turns[0], int)


# ---------------------------------------------------------------------------------------
# Shards on disk
# ---------------------------------------------------------------------------------------


def _write_text_atomic(path: Path, text: str) -> None:
    """Write via a temporary file and a rename: a killed run leaves the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _write_json_atomic(path: Path, obj) -> None:
    _write_text_atomic(path, json.dumps(obj, indent=1))


def read_manifest(folder: str | Path) -> dict:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise GumihoError(f"{folder} is not a training-data folder (no {MANIFEST}); make one with `train-data`")
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise GumihoError(f"{path} is not valid JSON: {exc}") from exc


def write_shard(folder: Path, number: int, conversations: list[Conversation], features: list[torch.Tensor],
                mask: str, dtype: torch.dtype) -> dict:
    from safetensors.torch import save_file

    ids = torch.cat([torch.tensor(c.input_ids, dtype=torch.int32) for c in conversations])
    loss_mask = torch.cat([
        torch.tensor([0] * (c.answer_start if mask == "answer" else 0)
                     + [1] * (len(c.input_ids) - (c.answer_start if mask == "answer" else 0)), dtype=torch.uint8)
        for c in conversations
    ])
    lengths = torch.tensor([len(c.input_ids) for c in conversations])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    name = f"shard-{number:05d}.safetensors"
    tmp = folder / (name + ".tmp")
    save_file({"input_ids": ids, "features": torch.cat(features).to(dtype), "loss_mask": loss_mask,
               "offsets": offsets}, str(tmp))
    os.replace(tmp, folder / name)
    return {"file": name, "conversations": len(conversations), "tokens": int(ids.numel()),
            "prompts": [c.index for c in conversations]}


def prompt_hash(turns: list[str]) -> str:
    """A short fingerprint of one prompt, so a resumed run can tell it is given the same prompts."""
    return hashlib.sha256(json.dumps(turns, ensure_ascii=False).encode("utf-8")).hexdigest()[:16]


def check_same_prompts(folder: Path, manifest: dict, prompts: list[list[str]]) -> None:
    """Refuse to resume a folder with other prompts: resuming goes by prompt index, so another --seed
    or --prompts file would silently mix two prompt sets (and skip prompts never answered)."""
    for shard in manifest["shards"]:
        for index, stored in zip(shard["prompts"], shard.get("prompt_hashes", [])):  # older folders: no hashes
            if index >= len(prompts) or prompt_hash(prompts[index]) != stored:
                raise GumihoError(
                    f"{folder} was made from other prompts (prompt {index} differs from the one stored): "
                    "resume it with the same --seed / --prompts / --num-prompts, or use a new --out folder")


def load_conversations(folder: str | Path) -> list[dict]:
    """Every stored conversation as {"input_ids" (T,), "features" (T, H) float32, "loss_mask" (T,)}."""
    from safetensors.torch import load_file

    folder = Path(folder)
    manifest = read_manifest(folder)
    out = []
    for shard in manifest["shards"]:
        data = load_file(str(folder / shard["file"]))
        offs = data["offsets"].tolist()
        for a, b in zip(offs, offs[1:]):
            out.append({
                "input_ids": data["input_ids"][a:b].long(),
                "features": data["features"][a:b].float(),
                "loss_mask": data["loss_mask"][a:b].bool(),
            })
    if not out:
        raise GumihoError(f"{folder} holds no conversations yet")
    return out


def generate_dataset(target, out_dir: str | Path, prompts: list[list[str]], max_new_tokens: int = 192,
                     batch_size: int = 8, shard_size: int = 64, mask: str = "answer",
                     feature_dtype: str = "float16", system: str | None = None, progress: bool = True) -> dict:
    """Answer `prompts` with the target and store the conversations; resumes a half-done folder."""
    from tqdm import tqdm

    from .heads import target_signature

    if mask not in ("answer", "all"):
        raise GumihoError(f"mask must be 'answer' or 'all' (got {mask!r})")
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}.get(feature_dtype)
    if dtype is None:
        raise GumihoError(f"unknown feature dtype {feature_dtype!r}: use float16, bfloat16 or float32")
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    if (folder / MANIFEST).is_file():
        manifest = read_manifest(folder)
        if manifest["target"] != target_signature(target):
            raise GumihoError(f"{folder} holds data of {manifest['target']['name']}, not of {target.name}")
        check_same_prompts(folder, manifest, prompts)
    else:
        manifest = {"format": FORMAT_VERSION, "target": target_signature(target), "mask": mask,
                    "max_new_tokens": max_new_tokens, "feature_dtype": feature_dtype, "shards": []}
    done = {i for s in manifest["shards"] for i in s["prompts"]}
    todo = [(i, p) for i, p in enumerate(prompts) if i not in done]
    bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), desc="conversations", unit="conv",
               disable=not progress)
    for start in range(0, len(todo), shard_size):
        chunk = todo[start:start + shard_size]
        conversations = []
        for b in range(0, len(chunk), batch_size):
            conversations += answer_prompts(target, chunk[b:b + batch_size], max_new_tokens, system)
            bar.update(len(chunk[b:b + batch_size]))
        features = [c.features for c in conversations]
        number = max((int(s["file"][6:11]) for s in manifest["shards"]), default=-1) + 1
        shard = write_shard(folder, number, conversations, features, manifest["mask"], dtype)
        shard["prompt_hashes"] = [prompt_hash(prompts[i]) for i in shard["prompts"]]
        manifest["shards"].append(shard)
        _write_json_atomic(folder / MANIFEST, manifest)  # only now does the shard count as done
        bar.set_postfix(tokens=sum(s["tokens"] for s in manifest["shards"]))
    bar.close()
    return manifest
