r"""Tests of the full-network tangent space ``PerturbationSpace`` (MATH.md section 6).

Network: two ``nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16)`` and a
linear head, float64, pairs from ``find_symmetries`` (per layer: query/key ``(2, 9, 9, 4)``
and value/output ``(2, 9, 8, 4)``). Some element-wise entries are zero (LayerNorm and
output biases, part of ``linear1.bias``: frozen in relative geometries) and so are some
pair entries (part of ``in_proj_bias``: they still move in the pair geometry).

The expected metric is assembled independently: for every pair, the reference metric of
``geometry_reference.py`` on blocks gathered from the ``PairSpec`` indices; for every other
entry ``(xi_j / c_j)^2`` with ``c_j = |theta_j|`` (relative) or 1 (Euclidean).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor, nn

import geometry_reference as ref  # tests/ is on sys.path (conftest.py)
from geosharp.geometry import GEOMETRIES, Geometry, PerturbationSpace
from geosharp.geometry.pairs import InvMetric, MixMetric
from geosharp.layout import ParameterLayout
from geosharp.symmetry.discovery import find_symmetries

F64 = torch.float64
SEEDS = (0, 1, 2)


@dataclass
class Net:
    model: nn.Module
    layout: ParameterLayout
    theta: Tensor
    pairs: list
    blocks: list[tuple[Tensor, Tensor]]  # per pair (one head): flat indices of G and H
    covered: Tensor  # entries that belong to a pair
    batch: tuple[Tensor, Tensor]

    def loss(self, theta: Tensor) -> Tensor:
        x, y = self.batch
        params = self.layout.unflatten(theta)
        out = torch.func.functional_call(self.model, params, (x,))
        return (out.mean(1) - y).square().mean()


@functools.cache
def network() -> Net:
    with torch.random.fork_rng():
        torch.manual_seed(0)

        def layer():
            return nn.TransformerEncoderLayer(
                d_model=8,
                nhead=2,
                dim_feedforward=16,
                dropout=0.0,
                batch_first=True,
                dtype=F64,
            )

        model = nn.Sequential(layer(), layer(), nn.Linear(8, 3, dtype=F64)).eval()
        with torch.no_grad():
            for i in (0, 1):
                attn = model[i].self_attn
                attn.in_proj_bias.normal_(0, 0.3)
                attn.in_proj_bias[:3] = 0.0  # zero pair entries (query bias of head 0)
                model[i].norm1.weight.normal_(1.0, 0.2)
                model[i].linear1.bias[:3] = 0.0  # zero element-wise entries
        x = torch.randn(4, 5, 8, dtype=F64)
        y = torch.randn(4, 3, dtype=F64)
    named = list(model.named_parameters())
    layout = ParameterLayout.from_named(named)
    theta = layout.flatten({n: p.detach() for n, p in named})
    pairs = find_symmetries(model).pairs
    assert len(pairs) == 4
    blocks = []
    for spec in pairs:
        for k in range(spec.shape[0]):

            def rows(side, k=k):
                return torch.cat([layout.offset(b.param) + b.index[k] for b in side])

            blocks.append((rows(spec.g_blocks), rows(spec.h_blocks)))
    covered = torch.zeros(theta.numel(), dtype=torch.bool)
    for g, h in blocks:
        covered[g.flatten()] = True
        covered[h.flatten()] = True
    assert bool((theta[covered] == 0).any()) and bool((theta[~covered] == 0).any())
    return Net(model, layout, theta, pairs, blocks, covered, (x, y))


@dataclass
class Expected:
    """What a geometry should be, from its definition (MATH.md section 6)."""

    name: str
    metric: str
    eps: float
    pair_ball: bool  # pairs measured with the pair metric, projected horizontally
    geodesic_step: bool
    weight: Tensor  # element-wise metric weights 1 / c^2 (0 on pair-ball and frozen entries)
    frozen: Tensor

    def pair_metric(self, G, H, xi, eta):
        return ref.pair_metric(self.metric, G, H, xi, eta, self.eps)


CASES = [
    ("euclidean", "inv", 0.0),
    ("adaptive", "inv", 0.0),
    ("geodesic", "inv", 0.0),
    ("geodesic", "mix", 0.0),
    ("geodesic", "inv", 1e-2),
    ("geodesic-norm-only", "inv", 0.0),
    ("geodesic-norm-only", "mix", 0.0),
    ("geodesic-curvature-only", "inv", 0.0),
    ("geodesic-curvature-only", "mix", 0.0),
]
assert {c[0] for c in CASES} == set(GEOMETRIES)


def expected(name: str, metric: str, eps: float) -> Expected:
    net = network()
    pair_ball = name in ("geodesic", "geodesic-norm-only")
    scale = torch.ones_like(net.theta) if name == "euclidean" else net.theta.abs()
    elementwise = ~net.covered if pair_ball else torch.ones_like(net.covered)
    frozen = elementwise & (scale == 0)
    weight = torch.where(elementwise & ~frozen, scale.clamp_min(1e-300) ** -2, 0.0)
    step = name in ("geodesic", "geodesic-curvature-only")
    return Expected(name, metric, eps, pair_ball, step, weight, frozen)


@pytest.fixture(params=CASES, ids=lambda c: f"{c[0]}-{c[1]}" + (f"-eps{c[2]}" if c[2] else ""))
def geo(request) -> tuple[PerturbationSpace, Expected]:
    name, metric, eps = request.param
    net = network()
    space = PerturbationSpace(
        net.theta, net.layout, net.pairs, Geometry.named(name, metric=metric, eps=eps)
    )
    return space, expected(name, metric, eps)


def tangent(exp: Expected, seed: int) -> Tensor:
    """A random vector that is zero on the frozen entries (not projected)."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(network().theta.shape, generator=gen, dtype=F64)
    return torch.where(exp.frozen, 0.0, z)


