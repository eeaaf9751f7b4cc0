"""Gaussian draws whose numbers do not depend on how a vector is split over processes.

A draw is a seed. Its number at global position ``j`` of a flat vector of ``numel``
entries is entry ``j mod BLOCK`` of block ``j // BLOCK``, a standard normal vector drawn
from a generator of its own, seeded from the draw's seed and the block's number. A
process that holds some slices of the vector (:meth:`~geosharp.geometry.sharded.Shards.runs`)
draws only the blocks they touch: the numbers a single process draws for the whole
vector, without the whole vector in memory (a block, 4 MiB in float32, at a time).

>>> import torch
>>> whole = torch.empty(10)
>>> normal_runs_(whole, [(0, 0, 10)], 10, seed=7, block=4)
>>> part = torch.empty(3)
>>> normal_runs_(part, [(5, 0, 3)], 10, seed=7, block=4)  # global positions 5, 6, 7
>>> torch.equal(part, whole[5:8])
True
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

__all__ = ["BLOCK", "draw_seed", "normal_runs_"]

BLOCK = 1 << 20
_MASK = (1 << 64) - 1


def draw_seed(generator: torch.Generator | None, device: torch.device) -> int:
    """A draw's seed, taken from ``generator`` (the global generator when ``None``)."""
    where = generator.device if generator is not None else device
    return int(torch.randint(0, 1 << 62, (1,), generator=generator, device=where))


def _block_seed(seed: int, block: int) -> int:
    """splitmix64 of ``(seed, block)``: independent-looking seeds for neighbouring blocks."""
    z = (seed + (block + 1) * 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) >> 1


def normal_runs_(
    out: Tensor,
    runs: Iterable[tuple[int, int, int]],
    numel: int,
    seed: int,
    block: int = BLOCK,
) -> None:
    """Write the draw ``seed`` of a ``numel``-entry vector into ``out``: for each
    ``(start, local, n)`` of ``runs``, global positions ``[start, start + n)`` go to
    ``out[local : local + n]``. Runs in increasing ``start`` reuse a block they share."""
    held: tuple[int, Tensor] | None = None
    for start, local, n in runs:
        pos, end = start, start + n
        while pos < end:
            b = pos // block
            if held is None or held[0] != b:
                g = torch.Generator(device=out.device).manual_seed(_block_seed(seed, b))
                size = min(block, numel - b * block)
                values = torch.randn(size, generator=g, dtype=out.dtype, device=out.device)
                held = (b, values)
            upto = min(end, (b + 1) * block)
            a = local + pos - start
            out[a : a + upto - pos].copy_(held[1][pos - b * block : upto - b * block])
            pos = upto
