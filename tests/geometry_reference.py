r"""Float64 reference geometry of one ``GL(h)`` pair, written from the definitions.

Nothing here calls geosharp. A pair ``(G, H)`` (``n x h``, ``m x h``) is flattened
row-major to ``theta = [vec(G); vec(H)]`` of size ``D = (n + m) h``; so is a tangent.
The metric is evaluated literally from MATH.md section 2 (traces, explicit inverses),

    inv:  g(xi, eta) = tr((P + eps I)^{-1} xiG^T etaG) + tr((Q + eps I)^{-1} xiH^T etaH)
    mix:  g(xi, eta) = tr(Q xiG^T etaG) + tr(P xiH^T etaH),

and everything else is derived generically from the dense metric matrix
``M_ij = g(e_i, e_j)``: Christoffel symbols by automatic differentiation, geodesics by
RK4, horizontal projections from the vertical basis ``V(E_ab) = (G E_ab, -H E_ab^T)``.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.func import grad, jacfwd, jvp, vmap

F64 = torch.float64
Dims = tuple[int, int, int]  # (n, m, h)


# --- flattening ---------------------------------------------------------------------------


def flatten(G: Tensor, H: Tensor) -> Tensor:
    """``[vec(G); vec(H)]`` (row-major)."""
    return torch.cat([G.reshape(-1), H.reshape(-1)])


def unflatten(x: Tensor, dims: Dims) -> tuple[Tensor, Tensor]:
    n, m, h = dims
    return x[: n * h].reshape(n, h), x[n * h :].reshape(m, h)


# --- metric -------------------------------------------------------------------------------


def pair_metric(
    name: str,
    G: Tensor,
    H: Tensor,
    xi: tuple[Tensor, Tensor],
    eta: tuple[Tensor, Tensor],
    eps: float = 0.0,
) -> Tensor:
    """``g(xi, eta)`` at one pair ``(G, H)``, literally from the definition; ``xi`` and
    ``eta`` may carry (broadcastable) leading batch dimensions. ``tr(A X^T Y)`` is
    written ``sum_{c,d,i} A_cd X_id Y_ic``."""
    P, Q = G.T @ G, H.T @ H
    if name == "inv":
        eye = torch.eye(G.shape[1], dtype=G.dtype)
        A, B = torch.linalg.inv(P + eps * eye), torch.linalg.inv(Q + eps * eye)
    elif name == "mix":
        A, B = Q, P
    else:
        raise ValueError(name)
    return torch.einsum("cd,...id,...ic->...", A, xi[0], eta[0]) + torch.einsum(
        "cd,...id,...ic->...", B, xi[1], eta[1]
    )


def metric_matrix(name: str, theta: Tensor, dims: Dims, eps: float = 0.0) -> Tensor:
    """Dense ``M(theta)`` with ``M_ab = g(e_a, e_b)`` (the definition on basis vectors)."""
    G, H = unflatten(theta, dims)
    n, m, h = dims
    basis = torch.eye(theta.numel(), dtype=theta.dtype)
    XG, XH = basis[:, : n * h].reshape(-1, n, h), basis[:, n * h :].reshape(-1, m, h)
    return pair_metric(name, G, H, (XG[:, None], XH[:, None]), (XG[None], XH[None]), eps)


def christoffel(name: str, theta: Tensor, dims: Dims, eps: float = 0.0) -> Tensor:
    r"""``Gamma[k, i, j] = 1/2 M^{-1}_{kl} (d_i M_jl + d_j M_il - d_l M_ij)``, by autograd."""
    M = metric_matrix(name, theta, dims, eps)
    dM = jacfwd(lambda t: metric_matrix(name, t, dims, eps))(theta)  # dM[a, b, c] = d_c M_ab
    first = dM.permute(2, 0, 1)  # first[i, j, l] = d_i M_jl
    lowered = first + first.transpose(0, 1) - dM  # d_i M_jl + d_j M_il - d_l M_ij
    return 0.5 * torch.einsum("kl,ijl->kij", torch.linalg.inv(M), lowered)


def geodesic_acceleration(name: str, theta: Tensor, v: Tensor, dims: Dims, eps=0.0) -> Tensor:
    """``-Gamma(v, v)`` from the full Christoffel tensor."""
    return -torch.einsum("kij,i,j->k", christoffel(name, theta, dims, eps), v, v)


def geodesic_acceleration_el(
    name: str, theta: Tensor, v: Tensor, dims: Dims, eps: float = 0.0
) -> Tensor:
    """``-Gamma(v, v)`` from the Euler-Lagrange equation of ``E = 1/2 v^T M(theta) v``:
    ``M a = 1/2 grad_theta(v^T M v) - (D_v M) v`` (cheaper than the full tensor)."""

    def energy(t):
        return v @ metric_matrix(name, t, dims, eps) @ v

    M, dM_v = jvp(lambda t: metric_matrix(name, t, dims, eps), (theta,), (v,))
    return torch.linalg.solve(M, 0.5 * grad(energy)(theta) - dM_v @ v)


def rk4_geodesic(
    name: str,
    theta: Tensor,
    v: Tensor,
    dims: Dims,
    times: list[float],
    steps: int,
    eps: float = 0.0,
) -> list[tuple[Tensor, Tensor]]:
    """Integrate ``theta'' = -Gamma(theta', theta')`` by classical RK4 from ``t = 0``,
    ``steps`` equal steps between consecutive ``times``; ``theta`` and ``v`` are batches
    ``(K, D)`` of starts. Returns ``(theta(t), theta'(t))`` at each of the ``times``."""
    accel = vmap(lambda x, u: geodesic_acceleration_el(name, x, u, dims, eps))

    def rhs(state):
        return state[1], accel(*state)

    out, t, state = [], 0.0, (theta, v)
    for target in times:
        dt = (target - t) / steps
        for _ in range(steps):
            k1 = rhs(state)
            k2 = rhs(tuple(s + 0.5 * dt * k for s, k in zip(state, k1)))
            k3 = rhs(tuple(s + 0.5 * dt * k for s, k in zip(state, k2)))
            k4 = rhs(tuple(s + dt * k for s, k in zip(state, k3)))
            state = tuple(
                s + dt / 6 * (a + 2 * b + 2 * c + d) for s, a, b, c, d in zip(state, k1, k2, k3, k4)
            )
        t = target
        out.append(state)
    return out


# --- vertical and horizontal spaces -------------------------------------------------------


def vertical_basis(theta: Tensor, dims: Dims) -> Tensor:
    """Rows ``vec(V(E_ab)) = vec(G E_ab, -H E_ab^T)``, ``a, b < h`` (``h^2 x D``)."""
    G, H = unflatten(theta, dims)
    h = dims[2]
    rows = []
    for a in range(h):
        for b in range(h):
            E = torch.zeros(h, h, dtype=theta.dtype)
            E[a, b] = 1.0
            rows.append(flatten(G @ E, -H @ E.T))
    return torch.stack(rows)


def residual(name: str, theta: Tensor, x: Tensor, dims: Dims, eps: float = 0.0) -> Tensor:
    """``R`` with ``g(x, V(L)) = tr(R L)`` for all ``L``: ``R_ba = g(x, V(E_ab))``."""
    h = dims[2]
    M = metric_matrix(name, theta, dims, eps)
    return (vertical_basis(theta, dims) @ (M @ x)).reshape(h, h).T


def vertical_cosine(name: str, theta: Tensor, x: Tensor, dims: Dims, eps: float = 0.0) -> Tensor:
    """``max_L |g(x, V(L))| / (||x||_g ||V(L)||_g)``: 0 iff ``x`` is horizontal; scale-free."""
    M = metric_matrix(name, theta, dims, eps)
    V = vertical_basis(theta, dims)
    # Orthonormalise the vertical basis in the metric, then take the largest component.
    K = V @ M @ V.T
    W = torch.linalg.solve_triangular(torch.linalg.cholesky(K), V, upper=False)
    comp = W @ (M @ x)
    return comp.norm() / torch.sqrt(x @ M @ x)


def project_horizontal(name: str, theta: Tensor, x: Tensor, dims: Dims, eps=0.0) -> Tensor:
    """g-orthogonal projection: ``x - V(L)`` with ``L`` from the normal equations
    ``g(V(E_a), V(E_b)) c_b = g(x, V(E_a))``."""
    M = metric_matrix(name, theta, dims, eps)
    V = vertical_basis(theta, dims)
    c = torch.linalg.solve(V @ M @ V.T, V @ M @ x)
    return x - V.T @ c


def vertical_lstsq(theta: Tensor, v: Tensor, dims: Dims) -> tuple[Tensor, Tensor]:
    """Least-squares ``L`` with ``v ~ vec(G L, -H L^T)``; returns ``(L, residual vector)``."""
    V = vertical_basis(theta, dims)
    c = torch.linalg.lstsq(V.T, v.unsqueeze(-1)).solution.squeeze(-1)
    return c.reshape(dims[2], dims[2]), v - V.T @ c


# --- test data ----------------------------------------------------------------------------


def random_orthogonal(k: int, gen: torch.Generator) -> Tensor:
    Qm, R = torch.linalg.qr(torch.randn(k, k, generator=gen, dtype=F64))
    return Qm * torch.sign(torch.diagonal(R))


def random_factor(rows: int, h: int, gen: torch.Generator, spread: float = 0.7) -> Tensor:
    """A full-column-rank ``rows x h`` matrix with singular values in
    ``exp([-spread, spread])`` times a random overall scale."""
    U = random_orthogonal(rows, gen)[:, :h]
    s = torch.exp(spread * (2 * torch.rand(h, generator=gen, dtype=F64) - 1))
    scale = torch.exp(torch.rand((), generator=gen, dtype=F64) - 0.5)
    return scale * (U * s) @ random_orthogonal(h, gen)


def random_invertible(h: int, gen: torch.Generator) -> Tensor:
    """``U diag(s) V^T`` with singular values in ``[e^-1, e]``: condition number <= e^2."""
    s = torch.exp(2 * torch.rand(h, generator=gen, dtype=F64) - 1)
    return (random_orthogonal(h, gen) * s) @ random_orthogonal(h, gen)