def reference_inner(exp: Expected, xi: Tensor, eta: Tensor) -> Tensor:
    net = network()
    total = (exp.weight * xi * eta).sum()
    if exp.pair_ball:
        for g, h in net.blocks:
            G, H = net.theta[g], net.theta[h]
            total = total + exp.pair_metric(G, H, (xi[g], xi[h]), (eta[g], eta[h]))
    return total


def rel(a: Tensor, b: Tensor) -> float:
    scale = b.norm()
    return float((a - b).norm() / (scale if scale > 0 else 1.0))


def pair_cosines(exp: Expected, xi: Tensor) -> list[float]:
    """Per pair: cosine (in the metric) of ``xi``'s blocks with the vertical space."""
    net = network()
    out = []
    for g, h in net.blocks:
        theta = ref.flatten(net.theta[g], net.theta[h])
        dims = (g.shape[0], h.shape[0], g.shape[1])
        x = ref.flatten(xi[g], xi[h])
        out.append(float(ref.vertical_cosine(exp.metric, theta, x, dims, exp.eps)))
    return out


@pytest.mark.parametrize("seed", SEEDS)
def test_inner_matches_reference(geo, seed):
    """``inner`` equals the independently assembled metric; it is symmetric and positive
    and ``norm = sqrt(inner(xi, xi))``."""
    space, exp = geo
    xi, eta = tangent(exp, seed), tangent(exp, seed + 100)
    value = space.inner(xi, eta)
    scale = torch.sqrt(reference_inner(exp, xi, xi) * reference_inner(exp, eta, eta))
    assert abs(float(value - reference_inner(exp, xi, eta))) <= 1e-12 * float(scale)
    assert abs(float(value - space.inner(eta, xi))) <= 1e-13 * float(scale)
    squared = float(space.inner(xi, xi))
    assert squared > 0
    assert math.isclose(squared, float(reference_inner(exp, xi, xi)), rel_tol=1e-12)
    assert math.isclose(float(space.norm(xi)), float(space.inner(xi, xi).sqrt()), rel_tol=1e-14)


