r"""The tangent space of a whole network at ``theta``, for one geometry.

A full-network tangent ``xi`` is one flat vector shaped like the perturbed parameters
(:class:`~geosharp.params.ParameterLayout`). Entries that belong to a symmetric pair
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

from ..params import ParameterLayout
from ..symmetry.pairs import PairSpec
from .pairs import PairMetric, PairState, get_metric
from .subgroup import restrict_state

__all__ = ["GEOMETRIES", "Geometry", "PerturbationSpace", "StackedPairs"]

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
        metric: str = "inv",
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
        full = f"{name}[{pair_metric.name}]"
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
    """

    specs: list[PairSpec]
    g_index: Tensor
    h_index: Tensor
    state: PairState | None = None
    group: str = "GL"

    def gather(self, flat: Tensor) -> tuple[Tensor, Tensor]:
        return flat[self.g_index], flat[self.h_index]

    def scatter(self, flat: Tensor, blocks: tuple[Tensor, Tensor]) -> Tensor:
        """``flat`` with this pair's entries replaced by ``blocks`` (out of place)."""
        out = flat.index_copy(0, self.g_index.reshape(-1), blocks[0].reshape(-1))
        return out.index_copy(0, self.h_index.reshape(-1), blocks[1].reshape(-1))

    def scatter_(self, flat: Tensor, blocks: tuple[Tensor, Tensor]) -> Tensor:
        """:meth:`scatter` in place."""
        flat.index_copy_(0, self.g_index.reshape(-1), blocks[0].reshape(-1).to(flat.dtype))
        return flat.index_copy_(0, self.h_index.reshape(-1), blocks[1].reshape(-1).to(flat.dtype))


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


