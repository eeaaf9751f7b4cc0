r"""Quotient geometry of ``GL(h)`` pairs ``(G, H)``, batched over heads and layers.

All tensors carry a leading batch dimension: ``G`` is ``(B, n, h)``, ``H`` is
``(B, m, h)``; a tangent vector is a pair ``(xiG, xiH)`` of the same shapes. With
``P = G^T G`` and ``Q = H^T H`` (MATH.md sections 2-5):

=========  ========================================  ===========================================
           ``inv``                                   ``mix``
=========  ========================================  ===========================================
metric     tr(P^-1 xiG^T etaG) + tr(Q^-1 xiH^T etaH)  tr(Q xiG^T etaG) + tr(P xiH^T etaH)
gradient   (dG P, dH Q)                              (dG Q^-1, dH P^-1)
=========  ========================================  ===========================================

The horizontal projection is ``xi - (G L, -H L^T)`` with ``L`` from a Sylvester
equation (``inv``) or in closed form (``mix``); geodesics are expanded to second
order, ``gamma(t) = (G, H) + t xi + t^2/2 (G'', H'')``.

The small ``h x h`` algebra (Gram matrices, inverses, eigen-decompositions, the
projection) runs in float64 whatever the input dtype: a Gram matrix squares the
condition number of its factor, so in float32 the projection is off by more than 1e-5
from a factor's condition number 100 and the Gram matrix is singular at 1e4. The
geodesic acceleration, on the autograd hot path, runs in the tangent's dtype.

>>> import torch
>>> G = torch.tensor([[[2.0]]], dtype=torch.float64)  # a scalar pair (u, v) = (2, 3)
>>> H = torch.tensor([[[3.0]]], dtype=torch.float64)
>>> xi = (torch.ones_like(G), torch.ones_like(H))
>>> inv = InvMetric().state(G, H)
>>> float(inv.inner(xi, xi))  # du^2/u^2 + dv^2/v^2
0.3611111111111111
>>> h = inv.project_horizontal(xi)  # xi_u/u = xi_v/v = (1/2 + 1/3) / 2 = 5/12
>>> float(h[0] / G), float(h[1] / H)
(0.4166666666666667, 0.4166666666666667)
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["InvMetric", "MixMetric", "PairMetric", "PairState", "get_metric"]

Tangent = tuple[Tensor, Tensor]
Reduce = Callable[[Tensor], Tensor]
_F64 = torch.float64


def _t(x: Tensor) -> Tensor:
    return x.transpose(-1, -2)


def _spd_functions(P: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``P^{-1}, P^{1/2}, P^{-1/2}`` and the eigenvalues of a batch of SPD matrices."""
    w, V = torch.linalg.eigh(P)
    if bool((w <= 0).any()):
        raise torch.linalg.LinAlgError(
            "a Gram matrix G^T G or H^T H is singular: a pair is rank deficient. "
            "Use the 'inv' metric with eps > 0 (e.g. eps=1e-4) or the 'mix' metric"
        )
    Vt = _t(V)
    inv = (V / w.unsqueeze(-2)) @ Vt
    sqrt = (V * w.sqrt().unsqueeze(-2)) @ Vt
    isqrt = (V / w.sqrt().unsqueeze(-2)) @ Vt
    return inv, sqrt, isqrt, w


class PairMetric(ABC):
    """A ``GL(h)``-invariant metric on pairs; :meth:`state` precomputes everything that
    depends only on the base point.

    Sharded pairs: every quantity the built-in metrics need from ``G`` and ``H`` is a
    sum over their rows (Gram matrices, ``xi_G^T G``, ...), so a state built with
    ``reduce`` (an all-reduce of a tensor's sum over the processes holding the rows,
    e.g. :func:`geosharp.distributed.all_reduce_sum`) works on each process's rows
    alone, with ``h x h`` reductions only. The equivariant sampler mixes rows and is not
    available there.
    """

    name: str

    @abstractmethod
    def state(self, G: Tensor, H: Tensor) -> PairState: ...


