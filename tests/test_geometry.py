r"""Numerical tests of the pair geometry (``geosharp.geometry.pairs``), MATH.md sections 2-5.

Every operator of ``InvMetric``/``MixMetric`` states is compared in float64 with the
dense, metric-agnostic reference of ``geometry_reference.py`` (metric matrix from the
definition, Christoffel symbols by autograd, RK4 geodesics), over a zoo of random pairs
``(B, n, m, h)`` and seeds; invariants (GL(h) invariance, idempotence, orthogonality) are
checked as properties.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

import geometry_reference as ref  # tests/ is on sys.path (conftest.py)
from geosharp.geometry.pairs import InvMetric, MixMetric

# torch's forward-mode AD scripts its decompositions on first use.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")

F64 = torch.float64
METRICS = ("inv", "mix")
# (B, n, m, h): a single scalar pair, h = 1, a square case n = m = h, and wider ones.
SHAPES = ((1, 1, 1, 1), (1, 3, 3, 1), (2, 5, 4, 2), (2, 3, 3, 3), (3, 6, 7, 3), (2, 9, 8, 4))
SEEDS = (0, 1, 2)
ZOO = [(shape, seed) for shape in SHAPES for seed in SEEDS]


def zoo_id(param) -> str:
    (B, n, m, h), seed = param
    return f"B{B}n{n}m{m}h{h}-s{seed}"


def metric(name: str, eps: float = 0.0):
    return InvMetric(eps=eps) if name == "inv" else MixMetric()


@dataclass
class Case:
    """Random pairs ``G`` (``B x n x h``), ``H`` (``B x m x h``) with tangents ``xi, eta``
    and invertible ``A`` (``B x h x h``)."""

    seed: int
    B: int
    n: int
    m: int
    h: int
    G: Tensor
    H: Tensor
    xi: tuple[Tensor, Tensor]
    eta: tuple[Tensor, Tensor]
    A: Tensor

    @property
    def dims(self) -> ref.Dims:
        return self.n, self.m, self.h

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.B, self.n, self.m, self.h

    def theta(self, b: int) -> Tensor:
        return ref.flatten(self.G[b], self.H[b])

    def flat(self, tangent, b: int) -> Tensor:
        return ref.flatten(tangent[0][b], tangent[1][b])

    def unflat(self, vectors: list[Tensor]) -> tuple[Tensor, Tensor]:
        blocks = [ref.unflatten(v, self.dims) for v in vectors]
        return torch.stack([g for g, _ in blocks]), torch.stack([h for _, h in blocks])

    def rng(self, salt: int) -> torch.Generator:
        """A fresh generator per test (results do not depend on the test order)."""
        return torch.Generator().manual_seed(1000 * self.seed + salt)

    def act(self, pair):
        """The group action ``(X A, Y A^{-T})`` on points and tangents."""
        return pair[0] @ self.A, pair[1] @ torch.linalg.inv(self.A).mT


@functools.cache
def make_case(shape: tuple[int, int, int, int], seed: int) -> Case:
    B, n, m, h = shape
    gen = torch.Generator().manual_seed(1000 * seed + 17)
    G = torch.stack([ref.random_factor(n, h, gen) for _ in range(B)])
    H = torch.stack([ref.random_factor(m, h, gen) for _ in range(B)])
    A = torch.stack([ref.random_invertible(h, gen) for _ in range(B)])

    def tangent():
        return torch.randn(G.shape, generator=gen, dtype=F64), torch.randn(
            H.shape, generator=gen, dtype=F64
        )

    return Case(seed, B, n, m, h, G, H, tangent(), tangent(), A)


@pytest.fixture(params=ZOO, ids=zoo_id)
def case(request) -> Case:
    return make_case(*request.param)


@pytest.fixture(params=METRICS)
def name(request) -> str:
    return request.param


def rel(a: Tensor, b: Tensor) -> float:
    """``||a - b|| / ||b||`` (absolute when ``b = 0``)."""
    scale = b.norm()
    return float((a - b).norm() / (scale if scale > 0 else 1.0))


def bflat(case: Case, tangent) -> Tensor:
    """A batched tangent as ``(B, D)`` flat vectors."""
    return torch.stack([case.flat(tangent, b) for b in range(case.B)])


def cat(pair) -> Tensor:
    return torch.cat([pair[0].flatten(), pair[1].flatten()])


# --- 1. metric --------------------------------------------------------------------------


def test_inner_matches_metric_matrix(case, name):
    """``inner(xi, eta) = x^T M y`` with ``M_ij = g(e_i, e_j)`` built from the definition;
    symmetric; ``norm^2 = inner(xi, xi) > 0``."""
    state = metric(name).state(case.G, case.H)
    value = state.inner(case.xi, case.eta)
    assert value.shape == (case.B,)
    for b in range(case.B):
        M = ref.metric_matrix(name, case.theta(b), case.dims)
        x, y = case.flat(case.xi, b), case.flat(case.eta, b)
        scale = float(torch.sqrt((x @ M @ x) * (y @ M @ y)))
        assert abs(float(value[b] - x @ M @ y)) <= 1e-12 * scale
    assert rel(state.inner(case.eta, case.xi), value) < 1e-13
    squared = state.inner(case.xi, case.xi)
    assert bool((squared > 0).all())
    assert rel(state.norm(case.xi) ** 2, squared) < 1e-13


@pytest.mark.parametrize(("name", "eps"), [("inv", 0.0), ("inv", 0.3), ("mix", 0.0)])
def test_states_hold_factors_only(case, name, eps):
    """A state holds the few ``h x h`` float64 matrices its hot path needs (``S, S^{-1}``
    for ``inv``, also ``T, T^{-1}`` with ``eps``; ``P^{-1}, Q^{-1}`` for ``mix``), and
    makes ``P, Q`` and their inverses from them: the Gram matrices (with ``eps``) and
    their inverses, to round-off."""
    state = (InvMetric(eps=eps) if name == "inv" else MixMetric()).state(case.G, case.H)
    held: dict[int, str] = {}  # storage -> first name (T is S for eps = 0)
    for k, v in vars(state).items():
        square = isinstance(v, Tensor) and v.dim() == 3 and v.shape[-2:] == (case.h, case.h)
        if square and k not in ("_G", "_H"):  # the blocks themselves, square when n = h
            held.setdefault(v.untyped_storage().data_ptr(), k)
    expected = {"_P_inv", "_Q_inv"} if name == "mix" else {"S", "S_inv"}
    assert set(held.values()) == expected | ({"T", "T_inv"} if eps else set())
    eye = eps * torch.eye(case.h, dtype=F64)
    P, Q = case.G.mT @ case.G + eye, case.H.mT @ case.H + eye
    for made, exact in ((state.P, P), (state.Q, Q), (state.P_inv, P.inverse())):
        assert rel(made, exact) < 1e-10
    assert rel(state.Q_inv, Q.inverse()) < 1e-10
    assert state.h == case.h


def test_mix_norm_measures_change_of_product(case):
    """``||xi||_mix^2 = ||xiG H^T||_F^2 + ||G xiH^T||_F^2`` (MATH.md section 2)."""
    state = MixMetric().state(case.G, case.H)
    xG, xH = case.xi
    expected = (xG @ case.H.mT).square().sum((-1, -2)) + (case.G @ xH.mT).square().sum((-1, -2))
    assert rel(state.inner(case.xi, case.xi), expected) < 1e-12


# --- 2. invariance ----------------------------------------------------------------------


def test_metric_is_gl_invariant(case, name):
    """``g`` at ``(G A, H A^{-T})`` of ``(xiG A, xiH A^{-T})`` equals ``g`` at ``(G, H)``."""
    base = metric(name).state(case.G, case.H)
    moved = metric(name).state(*case.act((case.G, case.H)))
    value = moved.inner(case.act(case.xi), case.act(case.eta))
    scale = base.norm(case.xi) * base.norm(case.eta)
    assert float(((value - base.inner(case.xi, case.eta)) / scale).abs().max()) < 1e-11


def test_operators_are_gl_equivariant(case, name):
    """At ``(G A, H A^{-T})``: the projection and the geodesic acceleration of the
    transformed tangent are the transformed ones; the Riemannian gradient of the
    transformed Euclidean gradient ``(dG A^{-T}, dH A)`` is the transformed gradient."""
    base = metric(name).state(case.G, case.H)
    moved = metric(name).state(*case.act((case.G, case.H)))
    for op in ("project_horizontal", "geodesic_acceleration"):
        expected = bflat(case, case.act(getattr(base, op)(case.xi)))
        assert rel(bflat(case, getattr(moved, op)(case.act(case.xi))), expected) < 1e-10, op
    egrad_moved = (case.xi[0] @ torch.linalg.inv(case.A).mT, case.xi[1] @ case.A)
    expected = bflat(case, case.act(base.egrad2rgrad(case.xi)))
    assert rel(bflat(case, moved.egrad2rgrad(egrad_moved)), expected) < 1e-10


# --- 3. horizontal space and projection --------------------------------------------------


def test_horizontal_residual_is_metric_against_vertical(case, name):
    """``horizontal_residual`` is the ``R`` with ``g(xi, V(L)) = tr(R L)`` for all ``L``
    (reference: ``R_ba = g(xi, V(E_ab))`` from the metric matrix), and ``vertical(L)`` is
    ``(G L, -H L^T)``."""
    state = metric(name).state(case.G, case.H)
    R = state.horizontal_residual(case.xi)
    for b in range(case.B):
        expected = ref.residual(name, case.theta(b), case.flat(case.xi, b), case.dims)
        assert rel(R[b], expected) < 1e-11
    L = torch.randn(case.B, case.h, case.h, generator=case.rng(1), dtype=F64)
    vG, vH = state.vertical(L)
    assert rel(vG, case.G @ L) < 1e-15 and rel(vH, -case.H @ L.mT) < 1e-15


def test_projection_is_g_orthogonal_onto_horizontal(case, name):
    """``xi_h = P(xi)`` is horizontal (``R = 0``, ``g(xi_h, V(L)) = 0`` for random ``L``,
    metric and ``V`` evaluated independently), ``P`` is idempotent, ``xi - xi_h`` is
    vertical (``(G L, -H L^T)`` with ``L`` from least squares, equal to
    ``vertical_coefficient``), and ``xi_h`` equals the reference projection from the
    normal equations of the vertical basis."""
    state = metric(name).state(case.G, case.H)
    xh = state.project_horizontal(case.xi)
    assert xh[0].shape == case.xi[0].shape and xh[1].shape == case.xi[1].shape
    R = state.horizontal_residual(xh)
    R_xi = state.horizontal_residual(case.xi)
    assert float(R.abs().max()) <= 1e-11 * float(R_xi.abs().max())
    assert rel(bflat(case, state.project_horizontal(xh)), bflat(case, xh)) < 1e-12
    L_coef = state.vertical_coefficient(case.xi)
    gen = case.rng(2)
    for b in range(case.B):
        theta, dims = case.theta(b), case.dims
        x, x_h = case.flat(case.xi, b), case.flat(xh, b)
        G, H, xhb = case.G[b], case.H[b], (xh[0][b], xh[1][b])
        for _ in range(3):
            L = torch.randn(case.h, case.h, generator=gen, dtype=F64)
            v = (G @ L, -H @ L.T)
            cross = ref.pair_metric(name, G, H, xhb, v)
            bound = torch.sqrt(
                ref.pair_metric(name, G, H, v, v) * ref.pair_metric(name, G, H, xhb, xhb)
            )
            assert abs(float(cross)) <= 1e-11 * float(bound)
        assert float(ref.vertical_cosine(name, theta, x_h, dims)) < 1e-11
        L, residual = ref.vertical_lstsq(theta, x - x_h, dims)
        assert float(residual.norm()) <= 1e-11 * float(x.norm())
        assert rel(L_coef[b], L) < 1e-9
        assert rel(x_h, ref.project_horizontal(name, theta, x, dims)) < 1e-10


def test_inv_sylvester_matches_scipy(case):
    """``X = L^T`` of ``inv`` solves ``(P Q) X + X (P Q) = C``,
    ``C = xiG^T G Q - P H^T xiH``; compared with ``scipy.linalg.solve_sylvester``."""
    linalg = pytest.importorskip("scipy.linalg")
    state = InvMetric().state(case.G, case.H)
    X = state.vertical_coefficient(case.xi).mT
    for b in range(case.B):
        G, H, (xG, xH) = case.G[b], case.H[b], (case.xi[0][b], case.xi[1][b])
        P, Q = G.T @ G, H.T @ H
        C = xG.T @ G @ Q - P @ H.T @ xH
        expected = linalg.solve_sylvester((P @ Q).numpy(), (P @ Q).numpy(), C.numpy())
        assert rel(X[b], torch.from_numpy(expected)) < 1e-9


def test_mix_vertical_coefficient_closed_form(case):
    """``mix``: ``L^T = 1/2 (xiG^T G P^{-1} - Q^{-1} H^T xiH)`` (MATH.md section 3)."""
    state = MixMetric().state(case.G, case.H)
    G, H, (xG, xH) = case.G, case.H, case.xi
    P_inv, Q_inv = torch.linalg.inv(G.mT @ G), torch.linalg.inv(H.mT @ H)
    expected = 0.5 * (xG.mT @ G @ P_inv - Q_inv @ H.mT @ xH)
    assert rel(state.vertical_coefficient(case.xi).mT, expected) < 1e-10


# --- 4. Riemannian gradient ----------------------------------------------------------------


def f_product(G: Tensor, H: Tensor, C: Tensor) -> Tensor:
    """A smooth function of ``W = G H^T`` only (per pair)."""
    W = G @ H.mT
    return (torch.sin(W) * C).sum((-1, -2)) + 0.1 * W.square().sum((-1, -2))


def f_generic(G: Tensor, H: Tensor, C: Tensor) -> Tensor:
    """A smooth function of ``(G, H)`` that is not GL(h)-invariant."""
    return (
        (torch.cos(G).sum((-1, -2)) * C.sum((-1, -2)))
        + (H**3).sum((-1, -2))
        + torch.log1p((G.mT @ G).diagonal(dim1=-2, dim2=-1).sum(-1)) * H.square().sum((-1, -2))
    )


@pytest.mark.parametrize("f", [f_product, f_generic], ids=["f(GH^T)", "f(G,H)"])
def test_riemannian_gradient(case, name, f):
    """``g(grad f, xi) = Df[xi]`` (autograd jvp) and ``grad f = M^{-1} egrad`` (dense);
    for ``f(G H^T)`` the gradient is horizontal, for the generic ``f`` it is not."""
    C = torch.randn(case.B, case.n, case.m, generator=case.rng(3), dtype=F64)
    G, H = case.G.clone().requires_grad_(), case.H.clone().requires_grad_()
    egrad = torch.autograd.grad(f(G, H, C).sum(), (G, H))
    _, derivative = torch.func.jvp(lambda g, h: f(g, h, C), (case.G, case.H), case.xi)
    state = metric(name).state(case.G, case.H)
    rgrad = state.egrad2rgrad(egrad)
    scale = state.norm(rgrad) * state.norm(case.xi)
    assert float(((state.inner(rgrad, case.xi) - derivative) / scale).abs().max()) < 1e-12
    for b in range(case.B):
        theta, M = case.theta(b), ref.metric_matrix(name, case.theta(b), case.dims)
        expected = torch.linalg.solve(M, case.flat(egrad, b))
        assert rel(case.flat(rgrad, b), expected) < 1e-10
        cosine = float(ref.vertical_cosine(name, theta, case.flat(rgrad, b), case.dims))
        if f is f_product:
            assert cosine < 1e-10
        else:
            assert cosine > 1e-3  # the check above is not vacuous


# --- 5. geodesics ----------------------------------------------------------------------


def test_geodesic_acceleration_is_christoffel(case, name):
    """``geodesic_acceleration(xi) = -Gamma(xi, xi)`` with ``Gamma`` from autograd
    derivatives of the dense metric matrix; it keeps the tangent's dtype."""
    state = metric(name).state(case.G, case.H)
    accel = state.geodesic_acceleration(case.xi)
    for b in range(case.B):
        theta, v = case.theta(b), case.flat(case.xi, b)
        Gamma = ref.christoffel(name, theta, case.dims)
        expected = -torch.einsum("kij,i,j->k", Gamma, v, v)
        assert rel(case.flat(accel, b), expected) < 1e-10
        euler_lagrange = ref.geodesic_acceleration_el(name, theta, v, case.dims)
        assert rel(euler_lagrange, expected) < 1e-10  # the RK4 below integrates this
    low = state.geodesic_acceleration((case.xi[0].float(), case.xi[1].float()))
    assert low[0].dtype == torch.float32 and low[1].dtype == torch.float32
    assert rel(bflat(case, low).double(), bflat(case, accel)) < 1e-5


