"""Sharpness measures: model left untouched, clear errors, Auto-PGD behaviour."""

import copy
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import geosharp
from geosharp.geometry import Geometry, PerturbationSpace
from geosharp.layout import ParameterLayout
from geosharp.measures import auto_pgd, checkpoints, measure_kwargs
from zoo import bert_case, encoder_case

ALL_MEASURES = [
    ("euclidean", "inv", 2.0),
    ("adaptive", "inv", 2.0),
    ("adaptive", "inv", float("inf")),
    ("geodesic", "inv", 2.0),
    ("geodesic", "mix", 2.0),
    ("geodesic-norm-only", "inv", 2.0),
    ("geodesic-curvature-only", "mix", 2.0),
]


def snapshot(model: nn.Module):
    return (
        {n: t.detach().clone() for n, t in model.state_dict(keep_vars=True).items()},
        {
            n: (p.requires_grad, None if p.grad is None else p.grad.clone())
            for n, p in model.named_parameters()
        },
        [m.training for m in model.modules()],
    )


def assert_same(model: nn.Module, snap) -> None:
    state, grads, flags = snap
    now = model.state_dict(keep_vars=True)
    assert now.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(now[name].detach(), tensor), name  # bit-identical
    for name, p in model.named_parameters():
        requires_grad, grad = grads[name]
        assert p.requires_grad == requires_grad
        assert (p.grad is None) == (grad is None)
        if grad is not None:
            assert torch.equal(p.grad, grad)
    assert [m.training for m in model.modules()] == flags


@pytest.fixture
def bert():
    case = bert_case(dtype=torch.float32)
    case.model.train()  # the measure must switch dropout off and restore this
    case.loss_fn(case.model, case.batches[0]).backward()  # a user's stale .grad stays
    return case


@pytest.mark.parametrize("geometry,metric,p", ALL_MEASURES)
@pytest.mark.parametrize("kind", ["worst", "average"])
def test_model_bit_identical_after_measure(bert, geometry, metric, p, kind):
    snap = snapshot(bert.model)
    result = geosharp.sharpness(
        bert.model,
        bert.batches,
        bert.loss_fn,
        geosharp.Geometry.named(geometry, metric=metric, p=p),
        rho=0.02,
        estimator=geosharp.WorstCase(n_iters=3, starts="random")
        if kind == "worst"
        else geosharp.AverageCase(n_samples=2),
    )
    assert math.isfinite(result.value)
    assert_same(bert.model, snap)


def test_model_bit_identical_after_exception_mid_way(bert):
    snap = snapshot(bert.model)
    calls = {"n": 0}

    def failing_loss(model, batch):
        calls["n"] += 1
        if calls["n"] == 3:  # inside Auto-PGD, with perturbed weights swapped in
            raise RuntimeError("boom")
        return bert.loss_fn(model, batch)

    with pytest.raises(RuntimeError, match="boom"):
        geosharp.sharpness(
            bert.model,
            bert.batches,
            failing_loss,
            rho=0.05,
            estimator=geosharp.WorstCase(n_iters=5),
        )
    assert calls["n"] == 3
    assert_same(bert.model, snap)


def test_dropout_is_off_during_the_measure(bert):
    seen = []

    def loss_fn(model, batch):
        seen.append(model.training)
        return bert.loss_fn(model, batch)

    geosharp.sharpness(
        bert.model, bert.batches[:1], loss_fn, rho=0.01, estimator=geosharp.WorstCase(n_iters=2)
    )
    assert seen and not any(seen)
    assert bert.model.training


# -- errors ------------------------------------------------------------------------------


@pytest.fixture
def small():
    return encoder_case(dtype=torch.float64)


