"""The fast paths behind Auto-PGD's inner loop (no timing here: see benchmarks/).

* strided block access equals indexing, on every layout of the zoo and on random ones,
  and the segments and claimed entries found without listing positions equal those
  found from them;
* the fused pair kernels equal the reference maths of ``geometry.pairs``;
* the in-place space methods equal their allocating counterparts;
* one forward+backward per step (``n_iters + 2`` calls of ``loss_fn`` per batch), one
  parameter-sized allocation per step (the gradient's), no host synchronisation between
  checkpoints on the device path;
* autocast: forward/backward in bfloat16, geometry in float32, model untouched.
"""

from __future__ import annotations

import functools
import math
import weakref
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import geosharp
from census import alive, measure_only
from geosharp.geometry import Geometry, PerturbationSpace, stack_pairs
from geosharp.geometry.pairs import InvMetric, MixMetric
from geosharp.geometry.stacked import Pairs, PairSpace
from geosharp.layout import (
    ParameterLayout,
    _view,
    gather_strided,
    locate_segments,
    read_located,
    row_segments,
    strided_segments,
)
from geosharp.measures import apgd, auto_pgd, estimators
from geosharp.measures.apgd_step import StepKernel
from geosharp.params import functional_loss
from geosharp.symmetry.groups import read_block
from geosharp.symmetry.pairs import Block
from zoo import bert_case, encoder_case

F64 = torch.float64


def flat_setup(model):
    named = list(model.named_parameters())
    layout = ParameterLayout.from_named(named)
    theta = layout.flatten({n: p.detach() for n, p in named})
    return layout, theta


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


# -- strided block access ----------------------------------------------------------------


def test_strided_access_equals_indexing(case):
    layout, theta = flat_setup(case.model)
    pairs = geosharp.find_symmetries(case.model).pairs
    blocks = stack_pairs(pairs, layout, theta.device)
    assert blocks
    x = torch.randn_like(theta)
    claimed = torch.zeros(theta.numel(), dtype=torch.bool)
    for block in blocks:
        assert all(s is not None for s in block._segments)  # linear layers: strided
        # found from the blocks' row starts: the segments of the listed positions
        whole = (strided_segments(block.g_index), strided_segments(block.h_index))
        assert block._segments == whole
        for pos in block.positions():
            claimed[pos] = True
        G, H = block.gather(x)
        assert torch.equal(G, x[block.g_index]) and torch.equal(H, x[block.h_index])
        new = (torch.randn_like(G), torch.randn_like(H))
        ref = x.index_copy(0, block.g_index.reshape(-1), new[0].reshape(-1))
        ref = ref.index_copy(0, block.h_index.reshape(-1), new[1].reshape(-1))
        assert torch.equal(block.scatter_(x.clone(), new), ref)
        ref = x.clone().index_add_(0, block.g_index.reshape(-1), new[0].reshape(-1), alpha=0.5)
        ref = ref.index_add_(0, block.h_index.reshape(-1), new[1].reshape(-1), alpha=0.5)
        assert torch.allclose(block.add_(x.clone(), new, alpha=0.5), ref, rtol=0, atol=1e-15)
    params = {n: v.reshape(-1) for n, v in layout.unflatten(theta).items()}
    # every head of a linear layer is a strided view of its parameter
    assert all(b.view(params[b.param]) is not None for p in pairs for b in p.g_blocks + p.h_blocks)
    masks = PairSpace(Pairs(InvMetric()), pairs, layout, params, theta.device).claimed(params)
    none = torch.zeros(0, dtype=torch.bool)
    got = [masks.get(n, none.new_zeros(params[n].numel())) for n in layout.names]
    assert torch.equal(torch.cat(got), claimed) and set(masks) < set(layout.names)


def test_base_blocks_are_read_through_strided_views(architecture):
    """The pair states read the base point's blocks where used (``read_params``) through
    the stacks' strided segments, located in the parameters (no position listed), also
    for rows of several query heads sharing a key head; equal to reading them by index,
    cast in the same copy."""
    case = architecture.case()
    layout, theta = flat_setup(case.model)
    pairs = geosharp.find_symmetries(case.model, case.inputs).pairs
    params = {n: v.reshape(-1) for n, v in layout.unflatten(theta).items()}
    for block in stack_pairs(pairs, layout, theta.device):
        assert all(located is not None for located, _ in block._located)
        for side, index in (("G", block.g_index), ("H", block.h_index)):
            assert torch.equal(block.read_params(params, side), theta[index])
            assert torch.equal(block.read_params(params, side, torch.float32), theta[index].float())


