"""Where a perturbation's entries live: parameters packed into one flat vector, and
strided views of it.

Every measure works on a *flat* copy ``theta`` of the parameters it perturbs.
:class:`ParameterLayout` packs and unpacks it (views, no copy); a pair's block, given
as int64 positions, is read and written through few strided views
(:func:`strided_segments`) where its layout allows. This module sits below both
:mod:`geosharp.symmetry` and :mod:`geosharp.geometry`.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "ParameterLayout",
    "Runs",
    "Segment",
    "column_starts",
    "gather_strided",
    "row_segments",
    "strided_segments",
    "write_strided",
]


@dataclass(frozen=True)
class ParameterLayout:
    """Names, shapes and offsets of the parameters packed into one flat vector."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    numel: int

    @classmethod
    def from_named(cls, named: Iterable[tuple[str, Tensor]]) -> ParameterLayout:
        names, shapes, offsets, total = [], [], [], 0
        for name, tensor in named:
            names.append(name)
            shapes.append(tensor.shape)
            offsets.append(total)
            total += tensor.numel()
        return cls(tuple(names), tuple(shapes), tuple(offsets), total)

    def offset(self, name: str) -> int:
        return self.offsets[self.names.index(name)]

    def flatten(self, tensors: Mapping[str, Tensor]) -> Tensor:
        """Concatenate ``tensors[name]`` for every name of the layout (a copy)."""
        return torch.cat([tensors[n].reshape(-1) for n in self.names])

    def unflatten(self, flat: Tensor) -> dict[str, Tensor]:
        """Views of ``flat`` with the parameters' shapes (no copy)."""
        sizes = [s.numel() for s in self.shapes]
        return {
            n: chunk.view(s)
            for n, s, chunk in zip(self.names, self.shapes, torch.split(flat, sizes))
        }


Segment = tuple[int, int, int, int, int, int, int, int]


def strided_segments(index: Tensor, max_segments: int | None = None) -> list[Segment] | None:
    """Cover a ``(B, n, h)`` block of flat positions by few strided views.

    Each segment ``(b0, nb, r0, nr, offset, sb, sr, sc)`` says that
    ``index[b0:b0+nb, r0:r0+nr, :]`` equals ``offset + b sb + r sr + c sc`` (``b, r, c``
    counted from the segment's start): a view ``flat.as_strided((nb, nr, h), (sb, sr,
    sc), offset)``. Returns ``None`` when the block is not made of such pieces (or needs
    more than ``max_segments``, default ``4 B + 16``): callers then index.

    >>> base = torch.arange(24).view(4, 6)  # a (4 x 6) weight; 2 heads of 2 rows each
    >>> index = torch.stack([base[0:2].T, base[2:4].T])  # (2, 6, 2): G = W_head^T
    >>> strided_segments(index)
    [(0, 2, 0, 6, 0, 12, 1, 6)]
    """
    if index.dim() != 3 or index.numel() == 0:
        return None
    rows = column_starts(index)
    return None if rows is None else row_segments(*rows, max_segments)


def column_starts(index: Tensor) -> tuple[Tensor, Tensor] | None:
    """``(start, col)``, ``(B, n)`` int64 each (on the CPU), with ``index[b, r, c] =
    start[b, r] + c col[b, r]`` (``col`` 1 for one column), or ``None`` when a row's
    columns do not step evenly: a ``(B, n, h)`` block without its column axis.

    >>> column_starts(torch.tensor([[[0, 4], [1, 5]]]))
    (tensor([[0, 1]]), tensor([[4, 4]]))
    """
    h = index.shape[2]
    idx = index.detach().to("cpu", torch.int64)
    start = idx[:, :, 0].clone()
    col = idx[:, :, 1] - idx[:, :, 0] if h > 1 else torch.ones_like(start)
    if h > 1 and not torch.equal(idx, start[..., None] + torch.arange(h) * col[..., None]):
        return None
    return start, col


