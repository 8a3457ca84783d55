"""Let torch's MKL use its AVX2/AVX-512 kernels on AMD CPUs.

MKL picks its code path by CPU vendor: on an AMD CPU it runs a generic path even when the
CPU has AVX-512. For this project's sizes that matters a lot: on a 2-core AMD EPYC (Zen 4)
the default model's one-token target pass takes ~62 ms on the generic path and ~35 ms on
the AVX-512 one (tree passes of 2-8 tokens: ~100 ms vs 40-70 ms). MKL asks two internal
functions whether the CPU is Intel's; torch exports them, so a tiny library that answers
"yes" and is loaded first (LD_PRELOAD) switches the path (both are needed: with only
`mkl_serv_intel_cpu` MKL falls back to SSE2). MKL still reads the CPU's feature bits, so it
only runs instructions the CPU has.

The library is built on first use with the system C compiler into the cache folder; without
a compiler, off Linux/x86, or on an Intel CPU, nothing happens. GUMIHO_MKL_ON_AMD=0 turns
it off. Must run before torch is imported: MKL reads LD_PRELOAD-resolved symbols at load.
"""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = "int mkl_serv_intel_cpu_true(void) { return 1; }\nint mkl_serv_intel_cpu(void) { return 1; }\n"
ENV_SWITCH = "GUMIHO_MKL_ON_AMD"


def is_amd_linux() -> bool:
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return any(line.startswith("vendor_id") and "AuthenticAMD" in line for line in f)
    except OSError:
        return False


def library_path() -> Path:
    # The same folder as target.cache_dir() (not imported from there: that module needs torch).
    return Path(os.environ.get("GUMIHO_CACHE", Path.home() / ".cache" / "gumiho-chat")) / "mkl-on-amd.so"


def build(path: Path | None = None) -> Path | None:
    """Compile the library if it is not there yet; None when no C compiler is found."""
    path = path or library_path()
    if path.is_file():
        return path
    cc = next((c for c in (os.environ.get("CC"), "cc", "gcc", "clang") if c and shutil.which(c)), None)
    if cc is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "mkl_on_amd.c", Path(tmp) / "mkl-on-amd.so"
        src.write_text(SOURCE)
        done = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(out), str(src)], capture_output=True)
        if done.returncode != 0:
            return None
        os.replace(out, path)  # atomic: two processes building at once both end with a whole file
    return path


def wanted() -> Path | None:
    """The library to preload in this environment, or None."""
    if os.environ.get(ENV_SWITCH, "1") == "0" or not is_amd_linux():
        return None
    return build()


def active() -> bool:
    """Whether this process has the library loaded."""
    try:
        return library_path().name in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def reexec_with_library() -> None:
    """Restart this process with the library preloaded, if it is wanted and not yet there.

    Call it first thing in a program's entry point, never from library code (it replaces the
    process). The environment is passed on, so subprocesses get the library too.
    """
    if active():
        return
    lib = wanted()
    if lib is None:
        return
    preload = os.environ.get("LD_PRELOAD", "")
    if str(lib) in preload.split(":"):
        return  # set but not loaded (the loader refused it): do not loop
    env = {**os.environ, "LD_PRELOAD": f"{lib}:{preload}" if preload else str(lib)}
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


if __name__ == "__main__":
    # `python -m gumiho_core.mkl_on_amd`: print the library to preload here (empty if none),
    # for shells: LD_PRELOAD="$(python -m gumiho_core.mkl_on_amd)" python -m pytest
    lib = wanted()
    print(lib or "")
