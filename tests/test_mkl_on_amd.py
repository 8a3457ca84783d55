"""The MKL-on-AMD preload: the library it builds, and a process restarted with it."""
import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gumiho_core import mkl_on_amd

ROOT = Path(__file__).resolve().parent.parent
HAS_CC = any(shutil.which(c) for c in ("cc", "gcc", "clang"))

# A program that restarts itself with the library (as launch.py does), then multiplies.
PROGRAM = f"""
import sys; sys.path.insert(0, {str(ROOT)!r})
from gumiho_core import mkl_on_amd
mkl_on_amd.reexec_with_library()
import torch
torch.randn(4, 576) @ torch.randn(576, 1536)
print("active", mkl_on_amd.active())
"""


@pytest.mark.skipif(not HAS_CC, reason="no C compiler")
def test_built_library_says_intel(tmp_path):
    path = mkl_on_amd.build(tmp_path / "lib.so")
    assert path == tmp_path / "lib.so"
    lib = ctypes.CDLL(str(path))
    assert lib.mkl_serv_intel_cpu_true() == 1 and lib.mkl_serv_intel_cpu() == 1
    assert mkl_on_amd.build(path) == path  # already there: kept


def run_program(tmp_path, **env):
    env = {**os.environ, "GUMIHO_CACHE": str(tmp_path), "MKL_VERBOSE": "1", **env}
    env.pop("LD_PRELOAD", None)
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.skipif(not (HAS_CC and mkl_on_amd.is_amd_linux()), reason="needs an AMD CPU on Linux and a C compiler")
def test_restarted_process_runs_mkls_vector_path_on_amd(tmp_path):
    out = run_program(tmp_path)
    assert "active True" in out
    header = next(line for line in out.splitlines() if line.startswith("MKL_VERBOSE oneMKL"))
    assert "AVX" in header, header  # not the generic "Intel(R) Architecture processors" path
    off = run_program(tmp_path, GUMIHO_MKL_ON_AMD="0")
    assert "active False" in off


@pytest.mark.skipif(mkl_on_amd.is_amd_linux(), reason="an Intel (or non-Linux) machine")
def test_nothing_is_preloaded_elsewhere(tmp_path):
    assert mkl_on_amd.wanted() is None
    assert "active False" in run_program(tmp_path)