def test_stacks_cut_into_runs_of_heads_give_the_same_values(architecture, monkeypatch):
    """A stack part is bounded by :func:`~geosharp.geometry.stacked.max_stack` entries and
    a pair of more is cut into runs of its heads: with every pair cut into single heads
    (also grouped-query and rotary ones), the measures take the same values as with
    whole pairs (in float64, to round-off), and the runs are single heads."""
    from geosharp.geometry import stacked

    case = architecture.case()
    data, kw = case.batches, dict(estimator=geosharp.WorstCase(n_iters=3))
    pairs = geosharp.find_symmetries(case.model, case.inputs).pairs
    whole = {
        m: geosharp.sharpness(case.model, data, case.loss_fn, m, 0.05, **kw).value
        for m in ("geodesic-inv", "geodesic-mix")
    }
    monkeypatch.setattr(stacked, "max_stack", lambda device, sharded=False: 1)
    layout = ParameterLayout.from_named(list(case.model.named_parameters()))
    stacks = stack_pairs(pairs, layout, torch.device("cpu"))
    assert len(stacks) == sum(p.shape[0] for p in pairs)
    assert all(s.shapes[0][0] == 1 for s in stacks)
    for measure, value in whole.items():
        cut = geosharp.sharpness(case.model, data, case.loss_fn, measure, 0.05, **kw).value
        assert cut == pytest.approx(value, rel=1e-12, abs=1e-15), measure


@pytest.mark.parametrize("seed", range(10))
def test_located_segments_read_blocks_out_of_their_parameters(seed):
    """A block's strided segments in a flat layout, located in the parameter they lie in,
    read it out of that parameter, cast and into any strides; a row that reaches past
    its parameter is not located, a parameter that is not contiguous not read."""
    gen = torch.Generator().manual_seed(seed)
    B, n, h = (int(v) for v in torch.randint(1, 6, (3,), generator=gen))
    b, r, c = torch.meshgrid(torch.arange(B), torch.arange(n), torch.arange(h), indexing="ij")
    sb, sr, sc = (int(v) for v in torch.randint(0, 40, (3,), generator=gen))
    index = 100 + b * (sb + n * h) + r * (sr + h * (sc + 1)) + c * (sc + 1)  # within "w"
    a, w = torch.randn(7, generator=gen, dtype=F64), torch.randn(20000, generator=gen, dtype=F64)
    layout = ParameterLayout.from_named([("a", a), ("w", w)])
    segments = strided_segments(index + 7)
    located = locate_segments(segments, layout, h)
    assert located is not None and {name for _, name in located} == {"w"}
    out = torch.empty((B, h, n), dtype=torch.float32).transpose(1, 2)
    assert read_located({"a": a, "w": w}, located, out)
    assert torch.equal(out, w[index].float())
    short = ParameterLayout.from_named([("a", a), ("w", w[: int(index.max())]), ("z", w)])
    assert locate_segments(segments, short, h) is None
    strided = torch.stack([w, w], 1)[:, 0]  # the same values, not contiguous
    assert torch.equal(strided, w) and not read_located({"a": a, "w": strided}, located, out)


def test_located_segments_cut_heads_that_lie_in_different_parameters():
    """The same block of two layers, one head each, a stride apart in the flat layout:
    one segment, located as one head in each parameter, and read out of both."""
    w0, w1 = torch.randn(6, 5, dtype=F64), torch.randn(6, 5, dtype=F64)
    layout = ParameterLayout.from_named([("w0", w0), ("w1", w1)])
    b, r, c = torch.meshgrid(torch.arange(2), torch.arange(5), torch.arange(3), indexing="ij")
    index = b * 30 + r + c * 5  # rows: input features; a head: 3 output rows
    segments = strided_segments(index)
    assert len(segments) == 1 and segments[0][1] == 2  # both heads in one segment
    located = locate_segments(segments, layout, 3)
    assert [name for _, name in located] == ["w0", "w1"]
    out = torch.empty(2, 5, 3, dtype=F64)
    assert read_located({"w0": w0, "w1": w1}, located, out)
    assert torch.equal(out, torch.cat([w0.reshape(-1), w1.reshape(-1)])[index])


@pytest.mark.parametrize("seed", range(40))
def test_strided_segments_random_layouts(seed):
    """Random (partly affine) index blocks: whenever segments are found they describe the
    index exactly; fully random indices fall back to indexing."""
    gen = torch.Generator().manual_seed(seed)
    B, n, h = (int(v) for v in torch.randint(1, 6, (3,), generator=gen))
    flat = torch.randn(20000, generator=gen)
    b, r, c = torch.meshgrid(torch.arange(B), torch.arange(n), torch.arange(h), indexing="ij")
    sb, sr, sc = (int(v) for v in torch.randint(0, 40, (3,), generator=gen))
    index = 100 + b * (sb + n * h) + r * sr + c * (sc + 1)
    if seed % 2:
        index[:, -1, :] = 15000 + b[:, -1, :] * h + c[:, -1, :]  # a bias row
    if seed % 5 == 0:
        index = torch.randint(0, 20000, (B, n, h), generator=gen)
    segments = strided_segments(index)
    block = Block("w", index)
    starts = block.starts()
    if starts is not None:  # the same segments without the column axis
        assert row_segments(*starts) == segments
    if seed % 5 and not seed % 2:  # separable: a strided view of distinct positions
        parts = (index[:, 0, 0], index[0, :, 0] - index[0, 0, 0], index[0, 0, :] - index[0, 0, 0])
        separable = Block.separable("w", *parts)
        view = separable.view(flat)
        if index.unique().numel() < index.numel():
            assert view is None  # repeated positions are never viewed
        if view is not None:
            assert torch.equal(view, flat[index])
            written = flat.clone()
            written[index] = -flat[index]
            view.neg_()
            assert torch.equal(flat, written)
        assert torch.equal(read_block({"w": flat}, separable), flat[index])
    if segments is None:  # random indices, or rows repeating positions (sr = 0)
        assert seed % 5 == 0 or (sr == 0 and n > 1)
        return
    out = gather_strided(flat, segments, index.shape)
    assert torch.equal(out, flat[index])