T0 = 0.05
TIMES = [T0 / 4, T0 / 2, T0]


@functools.cache
def integrated(shape, seed: int, name: str):
    """RK4 geodesics (2 steps per interval of ``TIMES``) of one case, from three batches of
    starts: ``(theta_b, xi_b)``, ``(theta_b, P(xi_b))``, and transformed
    ``(theta_b A, xi_b A)``; every start normalised to ``||xi||_g = 1``."""
    case = make_case(shape, seed)
    state = metric(name).state(case.G, case.H)
    xh = state.project_horizontal(case.xi)
    moved = case.act((case.G, case.H)), case.act(case.xi)

    def unit(theta, v):
        return torch.stack(
            [
                v[b] / ref.metric_matrix(name, theta[b], case.dims).mv(v[b]).dot(v[b]).sqrt()
                for b in range(case.B)
            ]
        )

    theta = torch.stack([case.theta(b) for b in range(case.B)])
    theta_moved = torch.stack([ref.flatten(moved[0][0][b], moved[0][1][b]) for b in range(case.B)])
    starts = torch.cat([theta, theta, theta_moved])
    v1 = unit(theta, bflat(case, case.xi))
    v0 = torch.cat([v1, unit(theta, bflat(case, xh)), unit(theta_moved, bflat(case, moved[1]))])
    return starts, v0, ref.rk4_geodesic(name, starts, v0, case.dims, TIMES, steps=2)


