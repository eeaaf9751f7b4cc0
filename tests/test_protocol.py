"""One property suite over every pair state: the contract of the geometry protocol.

Every state (``inv``, ``inv`` with ``eps``, ``mix``, their rotary and orthogonal
restrictions, and the weighted ``mix`` metric that ``docs/architecture.md`` adds as its
example) must satisfy:

* ``inner`` symmetric and positive, ``norm`` its square root;
* the horizontal projection: zero residual, idempotent, g-orthogonal, kills ``V(L)``;
* gradient duality ``g(egrad2rgrad(e), xi) = <e, xi>``;
* the acceleration solves the geodesic equation of the metric itself: a reference built
  from finite differences of the metric matrix, sharing no formula with the state;
* the hot path (``proju``, ``direction``, ``accelerate``, ``pullback``) equals the
  reference methods (and autograd for the pullback);
* the sampler is equivariant under the pairs' group.
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
import torch

from geosharp.geometry.pairs import InvMetric, MixMetric
from geosharp.geometry.subgroup import restrict_state
from geosharp.symmetry.groups import random_group_elements

F64 = torch.float64
ARCHITECTURE = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"


def docs_example() -> dict:
    """The namespace of ``docs/architecture.md``'s first code block (the new metric),
    run as a module (dataclasses look their module up)."""
    name = "geosharp_docs_architecture"
    if name not in sys.modules:
        blocks = re.findall(r"```python\n(.*?)```", ARCHITECTURE.read_text(), re.S)
        module = types.ModuleType(name)
        sys.modules[name] = module
        exec(compile(blocks[0], "docs/architecture.md (block 1)", "exec"), module.__dict__)
    return vars(sys.modules[name])


METRICS = {
    "inv": lambda: InvMetric(),
    "inv-eps": lambda: InvMetric(eps=0.3),
    "mix": lambda: MixMetric(),
    "wmix (docs)": lambda: docs_example()["WeightedMix"](lam=2.5),
}
STATES = [(name, group) for name in METRICS for group in ("GL", "rotary", "orthogonal")]


def pair(seed: int, B: int = 2, n: int = 6, m: int = 5, h: int = 4):
    gen = torch.Generator().manual_seed(seed)
    G = torch.randn(B, n, h, generator=gen, dtype=F64)
    H = torch.randn(B, m, h, generator=gen, dtype=F64)
    return G, H, gen


def tangent(G, H, gen):
    return torch.randn(G.shape, generator=gen, dtype=F64), torch.randn(
        H.shape, generator=gen, dtype=F64
    )


def make_state(name: str, group: str, G, H):
    return restrict_state(METRICS[name]().state(G, H), group)


def rel(a, b) -> float:
    a = torch.cat([t.reshape(-1) for t in a]) if isinstance(a, tuple) else a
    b = torch.cat([t.reshape(-1) for t in b]) if isinstance(b, tuple) else b
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


@pytest.fixture(params=STATES, ids=[f"{n}-{g}" for n, g in STATES])
def case(request):
    name, group = request.param
    G, H, gen = pair(sum(map(ord, name + group)))
    return name, group, make_state(name, group, G, H), gen


def test_inner_and_norm(case):
    _, _, state, gen = case
    x, y = tangent(state.G, state.H, gen), tangent(state.G, state.H, gen)
    assert torch.allclose(state.inner(x, y), state.inner(y, x), rtol=1e-12)
    assert bool((state.inner(x, x) > 0).all())
    assert torch.allclose(state.norm(x) ** 2, state.inner(x, x), rtol=1e-12)


def test_projection(case):
    _, _, state, gen = case
    x, y = tangent(state.G, state.H, gen), tangent(state.G, state.H, gen)
    px, py = state.project_horizontal(x), state.project_horizontal(y)
    scale = state.norm(x).max()
    assert float(state.horizontal_residual(px).abs().max()) < 1e-10 * float(scale)
    assert rel(state.project_horizontal(px), px) < 1e-10
    # g-orthogonal: what is removed is orthogonal to every horizontal vector
    removed = (x[0] - px[0], x[1] - px[1])
    assert float(state.inner(removed, py).abs().max()) < 1e-10 * float(scale**2)
    # the orbit directions of the group project to zero
    vertical = state.vertical(state.vertical_coefficient(x))
    size = float(torch.cat([t.reshape(-1) for t in vertical]).norm())
    left = torch.cat([t.reshape(-1) for t in state.project_horizontal(vertical)])
    assert size > 0 and float(left.norm()) < 1e-10 * size


def test_gradient_duality(case):
    _, _, state, gen = case
    e, x = tangent(state.G, state.H, gen), tangent(state.G, state.H, gen)
    euclidean = (e[0] * x[0]).sum((-1, -2)) + (e[1] * x[1]).sum((-1, -2))
    assert torch.allclose(state.inner(state.egrad2rgrad(e), x), euclidean, rtol=1e-10)


def test_hot_path_equals_reference(case):
    _, _, state, gen = case
    x, u = tangent(state.G, state.H, gen), tangent(state.G, state.H, gen)
    assert rel(state.proju(x), state.project_horizontal(x)) < 1e-11
    assert rel(state.direction(u), state.project_horizontal(state.egrad2rgrad(u))) < 1e-11
    accel, saved = state.accelerate(x)
    assert rel(accel, state.geodesic_acceleration(x)) < 1e-12
    xs = tuple(t.clone().requires_grad_(True) for t in x)
    vjp = torch.autograd.grad(state.geodesic_acceleration(xs), xs, u)
    expected = (u[0] + 0.5 * vjp[0], u[1] + 0.5 * vjp[1])
    assert rel(state.pullback(x, u, saved), expected) < 1e-12
    assert rel(state.pullback(x, u), expected) < 1e-12


def test_a_state_reading_its_blocks_answers_as_one_holding_them(case):
    """The measures' states read ``(G, H)`` from the base point where used
    (``read_from_``): they answer as the state that holds them, bit for bit, and do use
    the reads (a reader of other blocks moves the answers)."""
    name, group, held, gen = case
    G, H = held.G, held.H

    def reader(g, h):
        return lambda side, dtype=None: (g if side == "G" else h).to(dtype or F64).clone()

    lazy = make_state(name, group, G, H).read_from_(reader(G, H))
    moved = make_state(name, group, G, H).read_from_(reader(2 * G, H))
    x, u = tangent(G, H, gen), tangent(G, H, gen)

    def answers(state):
        accel, saved = state.accelerate(x)
        draw = state.sample(torch.Generator().manual_seed(1))
        return [*state.proju(x), *state.direction(u), *accel, *state.pullback(x, u, saved), *draw]

    assert lazy._G is None and lazy._H is None
    assert all(torch.equal(a, b) for a, b in zip(answers(lazy), answers(held), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(answers(moved), answers(held), strict=True))


def metric_matrix(metric, G, H) -> torch.Tensor:
    """``M`` with ``g(xi, eta) = xi^T M eta`` at one pair ``(G, H)`` (``(1, n, h)``,
    ``(1, m, h)``), from ``inner`` on basis vectors."""
    d = G.numel() + H.numel()
    eye = torch.eye(d, dtype=F64)
    basis_g = eye[:, : G.numel()].reshape(d, *G.shape[1:])
    basis_h = eye[:, G.numel() :].reshape(d, *H.shape[1:])
    state = metric.state(G.expand(d * d, -1, -1), H.expand(d * d, -1, -1))
    left = (basis_g.repeat_interleave(d, 0), basis_h.repeat_interleave(d, 0))
    right = (basis_g.repeat(d, 1, 1), basis_h.repeat(d, 1, 1))
    return state.inner(left, right).reshape(d, d)


@pytest.mark.parametrize("name", list(METRICS))
def test_acceleration_solves_the_geodesic_equation(name):
    """``a = M^{-1} (v^T dM v / 2 - (dM . v) v)``, the Euler-Lagrange equation of the
    energy ``v^T M(q) v / 2``, with ``dM`` by central differences of ``M(q)``."""
    metric = METRICS[name]()
    G, H, gen = pair(7, B=1, n=3, m=2, h=2)
    v = tangent(G, H, gen)
    q = torch.cat([G.reshape(-1), H.reshape(-1)])
    vq = torch.cat([v[0].reshape(-1), v[1].reshape(-1)])
    ng = G.numel()

    def M(point):
        return metric_matrix(metric, point[:ng].view(G.shape), point[ng:].view(H.shape))

    step = 1e-5
    dM = torch.stack(
        [(M(q + step * e) - M(q - step * e)) / (2 * step) for e in torch.eye(len(q), dtype=F64)]
    )  # dM[k] = dM / dq_k
    force = 0.5 * torch.einsum("i,kij,j->k", vq, dM, vq) - torch.einsum("k,kij,j->i", vq, dM, vq)
    expected = torch.linalg.solve(M(q), force)
    aG, aH = metric.state(G, H).geodesic_acceleration(v)
    assert rel(torch.cat([aG.reshape(-1), aH.reshape(-1)]), expected) < 1e-7


@pytest.mark.parametrize(("name", "group"), [s for s in STATES if s[0] != "inv-eps"])
def test_sampler_is_equivariant(name, group):
    """The same generator state draws ``(xiG A, xiH A^{-T})`` for ``(G A, H A^{-T})``
    (``inv`` with ``eps`` is equivariant only up to ``O(eps)``)."""
    G, H, _ = pair(11)
    A = random_group_elements(group, G.shape[0], G.shape[-1], cond=5.0)
    Ait = torch.linalg.inv(A).mT
    sample = make_state(name, group, G, H).sample(torch.Generator().manual_seed(3))
    moved = make_state(name, group, G @ A, H @ Ait).sample(torch.Generator().manual_seed(3))
    assert rel(moved, (sample[0] @ A, sample[1] @ Ait)) < 1e-10


@pytest.mark.parametrize("name", list(METRICS))
def test_sampler_is_standard_gaussian_in_the_metric(name):
    """Over 20000 draws, ``E[g(s, a) g(s, b)] = g(a, b)`` for random tangents ``a, b``."""
    metric, draws = METRICS[name](), 20000
    G, H, gen = pair(5, B=1, n=4, m=3, h=2)
    s = metric.state(G.expand(draws, -1, -1), H.expand(draws, -1, -1)).sample(gen)
    M = metric_matrix(metric, G, H)
    S = torch.cat([s[0].reshape(draws, -1), s[1].reshape(draws, -1)], 1)
    dirs = torch.randn(4, M.shape[0], generator=gen, dtype=F64)
    coords = S @ M @ dirs.T  # g(s, a_k)
    gram = dirs @ M @ dirs.T
    scale = torch.sqrt(gram.diagonal()[:, None] * gram.diagonal()[None, :])
    assert float(((coords.T @ coords / draws - gram) / scale).abs().max()) < 0.06


def test_docs_geometry_measures_invariantly(capsys):
    """``docs/architecture.md`` runs as written: its new metric plugs into
    ``sharpness`` and the value does not move under a random symmetry transform."""
    namespace = dict(docs_example())
    blocks = re.findall(r"```python\n(.*?)```", ARCHITECTURE.read_text(), re.S)
    assert len(blocks) == 2
    exec(compile(blocks[1], "docs/architecture.md (block 2)", "exec"), namespace)
    before, after = namespace["before"], namespace["after"]
    assert before.geometry == "geodesic-wmix" and before.value > 0
    assert after.value == pytest.approx(before.value, rel=1e-9)
    assert "geodesic-wmix" in capsys.readouterr().out