@pytest.mark.parametrize("held", ["HPHH", "PPHP", "HPPH", "PHHP", "HHHH"])
def test_rows_held_elsewhere_leave_the_held_rows_strided_views(held):
    """A sharded stack's bias rows, held here for some heads (``H``) and elsewhere for
    others (``P``, -1): every held row is covered by a strided view, whatever the order
    (a step back or onto a placeholder is not merged across heads), and nothing else."""
    from geosharp.geometry.sharded import _held_segments

    B, n, h = len(held), 3, 4
    b, r, c = torch.meshgrid(torch.arange(B), torch.arange(n), torch.arange(h), indexing="ij")
    index = 100 + b * n * h + r * h + c  # a weight block: every row held
    bias = 500 + b[:, 0, :] * h + c[:, 0, :]
    index[:, -1, :] = torch.where(torch.tensor([x == "H" for x in held])[:, None], bias, -1)
    segments = _held_segments(index)
    assert segments is not None
    flat = torch.randn(1000)
    out = torch.zeros(index.shape)
    for seg in segments:
        b0, nb, r0, nr = seg[:4]
        out[b0 : b0 + nb, r0 : r0 + nr] = _view(flat, seg, h)
    held_rows = index >= 0
    assert torch.equal(out[held_rows], flat[index[held_rows]])
    assert not out[~held_rows].any()


def test_gather_under_autograd_uses_indexing():
    """Strided views would make autograd's backward allocate a full vector per segment:
    a vector that requires grad is gathered by indexing (and stays differentiable)."""
    case = encoder_case(dtype=F64)
    layout, theta = flat_setup(case.model)
    (block, *_) = stack_pairs(geosharp.find_symmetries(case.model).pairs, layout, theta.device)
    x = theta.clone().requires_grad_(True)
    G, H = block.gather(x)
    (G.sum() + 2 * H.sum()).backward()
    expected = torch.zeros_like(theta)
    expected[block.g_index.reshape(-1)] += 1
    expected[block.h_index.reshape(-1)] += 2
    assert torch.equal(x.grad, expected)


# -- fused pair kernels against pairs.py ---------------------------------------------------


def pair_states(dtype_seed: int):
    gen = torch.Generator().manual_seed(dtype_seed)
    G = torch.randn(5, 11, 4, generator=gen, dtype=F64)
    H = torch.randn(5, 9, 4, generator=gen, dtype=F64)
    A = torch.randn(5, 4, 4, generator=gen, dtype=F64) + 3 * torch.eye(4, dtype=F64)
    G, H = G @ A, H @ torch.linalg.inv(A).mT  # some conditioning
    return {
        "inv": InvMetric().state(G, H),
        "inv-eps": InvMetric(eps=0.1).state(G, H),
        "mix": MixMetric().state(G, H),
    }, gen


@pytest.mark.parametrize("metric", ["inv", "inv-eps", "mix"])
@pytest.mark.parametrize("seed", [0, 1])
def test_pair_kernels_match_reference(metric, seed):
    states, gen = pair_states(seed)
    state = states[metric]
    x = (
        torch.randn(state.G.shape, generator=gen, dtype=F64),
        torch.randn(state.H.shape, generator=gen, dtype=F64),
    )
    u = (
        torch.randn(state.G.shape, generator=gen, dtype=F64),
        torch.randn(state.H.shape, generator=gen, dtype=F64),
    )

    accel, saved = state.accelerate(x)
    for a, b in zip(accel, state.geodesic_acceleration(x)):
        assert rel(a, b) < 1e-13

    xs = tuple(t.clone().requires_grad_(True) for t in x)
    vjp = torch.autograd.grad(state.geodesic_acceleration(xs), xs, u)
    for pulled in (state.pullback(x, u, saved), state.pullback(x, u)):
        for a, b, c in zip(pulled, u, vjp):
            assert rel(a, b + 0.5 * c) < 1e-13

    for a, b in zip(state.proju(x), state.project_horizontal(x)):
        assert rel(a, b) < 1e-12
    for a, b in zip(state.direction(u), state.project_horizontal(state.egrad2rgrad(u))):
        assert rel(a, b) < 1e-12


