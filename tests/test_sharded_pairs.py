"""Pair states on row shards: two gloo processes each hold half of the rows of every
pair and build their states with ``reduce=all_reduce_sum()``; every row-local result
(projection, direction, acceleration and its pullback, Riemannian gradient) equals the
whole pair's restricted to those rows, and every reduced one (inner product, residual,
vertical coefficient) equals the whole pair's, for ``inv`` (with and without ``eps``),
``mix`` and the rotary subgroup, in float64.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from geosharp.geometry.pairs import InvMetric, MixMetric
from launch import run_python

TESTS = Path(__file__).resolve().parent

WORKER = textwrap.dedent(
    """
    import json, sys
    import torch
    torch.set_num_threads(1)
    from geosharp import distributed as gd
    from geosharp.geometry.pairs import InvMetric, MixMetric
    from geosharp.geometry.subgroup import restrict_state

    rank, world = gd.init()
    F64 = torch.float64
    gen = torch.Generator().manual_seed(0)
    B, n, m, h = 3, 9, 7, 4

    def pair():
        return (torch.randn(B, n, h, generator=gen, dtype=F64),
                torch.randn(B, m, h, generator=gen, dtype=F64))

    (G, H), x, u = pair(), pair(), pair()
    rg, rh = torch.arange(rank, n, world), torch.arange(rank, m, world)  # this rank's rows

    def rows(t):
        return (t[0][:, rg], t[1][:, rh])

    def dev(a, b):
        return max(float((p - q).abs().max()) for p, q in zip(a, b))

    row_local = {  # state, whole (x, u) or their rows -> a tangent
        "proju": lambda s, x, u: s.proju(x),
        "project_horizontal": lambda s, x, u: s.project_horizontal(x),
        "direction": lambda s, x, u: s.direction(u),
        "egrad2rgrad": lambda s, x, u: s.egrad2rgrad(u),
        "accelerate": lambda s, x, u: s.accelerate(x)[0],
        "geodesic_acceleration": lambda s, x, u: s.geodesic_acceleration(x),
        "pullback": lambda s, x, u: s.pullback(x, u, s.accelerate(x)[1]),
    }
    reduced = {  # -> the same tensor on every rank
        "inner": lambda s, x, u: s.inner(x, u),
        "horizontal_residual": lambda s, x, u: s.horizontal_residual(x),
        "vertical_coefficient": lambda s, x, u: s.vertical_coefficient(x),
    }
    out = {}
    metrics = {"inv": InvMetric(), "inv-eps": InvMetric(eps=0.1), "mix": MixMetric()}
    for name, metric in metrics.items():
        for group in ("GL", "rotary"):
            whole = restrict_state(metric.state(G, H), group)
            sharded = metric.state(G[:, rg], H[:, rh], reduce=gd.all_reduce_sum())
            part = restrict_state(sharded, group)
            res = {k: dev(f(part, rows(x), rows(u)), rows(f(whole, x, u)))
                   for k, f in row_local.items()}
            res.update({k: float((f(part, rows(x), rows(u)) - f(whole, x, u)).abs().max())
                        for k, f in reduced.items()})
            out[f"{name}/{group}"] = res
    try:
        part.sample()
        out["sample"] = "ran"
    except NotImplementedError as e:
        out["sample"] = str(e)
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump({"world": world, "deviations": out}, f)
    """
)


@pytest.fixture(scope="module")
def deviations(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharded")
    script, result = tmp / "worker.py", tmp / "result.json"
    script.write_text(WORKER)
    run_python([str(script), str(result)], 2, timeout=300)
    return json.loads(result.read_text())


def test_two_processes_ran(deviations):
    assert deviations["world"] == 2


@pytest.mark.parametrize("metric", ["inv", "inv-eps", "mix"])
@pytest.mark.parametrize("group", ["GL", "rotary"])
def test_sharded_state_equals_the_whole_pair(deviations, metric, group):
    worst = deviations["deviations"][f"{metric}/{group}"]
    assert max(worst.values()) < 1e-10, worst


def test_sampler_needs_whole_pairs(deviations):
    assert "whole pairs" in deviations["deviations"]["sample"]


def test_identity_reduce_changes_nothing():
    """Without a process group the reduction is the identity: a state built with it is
    the plain state."""
    from geosharp.distributed import all_reduce_sum

    gen = torch.Generator().manual_seed(1)
    G, H = (torch.randn(2, 6, 3, generator=gen, dtype=torch.float64) for _ in range(2))
    x = (torch.randn_like(G), torch.randn_like(H))
    for metric in (InvMetric(), MixMetric()):
        plain, reduced = metric.state(G, H), metric.state(G, H, reduce=all_reduce_sum())
        assert all(torch.equal(a, b) for a, b in zip(plain.proju(x), reduced.proju(x)))


def test_a_shard_of_whole_heads_keeps_the_blocks_of_those_heads_only():
    """FSDP2's ``Shard(0)`` gives the first process the first half of the query, key and
    value heads, whole: its query/key stack keeps 2 of the 4 heads (the others' blocks
    would be zeros), while the value/output stack keeps all 4 (it holds some output rows
    of every head)."""
    from transformers import BertConfig, BertModel

    from geosharp.geometry.sharded import Shards, localize
    from geosharp.layout import ParameterLayout
    from geosharp.symmetry.discovery import find_symmetries

    config = BertConfig(vocab_size=8, hidden_size=16, num_hidden_layers=1,
                        num_attention_heads=4, intermediate_size=8)  # fmt: skip
    model = BertModel(config)
    symmetries = find_symmetries(model, warn=False)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    dims = {n: (0, 0, -(-p.shape[0] // 2)) for n, p in named}  # process 0 of 2
    local = [(n, p[: dims[n][2]]) for n, p in named]
    shards = Shards(ParameterLayout.from_named(named), ParameterLayout.from_named(local), dims,
                    reduce=lambda t: t, reduce_max=lambda t: t)  # fmt: skip
    stacks = {
        tuple(sorted({b.param.rsplit(".", 2)[-2] for b in s.specs[0].g_blocks})): s
        for s in localize(symmetries.pairs, shards, torch.device("cpu"))
    }
    qk, vo = stacks[("query",)], stacks[("value",)]
    assert qk.shapes[0][0] == qk.shapes[1][0] == 2 and qk.count == 4
    assert qk.heads.tolist() == [0, 1] and qk.owned.all()
    assert vo.shapes[0][0] == vo.shapes[1][0] == 4 and vo.heads is None


@pytest.mark.parametrize("metric", [InvMetric(), InvMetric(eps=1e-3), MixMetric()], ids=str)
def test_each_hot_path_step_sums_over_the_shards_in_one_collective(metric):
    """On row shards each step of Auto-PGD's hot path (acceleration, pullback,
    direction, projection) sums its ``h x h`` terms in one collective. Two processes
    holding the same rows are the pair with its rows twice: the reduction ``2 t`` gives
    that pair's values on those rows. The control: one call per ``h x h`` term (the
    per-term sums before fusion, 4, 4, 2 and 2) fails the count."""
    gen = torch.Generator().manual_seed(2)
    G, H = (
        torch.randn(3, 7, 4, generator=gen, dtype=torch.float64),
        torch.randn(3, 5, 4, generator=gen, dtype=torch.float64),
    )
    x, u = ((torch.randn_like(G), torch.randn_like(H)) for _ in range(2))
    calls = []

    def twice(t):
        calls.append(t.shape)
        return 2 * t

    shard = metric.state(G, H, reduce=twice)
    whole = metric.state(torch.cat([G, G], 1), torch.cat([H, H], 1))
    n, m = G.shape[1], H.shape[1]

    def doubled(t):
        return torch.cat([t[0], t[0]], 1), torch.cat([t[1], t[1]], 1)

    steps = {
        "accelerate": lambda s, d: s.accelerate(d(x))[0],
        "pullback": lambda s, d: s.pullback(d(x), d(u), saved[s is whole]),
        "direction": lambda s, d: s.direction(d(u)),
        "proju": lambda s, d: s.proju(d(x)),
    }
    saved = [state.accelerate(d(x))[1] for state, d in ((shard, lambda t: t), (whole, doubled))]
    for name, step in steps.items():
        calls.clear()
        got = step(shard, lambda t: t)
        assert len(calls) == 1, (name, calls)
        want = step(whole, doubled)
        for a, b, rows in zip(got, want, (n, m)):
            torch.testing.assert_close(a, b[:, :rows], rtol=1e-10, atol=1e-12)


# the operators that wait for the device: a value read on the host, or a shape that
# depends on values
HOST_READS = {"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal", "item"}


def _host_reads(step) -> list[str]:
    """The operators of ``step()`` that read values on the host."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in HOST_READS:
                self.seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    with Reads() as mode:
        step()
    return mode.seen


