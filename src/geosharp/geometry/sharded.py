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
from ..layout import ParameterLayout, _view, strided_segments, write_strided
from ..symmetry.pairs import PairSpec
from .pairs import Rows
from .stacked import StackedPairs, group_pairs

__all__ = ["ShardedStack", "Shards", "localize"]

Reduce = Callable[[Tensor], Tensor]


@dataclass
class Shards:
    """Where this process's slices lie in the global parameters.

    ``global_layout``: the whole parameters (the one-process layout); ``local``: the
    slices held here, in the same order; ``dims[name] = (dim, start, length)``.
    ``reduce`` sums a tensor over the processes, ``reduce_max`` takes its maximum;
    ``rank``: this process's number.
    """

    global_layout: ParameterLayout
    local: ParameterLayout
    dims: dict[str, tuple[int, int, int]]
    reduce: Reduce
    reduce_max: Reduce
    rank: int = 0

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

    def runs(self) -> list[tuple[int, int, int]]:
        """``(global start, local start, length)`` of every contiguous run of global
        entries held here, in increasing global order (one per parameter for slices of
        dimension 0)."""
        g, loc = self.global_layout, self.local
        out = []
        for name, shape, go, lo in zip(g.names, g.shapes, g.offsets, loc.offsets):
            dim, start, length = self.dims[name]
            inner = math.prod(shape[dim + 1 :])
            for o in range(math.prod(shape[:dim])):
                first = go + (o * shape[dim] + start) * inner
                out.append((first, lo + o * length * inner, length * inner))
        return [r for r in out if r[2] > 0]

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
    ``(B, n_local, h)`` of the ``B`` heads of which this process holds a row (``heads``,
    of the stack's ``count``), zero on phantom rows (never written). Read and written
    through strided views of the held rows where they allow, else through explicit
    positions. ``rows`` are the global row numbers of the local rows (``-1``: phantom),
    ``whole`` the global ``(n, m)``, for the sampler. ``reduce`` sums a tensor of
    per-head values over the processes, each head's over those that hold it."""

    def __init__(
        self,
        specs: list[PairSpec],
        group: str,
        whole: tuple[int, int],
        g_local: Tensor,
        h_local: Tensor,
        rows: tuple[Tensor, Tensor],
        local: ParameterLayout,
        device: torch.device,
        heads: tuple[Tensor, int] | None = None,
        reduce: Reduce | None = None,
        owned: Tensor | None = None,
    ):
        self.specs, self.layout, self.device, self.group = specs, None, device, group
        self.state = None
        self.rows = tuple(r.to(self.device) for r in rows)
        self.whole = whole
        self.heads, self.count = (None, None) if heads is None else heads
        if self.heads is not None:
            self.heads = self.heads.to(self.device)
        self._total = reduce  # the sampler's: its tensors run over every head
        # the local heads whose per-head values this process adds up (None: all, alone)
        self.owned = None if owned is None else owned.to(self.device)
        self.reduce = reduce if self.heads is None else _on_heads(reduce, self.heads, self.count)
        self.shapes = (g_local.shape, h_local.shape)
        segments = tuple(_held_segments(i) for i in (g_local, h_local))
        if all(s is not None for s in segments):
            self._segments, self._index = segments, None
        else:
            self._segments = (None, None)
            self._index = (g_local.to(self.device), h_local.to(self.device))
        self._local = local

    @property
    def g_index(self) -> Tensor:
        return self._explicit()[0]

    @property
    def h_index(self) -> Tensor:
        return self._explicit()[1]

    def _explicit(self) -> tuple[Tensor, Tensor]:
        """The ``(B, n, h)`` local positions, ``-1`` on phantom rows."""
        if self._index is not None:
            return self._index
        out = []
        for segs, shape in zip(self._segments, self.shapes):
            index = torch.full(shape, -1, dtype=torch.long)
            for b0, nb, r0, nr, offset, sb, sr, sc in segs:
                b = torch.arange(nb)[:, None, None] * sb
                r = torch.arange(nr)[None, :, None] * sr
                c = torch.arange(shape[-1])[None, None, :] * sc
                index[b0 : b0 + nb, r0 : r0 + nr] = offset + b + r + c
            out.append(index.to(self.device))
        return out[0], out[1]

    def positions(self) -> tuple[Tensor, Tensor]:
        return tuple(i[i >= 0] for i in self._explicit())  # type: ignore[return-value]

    def gather(self, flat: Tensor) -> tuple[Tensor, Tensor]:
        if self._index is None and self._strided(flat):
            out = []
            for segs, shape in zip(self._segments, self.shapes):
                block = torch.zeros(shape, dtype=flat.dtype, device=flat.device)
                for seg in segs:
                    b0, nb, r0, nr = seg[:4]
                    block[b0 : b0 + nb, r0 : r0 + nr].copy_(_view(flat, seg, shape[-1]))
                out.append(block)
            return out[0], out[1]
        return tuple(  # type: ignore[return-value]
            flat[i.clamp_min(0)].masked_fill_((i < 0), 0) for i in self._explicit()
        )

    def gather_params(self, params: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """The blocks of ``params`` (``{name: flat local slice}``, in their dtype), read
        parameter by parameter (no flat copy of them is made)."""
        names = {b.param for spec in self.specs for b in (*spec.g_blocks, *spec.h_blocks)}
        dtype = params[next(iter(names))].dtype
        layout, out = self._local, []
        for index in self._explicit():
            block = torch.zeros(index.shape, dtype=dtype, device=self.device)
            for name in names:
                offset = layout.offset(name)
                here = (index >= offset) & (index < offset + params[name].numel())
                block[here] = params[name][index[here] - offset].to(dtype)
            out.append(block)
        return out[0], out[1]

    def _held(self, blocks) -> list[tuple[Tensor, Tensor]]:
        """``(positions, values)`` of the held entries of ``blocks``."""
        out = []
        for index, block in zip(self._explicit(), blocks):
            held = index >= 0
            out.append((index[held], block[held]))
        return out

    def scatter(self, flat: Tensor, blocks) -> Tensor:
        for pos, values in self._held(blocks):
            flat = flat.index_copy(0, pos, values)
        return flat

    def scatter_(self, flat: Tensor, blocks) -> Tensor:
        if self._index is None and self._strided(flat):
            for segs, block in zip(self._segments, blocks):
                write_strided(flat, segs, block.to(flat.dtype), accumulate=False)
            return flat
        for pos, values in self._held(blocks):
            flat.index_copy_(0, pos, values.to(flat.dtype))
        return flat

    def add_(self, flat: Tensor, blocks, alpha: float = 1.0) -> Tensor:
        if self._index is None and self._strided(flat):
            for segs, block in zip(self._segments, blocks):
                write_strided(flat, segs, block.to(flat.dtype), accumulate=True, alpha=alpha)
            return flat
        for pos, values in self._held(blocks):
            flat.index_add_(0, pos, values.to(flat.dtype), alpha=alpha)
        return flat

    def sample(self, generator: torch.Generator | None):
        rows = Rows(*self.rows, *self.whole, self.heads, self.count, self._total)
        return self.state.sample(generator, rows=rows)


def _on_heads(reduce: Reduce | None, heads: Tensor, count: int) -> Reduce | None:
    """``reduce`` of per-head tensors ``(len(heads), ...)`` of some of ``count`` heads:
    spread over all of them (zero for the heads not held here), summed, taken back."""
    if reduce is None:
        return None

    def on_heads(t: Tensor) -> Tensor:
        if t.dim() == 0 or t.shape[0] != heads.numel():
            raise ValueError(f"a per-head sum over {heads.numel()} heads got shape {t.shape}")
        whole = t.new_zeros((count, *t.shape[1:]))
        whole[heads] = t
        return reduce(whole)[heads]

    return on_heads


def _held_segments(index: Tensor) -> list | None:
    """Strided views (:func:`~geosharp.layout.strided_segments`) of the held rows of a
    local ``(B, n, h)`` index whose phantom rows are ``-1``, or ``None``. Phantom rows
    get distinct, increasing negative positions, so that they form segments of their
    own (never merged with held rows), which are then left out."""
    index = index.cpu()
    phantom = index[..., 0] < 0
    if bool(phantom.any()):
        B, n, h = index.shape
        base = -(10**15) + torch.arange(B)[:, None] * 10**9 + torch.arange(n)[None, :] * h
        index = index.clone()
        index[phantom] = base[phantom][:, None] + torch.arange(h)
    segments = strided_segments(index)
    if segments is None:
        return None
    return [s for s in segments if s[4] >= 0]


def localize(pairs: Sequence[PairSpec], shards: Shards, device: torch.device) -> list[ShardedStack]:
    """The local rows of every stack of ``pairs`` (stacked as one process stacks them,
    so that the ``h x h`` sums of a head line up on every process). Positions are
    worked out one pair at a time (no global index of a whole stack is made). Raises
    :class:`~geosharp.errors.UsageError` when a row of a block is split across
    processes (the parameter is sharded along the wrong dimension)."""
    out = []
    for (n, m, _, group, _part), specs in group_pairs(pairs).items():  # as stack_pairs does
        sides, rows = [], []
        for side in ("g_blocks", "h_blocks"):
            parts = [_held_rows(spec, side, shards) for spec in specs]
            n_local = max((p[0].shape[1] for p in parts), default=0)
            sides.append(torch.cat([_pad_rows(p[0], n_local) for p in parts]))
            rows.append(torch.cat([_pad_rows(p[1], n_local) for p in parts]))
        # the heads of which a row is held here (a Shard(0) plan holds whole heads), and
        # those of them whose per-head values this process adds up (the last holder's)
        held = (rows[0] >= 0).any(1) | (rows[1] >= 0).any(1)
        heads = held.nonzero().reshape(-1)
        last = shards.reduce_max(torch.where(held, shards.rank, -1).to(torch.float64))
        owned = (last == shards.rank)[heads]
        stack = ShardedStack(
            specs,
            group,
            (n, m),
            sides[0][heads],
            sides[1][heads],
            (rows[0][heads], rows[1][heads]),
            shards.local,
            torch.device(device),
            (heads, held.numel()) if heads.numel() < held.numel() else None,
            shards.reduce,
            owned,
        )
        out.append(stack)
    return out


def _held_rows(spec: PairSpec, side: str, shards: Shards) -> tuple[Tensor, Tensor]:
    """One pair's rows held here: local positions ``(B, k, h)`` (held rows first, in
    their global order, ``-1`` rows after for heads that hold fewer) and their global
    row numbers ``(B, k)`` (``-1`` there)."""
    local = torch.cat([shards.to_local(b.param, b.index) for b in getattr(spec, side)], 1)
    held = local >= 0
    whole = held.all(-1)
    if bool((held.any(-1) & ~whole).any()):
        names = sorted({b.param for b in getattr(spec, side)})
        raise UsageError(
            f"the pair rows of {', '.join(names)} are split across processes: shard each "
            "pair weight along the dimension of its rows (the input features of "
            "query/key/value weights, the output features of the output weight), e.g. "
            "with geosharp.fsdp.shard(model, symmetries)"
        )
    k = int(whole.sum(1).max()) if whole.numel() else 0
    order = torch.sort((~whole).to(torch.int8), dim=1, stable=True).indices[:, :k]
    keep = torch.gather(whole, 1, order)
    picked = torch.gather(local, 1, order[..., None].expand(-1, -1, local.shape[-1]))
    picked[~keep] = -1
    return picked, torch.where(keep, order, -torch.ones_like(order))


def _pad_rows(x: Tensor, k: int) -> Tensor:
    """``x`` with ``-1`` rows appended along dimension 1 up to ``k``."""
    if x.shape[1] == k:
        return x
    pad = torch.full((x.shape[0], k - x.shape[1], *x.shape[2:]), -1, dtype=x.dtype)
    return torch.cat([x, pad], 1)
