"""The tensors alive on the heap, for the tests that count a measure's vectors."""

from __future__ import annotations

import contextlib
import gc
import warnings

import torch


def alive(numel: int) -> dict[int, torch.dtype]:
    """The storages of the tensors of ``numel`` elements the collector tracks (those
    made before :func:`measure_only` are not), each with its dtype."""
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tensors = [t for t in gc.get_objects() if isinstance(t, torch.Tensor)]
    return {t.untyped_storage().data_ptr(): t.dtype for t in tensors if t.numel() == numel}


@contextlib.contextmanager
def measure_only():
    """Inside, :func:`alive` sees only what was made inside: what lives before is frozen
    (``gc.freeze``), so a census scans the measure's objects, not the test run's."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
