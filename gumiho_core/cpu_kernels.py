"""The engine's own CPU kernels (cpu_kernels.c, groupwise_matmul.c), compiled once per machine.

A one-token pass of the default model spent more than half its time in small PyTorch
operations (~60 a layer, each microseconds of dispatch around a little arithmetic), and
PyTorch's int4 kernel cost grew with every 4 rows of a tree. cpu_kernels.c does a layer's
norms, rotary positions with the cache writes, and attention in one call each, computing
each row alone, so its result does not depend on the other rows of the pass (what lossless
decoding in bfloat16 needs; blocked_attention.py is the pure-PyTorch way to the same end).
groupwise_matmul.c does the 4- and 8-bit products on the CPU's integer units (quantize.py's
GroupwiseLinear); decoder_layers.c runs an int4 decoding pass through every layer with those
kernels in one call, and the serial draft head's 8-bit layers the same way (fast_heads.py). docs/fast_decoder.md has the measurements.

They are built with the machine's C compiler (`cc -O3 -march=native -fopenmp`, under a
second) into the cache folder, keyed by the sources and the CPU, on first use. Where no
compiler is found the decoder keeps PyTorch's kernels and blocked_attention.py, with a
one-line note; `GUMIHO_NATIVE_KERNELS=0` asks for that path on purpose (tests compare the two).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCES = [Path(__file__).with_name(name) for name in ("cpu_kernels.c", "groupwise_matmul.c", "decoder_layers.c")]
HEADERS = [Path(__file__).with_name("vector8.h")]  # included by the sources: part of the build's key
# -fopenmp: the library asks for libgomp.so.1, which in a process that imported torch is
# PyTorch's own (loaded first, same name): the kernels' threads are PyTorch's threads.
FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=gnu11", "-fopenmp"]

P, LONG, INT, FLOAT = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
AVX512_FLAGS = ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "avx512_bf16")
AMX_FROM_ROWS = 9  # products of fewer rows take VNNI (groupwise_matmul.c): the same bits, less work


class LayerWeights(ctypes.Structure):
    """decoder_layers.c's struct layer_weights: one layer's norms and products (pointers into the
    fast decoder's or the draft heads' own tensors, which live as long as they do; attn_norm
    None for a layer without an input norm)."""

    _fields_ = [(name, P) for name in ("attn_norm", "mlp_norm", "qkv", "out", "gate_up", "down", "qkv_scales",
                                       "out_scales", "gate_up_scales", "down_scales")]


class DecoderShape(ctypes.Structure):
    """decoder_layers.c's struct decoder_shape."""

    _fields_ = [*((name, INT) for name in ("layers", "dim", "heads", "kv_heads", "head_dim", "intermediate")),
                ("eps", FLOAT), ("scale", FLOAT), ("bits", INT)]