def test_geodesic_expansion_is_third_order(case, name):
    """``|geodesic(xi, t) - gamma(t)|`` (``gamma`` integrated by RK4, ``||xi||_g = 1``)
    shrinks ~8x when ``t`` halves: the second-order expansion has an ``O(t^3)`` error."""
    B = case.B
    _, v0, trajectory = integrated(case.shape, case.seed, name)
    state = metric(name).state(case.G, case.H)
    xi = case.unflat(list(v0[:B]))
    errors = []
    for t, (point, _) in zip(TIMES, trajectory):
        second_order = bflat(case, state.geodesic(xi, t))
        errors.append((second_order - point[:B]).norm(dim=1))
    for coarse, fine in ((errors[2], errors[1]), (errors[1], errors[0])):
        ratio = coarse / fine
        assert bool(((ratio > 6) & (ratio < 10)).all()), ratio
    assert bool((errors[2] < 1e-3).all())


def test_horizontal_geodesic_stays_horizontal(case, name):
    """Along the integrated geodesic from a horizontal start, the velocity stays
    horizontal (reference cosine with the vertical space ~ 0) and ``g(v, v) = 1``."""
    B = case.B
    _, _, trajectory = integrated(case.shape, case.seed, name)
    for point, velocity in trajectory:
        for b in range(B, 2 * B):
            theta, v = point[b], velocity[b]
            # RK4 error: ~1e-8 here, 16x less per halved step; a drift would be O(t).
            assert float(ref.vertical_cosine(name, theta, v, case.dims)) < 1e-7
            speed = ref.metric_matrix(name, theta, case.dims).mv(v).dot(v)
            assert abs(float(speed) - 1.0) < 1e-7  # RK4 accuracy