@pytest.mark.parametrize("metric", ["inv", "inv-eps", "mix"])
def test_pair_copies_live_for_one_pass(metric):
    """The ``h x h`` matrices in a float32 tangent's dtype are made once per pass
    (``reading``), shared by its calls, and freed at its end: between passes (the
    forward and backward) a state holds its float64 factors only; outside a pass each
    call makes its own, with the same values."""
    states, gen = pair_states(4)
    state = states[metric]
    x = tuple(torch.randn(t.shape, generator=gen).float() for t in (state.G, state.H))
    alone = state.pullback(x, x, state.accelerate(x)[1])
    assert "_pass" not in vars(state) or vars(state)["_pass"] is None
    with state.reading(torch.float32) as inside:
        first = inside._operands(torch.float32)
        assert first[2] is inside._operands(torch.float32)[2]  # made once in the pass
        made = dict(vars(state)["_pass"])
        assert {name for name, _ in made} >= {"P_inv", "Q_inv"}
        kept = [weakref.ref(t) for t in made.values()]
        within = inside.pullback(x, x, inside.accelerate(x)[1])
    del first, made
    assert vars(state)["_pass"] is None and all(r() is None for r in kept)
    for a, b in zip(within, alone):
        assert torch.equal(a, b)


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_pair_kernels_float32(metric):
    """In float32 the large products run in float32 and the h x h solve in float64: the
    direction stays within round-off of the float64 reference."""
    states, gen = pair_states(3)
    state = states[metric]
    g = (
        torch.randn(state.G.shape, generator=gen, dtype=F64),
        torch.randn(state.H.shape, generator=gen, dtype=F64),
    )
    exact = state.project_horizontal(state.egrad2rgrad(g))
    fast = state.direction(tuple(t.float() for t in g))
    assert all(t.dtype == torch.float32 for t in fast)
    for a, b in zip(fast, exact):
        assert rel(a.double(), b) < 1e-5


# -- in-place space methods ------------------------------------------------------------------

GEOMETRIES = [
    ("euclidean", "inv", 0.0, "straight"),
    ("adaptive", "inv", 0.0, "straight"),
    ("adaptive", "inv", 0.0, "exp"),
    ("geodesic", "inv", 0.0, "straight"),
    ("geodesic", "inv", 0.05, "straight"),
    ("geodesic", "mix", 0.0, "exp"),
    ("geodesic-norm-only", "mix", 0.0, "straight"),
    ("geodesic-curvature-only", "inv", 0.0, "straight"),
]


@pytest.fixture(scope="module")
def encoder():
    case = encoder_case(dtype=F64)
    layout, theta = flat_setup(case.model)
    return case, layout, theta, geosharp.find_symmetries(case.model).pairs


@pytest.mark.parametrize("name,metric,eps,step", GEOMETRIES)
def test_inplace_methods_match(encoder, name, metric, eps, step):
    _, layout, theta, pairs = encoder
    geometry = Geometry.named(name, metric=metric, eps=eps, elementwise_step=step)
    space = PerturbationSpace(theta, layout, pairs, geometry)
    kernel = StepKernel(space)
    gen = torch.Generator().manual_seed(0)
    xi = space.proju(0.01 * torch.randn(theta.shape, generator=gen, dtype=F64) * theta.abs())
    xp = space.proju(0.01 * torch.randn(theta.shape, generator=gen, dtype=F64) * theta.abs())
    egrad = torch.randn(theta.shape, generator=gen, dtype=F64)

    # retr_ == retr
    out = torch.empty_like(theta)
    step = space.retr_(xi, out)
    assert torch.allclose(out, space.retr(xi), rtol=1e-14, atol=1e-15)

    # pullback_ == autograd through retr
    x = xi.clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(space.retr(x), x, egrad)
    pulled = space.pullback_(step, egrad.clone())
    assert rel(pulled, expected) < 1e-13

    # direction_ + combine_ == kx xi + kd d + kxp xp with d = proju(egrad2rgrad(g))
    d = space.proju(space.egrad2rgrad(pulled))
    work = pulled.clone()
    sq, _ = kernel.direction_(work)
    assert math.isclose(float(sq), float(space.inner(d, d)), rel_tol=1e-10)
    kd, kx, kp = (torch.tensor(v, dtype=F64) for v in (0.3, 0.9, -0.2))
    kernel.combine_(work, kd, xi, kx, xp, kp)
    assert rel(work, 0.3 * d + 0.9 * xi - 0.2 * xp) < 1e-12
    # direction_ reads the Euclidean <xi, g>, <xp, g> in the same pass
    again = pulled.clone()
    sq2, (dx, dp) = kernel.direction_(again, xi, xp)
    assert float(sq2) == float(sq)
    assert math.isclose(float(dx), float(torch.dot(xi, pulled)), rel_tol=1e-12)
    assert math.isclose(float(dp), float(torch.dot(xp, pulled)), rel_tol=1e-12)
    # ascent_ == pullback_ then direction_ (one pass over the pair blocks where fused),
    # also from the retraction's matrices made again without a point
    fused = egrad.clone()
    sq3, (dx3, dp3) = kernel.ascent_(kernel.retraction(xi), fused, xi, xp)
    assert rel(fused, again) < 1e-13
    for got, want in ((sq3, sq2), (dx3, dx), (dp3, dp)):
        assert math.isclose(float(got), float(want), rel_tol=1e-12)
    # the step's point written in the same pass as the step, over xp's buffer
    if kernel.fused_step:
        point = xp.clone()
        kernel.combine_(again, kd, xi, kx, point, kp, point=point)
        space.retr_(again, point, written=True)
        assert torch.equal(again, work)
        assert torch.allclose(point, space.retr(work), rtol=1e-14, atol=1e-15)
    else:
        with pytest.raises(ValueError, match="exponential"):
            kernel.combine_(again, kd, xi, kx, xp, kp, point=xp.clone())
    # <xi, d>_g equals the Euclidean <xi, egrad> (xi horizontal): the loop relies on it
    assert math.isclose(float(space.inner(xi, d)), float(torch.dot(xi, pulled)), rel_tol=1e-9)


