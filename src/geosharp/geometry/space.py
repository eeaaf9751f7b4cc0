r"""The tangent space of a whole network at ``theta``, for one geometry.

A full-network tangent ``xi`` is one flat vector shaped like the perturbed parameters
(:class:`~geosharp.layout.ParameterLayout`). Entries that belong to a symmetric pair
are read as stacked ``(xiG, xiH)`` blocks (all pairs of the same shape across layers
batched together); every other entry keeps the element-wise geometry

.. math:: \|\xi\|^2 = \sum_j (\xi_j / c_j)^2, \qquad c_j = |\theta_j|
          \text{ (adaptive) or } 1 \text{ (Euclidean)}.

Entries with ``c_j = 0`` cannot move (the ball has no extent along them).

The geometries (MATH.md section 6 and its ablations):

=============================  =================  ================  ===============
name                           ball               horizontal        step
=============================  =================  ================  ===============
``euclidean``                  ``||xi||_2``       --                straight
``adaptive``                   ``||xi / |θ| ||``  --                straight
``geodesic``                   pair metric        projected         2nd-order geodesic
``geodesic-norm-only``         pair metric        projected         straight
``geodesic-curvature-only``    ``||xi / |θ| ||``  --                2nd-order geodesic
=============================  =================  ================  ===============
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..layout import ParameterLayout, gather_strided, strided_segments, write_strided
from ..symmetry.pairs import PairSpec
from .pairs import PairMetric, PairState, get_metric
from .subgroup import restrict_state

__all__ = ["GEOMETRIES", "Geometry", "PerturbationSpace", "Retraction", "StackedPairs"]

GEOMETRIES = (
    "euclidean",
    "adaptive",
    "geodesic",
    "geodesic-norm-only",
    "geodesic-curvature-only",
)


@dataclass(frozen=True)
class Geometry:
    """What defines a perturbation: the ball's norm, horizontality, and the step.

    Build with :meth:`named`. ``p`` is 2 (round ball) or ``inf`` (the element-wise box
    of adaptive sharpness in Andriushchenko et al. 2023).
    """

    name: str
    metric: PairMetric | None  # metric of the symmetric pairs (None: no pairs used)
    metric_ball: bool  # ball measured with the pair metric (else element-wise)
    geodesic_step: bool  # second-order geodesic on pairs (else straight line)
    relative: bool  # element-wise scale |theta| (else 1)
    p: float = 2.0
    exp_elementwise: bool = False  # exact GL(1) geodesic theta * exp(xi / theta)

    @classmethod
    def named(
        cls,
        name: str,
        metric: str | PairMetric = "inv",
        eps: float = 0.0,
        p: float = 2.0,
        elementwise_step: str = "straight",
    ) -> Geometry:
        if name not in GEOMETRIES:
            raise ValueError(f"unknown geometry {name!r}: choose one of {', '.join(GEOMETRIES)}")
        if p not in (2, 2.0, float("inf")):
            raise ValueError(f"p must be 2 or float('inf'), got {p!r}")
        if p != 2 and name != "adaptive":
            raise ValueError(
                f"the L-infinity ball is defined for 'adaptive' only, not for {name!r}"
            )
        if elementwise_step not in ("straight", "exp"):
            raise ValueError("elementwise_step must be 'straight' or 'exp'")
        exp = elementwise_step == "exp"
        if exp and name == "euclidean":
            raise ValueError("the exponential element-wise step needs a relative scale")
        if name == "euclidean":
            return cls(name, None, False, False, relative=False)
        if name == "adaptive":
            return cls(name, None, False, False, relative=True, p=float(p), exp_elementwise=exp)
        pair_metric = get_metric(metric, eps)
        full = f"{name}-{pair_metric.name}"  # the measure's name: "geodesic-inv", ...
        if name == "geodesic":
            return cls(full, pair_metric, True, True, True, exp_elementwise=exp)
        if name == "geodesic-norm-only":
            return cls(full, pair_metric, True, False, True, exp_elementwise=exp)
        return cls(full, pair_metric, False, True, True, exp_elementwise=exp)


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
        g, h = self.g_index, self.h_index
        self.shapes = (g.shape, h.shape)
        self._segments = (strided_segments(g), strided_segments(h))

    @property
    def g_index(self) -> Tensor:
        """Flat positions of the ``G`` blocks, ``(B, n, h)`` int64 (built on each call)."""
        return _flat_index(self.specs, "g_blocks", self.layout, self.device)

    @property
    def h_index(self) -> Tensor:
        """Flat positions of the ``H`` blocks, ``(B, m, h)`` int64 (built on each call)."""
        return _flat_index(self.specs, "h_blocks", self.layout, self.device)

    def gather(self, flat: Tensor) -> tuple[Tensor, Tensor]:
        """The ``(G, H)`` entries of ``flat`` as new ``(B, n, h)`` and ``(B, m, h)`` blocks."""
        if self._strided(flat):
            return tuple(  # type: ignore[return-value]
                gather_strided(flat, segs, shape)
                for segs, shape in zip(self._segments, self.shapes)
            )
        return flat[self.g_index], flat[self.h_index]

    def gather_params(self, params: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """The blocks read from per-parameter tensors ``params`` (name -> 1-D view)."""
        return tuple(  # type: ignore[return-value]
            _stacked(self.specs, side, lambda b: params[b.param][b.index.to(self.device)])
            for side in ("g_blocks", "h_blocks")
        )

    def scatter(self, flat: Tensor, blocks: tuple[Tensor, Tensor]) -> Tensor:
        """``flat`` with this pair's entries replaced by ``blocks`` (out of place)."""
        out = flat.index_copy(0, self.g_index.reshape(-1), blocks[0].reshape(-1))
        return out.index_copy(0, self.h_index.reshape(-1), blocks[1].reshape(-1))

    def scatter_(self, flat: Tensor, blocks: tuple[Tensor, Tensor]) -> Tensor:
        """:meth:`scatter` in place."""
        if self._strided(flat):
            for segs, block in zip(self._segments, blocks):
                write_strided(flat, segs, block.to(flat.dtype), accumulate=False)
            return flat
        for index, block in zip((self.g_index, self.h_index), blocks):
            flat.index_copy_(0, index.reshape(-1), block.reshape(-1).to(flat.dtype))
        return flat

    def add_(self, flat: Tensor, blocks: tuple[Tensor, Tensor], alpha: float = 1.0) -> Tensor:
        """Add ``alpha * blocks`` to this pair's entries of ``flat``, in place."""
        if self._strided(flat):
            for segs, block in zip(self._segments, blocks):
                write_strided(flat, segs, block.to(flat.dtype), accumulate=True, alpha=alpha)
            return flat
        for index, block in zip((self.g_index, self.h_index), blocks):
            flat.index_add_(0, index.reshape(-1), block.reshape(-1).to(flat.dtype), alpha=alpha)
        return flat

    def _strided(self, flat: Tensor) -> bool:
        return (
            self._segments[0] is not None
            and self._segments[1] is not None
            and flat.dim() == 1
            and flat.is_contiguous()
            and not (flat.requires_grad and torch.is_grad_enabled())  # autograd: index
        )