def test_geodesics_are_equivariant(case, name):
    """Geodesics from ``(G A, H A^{-T})`` with the transformed ``xi`` are the transformed
    geodesics, and ``G(t) H(t)^T`` is the same: for the integrated geodesics and exactly
    for ``geodesic(xi, t)``."""
    B = case.B
    _, _, trajectory = integrated(case.shape, case.seed, name)
    for point, _ in trajectory:
        G, H = case.unflat(list(point[:B]))
        Gm, Hm = case.unflat(list(point[2 * B :]))
        expected = case.act((G, H))
        assert rel(cat((Gm, Hm)), cat(expected)) < 1e-9
        assert rel(Gm @ Hm.mT, G @ H.mT) < 1e-9
    base = metric(name).state(case.G, case.H)
    moved = metric(name).state(*case.act((case.G, case.H)))
    for t in (0.3, 1.0):
        G, H = base.geodesic(case.xi, t)
        Gm, Hm = moved.geodesic(case.act(case.xi), t)
        assert rel(bflat(case, (Gm, Hm)), bflat(case, case.act((G, H)))) < 1e-10
        assert rel(Gm @ Hm.mT, G @ H.mT) < 1e-10


def test_scalar_pair_closed_forms():
    """GL(1) (MATH.md section 5): for horizontal ``xi``, ``inv`` has ``g = 2 w^2`` and its
    expansion is the Taylor polynomial of the exact ``u0 exp(t w)``; ``mix`` has
    ``v xi_u = u xi_v`` and ``g = dbeta^2 / 2``."""
    u = torch.tensor([[[2.0]], [[-0.7]], [[0.3]]], dtype=F64)
    v = torch.tensor([[[3.0]], [[1.5]], [[-4.0]]], dtype=F64)
    xi = (torch.tensor([[[0.4]], [[-1.0]], [[2.0]]], dtype=F64), torch.zeros_like(v))
    inv = InvMetric().state(u, v)
    x = inv.project_horizontal(xi)
    w = x[0] / u
    assert rel(x[1] / v, w) < 1e-14
    assert rel(inv.inner(x, x), 2 * w.flatten() ** 2) < 1e-14
    for t in (0.5, 2.0):
        gu, gv = inv.geodesic(x, t)
        assert rel(gu, u * (1 + t * w + (t * w) ** 2 / 2)) < 1e-14
        assert rel(gv, v * (1 + t * w + (t * w) ** 2 / 2)) < 1e-14
    mix = MixMetric().state(u, v)
    x = mix.project_horizontal(xi)
    assert rel(v * x[0], u * x[1]) < 1e-14
    dbeta = (v * x[0] + u * x[1]).flatten()
    assert rel(mix.inner(x, x), dbeta**2 / 2) < 1e-14