@pytest.mark.parametrize("rho", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_rho(small, rho):
    with pytest.raises(ValueError, match="rho must be a positive finite number"):
        geosharp.sharpness(small.model, small.batches, small.loss_fn, rho=rho)


def test_empty_batches(small):
    with pytest.raises(ValueError, match="no batches"):
        geosharp.sharpness(small.model, [], small.loss_fn, rho=0.1)


def test_single_batch_not_wrapped(small):
    with pytest.raises(TypeError, match="wrap a single batch in a list"):
        geosharp.sharpness(small.model, small.inputs, small.loss_fn, rho=0.1)


def test_nan_loss(small):
    def nan_loss(model, batch):
        return small.loss_fn(model, batch) * float("nan")

    with pytest.raises(FloatingPointError, match="unperturbed loss is nan"):
        geosharp.sharpness(small.model, small.batches, nan_loss, rho=0.1)


class _LogWeight(nn.Module):
    """loss = -log(w): finite at w = 1, NaN once a perturbation of radius > 1 crosses 0."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1, dtype=torch.float64))


def _log_loss(model, batch):
    return -torch.log(model.w).sum() * batch.mean()


@pytest.mark.parametrize(
    "estimator, where",
    [(geosharp.WorstCase(n_iters=5), "Auto-PGD step"), (geosharp.AverageCase(8), "direction")],
)
def test_nonfinite_perturbed_loss(estimator, where):
    model, batches = _LogWeight(), [torch.ones(2, dtype=torch.float64)] * 2
    kw = dict(measure="euclidean", rho=3.0, estimator=estimator)
    with pytest.raises(FloatingPointError, match=rf"batch 0, {where} \d+: loss nan.*lower rho"):
        geosharp.sharpness(model, batches, _log_loss, **kw)
    result = geosharp.sharpness(model, batches, _log_loss, nonfinite="inf", **kw)
    assert result.value == math.inf and result.per_batch == [math.inf, math.inf]
    assert result.nonfinite and all(where in w for w in result.nonfinite)
    fine = geosharp.sharpness(model, batches, _log_loss, **{**kw, "rho": 0.5})
    assert math.isfinite(fine.value) and fine.nonfinite == []
    assert model.w.item() == 1.0
    with pytest.raises(ValueError, match="nonfinite must be"):
        geosharp.sharpness(model, batches, _log_loss, nonfinite="nan", **kw)


@pytest.mark.parametrize(
    "estimator, per_batch",
    [
        (geosharp.WorstCase(n_iters=3), 4),
        (geosharp.WorstCase(3, starts=2), 8),
        (geosharp.AverageCase(5), 5),
    ],
)
def test_progress_counts_every_forward_backward_with_time_left(
    small, monkeypatch, estimator, per_batch
):
    """Progress per Auto-PGD step (per random direction), not per batch: a one-batch run
    of minutes is not silent; the lines give the time left."""
    import functools
    import io
    import sys

    module = sys.modules["geosharp.measures.sharpness"]  # the function shadows the module

    out = io.StringIO()
    monkeypatch.setattr(
        module, "Progress", functools.partial(module.Progress, every=0.0, stream=out)
    )
    geosharp.sharpness(small.model, small.batches, small.loss_fn, measure="adaptive", rho=0.05,
                       estimator=estimator, progress=True)  # fmt: skip
    total = len(small.batches) * per_batch
    lines = out.getvalue().splitlines()
    assert len(lines) == total and lines[-1].startswith(f"adaptive rho=0.05: {total}/{total} step")
    assert all("s left" in line for line in lines)


def test_non_scalar_loss(small):
    def vector_loss(model, batch):
        return F.cross_entropy(model(batch[0]), batch[1], reduction="none")

    with pytest.raises(ValueError, match=r"must return a scalar.*\.mean\(\)"):
        geosharp.sharpness(small.model, small.batches, vector_loss, rho=0.1)


def test_loss_not_a_tensor(small):
    with pytest.raises(TypeError, match="must return a tensor"):
        geosharp.sharpness(small.model, small.batches, lambda m, b: 1.0, rho=0.1)


def test_model_without_parameters():
    with pytest.raises(ValueError, match="no parameters"):
        geosharp.sharpness(nn.ReLU(), [torch.ones(2)], lambda m, b: m(b).sum(), rho=0.1)
    with pytest.raises(ValueError, match="no parameters"):
        geosharp.find_symmetries(nn.ReLU())


def test_unknown_names(small):
    with pytest.raises(ValueError, match="unknown geometry 'sharp'"):
        geosharp.sharpness(
            small.model, small.batches, small.loss_fn, geosharp.Geometry.named("sharp")
        )
    with pytest.raises(ValueError, match="unknown metric"):
        geosharp.sharpness(
            small.model,
            small.batches,
            small.loss_fn,
            geosharp.Geometry.named("geodesic", metric="euclid"),
        )
    with pytest.raises(ValueError, match="L-infinity ball is defined for 'adaptive' only"):
        geosharp.sharpness(
            small.model,
            small.batches,
            small.loss_fn,
            geosharp.Geometry.named("geodesic", p=float("inf")),
        )
    with pytest.raises(ValueError, match="unknown parameter names"):
        geosharp.sharpness(small.model, small.batches, small.loss_fn, parameters=["nope"])
    with pytest.raises(ValueError, match="unknown measure"):
        measure_kwargs("geodesic-euclid")


# -- Auto-PGD ------------------------------------------------------------------------------


class LinearLoss(nn.Module):
    """``L(theta) = <a, theta>``: the worst case over any round ball is known exactly."""

    def __init__(self, d: int = 12, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.theta = nn.Parameter(torch.randn(d, generator=g, dtype=torch.float64))
        self.a = torch.randn(d, generator=g, dtype=torch.float64)

    def forward(self, _batch=None):
        return self.theta @ self.a


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auto_pgd_reaches_the_linear_optimum(seed):
    """Adaptive ball ``||xi / |theta| ||_2 <= rho``: max ``<a, xi>`` is ``rho ||a |theta| ||``;
    the L-infinity box gives ``rho sum |a theta|``; Euclidean ``rho ||a||``."""
    model = LinearLoss(seed=seed)
    theta, a = model.theta.detach(), model.a

    def measure(**kw):
        return geosharp.sharpness(
            model,
            [None],
            lambda m, b: m(b),
            rho=0.1,
            **kw,
            estimator=geosharp.WorstCase(n_iters=10),
        ).value

    assert measure(measure="adaptive") == pytest.approx(0.1 * float((a * theta).norm()), rel=1e-6)
    assert measure(measure="adaptive-linf") == pytest.approx(
        0.1 * float((a * theta).abs().sum()), rel=1e-6
    )
    assert measure(measure="euclidean") == pytest.approx(0.1 * float(a.norm()), rel=1e-6)


@pytest.mark.parametrize(
    ("name", "metric"), [("geodesic", "mix"), ("geodesic-norm-only", "inv"), ("adaptive", "inv")]
)
def test_auto_pgd_iterates_stay_in_the_ball_and_horizontal(small, name, metric):
    """Also where the step is straight and the loop keeps points ``theta + xi``: the
    callback and the result still see tangents, and the best value is the loss at the
    returned tangent's point."""
    named = list(small.model.named_parameters())
    layout = ParameterLayout.from_named(named)
    theta = layout.flatten({n: p.detach() for n, p in named})
    sym = geosharp.find_symmetries(small.model)
    space = PerturbationSpace(theta, layout, sym.pairs, Geometry.named(name, metric))
    assert space.geometry.straight == (name != "geodesic")
    seen, calls = [], []
    loss = geosharp.params.functional_loss(small.model, small.loss_fn)

    def loss_grad(point, out):
        calls.append(1)
        point = point.detach().requires_grad_(True)
        value = loss(layout.unflatten(point), small.batches[0])
        return value.detach(), out.copy_(torch.autograd.grad(value, point)[0])

    def callback(event, i, iterate):
        if event == "step":
            seen.append(iterate.xi.clone())

    rho = 0.02
    with geosharp.params.evaluation_mode(small.model):  # no dropout: one objective
        best, best_xi, trace = auto_pgd(loss_grad, space, rho, n_iters=12, callback=callback)
        with torch.no_grad():
            at_best = loss(layout.unflatten(space.retr(best_xi)), small.batches[0])
    # one call per iteration: a step, or the best point again after a restart away from it
    assert len(calls) == len(trace.losses) == 13
    assert 12 - len(trace.restarts) <= len(seen) <= 12
    for xi in seen:
        assert float(space.norm(xi)) <= rho * (1 + 1e-9)
        assert float(space.horizontal_residual(xi)) < 1e-9
    assert trace.best == sorted(trace.best)  # best-so-far is monotone
    assert float(best) == max(trace.losses) == trace.best[-1]
    assert float(space.norm(best_xi)) <= rho * (1 + 1e-9)
    assert float(at_best) == pytest.approx(float(best), rel=1e-12)
    assert trace.step_sizes[0] == 2 * rho
    assert all(s in (2 * rho / 2**k for k in range(8)) for s in trace.step_sizes)


@pytest.mark.parametrize(
    ("name", "p", "rho"),
    [("adaptive", 2.0, 0.5), ("adaptive", math.inf, 0.05), ("euclidean", 2.0, 1.0)],
)
def test_a_narrower_gradient_keeps_the_iterate_as_its_point(small, name, p, rho, monkeypatch):
    """``grad_dtype`` narrower than the space (a half-precision model's gradient): the
    gradient gets a buffer of its own in it, the point is the iterate's own buffer; the
    run is that of the full-width gradient to the narrow one's round-off, its iterates
    stay in the ball, its best value is the loss at the returned tangent's point, and
    the device path (the best point kept by ``torch.where``) takes the same steps."""
    from geosharp.measures import apgd

    named = list(small.model.named_parameters())
    layout = ParameterLayout.from_named(named)
    theta = layout.flatten({n: p.detach() for n, p in named})
    space = PerturbationSpace(theta, layout, [], Geometry.named(name, p=p))
    loss = geosharp.params.functional_loss(small.model, small.loss_fn)
    seen = {}

    def loss_grad(point, out):
        seen.setdefault("out", set()).add(out.dtype)
        seen.setdefault("shared", set()).add(out.data_ptr() == point.data_ptr())
        point = point.detach().requires_grad_(True)
        value = loss(layout.unflatten(point), small.batches[0])
        return value.detach(), out.copy_(torch.autograd.grad(value, point)[0])

    def norms(event, i, iterate):
        if event == "step":
            seen.setdefault("norms", []).append(float(space.norm(iterate.xi)))

    runs = {}
    with geosharp.params.evaluation_mode(small.model):
        for key, dtype in (("wide", None), ("narrow", torch.float32), ("device", torch.float32)):
            if key == "device":
                monkeypatch.setattr(apgd, "_HOST_DEVICES", ())
            seen.clear()
            runs[key] = auto_pgd(loss_grad, space, rho, 20, callback=norms, grad_dtype=dtype)
            runs[key] += (seen["out"], seen["shared"], seen["norms"])
        with torch.no_grad():
            at_best = loss(layout.unflatten(space.retr(runs["narrow"][1])), small.batches[0])
    wide, narrow, device = runs["wide"], runs["narrow"], runs["device"]
    assert wide[3:5] == ({torch.float64}, {True}) and narrow[3:5] == ({torch.float32}, {False})
    assert narrow[2].losses == pytest.approx(wide[2].losses, rel=1e-6)
    assert narrow[2].losses != wide[2].losses  # the gradient's round-off steered the run
    assert max(narrow[5]) <= rho * (1 + 1e-9)
    assert float(space.norm(narrow[1])) <= rho * (1 + 1e-9)
    assert float(at_best) == pytest.approx(float(narrow[0]), rel=1e-12)
    assert device[2].losses == narrow[2].losses and torch.equal(device[1], narrow[1])
    trace = narrow[2]
    assert any(trace.losses[m] < trace.best[m] for m in trace.restarts)  # back to the best


def test_checkpoint_schedule():
    """p_0 = 0, p_1 = 0.22, p_{j+1} = p_j + max(p_j - p_{j-1} - 0.03, 0.06)."""
    assert checkpoints(100) == [22, 41, 57, 70, 80, 87, 93, 99]
    assert checkpoints(20) == [5, 9, 12, 14, 16, 18, 19]
    assert checkpoints(1) == []


def test_seeded_and_reproducible(small):
    kw = dict(rho=0.05, estimator=geosharp.WorstCase(n_iters=4, starts="random"), seed=3)
    state = torch.random.get_rng_state()
    a = geosharp.sharpness(small.model, small.batches, small.loss_fn, **kw)
    assert torch.equal(torch.random.get_rng_state(), state)  # global RNG untouched
    b = geosharp.sharpness(small.model, small.batches, small.loss_fn, **kw)
    c = geosharp.sharpness(small.model, small.batches, small.loss_fn, **{**kw, "seed": 4})
    assert a.per_batch == b.per_batch
    assert a.per_batch != c.per_batch


def test_a_measure_seeds_no_generator_of_a_device_that_starts_later(small, monkeypatch):
    """The verification's fixed draws seed only the generators they restore.
    ``torch.manual_seed`` also seeds CUDA, queued until it starts on a CPU run: the
    caller's later GPU work would draw from the measure's seed, not the caller's."""
    seeds = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seeds.append)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)  # the control: the check sees a global seed
    assert seeds == [1]
    kw = dict(rho=0.05, estimator=geosharp.WorstCase(n_iters=2))
    result = geosharp.sharpness(small.model, small.batches, small.loss_fn, "geodesic-inv", **kw)
    assert result.symmetry["verified"] > 0  # the verification drew its numbers
    assert seeds == [1]