@pytest.mark.parametrize("group", ["GL", "rotary"])
@pytest.mark.parametrize("metric", [InvMetric(), InvMetric(eps=1e-3), MixMetric()], ids=str)
def test_the_pair_maths_of_a_step_never_waits_for_the_device(metric, group):
    """Auto-PGD's hot path on a stack of pairs (acceleration, pullback, direction,
    projection, inner product; with the rotary subgroup's restriction too) runs without
    reading a value on the host, so that on a GPU it queues without synchronising. The
    control: a ``.item()`` and a ``nonzero`` in the step are seen."""
    from geosharp.geometry.subgroup import restrict_state

    gen = torch.Generator().manual_seed(3)
    G, H = (torch.randn(3, n, 4, generator=gen, dtype=torch.float32) for n in (7, 5))
    x, u = ((torch.randn_like(G), torch.randn_like(H)) for _ in range(2))
    state = restrict_state(metric.state(G, H), group)

    def step():
        saved = state.accelerate(x)[1]
        with state.reading(torch.float32):
            state.pullback(x, u, saved)
            state.direction(u)
            state.proju(x)
        state.inner(x, u)

    assert _host_reads(step) == []
    seen = _host_reads(lambda: (step(), x[0].sum().item(), (u[0] > 0).nonzero()))
    assert seen == ["_local_scalar_dense.default", "nonzero.default"]