def _stacked(specs: Sequence[PairSpec], side: str, read) -> Tensor:
    """``read(block)`` for every block of one side (``"g_blocks"`` or ``"h_blocks"``) of
    ``specs``: rows concatenated within a pair, pairs stacked."""
    return torch.cat([torch.cat([read(b) for b in getattr(s, side)], dim=1) for s in specs])


def _flat_index(
    specs: Sequence[PairSpec], side: str, layout: ParameterLayout, device: torch.device
) -> Tensor:
    return _stacked(specs, side, lambda b: layout.offset(b.param) + b.index).to(device)


def stack_pairs(
    pairs: Sequence[PairSpec], layout: ParameterLayout, device: torch.device
) -> list[StackedPairs]:
    """Group pairs by shape and symmetry group."""
    groups: dict[tuple[int, int, int, str], list[PairSpec]] = defaultdict(list)
    for pair in pairs:
        _, n, m, h = pair.shape
        groups[(n, m, h, pair.group)].append(pair)
    return [
        StackedPairs(specs, layout, torch.device(device), group=group)
        for (*_, group), specs in groups.items()
    ]


@dataclass
class Retraction:
    """What :meth:`PerturbationSpace.retr_` computed that the pullback reuses: the
    tangent ``xi`` and, per pair block, the state's saved ``h x h`` matrices (the ``xi``
    blocks are read again rather than kept through the forward and backward).
    :meth:`PerturbationSpace.pullback_` adds the pulled-back gradient's pair blocks,
    which :meth:`PerturbationSpace.split_direction_` then need not gather again."""

    xi: Tensor
    saved: list[object]
    grad_pairs: list[tuple[Tensor, Tensor]] | None = None


