r"""The pair factor of a perturbation space: the attention pairs, stacked.

Pairs of one shape ``(n, m, h)`` and one symmetry group are stacked over heads and
layers (:class:`StackedPairs`: blocks ``(B, n, h)`` and ``(B, m, h)`` read out of a flat
vector through strided views), so that all the ``h x h`` algebra is batched. Each
stack holds its pair state (:class:`~geosharp.geometry.pairs.PairState`), which owns
all the maths; this module only reads and writes the blocks.

:class:`Pairs` is the factor's definition (part of a
:class:`~geosharp.geometry.Geometry`): the pair metric, whether the pairs' entries are
measured in it (``ball``: the metric ball, horizontal projection and sampling on the
pairs; else the element-wise factor keeps them) and whether the step follows its
geodesic to second order (``geodesic``); :class:`PairSpace` its implementation.
"""

from __future__ import annotations

import functools
import itertools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..layout import (
    ParameterLayout,
    _view,
    gather_strided,
    locate_segments,
    read_located,
    row_segments,
    write_strided,
)
from ..symmetry.groups import read_block
from ..symmetry.pairs import PairSpec
from .elementwise import dot
from .pairs import PairMetric, PairState
from .subgroup import restrict_state

__all__ = ["PairSpace", "Pairs", "StackedPairs", "stack_pairs"]

Blocks = tuple[Tensor, Tensor]


@dataclass(frozen=True)
class Pairs:
    """The pair factor: ``metric`` on every ``(G, H)`` pair; ``ball``: the pairs' entries
    are measured, projected and sampled in it; ``geodesic``: the step adds the
    metric's geodesic acceleration (second order)."""

    metric: PairMetric
    ball: bool = True
    geodesic: bool = True


