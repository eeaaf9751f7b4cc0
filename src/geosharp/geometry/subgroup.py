r"""Pairs whose symmetry is a subgroup ``K`` of ``GL(h)`` (MATH.md section 1).

Rotary position embeddings (RoPE) rotate queries and keys by position before their
product, so the query/key pair keeps only the transforms that commute with every
rotation: in the "rotate half" layout (planes ``(j, j + h/2)``), matrices that act on
each plane as a complex scalar ``[[a, -b], [b, a]]``. Its Lie algebra ``k`` has
dimension ``h`` and the basis

.. math:: A_j = e_j e_j^T + e_{j'} e_{j'}^T, \qquad B_j = e_{j'} e_j^T - e_j e_{j'}^T,
          \qquad j' = j + h/2.

Queries and keys normalised without a weight keep the orthogonal group, whose algebra
is the skew-symmetric matrices (dimension ``h(h-1)/2``), and with rotary embeddings a
rotation per plane (the ``B_j`` alone).

The metrics are the same (they are ``GL(h)``-invariant, hence ``K``-invariant), and so
are the geodesics; only the vertical space shrinks to ``{V(L) = (G L, -H L^T): L in k}``.
The g-orthogonal projection onto the ``K``-horizontal space is ``xi - V(L)`` with
``L = sum_a c_a E_a`` solving the ``dim k`` linear equations (by a Cholesky factor of
their matrix, or, for a large algebra, by conjugate gradients on ``h x h`` products)

.. math:: \sum_b g(V(E_a), V(E_b))\, c_b = g(\xi, V(E_a)) = \operatorname{tr}(R(\xi) E_a),

i.e. ``Pi_k(R(xi - V(L))^T) = 0``. The Gram matrix of the vertical basis is SPD for
full-rank pairs; it is built from ``h x h`` matrices only (float64, batched):
``R(V(L)) = X_1 L^T Y_1 + X_2 L^T Y_2`` with ``(X_1, Y_1, X_2, Y_2) =
(P^{-1}, G^T G, H^T H, Q^{-1})`` for ``inv`` and ``(Q, G^T G, H^T H, P)`` for ``mix``.

>>> import torch
>>> from geosharp.geometry.pairs import InvMetric
>>> g = torch.Generator().manual_seed(0)
>>> G = torch.randn(3, 9, 4, generator=g, dtype=torch.float64)
>>> H = torch.randn(3, 7, 4, generator=g, dtype=torch.float64)
>>> state = restrict_state(InvMetric().state(G, H), "rotary")
>>> xi = state.project_horizontal((torch.randn_like(G), torch.randn_like(H)))
>>> bool(state.horizontal_residual(xi).abs().max() < 1e-12)
True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..symmetry.groups import check_group, lie_algebra_basis
from .pairs import InvState, MixState, PairState, Tangent

__all__ = ["SubgroupState", "restrict_state"]

_F64 = torch.float64


def _t(x: Tensor) -> Tensor:
    return x.transpose(-1, -2)


@dataclass
class SubgroupState(PairState):
    """Geometry of a batch of pairs whose symmetry is the subgroup ``group``.

    Everything but the vertical space is the full group's (``base``): metric,
    gradient, geodesic acceleration and sampling delegate to it.
    """

    base: PairState
    group: str
    rows: Tensor  # (k, 2) basis of the Lie algebra
    cols: Tensor
    signs: Tensor
    chol: Tensor | None  # (B, k, k) Cholesky factor of g(V(E_a), V(E_b)); None: solved by CG
    terms: tuple = ()  # ((X_1, Y_1), (X_2, Y_2)) of R(V(L)), for the solve by CG

    @property
    def h(self) -> int:
        return self.base.h

    def _derive(self, name: str) -> Tensor:
        return getattr(self.base, name)

    def read_from_(self, read) -> SubgroupState:
        self.base.read_from_(read)
        return super().read_from_(read)

    def inner(self, xi: Tangent, eta: Tangent) -> Tensor:
        return self.base.inner(xi, eta)

    def egrad2rgrad(self, egrad: Tangent) -> Tangent:
        return self.base.egrad2rgrad(egrad)

    def geodesic_acceleration(self, xi: Tangent) -> Tangent:
        return self.base.geodesic_acceleration(xi)

    def accelerate(self, xi: Tangent) -> tuple[Tangent, object]:
        return self.base.accelerate(xi)

    def pullback(self, xi: Tangent, u: Tangent, saved: object = None) -> Tangent:
        return self.base.pullback(xi, u, saved)

    def sample(self, generator: torch.Generator | None = None, rows=None) -> Tangent:
        if rows is None:  # a metric of one's own may not know row shards
            return self.base.sample(generator)
        return self.base.sample(generator, rows=rows)

    def _coordinates(self, R: Tensor) -> Tensor:
        """``tr(R E_a)`` for every basis element: ``(B, k)``."""
        # tr(R E) = sum_s sign_s R[col_s, row_s]
        return (R[..., self.cols, self.rows] * self.signs).sum(-1)

    def _element(self, c: Tensor) -> Tensor:
        """``sum_a c_a E_a`` as dense ``(B, h, h)`` matrices."""
        h = self.h
        flat = (self.rows * h + self.cols).reshape(-1)
        values = (c.unsqueeze(-1) * self.signs).flatten(-2)  # also for no heads
        out = torch.zeros(*c.shape[:-1], h * h, dtype=c.dtype, device=c.device)
        return out.index_add(-1, flat.to(c.device), values).view(*c.shape[:-1], h, h)

    def horizontal_residual(self, xi: Tangent) -> Tensor:
        """``Pi_k(R^T)^T``: ``tr(. L)`` agrees with ``R`` for ``L`` in ``k``; zero iff
        ``xi`` is horizontal for the subgroup."""
        R = self.base.horizontal_residual(xi)
        return _t(self._element(0.5 * self._coordinates(R)))

    def vertical_coefficient(self, xi: Tangent) -> Tensor:
        x = (xi[0].to(_F64), xi[1].to(_F64))
        rhs = self._coordinates(self.base.horizontal_residual(x))
        if self.chol is None:
            return self._element(_conjugate_gradients(self._gram_times, rhs))
        c = torch.cholesky_solve(rhs.unsqueeze(-1), self.chol).squeeze(-1)
        return self._element(c)

    def _gram_times(self, c: Tensor) -> Tensor:
        """``M c`` with ``M_ab = g(V(E_a), V(E_b))``, from ``h x h`` products:
        ``tr(R(V(L)) E_a)``, ``R(V(L)) = X_1 L^T Y_1 + X_2 L^T Y_2``."""
        Lt = _t(self._element(c))
        R = sum(X @ Lt @ Y for X, Y in self.terms)
        return self._coordinates(R)


DENSE = 512
"""An algebra of at most this dimension is solved by the Cholesky factor of its Gram
matrix (``dim k`` squared entries per head), a larger one (``O(h)`` for ``h > 32``) by
conjugate gradients."""


def _residual_terms(state: PairState) -> tuple | None:
    """``((X_1, Y_1), (X_2, Y_2))`` with ``R(V(L)) = X_1 L^T Y_1 + X_2 L^T Y_2`` for the
    metrics whose residual is known in closed form (``None``: another metric)."""
    G, H = state.G64, state.H64
    Gg, Hg = state._sums(_t(G) @ G, _t(H) @ H)
    if isinstance(state, InvState):
        return (state.P_inv, Gg), (Hg, state.Q_inv)
    if isinstance(state, MixState):
        return (state.Q, Gg), (Hg, state.P)
    return None


def _conjugate_gradients(times, b: Tensor, rtol: float = 1e-13) -> Tensor:
    """``x`` with ``M x = b`` for a batch of SPD ``M`` given by ``times(x) = M x``
    (``(B, k)``), by conjugate gradients to a residual of ``rtol |b|``."""
    x = torch.zeros_like(b)
    r = b.clone()
    p = r.clone()
    rr = (r * r).sum(-1, keepdim=True)
    target = (rtol**2) * rr.clamp_min(1e-300)
    for _ in range(4 * b.shape[-1] + 20):
        if bool((rr <= target).all()):
            break
        Mp = times(p)
        alpha = rr / (p * Mp).sum(-1, keepdim=True).clamp_min(1e-300)
        x = x + alpha * p
        r = r - alpha * Mp
        rr_new = (r * r).sum(-1, keepdim=True)
        p = r + (rr_new / rr.clamp_min(1e-300)) * p
        rr = rr_new
    return x


def _vertical_gram(state: PairState, rows: Tensor, cols: Tensor, signs: Tensor) -> Tensor:
    """``M_ab = g(V(E_a), V(E_b)) = tr(R(V(E_b)) E_a)`` for the sparse basis."""
    terms = _residual_terms(state)
    if terms is None:
        return _vertical_gram_generic(state, rows, cols, signs)
    Gg = terms[0][1]
    # tr(X E_b^T Y E_a), E_b = sum_s sb_s e_{p_s} e_{q_s}^T, E_a = sum_t sa_t e_{u_t} e_{v_t}^T:
    # sum_{s,t} sb_s sa_t X[v_t, q_s] Y[p_s, u_t].
    k = rows.shape[0]
    M = torch.zeros(*Gg.shape[:-2], k, k, dtype=_F64, device=Gg.device)
    for X, Y in terms:
        for s in range(rows.shape[1]):
            for t in range(rows.shape[1]):
                xv = X[..., cols[:, t].unsqueeze(1), cols[:, s].unsqueeze(0)]  # [a, b]
                yv = Y[..., rows[:, s].unsqueeze(0), rows[:, t].unsqueeze(1)]  # [a, b]
                M = M + signs[:, t].unsqueeze(1) * signs[:, s].unsqueeze(0) * xv * yv
    return 0.5 * (M + _t(M))


def _vertical_gram_generic(state: PairState, rows: Tensor, cols: Tensor, signs: Tensor) -> Tensor:
    """Slow path for other metrics: ``g(V(E_a), V(E_b))`` from ``state.inner``."""
    h = state.h
    k = rows.shape[0]
    basis = torch.zeros(k, h, h, dtype=_F64, device=state.G.device)
    for a in range(k):
        for s in range(rows.shape[1]):
            basis[a, rows[a, s], cols[a, s]] += signs[a, s]
    vertical = [state.vertical(basis[a]) for a in range(k)]
    M = torch.stack(
        [
            torch.stack([state.inner(vertical[a], vertical[b]) for b in range(k)], -1)
            for a in range(k)
        ],
        -2,
    )
    return 0.5 * (M + _t(M))


def restrict_state(state: PairState, group: str) -> PairState:
    """The geometry of ``state``'s pairs for the symmetry ``group``; ``"GL"`` returns
    ``state`` itself."""
    h = state.h
    check_group(group, h)
    if group == "GL":
        return state
    rows, cols, signs = lie_algebra_basis(group, h)
    device = state.G.device
    rows, cols, signs = rows.to(device), cols.to(device), signs.to(device)
    terms = _residual_terms(state) if len(rows) > DENSE else None
    chol = None
    if terms is None:
        M = _vertical_gram(state, rows, cols, signs)
        chol, info = torch.linalg.cholesky_ex(M)
        if bool((info != 0).any()):
            raise torch.linalg.LinAlgError(
                f"the vertical space of a {group!r} pair is degenerate: a pair is rank deficient"
            )
    return SubgroupState(
        state.G,
        state.H,
        None,  # P, Q and their inverses: the base state's (_derive)
        None,
        None,
        None,
        base=state,
        group=group,
        reduce=state.reduce,
        rows=rows,
        cols=cols,
        signs=signs,
        chol=chol,
        terms=terms or (),
    )
