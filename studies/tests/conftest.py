"""The studies' tests share the repository's test helpers (``zoo``, ``launch``, ...)."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GEOSHARP_STRICT_TRACE", "1")  # a tracer bug fails the test