@dataclass
class StackedPairs:
    """Pairs of one shape ``(n, m, h)`` and one symmetry group, stacked over heads and
    layers: blocks ``(B, n, h)`` and ``(B, m, h)``.

    A flat vector's pair entries are read and written through strided views
    (:func:`~geosharp.layout.strided_segments`: a head of a linear layer is one strided
    block of its weight plus a row of its bias). Where the layout is not strided, and for
    vectors autograd tracks, int64 positions are built on demand (:attr:`g_index`,
    :attr:`h_index`) and not kept. ``state`` is the pair geometry at the base point,
    ``group`` the symmetry group (``"GL"`` or a subgroup, see
    :mod:`geosharp.geometry.subgroup`).
    """

    specs: list[PairSpec]
    layout: ParameterLayout
    device: torch.device
    state: PairState | None = None
    group: str = "GL"

    def __post_init__(self) -> None:
        heads = sum(s.shape[0] for s in self.specs)
        _, n, m, h = self.specs[0].shape
        self.shapes = (torch.Size((heads, n, h)), torch.Size((heads, m, h)))
        self._segments = tuple(self._strided_segments(side) for side in ("g_blocks", "h_blocks"))

    def _strided_segments(self, side: str) -> list | None:
        """The strided views of one side, found from its blocks' row starts (no position
        listed); ``None`` where a block's columns do not step evenly, which no strided
        view of its positions covers either."""
        rows = _row_starts(self.specs, side, self.layout)
        return None if rows is None else row_segments(*rows)

    @property
    def g_index(self) -> Tensor:
        """Flat positions of the ``G`` blocks, ``(B, n, h)`` int64 (built on each call)."""
        return _flat_index(self.specs, "g_blocks", self.layout, self.device)

    @property
    def h_index(self) -> Tensor:
        """Flat positions of the ``H`` blocks, ``(B, m, h)`` int64 (built on each call)."""
        return _flat_index(self.specs, "h_blocks", self.layout, self.device)

    def gather(self, flat: Tensor) -> Blocks:
        """The ``(G, H)`` entries of ``flat`` as new ``(B, n, h)`` and ``(B, m, h)`` blocks."""
        if self._strided(flat):
            return tuple(  # type: ignore[return-value]
                gather_strided(flat, segs, shape)
                for segs, shape in zip(self._segments, self.shapes)
            )
        return flat[self.g_index], flat[self.h_index]

    def gather_many(self, flats: Sequence[Tensor]) -> list[Blocks]:
        """:meth:`gather` of each of ``flats`` (on row shards: their cut rows moved in one
        collective)."""
        return [self.gather(flat) for flat in flats]

    def gather_params(self, params: dict[str, Tensor]) -> Blocks:
        """The blocks read from per-parameter tensors ``params`` (name -> 1-D view)."""
        return self.read_params(params, "G"), self.read_params(params, "H")

    def read_params(
        self, params: dict[str, Tensor], side: str, dtype: torch.dtype | None = None
    ) -> Tensor:
        """Side ``"G"`` or ``"H"`` of the blocks of ``params`` as a new ``(B, n, h)`` or
        ``(B, m, h)`` tensor in ``dtype`` (``None``: the parameters'), copied (and cast)
        once out of the parameters through the side's strided views, by index where it
        has none. Laid out as the weights hold the blocks: where a head's rows are a
        linear layer's rows (a query's ``W[k h : (k + 1) h, :]``), ``(B, h, n)`` storage
        seen transposed, so that the copy reads and writes whole rows."""
        i = 0 if side == "G" else 1
        attr = ("g_blocks", "h_blocks")[i]
        first = params[getattr(self.specs[0], attr)[0].param]
        B, n, h = self.shapes[i]
        dtype = dtype or first.dtype
        located, row_major = self._located[i]
        if row_major:
            out = torch.empty((B, h, n), dtype=dtype, device=first.device).transpose(1, 2)
        else:
            out = torch.empty((B, n, h), dtype=dtype, device=first.device)
        if located is None or not read_located(params, located, out):
            out.copy_(_stacked(self.specs, attr, lambda b: read_block(params, b)))
        return out

    @functools.cached_property
    def _located(self) -> tuple[tuple[list | None, bool], ...]:
        """Per side, its strided segments in the parameters they lie in
        (:func:`~geosharp.layout.locate_segments`; ``None``: none), and whether most of
        its entries lie in rows that step by one (:meth:`read_params`' layout)."""
        out = []
        for segs, (B, n, h) in zip(self._segments, self.shapes):
            located = None if segs is None else locate_segments(segs, self.layout, h)
            along = 0 if located is None else _along_rows(located, h)
            out.append((located, 2 * along > B * n * h))
        return tuple(out)

    def base_reader(self, params: dict[str, Tensor]):
        """``read(side, dtype)`` of the blocks of the base point ``params``, for a
        :class:`~geosharp.geometry.pairs.PairState` that holds none
        (:meth:`~geosharp.geometry.pairs.PairState.read_from_`)."""
        return lambda side, dtype=None: self.read_params(params, side, dtype)

    def scatter(self, flat: Tensor, blocks: Blocks) -> Tensor:
        """``flat`` with this pair's entries replaced by ``blocks`` (out of place)."""
        out = flat.index_copy(0, self.g_index.reshape(-1), blocks[0].reshape(-1))
        return out.index_copy(0, self.h_index.reshape(-1), blocks[1].reshape(-1))

    def scatter_(self, flat: Tensor, blocks: Blocks) -> Tensor:
        """:meth:`scatter` in place."""
        if self._strided(flat):
            for segs, block in zip(self._segments, blocks):
                write_strided(flat, segs, block.to(flat.dtype), accumulate=False)
            return flat
        for index, block in zip((self.g_index, self.h_index), blocks):
            flat.index_copy_(0, index.reshape(-1), block.reshape(-1).to(flat.dtype))
        return flat

    def add_(self, flat: Tensor, blocks: Blocks, alpha: float = 1.0) -> Tensor:
        """Add ``alpha * blocks`` to this pair's entries of ``flat``, in place."""
        if self._strided(flat):
            for segs, block in zip(self._segments, blocks):
                write_strided(flat, segs, block.to(flat.dtype), accumulate=True, alpha=alpha)
            return flat
        for index, block in zip((self.g_index, self.h_index), blocks):
            flat.index_add_(0, index.reshape(-1), block.reshape(-1).to(flat.dtype), alpha=alpha)
        return flat

    def positions(self) -> tuple[Tensor, Tensor]:
        """The flat positions of the ``G`` and ``H`` entries (1-D int64, new)."""
        return self.g_index.reshape(-1), self.h_index.reshape(-1)

    def mark_(self, mask: Tensor) -> Tensor:
        """Set ``mask`` (flat, boolean) at this stack's entries, in place."""
        if all(s is not None for s in self._segments):
            for segs, shape in zip(self._segments, self.shapes):
                for seg in segs:
                    _view(mask, seg, shape[-1]).fill_(True)
            return mask
        for pos in self.positions():
            mask[pos.to(mask.device)] = True
        return mask

    def sample(self, generator: torch.Generator | None) -> Blocks:
        """A draw of :meth:`PairState.sample` for this stack."""
        return self.state.sample(generator)

    def _strided(self, flat: Tensor) -> bool:
        return (
            self._segments[0] is not None
            and self._segments[1] is not None
            and flat.dim() == 1
            and flat.is_contiguous()
            and not (flat.requires_grad and torch.is_grad_enabled())  # autograd: index
        )


