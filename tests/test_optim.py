"""GeodesicSAM: SAM and ASAM in one class, invariant in the geodesic geometries."""

from __future__ import annotations

import copy

import pytest
import torch

import geosharp
from geosharp.training.optim import GeodesicSAM
from zoo import encoder_case


def _closure(model, batch, loss_fn):
    def closure():
        loss = loss_fn(model, batch)
        loss.backward()
        return loss

    return closure


@pytest.mark.parametrize("measure", ["euclidean", "adaptive", "geodesic-inv", "geodesic-mix"])
def test_rho_zero_is_one_step_of_the_base_optimizer(measure):
    case = encoder_case()
    case.model.eval()
    reference = copy.deepcopy(case.model)
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    _closure(reference, case.batches[0], case.loss_fn)()
    sgd.step()
    opt = GeodesicSAM(case.model, torch.optim.SGD, rho=0.0, measure=measure, lr=0.1, momentum=0.9)
    opt.step(_closure(case.model, case.batches[0], case.loss_fn))
    for a, b in zip(case.model.parameters(), reference.parameters()):
        assert torch.equal(a, b)


def _ascent_loss(model, measure, batch, loss_fn):
    opt = GeodesicSAM(model, torch.optim.SGD, rho=0.05, measure=measure, lr=0.1)
    _closure(model, batch, loss_fn)()
    opt.first_step(zero_grad=True)
    with torch.no_grad():
        loss = float(loss_fn(model, batch))
    opt.restore()
    return loss


def test_ascent_loss_is_invariant_for_geodesic_sam_only():
    case = encoder_case()
    case.model.eval()
    other = copy.deepcopy(case.model)
    geosharp.reparameterize(other, seed=2, batch=case.inputs)
    batch = case.batches[0]
    for measure in ("geodesic-inv", "geodesic-mix"):
        a = _ascent_loss(case.model, measure, batch, case.loss_fn)
        b = _ascent_loss(other, measure, batch, case.loss_fn)
        assert b == pytest.approx(a, rel=1e-9)
    for measure in ("euclidean", "adaptive"):
        a = _ascent_loss(case.model, measure, batch, case.loss_fn)
        b = _ascent_loss(other, measure, batch, case.loss_fn)
        assert abs(a - b) > 1e-4 * abs(a)


def test_weights_restored_when_the_second_closure_raises():
    case = encoder_case()
    case.model.eval()
    before = [p.detach().clone() for p in case.model.parameters()]
    opt = GeodesicSAM(case.model, torch.optim.SGD, rho=0.1, lr=0.1)
    calls = []

    def closure():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        loss = case.loss_fn(case.model, case.batches[0])
        loss.backward()
        return loss

    with pytest.raises(RuntimeError, match="boom"):
        opt.step(closure)
    for p, q in zip(case.model.parameters(), before):
        assert torch.equal(p, q)
    opt.step(_closure(case.model, case.batches[0], case.loss_fn))  # usable again


def test_training_with_adamw_and_user_errors():
    case = encoder_case()
    case.model.eval()
    base = torch.optim.AdamW(case.model.parameters(), lr=3e-3)
    opt = GeodesicSAM(case.model, base, rho=0.05, measure="geodesic-mix")
    with torch.no_grad():
        first = float(case.loss_fn(case.model, case.batches[0]))
    for _ in range(15):
        opt.step(_closure(case.model, case.batches[0], case.loss_fn))
    with torch.no_grad():
        assert float(case.loss_fn(case.model, case.batches[0])) < 0.7 * first
    assert opt.state_dict()["state"]  # the base optimizer's state
    with pytest.raises(RuntimeError, match="second_step without first_step"):
        opt.second_step()
    with pytest.raises(ValueError, match="round ball"):
        GeodesicSAM(case.model, torch.optim.SGD, measure="adaptive-linf", lr=0.1)
    with pytest.raises(ValueError, match="without '-attn'"):
        GeodesicSAM(case.model, torch.optim.SGD, measure="adaptive-attn", lr=0.1)
    with pytest.raises(ValueError, match="rho"):
        GeodesicSAM(case.model, torch.optim.SGD, rho=-1.0, lr=0.1)


def test_manual_steps_with_autocast_and_gradient_clipping():
    case = encoder_case(torch.float32)
    case.model.eval()
    opt = GeodesicSAM(case.model, torch.optim.SGD, rho=0.05, lr=0.05)
    before = [p.detach().clone() for p in case.model.parameters()]
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            case.loss_fn(case.model, case.batches[0]).backward()
        norm = opt.first_step(zero_grad=True)
        assert norm > 0
        with torch.autocast("cpu", dtype=torch.bfloat16):
            case.loss_fn(case.model, case.batches[0]).backward()
        torch.nn.utils.clip_grad_norm_(case.model.parameters(), 1.0)
        opt.second_step(zero_grad=True)
    assert all(p.dtype == torch.float32 for p in case.model.parameters())
    assert any(not torch.equal(p, q) for p, q in zip(case.model.parameters(), before))
    assert all(torch.isfinite(p).all() for p in case.model.parameters())


def test_geodesic_sam_speaks_of_its_step_from_the_users_line():
    """Where part of the symmetry is not understood (attention in an opaque kernel),
    GeodesicSAM's warning speaks of its ascent step (it has no value nor
    result.symmetry), attributed to the line that built it."""
    from zoo import fused_attention

    class Kernel(torch.nn.Module):
        def __init__(self, dim=8, heads=2):
            super().__init__()
            self.heads = heads
            self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim) for _ in range(4))

        def forward(self, x):
            b, t, d = x.shape
            split = [
                f(x).view(b, t, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v)
            ]
            return self.o(fused_attention(*split).transpose(1, 2).reshape(b, t, d))

    model = Kernel()
    batch = torch.randn(2, 5, 8)
    symmetries = geosharp.find_symmetries(model, batch, warn=False)
    with pytest.warns(geosharp.SymmetryWarning) as caught:
        GeodesicSAM(model, torch.optim.SGD(model.parameters(), lr=0.1), symmetries=symmetries)
    message = str(caught[0].message)
    assert message.startswith("GeodesicSAM (geodesic-inv): ") and "ascent step" in message
    assert "the value" not in message and "result.symmetry" not in message
    assert caught[0].filename == __file__
