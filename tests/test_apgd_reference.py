"""The oracle of :func:`geosharp.measures.auto_pgd`: Auto-PGD written in ~40 lines
against the manifold interface alone (``inner``/``norm``, ``proju_``, ``egrad2rgrad_``,
``retr_``, ``pullback_``; the box reads the element-wise factor's scale), without
fused passes, buffers or host tricks. The production loop must take its steps:
the same iterates, step sizes, restarts and best values, in float64 on the zoo, for
every geometry, both starts and both restart rules."""

from __future__ import annotations

import math

import pytest
import torch

import geosharp
from geosharp.geometry import Geometry, PerturbationSpace
from geosharp.layout import ParameterLayout
from geosharp.measures import auto_pgd, checkpoints
from zoo import CASES


def reference_apgd(loss_grad, space, rho, n_iters, xi0=None, momentum=0.75, keep=False):
    """Auto-PGD (Croce & Hein 2020), MATH.md section 6; ``keep``: a restart steps from
    the best point with its kept gradient, else it evaluates the best point again."""
    box, c = space.geometry.p == math.inf, space.elementwise.scale

    def project(v):  # the ball, then the horizontal space
        if box:
            return torch.maximum(torch.minimum(v, rho * c), -rho * c)
        return space.proju_(v * min(1.0, rho / max(float(space.norm(v)), 1e-30)))

    def evaluate(x):  # the loss at x's point, and its gradient pulled back to x
        point = space.empty()
        step = space.retr_(x, point)
        value, grad = loss_grad(point, space.empty())
        return float(value), space.pullback_(step, grad)

    def ascent(g):
        if box:
            return space.elementwise.scale_(g.sign())
        d = space.proju_(space.egrad2rgrad_(g.clone()))
        return d / float(space.norm(d))

    xi = space.empty().zero_() if xi0 is None else project(xi0.clone())
    value, grad = evaluate(xi)
    best, best_xi, best_grad, improved = value, xi, grad, True
    xi_prev, eta, marks, revisit = xi, 2 * rho, checkpoints(n_iters), False
    last, ups, reduced, best_at_mark = 0, 0, True, best
    out = {"losses": [value], "best": [best], "step_sizes": [eta], "restarts": [], "xi": []}
    for i in range(n_iters):
        if not revisit:
            a = momentum if i > 0 else 1.0
            z = project(xi + eta * ascent(grad))
            xi_prev, xi = xi, project(xi + a * (z - xi) + (1 - a) * (xi - xi_prev))
            out["xi"].append(xi)
        revisit = False
        new, grad = evaluate(xi)
        ups, value, improved = ups + (new > value), new, new > best
        if improved:
            best, best_xi, best_grad = value, xi, grad
        out["losses"].append(value), out["best"].append(best)
        if i + 1 in marks:
            too_few = ups < 0.75 * (i + 1 - last)
            reduced = too_few or (not reduced and best == best_at_mark)
            if reduced:
                eta /= 2
                if not improved:  # back to the best point
                    xi = best_xi
                    if keep:
                        grad, value = best_grad, best
                    revisit = not keep
                xi_prev = xi
                out["restarts"].append(i + 1)
            best_at_mark, last, ups = best, i + 1, 0
        out["step_sizes"].append(eta)
    return best, best_xi, out


SETTINGS = [
    ("euclidean", {}),
    ("adaptive", {}),
    ("adaptive", {"p": math.inf}),
    ("adaptive", {"elementwise_step": "exp"}),
    ("geodesic", {"metric": "inv"}),
    ("geodesic", {"metric": "mix"}),
    ("geodesic-norm-only", {"metric": "inv"}),
    ("geodesic-curvature-only", {"metric": "mix"}),
]


@pytest.fixture(scope="module", params=["encoder", "bert"])
def problem(request):
    case = CASES[request.param](dtype=torch.float64)
    named = list(case.model.named_parameters())
    layout = ParameterLayout.from_named(named)
    theta = {n: p.detach() for n, p in named}
    loss = geosharp.params.functional_loss(case.model, case.loss_fn)
    case.model.eval()  # no dropout: one objective

    def loss_grad(point, out):
        point = point.detach().requires_grad_(True)
        value = loss(layout.unflatten(point), case.batches[0])
        return value.detach(), out.copy_(torch.autograd.grad(value, point)[0])

    return case, layout, theta, geosharp.find_symmetries(case.model).pairs, loss_grad


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


@pytest.mark.parametrize("keep", [False, True], ids=["revisit", "kept-gradient"])
@pytest.mark.parametrize("start", ["zero", "random"])
@pytest.mark.parametrize(("name", "kw"), SETTINGS, ids=lambda s: str(s))
def test_auto_pgd_takes_the_reference_steps(problem, name, kw, start, keep):
    _, layout, theta, pairs, loss_grad = problem
    geometry = Geometry.named(name, **kw)
    space = PerturbationSpace(theta, layout, pairs, geometry)
    rho = 0.05 if geometry.p == 2 else 0.01
    xi0 = None
    if start == "random":
        xi0 = space.random(torch.Generator().manual_seed(1))
        xi0 = xi0 * (0.5 * rho / float(space.norm(xi0)))
    seen = []

    def callback(event, i, iterate):
        if event == "step":
            seen.append(iterate.xi.clone())

    best, best_xi, trace = auto_pgd(
        loss_grad, space, rho, 16, xi0, callback=callback, keep_best_gradient=keep
    )
    want_best, want_xi, want = reference_apgd(loss_grad, space, rho, 16, xi0, keep=keep)
    assert trace.step_sizes == want["step_sizes"] and trace.restarts == want["restarts"]
    assert trace.losses == pytest.approx(want["losses"], rel=1e-10, abs=1e-13)
    assert trace.best == pytest.approx(want["best"], rel=1e-10, abs=1e-13)
    assert len(seen) == len(want["xi"])
    assert max(_rel(x, y) for x, y in zip(seen, want["xi"])) < 1e-8
    assert float(best) == pytest.approx(want_best, rel=1e-10)
    assert _rel(best_xi, want_xi) < 1e-8


@pytest.mark.parametrize("keep", [False, True])
def test_the_comparison_sees_the_restart_rule(problem, keep):
    """Control: where a restart goes back to an earlier best point (adaptive, L-infinity
    box), the reference with the other restart rule takes other steps, at the
    tolerance of the comparison."""
    _, layout, theta, pairs, loss_grad = problem
    space = PerturbationSpace(theta, layout, pairs, Geometry.named("adaptive", p=math.inf))
    _, _, trace = auto_pgd(loss_grad, space, 0.01, 16, keep_best_gradient=keep)
    _, _, other = reference_apgd(loss_grad, space, 0.01, 16, keep=not keep)
    assert any(trace.losses[m] < trace.best[m] for m in trace.restarts)  # back to the best
    assert trace.losses != pytest.approx(other["losses"], rel=1e-10, abs=1e-13)
