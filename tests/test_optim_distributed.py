"""GeodesicSAM under DistributedDataParallel (2 CPU processes, gloo).

With a synchronised first backward every process ascends along the global gradient,
so two processes on the two halves of a batch take the step one process takes on the
whole batch. With the first backward inside ``no_sync()`` (as SAM users run it) each
process ascends along its own half's gradient, and the second backward averages the
two ascent gradients: the step is the mean of the halves' SAM gradients, which one
process reproduces by hand. Either way the processes' weights stay identical.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from launch import run_python

TESTS = Path(__file__).resolve().parent
MEASURES = ("geodesic-inv", "adaptive")
MODES = ("sync", "no_sync")

WORKER = textwrap.dedent(
    """
    import contextlib, json, sys
    import torch
    sys.path.insert(0, sys.argv[2])
    torch.set_num_threads(1)
    from torch.nn.parallel import DistributedDataParallel
    from geosharp import distributed as gd
    from geosharp.training.optim import GeodesicSAM
    from zoo import encoder_case

    rank, world = gd.init()
    out = {}
    for measure in ("geodesic-inv", "adaptive"):
        for mode in ("sync", "no_sync"):
            case = encoder_case(dtype=torch.float64)
            model, loss_fn = case.model.eval(), case.loss_fn  # no dropout
            net = DistributedDataParallel(model) if world > 1 else model
            opt = GeodesicSAM(model, torch.optim.SGD, rho=0.1, measure=measure, lr=0.5)
            for step in range(3):
                x, y = case.batches[step % 2]
                if world > 1:  # this process's half of the batch
                    half = (x[rank::world], y[rank::world])
                    first = net.no_sync() if mode == "no_sync" else contextlib.nullcontext()
                    with first:
                        loss_fn(net, half).backward()
                    opt.first_step(zero_grad=True)
                    loss_fn(net, half).backward()
                    opt.second_step(zero_grad=True)
                elif mode == "sync":  # the whole batch in one process
                    loss_fn(model, (x, y)).backward()
                    opt.first_step(zero_grad=True)
                    loss_fn(model, (x, y)).backward()
                    opt.second_step(zero_grad=True)
                else:  # by hand: each half's ascent gradient, averaged, one base step
                    total = None
                    for r in range(2):
                        half = (x[r::2], y[r::2])
                        loss_fn(model, half).backward()
                        opt.first_step(zero_grad=True)
                        loss_fn(model, half).backward()
                        grads = [p.grad.clone() for p in model.parameters()]
                        opt.restore()
                        opt.zero_grad()
                        total = grads if total is None else [a + b for a, b in zip(total, grads)]
                    for p, g in zip(model.parameters(), total):
                        p.grad = g / 2
                    opt.base_optimizer.step()
                    opt.zero_grad()
            weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            out[f"{measure}/{mode}"] = weights.tolist()
    with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
        json.dump(out, f)
    """
)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sam_ddp")
    script = tmp / "worker.py"
    script.write_text(WORKER)
    runs = {}
    for nproc in (1, 2):
        out = tmp / f"world{nproc}"
        out.mkdir()
        run_python([str(script), str(out), str(TESTS)], nproc, timeout=300)
        runs[nproc] = [
            {k: torch.tensor(v, dtype=torch.float64) for k, v in json.loads(p.read_text()).items()}
            for p in sorted(out.glob("rank*.json"))
        ]
    assert [len(r) for r in runs.values()] == [1, 2]
    return runs


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("measure", MEASURES)
@pytest.mark.parametrize("mode", MODES)
def test_ddp_equals_one_process(weights, measure, mode):
    key = f"{measure}/{mode}"
    one = weights[1][0][key]
    for rank in weights[2]:
        assert _rel(rank[key], one) < 1e-10


@pytest.mark.parametrize("measure", MEASURES)
def test_no_sync_ascent_is_another_step(weights, measure):
    """The two modes differ: the comparison above can tell them apart."""
    one = weights[1][0]
    assert _rel(one[f"{measure}/no_sync"], one[f"{measure}/sync"]) > 1e-6
