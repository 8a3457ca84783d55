import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # `import tiny` from the tests
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
