r"""The tangent space of a whole network at ``theta``, for one geometry.

A geometry is a product of two factors (:class:`Geometry`): the element-wise factor
(:class:`~geosharp.geometry.elementwise.Elementwise`) on every entry,

.. math:: \|\xi\|^2 = \sum_j (\xi_j / c_j)^2, \qquad c_j = |\theta_j|
          \text{ (adaptive) or } 1 \text{ (Euclidean)},

and, optionally, the pair factor (:class:`~geosharp.geometry.stacked.Pairs`) on the
attention pairs, read as stacked ``(xiG, xiH)`` blocks: a pair metric that measures
the pairs' entries (its ball: they leave the element-wise sum) and/or a second-order
geodesic step. The named geometries are recipes of that product (MATH.md section 6
and its ablations):

=============================  =================  ================  ===============
name                           ball               horizontal        step
=============================  =================  ================  ===============
``euclidean``                  ``||xi||_2``       --                straight
``adaptive``                   ``||xi / |θ| ||``  --                straight
``geodesic``                   pair metric        projected         2nd-order geodesic
``geodesic-norm-only``         pair metric        projected         straight
``geodesic-curvature-only``    ``||xi / |θ| ||``  --                2nd-order geodesic
=============================  =================  ================  ===============

:class:`PerturbationSpace` is the product's implementation: an
:class:`~geosharp.geometry.elementwise.ElementwiseSpace` and a
:class:`~geosharp.geometry.stacked.PairSpace`, both over the model's own tensors; it
sums their inner products and lets the element-wise factor write every entry before
the pair factor writes its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..layout import ParameterLayout
from ..symmetry.pairs import PairSpec
from .draws import draw_seed, normal_runs_
from .elementwise import Elementwise, ElementwiseSpace, dot, exp_step
from .pairs import PairMetric, get_metric
from .sharded import Shards, localize
from .stacked import Pairs, PairSpace, StackedPairs, stack_pairs

__all__ = [
    "GEOMETRIES",
    "Elementwise",
    "Geometry",
    "Pairs",
    "PerturbationSpace",
    "Retraction",
    "StackedPairs",
    "stack_pairs",
]

# name -> (relative element-wise scale, the pair factor's (ball, geodesic) or None)
RECIPES: dict[str, tuple[bool, tuple[bool, bool] | None]] = {
    "euclidean": (False, None),
    "adaptive": (True, None),
    "geodesic": (True, (True, True)),
    "geodesic-norm-only": (True, (True, False)),
    "geodesic-curvature-only": (True, (False, True)),
}
GEOMETRIES = tuple(RECIPES)


@dataclass(frozen=True)
class Geometry:
    """What defines a perturbation: the product of an element-wise factor and,
    optionally, a pair factor.

    Build the named ones with :meth:`named`, or compose your own, e.g.
    ``Geometry("mine", Elementwise(relative=True), Pairs(MyMetric(), ball=True,
    geodesic=True))``. The element-wise ball may be ``p = inf`` (the box of adaptive
    sharpness in Andriushchenko et al. 2023) only without a pair factor.
    """

    name: str
    elementwise: Elementwise = field(default_factory=Elementwise)
    pairs: Pairs | None = None

    def __post_init__(self) -> None:
        if self.elementwise.p != 2 and self.pairs is not None:
            raise ValueError(
                f"the L-infinity ball is defined for the element-wise geometry only, not "
                f"for {self.name!r}"
            )

    @classmethod
    def named(
        cls,
        name: str,
        metric: str | PairMetric = "inv",
        eps: float = 0.0,
        p: float = 2.0,
        elementwise_step: str = "straight",
    ) -> Geometry:
        """The recipe ``name`` of :data:`GEOMETRIES`; the pair metric (``"inv"``,
        ``"mix"`` or a :class:`~geosharp.geometry.PairMetric`) names the result
        (``"geodesic-inv"``, ...)."""
        if name not in RECIPES:
            raise ValueError(f"unknown geometry {name!r}: choose one of {', '.join(GEOMETRIES)}")
        if p not in (2, 2.0, float("inf")):
            raise ValueError(f"p must be 2 or float('inf'), got {p!r}")
        if p != 2 and name != "adaptive":
            raise ValueError(
                f"the L-infinity ball is defined for 'adaptive' only, not for {name!r}"
            )
        relative, pair = RECIPES[name]
        elementwise = Elementwise(relative, float(p), elementwise_step)
        if pair is None:
            return cls(name, elementwise)
        pair_metric = get_metric(metric, eps)
        return cls(f"{name}-{pair_metric.name}", elementwise, Pairs(pair_metric, *pair))

    # shorthands for the factors' settings
    @property
    def metric(self) -> PairMetric | None:
        """The pair metric (``None``: no pair factor)."""
        return self.pairs.metric if self.pairs is not None else None

    @property
    def metric_ball(self) -> bool:
        """Whether the pairs' entries are measured with the pair metric."""
        return self.pairs is not None and self.pairs.ball

    @property
    def geodesic_step(self) -> bool:
        """Whether the step follows the pair metric's geodesic to second order."""
        return self.pairs is not None and self.pairs.geodesic

    @property
    def relative(self) -> bool:
        return self.elementwise.relative

    @property
    def p(self) -> float:
        return self.elementwise.p

    @property
    def exp_elementwise(self) -> bool:
        """Whether element-wise entries take the exact GL(1) geodesic."""
        return self.elementwise.step == "exp"

    @property
    def straight(self) -> bool:
        """Whether the step is the straight line ``theta + xi`` (no geodesic correction,
        no exponential)."""
        return not (self.geodesic_step or self.exp_elementwise)

    @property
    def holds_point(self) -> bool:
        """Whether every entry steps on the straight line ``theta + xi`` (no pair
        factor, no exponential): Auto-PGD may then keep an iterate in its point's buffer
        beside a narrower gradient (:attr:`PerturbationSpace.holds_point`)."""
        return self.pairs is None and not self.exp_elementwise


