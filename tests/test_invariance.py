"""The paper's central claim: geodesic sharpness is invariant under the GL(h)
symmetries of attention, adaptive sharpness is not.

Each model of the zoo is re-parameterised by random transforms with condition number
100 on every query/key and value/output pair. The output must not change; geodesic
sharpness (both metrics, deterministic start) must agree within 1%; adaptive
sharpness must change markedly.
"""

import copy

import pytest
import torch

import geosharp
from geosharp.symmetry.check import _outputs
from zoo import CASES

RHO = {"adaptive": 0.05, "inv": 0.05, "mix": 0.01}


@pytest.fixture(scope="module", params=sorted(CASES))
def case_and_twin(request):
    case = CASES[request.param]()
    twin = copy.deepcopy(case.model)
    geosharp.reparameterize(twin, cond=100.0, seed=1, batch=case.inputs)
    return case, twin


def test_reparameterisation_keeps_the_function(case_and_twin):
    case, twin = case_and_twin
    params = dict(case.model.named_parameters())
    moved = max(
        float((p - params[n]).detach().abs().max() / params[n].detach().abs().max())
        for n, p in twin.named_parameters()
    )
    assert moved > 0.5, "the transform should change the weights a lot"
    case.model.eval()
    twin.eval()
    with torch.no_grad():
        ref = _outputs(case.model, case.inputs, dict(case.model.named_parameters()))
        out = _outputs(twin, case.inputs, dict(twin.named_parameters()))
    for a, b in zip(out, ref):
        assert float((a - b).abs().max()) <= 1e-5 * max(1.0, float(b.abs().max()))


def test_self_check_passes(case_and_twin):
    case, _ = case_and_twin
    check = geosharp.check_symmetries(case.model, case.inputs, cond=100.0)
    assert check.ok, str(check)
    assert check.max_rel_change < 1e-9  # float64 models


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_geodesic_sharpness_is_invariant(case_and_twin, metric):
    case, twin = case_and_twin
    kwargs = dict(measure=f"geodesic-{metric}", rho=RHO[metric], estimator=geosharp.WorstCase(10))
    a = geosharp.sharpness(case.model, case.batches, case.loss_fn, **kwargs).value
    b = geosharp.sharpness(twin, case.batches, case.loss_fn, **kwargs).value
    assert a > 1e-4, "the measure should see some sharpness"
    assert abs(a - b) <= 0.01 * abs(a), (a, b)


def test_adaptive_sharpness_is_not_invariant(case_and_twin):
    case, twin = case_and_twin
    kwargs = dict(measure="adaptive", rho=RHO["adaptive"], estimator=geosharp.WorstCase(10))
    a = geosharp.sharpness(case.model, case.batches, case.loss_fn, **kwargs).value
    b = geosharp.sharpness(twin, case.batches, case.loss_fn, **kwargs).value
    assert abs(a - b) > 0.2 * abs(a), (a, b)


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_average_case_geodesic_is_invariant(case_and_twin, metric):
    """Random directions are Gaussian in the metric: the transform maps the sample of
    one network onto the sample of the other (same generator), so the average agrees."""
    case, twin = case_and_twin
    kwargs = dict(
        measure=f"geodesic-{metric}", rho=RHO[metric], estimator=geosharp.AverageCase(n_samples=4)
    )
    a = geosharp.sharpness(case.model, case.batches, case.loss_fn, **kwargs)
    b = geosharp.sharpness(twin, case.batches, case.loss_fn, **kwargs)
    scale = max(abs(v) for v in a.per_batch) + 1e-3 * a.loss
    assert all(abs(x - y) <= 0.05 * scale for x, y in zip(a.per_batch, b.per_batch))


def test_a_composed_geometry_is_invariant(case_and_twin):
    """A product no recipe names, Euclidean element-wise with ``inv`` on the pairs: the
    pair factor alone makes the measure invariant, and it is another measure than
    ``geodesic-inv`` (adaptive element-wise)."""
    from geosharp.geometry import Elementwise, Geometry, InvMetric, Pairs

    case, twin = case_and_twin
    composed = Geometry("euclidean+inv", Elementwise(relative=False), Pairs(InvMetric()))
    kwargs = dict(rho=0.05, estimator=geosharp.WorstCase(10))
    a = geosharp.sharpness(case.model, case.batches, case.loss_fn, measure=composed, **kwargs)
    b = geosharp.sharpness(twin, case.batches, case.loss_fn, measure=composed, **kwargs)
    assert a.geometry == "euclidean+inv" and a.value > 1e-4
    assert abs(a.value - b.value) <= 0.01 * abs(a.value), (a.value, b.value)
    named = geosharp.sharpness(case.model, case.batches, case.loss_fn, "geodesic-inv", **kwargs)
    assert abs(named.value - a.value) > 0.01 * abs(a.value)