def test_result_fields_and_json(small):
    r = geosharp.sharpness(
        small.model, small.batches, small.loss_fn, rho=0.05, estimator=geosharp.WorstCase(n_iters=3)
    )
    assert len(r.per_batch) == len(small.batches) == len(r.traces)
    assert r.value == pytest.approx(sum(r.per_batch) / len(r.per_batch))
    assert r.value >= 0  # deterministic start: the unperturbed point is a candidate
    assert r.geometry == "geodesic-inv" and r.settings["n_pairs"] == 4
    assert '"per_batch"' in r.to_json()
    assert "worst-case geodesic-inv" in str(r)


def test_frozen_parameters_are_not_perturbed(small):
    model = copy.deepcopy(small.model)
    for p in model.encoder.parameters():
        p.requires_grad_(False)
    r = geosharp.sharpness(
        model, small.batches, small.loss_fn, rho=0.05, estimator=geosharp.WorstCase(n_iters=3)
    )
    assert r.settings["n_pairs"] == 0  # every pair has a frozen member
    assert r.value > 0  # the head still moves


def test_several_starts_keep_the_best_and_each_start_s_value(small):
    def run(starts="zero"):
        estimator = geosharp.WorstCase(n_iters=4, starts=starts)
        args = (small.model, small.batches, small.loss_fn)
        return geosharp.sharpness(*args, "geodesic-inv", 0.05, estimator, seed=3)

    zero, one = run(), run(starts=1)
    assert zero.per_batch == one.per_batch and one.per_batch_starts == []
    three = run(starts=3)
    assert len(three.per_batch_starts) == len(small.batches)
    for best, starts, first in zip(three.per_batch, three.per_batch_starts, zero.per_batch):
        assert len(starts) == 3 and starts[0] == first  # the zero start comes first
        assert best == max(starts)
    assert three.value >= zero.value and three.settings["starts"] == 3
    for bad in (0, "two", True):
        with pytest.raises((ValueError, TypeError), match="starts"):
            run(starts=bad)