def test_mix_horizontal_geodesic_flat_iff_square(case):
    """``mix``: along a horizontal geodesic, ``W(t) = G(t) H(t)^T`` is a straight line for
    square factors (``n = m = h``): the ``t^2`` coefficient of ``W`` of the expansion,
    ``xiG xiH^T + (G'' H^T + G H''^T) / 2``, vanishes; for ``h < n`` or ``h < m`` it
    does not (MATH.md section 5)."""
    state = MixMetric().state(case.G, case.H)
    x = state.project_horizontal(case.xi)
    aG, aH = state.geodesic_acceleration(x)
    quadratic = x[0] @ x[1].mT + 0.5 * (aG @ case.H.mT + case.G @ aH.mT)
    first = x[0] @ case.H.mT + case.G @ x[1].mT
    ratio = (
        quadratic.norm(dim=(-2, -1))
        / first.norm(dim=(-2, -1)) ** 2
        * (case.G @ case.H.mT).norm(dim=(-2, -1))
    )
    if case.n == case.m == case.h:
        assert float(ratio.max()) < 1e-12
    else:
        assert float(ratio.min()) > 1e-3


# --- 6. sampling ---------------------------------------------------------------------------


SAMPLED = [("inv", 0.0), ("inv", 0.3), ("mix", 0.0)]