@pytest.mark.parametrize("seed", SEEDS)
def test_proju(geo, seed):
    """``proju`` zeroes the frozen entries, is idempotent, and on pair-ball geometries
    makes every pair horizontal, equal to the reference g-orthogonal projection (and
    g-orthogonal: ``inner(xi - P xi, P eta) = 0``); elsewhere it changes nothing."""
    space, exp = geo
    net = network()
    z = torch.randn(net.theta.shape, generator=torch.Generator().manual_seed(seed), dtype=F64)
    p = space.proju(z)
    assert bool((p[exp.frozen] == 0).all())
    assert rel(space.proju(p), p) < 1e-12
    free = ~exp.frozen
    if not exp.pair_ball:
        assert torch.equal(p, torch.where(exp.frozen, 0.0, z))
        return
    assert torch.equal(p[free & ~net.covered], z[free & ~net.covered])
    for g, h in net.blocks:
        theta = ref.flatten(net.theta[g], net.theta[h])
        dims = (g.shape[0], h.shape[0], g.shape[1])
        x = ref.flatten(z[g], z[h])
        expect = ref.project_horizontal(exp.metric, theta, x, dims, exp.eps)
        assert rel(ref.flatten(p[g], p[h]), expect) < 1e-9
    assert max(pair_cosines(exp, p)) < 1e-10
    assert float(space.horizontal_residual(p)) < 1e-10
    eta = space.proju(tangent(exp, seed + 7))
    cross = space.inner(z - p, eta)
    assert abs(float(cross)) < 1e-11 * float(space.norm(z - p) * space.norm(eta))


@functools.cache
def loss_gradient() -> Tensor:
    net = network()
    theta = net.theta.clone().requires_grad_()
    return torch.autograd.grad(net.loss(theta), theta)[0]


@pytest.mark.parametrize("seed", SEEDS)
def test_egrad2rgrad(geo, seed):
    """``inner(rgrad, xi) = <egrad, xi>`` for every ``xi`` of the tangent space (frozen
    entries zero), for the loss gradient and a random covector; ``rgrad`` is zero on frozen
    entries; the loss is GL-invariant, so on pair-ball geometries its ``rgrad`` is
    horizontal (a random covector's is not)."""
    space, exp = geo
    random_grad = torch.randn(
        network().theta.shape, generator=torch.Generator().manual_seed(seed + 50), dtype=F64
    )
    xi = tangent(exp, seed)
    for egrad in (loss_gradient(), random_grad):
        rgrad = space.egrad2rgrad(egrad)
        assert bool((rgrad[exp.frozen] == 0).all())
        scale = space.norm(rgrad) * space.norm(xi)
        assert abs(float(space.inner(rgrad, xi) - egrad @ xi)) < 1e-12 * float(scale)
    if exp.pair_ball:
        assert max(pair_cosines(exp, space.egrad2rgrad(loss_gradient()))) < 1e-9
        assert min(pair_cosines(exp, space.egrad2rgrad(random_grad))) > 1e-3


def pair_state(exp: Expected, g: Tensor, h: Tensor):
    metric = InvMetric(eps=exp.eps) if exp.metric == "inv" else MixMetric()
    theta = network().theta
    return metric.state(theta[g][None], theta[h][None])


@pytest.mark.parametrize("seed", SEEDS)
def test_retr(geo, seed):
    """``retr(0) = theta``; straight-step geometries give ``theta + xi``; geodesic-step
    geometries give ``state.geodesic(xi, 1)`` on every pair's blocks (state built from the
    blocks gathered by the ``PairSpec`` indices) and ``theta + xi`` elsewhere."""
    space, exp = geo
    net = network()
    assert torch.equal(space.retr(torch.zeros_like(net.theta)), net.theta)
    xi = 0.3 * space.proju(tangent(exp, seed))
    out = space.retr(xi)
    if not exp.geodesic_step:
        assert torch.equal(out, net.theta + xi)
        return
    assert torch.equal(out[~net.covered], (net.theta + xi)[~net.covered])
    moved = 0.0
    for g, h in net.blocks:
        G1, H1 = pair_state(exp, g, h).geodesic((xi[g][None], xi[h][None]), 1.0)
        assert rel(ref.flatten(out[g], out[h]), ref.flatten(G1[0], H1[0])) < 1e-13
        moved += float((out[g] - net.theta[g] - xi[g]).norm())
    assert moved > 1e-3  # the curvature correction is there


