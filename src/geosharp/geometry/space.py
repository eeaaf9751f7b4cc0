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
from collections.abc import Sequence
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
    layers.

    ``g_index`` (``(B, n, h)``) and ``h_index`` (``(B, m, h)``) hold positions in the flat
    parameter vector; ``state`` is the pair geometry at the base point; ``group`` the
    symmetry group of the pairs (``"GL"`` or a subgroup, see
    :mod:`geosharp.geometry.subgroup`).

    Reads and writes of contiguous flat vectors go through strided views when the
    indices allow it (:func:`strided_segments`: a head of a linear layer is one strided
    block of its weight plus a row of its bias), which is several times faster than
    indexing; other layouts, and non-contiguous vectors, use the indices.
    """

    specs: list[PairSpec]
    g_index: Tensor
    h_index: Tensor
    state: PairState | None = None
    group: str = "GL"

    def __post_init__(self) -> None:
        self._segments = (strided_segments(self.g_index), strided_segments(self.h_index))

    def gather(self, flat: Tensor) -> tuple[Tensor, Tensor]:
        """The ``(G, H)`` entries of ``flat`` as new ``(B, n, h)`` and ``(B, m, h)`` blocks."""
        if self._strided(flat):
            return tuple(  # type: ignore[return-value]
                gather_strided(flat, segs, index.shape)
                for segs, index in zip(self._segments, (self.g_index, self.h_index))
            )
        return flat[self.g_index], flat[self.h_index]

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
        flat.index_copy_(0, self.g_index.reshape(-1), blocks[0].reshape(-1).to(flat.dtype))
        return flat.index_copy_(0, self.h_index.reshape(-1), blocks[1].reshape(-1).to(flat.dtype))

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


def stack_pairs(
    pairs: Sequence[PairSpec], layout: ParameterLayout, device: torch.device
) -> list[StackedPairs]:
    """Group pairs by shape and symmetry group and translate their indices into flat
    positions."""
    groups: dict[tuple[int, int, int, str], list[PairSpec]] = defaultdict(list)
    for pair in pairs:
        _, n, m, h = pair.shape
        groups[(n, m, h, pair.group)].append(pair)

    def flat_index(blocks) -> Tensor:
        return torch.cat([layout.offset(b.param) + b.index for b in blocks], dim=1)

    out = []
    for (*_, group), specs in groups.items():
        g = torch.cat([flat_index(s.g_blocks) for s in specs]).to(device)
        h = torch.cat([flat_index(s.h_blocks) for s in specs]).to(device)
        out.append(StackedPairs(specs, g, h, group=group))
    return out


@dataclass
class Retraction:
    """What :meth:`PerturbationSpace.retr_` computed that the pullback reuses: the
    tangent ``xi``, and per pair block its ``xi`` blocks and the state's saved matrices.
    :meth:`PerturbationSpace.pullback_` adds the pulled-back gradient's pair blocks,
    which :meth:`PerturbationSpace.split_direction_` then need not gather again."""

    xi: Tensor
    pairs: list[tuple[tuple[Tensor, Tensor], object]]
    grad_pairs: list[tuple[Tensor, Tensor]] | None = None


class PerturbationSpace:
    """Tangent space at the flat point ``theta`` for a :class:`Geometry`.

    Operations mirror geoopt's manifold interface: :meth:`inner`, :meth:`proju`
    (horizontal projection), :meth:`egrad2rgrad`, :meth:`retr` (the perturbed point
    ``gamma_xi(1)``), plus :meth:`random` (a Gaussian in the metric).

    Besides ``theta`` the space keeps one parameter-sized vector, the element-wise scale
    ``scale`` (``c_j``, zero on frozen entries and on pair entries of pair-ball
    geometries), and a boolean mask ``active`` of the entries a perturbation may use
    (``None`` when all may). The in-place methods :meth:`retr_`, :meth:`pullback_`,
    :meth:`split_direction_` and :meth:`combine_` serve Auto-PGD's inner loop without
    parameter-sized temporaries; what one passes to the next is explicit
    (:class:`Retraction`). The pair maths is the pair states' own
    (:class:`~geosharp.geometry.pairs.PairState`); this class only reads and writes
    their blocks.
    """

    def __init__(
        self,
        theta: Tensor,
        layout: ParameterLayout,
        pairs: Sequence[PairSpec],
        geometry: Geometry,
    ):
        if theta.dim() != 1 or theta.numel() != layout.numel:
            raise ValueError("theta must be the flat vector of the layout's parameters")
        self.theta = theta.detach()
        self.layout = layout
        self.geometry = geometry
        use_pairs = geometry.metric is not None
        self.blocks = stack_pairs(pairs, layout, theta.device) if use_pairs else []
        for block in self.blocks:
            state = geometry.metric.state(*block.gather(self.theta))
            block.state = restrict_state(state, block.group)
        self._metric_blocks = self.blocks if geometry.metric_ball else []
        pair_entries = [
            index.reshape(-1)
            for block in self._metric_blocks
            for index in (block.g_index, block.h_index)
        ]

        # Element-wise scale c: |theta| (relative) or 1; entries below sqrt(tiny) are
        # frozen (1/c would overflow and c^2 underflow), and so, for the element-wise
        # metric, are pair entries of pair-ball geometries (their metric is the pair's).
        self._unit = not geometry.relative  # c = 1 everywhere, every entry active
        if self._unit:
            self.scale = torch.ones_like(self.theta)
        else:
            self.scale = self.theta.abs()
            self.scale.masked_fill_(self.scale <= torch.finfo(self.scale.dtype).tiny ** 0.5, 0)
        for index in pair_entries:
            self.scale.index_fill_(0, index, 0)
        # Entries a perturbation may use: movable element-wise ones, and pair entries.
        active = self.scale > 0
        for index in pair_entries:
            active.index_fill_(0, index, True)
        self.active: Tensor | None = None if bool(active.all()) else active
        # Element-wise work on CPU goes chunk by chunk (cache-sized temporaries); a GPU
        # takes the vector in a few large pieces.
        self._chunk = (1 << 18) if theta.device.type == "cpu" else (1 << 26)

    @property
    def inv_scale(self) -> Tensor:
        """``1 / c`` on element-wise entries that may move, else 0 (computed on demand)."""
        scale = self.scale
        return torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale))

    def _chunks(self):
        n, step = self.theta.numel(), self._chunk
        return ((s, min(n, s + step)) for s in range(0, n, step))

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
        if self._unit:
            return self.dot(x, y)
        total = torch.zeros((), dtype=torch.float64, device=x.device)
        for s, e in self._chunks():
            c = self.scale[s:e]
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
        for s, e in self._chunks():
            c = self.scale[s:e]
            part = (xi[s:e] / torch.where(c > 0, c, torch.ones_like(c))).abs_()
            part.masked_fill_(c == 0, 0)
            best = torch.maximum(best, part.max().double())
        return best

    # -- projections ----------------------------------------------------------------------

    def proju(self, xi: Tensor) -> Tensor:
        """Zero the frozen entries and project every pair onto its horizontal space."""
        return self.proju_(xi.clone())

    def proju_(self, xi: Tensor) -> Tensor:
        """:meth:`proju` in place (returns ``xi``)."""
        if self.active is not None:
            xi.mul_(self.active)
        for block in self._metric_blocks:
            block.scatter_(xi, block.state.proju(block.gather(xi)))
        return xi

    def egrad2rgrad(self, egrad: Tensor) -> Tensor:
        """Riemannian gradient: ``c^2 * g`` element-wise, section 4 on pairs."""
        return self.egrad2rgrad_(egrad.clone())

    def egrad2rgrad_(self, egrad: Tensor) -> Tensor:
        """:meth:`egrad2rgrad` in place (returns ``egrad``)."""
        pair_grads = [b.state.egrad2rgrad(b.gather(egrad)) for b in self._metric_blocks]
        if not self._unit:
            egrad.mul_(self.scale).mul_(self.scale)
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
        if not self._unit:
            egrad.mul_(self.scale)  # zero on pair entries of pair balls and frozen entries
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
    ) -> Tensor:
        """``out <- kd d + kx x + kxp xp`` where ``out`` and ``pair_dirs`` come from
        :meth:`split_direction_` (scalars: 0-d tensors, so nothing waits for the device)."""
        if not self._unit:
            out.mul_(self.scale)
        for block, d in zip(self._metric_blocks, pair_dirs):
            block.scatter_(out, d)  # pair entries of `out` are zero here
        out.mul_(kd).addcmul_(x, kx)
        if xp is not None:
            out.addcmul_(xp, kxp)
        return out

    def retr_(self, xi: Tensor, out: Tensor) -> Retraction:
        """Write :meth:`retr` into ``out`` (not differentiable); returns what
        :meth:`pullback_` needs."""
        pairs = []
        with torch.no_grad():
            if self.geometry.exp_elementwise:
                out.copy_(self.retr(xi))
                if self.geometry.geodesic_step:
                    pairs = [(block.gather(xi), None) for block in self.blocks]
                return Retraction(xi, pairs)
            torch.add(self.theta, xi, out=out)
            if self.geometry.geodesic_step:
                for block in self.blocks:
                    x = block.gather(xi)
                    accel, saved = block.state.accelerate(x)
                    block.add_(out, accel, alpha=0.5)
                    pairs.append((x, saved))
        return Retraction(xi, pairs)

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
            for block, (x, saved) in zip(self.blocks, step.pairs):
                g = block.state.pullback(x, block.gather(grad), saved)
                block.scatter_(grad, g)
                blocks_out.append(g)
        if self.geometry.metric_ball:
            step.grad_pairs = blocks_out
        return grad

    def _exp_pullback_(self, xi: Tensor, grad: Tensor) -> None:
        """``grad *= exp(xi / theta)`` where ``theta != 0``, pair entries excepted (they
        keep the straight step)."""
        kept = [block.gather(grad) for block in self.blocks]
        for s, e in self._chunks():
            theta = self.theta[s:e]
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
        z = torch.randn(
            self.theta.shape,
            generator=generator,
            dtype=self.theta.dtype,
            device=self.theta.device,
        )
        out = z if self._unit else z.mul_(self.scale)
        for block in self._metric_blocks:
            block.scatter_(out, block.state.sample(generator))
        return self.proju_(out)

    def retr(self, xi: Tensor) -> Tensor:
        """The perturbed point ``gamma_xi(1)`` as a flat vector (differentiable in ``xi``)."""
        geometry = self.geometry
        if geometry.exp_elementwise:
            theta = self.theta
            ratio = torch.where(theta != 0, xi / torch.where(theta != 0, theta, 1), 0)
            moved = torch.where(theta != 0, theta * torch.exp(ratio), theta + xi)
            # Pair entries keep the straight line (plus the geodesic correction below).
            out = self._straight_on_pairs(moved, xi)
        else:
            out = self.theta + xi
        if geometry.geodesic_step:
            for block in self.blocks:
                aG, aH = block.state.geodesic_acceleration(block.gather(xi))
                out = out.index_add_(0, block.g_index.reshape(-1), aG.reshape(-1), alpha=0.5)
                out = out.index_add_(0, block.h_index.reshape(-1), aH.reshape(-1), alpha=0.5)
        return out

    def _straight_on_pairs(self, moved: Tensor, xi: Tensor) -> Tensor:
        out = moved
        for block in self.blocks:
            g_th, h_th = block.gather(self.theta)
            g_xi, h_xi = block.gather(xi)
            out = block.scatter(out, (g_th + g_xi, h_th + h_xi))
        return out


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