def test_attention_only_measures_perturb_the_pairs_alone(small):
    symmetries = geosharp.find_symmetries(small.model)
    in_pairs = {n for pair in symmetries.pairs for n in pair.params}
    assert in_pairs and in_pairs != {n for n, _ in small.model.named_parameters()}
    for name in ("adaptive-attn", "geodesic-inv-attn", "geodesic-mix-attn"):
        args = (small.model, small.batches, small.loss_fn)
        estimator = geosharp.WorstCase(n_iters=3)
        attn = geosharp.sharpness(*args, name, estimator=estimator)
        chosen = [n for n, _ in small.model.named_parameters() if n in in_pairs]
        whole = name.removesuffix("-attn")
        same = geosharp.sharpness(*args, whole, attn.rho, estimator, parameters=chosen)
        assert attn.value == same.value > 0 and attn.settings["parameters"] == "pairs"
        assert attn.rho == geosharp.DEFAULT_RHO[name]
    with pytest.raises(ValueError, match="no symmetric pairs"):
        geosharp.sharpness(
            nn.Linear(3, 1), [torch.ones(2, 3)], lambda m, b: m(b).sum(), parameters="pairs"
        )


def test_a_named_measure_is_its_geometry_and_parameters(small):
    def run(**k):
        estimator = geosharp.WorstCase(n_iters=2)
        return geosharp.sharpness(
            small.model, small.batches, small.loss_fn, **k, estimator=estimator
        )

    for name in ("geodesic-mix", "adaptive-linf", "adaptive-attn"):
        named = run(measure=name)
        kw = measure_kwargs(name)
        parameters = kw.pop("parameters", None)
        spelled = geosharp.Geometry.named(kw.pop("geometry"), **kw)
        assert named.value == run(measure=spelled, parameters=parameters).value
        assert named.rho == geosharp.DEFAULT_RHO[name]
    with pytest.raises(ValueError, match="unknown measure"):
        run(measure="sharpest")


