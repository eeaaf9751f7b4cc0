"""hessian_trace against a dense float64 reference, invariance, and the model untouched."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.func import functional_call
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import geosharp
from geosharp import Geometry, PerturbationSpace, find_symmetries
from geosharp.layout import ParameterLayout
from geosharp.measures.hessian import hessian_trace
from geosharp.measures.problem import batch_seed
from zoo import EncoderClassifier, encoder_case

MEASURES = ["euclidean", "adaptive", "geodesic-inv", "geodesic-mix", "geodesic-curvature-only-inv"]


def _tiny():
    torch.manual_seed(0)
    model = EncoderClassifier(dim=8, heads=2, layers=1).double().eval()
    with torch.no_grad():
        model.encoder.layers[0].self_attn.in_proj_weight.mul_(4.0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(12, 5, 8, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (12,), generator=gen)
    return model, [(x, y)], lambda m, b: F.cross_entropy(m(b[0]), b[1])


def _space(model, measure):
    spec = geosharp.measures.measure_kwargs(measure)
    geo = Geometry.named(spec.pop("geometry"), **spec)
    named = list(model.named_parameters())
    pairs = find_symmetries(model).pairs if geo.metric is not None else []
    theta = {n: p.detach() for n, p in named}
    return PerturbationSpace(theta, ParameterLayout.from_named(named), pairs, geo)


def _dense(model, batches, space):
    """The matrix K of the quadratic form Hess f(v, v) = v^T K v, built from autograd's
    dense Hessian and the path's second-order term read off ``space.retr``."""
    layout = space.layout
    theta = space.elementwise.theta_flat()

    def f(flat):
        params = layout.unflatten(flat)
        losses = [F.cross_entropy(functional_call(model, params, (x,)), y) for x, y in batches]
        return sum(losses) / len(losses)

    with sdpa_kernel(SDPBackend.MATH):
        hess = torch.autograd.functional.hessian(f, theta, vectorize=True)
    grad = torch.autograd.functional.jacobian(f, theta)
    zero = torch.zeros_like(theta)
    # retr(v) = theta + v + a(v)/2 with a quadratic: <grad, a(v)> = v^T M v
    christoffel = torch.autograd.functional.hessian(
        lambda v: 2 * torch.dot(grad, space.retr(v) - theta - v), zero, vectorize=True
    )
    return hess + christoffel / 2


def _covariance(space):
    """P G^-1 P^T: the covariance of the projected Gaussian probes in the metric."""
    n = space.numel
    metric = torch.autograd.functional.hessian(
        lambda v: space.inner(v, v) / 2, torch.zeros(n, dtype=torch.float64), vectorize=True
    )
    projector = torch.stack([space.proju(e) for e in torch.eye(n, dtype=torch.float64)], 1)
    # frozen entries (theta_j = 0: the ball has no extent there) have no metric: pinv
    return projector @ torch.linalg.pinv(metric, hermitian=True) @ projector.T


@pytest.mark.parametrize("probe_batch", [1, 3])
@pytest.mark.parametrize("measure", MEASURES)
def test_each_probe_is_the_dense_quadratic_form(measure, probe_batch):
    """One by one, and three at a time by a vectorised backward (4 probes: the last
    batch of probes is partial)."""
    model, batches, loss_fn = _tiny()
    space = _space(model, measure)
    K = _dense(model, batches, space)
    result = hessian_trace(
        model, batches, loss_fn, measure, n_probes=4, seed=3, probe_batch=probe_batch
    )
    for k, value in enumerate(result.per_probe):
        z = space.random(torch.Generator().manual_seed(batch_seed(3, k)))
        assert value == pytest.approx(float(z @ K @ z), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("measure", ["adaptive", "geodesic-inv", "geodesic-mix"])
def test_hutchinson_estimate_matches_the_dense_trace(measure):
    model, batches, loss_fn = _tiny()
    space = _space(model, measure)
    KS = _dense(model, batches, space) @ _covariance(space)
    n = 1500
    result = hessian_trace(model, batches, loss_fn, measure, n_probes=n, seed=0, probe_batch=100)
    assert abs(result.value - float(torch.trace(KS))) < 4 * result.stderr
    # Gaussian probes: Var z^T K z = 2 tr((K S)^2); a wrong probe covariance shows here
    assert result.stderr**2 == pytest.approx(2 * float(torch.trace(KS @ KS)) / n, rel=0.2)


def test_acceleration_is_the_second_order_term_of_the_step():
    model, *_ = _tiny()
    for name in ("adaptive", "geodesic"):
        geo = Geometry.named(name, elementwise_step="exp")
        named = list(model.named_parameters())
        pairs = find_symmetries(model).pairs if geo.metric is not None else []
        space = PerturbationSpace(
            {n: p.detach() for n, p in named}, ParameterLayout.from_named(named), pairs, geo
        )
        xi = space.random(torch.Generator().manual_seed(0))
        theta = space.elementwise.theta_flat()
        a = space.acceleration(xi)
        for t in (1e-2, 1e-3):
            second = 2 * (space.retr(t * xi) - theta - t * xi) / t**2
            assert torch.allclose(second, a, rtol=0, atol=30 * t * float(a.abs().max()))


def test_geodesic_trace_is_invariant_and_euclidean_is_not():
    case = encoder_case()
    case.model.eval()
    other = copy.deepcopy(case.model)
    geosharp.reparameterize(other, seed=1, batch=case.inputs)
    for measure, same in (("geodesic-inv", True), ("geodesic-mix", True), ("euclidean", False)):
        a = hessian_trace(case.model, case.batches, case.loss_fn, measure, n_probes=3)
        b = hessian_trace(other, case.batches, case.loss_fn, measure, n_probes=3)
        for x, y in zip(a.per_probe, b.per_probe):
            if same:
                assert y == pytest.approx(x, rel=1e-8)
            else:
                assert abs(y - x) > 1e-3 * abs(x)


def test_model_untouched_and_user_errors():
    model, batches, loss_fn = _tiny()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    flags = [p.requires_grad for p in model.parameters()]
    model.train()

    def boom(m, b):
        if boom.calls:
            raise RuntimeError("boom")
        boom.calls += 1
        return loss_fn(m, b)

    boom.calls = 0
    with pytest.raises(RuntimeError, match="boom"):
        hessian_trace(model, batches * 2, boom, "geodesic-inv", n_probes=2)
    result = hessian_trace(model, batches, loss_fn, "geodesic-inv", n_probes=2)
    assert model.training and [p.requires_grad for p in model.parameters()] == flags
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) and p.grad is None
    assert "geodesic-inv" in str(result) and result.n_batches == 1
    with pytest.raises(ValueError, match="n_probes"):
        hessian_trace(model, batches, loss_fn, n_probes=0)
    with pytest.raises(ValueError, match="round ball"):
        hessian_trace(model, batches, loss_fn, "adaptive-linf")
    with pytest.raises(TypeError, match="n_iters"):
        hessian_trace(model, batches, loss_fn, n_iters=3)
    with pytest.raises(TypeError, match=r"measure=Geometry.named\('geodesic', metric='mix'\)"):
        hessian_trace(model, batches, loss_fn, metric="mix")