def _dot(a: Blocks, b: Blocks) -> Tensor:
    """The Euclidean ``<a, b>`` of two pairs of blocks (float64, 0-d)."""
    return sum(dot(x.reshape(-1), y.reshape(-1), 1 << 22) for x, y in zip(a, b))


def _direction_into(block: StackedPairs, state: PairState, g: Blocks, flat: Tensor) -> Tensor:
    """Write the ascent direction ``d`` of the blocks ``g`` into ``block``'s entries of
    ``flat``; returns ``<d, g>``."""
    d = state.direction(g)
    block.scatter_(flat, d)
    return _dot(d, g)


def _along_rows(located: list, h: int) -> int:
    """The entries of ``located`` segments whose rows step by one (a head's columns are
    rows of its weight)."""
    return sum(seg[1] * seg[3] * h for seg, _ in located if seg[6] == 1)


def _stacked(specs: Sequence[PairSpec], side: str, read) -> Tensor:
    """``read(block)`` for every block of one side (``"g_blocks"`` or ``"h_blocks"``) of
    ``specs``: rows concatenated within a pair, pairs stacked."""
    return torch.cat([torch.cat([read(b) for b in getattr(s, side)], dim=1) for s in specs])


def _flat_index(
    specs: Sequence[PairSpec], side: str, layout: ParameterLayout, device: torch.device
) -> Tensor:
    return _stacked(specs, side, lambda b: layout.offset(b.param) + b.index).to(device)


def _row_starts(
    specs: Sequence[PairSpec], side: str, layout: ParameterLayout
) -> tuple[Tensor, Tensor] | None:
    """The flat ``(start, step)`` of one side (:meth:`~geosharp.symmetry.pairs.Block.starts`
    of every block, stacked like the blocks), or ``None``."""
    rows = {id(b): b.starts() for spec in specs for b in getattr(spec, side)}
    if any(r is None for r in rows.values()):
        return None
    start = _stacked(specs, side, lambda b: rows[id(b)][0] + layout.offset(b.param))
    return start, _stacked(specs, side, lambda b: rows[id(b)][1])


