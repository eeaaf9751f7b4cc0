r"""A perturbation space over parameter shards: every process holds a slice of every
parameter (FSDP2's ``Shard(dim)``), and the measure's vectors are the local slices.

Element-wise work is local; the measure's sums (inner products, norms) are sums of
local sums, all-reduced. A pair's ``(G, H)`` blocks are split by *rows*: a process
holds some rows of each head's block, whole, and the pair maths needs only ``h x h``
sums over rows (:class:`~geosharp.geometry.pairs.PairMetric` with ``reduce``). A
process that holds no row of a head's bias (a 1-D bias is cut by heads) pads that head
with a zero row (a *phantom*, read as 0 and never written), which no row sum sees.

:class:`Shards` describes the split: for each parameter its global shape and the
range ``[start, start + length)`` of dimension ``dim`` held here. :func:`localize`
turns global pairs into local :class:`ShardedStack` blocks, with an error naming the
parameter when a row would be cut across processes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import UsageError
from ..layout import ParameterLayout
from ..symmetry.pairs import PairSpec
from .pairs import Rows
from .stacked import StackedPairs, stack_pairs

__all__ = ["ShardedStack", "Shards", "localize"]

Reduce = Callable[[Tensor], Tensor]


@dataclass
class Shards:
    """Where this process's slices lie in the global parameters.

    ``global_layout``: the whole parameters (the one-process layout); ``local``: the
    slices held here, in the same order; ``dims[name] = (dim, start, length)``.
    ``reduce`` sums a tensor over the processes, ``reduce_max`` takes its maximum.
    """

    global_layout: ParameterLayout
    local: ParameterLayout
    dims: dict[str, tuple[int, int, int]]
    reduce: Reduce
    reduce_max: Reduce

    def local_positions(self, name: str) -> Tensor:
        """Positions in ``param.view(-1)`` of the entries held here, in local order."""
        shape = self.global_layout.shapes[self.global_layout.names.index(name)]
        dim, start, length = self.dims[name]
        pos = torch.arange(math.prod(shape), dtype=torch.long).view(shape)
        return pos.narrow(dim, start, length).reshape(-1)

    def slice_(self, whole: Tensor, out: Tensor) -> Tensor:
        """Write the local entries of ``whole`` (a flat vector of the global layout) into
        ``out`` (a flat vector of the local one)."""
        g, loc = self.global_layout, self.local
        for name, shape, go, lo, lshape in zip(
            g.names, g.shapes, g.offsets, loc.offsets, loc.shapes
        ):
            dim, start, length = self.dims[name]
            part = whole[go : go + math.prod(shape)].view(shape).narrow(dim, start, length)
            out[lo : lo + math.prod(lshape)].view(lshape).copy_(part)
        return out

    def to_local(self, name: str, index: Tensor) -> Tensor:
        """Flat positions in the local vector of the global ``index`` (positions in
        ``param.view(-1)``), ``-1`` where the entry is held elsewhere."""
        g = self.global_layout
        shape = g.shapes[g.names.index(name)]
        dim, start, length = self.dims[name]
        inner = math.prod(shape[dim + 1 :])
        coord = (index // inner) % shape[dim]
        outer = index // (inner * shape[dim])
        local = outer * (length * inner) + (coord - start) * inner + index % inner
        held = (coord >= start) & (coord < start + length)
        return torch.where(held, local + self.local.offset(name), -torch.ones_like(index))


class ShardedStack(StackedPairs):
    """The rows held here of a :class:`~geosharp.geometry.stacked.StackedPairs`: blocks
    ``(B, n_local, h)`` read and written through explicit positions, ``-1`` on phantom
    rows. ``rows`` are the global row numbers of the local rows (``-1``: phantom),
    ``whole`` the global ``(n, m)``, for the sampler."""

    def __init__(
        self,
        base: StackedPairs,
        g_local: Tensor,
        h_local: Tensor,
        rows: tuple[Tensor, Tensor],
        theta: Tensor,
    ):
        self.specs, self.layout, self.device, self.group = (
            base.specs,
            None,
            base.device,
            base.group,
        )
        self.state = None
        self._index = (g_local.to(self.device), h_local.to(self.device))
        self._valid = tuple((i >= 0) for i in self._index)
        self._positions = tuple(i[v] for i, v in zip(self._index, self._valid))
        self.rows = tuple(r.to(self.device) for r in rows)
        self.whole = (base.shapes[0][1], base.shapes[1][1])
        self.shapes = (g_local.shape, h_local.shape)
        self._segments = (None, None)
        self._theta = theta

    @property
    def g_index(self) -> Tensor:
        return self._index[0]

    @property
    def h_index(self) -> Tensor:
        return self._index[1]

    def positions(self) -> tuple[Tensor, Tensor]:
        return self._positions

    def gather(self, flat: Tensor) -> tuple[Tensor, Tensor]:
        return tuple(  # type: ignore[return-value]
            flat[i.clamp_min(0)].masked_fill_(~v, 0) for i, v in zip(self._index, self._valid)
        )

    def gather_params(self, params: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        return self.gather(self._theta)

    def scatter(self, flat: Tensor, blocks) -> Tensor:
        for pos, valid, block in zip(self._positions, self._valid, blocks):
            flat = flat.index_copy(0, pos, block[valid])
        return flat

    def scatter_(self, flat: Tensor, blocks) -> Tensor:
        for pos, valid, block in zip(self._positions, self._valid, blocks):
            flat.index_copy_(0, pos, block[valid].to(flat.dtype))
        return flat

    def add_(self, flat: Tensor, blocks, alpha: float = 1.0) -> Tensor:
        for pos, valid, block in zip(self._positions, self._valid, blocks):
            flat.index_add_(0, pos, block[valid].to(flat.dtype), alpha=alpha)
        return flat

    def sample(self, generator: torch.Generator | None):
        return self.state.sample(generator, Rows(*self.rows, *self.whole))


def localize(
    pairs: Sequence[PairSpec], shards: Shards, theta: Tensor, device: torch.device
) -> list[ShardedStack]:
    """The local rows of every stack of ``pairs`` (stacked as one process stacks them,
    so that the ``h x h`` sums of a head line up on every process). ``theta``: the
    local flat base point. Raises :class:`~geosharp.errors.UsageError` when a row of a
    block is split across processes (the parameter is sharded along the wrong
    dimension)."""
    out = []
    for base in stack_pairs(pairs, shards.global_layout, torch.device("cpu")):
        sides, rows = [], []
        for side in ("g_blocks", "h_blocks"):
            local = torch.cat(
                [
                    torch.cat([shards.to_local(b.param, b.index) for b in getattr(s, side)], 1)
                    for s in base.specs
                ]
            )  # (B, n, h) local positions, -1 where held elsewhere
            held = local >= 0
            whole_rows = held.all(-1)
            if bool((held.any(-1) & ~whole_rows).any()):
                spec = base.specs[0]
                names = sorted({b.param for b in getattr(spec, side)})
                raise UsageError(
                    f"the pair rows of {', '.join(names)} are split across processes: shard "
                    "each pair weight along the dimension of its rows (the input features "
                    "of query/key/value weights, the output features of the output "
                    "weight), e.g. with geosharp.fsdp.shard(model, symmetries)"
                )
            count = whole_rows.sum(1)
            n_local = int(count.max()) if count.numel() else 0
            # the held rows first, in their global order; phantom rows after
            order = torch.sort((~whole_rows).to(torch.int8), dim=1, stable=True).indices
            order = order[:, :n_local]
            keep = torch.gather(whole_rows, 1, order)
            picked = torch.gather(local, 1, order[..., None].expand(-1, -1, local.shape[-1]))
            picked[~keep] = -1
            sides.append(picked)
            rows.append(torch.where(keep, order, -torch.ones_like(order)))
        out.append(ShardedStack(base, sides[0], sides[1], (rows[0], rows[1]), theta))
    return out