# -- the call: a measure, a radius, an estimator ------------------------------------------


@pytest.mark.parametrize(
    ("flat", "spelled"),
    [
        (dict(n_iters=4, starts=2), "estimator=WorstCase(n_iters=4, starts=2)"),
        (dict(n_iters=3, random_start=True), "estimator=WorstCase(n_iters=3, starts='random')"),
        (dict(kind="average", n_samples=3), "estimator=AverageCase(n_samples=3)"),
        (dict(geometry="adaptive", p=float("inf")), "Geometry.named('adaptive', p=float('inf'))"),
        (
            dict(metric="mix", n_iters=2),
            "measure=Geometry.named('geodesic', metric='mix'), estimator=WorstCase(n_iters=2)",
        ),
        (dict(per="layer"), "block_sharpness(model, batches, loss_fn, ..., per='layer')"),
        (dict(low_memory=True), "the default now; remove the argument"),
    ],
)
def test_the_keywords_of_earlier_versions_name_their_spelling(small, flat, spelled):
    with pytest.raises(TypeError) as info:
        geosharp.sharpness(small.model, small.batches, small.loss_fn, **flat)
    assert spelled in str(info.value)


def test_a_geometry_object_or_a_name(small):
    args = (small.model, small.batches[:1], small.loss_fn)
    kw = dict(rho=0.02, estimator=geosharp.WorstCase(n_iters=3))
    by_name = geosharp.sharpness(*args, "geodesic-inv", **kw)
    by_object = geosharp.sharpness(*args, Geometry.named("geodesic", metric="inv"), **kw)
    by_default = geosharp.sharpness(*args, **kw)
    assert by_name.per_batch == by_object.per_batch == by_default.per_batch
    relaxed = geosharp.sharpness(*args, Geometry.named("geodesic", eps=0.001), **kw)
    assert relaxed.settings["eps"] == 1e-3


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(estimator=geosharp.WorstCase(), n_iters=5), TypeError, r"WorstCase\(n_iters=5\)"),
        (dict(n_iter=5), TypeError, "unexpected keyword argument.*n_iter"),
        (dict(estimator="worst"), TypeError, "WorstCase"),
        (dict(measure=3), TypeError, "a name or a Geometry"),
    ],
)
def test_call_errors_name_the_fix(small, kwargs, error, match):
    with pytest.raises(error, match=match):
        geosharp.sharpness(small.model, small.batches, small.loss_fn, **kwargs)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: geosharp.WorstCase(n_iters=0), "at least 1"),
        (lambda: geosharp.WorstCase(starts="best"), "'zero', 'random'"),
        (lambda: geosharp.WorstCase(starts=True), "'zero', 'random'"),
        (lambda: geosharp.AverageCase(n_samples=0), "at least 1"),
        (lambda: geosharp.AverageCase(n_samples=2.5), "integer"),
    ],
)
def test_estimators_check_their_arguments(make, match):
    with pytest.raises((TypeError, ValueError), match=match):
        make()


