"""Entry point: `python launch.py` opens the chat; `python launch.py --help` lists the commands."""
import importlib.util
from pathlib import Path


def _mkl_on_amd():
    # Loaded by path, not as gumiho_core.mkl_on_amd: importing the package imports torch,
    # and the restart with the library preloaded should happen before that (it is faster).
    spec = importlib.util.spec_from_file_location("mkl_on_amd", Path(__file__).parent / "gumiho_core" / "mkl_on_amd.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    _mkl_on_amd().reexec_with_library()
    from gumiho_core.cli import main

    raise SystemExit(main())
