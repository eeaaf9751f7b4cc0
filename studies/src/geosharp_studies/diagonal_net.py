r"""Diagonal linear networks ``f(x) = <u * v, x>`` and their closed-form sharpness.

Each coordinate ``(u_j, v_j)`` is a ``GL(1)`` pair: ``(u_j, v_j) -> (a u_j, v_j / a)``
leaves ``beta = u * v`` and the network unchanged. :class:`DiagonalNet` registers a
handler so that :func:`geosharp.find_symmetries` returns these ``d`` pairs (one
:class:`~geosharp.symmetry.PairSpec` with ``d`` heads of shape ``1 x 1``), and the
general Auto-PGD code of :func:`geosharp.sharpness` measures the network like any other.

For the squared loss ``L(beta) = 1/(2n) ||X beta - y||^2`` the worst-case sharpness has
reduced forms (MATH.md sections 5 and 7) that this module evaluates independently of
the general machinery, to cross-check it:

* ``inv`` metric, exact exponential geodesic ``beta exp(2 w)``:
  ``S = max_{||w|| <= rho / sqrt 2} L(beta0 exp(2 w)) - L(beta0)``
  (:func:`geodesic_sharpness_inv`);
* ``mix`` metric, straight line in ``beta``:
  ``S = max_{||d|| <= sqrt(2) rho} L(beta0 + d) - L(beta0)``, a trust-region problem solved
  exactly (:func:`trust_region_max`, :func:`geodesic_sharpness_mix`); the true geodesic ball
  keeps the signs of ``beta`` (the geodesic ends where a coordinate reaches 0), which
  ``sign_preserving=True`` imposes;
* adaptive: ``max_{||eps|| <= rho} L((u + |u| eps_u) (v + |v| eps_v)) - L(beta0)``
  (:func:`adaptive_sharpness_diagonal`).

The non-quadratic problems (``inv``, adaptive, sign-preserving ``mix``) are maximised by
projected gradient ascent on the Euclidean ball of the reduced variable, started from
the exact trust-region solution of their quadratic model and from random points; the
reduced problems are small (``d`` or ``2 d`` unknowns) and smooth, so this is cheap and
reliable, and it shares no code with :mod:`geosharp.measures`.

>>> import torch
>>> net = DiagonalNet(3, u=torch.tensor([1.0, 2.0, 3.0]), v=torch.tensor([1.0, 0.5, -1.0]))
>>> net.beta.tolist()
[1.0, 1.0, -3.0]
>>> import geosharp
>>> [(p.kind, p.shape) for p in geosharp.find_symmetries(net).pairs]  # (heads, n, m, h)
[('rescaling', (3, 1, 1, 1))]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from geosharp.symmetry.pairs import Block, PairSpec, positions
from geosharp.symmetry.registry import NameOf, register_handler

__all__ = [
    "DiagonalNet",
    "adaptive_sharpness_diagonal",
    "diagonal_pairs",
    "geodesic_sharpness_inv",
    "geodesic_sharpness_mix",
    "maximize_on_ball",
    "quadratic_terms",
    "squared_loss",
    "trust_region_max",
]


class DiagonalNet(nn.Module):
    """``f(x) = <u * v, x>`` with parameters ``u``, ``v`` of shape ``(d,)`` (float64 by
    default). ``x`` is ``(..., d)``; the output is ``(...)``."""

    def __init__(
        self,
        d: int,
        u: Tensor | None = None,
        v: Tensor | None = None,
        dtype: torch.dtype = torch.float64,
    ):
        super().__init__()
        u = torch.ones(d, dtype=dtype) if u is None else torch.as_tensor(u, dtype=dtype)
        v = torch.zeros(d, dtype=dtype) if v is None else torch.as_tensor(v, dtype=dtype)
        if u.shape != (d,) or v.shape != (d,):
            raise ValueError(
                f"u and v must have shape ({d},), got {tuple(u.shape)}, {tuple(v.shape)}"
            )
        self.d = d
        self.u = nn.Parameter(u.clone())
        self.v = nn.Parameter(v.clone())

    @property
    def beta(self) -> Tensor:
        """The linear predictor ``u * v`` (detached)."""
        return (self.u * self.v).detach()

    def forward(self, x: Tensor) -> Tensor:
        return x @ (self.u * self.v)

    def extra_repr(self) -> str:
        return f"d={self.d}"


def diagonal_pairs(module: nn.Module, prefix: str, name_of: NameOf) -> list[PairSpec]:
    """Handler: coordinate ``j`` of ``(u, v)`` is the ``GL(1)`` pair ``G = [[u_j]]``,
    ``H = [[v_j]]`` (head ``j``)."""
    assert isinstance(module, DiagonalNet)
    d = module.d
    return [
        PairSpec(
            prefix,
            "rescaling",
            (Block(name_of(module.u), positions(module.u).view(d, 1, 1)),),
            (Block(name_of(module.v), positions(module.v).view(d, 1, 1)),),
        )
    ]


register_handler(DiagonalNet, diagonal_pairs)


def squared_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    """``1/(2n) ||model(X) - y||^2`` for a batch ``(X, y)``: the loss of this module's
    closed forms, in the ``loss_fn(model, batch)`` form of :func:`geosharp.sharpness`."""
    X, y = batch
    return 0.5 * (model(X) - y).pow(2).mean()


# --- closed forms (numpy, float64) ------------------------------------------------------


def _np(x) -> np.ndarray:
    if isinstance(x, Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def quadratic_terms(X, y, beta) -> tuple[float, np.ndarray, np.ndarray]:
    """``L(beta)``, its gradient ``X^T (X beta - y) / n`` and Hessian ``X^T X / n``."""
    X, y, beta = _np(X), _np(y), _np(beta)
    n = X.shape[0]
    r = X @ beta - y
    return float(r @ r) / (2 * n), X.T @ r / n, X.T @ X / n


def trust_region_max(A, g, radius: float) -> tuple[float, np.ndarray]:
    """Exact ``max_{||d|| <= radius} g^T d + 1/2 d^T A d`` for a symmetric ``A``.

    The maximiser satisfies ``(lam I - A) d = g`` with ``lam >= max(lambda_max(A), 0)``
    and ``lam (radius - ||d||) = 0``. In the eigenbasis of ``A`` the norm
    ``||d(lam)||`` is decreasing in ``lam``, so the scalar secular equation
    ``||d(lam)|| = radius`` is solved by bisection to machine precision; when the
    gradient has (almost) no component on the top eigenspace ("hard case") the
    remainder of the radius goes along the top eigenvector. Returns the value and ``d``.

    >>> A = np.diag([2.0, 1.0]); g = np.zeros(2)
    >>> value, d = trust_region_max(A, g, 0.5)
    >>> round(value, 12), np.abs(d).round(12).tolist()  # 1/2 * 2 * 0.5^2
    (0.25, [0.5, 0.0])
    """
    A, g = _np(A), _np(g)
    if radius <= 0:
        return 0.0, np.zeros_like(g)
    a, V = np.linalg.eigh(0.5 * (A + A.T))
    c = V.T @ g
    a_max = a[-1]
    scale = max(np.abs(a).max(), 1e-300)

    def step(lam: float) -> np.ndarray:
        return c / (lam - a)

    # Interior solution: A negative definite and the unconstrained maximiser inside.
    if a_max < 0:
        d_in = step(0.0)
        if np.linalg.norm(d_in) <= radius:
            d = V @ d_in
            return float(g @ d + 0.5 * d @ A @ d), d
    lo = max(a_max, 0.0)
    top = a >= a_max - 1e-12 * scale
    c_norm = np.linalg.norm(c)
    hard = lo == a_max and (
        np.linalg.norm(c[top]) <= 1e-14 * max(c_norm, 1e-300) or c_norm <= 1e-14 * scale * radius
    )
    if hard:
        # ||d(lam)|| as lam -> a_max+ stays below the radius (or the gradient is at
        # round-off): fill up along the top eigenvector, on the gradient's side.
        d_eig = np.where(top, 0.0, c / np.where(top, 1.0, lo - a))
        norm_rest = np.linalg.norm(d_eig)
        if norm_rest <= radius:
            k = int(np.flatnonzero(top)[-1])
            d_eig[k] = (1.0 if c[k] >= 0 else -1.0) * np.sqrt(radius**2 - norm_rest**2)
            d = V @ d_eig
            return float(g @ d + 0.5 * d @ A @ d), d
    hi = lo + c_norm / radius
    lo_b = lo
    for _ in range(200):
        mid = 0.5 * (lo_b + hi)
        if mid <= lo_b or mid >= hi:
            break
        if np.linalg.norm(step(mid)) > radius:
            lo_b = mid
        else:
            hi = mid
    d = V @ step(hi)
    return float(g @ d + 0.5 * d @ A @ d), d


def maximize_on_ball(
    fun: Callable[[np.ndarray], tuple[float, np.ndarray]],
    starts: Sequence[np.ndarray],
    radius: float,
    n_iters: int = 300,
    project: Callable[[np.ndarray], np.ndarray] | None = None,
    tol: float = 1e-13,
) -> tuple[float, np.ndarray]:
    """Projected gradient ascent of ``fun`` (returning value and gradient) over the
    Euclidean ball of ``radius`` (or the convex set of ``project``), from each start;
    monotone, with a step that doubles after a success and shrinks to a quarter after a
    failure; stops when a step gains less than ``tol`` (relative).
    Returns the best value and point."""
    if project is None:

        def project(x: np.ndarray) -> np.ndarray:
            norm = np.linalg.norm(x)
            return x if norm <= radius else x * (radius / norm)

    best_value, best_x = -np.inf, None
    for start in starts:
        x = project(np.asarray(start, dtype=np.float64))
        value, grad = fun(x)
        t = radius / max(np.linalg.norm(grad), 1e-300)
        for _ in range(n_iters):
            x_new = project(x + t * grad)
            new_value, new_grad = fun(x_new)
            if new_value > value:
                gain = new_value - value
                x, value, grad = x_new, new_value, new_grad
                t *= 2.0
                if gain <= tol * max(abs(value), 1e-300):
                    break
            else:
                t *= 0.25
                if t * np.linalg.norm(grad) < 1e-12 * radius:
                    break
        if value > best_value:
            best_value, best_x = value, x
    return float(best_value), best_x


def _random_starts(dim: int, radius: float, count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        z = rng.standard_normal(dim)
        out.append(z * radius / np.linalg.norm(z))
    return out


def geodesic_sharpness_inv(
    X, y, beta, rho: float, n_random: int = 4, n_iters: int = 300, seed: int = 0
) -> float:
    """Worst-case geodesic sharpness for the ``inv`` metric with the exact geodesic:
    ``max_{||w|| <= rho/sqrt(2)} L(beta exp(2 w)) - L(beta)``.

    Along a horizontal ``xi = (u w, v w)`` the exact geodesic is ``u exp(w t)``,
    ``v exp(w t)`` and ``||xi||_inv^2 = 2 ||w||^2`` (MATH.md section 5). Started from the
    exact maximiser of the quadratic model ``L + 2 g^T(beta w) + 2 (beta w)^T A (beta w)``
    (both signs) and ``n_random`` random points.
    """
    X, y, beta = _np(X), _np(y), _np(beta)
    n = X.shape[0]
    loss0, g, A = quadratic_terms(X, y, beta)
    radius = rho / np.sqrt(2.0)

    def fun(w: np.ndarray) -> tuple[float, np.ndarray]:
        b = beta * np.exp(2.0 * w)
        r = X @ b - y
        return float(r @ r) / (2 * n) - loss0, 2.0 * b * (X.T @ r) / n

    _, w_q = trust_region_max(4.0 * beta[:, None] * A * beta[None, :], 2.0 * beta * g, radius)
    starts = [w_q, -w_q, *_random_starts(len(beta), radius, n_random, seed)]
    return maximize_on_ball(fun, starts, radius, n_iters)[0]


def geodesic_sharpness_mix(
    X,
    y,
    beta,
    rho: float,
    sign_preserving: bool = False,
    n_random: int = 4,
    n_iters: int = 300,
    seed: int = 0,
) -> float:
    """Worst-case geodesic sharpness for the ``mix`` metric: the quotient geodesic is the
    straight line ``beta + t dbeta`` with ``||xi||_mix^2 = ||dbeta||^2 / 2``, so
    ``S = max_{||d|| <= sqrt(2) rho} L(beta + d) - L(beta)``.

    ``sign_preserving=False``: the exact trust-region solution (valid while no
    coordinate of ``beta + d`` crosses zero). ``sign_preserving=True``: the true geodesic
    ball, whose geodesics end where a coordinate reaches 0, i.e. the extra constraints
    ``sign(beta_j) (beta_j + d_j) >= 0`` (a convex set; maximised by projected ascent
    from the trust-region solution, its sign-clipped version and random points).
    """
    X, y, beta = _np(X), _np(y), _np(beta)
    _, g, A = quadratic_terms(X, y, beta)
    radius = np.sqrt(2.0) * rho
    value, d = trust_region_max(A, g, radius)
    if not sign_preserving:
        return value
    s = np.sign(beta)
    lower = -np.abs(beta)  # s * d >= -|beta|
    project = _ball_halfspace_projection(s, lower, radius)

    def fun(x: np.ndarray) -> tuple[float, np.ndarray]:
        return float(g @ x + 0.5 * x @ A @ x), g + A @ x

    starts = [d, -d, *_random_starts(len(beta), radius, n_random, seed)]
    return maximize_on_ball(fun, starts, radius, n_iters, project=project)[0]


def _ball_halfspace_projection(
    s: np.ndarray, lower: np.ndarray, radius: float
) -> Callable[[np.ndarray], np.ndarray]:
    """Euclidean projection onto ``{||x|| <= radius, s_j x_j >= lower_j}`` (``lower <= 0``).

    In the flipped coordinates ``x' = s x`` the KKT point is ``x'_j = max(t z'_j, l_j)``
    with ``t = 1 / (1 + mu)`` in ``(0, 1]``: ``t = 1`` if that point is inside the ball,
    else the ``t`` at which its norm equals the radius. The norm grows with ``t`` and a
    coordinate with ``z'_j < 0`` is clipped once ``t > l_j / z'_j``; between consecutive
    breakpoints the squared norm is ``t^2 S + C``, so sorting the breakpoints gives ``t``
    exactly (``O(d log d)``).
    """
    s = np.where(s == 0, 1.0, s)
    low = np.minimum(lower, 0.0)

    def project(z: np.ndarray) -> np.ndarray:
        zp = s * z
        x = np.maximum(zp, low)
        if x @ x <= radius * radius:
            return s * x
        neg = zp < 0
        # Breakpoints t_j = l_j / z'_j (0 where l_j = 0: clipped at once; inf if z'_j >= 0).
        tb = np.full(zp.shape, np.inf)
        tb[neg] = low[neg] / zp[neg]
        order = np.argsort(tb)
        tb_s, z2, l2 = tb[order], zp[order] ** 2, low[order] ** 2
        # With the first k (sorted) coordinates clipped: S_k = sum of the others' z'^2,
        # C_k = sum of the first k l^2; norm^2(t) = t^2 S_k + C_k on [t_k, t_{k+1}).
        S = z2.sum() - np.concatenate([[0.0], np.cumsum(z2)])
        C = np.concatenate([[0.0], np.cumsum(l2)])
        bounds = np.concatenate([[0.0], tb_s])  # interval k starts at bounds[k]
        finite = np.isfinite(bounds)
        at_start = np.where(finite, np.where(finite, bounds, 0.0) ** 2 * S + C, np.inf)
        k = int(np.searchsorted(at_start, radius * radius, side="right") - 1)
        k = max(k, 0)
        t = np.sqrt(max(radius * radius - C[k], 0.0) / S[k]) if S[k] > 0 else 1.0
        t = min(t, 1.0)
        return s * np.maximum(t * zp, low)

    return project


def adaptive_sharpness_diagonal(
    X, y, u, v, rho: float, n_random: int = 4, n_iters: int = 300, seed: int = 0
) -> float:
    """Worst-case adaptive (L2) sharpness of a diagonal net, straight-line perturbation
    ``theta + |theta| eps``, ``||eps|| <= rho``:
    ``max L((u + |u| eps_u)(v + |v| eps_v)) - L(u v)``.

    Started from the exact maximiser of the quadratic model in which ``u`` and ``v`` move
    in step (``eps_u = sign(u) a``, ``eps_v = sign(v) a``, ``||a|| = rho / sqrt 2``; then
    ``beta -> beta (1 + a)^2``), both signs, and random points.
    """
    X, y, u, v = _np(X), _np(y), _np(u), _np(v)
    n, d = X.shape
    beta = u * v
    loss0, g, A = quadratic_terms(X, y, beta)
    au, av = np.abs(u), np.abs(v)

    def fun(e: np.ndarray) -> tuple[float, np.ndarray]:
        pu, pv = u + au * e[:d], v + av * e[d:]
        r = X @ (pu * pv) - y
        gb = X.T @ r / n
        return float(r @ r) / (2 * n) - loss0, np.concatenate([gb * pv * au, gb * pu * av])

    radius = rho
    _, a = trust_region_max(
        4.0 * beta[:, None] * A * beta[None, :], 2.0 * beta * g, radius / np.sqrt(2.0)
    )
    start = np.concatenate([np.sign(u) * a, np.sign(v) * a])
    starts = [start, -start, *_random_starts(2 * d, radius, n_random, seed)]
    return maximize_on_ball(fun, starts, radius, n_iters)[0]