def row_segments(
    start: Tensor, col: Tensor, max_segments: int | None = None
) -> list[Segment] | None:
    """:func:`strided_segments` of the block ``start[b, r] + c col[b, r]`` (``(B, n)``
    int64 each), without listing its positions: what a block whose columns step evenly
    is known by.

    >>> row_segments(torch.tensor([[0, 1], [2, 3]]), torch.full((2, 2), 4))
    [(0, 2, 0, 2, 0, 2, 1, 4)]
    """
    if start.dim() != 2 or start.numel() == 0:
        return None
    B, n = start.shape
    limit = 4 * B + 16 if max_segments is None else max_segments
    start, col = start.to("cpu", torch.int64), col.to("cpu", torch.int64)
    # Runs of rows with one column stride and one row stride, per head. Rows where the
    # column stride or the row step changes are found at once; the runs are then cut
    # greedily at those rows only.
    step = torch.zeros_like(start)
    step[:, 1:] = start[:, 1:] - start[:, :-1]
    change = torch.zeros_like(start, dtype=torch.bool)
    change[:, 1:] = col[:, 1:] != col[:, :-1]
    change[:, 2:] |= step[:, 2:] != step[:, 1:-1]
    heads_at, rows_at = change.nonzero(as_tuple=True)
    changes: list[list[int]] = [[] for _ in range(B)]
    for b, r in zip(heads_at.tolist(), rows_at.tolist()):
        changes[b].append(r)
    col_l, start_l, step_l = col.tolist(), start.tolist(), step.tolist()
    runs_per_head: list[list[tuple[int, int, int, int]]] = []  # (r0, nr, sr, sc)
    for b in range(B):
        runs, r0, cuts = [], 0, changes[b]
        while r0 < n:
            if r0 + 1 < n and col_l[b][r0 + 1] == col_l[b][r0]:
                k = bisect.bisect_right(cuts, r0 + 1)
                r1 = cuts[k] if k < len(cuts) else n
                sr = step_l[b][r0 + 1]
            else:
                r1, sr = r0 + 1, 0
            runs.append((r0, r1 - r0, sr, col_l[b][r0]))
            r0 = r1
        if len(runs) > limit:
            return None
        runs_per_head.append(runs)
    # Merge consecutive heads with the same runs; each run then steps through memory by
    # its own constant offset from head to head (a weight block and a bias row do not).
    # A step back, or from a negative offset to a non-negative one (the placeholders of
    # rows held elsewhere, :func:`geosharp.geometry.sharded._held_segments`), is not
    # merged: that head starts a segment of its own.
    segments: list[Segment] = []
    b0 = 0
    while b0 < B:
        runs = runs_per_head[b0]
        b1 = b0 + 1
        while b1 < B and runs_per_head[b1] == runs:
            b1 += 1
        for r0, nr, sr, sc in runs:
            offsets = [start_l[b][r0] for b in range(b0, b1)]
            i = 0
            while i < len(offsets):
                j, step = i + 1, 0
                side = offsets[i] >= 0
                if j < len(offsets) and offsets[j] > offsets[i] and (offsets[j] >= 0) == side:
                    step = offsets[j] - offsets[i]
                    while (
                        j < len(offsets)
                        and offsets[j] - offsets[j - 1] == step
                        and (offsets[j] >= 0) == side
                    ):
                        j += 1
                segments.append((b0 + i, j - i, r0, nr, offsets[i], step, sr, sc))
                i = j
        b0 = b1
        if len(segments) > limit:
            return None
    # Negative strides cannot be viewed; a zero stride over several rows would repeat
    # positions (writes through such a view are ill-defined): index instead. Heads are
    # merged above only at a positive stride.
    for _, _, _, nr, _, _, sr, sc in segments:
        if min(sr, sc) < 0 or (sr == 0 and nr > 1) or sc == 0:
            return None
    return segments


class Runs:
    """A flat int64 index held as its rows' arithmetic runs: row ``i`` is
    ``first[i] + step[i] * arange(count[i])``, and :meth:`expand` makes the index where
    it is used (``3`` numbers a row instead of ``count``). An index whose rows are not
    such runs is held as it is.

    >>> import torch
    >>> index = torch.cat([torch.arange(0, 32, 4), torch.arange(50, 58), torch.tensor([9])])
    >>> runs = Runs(index, torch.tensor([8, 8, 1]))
    >>> torch.equal(runs.expand(), index), runs.explicit is None
    (True, True)
    >>> Runs(index, torch.tensor([4, 8, 5])).explicit is None  # 16, 20, 24, 28, 50 is no run
    False
    """

    def __init__(self, index: Tensor, counts: Tensor):
        self.numel, self.explicit = index.numel(), None
        counts = counts[counts > 0].to(device=index.device, dtype=torch.long)
        if int(counts.sum()) != self.numel:
            raise ValueError(f"rows of {int(counts.sum())} entries for an index of {self.numel}")
        starts = torch.cumsum(counts, 0) - counts
        first = index[starts]
        second = index[torch.where(counts > 1, starts + 1, starts)]
        self.counts, self.step = counts, second - first
        self.base = first - self.step * starts  # entry k of row i: base[i] + step[i] * k
        if not torch.equal(self.expand(), index):
            self.explicit, self.counts, self.step, self.base = index, None, None, None

    def expand(self) -> Tensor:
        """The index, made."""
        if self.explicit is not None:
            return self.explicit
        out = torch.repeat_interleave(self.step, self.counts, output_size=self.numel)
        out.mul_(torch.arange(self.numel, device=out.device))
        return out.add_(torch.repeat_interleave(self.base, self.counts, output_size=self.numel))

    def to(self, device: torch.device) -> Runs:
        out = Runs.__new__(Runs)
        out.numel = self.numel
        for name in ("explicit", "counts", "step", "base"):
            value = getattr(self, name)
            setattr(out, name, None if value is None else value.to(device))
        return out


