"""Seeded random numbers that leave the caller's generators as they were.

``torch.manual_seed`` seeds every device, and one that has not started yet (CUDA on a
CPU run) is seeded when it starts: a measure that called it would change the random
numbers the caller's later GPU work draws. :func:`seeded` seeds only the generators it
restores.

>>> import torch
>>> state = torch.get_rng_state()
>>> with seeded(0):
...     a = torch.rand(2)
>>> with seeded(0, [torch.device("meta")]):  # no generator there: passed over
...     b = torch.rand(2)
>>> torch.equal(a, b), torch.equal(torch.get_rng_state(), state)
(True, True)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

__all__ = ["seeded"]


@contextlib.contextmanager
def seeded(seed: int, devices: Iterable[torch.device] = ()) -> Iterator[None]:
    """Within: the global generators of the CPU and of ``devices`` seeded with ``seed``,
    the same numbers as after ``torch.manual_seed(seed)``; on exit, also on error, their
    states are as before. No other generator is touched, now or when a device starts.
    Devices without a generator of their own (``meta``) are passed over."""
    held = {d: m for d in dict.fromkeys(devices) if (m := _generator_module(d)) is not None}
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=[]))
        for kind in dict.fromkeys(d.type for d in held):
            on = [d for d in held if d.type == kind]
            stack.enter_context(torch.random.fork_rng(devices=on, device_type=kind))
        torch.random.default_generator.manual_seed(seed)
        for device, module in held.items():
            on = module.device(device) if hasattr(module, "device") else contextlib.nullcontext()
            with on:
                module.manual_seed(seed)
        yield


def _generator_module(device: torch.device):
    """The ``torch.<device type>`` module that holds the device's global generator."""
    if device.type in ("cpu", "meta"):
        return None
    module = getattr(torch, device.type, None)
    return module if hasattr(module, "get_rng_state") else None