@pytest.mark.parametrize("name", ["inv", "mix"])
def test_sample_is_equivariant(case, name):
    """With the same generator state, the pairs ``(G A, H A^{-T})`` draw
    ``(xiG A, xiH A^{-T})``: symmetry-related networks see related directions."""
    A = case.A
    Ait = torch.linalg.inv(A).transpose(-1, -2)
    sample = metric(name).state(case.G, case.H).sample(torch.Generator().manual_seed(5))
    moved = metric(name).state(case.G @ A, case.H @ Ait).sample(torch.Generator().manual_seed(5))
    for b in range(case.B):
        assert rel(case.flat(moved, b), case.flat((sample[0] @ A, sample[1] @ Ait), b)) < 1e-9


@pytest.mark.parametrize(("name", "eps"), SAMPLED)
@pytest.mark.parametrize("seed", SEEDS)
def test_sample_covariance(name, seed, eps):
    """Over 20000 draws, ``E[g(s, a) g(s, b)] = g(a, b)`` for random tangents ``a, b``:
    ``sample`` is a standard Gaussian in the metric (no replay of the generator)."""
    case, draws = make_case((1, 5, 4, 2), seed), 20000
    G, H = case.G.expand(draws, -1, -1), case.H.expand(draws, -1, -1)
    s = metric(name, eps).state(G, H).sample(torch.Generator().manual_seed(seed))
    M = ref.metric_matrix(name, case.theta(0), case.dims, eps)
    S = torch.cat([s[0].reshape(draws, -1), s[1].reshape(draws, -1)], 1)
    dirs = torch.randn(4, M.shape[0], generator=case.rng(4), dtype=F64)
    coords = S @ M @ dirs.T  # g(s, a_k)
    second = coords.T @ coords / draws
    gram = dirs @ M @ dirs.T
    normed = (second - gram) / torch.sqrt(gram.diagonal()[:, None] * gram.diagonal()[None, :])
    assert float(normed.abs().max()) < 0.06