def _view(flat: Tensor, seg: Segment, h: int) -> Tensor:
    _, nb, _, nr, offset, sb, sr, sc = seg
    return flat.as_strided((nb, nr, h), (sb, sr, sc), flat.storage_offset() + offset)


def gather_strided(flat: Tensor, segments: list[Segment], shape: torch.Size) -> Tensor:
    out = torch.empty(shape, dtype=flat.dtype, device=flat.device)
    for seg in segments:
        b0, nb, r0, nr = seg[:4]
        out[b0 : b0 + nb, r0 : r0 + nr].copy_(_view(flat, seg, shape[-1]))
    return out


def locate_segments(
    segments: list[Segment], layout: ParameterLayout, h: int
) -> list[tuple[Segment, str]] | None:
    """Each segment of a flat vector of ``layout`` as ``(segment, name)``, its offset
    counted in the parameter ``name`` it lies in (:func:`read_located`): a segment whose
    rows run on into the next parameter (a weight's rows, then its bias row) is cut
    there, and one whose heads lie in different parameters (the same block of two
    layers) is cut into its heads. ``None`` where a row leaves its parameter.

    >>> layout = ParameterLayout.from_named([("w", torch.zeros(2, 3)), ("b", torch.zeros(3))])
    >>> locate_segments([(0, 1, 0, 3, 0, 0, 3, 1)], layout, 3)  # two weight rows, a bias row
    [((0, 1, 0, 2, 0, 0, 3, 1), 'w'), ((0, 1, 2, 1, 0, 0, 3, 1), 'b')]
    >>> layout = ParameterLayout.from_named([("w0", torch.zeros(2, 3)), ("w1", torch.zeros(2, 3))])
    >>> locate_segments([(0, 2, 0, 2, 0, 6, 3, 1)], layout, 3)  # a head in each weight
    [((0, 1, 0, 2, 0, 6, 3, 1), 'w0'), ((1, 1, 0, 2, 0, 6, 3, 1), 'w1')]
    """
    out = []
    for seg in segments:
        located = _locate(seg, layout, h)
        b0, nb, r0, nr, offset, sb, sr, sc = seg
        if located is None and nb > 1:  # its heads in different parameters: one by one
            heads = [_locate((b0 + k, 1, r0, nr, offset + k * sb, sb, sr, sc), layout, h)
                     for k in range(nb)]  # fmt: skip
            located = None if None in heads else [x for head in heads for x in head]
        if located is None:
            return None
        out.extend(located)
    return out


def _locate(segment: Segment, layout: ParameterLayout, h: int) -> list | None:
    """:func:`locate_segments` of one segment, all its heads in the same parameters."""
    b0, nb, r0, nr, offset, sb, sr, sc = segment
    span = (nb - 1) * sb + (h - 1) * sc  # from a row's first entry to its last
    out, r = [], 0
    while r < nr:
        first = offset + r * sr
        i = bisect.bisect_right(layout.offsets, first) - 1
        if i < 0:
            return None
        start = layout.offsets[i]
        stop = start + math.prod(layout.shapes[i])
        if first + span >= stop:
            return None
        rows = nr - r if sr == 0 else min(nr - r, (stop - 1 - span - first) // sr + 1)
        out.append(((b0, nb, r0 + r, rows, first - start, sb, sr, sc), layout.names[i]))
        r += rows
    return out


def read_located(
    params: Mapping[str, Tensor], located: list[tuple[Segment, str]], out: Tensor
) -> bool:
    """Copy the :func:`locate_segments` of ``params`` (``{name: tensor}``) into the
    ``(B, n, h)`` block ``out`` (any strides, any dtype: cast in the copy); ``False``,
    nothing copied, where one of the parameters is not contiguous."""
    if not all(params[name].is_contiguous() for _, name in located):
        return False
    for seg, name in located:
        b0, nb, r0, nr = seg[:4]
        out[b0 : b0 + nb, r0 : r0 + nr].copy_(_view(params[name], seg, out.shape[-1]))
    return True


def write_strided(
    flat: Tensor, segments: list[Segment], block: Tensor, accumulate: bool, alpha: float = 1.0
) -> None:
    h = block.shape[-1]
    for seg in segments:
        b0, nb, r0, nr = seg[:4]
        view, part = _view(flat, seg, h), block[b0 : b0 + nb, r0 : r0 + nr]
        if not accumulate:
            view.copy_(part)
        elif alpha == 1.0:
            view.add_(part)
        else:
            view.add_(part, alpha=alpha)