class PerturbationSpace:
    """Tangent space at the flat point ``theta`` for a :class:`Geometry`.

    Operations mirror geoopt's manifold interface: :meth:`inner`, :meth:`proju`
    (horizontal projection), :meth:`egrad2rgrad`, :meth:`retr` (the perturbed point
    ``gamma_xi(1)``), plus :meth:`random` (a Gaussian in the metric).
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

        covered = torch.zeros_like(self.theta, dtype=torch.bool)
        for block in self.blocks:
            covered[block.g_index.reshape(-1)] = True
            covered[block.h_index.reshape(-1)] = True
        scale = self.theta.abs() if geometry.relative else torch.ones_like(self.theta)
        elementwise = ~covered if geometry.metric_ball else torch.ones_like(covered)
        # Entries below sqrt(tiny) are frozen: 1/c would overflow (and c^2 underflow).
        movable = scale > torch.finfo(scale.dtype).tiny ** 0.5
        zero = torch.zeros_like(scale)
        self.scale = torch.where(elementwise & movable, scale, zero)
        # The element-wise metric is sum_j (xi_j / c_j)^2 on element-wise entries.
        self.inv_scale = torch.where(self.scale > 0, 1.0 / torch.where(movable, scale, 1), zero)
        # Entries a perturbation may use: movable element-wise ones, and pair entries.
        self.active = (elementwise & movable) | (covered & geometry.metric_ball)
        self._all_active = bool(self.active.all())
        self.active = self.active.to(theta.dtype)
        self._metric_blocks = self.blocks if geometry.metric_ball else []
        self._work = torch.empty_like(self.theta)  # scratch for norms (no allocation)

    # -- metric ---------------------------------------------------------------------------

    def inner(self, xi: Tensor, eta: Tensor) -> Tensor:
        """``g(xi, eta)`` (0-d tensor, float64)."""
        if eta is xi:
            a = torch.mul(xi, self.inv_scale, out=self._work)
            total = torch.dot(a, a).double()
        else:
            total = torch.dot(torch.mul(xi, self.inv_scale, out=self._work), eta * self.inv_scale)
            total = total.double()
        for block in self._metric_blocks:
            total = total + block.state.inner(block.gather(xi), block.gather(eta)).sum()
        return total

    def norm(self, xi: Tensor) -> Tensor:
        if self.geometry.p == float("inf"):
            return self.linf_norm(xi)
        return self.inner(xi, xi).clamp_min(0).sqrt()

    def linf_norm(self, xi: Tensor) -> Tensor:
        return torch.mul(xi, self.inv_scale, out=self._work).abs_().max().double()

    # -- projections ----------------------------------------------------------------------

    def proju(self, xi: Tensor) -> Tensor:
        """Zero the frozen entries and project every pair onto its horizontal space."""
        return self.proju_(xi.clone())

    def proju_(self, xi: Tensor) -> Tensor:
        """:meth:`proju` in place (returns ``xi``)."""
        if not self._all_active:
            xi.mul_(self.active)
        for block in self._metric_blocks:
            block.scatter_(xi, block.state.project_horizontal(block.gather(xi)))
        return xi

    def egrad2rgrad(self, egrad: Tensor) -> Tensor:
        """Riemannian gradient: ``c^2 * g`` element-wise, section 4 on pairs."""
        return self.egrad2rgrad_(egrad.clone())

    def egrad2rgrad_(self, egrad: Tensor) -> Tensor:
        """:meth:`egrad2rgrad` in place (returns ``egrad``)."""
        pair_grads = [b.state.egrad2rgrad(b.gather(egrad)) for b in self._metric_blocks]
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

    # -- sampling and stepping ------------------------------------------------------------

    def random(self, generator: torch.Generator | None = None) -> Tensor:
        """A Gaussian tangent in the metric, projected (not normalised).

        Pair blocks are drawn equivariantly (:func:`equivariant_gaussian`): with the same
        generator state, symmetry-related networks get symmetry-related samples.
        """
        z = torch.randn(
            self.theta.shape, generator=generator, dtype=self.theta.dtype,
            device=self.theta.device,
        )
        out = z.mul_(self.scale)
        for block in self._metric_blocks:
            sample = equivariant_gaussian(
                block.state, self.geometry.metric.name, generator,
                eps=getattr(self.geometry.metric, "eps", 0.0),
            )
            block.scatter_(out, sample)
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


def equivariant_gaussian(
    state: PairState, metric: str, generator: torch.Generator | None = None,
    chunk: int = 1 << 22, eps: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """A Gaussian pair tangent in the metric whose draw commutes with the group action.

    ``inv``: ``xiG = W G``, ``xiH = W' H`` with standard Gaussian ``W`` (``n x n``),
    ``W'`` (``m x m``): the rows of ``xiG`` are ``N(0, P)``, the law of ``Z P^{1/2}``.
    ``mix``: ``xiG = W H Q^{-1}``, ``xiH = W' G P^{-1}`` (rows ``N(0, Q^{-1})`` and
    ``N(0, P^{-1})``). Under ``(G, H) -> (G A, H A^{-T})`` each sample maps to
    ``(xiG A, xiH A^{-T})``, so symmetry-related networks see related directions.
    Heads are drawn in chunks of at most ``chunk`` Gaussian numbers.

    ``inv`` with ``eps > 0`` (metric of ``P + eps I``, ``Q + eps I``) adds independent
    ``sqrt(eps) Z`` so that the rows are ``N(0, P + eps I)``; like the relaxed metric,
    this is equivariant only up to ``O(eps)``.
    """
    G, H = state.G, state.H
    heads, n, _ = G.shape
    m = H.shape[1]
    if metric == "inv":
        g_factor, h_factor = G, H
    else:
        g_factor, h_factor = H @ state.Q_inv, G @ state.P_inv
    step = max(1, chunk // max(n * g_factor.shape[1], m * h_factor.shape[1]))
    parts_g, parts_h = [], []
    for start in range(0, heads, step):
        sl = slice(start, start + step)
        count = g_factor[sl].shape[0]
        W = torch.randn(count, n, g_factor.shape[1], generator=generator, dtype=G.dtype,
                        device=G.device)
        parts_g.append(W @ g_factor[sl])
        W = torch.randn(count, m, h_factor.shape[1], generator=generator, dtype=G.dtype,
                        device=G.device)
        parts_h.append(W @ h_factor[sl])
    xiG, xiH = torch.cat(parts_g), torch.cat(parts_h)
    if metric == "inv" and eps:
        root = eps**0.5
        xiG = xiG + root * torch.randn(G.shape, generator=generator, dtype=G.dtype, device=G.device)
        xiH = xiH + root * torch.randn(H.shape, generator=generator, dtype=H.dtype, device=H.device)
    return xiG, xiH