@dataclass
class Retraction:
    """What :meth:`PerturbationSpace.retr_` computed that the pullback reuses: the
    tangent ``xi`` and, per pair block, the state's saved ``h x h`` matrices (the ``xi``
    blocks are read again rather than kept through the forward and backward)."""

    xi: Tensor
    saved: list[object]


class PerturbationSpace:
    """Tangent space at ``theta`` for a :class:`Geometry`: the product of its factors.

    ``theta``: the perturbed parameters, either as ``{name: tensor}`` (the model's own
    tensors: they are read, never copied or written) or as one flat vector of the
    layout. Tangents are flat vectors of the layout (``layout.unflatten`` shows them per
    parameter, as views), in ``dtype`` (default: ``theta``'s); a wider ``dtype`` than
    ``theta``'s (float32 tangents of a bfloat16 model) reads ``theta`` piece by piece in
    it, exactly, and keeps no wider copy.

    The interface is geoopt's manifold's, for a product of two factors:
    :meth:`inner` and :meth:`norm` (the metric), :meth:`proju` (the horizontal
    projection), :meth:`egrad2rgrad` (gradient to ascent direction), :meth:`retr` (the
    perturbed point ``gamma_xi(1)``, a second-order retraction) with :meth:`retr_` and
    :meth:`pullback_` (the same in place, for a loop: what one passes to the next is a
    :class:`Retraction`), :meth:`random` (a Gaussian in the metric) and
    :meth:`acceleration`; Auto-PGD's fused passes live in
    :mod:`geosharp.measures.apgd_step`, over the factors. The element-wise factor
    (:attr:`elementwise`) computes its scale ``c`` and mask of frozen entries from
    ``theta`` piece by piece where used (``elementwise.scale`` and ``.active`` build them
    whole, for inspection): the space keeps no parameter-sized vector, unless
    ``cache_scale=True`` keeps ``c`` (one vector, and a multiplication instead of a
    piece-wise computation wherever it is applied). The pair factor (:attr:`pairs`,
    ``None`` without one) holds the stacked
    pairs and their states, which own the pair maths.
    """

    def __init__(
        self,
        theta: Tensor | Mapping[str, Tensor],
        layout: ParameterLayout,
        pairs: Sequence[PairSpec],
        geometry: Geometry,
        cache_scale: bool = False,
        shards: Shards | None = None,
        dtype: torch.dtype | None = None,
    ):
        params = _parameter_views(theta, layout)
        first = params[layout.names[0]]
        self.dtype = first.dtype if dtype is None else dtype
        self.device, self.numel = first.device, layout.numel
        self.layout = layout
        self.geometry = geometry
        self.shards = shards
        self.pairs: PairSpace | None = None
        if geometry.pairs is not None:
            stacks, reduce = None, None
            if shards is not None:
                stacks, reduce = localize(pairs, shards, self.device), shards.reduce
            self.pairs = PairSpace(
                geometry.pairs, pairs, layout, params, self.device, stacks, reduce
            )
        claimed = self.pairs.claimed(params) if self.pairs is not None else {}
        self.elementwise = ElementwiseSpace(
            geometry.elementwise, params, layout, claimed, cache_scale, self.dtype
        )
        #: the pair factor where its metric measures its entries (the ball), else None
        self.ball_pairs = self.pairs if self.pairs is not None and self.pairs.ball else None
        #: the stacked pairs of the pair factor (empty without one)
        self.blocks: list[StackedPairs] = self.pairs.blocks if self.pairs is not None else []
        #: the sum over the processes that hold a slice each (the identity unsharded)
        self.reduce = (lambda t: t) if shards is None else shards.reduce

    def refresh(self) -> PerturbationSpace:
        """Recompute what depends on the values of ``theta`` (the pair states, the frozen
        entries, a cached scale) after the tensors it views were updated in place, e.g.
        by an optimizer step: cheaper than a new space, whose pair stacking and layout
        stay the same. Returns the space."""
        if self.pairs is not None:
            self.pairs.set_states(self._params())
        self.elementwise.refresh()
        return self

    def _params(self) -> dict[str, Tensor]:
        return {n: part.theta for n, part in zip(self.layout.names, self.elementwise.parts)}

    def empty(self) -> Tensor:
        """A new uninitialised flat tangent."""
        return torch.empty(self.numel, dtype=self.dtype, device=self.device)

    def dot(self, x: Tensor, y: Tensor) -> Tensor:
        """Euclidean ``<x, y>`` (0-d, float64), accumulated chunk by chunk in float64: a
        single float32 dot product of 10^8 entries can be off by 1e-3."""
        return self.reduce(dot(x, y, self.elementwise.chunk))

    # -- metric ---------------------------------------------------------------------------

    def inner(self, xi: Tensor, eta: Tensor) -> Tensor:
        """``g(xi, eta)`` (0-d tensor, float64)."""
        total = self.reduce(self.elementwise.inner(xi, eta))
        return self.ball_pairs.inner(xi, eta, total) if self.ball_pairs is not None else total

    def norm(self, xi: Tensor) -> Tensor:
        """The metric norm, or the largest ``|xi_j| / c_j`` for ``p = inf``."""
        if self.geometry.p == float("inf"):
            best = self.elementwise.linf_norm(xi)
            return best if self.shards is None else self.shards.reduce_max(best)
        return self.inner(xi, xi).clamp_min(0).sqrt()

    # -- projections ----------------------------------------------------------------------

    def proju(self, xi: Tensor) -> Tensor:
        """Zero the frozen entries and project every pair onto its horizontal space."""
        return self.proju_(xi.clone())

    def proju_(self, xi: Tensor) -> Tensor:
        """:meth:`proju` in place (returns ``xi``)."""
        self.elementwise.freeze_(xi)
        if self.ball_pairs is not None:
            self.ball_pairs.proju_(xi)
        return xi

    def egrad2rgrad(self, egrad: Tensor) -> Tensor:
        """Riemannian gradient: ``c^2 * g`` element-wise, section 4 on pairs."""
        return self.egrad2rgrad_(egrad.clone())

    def egrad2rgrad_(self, egrad: Tensor) -> Tensor:
        """:meth:`egrad2rgrad` in place (returns ``egrad``)."""
        pair_grads = self.ball_pairs.egrad2rgrad(egrad) if self.ball_pairs is not None else []
        self.elementwise.scale_(egrad, 2)
        if self.ball_pairs is not None:
            self.ball_pairs.write_(egrad, pair_grads)
        return egrad

    def horizontal_residual(self, xi: Tensor) -> Tensor:
        """Largest ``|R|`` over pairs, relative to the size of ``xi``: 0 iff horizontal."""
        if self.ball_pairs is not None:
            worst = self.ball_pairs.horizontal_residual(xi)
        else:
            worst = torch.zeros((), dtype=torch.float64, device=xi.device)
        return worst / self.norm(xi).clamp_min(1e-300)

    def retr_(self, xi: Tensor, out: Tensor, written: bool = False) -> Retraction:
        """Write :meth:`retr` into ``out`` (not differentiable); returns what
        :meth:`pullback_` needs. ``written``: a fused step wrote the element-wise entries
        already (:meth:`geosharp.measures.apgd_step.StepKernel.combine_`)."""
        saved: list[object] = []
        with torch.no_grad():
            if not written:
                self.elementwise.step_(xi, out)
            if self.pairs is not None:
                saved = self.pairs.retr_(xi, out, straighten=self.elementwise.exp)
        return Retraction(xi, saved)

    def pullback_(self, step: Retraction, grad: Tensor, pairs: bool = True) -> Tensor:
        """Turn ``grad``, the gradient at the point of ``step``, into the gradient with
        respect to its ``xi``, in place: the step is the identity but for the geodesic
        correction of pairs and, with ``elementwise_step="exp"``, the factor
        ``exp(xi / theta)`` of element-wise entries (pair entries keep the straight
        step). ``pairs=False`` leaves the pair blocks to a fused pass of the caller."""
        with torch.no_grad():
            if self.elementwise.exp:
                self._exp_pullback_(step, grad)
            if pairs and self.geometry.geodesic_step:
                self.pairs.pullback_(step.xi, grad, step.saved)
        return grad

    def _exp_pullback_(self, step: Retraction, grad: Tensor) -> None:
        """The factor ``exp(xi / theta)`` of the element-wise step on the entries it
        takes (pair entries keep the straight step)."""
        kept = self.pairs.read(grad) if self.pairs is not None else []
        self.elementwise.exp_pullback_(step.xi, grad)
        if self.pairs is not None:
            self.pairs.write_(grad, kept)

    # -- sampling and stepping ------------------------------------------------------------

    def random(self, generator: torch.Generator | None = None) -> Tensor:
        """A Gaussian tangent in the metric, projected (not normalised).

        The element-wise entries are a draw of :mod:`~geosharp.geometry.draws` seeded
        from ``generator``: a sharded space draws only the blocks of its own slices, the
        numbers one process draws for the whole vector. Pair blocks are drawn
        equivariantly (:meth:`PairState.sample`): with the same generator state,
        symmetry-related networks get symmetry-related samples.
        """
        z = self.empty()
        seed = draw_seed(generator, self.device)
        if self.shards is None:
            normal_runs_(z, [(0, 0, self.numel)], self.numel, seed)
        else:
            normal_runs_(z, self.shards.runs(), self.shards.global_layout.numel, seed)
        out = self.elementwise.scale_(z)
        if self.ball_pairs is not None:
            self.ball_pairs.write_(out, self.ball_pairs.sample(generator))
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
        if self.elementwise.exp:
            self.elementwise.exp_acceleration_(xi, out)
            if self.pairs is not None:  # pair entries keep the straight line
                blocks = self.pairs.read(out)
                self.pairs.write_(out, [tuple(map(torch.zeros_like, b)) for b in blocks])
        if self.geometry.geodesic_step:
            self.pairs.add_acceleration_(xi, out)
        return out

    def retr(self, xi: Tensor) -> Tensor:
        """The perturbed point ``gamma_xi(1)`` as a flat vector (differentiable in ``xi``)."""
        theta = self.elementwise.theta_flat()
        exp = self.elementwise.exp
        out = exp_step(theta, xi) if exp else theta + xi
        if self.pairs is not None:
            out = self.pairs.retr(theta, xi, out, straighten=exp)
        return out


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
    if len({t.device for t in out.values()}) > 1:
        raise ValueError("theta's tensors must share one device")
    return out