@dataclass
class PairState(ABC):
    """Geometry of a batch of pairs at a fixed base point ``(G, H)``.

    ``G, H`` keep the parameters' dtype; after :meth:`read_from_` they are not held but
    read from the base point on each use (the model's own weights: no copy of them
    lives as long as the state). The ``h x h`` matrices ``P, Q, P_inv, Q_inv`` are
    float64, held as given, or, where given as ``None``, made on each use from what the
    state holds (:meth:`_derive`: the built-in states hold factors from which they
    follow, and the hot path's copies in the tangent's dtype). :attr:`G64` and
    :attr:`H64` give the blocks in float64 for the reference methods.
    """

    _G: Tensor | None  # None: read on each use (read_from_)
    _H: Tensor | None
    _P: Tensor | None  # None: made on each use (_derive)
    _Q: Tensor | None
    _P_inv: Tensor | None
    _Q_inv: Tensor | None
    reduce: Reduce | None = field(default=None, kw_only=True, repr=False)
    _read: Callable[[str, torch.dtype | None], Tensor] | None = field(
        default=None, kw_only=True, repr=False, compare=False
    )

    def _sum(self, t: Tensor) -> Tensor:
        """``t`` summed over the shards of the rows (identity on a whole pair)."""
        return t if self.reduce is None else self.reduce(t)

    def _sums(self, *ts: Tensor) -> tuple[Tensor, ...]:
        """Each per-pair ``t`` (``(B, ...)``, one dtype) summed over the shards of the
        rows in one collective: side by side in one ``(B, k)`` buffer, taken back as
        views of it (identity on a whole pair)."""
        if self.reduce is None:
            return ts
        sizes = [math.prod(t.shape[1:]) for t in ts]  # B may be 0: no heads held here
        total = self.reduce(torch.cat([t.reshape(t.shape[0], k) for t, k in zip(ts, sizes)], 1))
        return tuple(part.view(t.shape) for part, t in zip(total.split(sizes, dim=1), ts))

    def read_from_(self, read: Callable[[str, torch.dtype | None], Tensor]) -> PairState:
        """Drop the held blocks: ``read("G" or "H", dtype)`` gives them, new, on each use
        (``dtype`` ``None``: the parameters' own). Returns the state."""
        self._G = self._H = None
        self._read = read
        return self

    def block(self, name: str, dtype: torch.dtype | None = None) -> Tensor:
        """The base point's ``"G"`` or ``"H"`` blocks in ``dtype`` (``None``: as held or
        read); a held block in its own dtype is itself, not a copy."""
        held = self._G if name == "G" else self._H
        if held is None:
            kept = self.__dict__.get("_kept")
            if kept is not None and kept[0] == dtype:
                return kept[1 if name == "G" else 2]
            return self._read(name, dtype)
        return held if dtype is None else held.to(dtype)

    @contextlib.contextmanager
    def reading(self, dtype: torch.dtype):
        """One pass over the pairs' blocks: within it, the blocks read where used
        (:meth:`read_from_`) are read once in ``dtype``, and the ``h x h`` matrices in a
        tangent's dtype made once, both shared by every method called and freed at its
        end, so that they are not held through the forward and backward between passes
        (outside a pass, each use makes its own)."""
        if self.__dict__.get("_pass") is not None:  # within a pass already
            yield self
            return
        self._pass = {}
        if self._read is not None:
            self._kept = (dtype, self._read("G", dtype), self._read("H", dtype))
        try:
            yield self
        finally:
            self._pass = self._kept = None

    @property
    def P(self) -> Tensor:
        return self._matrix("P")

    @property
    def Q(self) -> Tensor:
        return self._matrix("Q")

    @property
    def P_inv(self) -> Tensor:
        return self._matrix("P_inv")

    @property
    def Q_inv(self) -> Tensor:
        return self._matrix("Q_inv")

    def _matrix(self, name: str) -> Tensor:
        held = self.__dict__["_" + name]
        if held is not None:
            return held
        made = (self.__dict__.get("_pass") or {}).get((name, _F64))
        return made if made is not None else self._derive(name)

    def _derive(self, name: str) -> Tensor:
        """The float64 ``h x h`` matrix ``name`` (``"P"``, ``"Q"``, ``"P_inv"``,
        ``"Q_inv"``) of a state that does not hold it."""
        raise NotImplementedError(f"{type(self).__name__} holds no {name} and cannot make it")

    @property
    def G(self) -> Tensor:
        return self.block("G")

    @property
    def H(self) -> Tensor:
        return self.block("H")

    @property
    def h(self) -> int:
        for name in ("_P", "_Q", "_P_inv", "_Q_inv"):
            if self.__dict__[name] is not None:
                return self.__dict__[name].shape[-1]
        return self.P.shape[-1]

    @property
    def G64(self) -> Tensor:
        return self.block("G", _F64)

    @property
    def H64(self) -> Tensor:
        return self.block("H", _F64)

    def vertical(self, L: Tensor) -> Tangent:
        """The vertical vector ``(G L, -H L^T)``: the orbit direction of ``L``."""
        return self.G64 @ L, -self.H64 @ _t(L)

    @abstractmethod
    def inner(self, xi: Tangent, eta: Tangent) -> Tensor:
        """``g(xi, eta)`` per pair, shape ``(B,)``."""

    @abstractmethod
    def horizontal_residual(self, xi: Tangent) -> Tensor:
        """``R`` with ``g(xi, V(L)) = tr(R L)``; ``xi`` is horizontal iff ``R = 0``."""

    @abstractmethod
    def vertical_coefficient(self, xi: Tangent) -> Tensor:
        """``L`` such that ``xi - V(L)`` is horizontal (the g-orthogonal projection)."""

    @abstractmethod
    def egrad2rgrad(self, egrad: Tangent) -> Tangent:
        """Riemannian gradient from the Euclidean gradient ``(dG, dH)``."""

    @abstractmethod
    def geodesic_acceleration(self, xi: Tangent) -> Tangent:
        """``(G'', H'') = -Gamma(xi, xi)``, in ``xi``'s dtype."""

    @abstractmethod
    def sample(self, generator: torch.Generator | None = None, rows: Rows | None = None) -> Tangent:
        """A standard Gaussian in the metric (``E g(xi, a) g(xi, b) = g(a, b)``), drawn
        equivariantly: with the same generator state, the pairs ``(G A, H A^{-T})`` get
        ``(xiG A, xiH A^{-T})``, so symmetry-related networks see related directions.
        On row shards (``reduce``), ``rows`` says which global rows are held here: the
        draw is the whole pair's, restricted to them."""

    def project_horizontal(self, xi: Tangent) -> Tangent:
        """The g-orthogonal projection onto the horizontal space (float64 inside)."""
        dtype = xi[0].dtype
        x = (xi[0].to(_F64), xi[1].to(_F64))
        L = self.vertical_coefficient(x)
        vG, vH = self.vertical(L)
        return (x[0] - vG).to(dtype), (x[1] - vH).to(dtype)

    # Auto-PGD's hot path. The same maths; states that can arrange it for speed override
    # it (the large n x h products in the tangent's dtype, the h x h algebra in float64).

    def proju(self, xi: Tangent) -> Tangent:
        """:meth:`project_horizontal` (a fused form where the state has one)."""
        return self.project_horizontal(xi)

    def direction(self, egrad: Tangent) -> Tangent:
        """The horizontal Riemannian gradient ``proju(egrad2rgrad(egrad))``."""
        return self.proju(self.egrad2rgrad(egrad))

    def accelerate(self, xi: Tangent) -> tuple[Tangent, object]:
        """``geodesic_acceleration(xi)``, and what :meth:`pullback` may reuse of it."""
        return self.geodesic_acceleration(xi), None

    def pullback(self, xi: Tangent, u: Tangent, saved: object = None) -> Tangent:
        """``u + J^T u / 2`` with ``J`` the Jacobian of the acceleration at ``xi``: the
        gradient in ``xi`` of a loss at ``(G, H) + xi + a(xi) / 2`` whose gradient there
        is ``u``. ``saved`` comes from :meth:`accelerate` (here: autograd)."""
        x = tuple(t.detach().requires_grad_(True) for t in xi)
        with torch.enable_grad():
            vjp = torch.autograd.grad(self.geodesic_acceleration(x), x, u)
        return u[0] + 0.5 * vjp[0], u[1] + 0.5 * vjp[1]

    def geodesic(self, xi: Tangent, t: float = 1.0) -> tuple[Tensor, Tensor]:
        """Second-order geodesic ``(G, H) + t xi + t^2/2 (G'', H'')``."""
        aG, aH = self.geodesic_acceleration(xi)
        G, H = self.block("G", aG.dtype), self.block("H", aH.dtype)
        return G + t * xi[0] + 0.5 * t * t * aG, H + t * xi[1] + 0.5 * t * t * aH

    def norm(self, xi: Tangent) -> Tensor:
        return self.inner(xi, xi).clamp_min(0).sqrt()

    def _operands(self, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``G, H, P^{-1}, Q^{-1}`` in ``dtype``: the hot path's operands, made for the
        call or, within :meth:`reading`, once per pass."""
        return tuple(self._cast(n, dtype) for n in ("G", "H", "P_inv", "Q_inv"))  # type: ignore[return-value]

    def _cast(self, name: str, dtype: torch.dtype) -> Tensor:
        if name in ("G", "H"):
            return self.block(name, dtype)
        made = self.__dict__.get("_pass")
        if made is None:
            return getattr(self, name).to(dtype)
        key = (name, dtype)
        if key not in made:
            made[key] = getattr(self, name).to(dtype)
        return made[key]


# --- inv ------------------------------------------------------------------------------


@dataclass
class InvState(PairState):
    """``P, Q`` (and ``P_inv, Q_inv``) include ``eps``. The projection
    solves ``A X + X B = C`` with ``A = P (H^T H) = S diag(d) S^{-1}`` and
    ``B = (G^T G) Q = T diag(e) T^{-1}`` (for ``eps = 0``, ``A = B = P Q`` and
    ``T, e = S, d``).

    Only ``S, S^{-1}`` (and ``T, T^{-1}`` with ``eps``) are held in float64; the rest
    follows: ``P = S S^T``, ``P^{-1} = S^{-T} S^{-1}``, and ``Q = S^{-T} D S^{-1}``
    (``eps = 0``) or ``T^{-T} T^{-1}`` (``eps > 0``)."""

    S: Tensor
    S_inv: Tensor
    d: Tensor
    T: Tensor
    T_inv: Tensor
    e: Tensor
    eps: float = 0.0

    def inner(self, xi: Tangent, eta: Tangent) -> Tensor:
        x, y = _f64(xi), _f64(eta)
        return self._sum(
            ((x[0] @ self.P_inv) * y[0]).sum((-1, -2)) + ((x[1] @ self.Q_inv) * y[1]).sum((-1, -2))
        )

    def horizontal_residual(self, xi: Tangent) -> Tensor:
        x = _f64(xi)
        A, B = self._sums(_t(x[0]) @ self.G64, _t(self.H64) @ x[1])
        return self.P_inv @ A - B @ self.Q_inv

    @property
    def h(self) -> int:
        return self.S.shape[-1]

    def _derive(self, name: str) -> Tensor:
        S, S_inv = self.S, self.S_inv
        if name == "P":
            return S @ _t(S)
        if name == "P_inv":
            return _t(S_inv) @ S_inv
        if name == "Q":  # (Q T) T^{-1}
            return self._QT() @ self.T_inv
        return self.T @ _t(self.T) if self.eps else (S / self.d.unsqueeze(-2)) @ _t(S)

    def _QT(self) -> Tensor:
        """``Q T``: ``S^{-T} D`` (``eps = 0``), ``T^{-T}`` (``eps > 0``)."""
        return _t(self.T_inv) if self.eps else _t(self.S_inv) * self.d.unsqueeze(-2)

    def vertical_coefficient(self, xi: Tangent) -> Tensor:
        # R(xi - V(L)) = 0 with X = L^T reads A X + X B = C (multiplied by P, Q), where
        # C = xiG^T G Q - P H^T xiH, A = P (H^T H), B = (G^T G) Q (P, Q with eps; for
        # eps = 0 this is MATH.md's (P Q) X + X (P Q) = C). With A = S D S^{-1} and
        # B = T E T^{-1}: Y = S^{-1} C T, Y_ij /= d_i + e_j, X = S Y T^{-1}.
        # denom = 0 only where V(L) = 0 (G and H both rank deficient, eps > 0): any Y
        # solves there; take 0.
        x = _f64(xi)
        return self._coefficient(*self._sums(_t(x[0]) @ self.G64, _t(self.H64) @ x[1]))

    def egrad2rgrad(self, egrad: Tangent) -> Tangent:
        dtype = egrad[0].dtype
        return egrad[0] @ self._cast("P", dtype), egrad[1] @ self._cast("Q", dtype)

    def geodesic_acceleration(self, xi: Tangent) -> Tangent:
        dtype = xi[0].dtype
        G, H, P_inv, Q_inv = self._operands(dtype)
        xG, xH = xi
        sG, qG, sH, qH = self._sums(
            _t(xG) @ G + _t(G) @ xG, _t(xG) @ xG, _t(xH) @ H + _t(H) @ xH, _t(xH) @ xH
        )
        aG = xG @ (P_inv @ sG) - G @ (P_inv @ qG)
        aH = xH @ (Q_inv @ sH) - H @ (Q_inv @ qH)
        return aG, aH

    def sample(self, generator: torch.Generator | None = None, rows: Rows | None = None) -> Tangent:
        """``(W G, W' H)`` with standard Gaussian ``W`` (``n x n``) and ``W'`` (``m x m``):
        the rows of ``xiG`` are ``N(0, P)``. With ``eps > 0`` an independent
        ``sqrt(eps) Z`` makes them ``N(0, P + eps I)`` (equivariant up to ``O(eps)``)."""
        G, H = self.G64, self.H64
        xiG, xiH = _gaussian_products(G, H, G, H, generator, **_sharded(self, rows, "gh"))
        if self.eps:
            root = self.eps**0.5
            noise = [
                torch.randn(shape, generator=generator, dtype=G.dtype, device=G.device)
                for shape in _whole_shapes(G, H, rows)
            ]
            if rows is not None:
                if rows.heads is not None:
                    noise = [x[rows.heads] for x in noise]
                noise = [_take_rows(x, r) for x, r in zip(noise, (rows.g, rows.h))]
            xiG, xiH = xiG + root * noise[0], xiH + root * noise[1]
        return xiG, xiH

    def proju(self, xi: Tangent) -> Tangent:
        return _project(self, xi)

    def direction(self, egrad: Tangent) -> Tangent:
        return _direction(self, egrad, "P", "Q")  # rgrad = (gG P, gH Q)

    def accelerate(self, xi: Tangent) -> tuple[Tangent, object]:
        G, H, P_inv, Q_inv = self._operands(xi[0].dtype)
        sides = ((xi[0], G, P_inv), (xi[1], H, Q_inv))
        grams = self._sums(*(g for xx, B, _ in sides for g in (_t(xx) @ B, _t(xx) @ xx)))
        out, saved = [], []
        for (xx, B, B_inv), cross, square in zip(sides, grams[::2], grams[1::2]):
            M, N = B_inv @ _sym(cross), B_inv @ square
            out.append(torch.bmm(xx, M).baddbmm_(B, N, alpha=-1))
            saved.append(M)
        return (out[0], out[1]), tuple(saved)

    def pullback(self, xi: Tangent, u: Tangent, saved: object = None) -> Tangent:
        if saved is None:
            saved = self.accelerate(xi)[1]
        G, H, P_inv, Q_inv = self._operands(u[0].dtype)
        eye = torch.eye(G.shape[-1], dtype=G.dtype, device=G.device)
        sides = ((xi[0], G, P_inv, u[0], saved[0]), (xi[1], H, Q_inv, u[1], saved[1]))
        # a = x M - B N: J^T u = u M^T + B (S^T B^-1 + B^-1 S) - x (T^T B^-1 + B^-1 T),
        # S = x^T u, T = B^T u (B^-1 symmetric).
        sums = self._sums(*(g for xx, B, _, uu, _ in sides for g in (_t(xx) @ uu, _t(B) @ uu)))
        out = []
        for (xx, B, B_inv, uu, M), S, T in zip(sides, sums[::2], sums[1::2]):
            K2, K1 = _sym(B_inv @ S), _sym(B_inv @ T)  # X^T B^-1 + B^-1 X, B^-1 symmetric
            g = torch.bmm(uu, eye + 0.5 * _t(M))
            out.append(g.baddbmm_(B, K2, alpha=0.5).baddbmm_(xx, K1, alpha=-0.5))
        return out[0], out[1]

    def _coefficient(self, A: Tensor, B: Tensor) -> Tensor:
        """:meth:`vertical_coefficient` from ``x_G^T G`` and ``H^T x_H`` (float64)."""
        # C = x_G^T G Q - P H^T x_H; A X + X B' = C solved in the eigenbases, where
        # S^{-1} C T = S^{-1} A (Q T) - S^T B T (S^{-1} P = S^T): P and Q never formed
        return self._solve(self.S_inv @ A @ self._QT() - _t(self.S) @ (B @ self.T))

    def _direction_coefficient(self, gram_g: Tensor, gram_h: Tensor) -> Tensor:
        """The coefficient of ``(gG P, gH Q)`` from ``gG^T G`` and ``H^T gH``: its
        ``S^{-1} C T`` is ``S^T (gG^T G - H^T gH) Q T``."""
        return self._solve(_t(self.S) @ (gram_g - gram_h) @ self._QT())

    def _solve(self, Y: Tensor) -> Tensor:
        """``X^T`` from ``Y = S^{-1} C T``: ``Y_ij / (d_i + e_j)``, ``X = S Y T^{-1}``."""
        denom = self.d.unsqueeze(-1) + self.e.unsqueeze(-2)
        tol = denom.shape[-1] * torch.finfo(_F64).eps * denom.amax((-1, -2), keepdim=True)
        Y = torch.where(denom > tol, Y / torch.where(denom > tol, denom, 1.0), 0.0)
        return _t(self.S @ Y @ self.T_inv)


@dataclass(frozen=True)
class InvMetric(PairMetric):
    """``g = tr(P^{-1} xiG^T etaG) + tr(Q^{-1} xiH^T etaH)``: scale-free, like adaptive
    sharpness. ``eps > 0`` uses ``P + eps I``, ``Q + eps I`` for nearly rank-deficient
    pairs (then invariance holds only up to ``O(eps)``)."""

    eps: float = 0.0
    name: str = "inv"

    def state(self, G: Tensor, H: Tensor, reduce: Reduce | None = None) -> InvState:
        G, H = G.detach(), H.detach()
        G64, H64 = G.to(_F64), H.to(_F64)
        P, Q = _gram(G64, self.eps, reduce), _gram(H64, self.eps, reduce)
        _, P_sqrt, P_isqrt, _ = _spd_functions(P)
        _, Q_sqrt, Q_isqrt, _ = _spd_functions(Q)
        # A = P (H^T H) = S D S^{-1}: P^{1/2} (H^T H) P^{1/2} = U D U^T, S = P^{1/2} U.
        d, U = torch.linalg.eigh(P_sqrt @ (Q if not self.eps else _gram(H64, 0.0, reduce)) @ P_sqrt)
        S, S_inv = P_sqrt @ U, _t(U) @ P_isqrt
        if self.eps:
            # B = (G^T G) Q = T E T^{-1}: Q^{1/2} (G^T G) Q^{1/2} = W E W^T, T = Q^{-1/2} W.
            e, W = torch.linalg.eigh(Q_sqrt @ _gram(G64, 0.0, reduce) @ Q_sqrt)
            T, T_inv = Q_isqrt @ W, _t(W) @ Q_sqrt
        else:
            e, T, T_inv = d, S, S_inv
        return InvState(
            G,
            H,
            None,
            None,
            None,
            None,
            S=S,
            S_inv=S_inv,
            d=d,
            T=T,
            T_inv=T_inv,
            e=e,
            eps=self.eps,
            reduce=reduce,
        )


# --- mix ------------------------------------------------------------------------------


@dataclass
class MixState(PairState):
    """Holds ``P^{-1}, Q^{-1}`` (float64); ``P, Q`` are made where used, by inversion."""

    def _derive(self, name: str) -> Tensor:
        return torch.linalg.inv(self.P_inv if name == "P" else self.Q_inv)

    def _direction_coefficient(self, gram_g: Tensor, gram_h: Tensor) -> Tensor:
        """The coefficient of ``(gG Q^{-1}, gH P^{-1})`` from ``gG^T G`` and ``H^T gH``."""
        return self._coefficient(self.Q_inv @ gram_g, gram_h @ self.P_inv)

    def inner(self, xi: Tangent, eta: Tangent) -> Tensor:
        x, y = _f64(xi), _f64(eta)
        return self._sum(
            ((x[0] @ self.Q) * y[0]).sum((-1, -2)) + ((x[1] @ self.P) * y[1]).sum((-1, -2))
        )

    def horizontal_residual(self, xi: Tangent) -> Tensor:
        x = _f64(xi)
        A, B = self._sums(_t(x[0]) @ self.G64, _t(self.H64) @ x[1])
        return self.Q @ A - B @ self.P

    def vertical_coefficient(self, xi: Tangent) -> Tensor:
        x = _f64(xi)
        A, B = self._sums(_t(self.G64) @ x[0], _t(x[1]) @ self.H64)
        return 0.5 * (self.P_inv @ A - B @ self.Q_inv)

    def egrad2rgrad(self, egrad: Tangent) -> Tangent:
        dtype = egrad[0].dtype
        return egrad[0] @ self._cast("Q_inv", dtype), egrad[1] @ self._cast("P_inv", dtype)

    def geodesic_acceleration(self, xi: Tangent) -> Tangent:
        dtype = xi[0].dtype
        G, H, P_inv, Q_inv = self._operands(dtype)
        xG, xH = xi
        qH, sH, qG, sG = self._sums(
            _t(xH) @ xH, _t(xH) @ H + _t(H) @ xH, _t(xG) @ xG, _t(xG) @ G + _t(G) @ xG
        )
        aG = (G @ qH - xG @ sH) @ Q_inv
        aH = (H @ qG - xH @ sG) @ P_inv
        return aG, aH

    def sample(self, generator: torch.Generator | None = None, rows: Rows | None = None) -> Tangent:
        """``(W H Q^{-1}, W' G P^{-1})``: rows ``N(0, Q^{-1})`` and ``N(0, P^{-1})``."""
        G, H = self.G64, self.H64
        return _gaussian_products(
            G, H, H @ self.Q_inv, G @ self.P_inv, generator, **_sharded(self, rows, "hg")
        )

    def proju(self, xi: Tangent) -> Tangent:
        return _project(self, xi)

    def direction(self, egrad: Tangent) -> Tangent:
        return _direction(self, egrad, "Q_inv", "P_inv")  # rgrad = (gG Q^-1, gH P^-1)

    def accelerate(self, xi: Tangent) -> tuple[Tangent, object]:
        G, H, P_inv, Q_inv = self._operands(xi[0].dtype)
        xG, xH = xi
        hH, qH, gG, qG = self._sums(_t(xH) @ H, _t(xH) @ xH, _t(xG) @ G, _t(xG) @ xG)
        Bm, D = _sym(hH), _sym(gG)  # xH^T H + H^T xH, xG^T G + G^T xG
        aG = torch.bmm(G, qH @ Q_inv).baddbmm_(xG, Bm @ Q_inv, alpha=-1)
        aH = torch.bmm(H, qG @ P_inv).baddbmm_(xH, D @ P_inv, alpha=-1)
        return (aG, aH), (Bm, D)

    def pullback(self, xi: Tangent, u: Tangent, saved: object = None) -> Tangent:
        if saved is None:
            saved = self.accelerate(xi)[1]
        G, H, P_inv, Q_inv = self._operands(u[0].dtype)
        eye = torch.eye(G.shape[-1], dtype=G.dtype, device=G.device)
        (xG, xH), (uG, uH), (Bm, D) = xi, u, saved
        # aG = (G A - xG Bm) Q^-1, aH = (H C - xH D) P^-1 (A = xH^T xH, C = xG^T xG): with
        # E = G^T uG Q^-1, F = xG^T uG Q^-1, E' = H^T uH P^-1, F' = xH^T uH P^-1,
        # J^T u = (-uG Q^-1 Bm + xG sym(E') - G sym(F'), -uH P^-1 D + xH sym(E) - H sym(F)).
        sums = self._sums(_t(G) @ uG, _t(xG) @ uG, _t(H) @ uH, _t(xH) @ uH)
        E, F = sums[0] @ Q_inv, sums[1] @ Q_inv
        E2, F2 = sums[2] @ P_inv, sums[3] @ P_inv
        gG = torch.bmm(uG, eye - 0.5 * (Q_inv @ Bm))
        gG.baddbmm_(xG, _sym(E2), alpha=0.5).baddbmm_(G, _sym(F2), alpha=-0.5)
        gH = torch.bmm(uH, eye - 0.5 * (P_inv @ D))
        gH.baddbmm_(xH, _sym(E), alpha=0.5).baddbmm_(H, _sym(F), alpha=-0.5)
        return gG, gH

    def _coefficient(self, A: Tensor, B: Tensor) -> Tensor:
        """:meth:`vertical_coefficient` from ``x_G^T G`` and ``H^T x_H`` (float64)."""
        return 0.5 * (self.P_inv @ _t(A) - _t(B) @ self.Q_inv)


@dataclass(frozen=True)
class MixMetric(PairMetric):
    """``g = tr(Q xiG^T etaG) + tr(P xiH^T etaH)``: ``||xi||^2 = ||xiG H^T||^2 +
    ||G xiH^T||^2``, an absolute change of ``W = G H^T`` (choose ``rho`` accordingly)."""

    name: str = "mix"

    def state(self, G: Tensor, H: Tensor, reduce: Reduce | None = None) -> MixState:
        G, H = G.detach(), H.detach()
        P, Q = _gram(G.to(_F64), 0.0, reduce), _gram(H.to(_F64), 0.0, reduce)
        P_inv = _spd_functions(P)[0]
        Q_inv = _spd_functions(Q)[0]
        return MixState(G, H, None, None, P_inv, Q_inv, reduce=reduce)


def get_metric(name: str | PairMetric, eps: float = 0.0) -> PairMetric:
    """``"inv"`` (with ``eps``), ``"mix"``, or a :class:`PairMetric` of your own."""
    if isinstance(name, PairMetric):
        if eps:
            raise ValueError("eps is for the built-in 'inv' metric; set it in your metric")
        return name
    if name == "inv":
        return InvMetric(eps=eps)
    if name == "mix":
        if eps:
            raise ValueError("eps applies to the 'inv' metric only; 'mix' needs no relaxation")
        return MixMetric()
    raise ValueError(f"unknown metric {name!r}: use 'inv' or 'mix'")


def _gram(X: Tensor, eps: float, reduce: Reduce | None = None) -> Tensor:
    gram = _t(X) @ X
    if reduce is not None:
        gram = reduce(gram)
    if eps:
        gram = gram + eps * torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    return gram


def _whole(state: PairState, what: str) -> None:
    if state.reduce is not None:
        raise NotImplementedError(f"{what} needs whole pairs: it mixes rows across shards")


def _f64(xi: Tangent) -> Tangent:
    return xi[0].to(_F64), xi[1].to(_F64)


def _sym(x: Tensor) -> Tensor:
    return x + _t(x)


def _project(state: InvState | MixState, x: Tangent) -> Tangent:
    """``project_horizontal(x)`` fused: the two h x h reductions ``x_G^T G``, ``H^T x_H``
    in ``x``'s dtype, the coefficient in float64, and the correction ``(x_G - G L,
    x_H + H L^T)`` as one ``baddbmm`` each."""
    dt = x[0].dtype
    G, H = state._cast("G", dt), state._cast("H", dt)
    L = state._coefficient(*state._sums((_t(x[0]) @ G).double(), (_t(H) @ x[1]).double())).to(dt)
    return torch.baddbmm(x[0], G, L, alpha=-1), torch.baddbmm(x[1], H, _t(L))


def _direction(state: InvState | MixState, egrad: Tangent, left: str, right: str) -> Tangent:
    """``project_horizontal(egrad2rgrad(egrad))`` fused, for a Riemannian gradient
    ``(gG A, gH B)`` with the symmetric ``A, B`` named ``left, right``: its two h x h
    reductions are those of ``egrad`` times ``A, B``, so it is never formed before the
    projection."""
    dt = egrad[0].dtype
    G, H = state._cast("G", dt), state._cast("H", dt)
    gram_g, gram_h = state._sums((_t(egrad[0]) @ G).double(), (_t(H) @ egrad[1]).double())
    L = state._direction_coefficient(gram_g, gram_h).to(dt)
    A, B = state._cast(left, dt), state._cast(right, dt)
    return (
        torch.bmm(egrad[0], A).baddbmm_(G, L, alpha=-1),
        torch.bmm(egrad[1], B).baddbmm_(H, _t(L)),
    )


@dataclass(frozen=True)
class Rows:
    """The rows of a stack of pairs held by this process: ``g`` ``(B, n_local)`` and
    ``h`` ``(B, m_local)`` global row numbers (``-1``: a zero phantom row), of ``n``
    and ``m`` rows in all; ``heads`` ``(B,)``: which of the stack's ``count`` heads
    they are (``None``: all, in order); ``total`` sums a tensor over the processes
    (``None``: the state's ``reduce``)."""

    g: Tensor
    h: Tensor
    n: int
    m: int
    heads: Tensor | None = None
    count: int | None = None
    total: Reduce | None = None


def _whole_shapes(G: Tensor, H: Tensor, rows: Rows | None) -> tuple[tuple, tuple]:
    if rows is None:
        return tuple(G.shape), tuple(H.shape)
    count = G.shape[0] if rows.count is None else rows.count
    return (count, rows.n, G.shape[2]), (count, rows.m, H.shape[2])


def _take_rows(x: Tensor, rows: Tensor) -> Tensor:
    """``x[b, rows[b]]`` per head ``b``, zero on phantom rows (``-1``)."""
    out = torch.gather(x, 1, rows.clamp_min(0)[..., None].expand(-1, -1, x.shape[-1]))
    return out.masked_fill_((rows < 0)[..., None], 0)


def _sharded(state: PairState, rows: Rows | None, factors: str) -> dict:
    """The keywords of :func:`_gaussian_products` on row shards: the global row counts,
    the global rows of the two factors (``factors``: which side each factor's rows come
    from) and of the output, and the sum over processes."""
    if state.reduce is None:
        return {}
    if rows is None:
        _whole(state, "sample")
    side = {"g": (rows.g, rows.n), "h": (rows.h, rows.m)}
    return {
        "shards": (
            (rows.n, rows.m),
            (side[factors[0]], side[factors[1]]),
            (rows.g, rows.h),
            state.reduce if rows.total is None else rows.total,
            (rows.heads, rows.count),
        )
    }


def _gaussian_products(
    G: Tensor,
    H: Tensor,
    g_factor: Tensor,
    h_factor: Tensor,
    generator,
    chunk: int = 1 << 22,
    shards: tuple | None = None,
) -> Tangent:
    """``(W g_factor, W' h_factor)`` with standard Gaussian ``W`` (``n x n``), ``W'``
    (``m x m``), drawn head by head in chunks of at most ``chunk`` numbers.

    ``shards``: the factors hold some rows of the whole pair's, of some of its heads
    (see :func:`_sharded`); ``W`` is drawn whole for every head of the stack, each
    process multiplies the columns of its factor rows, the products are summed over
    processes and the rows held here kept: the same numbers as the whole pair's."""
    if shards is not None:
        return _sharded_products(G, g_factor, h_factor, generator, chunk, shards)
    heads, n, m = G.shape[0], G.shape[1], H.shape[1]
    step = max(1, chunk // max(n * g_factor.shape[1], m * h_factor.shape[1]))
    parts: list[list[Tensor]] = [[], []]
    for start in range(0, heads, step):
        sl = slice(start, start + step)
        count = g_factor[sl].shape[0]
        for i, (size, factor) in enumerate(((n, g_factor), (m, h_factor))):
            W = torch.randn(
                count, size, factor.shape[1], generator=generator, dtype=G.dtype, device=G.device
            )
            parts[i].append(W @ factor[sl])
    return torch.cat(parts[0]), torch.cat(parts[1])


def _sharded_products(G: Tensor, g_factor, h_factor, generator, chunk: int, shards) -> Tangent:
    """:func:`_gaussian_products` on row shards: the heads of the stack drawn in the same
    chunks on every process, each process's factor rows (of the heads it holds, zero
    for the others) multiplied in, summed over processes."""
    (n, m), ((f_g, k_g), (f_h, k_h)), out_rows, total, (heads, count) = shards
    if heads is None:
        heads = torch.arange(G.shape[0], device=G.device)
        count = G.shape[0]
    step = max(1, chunk // max(n * k_g, m * k_h))
    parts: list[list[Tensor]] = [[], []]
    for start in range(0, count, step):
        stop = min(start + step, count)
        here = ((heads >= start) & (heads < stop)).nonzero().reshape(-1)  # local heads
        at = heads[here] - start  # their places in the chunk
        for i, (size, k, factor) in enumerate(((n, k_g, g_factor), (m, k_h, h_factor))):
            W = torch.randn(
                stop - start, size, k, generator=generator, dtype=G.dtype, device=G.device
            )
            held = factor.new_zeros((stop - start, *factor.shape[1:]))
            held[at] = factor[here]
            cols = torch.zeros((stop - start, factor.shape[1]), dtype=torch.long, device=G.device)
            cols[at] = (f_g, f_h)[i][here].clamp_min(0)  # phantom rows of a factor are zero
            W = torch.gather(W, 2, cols[:, None, :].expand(-1, size, -1))
            parts[i].append(_take_rows(total(W @ held)[at], out_rows[i][here]))
    return torch.cat(parts[0]), torch.cat(parts[1])