def test_the_loop_keeps_no_retraction_past_its_step(encoder):
    """What a retraction saves for the pullback (``h x h`` matrices per stack part) is
    released once the step has used it: small tensors kept through the next step's
    block temporaries pin the C heap under them (kept one step longer, they made a 1.1B
    LLaMA's geodesic measure peak 7685 MiB over the loaded model instead of 3608)."""
    _, layout, theta, pairs = encoder
    space = PerturbationSpace(theta, layout, pairs, Geometry.named("geodesic", "inv"))
    made, alive, retr_ = [], [], space.retr_

    def recorded(xi, out, written=False):
        step = retr_(xi, out, written=written)
        made.append([weakref.ref(t) for kept in step.saved for t in kept])
        return step

    def loss_grad(point, out):
        return (point * point).sum(), out.copy_(2 * point)

    def callback(event, i, iterate):
        if event == "evaluate":  # after the retraction, before the forward
            alive.append(sum(r() is not None for refs in made[:-1] for r in refs))

    space.retr_ = recorded
    auto_pgd(loss_grad, space, 0.05, 8, callback=callback)
    assert len(made) >= 9 and all(made) and alive[1:] and max(alive) == 0


@pytest.mark.parametrize("frozen", [False, True])
def test_scaling_outside_pairs_keeps_the_claimed_entries(frozen):
    """``c x`` on the entries no pair ball claims (zero where ``c = 0``), the claimed
    ones untouched, and the sum of squares over the former: with parameters wholly,
    partly and not claimed, and with no parameter free of claims."""
    from geosharp.geometry.elementwise import ElementwiseSpace

    gen = torch.Generator().manual_seed(0)
    params = {n: torch.randn(12, generator=gen, dtype=F64) for n in "abdc"}
    if frozen:  # entries that cannot move (c = 0), in a partly claimed parameter and in a
        params["c"][[1, 5]] = 0.0  # free one that shares its run with another
        params["d"][[0, 11]] = 1e-200  # below sqrt(tiny): frozen, though not 0
    layout = ParameterLayout.from_named(list(params.items()))
    partial = torch.zeros(12, dtype=torch.bool)
    partial[3:8] = True
    claimed = {"a": torch.ones(12, dtype=torch.bool), "c": partial}
    space = ElementwiseSpace(Geometry.named("adaptive").elementwise, params, layout, claimed)
    x = torch.randn(48, generator=gen, dtype=F64)
    mine = torch.cat([claimed.get(n, torch.zeros(12, dtype=torch.bool)) for n in "abdc"])
    c = layout.flatten(params).abs()
    c[c <= torch.finfo(F64).tiny ** 0.5] = 0.0
    expected = torch.where(mine, x, c * x)
    sq, _ = space.direction_(out := x.clone())
    assert torch.equal(out, expected)
    assert math.isclose(float(sq), float((expected[~mine] ** 2).sum()), rel_tol=1e-14)
    kinds = [run.kind for run in space.runs]
    assert kinds == ["claimed", "free", "mixed"] and space.runs[1].frozen == frozen
    # the dots read before the scaling: over every entry, or the unclaimed ones only
    y = torch.randn(48, generator=gen, dtype=F64)
    for claimed_too, over in ((True, torch.ones_like(mine)), (False, ~mine)):
        sq2, (dot,) = space.direction_(out := x.clone(), [y], claimed=claimed_too)
        assert torch.equal(out, expected) and float(sq2) == float(sq)
        assert math.isclose(float(dot), float((y * x)[over].sum()), rel_tol=1e-13)
    # no free run at all: the mixed one alone
    alone = ElementwiseSpace(
        Geometry.named("adaptive").elementwise, {"c": params["c"]},
        ParameterLayout.from_named([("c", params["c"])]), {"c": partial},
    )  # fmt: skip
    sq, _ = alone.direction_(out := x[36:].clone())
    assert [run.kind for run in alone.runs] == ["mixed"]
    assert torch.equal(out, expected[36:])
    assert math.isclose(float(sq), float((expected[36:][~partial] ** 2).sum()), rel_tol=1e-14)


