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
turns global pairs into local :class:`ShardedStack` blocks.

A row cut across processes (FSDP2's ``Shard(0)`` with more processes than heads cuts
each query/key/value row of ``h`` entries of a head) is *split*: one process, the
lowest-ranked that holds an entry of it, keeps it in its blocks as if it held it whole,
and every read and write of the stack's blocks moves the split rows' entries through an
all-reduced buffer of those rows only (each entry is held by one process and zero on the
others, so the sum is exact): the split rows' entries travel, never a whole parameter.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..layout import (
    ParameterLayout,
    Runs,
    _view,
    locate_segments,
    read_located,
    strided_segments,
    write_strided,
)
from ..symmetry.pairs import PairSpec
from .pairs import Rows
from .stacked import StackedPairs, group_pairs, max_stack

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


@dataclass
class Split:
    """The rows of one side of a stack cut across processes, moved through a buffer of
    ``size`` entries (``h`` per split row, the same on every process): ``mine`` are the
    local flat positions of the entries held here and ``mine_at`` their places in the
    buffer; ``block`` the places in this process's ``(B, n_local, h)`` block (flattened)
    of the split rows it keeps, ``block_at`` theirs in the buffer. Each is held as the
    runs of its rows (:class:`~geosharp.layout.Runs`) and made where used."""

    size: int
    mine_runs: Runs
    mine_at_runs: Runs
    block_runs: Runs
    block_at_runs: Runs

    @property
    def mine(self) -> Tensor:
        return self.mine_runs.expand()

    def to(self, device: torch.device) -> Split:
        runs = (self.mine_runs, self.mine_at_runs, self.block_runs, self.block_at_runs)
        return Split(self.size, *(r.to(device) for r in runs))

    def _buffer(self, like: Tensor) -> Tensor:
        # all-reduced: half precision travels as float32 (exact)
        dtype = like.dtype if like.element_size() >= 4 else torch.float32
        return torch.zeros(self.size, dtype=dtype, device=like.device)

    def receive(self, mine: Tensor, total: Reduce) -> Tensor:
        """The buffer of every split row, whole, from each process's entries ``mine``."""
        return total(self.incoming(mine))

    def incoming(self, mine: Tensor) -> Tensor:
        """This process's part of :meth:`receive`'s buffer (to be summed)."""
        out = self._buffer(mine)
        out[self.mine_at_runs.expand()] = mine.to(out.dtype)
        return out

    def fill_(self, block: Tensor, buffer: Tensor) -> None:
        """Write the split rows kept here into ``block`` from the ``buffer``."""
        block.view(-1)[self.block_runs.expand()] = buffer[self.block_at_runs.expand()].to(
            block.dtype
        )

    def outgoing(self, block: Tensor) -> Tensor:
        """This process's part of the buffer that sends the split rows in the keepers'
        ``block`` to the processes holding their entries (to be summed; :meth:`sent`)."""
        out = self._buffer(block)
        out[self.block_at_runs.expand()] = block.reshape(-1)[self.block_runs.expand()].to(out.dtype)
        return out

    def sent(self, buffer: Tensor) -> Tensor:
        """The values for :attr:`mine` in the summed buffer of :meth:`outgoing`."""
        return buffer[self.mine_at_runs.expand()]


def _read(params: dict[str, Tensor], names, layout: ParameterLayout, index: Tensor, out: Tensor):
    """``out[k] = entry index[k]`` of the local flat layout, read from ``params``
    (``{name: flat local slice}``); ``-1`` positions are left alone."""
    for name in names:
        offset = layout.offset(name)
        here = (index >= offset) & (index < offset + params[name].numel())
        out[here] = params[name][index[here] - offset].to(out.dtype)