def max_stack(device: torch.device | str, sharded: bool = False) -> int:
    """Block entries of one stack part on ``device``: what the batched maths of a part
    makes at once. On a CPU, ``2^20`` (a part's blocks, 4 MiB in float32, stay in the
    last-level cache while a step's products and copies read them again: the loop's own
    work on BERT-base's pairs took 0.47 s per step with parts of ``2^20`` entries against
    0.68 s with ``2^23`` and 0.56 s with ``2^18``, ``docs/results/step_trend/``);
    elsewhere, and for a ``sharded`` space everywhere, ``2^23``. A part is cut by heads,
    and a plan that places whole heads on processes (FSDP2's ``Shard(0)``) leaves a small
    part on one process only, whose collectives the others wait for: the 1.1B LLaMA's
    geodesic-inv on 2 CPU processes took 6.2-6.4 s per evaluation at 6 layers with
    ``2^20`` against 5.2-5.4 s with ``2^23`` (no difference with rows split across the
    processes; ``docs/results/llama_bf16/stack_parts_sharded.log``).

    >>> max_stack("cpu"), max_stack("meta"), max_stack("cpu", sharded=True)
    (1048576, 8388608, 8388608)
    """
    return 1 << 20 if torch.device(device).type == "cpu" and not sharded else 1 << 23


def group_pairs(
    pairs: Sequence[PairSpec], max_entries: int
) -> dict[tuple[int, int, int, str, int], list[PairSpec]]:
    """``{(n, m, h, group, part): pairs}``: the stacks, in the order of their first
    pair; pairs of one shape and group are cut into consecutive parts of at most
    ``max_entries`` block entries (:func:`max_stack`), so that what the batched maths
    makes at once stays a bounded fraction of a large model and, on a CPU, in cache. A
    pair of more entries is cut into near-equal runs of its heads first (one head at
    least).

    >>> from types import SimpleNamespace as Pair  # (heads, n, m, h): 32 entries each
    >>> pairs = [Pair(shape=(2, 4, 4, 2), group="GL") for _ in range(3)]
    >>> [len(ps) for ps in group_pairs(pairs, max_entries=64).values()]
    [2, 1]
    """
    groups: dict[tuple[int, int, int, str, int], list[PairSpec]] = {}
    sizes: dict[tuple[int, int, int, str], tuple[int, int]] = defaultdict(lambda: (0, 0))
    for pair in (part for whole in pairs for part in _head_runs(whole, max_entries)):
        count, n, m, h = pair.shape
        shape = (n, m, h, pair.group)
        part, used = sizes[shape]
        entries = count * (n + m) * h
        if used and used + entries > max_entries:
            part, used = part + 1, 0
        sizes[shape] = (part, used + entries)
        groups.setdefault((*shape, part), []).append(pair)
    return groups