def _tensors(obj, seen=None):
    """Every tensor reachable from ``obj`` through attributes, lists, tuples and dicts."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)):
        items = list(vars(obj).values())
    else:
        return []
    return [t for item in items for t in _tensors(item, seen)]


@pytest.mark.parametrize("name", ["adaptive", "geodesic"])
def test_space_keeps_no_parameter_sized_vector(name):
    """Built on the model's own tensors, the space reads them in place, the pair states'
    blocks too (read where used): what it holds beyond them is the states' h x h
    matrices and nothing parameter-sized, also after its passes (a pass's scratch
    buffer is freed at its end, not held through the forward and backward)."""
    case = encoder_case(dtype=torch.float32)
    named = list(case.model.named_parameters())
    layout = ParameterLayout.from_named(named)
    pairs = geosharp.find_symmetries(case.model).pairs
    space = PerturbationSpace(
        {n: p.detach() for n, p in named}, layout, pairs, Geometry.named(name)
    )
    own = {p.untyped_storage().data_ptr() for _, p in named}

    def held_by_space() -> dict:
        return {
            t.untyped_storage().data_ptr(): t
            for t in _tensors(space)
            if t.untyped_storage().data_ptr() not in own
        }

    small = 8 * 10 * sum(s.shape[0] * s.shape[3] ** 2 for s in pairs)  # h x h, float64
    bound = small if name == "geodesic" else 0
    held = held_by_space()
    assert sum(t.untyped_storage().nbytes() for t in held.values()) <= bound
    g, x = torch.randn(layout.numel), torch.randn(layout.numel)
    kernel = StepKernel(space)
    kernel.direction_(g)
    one = torch.ones(())
    kernel.combine_(g, one, x, one)
    assert sum(t.untyped_storage().nbytes() for t in held_by_space().values()) <= bound
    # no pair's block (heads, n, h): every held tensor is smaller than the smallest
    stacks = {}  # a stack's h x h matrices: (heads of pairs of one shape, h, h)
    for s in pairs:
        stacks[s.shape[1:]] = stacks.get(s.shape[1:], 0) + s.shape[0] * s.shape[3] ** 2
    squares = max(stacks.values())
    assert squares < min(s.shape[0] * min(s.shape[1:3]) * s.shape[3] for s in pairs)
    assert all(t.numel() <= squares for t in held.values())
    assert not any(t.dtype == torch.long for t in _tensors(space))  # no index tensors
    # exact zeros cannot move with the relative scale: the mask of frozen entries
    adaptive = Geometry.named("adaptive")
    before = PerturbationSpace(dict(named), layout, pairs, adaptive).elementwise.active
    n_before = 0 if before is None else int((~before).sum())
    with torch.no_grad():
        case.model.head.bias.zero_()
    after = PerturbationSpace(dict(named), layout, pairs, adaptive).elementwise.active
    assert after is not None and int((~after).sum()) == n_before + case.model.head.bias.numel()
    unfrozen = {n: p.detach().abs() + 1 for n, p in named}
    assert PerturbationSpace(unfrozen, layout, pairs, adaptive).elementwise.active is None


# -- the loop: calls, allocations, synchronisation -------------------------------------------


def test_one_forward_backward_per_step():
    """Per batch: the unperturbed loss, its floor (the outputs rounded, without
    gradient), the start point, one call per step (the best point's gradient kept for
    restarts; else see the next test). A geometry with pairs
    first finds them: two calls on the first batch (the traced forward pass, then the
    inputs of the modules whose pairs are verified)."""
    case = bert_case(dtype=torch.float32)
    calls = []

    def loss_fn(model, batch):
        calls.append(torch.is_grad_enabled())
        return case.loss_fn(model, batch)

    for kw in (
        dict(measure="adaptive"),
        dict(measure="geodesic-mix"),
        dict(measure="adaptive-linf"),
    ):
        calls.clear()
        geosharp.sharpness(
            case.model,
            case.batches,
            loss_fn,
            rho=0.01,
            **kw,
            estimator=geosharp.WorstCase(n_iters=7),
        )
        # the pairs found and verified, else one forward that settles the dtypes
        setup = 2 if kw["measure"].startswith("geodesic") else 1
        assert len(calls) == len(case.batches) * (7 + 3) + setup
        assert calls.count(False) == len(case.batches) + setup  # the floors, the set-up


@pytest.mark.parametrize("measure", ["adaptive", "geodesic-inv", "adaptive-linf"])
def test_a_restart_evaluates_the_best_point_again_as_an_iteration(measure, monkeypatch):
    """A restart back to a best point other than the current iterate evaluates it again
    in the next iteration (its gradient is not kept): as many calls as the reference,
    which keeps the gradient and steps from the best point at once; the same run up to
    that restart, and the best point's loss again; the device path (``torch.where``,
    no host reads) takes the same steps."""
    case = encoder_case(dtype=F64)
    calls = []

    def loss_fn(model, batch):
        calls.append(1)
        return case.loss_fn(model, batch)

    n_iters, results = 20, {}
    reference = functools.partial(apgd.auto_pgd, keep_best_gradient=True)
    for kept in (False, True):
        calls.clear()
        with mock.patch.object(estimators, "auto_pgd", reference if kept else apgd.auto_pgd):
            results[kept] = geosharp.sharpness(
                case.model,
                case.batches,
                loss_fn,
                measure=measure,
                rho=4 * geosharp.DEFAULT_RHO[measure],
                estimator=geosharp.WorstCase(n_iters=n_iters),
            )
        results[kept].calls = len(calls)
    ours, kept = results[False], results[True]
    # the pairs found and verified, else one forward that settles the dtypes; per
    # batch, the unperturbed loss and its floor
    setup = 2 if measure.startswith("geodesic") else 1
    assert ours.calls == kept.calls == len(case.batches) * (n_iters + 3) + setup
    assert ours.settings["restart"] == "revisit"
    revisits = 0
    for a, b in zip(ours.traces, kept.traces):
        assert len(a.losses) == len(b.losses) == n_iters + 1
        back = [m for m in a.restarts if a.losses[m] < a.best[m]]  # away from the iterate
        first = back[0] if back else n_iters
        assert a.losses[: first + 1] == b.losses[: first + 1]
        for m in back:
            assert a.losses[m + 1] == a.best[m]
        revisits += len(back)
    assert revisits > 0
    monkeypatch.setattr(apgd, "_HOST_DEVICES", ())
    device = geosharp.sharpness(
        case.model,
        case.batches,
        case.loss_fn,
        measure=measure,
        rho=4 * geosharp.DEFAULT_RHO[measure],
        estimator=geosharp.WorstCase(n_iters=n_iters),
    )
    assert [t.losses for t in device.traces] == [t.losses for t in ours.traces]
    assert device.per_batch == ours.per_batch


class _LargeAllocations(TorchDispatchMode):
    """Counts new (non-aliasing) outputs of parameter size."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        if returns and returns[0].alias_info is None:
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.numel() == self.numel:
                    self.count += 1
        return out