class CpuKernels:
    """The compiled library, its entry points typed. Tensors are checked by the caller (the
    decoder hands over its own, in the layouts below); a kernel reads raw pointers."""

    def __init__(self, path: Path):
        self.version = path.stem  # the source's and the CPU's hash: measured costs are keyed on it
        self.library = ctypes.CDLL(str(path))
        self._attention = self._typed("tree_attention", INT, P, LONG, P, P, LONG, INT, INT, INT, INT, INT, P,
                                      FLOAT, P)
        self._add_rms_norm = self._typed("add_rms_norm", None, P, P, P, INT, INT, FLOAT, P)
        self._rotate_and_store = self._typed("rotate_and_store", None, P, P, P, INT, INT, INT, INT, LONG, INT,
                                             P, P, P)
        self._groupwise_matmul = self._typed("groupwise_matmul", INT, P, INT, INT, P, INT, P, INT, P, INT)
        self._decoder_layers = self._typed("decoder_layers", INT, P, P, P, INT, P, P, P, P, LONG, INT, P)
        self._decoder_pass = self._typed("decoder_pass", INT, P, P, P, P, INT, LONG, INT, P, P, LONG, P, P, P,
                                         LONG, INT, P, P, P)
        # groupwise_matmul.c runs on AVX2 with FMA, on AVX512-VNNI where the CPU has it with
        # AVX512-BF16 (the same bits), and on AMX for many rows where the CPU has it and Linux
        # grants this process its tile state.
        self.groupwise = _cpu_has("avx2") and _cpu_has("fma")
        self.avx512 = all(_cpu_has(flag) for flag in AVX512_FLAGS)
        ctypes.c_int.in_dll(self.library, "use_avx512").value = int(self.avx512)
        self.amx = self.avx512 and _cpu_has("amx_int8") and self.library.amx_enable(AMX_FROM_ROWS) == 0

    def groupwise_matmul(self, x: torch.Tensor, weights: torch.Tensor, bits: int, scales: torch.Tensor,
                         dtype=torch.bfloat16) -> torch.Tensor:
        """x (m, k) bfloat16 contiguous @ weights in groupwise_matmul.c's layout ((n / 16, k / 32,
        32 * bits) uint8; scales and lows (n / 16, k / 32, 2, 16) bfloat16). Returns (m, n) in
        `dtype`, bfloat16 or float32. Where `groupwise`."""
        m, k = x.shape
        n = weights.shape[0] * 16
        y = torch.empty(m, n, dtype=dtype)
        if self._groupwise_matmul(x.data_ptr(), m, k, weights.data_ptr(), bits, scales.data_ptr(), n, y.data_ptr(),
                                  dtype == torch.float32):
            raise RuntimeError(f"groupwise_matmul refused a {k} -> {n} product (k a multiple of 32, n of 16) "
                               "or found no memory")
        return y

    def decoder_layers(self, layers: ctypes.Array, shape: DecoderShape, x: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                       ancestors: torch.Tensor) -> None:
        """Every layer of a groupwise decoder (shape.bits) over x (n, dim) bfloat16 contiguous, in place: x
        becomes the last layer's output. cos / sin (n, head_dim) float32; keys / values the
        whole cache (layers, kv_heads, capacity, head_dim) bfloat16; ancestors as tree_attention."""
        if self._decoder_layers(ctypes.byref(layers), ctypes.byref(shape), x.data_ptr(), x.shape[0],
                                cos.data_ptr(), sin.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.shape[2],
                                start, ancestors.data_ptr()):
            raise RuntimeError("decoder_layers refused the pass (sizes its kernels do not take) or found no memory")

    def decoder_pass(self, layers: ctypes.Array, shape: DecoderShape, tokens: torch.Tensor, embedding: torch.Tensor,
                     cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
                     values: torch.Tensor, start: int, ancestors: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        """A decoding pass from tokens to final-norm features (n, dim) bfloat16: decoder_layers with
        the rows' embeddings and rotary rows looked up and the final norm applied in C. tokens /
        positions (n,) int64 contiguous; embedding (vocab, dim) float32 or bfloat16; cos / sin
        tables (at least max(positions) + 1, head_dim) float32; the rest as decoder_layers."""
        if tokens.dtype != torch.int64 or not tokens.is_contiguous():
            tokens = tokens.long().contiguous()
        if positions.dtype != torch.int64 or not positions.is_contiguous():
            positions = positions.long().contiguous()
        n = tokens.shape[0]
        out = torch.empty(n, shape.dim, dtype=torch.bfloat16)
        if self._decoder_pass(ctypes.byref(layers), ctypes.byref(shape), tokens.data_ptr(), embedding.data_ptr(),
                              embedding.dtype == torch.bfloat16, embedding.shape[0], n, cos_table.data_ptr(),
                              sin_table.data_ptr(), cos_table.shape[0], positions.data_ptr(), keys.data_ptr(),
                              values.data_ptr(), keys.shape[2], start, ancestors.data_ptr(), norm.data_ptr(),
                              out.data_ptr()):
            raise RuntimeError("decoder_pass refused the pass (a token outside the vocabulary, a position outside "
                               "the rotary table, sizes its kernels do not take) or found no memory")
        return out

    def _typed(self, name: str, result, *arguments):
        function = getattr(self.library, name)
        function.restype, function.argtypes = result, list(arguments)
        return function

    def add_rms_norm(self, x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x += y in place (None: nothing added), then RMSNorm(x) * weight. All bfloat16,
        contiguous, x and y (n, dim), weight (dim,)."""
        out = torch.empty_like(x)
        self._add_rms_norm(x.data_ptr(), None if y is None else y.data_ptr(), weight.data_ptr(), x.shape[0],
                           x.shape[1], eps, out.data_ptr())
        return out

    def rotate_and_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                         values: torch.Tensor, start: int, heads: int) -> torch.Tensor:
        """qkv (n, heads + 2 kv_heads, d) bfloat16 contiguous; cos / sin (n, d) float32; keys /
        values one layer's cache (kv_heads, capacity, d) bfloat16. Rotary positions on queries
        and keys; keys and values written at cache slots start .. start + n. Returns the
        rotated queries (n, heads, d) bfloat16."""
        n, _, d = qkv.shape
        q = torch.empty(n, heads, d, dtype=torch.bfloat16)
        self._rotate_and_store(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), n, heads, keys.shape[0], d,
                               keys.shape[1], start, q.data_ptr(), keys.data_ptr(), values.data_ptr())
        return q

    def tree_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                       ancestors: torch.Tensor, scale: float) -> torch.Tensor:
        """q (n, heads, d) bfloat16, rows of any stride, heads contiguous; keys / values
        (kv_heads, capacity, d) bfloat16 contiguous, one layer's cache holding the new rows at
        start .. start + n; ancestors (n, n) uint8 contiguous, which new rows each row sees
        (itself included, rows in depth order). Returns (n, heads * d) bfloat16."""
        n, heads, d = q.shape
        out = torch.empty(n, heads * d, dtype=torch.bfloat16)
        failed = self._attention(q.data_ptr(), q.stride(0), keys.data_ptr(), values.data_ptr(), keys.shape[1],
                                 n, heads, keys.shape[0], d, start, ancestors.data_ptr(), scale, out.data_ptr())
        if failed:
            raise RuntimeError(f"cpu_kernels.tree_attention refused head_dim {d} (a multiple of 16 up to 256)")
        return out


def supports(head_dim: int) -> bool:
    return head_dim % 16 == 0 and head_dim <= 256


@functools.cache
def load() -> tuple[CpuKernels | None, str]:
    """(the kernels, "") or (None, why not): compiled on first use, then read from the cache."""
    if os.environ.get("GUMIHO_NATIVE_KERNELS", "1") == "0":
        return None, "GUMIHO_NATIVE_KERNELS=0"
    if platform.machine() not in ("x86_64", "AMD64"):  # the kernels use x86 vector instructions
        return None, f"the engine's CPU kernels are built for x86-64, not {platform.machine()}: PyTorch's run"
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None, "no C compiler found (cc / gcc): the fast decoder runs on PyTorch's kernels, slower"
    try:
        return CpuKernels(_build(compiler)), ""
    except subprocess.CalledProcessError as exc:
        error = next((line for line in (exc.stderr or b"").decode(errors="replace").splitlines() if "error" in line),
                     f"{compiler} exited with {exc.returncode}")
        return None, f"building the CPU kernels failed ({error.strip()}): the fast decoder runs on PyTorch's kernels"
    except OSError as exc:
        return None, f"building the CPU kernels failed ({exc}): the fast decoder runs on PyTorch's kernels"


def _build(compiler: str) -> Path:
    from .target import cache_dir  # the project's one cache folder

    source = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    key = hashlib.sha256(source + " ".join([compiler, *FLAGS, _cpu_id()]).encode()).hexdigest()[:16]
    library = cache_dir() / "kernels" / f"cpu_kernels-{key}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name and renamed: processes starting together never load half a file.
    with tempfile.TemporaryDirectory(dir=library.parent) as work:
        built = Path(work) / library.name
        subprocess.run([compiler, *FLAGS, "-o", str(built), *map(str, SOURCES)], check=True,
                       capture_output=True, timeout=120)
        os.replace(built, library)
    return library


def _cpu_has(flag: str) -> bool:
    return flag in _cpu_id().split()


def _cpu_id() -> str:
    """-march=native compiles for this CPU: a cache shared with another machine must not match."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()