RETR_CASES = [
    (*case, step)
    for case in CASES
    for step in ("straight", "exp")
    if not (case[0] == "euclidean" and step == "exp")  # exp needs a relative scale
]


@pytest.mark.parametrize(("name", "metric", "eps", "step"), RETR_CASES)
def test_retr_is_differentiable(name, metric, eps, step):
    """``xi -> <w, retr(xi)>``: its autograd gradient matches central differences along a
    random direction, and at ``xi = 0`` it is ``w`` (``d retr(0) = identity``)."""
    net = network()
    geometry = Geometry.named(name, metric=metric, eps=eps, elementwise_step=step)
    space = PerturbationSpace(net.theta, net.layout, net.pairs, geometry)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(space.numel, generator=gen, dtype=F64)
    # Relative sizes (space.random scales element-wise entries by |theta|).
    xi = (0.2 * space.random(gen)).requires_grad_()
    d = space.random(gen)

    def f(x):
        return w @ space.retr(x)

    (grad,) = torch.autograd.grad(f(xi), xi)
    delta = 1e-5
    with torch.no_grad():
        fd = (f(xi + delta * d) - f(xi - delta * d)) / (2 * delta)
    assert abs(float(grad @ d - fd)) < 1e-7 * float(w.norm() * d.norm())
    zero = torch.zeros_like(net.theta).requires_grad_()
    (grad0,) = torch.autograd.grad(f(zero), zero)
    assert torch.allclose(grad0, w, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("seed", SEEDS)
def test_adaptive_norms(seed):
    """Adaptive: ``||xi|| = ||xi / |theta| ||_2`` and, with ``p = inf``,
    ``max_j |xi_j / theta_j|``, over entries with ``theta_j != 0`` (the others are frozen)."""
    net = network()
    exp = expected("adaptive", "inv", 0.0)
    xi = tangent(exp, seed)
    nonzero = net.theta != 0
    assert torch.equal(exp.frozen, ~nonzero)
    ratio = xi[nonzero] / net.theta[nonzero]
    l2 = PerturbationSpace(net.theta, net.layout, net.pairs, Geometry.named("adaptive"))
    assert math.isclose(float(l2.norm(xi)), float(ratio.norm()), rel_tol=1e-13)
    linf = PerturbationSpace(
        net.theta, net.layout, net.pairs, Geometry.named("adaptive", p=float("inf"))
    )
    assert math.isclose(float(linf.norm(xi)), float(ratio.abs().max()), rel_tol=1e-14)


@pytest.mark.parametrize("seed", SEEDS)
def test_random(geo, seed):
    """``random`` lies in the tangent space (frozen entries zero, ``proju`` leaves it),
    is horizontal on pair-ball geometries, and is reproducible from the generator."""
    space, exp = geo
    r = space.random(torch.Generator().manual_seed(seed))
    assert torch.equal(r, space.random(torch.Generator().manual_seed(seed)))
    assert not torch.equal(r, space.random(torch.Generator().manual_seed(seed + 1)))
    assert bool((r[exp.frozen] == 0).all())
    assert bool((r[~exp.frozen] != 0).all())
    assert rel(space.proju(r), r) < 1e-12
    if exp.pair_ball:
        assert max(pair_cosines(exp, r)) < 1e-10
        assert float(space.horizontal_residual(r)) < 1e-10


@pytest.mark.parametrize("seed", SEEDS)
def test_random_is_gaussian_in_metric(geo, seed):
    """``random`` is the projection of a standard Gaussian in the metric. Without pair
    ball it is exactly ``z * c`` (``z`` replayed from the generator through
    :mod:`geosharp.geometry.draws`, ``c = |theta|`` or 1, frozen entries 0). With pair
    ball, over 300 draws: element-wise entries ``r_j / c_j`` have unit variance, and on
    each pair the whitened ``M^{1/2} r`` has the covariance of the orthogonal projector
    onto the (whitened) horizontal space."""
    space, exp = geo
    net = network()
    scale = torch.where(exp.weight > 0, exp.weight.rsqrt(), 0.0)
    if not exp.pair_ball:
        from geosharp.geometry.draws import draw_seed, normal_runs_

        n = net.theta.numel()
        z = torch.empty(n, dtype=F64)
        normal_runs_(z, [(0, 0, n)], n, draw_seed(torch.Generator().manual_seed(seed), z.device))
        r = space.random(torch.Generator().manual_seed(seed))
        assert rel(r, z * scale) < 1e-15
        return
    gen, draws = torch.Generator().manual_seed(seed), 300
    R = torch.stack([space.random(gen) for _ in range(draws)])
    ew = exp.weight > 0
    standardized = R[:, ew] / scale[ew]
    assert abs(float(standardized.square().mean()) - 1) < 0.02
    assert float((standardized.square().mean(0) - 1).abs().max()) < 0.6
    traces, expected_traces = 0.0, 0.0
    for g, h in net.blocks:
        theta = ref.flatten(net.theta[g], net.theta[h])
        dims = (g.shape[0], h.shape[0], g.shape[1])
        w, U = torch.linalg.eigh(ref.metric_matrix(exp.metric, theta, dims, exp.eps))
        root = (U * w.sqrt()) @ U.T
        V = ref.vertical_basis(theta, dims) @ root  # whitened vertical vectors (rows)
        projector = torch.eye(len(w), dtype=F64) - V.T @ torch.linalg.solve(V @ V.T, V)
        W = torch.stack([ref.flatten(r[g], r[h]) for r in R]) @ root
        cov = W.T @ W / draws
        assert float((cov - projector).abs().max()) < 0.35
        traces += float(cov.trace())
        expected_traces += float(projector.trace())
    # Pooled over 8 pairs the relative standard deviation is ~0.004.
    assert abs(traces / expected_traces - 1) < 0.015


@pytest.mark.parametrize("name", ["adaptive", "geodesic", "geodesic-curvature-only"])
@pytest.mark.parametrize("seed", SEEDS)
def test_exp_elementwise_step(name, seed):
    """``elementwise_step='exp'``: element-wise entries move to ``theta exp(xi / theta)``
    (exact GL(1) geodesic), frozen ones stay; pair entries (geodesic-step geometries) get
    ``state.geodesic``."""
    net = network()
    exp = expected(name, "inv", 0.0)
    geometry = Geometry.named(name, elementwise_step="exp")
    space = PerturbationSpace(net.theta, net.layout, net.pairs, geometry)
    xi = 0.5 * space.random(torch.Generator().manual_seed(seed))
    out = space.retr(xi)
    elementwise = ~net.covered if exp.geodesic_step else torch.ones_like(net.covered)
    free = elementwise & (net.theta != 0)
    theta = net.theta
    assert rel(out[free], theta[free] * torch.exp(xi[free] / theta[free])) < 1e-15
    assert torch.equal(out[elementwise & ~free], theta[elementwise & ~free])
    if exp.geodesic_step:
        for g, h in net.blocks:
            G1, H1 = pair_state(exp, g, h).geodesic((xi[g][None], xi[h][None]), 1.0)
            assert rel(ref.flatten(out[g], out[h]), ref.flatten(G1[0], H1[0])) < 1e-13


def test_geometry_named_rejects_bad_arguments():
    """Unknown names, the L-infinity ball outside 'adaptive', the exponential step without
    a relative scale, an unknown metric, and ``eps`` with 'mix' are errors."""
    with pytest.raises(ValueError):
        Geometry.named("sharp")
    with pytest.raises(ValueError):
        Geometry.named("geodesic", p=float("inf"))
    with pytest.raises(ValueError):
        Geometry.named("euclidean", elementwise_step="exp")
    with pytest.raises(ValueError):
        Geometry.named("geodesic", metric="frobenius")
    with pytest.raises(ValueError):
        Geometry.named("geodesic", metric="mix", eps=1e-3)
    with pytest.raises(ValueError):
        PerturbationSpace(network().theta[:-1], network().layout, [], Geometry.named("adaptive"))
    # the factors check themselves when composed by hand
    from geosharp.geometry import Elementwise, InvMetric, Pairs

    with pytest.raises(ValueError, match="element-wise geometry only"):
        Geometry("box", Elementwise(p=float("inf")), Pairs(InvMetric()))
    with pytest.raises(ValueError, match="relative scale"):
        Elementwise(relative=False, step="exp")
    with pytest.raises(ValueError, match="p must be"):
        Elementwise(p=1)


@pytest.mark.parametrize("name", ["adaptive", "geodesic", "geodesic-curvature-only"])
def test_refresh_equals_a_new_space_after_an_in_place_update(name):
    """A space over the model's own tensors, refreshed after they change in place,
    acts as a space built at the new point (pair states, frozen entries, cached scale)."""
    from zoo import encoder_case

    model = encoder_case().model
    named = list(model.named_parameters())
    layout = ParameterLayout.from_named(named)
    pairs = find_symmetries(model).pairs
    geo = Geometry.named(name, "inv")
    view = {n: p.detach() for n, p in named}
    space = PerturbationSpace(view, layout, pairs, geo, cache_scale=True)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.3).add_(0.01)
        named[0][1][0].zero_()  # entries become frozen
    fresh = PerturbationSpace({n: p.detach() for n, p in named}, layout, pairs, geo)
    space.refresh()
    gen = torch.Generator().manual_seed(0)
    xi = torch.randn(layout.numel, generator=gen, dtype=torch.float64)
    assert space.inner(xi, xi) == pytest.approx(float(fresh.inner(xi, xi)), rel=1e-12)
    assert torch.allclose(space.proju(xi), fresh.proju(xi), rtol=1e-12, atol=1e-14)
    assert torch.allclose(space.egrad2rgrad(xi), fresh.egrad2rgrad(xi), rtol=1e-12, atol=1e-14)
    assert torch.allclose(space.retr(1e-3 * xi), fresh.retr(1e-3 * xi), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_draw_over_slices_is_the_whole_draw_sliced(world):
    """Each process draws only the blocks of its own slices (of dimension 0 or 1, as
    FSDP2 cuts them, uneven and empty ones included) and gets the numbers of the whole
    draw: random starts do not depend on the number of processes."""
    from geosharp.geometry.draws import normal_runs_
    from geosharp.geometry.sharded import Shards
    from geosharp.layout import ParameterLayout

    shapes = {"a": ((7, 5), 0), "b": ((4, 6), 1), "c": ((2,), 0), "d": ((3, 2, 4), 1)}
    whole_named = [(n, torch.empty(shape)) for n, (shape, _) in shapes.items()]
    numel = sum(t.numel() for _, t in whole_named)
    whole = torch.empty(numel)
    normal_runs_(whole, [(0, 0, numel)], numel, seed=11, block=16)
    for rank in range(world):
        dims, local_named = {}, []
        for name, (shape, dim) in shapes.items():
            chunk = -(-shape[dim] // world)
            start = min(rank * chunk, shape[dim])
            length = max(0, min(shape[dim] - start, chunk))
            dims[name] = (dim, start, length)
            local_named.append((name, torch.empty(*shape[:dim], length, *shape[dim + 1 :])))
        shards = Shards(
            ParameterLayout.from_named(whole_named),
            ParameterLayout.from_named(local_named),
            dims,
            reduce=None,
            reduce_max=None,
        )
        local = torch.empty(shards.local.numel)
        normal_runs_(local, shards.runs(), numel, seed=11, block=16)
        assert torch.equal(local, shards.slice_(whole, torch.empty(shards.local.numel)))
