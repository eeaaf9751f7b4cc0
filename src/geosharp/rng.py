"""Seeded random numbers that leave the caller's generators as they were.

``torch.manual_seed`` seeds every device, and one that has not started yet (CUDA on a
CPU run) is seeded when it starts: a measure that called it would change the random
numbers the caller's later GPU work draws. :func:`seeded` seeds only the generators it
restores.

>>> import torch
>>> state = torch.get_rng_state()
>>> with seeded(0):
...     a = torch.rand(2)
>>> with seeded(0):
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
    states are as before. No other generator is touched, now or when a device starts."""
    devices = list(dict.fromkeys(d for d in devices if d.type != "cpu"))
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=[]))
        for kind in dict.fromkeys(d.type for d in devices):
            on = [d for d in devices if d.type == kind]
            stack.enter_context(torch.random.fork_rng(devices=on, device_type=kind))
        torch.random.default_generator.manual_seed(seed)
        for device in devices:
            module = torch.get_device_module(device)
            with module.device(device):
                module.manual_seed(seed)
        yield