def _head_runs(pair: PairSpec, max_entries: int) -> list[PairSpec]:
    """``pair`` cut into near-equal runs of heads of at most ``max_entries`` entries
    each (a head at least); itself where it fits."""
    count, n, m, h = pair.shape
    runs = min(count, -(-count * (n + m) * h // max_entries))
    if runs <= 1:
        return [pair]
    cuts = [count * i // runs for i in range(runs + 1)]
    return [pair.take_heads(a, b) for a, b in itertools.pairwise(cuts)]


def stack_pairs(
    pairs: Sequence[PairSpec], layout: ParameterLayout, device: torch.device
) -> list[StackedPairs]:
    """Group pairs by shape and symmetry group, in parts (:func:`group_pairs`)."""
    return [
        StackedPairs(specs, layout, torch.device(device), group=group)
        for (*_, group, _part), specs in group_pairs(pairs, max_stack(device)).items()
    ]


class PairSpace:
    """:class:`Pairs` at the base point ``params`` (``{name: 1-D view}``): one
    :class:`StackedPairs` with its state per shape and group.

    Reads (:meth:`read`) and writes (:meth:`write_`) its blocks of flat vectors, and
    answers, per stack, what the product space asks of it: the metric, projection,
    Riemannian gradient, ascent direction and sampler on the pairs (when ``ball``), the
    geodesic correction of the step and its pullback (when ``geodesic``). The
    element-wise factor writes every entry first; the pairs then write theirs.
    """

    def __init__(
        self,
        factor: Pairs,
        pairs: Sequence[PairSpec],
        layout: ParameterLayout,
        params: dict[str, Tensor],
        device: torch.device,
        stacks: list[StackedPairs] | None = None,
        reduce=None,
    ):
        self.factor = factor
        self.ball, self.geodesic = factor.ball, factor.geodesic
        self.layout = layout
        self.reduce = reduce  # row shards: the sum over processes (else None)
        self.blocks = stack_pairs(pairs, layout, device) if stacks is None else stacks
        self.set_states(params)

    def set_states(self, params: dict[str, Tensor]) -> None:
        """The pair states at ``params`` (views of the base point)."""
        self._params = params
        for block in self.blocks:
            # row shards: the sum over processes, of the heads the block holds
            reduce = getattr(block, "reduce", self.reduce)
            extra = {} if reduce is None else {"reduce": reduce}
            state = self.factor.metric.state(*block.gather_params(params), **extra)
            state = restrict_state(state, block.group)
            # the blocks are read from the base point where used, not held: a geodesic
            # measure keeps no copy of the pairs' weights (one perturbed-parameter-sized
            # vector of an attention-only measure)
            reader = block.base_reader(params)
            block.state = state if reader is None else state.read_from_(reader)

    def claimed(self, params: dict[str, Tensor]) -> dict[str, Tensor]:
        """``{name: boolean mask}`` of the entries whose metric is the pairs' (none
        without ``ball``): the element-wise factor leaves them alone."""
        masks: dict[str, Tensor] = {}
        if not self.ball:
            return masks
        device = next(iter(params.values())).device
        flat = torch.zeros(self.layout.numel, dtype=torch.bool, device=device)
        for block in self.blocks:
            block.mark_(flat)
        for name, mask in self.layout.unflatten(flat).items():
            mask = mask.reshape(-1)
            if bool(mask.any()):
                # a partial mask is kept: its own copy, so that the flat one is freed
                masks[name] = mask if bool(mask.all()) else mask.clone()
        return masks

    def read(self, flat: Tensor) -> list[Blocks]:
        return [block.gather(flat) for block in self.blocks]

    def write_(self, flat: Tensor, values: Sequence[Blocks]) -> Tensor:
        for block, value in zip(self.blocks, values):
            block.scatter_(flat, value)
        return flat

    # -- the metric (ball only) -----------------------------------------------------------

    def inner(self, xi: Tensor, eta: Tensor, total: Tensor) -> Tensor:
        """``total`` plus the pair metric's ``g(xi, eta)`` summed over pairs."""
        shared = None  # row shards: each head's value added once, over the processes
        for block in self.blocks:
            values = block.state.inner(block.gather(xi), block.gather(eta))
            owned = getattr(block, "owned", None)
            if owned is None:
                total = total + values.sum()
            else:
                part = values[owned].sum()
                shared = part if shared is None else shared + part
        return total if shared is None else total + self.reduce(shared)

    def proju_(self, xi: Tensor) -> Tensor:
        for block in self.blocks:
            block.scatter_(xi, block.state.proju(block.gather(xi)))
        return xi

    def egrad2rgrad(self, egrad: Tensor) -> list[Blocks]:
        return [b.state.egrad2rgrad(b.gather(egrad)) for b in self.blocks]

    def horizontal_residual(self, xi: Tensor) -> Tensor:
        worst = torch.zeros((), dtype=torch.float64, device=xi.device)
        for block in self.blocks:
            R = block.state.horizontal_residual(block.gather(xi))
            worst = torch.maximum(worst, R.abs().amax())
        return worst

    def direction_(self, egrad: Tensor) -> Tensor:
        """Overwrite each stack's entries of the Euclidean gradient ``egrad`` with its
        ascent direction ``d``, one stack at a time; returns ``sum <d, g>``."""
        sq = torch.zeros((), dtype=torch.float64, device=egrad.device)
        for block in self.blocks:
            sq = sq + _direction_into(block, block.state, block.gather(egrad), egrad)
        return sq if self.reduce is None else self.reduce(sq)

    def ascent_(
        self, xi: Tensor, grad: Tensor, saved: list[object], others: Sequence[Tensor]
    ) -> tuple[Tensor, list[Tensor]]:
        """:meth:`pullback_` then :meth:`direction_` in one pass over each stack's blocks
        (read once, written once): the gradient's pair entries become the ascent
        direction ``d`` of the pulled-back gradient ``g``. Returns ``sum <d, g>`` and
        ``<y, g>`` over the pair entries for each ``y`` of ``others`` (this process's
        rows; not summed over processes)."""
        sq = torch.zeros((), dtype=torch.float64, device=grad.device)
        dots = [torch.zeros_like(sq) for _ in others]
        ys = [y for y in others if y is not xi]
        for block, kept in zip(self.blocks, saved):
            x, e, *read = block.gather_many([xi, grad, *ys])
            with block.state.reading(grad.dtype) as state:  # the base blocks read once
                g = state.pullback(x, e, kept)
                e = None  # the gradient's blocks freed before the direction is made
                for j, y in enumerate(others):
                    dots[j] = dots[j] + _dot(x if y is xi else read.pop(0), g)
                sq = sq + _direction_into(block, state, g, grad)
        return sq, dots

    def sample(self, generator: torch.Generator | None) -> list[Blocks]:
        return [block.sample(generator) for block in self.blocks]

    # -- the step -------------------------------------------------------------------------

    def retr_(self, xi: Tensor, out: Tensor, straighten: bool) -> list[object]:
        """Write the pairs' part of the step into ``out`` (which holds the element-wise
        step): ``straighten`` puts the straight ``theta + xi`` back on pair entries
        (after an exponential element-wise step); the geodesic correction
        ``accel / 2`` is added. Returns what :meth:`pullback_` reuses."""
        if straighten:
            self._straighten_(xi, out)
        saved = []
        if not self.geodesic:
            return saved
        for block in self.blocks:
            x = block.gather(xi)
            with block.state.reading(xi.dtype) as state:  # its matrices made once, freed
                if straighten:
                    block.add_(out, state.geodesic_acceleration(x), alpha=0.5)
                    saved.append(None)
                    continue
                accel, kept = state.accelerate(x)
            block.add_(out, accel, alpha=0.5)
            saved.append(kept)
        return saved

    def saved(self, xi: Tensor, straighten: bool) -> list[object]:
        """What :meth:`retr_` returns for :meth:`pullback_` at ``xi``, made again (nothing
        written)."""
        if straighten:
            return [None for _ in self.blocks]
        return [block.state.accelerate(block.gather(xi))[1] for block in self.blocks]

    def _straighten_(self, xi: Tensor, out: Tensor) -> None:
        params = self._params
        for block in self.blocks:
            g_th, h_th = block.gather_params(params)
            g_xi, h_xi = block.gather(xi)
            block.scatter_(out, (g_th + g_xi, h_th + h_xi))

    def pullback_(self, xi: Tensor, grad: Tensor, saved: list[object]) -> Tensor:
        """The gradient's pair blocks pulled back through the geodesic correction,
        written into ``grad``, one stack at a time."""
        for block, kept in zip(self.blocks, saved):
            block.scatter_(grad, block.state.pullback(block.gather(xi), block.gather(grad), kept))
        return grad

    def add_acceleration_(self, xi: Tensor, out: Tensor) -> None:
        for block in self.blocks:
            block.add_(out, block.state.geodesic_acceleration(block.gather(xi)))

    def retr(self, theta: Tensor, xi: Tensor, out: Tensor, straighten: bool) -> Tensor:
        """:meth:`retr_` out of place and differentiable in ``xi``."""
        if straighten:
            for block in self.blocks:
                g_th, h_th = block.gather(theta)
                g_xi, h_xi = block.gather(xi)
                out = block.scatter(out, (g_th + g_xi, h_th + h_xi))
        if self.geodesic:
            for block in self.blocks:
                aG, aH = block.state.geodesic_acceleration(block.gather(xi))
                out = out.index_add_(0, block.g_index.reshape(-1), aG.reshape(-1), alpha=0.5)
                out = out.index_add_(0, block.h_index.reshape(-1), aH.reshape(-1), alpha=0.5)
        return out
