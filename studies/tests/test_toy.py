"""Scalar toy model (paper, appendix D): closed forms against metric-agnostic numerics,
invariance on the symmetry orbits, and the core's geodesic expansion."""

import json

import numpy as np
import pytest
import torch

import geosharp
from geosharp import Geometry, PerturbationSpace, find_symmetries
from geosharp.geometry import InvMetric, MixMetric
from geosharp.layout import ParameterLayout
from geosharp.measures.hessian import hessian_trace
from geosharp.measures.problem import batch_seed
from geosharp_studies import toy

POINTS = [(0.7, 1.1), (-1.3, 0.4), (0.3, -0.5), (1.6, 1.2), (-0.9, -2.0)]
DATA = [(1.0, 1.0), (2.0, -0.5)]


def autograd_derivatives(u, v, x, y):
    theta = torch.tensor([u, v], dtype=torch.float64)

    def f(p):
        return toy.loss(p[0], p[1], x, y)

    grad = torch.autograd.functional.jacobian(f, theta).numpy()
    hess = torch.autograd.functional.hessian(f, theta).numpy()
    return grad, hess


@pytest.mark.parametrize(("x", "y"), DATA)
@pytest.mark.parametrize(("u", "v"), POINTS)
def test_euclidean_quantities_match_autograd(u, v, x, y):
    grad, hess = autograd_derivatives(u, v, x, y)
    assert toy.euclidean_grad_norm(u, v, x, y) == pytest.approx(np.linalg.norm(grad), rel=1e-12)
    assert toy.euclidean_hessian_trace(u, v, x, y) == pytest.approx(np.trace(hess), rel=1e-12)


@pytest.mark.parametrize(("x", "y"), DATA)
@pytest.mark.parametrize(("u", "v"), POINTS)
@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_riemannian_gradient_norm_matches_the_metric_definition(u, v, x, y, metric):
    grad, _ = autograd_derivatives(u, v, x, y)
    fn = toy.inv_metric if metric == "inv" else toy.mix_metric
    g = fn(torch.tensor([u, v], dtype=torch.float64)).numpy()
    rgrad = np.linalg.solve(g, grad)  # g^{-1} dl
    expected = np.sqrt(rgrad @ g @ rgrad)
    assert toy.riemannian_grad_norm(u, v, x, y, metric) == pytest.approx(expected, rel=1e-12)


def unit_horizontal(u, v, metric):
    xi = np.array([u, v])  # xi_u / u = xi_v / v: horizontal for both metrics
    fn = toy.inv_metric if metric == "inv" else toy.mix_metric
    g = fn(torch.tensor([u, v], dtype=torch.float64)).numpy()
    return xi / np.sqrt(xi @ g @ xi), g


@pytest.mark.parametrize(("x", "y"), DATA)
@pytest.mark.parametrize(("u", "v"), POINTS)
@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_riemannian_hessian_trace_matches_christoffel_computation(u, v, x, y, metric):
    fn = toy.inv_metric if metric == "inv" else toy.mix_metric
    hess = toy.numerical_riemannian_hessian(fn, [u, v], x, y)
    e, g = unit_horizontal(u, v, metric)
    # the quotient is one-dimensional: its trace is Hess(e, e) for a unit horizontal e
    assert e @ hess @ e == pytest.approx(
        toy.riemannian_hessian_trace(u, v, x, y, metric), rel=1e-10, abs=1e-12
    )
    if metric == "inv":
        # the orbit is a geodesic of inv along which l is constant: the vertical
        # direction adds nothing, the total-space trace g^{ij} Hess_ij is the same
        total = np.trace(np.linalg.solve(g, hess))
        assert total == pytest.approx(
            toy.riemannian_hessian_trace(u, v, x, y), rel=1e-10, abs=1e-12
        )


def test_riemannian_hessian_trace_is_the_second_derivative_along_the_geodesic():
    u, v, x, y = 1.2, 0.9, 1.0, 1.0
    e, _ = unit_horizontal(u, v, "inv")
    h = 1e-4
    values = [toy.loss(*toy.geodesic_inv(u, v, e[0], e[1], t), x, y) for t in (-h, 0.0, h)]
    second = (values[0] - 2 * values[1] + values[2]) / h**2
    assert second == pytest.approx(toy.riemannian_hessian_trace(u, v, x, y), rel=1e-6)


def test_riemannian_quantities_are_constant_on_orbits_and_euclidean_ones_are_not():
    scales = np.exp(np.linspace(-1.5, 1.5, 9))
    x, y = 1.0, 1.0
    for u, v in POINTS:
        for fn in (toy.loss, toy.riemannian_grad_norm, toy.riemannian_hessian_trace):
            assert toy.orbit_variation(lambda a, b, fn=fn: fn(a, b, x, y), u, v, scales) < 1e-12
        for fn in (toy.euclidean_grad_norm, toy.euclidean_hessian_trace):
            assert toy.orbit_variation(lambda a, b, fn=fn: fn(a, b, x, y), u, v, scales) > 0.3
    for u, v in POINTS:  # mix quantities as well
        for fn in (toy.riemannian_grad_norm, toy.riemannian_hessian_trace):
            assert (
                toy.orbit_variation(lambda a, b, fn=fn: fn(a, b, x, y, "mix"), u, v, scales) < 1e-12
            )


def test_riemannian_hessian_trace_values():
    # 2 y^2 at the minima x beta = y, 0 on the axes, negative for 0 < x beta < y / 2
    assert toy.riemannian_hessian_trace(2.0, 0.5) == pytest.approx(2.0)
    assert toy.riemannian_hessian_trace(0.0, 1.3) == 0.0
    assert toy.riemannian_hessian_trace(0.5, 0.5) < 0
    assert toy.euclidean_hessian_trace(0.5, 0.5) > 0