@pytest.mark.parametrize(
    "kw",
    [
        dict(measure="adaptive"),
        dict(measure="geodesic-inv"),
        dict(measure="adaptive-linf"),
    ],
)
def test_parameter_sized_allocations_per_step(kw):
    """A step allocates nothing parameter-sized once the loop holds its buffers (they are
    recycled): a run three times longer allocates no more. A short run may allocate
    fewer: the best point takes a buffer of its own only once the iterate has moved past
    it."""
    case = encoder_case(dtype=torch.float32)
    _, theta = flat_setup(case.model)
    counts = []
    for n_iters in (3, 27, 81):
        evaluations = []

        def count(event, i, iterate, evaluations=evaluations):
            evaluations += [i] if event == "evaluate" else []

        with _LargeAllocations(theta.numel()) as mode:
            geosharp.sharpness(
                case.model,
                case.batches[:1],
                case.loss_fn,
                rho=0.01,
                callback=count,
                **kw,
                estimator=geosharp.WorstCase(n_iters=n_iters),
            )
        counts.append(mode.count)
    assert counts[0] <= counts[1] == counts[2], counts


@pytest.mark.parametrize("measure", ["adaptive", "geodesic-inv", "adaptive-linf"])
def test_parameter_sized_vectors_alive_at_each_evaluation(measure):
    """After each evaluation the loop holds ``xi``, its previous and best values and the
    gradient, written over the point it was evaluated at: 4 parameter-sized vectors, the
    gradient being the training step's own (no copy of the best point's gradient); the
    model's own tensors are not copied. The best point is the iterate itself while it is
    the best (no copy): one vector fewer until the iterate first moves past it (then a
    freed buffer is kept for reuse)."""
    case = encoder_case(dtype=torch.float32)
    numel = sum(p.numel() for p in case.model.parameters())
    counts = []

    before = set(alive(numel))  # the model's own, and what other tests left

    def census(event, i, iterate):
        if event == "evaluated" and i > 0:
            counts.append(len(set(alive(numel)) - before))

    with measure_only():
        result = geosharp.sharpness(
            case.model, case.batches[:1], case.loss_fn, measure, 0.5, callback=census,
            estimator=geosharp.WorstCase(n_iters=8),
        )  # fmt: skip
    full = 4
    best = result.traces[0].best
    assert best[1] > best[0] and counts[0] == full - 1, counts  # the start, held as best
    assert max(counts) == full, counts  # once the iterate has moved past the best


def test_no_host_synchronisation_between_checkpoints(monkeypatch):
    """The device path (``torch.where`` for the best point) reads nothing from the device
    but at checkpoints (one read each) and once at the end (the trace)."""
    monkeypatch.setattr(apgd, "_HOST_DEVICES", ())
    case = encoder_case(dtype=torch.float32)
    layout, theta = flat_setup(case.model)
    sym = geosharp.find_symmetries(case.model)
    space = PerturbationSpace(theta, layout, sym.pairs, Geometry.named("geodesic", "inv"))
    evaluate = functional_loss(case.model, case.loss_fn)

    def loss_grad(point, out):
        point = point.detach().requires_grad_(True)
        loss = evaluate(layout.unflatten(point), case.batches[0])
        return loss.detach(), out.copy_(torch.autograd.grad(loss, point)[0])

    reads = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _original=original, _name=name, **k):
            reads.append(_name)
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    n_iters = 12
    auto_pgd(loss_grad, space, 0.01, n_iters)
    monkeypatch.undo()
    marks = len(apgd.checkpoints(n_iters))
    assert len(reads) == marks + 2 and set(reads) == {"tolist"}, reads


# -- autocast ----------------------------------------------------------------------------------