@pytest.mark.parametrize("make", [bert_case, encoder_case])
def test_per_layer_and_module_sharpness(make):
    """Each block measured with the rest fixed, in the same geometry and radius: the
    blocks cover every trainable parameter once with each attention pair whole, a block
    value is that block's sharpness(parameters=...), and the geodesic block values do not
    move under a symmetry transform while the adaptive ones do."""
    from geosharp.measures.blocks import parameter_blocks

    case = make(torch.float64)
    sym = geosharp.find_symmetries(case.model, case.batches[0], loss_fn=case.loss_fn)
    trainable = [n for n, p in case.model.named_parameters() if p.requires_grad]
    for per in ("layer", "module"):
        blocks = parameter_blocks(case.model, per, sym.pairs)
        assert sorted(n for names in blocks.values() for n in names) == sorted(trainable)
        owner = {n: b for b, names in blocks.items() for n in names}
        assert all(len({owner[n] for n in pair.params}) == 1 for pair in sym.pairs)
    moved = copy.deepcopy(case.model)
    geosharp.reparameterize(moved, sym, cond=10.0, seed=1)
    blocks = geosharp.block_sharpness
    for per in ("layer", "head"):
        kw = dict(rho=0.05, estimator=geosharp.WorstCase(n_iters=4), per=per)
        before = blocks(case.model, case.batches, case.loss_fn, "geodesic-inv", **kw)
        after = blocks(moved, case.batches, case.loss_fn, "geodesic-inv", **kw)
        adaptive = [
            blocks(m, case.batches, case.loss_fn, "adaptive", **kw).values
            for m in (case.model, moved)
        ]
        touched = [b for b, names in before.parameters.items() if set(names) & set(sym.parameters)]
        assert touched and before.values.keys() == after.values.keys()
        for block, value in before.values.items():
            assert value > 0 and after.values[block] == pytest.approx(value, rel=1e-9), block
        assert any(adaptive[1][b] != pytest.approx(adaptive[0][b], rel=1e-3) for b in touched)
    kw["per"] = "layer"
    layers = blocks(case.model, case.batches, case.loss_fn, "geodesic-inv", **kw)
    first, names = next(iter(layers.parameters.items()))
    del kw["per"]
    alone = geosharp.sharpness(
        case.model, case.batches, case.loss_fn, "geodesic-inv", **kw, parameters=names
    )
    assert layers.values[first] == alone.value
    with pytest.raises(ValueError, match="drop parameters"):
        blocks(case.model, case.batches, case.loss_fn, "adaptive", **kw, parameters=names)
    with pytest.raises(ValueError, match="per must be one of"):
        blocks(case.model, case.batches, case.loss_fn, "adaptive", **kw, per="row")


