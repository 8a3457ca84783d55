import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # `import tiny` from the tests
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest


@pytest.fixture(scope="session")
def default_target():
    """The real embedded default model, loaded once per test session (~15 s)."""
    from gumiho_core import load_target

    return load_target(None)
