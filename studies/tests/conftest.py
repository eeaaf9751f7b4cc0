"""The studies' tests share the repository's test helpers (``zoo``, ``launch``, ...)."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GEOSHARP_STRICT_TRACE", "1")  # a tracer bug fails the test


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """A command run here with ``--threads`` sets torch's threads for the whole test
    process (the suite's run on one each): restored after every test."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