@dataclass
class _Part:
    """One parameter's entries ``[start, start + numel)`` of a flat tangent.

    ``theta``: the parameter itself, as a 1-D view; ``pairs``: its entries that belong to
    pairs of a pair-ball geometry (``False`` none, ``True`` all, or a boolean mask);
    ``frozen``: whether some element-wise entry cannot move (``|theta_j|`` below
    ``sqrt(tiny)`` with the relative scale).
    """

    start: int
    theta: Tensor
    pairs: bool | Tensor = False
    frozen: bool = False

    @property
    def end(self) -> int:
        return self.start + self.theta.numel()


class PerturbationSpace:
    """Tangent space at ``theta`` for a :class:`Geometry`.

    ``theta``: the perturbed parameters, either as ``{name: tensor}`` (the model's own
    tensors: they are read, never copied or written) or as one flat vector of the
    layout. Tangents are flat vectors of the layout (``layout.unflatten`` shows them per
    parameter, as views).

    Operations mirror geoopt's manifold interface: :meth:`inner`, :meth:`proju`
    (horizontal projection), :meth:`egrad2rgrad`, :meth:`retr` (the perturbed point
    ``gamma_xi(1)``), plus :meth:`random` (a Gaussian in the metric). The in-place
    methods :meth:`retr_`, :meth:`pullback_`, :meth:`split_direction_` and
    :meth:`combine_` serve Auto-PGD's inner loop; what one passes to the next is
    explicit (:class:`Retraction`). The element-wise scale ``c`` and the mask of frozen
    entries are computed from ``theta`` piece by piece when used (:attr:`scale` and
    :attr:`active` build them whole, for inspection): the space keeps no
    parameter-sized vector, unless ``cache_scale=True`` keeps ``c`` (one vector, and
    a multiplication instead of a piece-wise computation wherever it is applied). The
    pair maths is the pair states' own (:class:`~geosharp.geometry.pairs.PairState`);
    this class only reads and writes their blocks.
    """

    def __init__(
        self,
        theta: Tensor | Mapping[str, Tensor],
        layout: ParameterLayout,
        pairs: Sequence[PairSpec],
        geometry: Geometry,
        cache_scale: bool = False,
    ):
        params = _parameter_views(theta, layout)
        first = params[layout.names[0]]
        self.dtype, self.device, self.numel = first.dtype, first.device, layout.numel
        self.layout = layout
        self.geometry = geometry
        use_pairs = geometry.metric is not None
        self.blocks = stack_pairs(pairs, layout, self.device) if use_pairs else []
        self._metric_blocks = self.blocks if geometry.metric_ball else []
        self._set_states(params)

        # Element-wise scale c: |theta| (relative) or 1; entries below sqrt(tiny) are
        # frozen (1/c would overflow and c^2 underflow), and so, for the element-wise
        # metric, are pair entries of pair-ball geometries (their metric is the pair's).
        self._unit = not geometry.relative
        self._tiny = torch.finfo(self.dtype).tiny ** 0.5
        in_pairs = _pair_masks(self._metric_blocks, params)
        self._parts = []
        for name, start in zip(layout.names, layout.offsets):
            part = _Part(start, params[name], in_pairs.get(name, False))
            if isinstance(part.pairs, Tensor):
                part.pairs = True if bool(part.pairs.all()) else part.pairs
            if not self._unit and part.pairs is not True:
                part.frozen = bool(self._frozen_mask(part.theta, part.pairs).any())
            self._parts.append(part)
        self._trivial = self._unit and not in_pairs  # c = 1 everywhere
        # Element-wise work on CPU goes in cache-sized pieces; a GPU takes large ones.
        self._chunk = (1 << 18) if self.device.type == "cpu" else (1 << 26)
        self._cached_scale = None
        if cache_scale and not self._trivial:
            self._cached_scale = self.scale  # one vector more, one pass less per use

    def _set_states(self, params: dict[str, Tensor]) -> None:
        for block in self.blocks:
            state = self.geometry.metric.state(*block.gather_params(params))
            block.state = restrict_state(state, block.group)

    def refresh(self) -> PerturbationSpace:
        """Recompute what depends on the values of ``theta`` (the pair states, the frozen
        entries, a cached scale) after the tensors it views were updated in place, e.g.
        by an optimizer step: cheaper than a new space, whose pair stacking and layout
        stay the same. Returns the space."""
        params = self._params()
        self._set_states(params)
        for part in self._parts:
            if not self._unit and part.pairs is not True:
                part.frozen = bool(self._frozen_mask(part.theta, part.pairs).any())
        if self._cached_scale is not None:
            self._cached_scale = None
            self._cached_scale = self.scale
        return self

    # -- the base point, piece by piece --------------------------------------------------

    def empty(self) -> Tensor:
        """A new uninitialised flat tangent."""
        return torch.empty(self.numel, dtype=self.dtype, device=self.device)

    def theta_flat(self) -> Tensor:
        """``theta`` as a new flat vector (for references and tests; the loop never
        needs it)."""
        return torch.cat([part.theta for part in self._parts])

    @property
    def straight(self) -> bool:
        """Whether the step is the straight line ``theta + xi`` (no geodesic correction,
        no exponential): then a point is its own tangent plus ``theta``, and Auto-PGD
        with ``low_memory=True`` keeps points instead of tangents (one vector less)."""
        return not (self.geometry.geodesic_step or self.geometry.exp_elementwise)

    def to_point_(self, xi: Tensor) -> Tensor:
        """``xi <- theta + xi`` in place."""
        for part in self._parts:
            xi[part.start : part.end].add_(part.theta)
        return xi

    def to_tangent_(self, point: Tensor) -> Tensor:
        """``point <- point - theta`` in place."""
        for part in self._parts:
            point[part.start : part.end].sub_(part.theta)
        return point

    def tangent_dot(self, point: Tensor, y: Tensor) -> Tensor:
        """Euclidean ``<point - theta, y>`` (0-d, float64), the difference formed piece
        by piece (exact where ``point`` is near ``theta``; no cancellation of large dot
        products)."""
        total = torch.zeros((), dtype=torch.float64, device=y.device)
        for s, e, theta, *_ in self._pieces():
            total += torch.dot(point[s:e] - theta, y[s:e]).double()
        return total

    def _pieces(self):
        """``(start, end, theta piece, pair mask piece, frozen)`` covering the layout."""
        step = self._chunk
        for part in self._parts:
            n = part.theta.numel()
            for a in range(0, n, step):
                b = min(n, a + step)
                pairs = part.pairs[a:b] if isinstance(part.pairs, Tensor) else part.pairs
                yield part.start + a, part.start + b, part.theta[a:b], pairs, part.frozen

    def _scale_piece(
        self, theta: Tensor, pairs: bool | Tensor, frozen: bool = True
    ) -> Tensor | None:
        """``c`` on a piece (``None``: zero on all of it); ``frozen=False`` says that no
        entry of the piece's parameter is below the threshold."""
        if pairs is True:
            return None
        if self._unit:
            c = torch.ones_like(theta)
        else:
            c = theta.abs()
            if frozen:
                c.masked_fill_(c <= self._tiny, 0)
        if isinstance(pairs, Tensor):
            c.masked_fill_(pairs, 0)
        return c

    def _frozen_mask(self, theta: Tensor, pairs: bool | Tensor) -> Tensor:
        frozen = theta.abs() <= self._tiny
        return frozen & ~pairs if isinstance(pairs, Tensor) else frozen

    def scale_(self, x: Tensor, power: int = 1) -> Tensor:
        """``x <- c^power x`` in place (zero where ``c = 0``)."""
        if self._trivial:
            return x
        if self._cached_scale is not None:
            x.mul_(self._cached_scale)
            return x.mul_(self._cached_scale) if power == 2 else x
        return self._scale_pieces_(x, power)

    def _scale_pieces_(self, x: Tensor, power: int = 1) -> Tensor:
        """:meth:`scale_` computing ``c`` piece by piece."""
        for s, e, theta, pairs, frozen in self._pieces():
            c = self._scale_piece(theta, pairs, frozen)
            if c is None:
                x[s:e].zero_()
            else:
                x[s:e].mul_(c)
                if power == 2:
                    x[s:e].mul_(c)
        return x

    @property
    def scale(self) -> Tensor:
        """The element-wise scale ``c`` as a new flat vector (for inspection)."""
        ones = torch.ones(self.numel, dtype=self.dtype, device=self.device)
        return ones if self._trivial else self._scale_pieces_(ones)

    @property
    def inv_scale(self) -> Tensor:
        """``1 / c`` on element-wise entries that may move, else 0 (a new vector)."""
        scale = self.scale
        return torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale))

    @property
    def active(self) -> Tensor | None:
        """Boolean flat mask of the entries a perturbation may use (a new vector), or
        ``None`` when all may."""
        if not any(part.frozen for part in self._parts):
            return None
        out = torch.ones(self.numel, dtype=torch.bool, device=self.device)
        for part in self._parts:
            if part.frozen:
                out[part.start : part.end] = ~self._frozen_mask(part.theta, part.pairs)
        return out

    def dot(self, x: Tensor, y: Tensor) -> Tensor:
        """Euclidean ``<x, y>`` (0-d, float64), accumulated chunk by chunk in float64: a
        single float32 dot product of 10^8 entries can be off by 1e-3."""
        return _dot(x, y, self._chunk)

    # -- metric ---------------------------------------------------------------------------

    def inner(self, xi: Tensor, eta: Tensor) -> Tensor:
        """``g(xi, eta)`` (0-d tensor, float64)."""
        total = self._elementwise_inner(xi, eta)
        for block in self._metric_blocks:
            total = total + block.state.inner(block.gather(xi), block.gather(eta)).sum()
        return total

    def _elementwise_inner(self, x: Tensor, y: Tensor) -> Tensor:
        if self._trivial:
            return self.dot(x, y)
        total = torch.zeros((), dtype=torch.float64, device=x.device)
        for s, e, theta, pairs, frozen in self._pieces():
            c = self._scale_piece(theta, pairs, frozen)
            if c is None:
                continue
            inv = torch.where(c > 0, c.reciprocal(), torch.zeros_like(c))
            a = x[s:e] * inv
            b = a if y is x else y[s:e] * inv
            total += torch.dot(a, b).double()
        return total

    def norm(self, xi: Tensor) -> Tensor:
        if self.geometry.p == float("inf"):
            return self.linf_norm(xi)
        return self.inner(xi, xi).clamp_min(0).sqrt()

    def linf_norm(self, xi: Tensor) -> Tensor:
        best = torch.zeros((), dtype=torch.float64, device=xi.device)
        for s, e, theta, pairs, frozen in self._pieces():
            c = self._scale_piece(theta, pairs, frozen)
            if c is None:
                continue
            part = (xi[s:e] / torch.where(c > 0, c, torch.ones_like(c))).abs_()
            part.masked_fill_(c == 0, 0)
            best = torch.maximum(best, part.max().double())
        return best

    def clamp_box_(self, xi: Tensor, rho: float) -> Tensor:
        """Clamp ``xi`` in place into the element-wise box ``|xi_j| <= rho c_j``."""
        for s, e, theta, pairs, frozen in self._pieces():
            c = self._scale_piece(theta, pairs, frozen)
            if c is None:
                xi[s:e].zero_()
            else:
                upper = rho * c
                xi[s:e].clamp_(-upper, upper)
        return xi

    # -- projections ----------------------------------------------------------------------

    def proju(self, xi: Tensor) -> Tensor:
        """Zero the frozen entries and project every pair onto its horizontal space."""
        return self.proju_(xi.clone())

    def proju_(self, xi: Tensor) -> Tensor:
        """:meth:`proju` in place (returns ``xi``)."""
        for part in self._parts:
            if part.frozen:
                xi[part.start : part.end].masked_fill_(self._frozen_mask(part.theta, part.pairs), 0)
        for block in self._metric_blocks:
            block.scatter_(xi, block.state.proju(block.gather(xi)))
        return xi

    def egrad2rgrad(self, egrad: Tensor) -> Tensor:
        """Riemannian gradient: ``c^2 * g`` element-wise, section 4 on pairs."""
        return self.egrad2rgrad_(egrad.clone())

    def egrad2rgrad_(self, egrad: Tensor) -> Tensor:
        """:meth:`egrad2rgrad` in place (returns ``egrad``)."""
        pair_grads = [b.state.egrad2rgrad(b.gather(egrad)) for b in self._metric_blocks]
        self.scale_(egrad, 2)
        for block, grad in zip(self._metric_blocks, pair_grads):
            block.scatter_(egrad, grad)
        return egrad

    def horizontal_residual(self, xi: Tensor) -> Tensor:
        """Largest ``|R|`` over pairs, relative to the size of ``xi``: 0 iff horizontal."""
        worst = torch.zeros((), dtype=torch.float64, device=xi.device)
        for block in self._metric_blocks:
            R = block.state.horizontal_residual(block.gather(xi))
            worst = torch.maximum(worst, R.abs().amax())
        return worst / self.norm(xi).clamp_min(1e-300)

    # -- Auto-PGD's inner loop, in place ---------------------------------------------------

    def split_direction_(
        self, egrad: Tensor, step: Retraction | None = None
    ) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        r"""Start the ascent direction ``d = proju(egrad2rgrad(egrad))`` in place.

        Element-wise entries of ``egrad`` become ``c * egrad`` (``d = c^2 egrad`` there:
        :meth:`combine_` applies the second ``c``); the pair blocks of ``d`` are returned.
        Also returns ``||d||^2`` (float64, 0-d), as ``<d, egrad>`` (Euclidean): the
        Riemannian gradient represents ``egrad`` in the metric and ``d`` is horizontal.
        ``step``: the :class:`Retraction` whose :meth:`pullback_` gave ``egrad``.
        """
        sq = torch.zeros((), dtype=torch.float64, device=egrad.device)
        pair_dirs = []
        known = step.grad_pairs if step is not None else None
        for i, block in enumerate(self._metric_blocks):
            g = known[i] if known is not None else block.gather(egrad)
            d = block.state.direction(g)
            for dx, gx in zip(d, g):
                sq = sq + _block_dot(dx, gx)
            pair_dirs.append(d)
        self.scale_(egrad)  # zero on pair entries of pair balls and on frozen entries
        return sq + self.dot(egrad, egrad), pair_dirs

    def combine_(
        self,
        out: Tensor,
        pair_dirs: list[tuple[Tensor, Tensor]],
        kd: Tensor,
        x: Tensor,
        kx: Tensor,
        xp: Tensor | None = None,
        kxp: Tensor | None = None,
        points: bool = False,
    ) -> Tensor:
        """``out <- kd d + kx x + kxp xp`` where ``out`` and ``pair_dirs`` come from
        :meth:`split_direction_` (scalars: 0-d tensors, so nothing waits for the device).

        ``points=True``: ``x`` and ``xp`` are points ``theta + xi`` (see :attr:`straight`)
        and ``out`` becomes one, ``theta + kd d + kx xi + kxp xi_p``, the tangents formed
        piece by piece."""
        self.scale_(out)
        for block, d in zip(self._metric_blocks, pair_dirs):
            block.scatter_(out, d)  # pair entries of `out` are zero here
        if not points:
            out.mul_(kd).addcmul_(x, kx)
            if xp is not None:
                out.addcmul_(xp, kxp)
            return out
        for s, e, theta, *_ in self._pieces():
            piece = out[s:e].mul_(kd)
            piece.addcmul_(x[s:e] - theta, kx)
            if xp is not None:
                piece.addcmul_(xp[s:e] - theta, kxp)
            piece.add_(theta)
        return out

    def retr_(self, xi: Tensor, out: Tensor) -> Retraction:
        """Write :meth:`retr` into ``out`` (not differentiable); returns what
        :meth:`pullback_` needs."""
        saved = []
        with torch.no_grad():
            if self.geometry.exp_elementwise:
                self._exp_step_(xi, out)
            else:
                for part in self._parts:
                    sl = slice(part.start, part.end)
                    torch.add(part.theta, xi[sl], out=out[sl])
            if self.geometry.geodesic_step:
                for block in self.blocks:
                    x = block.gather(xi)
                    if self.geometry.exp_elementwise:
                        block.add_(out, block.state.geodesic_acceleration(x), alpha=0.5)
                        saved.append(None)
                        continue
                    accel, kept = block.state.accelerate(x)
                    block.add_(out, accel, alpha=0.5)
                    saved.append(kept)
        return Retraction(xi, saved)

    def _exp_step_(self, xi: Tensor, out: Tensor) -> None:
        """``out <- theta exp(xi / theta)`` where ``theta != 0`` (``theta + xi`` elsewhere
        and on pair entries, which keep the straight step)."""
        for s, e, theta, *_ in self._pieces():
            out[s:e] = _exp_step(theta, xi[s:e])
        params = self._params()
        for block in self.blocks:
            g_th, h_th = block.gather_params(params)
            g_xi, h_xi = block.gather(xi)
            block.scatter_(out, (g_th + g_xi, h_th + h_xi))

    def _params(self) -> dict[str, Tensor]:
        return {n: part.theta for n, part in zip(self.layout.names, self._parts)}

    def pullback_(self, step: Retraction, grad: Tensor) -> Tensor:
        """Turn ``grad``, the gradient at the point of ``step``, into the gradient with
        respect to its ``xi``, in place: the step is the identity but for the geodesic
        correction of pairs and, with ``elementwise_step="exp"``, the factor
        ``exp(xi / theta)`` of element-wise entries."""
        with torch.no_grad():
            if self.geometry.exp_elementwise:
                self._exp_pullback_(step.xi, grad)
            if not self.geometry.geodesic_step:
                return grad
            blocks_out = []
            for block, saved in zip(self.blocks, step.saved):
                g = block.state.pullback(block.gather(step.xi), block.gather(grad), saved)
                block.scatter_(grad, g)
                blocks_out.append(g)
        if self.geometry.metric_ball:
            step.grad_pairs = blocks_out
        return grad

    def _exp_pullback_(self, xi: Tensor, grad: Tensor) -> None:
        """``grad *= exp(xi / theta)`` where ``theta != 0``, pair entries excepted (they
        keep the straight step)."""
        kept = [block.gather(grad) for block in self.blocks]
        for s, e, theta, *_ in self._pieces():
            nonzero = theta != 0
            ratio = xi[s:e] / torch.where(nonzero, theta, torch.ones_like(theta))
            grad[s:e].mul_(torch.where(nonzero, ratio.exp_(), torch.ones_like(theta)))
        for block, g in zip(self.blocks, kept):
            block.scatter_(grad, g)

    # -- sampling and stepping ------------------------------------------------------------

    def random(self, generator: torch.Generator | None = None) -> Tensor:
        """A Gaussian tangent in the metric, projected (not normalised).

        Pair blocks are drawn equivariantly (:meth:`PairState.sample`): with the same
        generator state, symmetry-related networks get symmetry-related samples.
        """
        z = torch.randn(self.numel, generator=generator, dtype=self.dtype, device=self.device)
        out = self.scale_(z)
        for block in self._metric_blocks:
            block.scatter_(out, block.state.sample(generator))
        return self.proju_(out)

    def acceleration(self, xi: Tensor) -> Tensor:
        r"""The second-order term of the step, a new flat vector ``a`` with

        .. math:: \gamma_{t\xi}(1) = \theta + t\xi + \tfrac{t^2}{2} a(\xi) + O(t^3):

        on pairs of a geodesic step the geodesic acceleration of the pair metric
        (:meth:`PairState.geodesic_acceleration`), element-wise with
        ``elementwise_step="exp"`` ``xi^2 / theta`` (the GL(1) geodesic), 0 elsewhere.
        Then ``d^2/dt^2 f(gamma_{t xi}(1)) = xi^T Hess f xi + <grad f, a(xi)>`` at
        ``t = 0``: the Riemannian Hessian's quadratic form (the Christoffel term is
        ``<grad f, a>``).
        """
        out = torch.zeros_like(xi)
        if self.geometry.exp_elementwise:
            for s, e, theta, *_ in self._pieces():
                nonzero = theta != 0
                out[s:e] = torch.where(
                    nonzero, xi[s:e].square() / torch.where(nonzero, theta, 1), 0
                )
            for block in self.blocks:  # pair entries keep the straight line
                g, h = block.gather(out)
                block.scatter_(out, (torch.zeros_like(g), torch.zeros_like(h)))
        if self.geometry.geodesic_step:
            for block in self.blocks:
                block.add_(out, block.state.geodesic_acceleration(block.gather(xi)))
        return out

    def retr(self, xi: Tensor) -> Tensor:
        """The perturbed point ``gamma_xi(1)`` as a flat vector (differentiable in ``xi``)."""
        geometry = self.geometry
        theta = self.theta_flat()
        if geometry.exp_elementwise:
            out = _exp_step(theta, xi)
            for block in self.blocks:  # pair entries keep the straight line
                g_th, h_th = block.gather(theta)
                g_xi, h_xi = block.gather(xi)
                out = block.scatter(out, (g_th + g_xi, h_th + h_xi))
        else:
            out = theta + xi
        if geometry.geodesic_step:
            for block in self.blocks:
                aG, aH = block.state.geodesic_acceleration(block.gather(xi))
                out = out.index_add_(0, block.g_index.reshape(-1), aG.reshape(-1), alpha=0.5)
                out = out.index_add_(0, block.h_index.reshape(-1), aH.reshape(-1), alpha=0.5)
        return out