def test_precision_floor_is_reported_and_a_value_near_it_is_warned_about():
    """bf16 autocast at a radius where it moves the value by more than 10% against
    float32: the floor (|L_bf16 - L_fp32| at theta) is in the result, a warning says
    so and strict=True refuses; float32 reports its eps-floor and does not warn."""
    import warnings

    case = bert_case(torch.float32)
    kw = dict(measure="adaptive", rho=1e-3, estimator=geosharp.WorstCase(n_iters=5))
    with warnings.catch_warnings():
        warnings.simplefilter("error", geosharp.PrecisionWarning)
        full = geosharp.sharpness(case.model, case.batches, case.loss_fn, **kw)
    assert 0 < full.floor < 1e-6 and full.settings["precision"] == "float32"
    assert full.settings["matmul_precision"] == "highest (CPU)"
    with pytest.warns(geosharp.PrecisionWarning, match="round-off floor of the loss in bfloat16"):
        half = geosharp.sharpness(
            case.model, case.batches, case.loss_fn, autocast_dtype=torch.bfloat16, **kw
        )
    assert abs(half.value - full.value) > 0.1 * full.value and half.floor > 10 * full.floor
    assert abs(half.value) < 10 * half.floor
    with pytest.raises(geosharp.UsageError, match="round-off floor"):
        geosharp.sharpness(case.model, case.batches, case.loss_fn, autocast_dtype=torch.bfloat16,
                           strict=True, **kw)  # fmt: skip
    with pytest.raises(ValueError, match="matmul_precision"):
        geosharp.sharpness(case.model, case.batches, case.loss_fn, matmul_precision="tf32", **kw)