def test_autocast_bfloat16_close_to_float32():
    case = bert_case(dtype=torch.float32)
    model = case.model.eval()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    kw = dict(measure="geodesic-inv", rho=0.05, estimator=geosharp.WorstCase(6))
    ref = geosharp.sharpness(model, case.batches, case.loss_fn, **kw)
    bf = geosharp.sharpness(model, case.batches, case.loss_fn, autocast_dtype=torch.bfloat16, **kw)
    assert bf.settings["autocast"] == "bfloat16" and ref.settings["autocast"] is None
    assert bf.value > 0 and math.isfinite(bf.value)
    assert bf.loss == pytest.approx(ref.loss, rel=2e-2)
    assert bf.value == pytest.approx(ref.value, rel=0.25)
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p.detach(), before[n])
    with pytest.raises(ValueError, match="autocast_dtype"):
        geosharp.sharpness(model, case.batches, case.loss_fn, autocast_dtype=torch.float64)


def test_per_batch_generators_make_values_independent_of_order():
    """Batch i's random start comes from its own generator: measuring a batch alone (at
    the same index) gives the value it gets among the others."""
    case = encoder_case(dtype=F64)
    kw = dict(rho=0.05, estimator=geosharp.WorstCase(3, starts="random"), seed=7)
    full = geosharp.sharpness(case.model, case.batches, case.loss_fn, **kw)
    first = geosharp.sharpness(case.model, case.batches[:1], case.loss_fn, **kw)
    assert full.per_batch[0] == first.per_batch[0]
    assert full.per_batch[0] != full.per_batch[1]


@pytest.mark.parametrize("name", ["adaptive", "geodesic", "geodesic-curvature-only"])
def test_cached_scale_changes_no_value(encoder, name):
    """``cache_scale=True`` (the default mode of ``sharpness``) keeps ``c`` as one vector;
    every result is bit-identical to the piece-wise computation."""
    _, layout, theta, pairs = encoder
    geometry = Geometry.named(name)
    lean = PerturbationSpace(theta, layout, pairs, geometry)
    cached = PerturbationSpace(theta, layout, pairs, geometry, cache_scale=True)

    def parameter_sized(space):
        return sum(t.numel() == space.numel and t.dim() == 1 for t in _tensors(space))

    assert parameter_sized(cached) == parameter_sized(lean) + 1  # c, kept
    assert torch.equal(lean.elementwise.scale, cached.elementwise.scale)
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(theta.shape, generator=gen, dtype=F64)
    lean_c, cached_c = lean.elementwise, cached.elementwise
    assert torch.equal(lean_c.scale_(g.clone(), 2), cached_c.scale_(g.clone(), 2))
    assert torch.equal(lean.egrad2rgrad(g), cached.egrad2rgrad(g))
    a, b = g.clone(), g.clone()
    assert torch.equal(StepKernel(lean).direction_(a)[0], StepKernel(cached).direction_(b)[0])
    assert torch.equal(a, b)


# -- the gradient written over its point ------------------------------------------------


class _DetachedRead(torch.nn.Module):
    """``b.weight`` read without a gradient before its differentiable use: backward
    needs its values after their gradient is complete (``copy``: a copy is read)."""

    def __init__(self, copy: bool):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.copy = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), copy

    def forward(self, x):
        w = self.b.weight.detach()
        h = torch.tanh(self.a(x)) @ (w.clone() if self.copy else w).T
        return self.b(torch.tanh(h)).square().mean()


def test_gradient_written_over_its_point_is_the_gradient():
    from geosharp.measures.backends import LossGrad

    case = encoder_case(dtype=torch.float64)
    case.model.eval()
    layout, theta = flat_setup(case.model)
    objective = LossGrad(functional_loss(case.model, case.loss_fn), layout, case.batches[0], _null)
    point = theta + 0.01 * torch.randn(theta.shape, dtype=theta.dtype)
    value, grad = objective(point.clone(), torch.empty_like(point))
    shared = point.clone()
    value_shared, out = objective(shared, shared)
    assert out is shared and float(value_shared) == float(value)
    assert torch.equal(out, grad)


def test_a_point_read_after_its_gradient_is_evaluated_again_with_separate_buffers():
    """Where backward reads a weight's values after its gradient replaced them, the
    version check catches it (:class:`PointOverwritten`) and Auto-PGD evaluates again
    with separate buffers: the value is that of the same function without the read."""
    from geosharp.measures.apgd import PointOverwritten
    from geosharp.measures.backends import LossGrad

    def loss(model, batch):
        return model(batch)

    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    model = _DetachedRead(copy=False)
    layout, theta = flat_setup(model)
    objective = LossGrad(functional_loss(model, loss), layout, x, _null)
    with pytest.raises(PointOverwritten):
        shared = theta.clone()
        objective(shared, shared)
    kw = dict(estimator=geosharp.WorstCase(n_iters=4))
    read = geosharp.sharpness(model, [x], loss, "adaptive", 0.1, **kw)
    copied = geosharp.sharpness(_DetachedRead(copy=True), [x], loss, "adaptive", 0.1, **kw)
    assert read.value == copied.value and read.traces[0].losses == copied.traces[0].losses


def _null():
    import contextlib

    return contextlib.nullcontext()