class ShardedStack(StackedPairs):
    """The rows held here of a :class:`~geosharp.geometry.stacked.StackedPairs`: blocks
    ``(B, n_local, h)`` of the ``B`` heads of which this process holds a row (``heads``,
    of the stack's ``count``), zero on phantom rows (never written). Read and written
    through strided views of the held rows where they allow, else through explicit
    positions. ``rows`` are the global row numbers of the local rows (``-1``: phantom),
    ``whole`` the global ``(n, m)``, for the sampler. ``reduce`` sums a tensor of
    per-head values over the processes, each head's over those that hold it.
    ``exchange``: per side, the :class:`Split` rows (``None``: no row of the side is
    cut across processes), moved with ``total`` (the sum over processes)."""

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
        exchange: tuple[Split | None, Split | None] = (None, None),
    ):
        self.specs, self.layout, self.device, self.group = specs, None, device, group
        self.exchange = tuple(None if x is None else x.to(device) for x in exchange)
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

    def gather(self, flat: Tensor, moved: list[Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """The held rows' blocks of ``flat``, the cut rows' from ``moved`` (their summed
        buffers, per cut side) or moved here."""
        if self._index is None and self._strided(flat):
            out = []
            for segs, shape in zip(self._segments, self.shapes):
                block = torch.zeros(shape, dtype=flat.dtype, device=flat.device)
                for seg in segs:
                    b0, nb, r0, nr = seg[:4]
                    block[b0 : b0 + nb, r0 : r0 + nr].copy_(_view(flat, seg, shape[-1]))
                out.append(block)
        else:
            out = [flat[i.clamp_min(0)].masked_fill_((i < 0), 0) for i in self._explicit()]
        cut = self._cut()
        if moved is None:
            moved = self._moved([split.incoming(flat[split.mine]) for _, split in cut])
        for (i, split), buffer in zip(cut, moved):
            split.fill_(out[i], buffer)
        return out[0], out[1]

    def gather_many(self, flats: Sequence[Tensor]) -> list[tuple[Tensor, Tensor]]:
        """:meth:`gather` of each of ``flats``, their cut rows moved in one collective."""
        cut = self._cut()
        moved = iter(self._moved([s.incoming(f[s.mine]) for f in flats for _, s in cut]))
        return [self.gather(flat, [next(moved) for _ in cut]) for flat in flats]

    def _cut(self) -> list[tuple[int, Split]]:
        """``(side, split)`` of the sides with rows cut across processes."""
        return [(i, split) for i, split in enumerate(self.exchange) if split is not None]

    def _moved(self, buffers: list[Tensor]) -> list[Tensor]:
        """Each buffer of cut rows summed over the processes, in one collective."""
        if len(buffers) < 2:
            return [self._total(b) for b in buffers]
        total = self._total(torch.cat(buffers))
        return list(total.split([b.numel() for b in buffers]))

    def gather_params(self, params: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """The blocks of ``params`` (``{name: flat local slice}``, in their dtype), read
        parameter by parameter (no flat copy of them is made)."""
        names = {b.param for spec in self.specs for b in (*spec.g_blocks, *spec.h_blocks)}
        dtype = params[next(iter(names))].dtype
        layout, out = self._local, []
        for index in self._explicit():
            block = torch.zeros(index.shape, dtype=dtype, device=self.device)
            _read(params, names, layout, index, block)
            out.append(block)
        for block, split in zip(out, self.exchange):
            if split is not None:
                split.fill_(block, self._received(params, split))
        return out[0], out[1]

    def base_reader(self, params: dict[str, Tensor]):
        """``read(side, dtype)`` of the held rows of ``params`` (:meth:`read_params`), or
        ``None`` where the state must hold its blocks: held rows that no strided view of
        one parameter covers. Rows cut across processes come through a collective, made
        once here: the reader keeps the cut rows this process keeps (their entries
        only), and reads the rest where used."""
        kind = params[self.specs[0].g_blocks[0].param].dtype
        # the cut rows kept here, in the blocks' order: a collective per cut side, made by
        # every process (whatever it decides below)
        cut = [
            None if x is None else self._received(params, x)[x.block_at_runs.expand()].to(kind)
            for x in self.exchange
        ]
        located = self._local_segments
        if located is None or not (any(located) or any(c is not None for c in cut)):
            return None
        if not all(params[name].is_contiguous() for side in located for _, name in side):
            return None

        def read(side: str, dtype: torch.dtype | None = None) -> Tensor:
            i = 0 if side == "G" else 1
            if located[i]:
                out = self.read_params(params, side, dtype)
            else:  # only rows cut across processes here
                out = torch.zeros(self.shapes[i], dtype=dtype or kind, device=self.device)
            if cut[i] is not None:
                out.view(-1)[self.exchange[i].block_runs.expand()] = cut[i].to(out.dtype)
            return out

        return read

    def _received(self, params: dict[str, Tensor], split: Split) -> Tensor:
        """``split``'s buffer of cut rows, whole, from the entries of ``params`` held
        here (a collective)."""
        names = {b.param for spec in self.specs for b in (*spec.g_blocks, *spec.h_blocks)}
        index = split.mine
        dtype = params[next(iter(names))].dtype
        mine = torch.zeros(index.shape, dtype=dtype, device=self.device)
        _read(params, names, self._local, index, mine)
        return split.receive(mine, self._total)

    def read_params(
        self, params: dict[str, Tensor], side: str, dtype: torch.dtype | None = None
    ) -> Tensor:
        """Side ``"G"`` or ``"H"`` of the held rows of ``params`` (``{name: flat local
        slice}``) as a new block in ``dtype`` (zero on phantom rows), one strided view
        per segment."""
        i = 0 if side == "G" else 1
        # a side may hold only phantom rows here: the dtype is that of the stack's params
        first = params[next(name for located in self._local_segments for _, name in located)]
        out = torch.zeros(self.shapes[i], dtype=dtype or first.dtype, device=first.device)
        if not read_located(params, self._local_segments[i], out):
            raise RuntimeError("a sharded parameter is not contiguous")  # base_reader checks
        return out

    @functools.cached_property
    def _local_segments(self) -> tuple[list, list] | None:
        """Per side, the strided segments in the parameters they lie in
        (:func:`~geosharp.layout.locate_segments`), or ``None``."""
        if self._segments[0] is None or self._segments[1] is None:
            return None
        h = self.shapes[0][-1]
        located = [locate_segments(segs, self._local, h) for segs in self._segments]
        return None if None in located else (located[0], located[1])

    def _held(self, blocks) -> list[tuple[Tensor, Tensor]]:
        """``(positions, values)`` of the held entries of ``blocks``."""
        out = []
        for index, block in zip(self._explicit(), blocks):
            held = index >= 0
            out.append((index[held], block[held]))
        return out

    def positions(self) -> tuple[Tensor, Tensor]:
        return tuple(  # type: ignore[return-value]
            i[i >= 0] if x is None else torch.cat([i[i >= 0], x.mine])
            for i, x in zip(self._explicit(), self.exchange)
        )

    def mark_(self, mask: Tensor) -> Tensor:
        super().mark_(mask)
        for split in self.exchange:
            if split is not None:
                mask[split.mine] = True
        return mask

    def scatter(self, flat: Tensor, blocks) -> Tensor:
        if any(x is not None for x in self.exchange):
            raise NotImplementedError("an out-of-place write of rows split across processes")
        for pos, values in self._held(blocks):
            flat = flat.index_copy(0, pos, values)
        return flat

    def scatter_(self, flat: Tensor, blocks) -> Tensor:
        if self._index is None and self._strided(flat):
            for segs, block in zip(self._segments, blocks):
                write_strided(flat, segs, block.to(flat.dtype), accumulate=False)
        else:
            for pos, values in self._held(blocks):
                flat.index_copy_(0, pos, values.to(flat.dtype))
        cut = self._cut()
        for (_, split), buffer in zip(
            cut, self._moved([split.outgoing(blocks[i]) for i, split in cut])
        ):
            flat.index_copy_(0, split.mine, split.sent(buffer).to(flat.dtype))
        return flat

    def add_(self, flat: Tensor, blocks, alpha: float = 1.0) -> Tensor:
        if self._index is None and self._strided(flat):
            for segs, block in zip(self._segments, blocks):
                write_strided(flat, segs, block.to(flat.dtype), accumulate=True, alpha=alpha)
        else:
            for pos, values in self._held(blocks):
                flat.index_add_(0, pos, values.to(flat.dtype), alpha=alpha)
        cut = self._cut()
        for (_, split), buffer in zip(
            cut, self._moved([split.outgoing(blocks[i]) for i, split in cut])
        ):
            flat.index_add_(0, split.mine, split.sent(buffer).to(flat.dtype), alpha=alpha)
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
    own (never merged with held rows), which are then left out. A side of which no row
    is held here (a run of heads whose other side lies on other processes) has no
    segment: nothing to read."""
    if index.numel() == 0:
        return []
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
    """The local rows of every stack of ``pairs`` (stacked alike on every process, in
    parts of :func:`~geosharp.geometry.stacked.max_stack` entries for a sharded space,
    so that the ``h x h`` sums of a head line up on every process). Positions are
    worked out one pair at a time (no global index of a whole stack is made). A row cut
    across processes is kept by the lowest-ranked process holding an entry of it, its
    entries moved through a :class:`Split` buffer (one all-reduce per pair and side
    finds those rows)."""
    out = []
    stacks = group_pairs(pairs, max_stack(device, sharded=True))  # the same on every process
    for (n, m, _, group, _part), specs in stacks.items():
        sides, rows, exchange = [], [], []
        for side in ("g_blocks", "h_blocks"):
            parts, done = [], 0
            for spec in specs:
                parts.append(_held_rows(spec, side, shards, done))
                done += parts[-1][-1]
            n_local = max((p[0].shape[1] for p in parts), default=0)
            sides.append(torch.cat([_pad_rows(p[0], n_local) for p in parts]))
            rows.append(torch.cat([_pad_rows(p[1], n_local) for p in parts]))
            kept_at = torch.cat([_pad_rows(p[2], n_local) for p in parts])
            exchange.append((done, kept_at, *(torch.cat([p[k] for p in parts]) for k in (3, 4, 5))))
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
            tuple(_split(x, heads, b.shape[-1]) for x, b in zip(exchange, sides)),  # type: ignore[arg-type]
        )
        out.append(stack)
    return out


def _split(x: tuple, heads: Tensor, h: int) -> Split | None:
    """The :class:`Split` of one side from :func:`_held_rows`' parts (``None`` when no
    row of it is cut), its kept rows placed in the blocks of the ``heads`` held here."""
    count, kept_at, mine, mine_at, counts = x
    if count == 0:
        return None
    kept_at = kept_at[heads]
    b, k = (kept_at >= 0).nonzero(as_tuple=True)
    cols = torch.arange(h)
    block = ((b * kept_at.shape[1] + k) * h)[:, None] + cols
    block_at = (kept_at[b, k] * h)[:, None] + cols
    rows = torch.full((block.shape[0],), h)
    return Split(
        count * h,
        Runs(mine, counts),
        Runs(mine_at, counts),
        Runs(block.reshape(-1), rows),
        Runs(block_at.reshape(-1), rows),
    )


def _held_rows(
    spec: PairSpec, side: str, shards: Shards, before: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, int]:
    """One pair's rows held here: local positions ``(B, k, h)`` (held rows first, in
    their global order, ``-1`` rows after for heads that hold fewer, and on the split
    rows kept here, whose entries come through the buffer) and their global row
    numbers ``(B, k)`` (``-1`` there); the split rows kept here, by their number in the
    buffer (``(B, k)``, ``-1`` elsewhere, numbered after ``before``); the local
    positions of the entries held here of split rows and their places in the buffer,
    with the number of those entries in each row; and the number of split rows."""
    local = torch.cat([shards.to_local(b.param, b.index) for b in getattr(spec, side)], 1)
    held = local >= 0
    whole = held.all(-1)
    cut = held.any(-1) & ~whole
    # a row is split where some process holds part of it; the lowest such rank keeps it
    lowest = -shards.reduce_max(torch.where(cut, -float(shards.rank), -math.inf).double())
    split = lowest < math.inf
    kept = whole | (lowest == shards.rank)
    number = (torch.cumsum(split.reshape(-1), 0) - 1 + before).view(split.shape)
    number = torch.where(split, number, -1)
    k = int(kept.sum(1).max()) if kept.numel() else 0
    order = torch.sort((~kept).to(torch.int8), dim=1, stable=True).indices[:, :k]
    keep = torch.gather(kept, 1, order)
    picked = torch.gather(local, 1, order[..., None].expand(-1, -1, local.shape[-1]))
    picked[~torch.gather(whole, 1, order)] = -1
    row = torch.where(keep, order, -torch.ones_like(order))
    kept_at = torch.where(keep, torch.gather(number, 1, order), -1)
    entries = held & split[..., None]
    at = number[..., None] * local.shape[-1] + torch.arange(local.shape[-1])
    counts = entries.sum(-1).reshape(-1)  # entries per row, in the order of local[entries]
    return picked, row, kept_at, local[entries], at[entries], counts, int(split.sum())


def _pad_rows(x: Tensor, k: int) -> Tensor:
    """``x`` with ``-1`` rows appended along dimension 1 up to ``k``."""
    if x.shape[1] == k:
        return x
    pad = torch.full((x.shape[0], k - x.shape[1], *x.shape[2:]), -1, dtype=x.dtype)
    return torch.cat([x, pad], 1)