def _exp_step(theta: Tensor, xi: Tensor) -> Tensor:
    """``theta exp(xi / theta)`` where ``theta != 0``, ``theta + xi`` elsewhere."""
    nonzero = theta != 0
    ratio = torch.where(nonzero, xi / torch.where(nonzero, theta, 1), 0)
    return torch.where(nonzero, theta * torch.exp(ratio), theta + xi)


def _parameter_views(theta: Tensor | Mapping[str, Tensor], layout: ParameterLayout) -> dict:
    """``{name: 1-D view}`` of the perturbed parameters (a copy only of a tensor that is
    not contiguous)."""
    if isinstance(theta, Tensor):
        if theta.dim() != 1 or theta.numel() != layout.numel:
            raise ValueError("theta must be the flat vector of the layout's parameters")
        return {n: t.detach().reshape(-1) for n, t in layout.unflatten(theta).items()}
    missing = [n for n in layout.names if n not in theta]
    if missing:
        raise ValueError(f"theta lacks the layout's parameters {missing}")
    out = {}
    for name, shape in zip(layout.names, layout.shapes):
        t = theta[name]
        if t.shape != shape:
            raise ValueError(f"theta[{name!r}] has shape {tuple(t.shape)}, not {tuple(shape)}")
        out[name] = t.detach().reshape(-1)
    if len({(t.dtype, t.device) for t in out.values()}) > 1:
        raise ValueError("theta's tensors must share one dtype and one device")
    return out


def _pair_masks(blocks: Sequence[StackedPairs], params: dict[str, Tensor]) -> dict:
    """``{name: boolean mask}`` of the entries of each parameter that belong to ``blocks``."""
    masks: dict[str, Tensor] = {}
    for block in blocks:
        for spec in block.specs:
            for b in (*spec.g_blocks, *spec.h_blocks):
                theta = params[b.param]
                if b.param not in masks:
                    masks[b.param] = torch.zeros(
                        theta.numel(), dtype=torch.bool, device=theta.device
                    )
                masks[b.param][b.index.reshape(-1).to(theta.device)] = True
    return masks


def _dot(x: Tensor, y: Tensor, chunk: int) -> Tensor:
    n = x.numel()
    if n <= chunk:
        return torch.dot(x, y).double()
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for s in range(0, n, chunk):
        total += torch.dot(x[s : s + chunk], y[s : s + chunk]).double()
    return total


def _block_dot(a: Tensor, b: Tensor) -> Tensor:
    """Euclidean ``<a, b>`` of two blocks (0-d, float64)."""
    return _dot(a.reshape(-1), b.reshape(-1), 1 << 22)