@pytest.mark.parametrize(
    ("u0", "v0", "xi"),
    [(0.8, -1.3, (0.3, -0.5)), (-0.4, -0.7, (0.2, 0.1)), (1.5, 0.2, (-0.6, 0.05))],
)
def test_inv_geodesic_closed_form_matches_numerical_geodesic(u0, v0, xi):
    exact = np.array(toy.geodesic_inv(u0, v0, *xi, 1.0))
    numeric = toy.numerical_geodesic(toy.inv_metric, [u0, v0], xi, 1.0, steps=300)
    np.testing.assert_allclose(numeric, exact, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize(("u0", "v0", "w"), [(0.8, -1.3, 0.2), (1.5, 0.4, -0.3)])
def test_horizontal_mix_geodesic_is_a_straight_line_in_beta(u0, v0, w):
    exact = np.array(toy.geodesic_mix(u0, v0, w, 1.0))
    numeric = toy.numerical_geodesic(toy.mix_metric, [u0, v0], [w * u0, w * v0], 1.0, steps=300)
    np.testing.assert_allclose(numeric, exact, rtol=1e-9, atol=1e-10)
    beta = [np.prod(toy.geodesic_mix(u0, v0, w, t)) for t in (0.0, 0.5, 1.0)]
    assert beta[1] - beta[0] == pytest.approx(beta[2] - beta[1], rel=1e-12)
    # a non-horizontal start is not this curve (the check can fail)
    other = toy.numerical_geodesic(toy.mix_metric, [u0, v0], [w * u0, 0.0], 1.0, steps=100)
    assert np.abs(other - exact).max() > 1e-3


@pytest.mark.parametrize("metric", [InvMetric(), MixMetric()])
def test_core_geodesic_acceleration_equals_minus_christoffel(metric):
    # geosharp.geometry's second-order geodesic for a GL(1) pair against the toy's
    # autodiff Christoffel symbols, for non-horizontal xi too
    fn = toy.inv_metric if metric.name == "inv" else toy.mix_metric
    for (u, v), xi in zip(POINTS, [(0.3, -0.2), (1.0, 0.5), (-0.4, 0.9), (0.1, 0.1), (2.0, -1.0)]):
        state = metric.state(
            torch.tensor([[[u]]], dtype=torch.float64), torch.tensor([[[v]]], dtype=torch.float64)
        )
        aG, aH = state.geodesic_acceleration(
            (
                torch.tensor([[[xi[0]]]], dtype=torch.float64),
                torch.tensor([[[xi[1]]]], dtype=torch.float64),
            )
        )
        gamma = toy.christoffel(fn, torch.tensor([u, v], dtype=torch.float64))
        expected = -torch.einsum(
            "kij,i,j->k",
            gamma,
            torch.tensor(xi, dtype=torch.float64),
            torch.tensor(xi, dtype=torch.float64),
        )
        np.testing.assert_allclose([aG.item(), aH.item()], expected.numpy(), rtol=1e-12, atol=1e-12)


def test_study_writes_figures_and_checks(tmp_path):
    code = toy.main(["--out", str(tmp_path), "--figures", str(tmp_path / "fig")])
    assert code == 0
    checks = json.loads((tmp_path / "toy_checks.json").read_text())
    variation = checks["max_relative_variation_on_orbits"]
    assert variation["riemannian_grad_norm"] < 1e-12
    assert variation["riemannian_hessian_trace"] < 1e-12
    assert variation["euclidean_grad_norm"] > 0.3
    assert variation["euclidean_hessian_trace"] > 0.3
    assert checks["geodesic_inv_max_abs_error"] < 1e-8
    assert checks["geodesic_mix_max_abs_error"] < 1e-8
    for name in ("toy_figure1.png", "toy_figure6.png"):
        path = tmp_path / "fig" / name
        assert path.exists() and 10_000 < path.stat().st_size < 300_000


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_scalar_toy_model_closed_form(metric):
    """The paper's scalar toy model ``l = (x u v - y)^2 / 2``, ``(u, v)`` one GL(1) pair:
    the quotient is one-dimensional, so every probe is ``||z||_g^2`` times the closed-form
    Riemannian Hessian trace of :func:`geosharp_studies.toy.riemannian_hessian_trace`."""
    model = torch.nn.Sequential(
        torch.nn.Linear(1, 1, bias=False), torch.nn.Linear(1, 1, bias=False)
    ).double()
    u, v, x, y = 0.7, -1.9, 1.3, 0.4
    with torch.no_grad():
        model[0].weight.fill_(u)
        model[1].weight.fill_(v)
    pair = geosharp.declare_pair(model, G=["1.weight"], H=[("0.weight", lambda w: w.T)])
    symmetries = find_symmetries(model).with_pairs(pair)
    batch = (torch.full((1, 1), x, dtype=torch.float64), torch.full((1, 1), y, dtype=torch.float64))

    def loss_fn(m, b):
        return 0.5 * (m(b[0]) - b[1]).pow(2).sum()

    measure = f"geodesic-{metric}"
    result = hessian_trace(
        model, [batch], loss_fn, measure, n_probes=5, seed=2, symmetries=symmetries
    )
    named = list(model.named_parameters())
    space = PerturbationSpace(
        {n: p.detach() for n, p in named},
        ParameterLayout.from_named(named),
        [pair],
        Geometry.named("geodesic", metric),
    )
    trace = toy.riemannian_hessian_trace(u, v, x, y, metric=metric)
    for k, value in enumerate(result.per_probe):
        z = space.random(torch.Generator().manual_seed(batch_seed(2, k)))
        assert value == pytest.approx(trace * float(space.inner(z, z)), rel=1e-9)
