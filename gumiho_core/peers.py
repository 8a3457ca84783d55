"""The peer a user would run instead: llama.cpp (llama-cpp-python) on the same GGUF file.

The benchmark's `llama.cpp` method. It is an optional extra (`pip install -e '.[peers]'`):
llama-cpp-python compiles llama.cpp from source (~12 min on 2 cores), so nothing but this
method needs it. To make the comparison about speed alone, it reads what our engine reads:
- the same GGUF file (the embedded default, or `--model FILE.gguf`);
- the same prompt token ids, those our tokenizer makes through the chat template (the
  GGUF's own tokenizer is the one ours was loaded from, so both see the same tokens);
- the same thread count, max new tokens, EOS rule and sampling settings.
Its outputs are not ours: it computes with Q4_1 dot products where we compute in float32
from the dequantised weights, so a near-tie of the logits can go the other way. The
benchmark reports how often its greedy answers equal ours and where they first part; that
is not a failure of our lossless check, which compares our own methods only.
"""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path

from .errors import GumihoError
from .settings import GenerationSettings

METHOD = "llama.cpp"
INSTALL_HINT = "pip install -e '.[peers]'"


def peer_gguf(model: str | None) -> Path:
    """The GGUF file the llama.cpp method reads: the default model's, or `model` if it is one.

    Any other model (a Hugging Face folder, a hub id) has no file llama.cpp could read as it
    is, and converting it would compare against a different file: refused in one line. So is
    a machine without llama-cpp-python. Both are checked before any model loads.
    """
    if importlib.util.find_spec("llama_cpp") is None:
        raise GumihoError(f"the {METHOD} method needs llama-cpp-python: {INSTALL_HINT}")
    if model is None:
        from .target import default_model_path  # loads nothing: finds the installed file

        return default_model_path()
    path = Path(model).expanduser()
    if path.suffix.lower() != ".gguf" or not path.is_file():
        raise GumihoError(f"the {METHOD} method needs a .gguf model: the default model or --model FILE.gguf "
                          f"(got {model})")
    return path


class LlamaCppPeer:
    """One llama.cpp model, loaded once and reused for every prompt (as our engine is)."""

    def __init__(self, gguf: Path, threads: int, context: int):
        try:
            from llama_cpp import Llama
        except ImportError:
            raise GumihoError(f"the {METHOD} method needs llama-cpp-python: {INSTALL_HINT}") from None
        # n_ctx: what the longest prompt and answer need, not the model's whole window, whose
        # KV cache llama.cpp would allocate up front.
        self.llm = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads,
                         n_ctx=context, verbose=False)

    def run(self, prompt_ids: list[int], settings: GenerationSettings, eos_ids: set[int]):
        """New token ids (EOS included, as our engine emits it) and the seconds they took,
        the prompt's prefill included."""
        s = settings.sampling
        # reset(): llama-cpp-python would otherwise keep the KV cache of the prompt it read
        # last and skip its prefill, which every other method pays.
        self.llm.reset()
        if s.seed is not None:
            self.llm.set_seed(s.seed)
        # temp 0 is llama.cpp's greedy sampler. Under sampling the filters our engine does not
        # have are off (min_p, typical_p), top_k 0 means none in both; llama.cpp applies top_p
        # before the temperature where we apply it after, so with top_p < 1 the two
        # distributions differ slightly (sampled outputs are not compared anyway).
        options = dict(temp=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=0.0, typical_p=1.0,
                       repeat_penalty=s.repetition_penalty)
        tokens: list[int] = []
        start = time.perf_counter()
        for token in self.llm.generate(prompt_ids, reset=True, **options):
            tokens.append(int(token))
            if token in eos_ids or len(tokens) >= settings.max_new_tokens:
                break
        return tokens, time.perf_counter() - start


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """How the peer's greedy answers compare with ours: share identical, first divergences.

    first_divergence per prompt: the index of the first new token that differs (or where one
    answer ends before the other), None where the answers are identical.
    """
    firsts = []
    for a, b in zip(ours, theirs):
        if a == b:
            firsts.append(None)
            continue
        firsts.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    same = sum(f is None for f in firsts)
    return {"identical_share": same / len(firsts) if firsts else None, "first_divergence": firsts}