# --- relaxed inv metric (eps > 0) ----------------------------------------------------------


@pytest.mark.parametrize("eps", [1e-4, 0.3])
def test_inv_eps_uses_relaxed_gram(case, eps):
    """``InvMetric(eps)`` is the metric of ``P + eps I, Q + eps I`` throughout: inner,
    gradient ``M^{-1} egrad``, geodesic acceleration ``-Gamma`` and a projection that is
    g-orthogonal, horizontal and idempotent for that metric."""
    state = InvMetric(eps=eps).state(case.G, case.H)
    xh = state.project_horizontal(case.xi)
    assert rel(bflat(case, state.project_horizontal(xh)), bflat(case, xh)) < 1e-11
    rgrad = state.egrad2rgrad(case.eta)
    accel = state.geodesic_acceleration(case.xi)
    for b in range(case.B):
        theta, x, y = case.theta(b), case.flat(case.xi, b), case.flat(case.eta, b)
        M = ref.metric_matrix("inv", theta, case.dims, eps)
        assert abs(float(state.inner(case.xi, case.eta)[b] - x @ M @ y)) < 1e-12 * float(
            torch.sqrt((x @ M @ x) * (y @ M @ y))
        )
        assert rel(case.flat(rgrad, b), torch.linalg.solve(M, y)) < 1e-10
        assert rel(case.flat(xh, b), ref.project_horizontal("inv", theta, x, case.dims, eps)) < 1e-9
        assert float(ref.vertical_cosine("inv", theta, case.flat(xh, b), case.dims, eps)) < 1e-10
        if b == 0:
            expected = ref.geodesic_acceleration("inv", theta, x, case.dims, eps)
            assert rel(case.flat(accel, b), expected) < 1e-10


def test_inv_eps_projection_near_rank_deficient():
    """``eps`` is meant for nearly rank-deficient pairs: there the projection must still be
    horizontal for the relaxed metric and idempotent."""
    gen = torch.Generator().manual_seed(3)
    G = torch.randn(2, 6, 3, generator=gen, dtype=F64)
    G[..., 2] = G[..., 0] - 2 * G[..., 1] + 1e-7 * torch.randn(2, 6, generator=gen, dtype=F64)
    H = torch.randn(2, 5, 3, generator=gen, dtype=F64)
    xi = (torch.randn_like(G), torch.randn_like(H))
    state = InvMetric(eps=1e-4).state(G, H)
    xh = state.project_horizontal(xi)
    again = state.project_horizontal(xh)
    assert rel(cat(again), cat(xh)) < 1e-9
    for b in range(2):
        theta = ref.flatten(G[b], H[b])
        x = ref.flatten(xh[0][b], xh[1][b])
        assert float(ref.vertical_cosine("inv", theta, x, (6, 5, 3), 1e-4)) < 1e-9


def test_rank_deficient_pair_raises():
    """``inv`` without ``eps`` and ``mix`` need full column rank."""
    G = torch.ones(1, 4, 2, dtype=F64)
    H = torch.randn(1, 3, 2, dtype=F64)
    for m in (InvMetric(), MixMetric()):
        with pytest.raises(torch.linalg.LinAlgError):
            m.state(G, H)
    InvMetric(eps=1e-3).state(G, H)  # relaxed: fine


# --- 7. float32 inputs ---------------------------------------------------------------------


def _float32_projection(name: str, seed: int, cond: float):
    """A float32 pair whose ``G`` has condition number ``cond``, projected: per head the
    relative error against the exact float64 projection, its vertical cosine, and the
    floor set by rounding the exact projection to float32."""
    gen = torch.Generator().manual_seed(seed)
    B, n, m, h = 2, 9, 8, 4
    s = torch.logspace(0, -math.log10(cond), h, dtype=F64)
    G = torch.stack(
        [
            (ref.random_orthogonal(n, gen)[:, :h] * s) @ ref.random_orthogonal(h, gen)
            for _ in range(B)
        ]
    ).float()
    H = torch.stack([ref.random_factor(m, h, gen) for _ in range(B)]).float()
    xi = (torch.randn(B, n, h, generator=gen).float(), torch.randn(B, m, h, generator=gen).float())
    xh = metric(name).state(G, H).project_horizontal(xi)
    assert xh[0].dtype == torch.float32 and xh[1].dtype == torch.float32
    out = []
    for b in range(B):
        theta = ref.flatten(G[b].double(), H[b].double())
        x = ref.flatten(xi[0][b].double(), xi[1][b].double())
        exact = ref.project_horizontal(name, theta, x, (n, m, h))
        got = ref.flatten(xh[0][b].double(), xh[1][b].double())
        floor = float(ref.vertical_cosine(name, theta, exact.float().double(), (n, m, h)))
        cosine = float(ref.vertical_cosine(name, theta, got, (n, m, h)))
        out.append((rel(got, exact), cosine, floor))
    return out


@pytest.mark.parametrize("seed", SEEDS)
def test_float32_projection_is_accurate(name, seed):
    """With float32 weights of condition number 1e4, the projection (float64 inside)
    returns float32 within 1e-6 of the exact float64 projection and is horizontal to
    1e-6 (``inv``; ``mix`` to 4x the floor set by rounding the exact projection to
    float32)."""
    for error, cosine, floor in _float32_projection(name, seed, 1e4):
        assert error < 1e-6
        assert cosine < (1e-6 if name == "inv" else max(1e-6, 4 * floor))


def test_the_small_algebra_in_float32_loses_the_projection(name, monkeypatch):
    """Why the ``h x h`` algebra stays in float64: the same code with it in float32 is
    within 1e-5 of the exact projection only for ``G`` of condition number 10; at 100
    its error is above 1e-5 (the Gram matrix squares the condition number: ``1e4 x``
    float32's ``6e-8``), at 1e4 the Gram matrix is singular in float32. In float64
    (:func:`test_float32_projection_is_accurate`) it is within 1e-6 at 1e4."""
    from geosharp.geometry import pairs

    monkeypatch.setattr(pairs, "_F64", torch.float32)
    assert max(e for e, _, _ in _float32_projection(name, 0, 10.0)) < 1e-5
    assert min(e for e, _, _ in _float32_projection(name, 0, 100.0)) > 1e-5
    with pytest.raises(torch.linalg.LinAlgError, match="singular"):
        _float32_projection(name, 0, 1e4)
