"""A half-precision model's perturbed linear layers multiply in the model's own
precision: the weight's product plus the perturbation's in half-precision parts, each
accumulated in float32 (``geosharp.measures.backends.split``). Checked against float64
products, against the float32 path it replaces (within the reported floor, which does
not grow), and by counting the float32 share of a measure's matrix-product FLOPs."""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import geosharp
from geosharp.measures.backends import split as products
from hf_zoo import build

HALVES = [torch.bfloat16, torch.float16]
# the half-precision output's unit in the last place, relative
ULP = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _layer(half, rho=0.05, seed=0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(24, 40, generator=g).to(half)  # (out, in)
    point = weight.float() * (1 + rho * torch.randn(24, 40, generator=g))
    x = torch.randn(3, 5, 40, generator=g).to(half)
    return x, weight, point


@pytest.mark.parametrize("half", HALVES)
def test_the_parts_carry_the_perturbation_to_under_2_to_the_minus_16_of_itself(half):
    _, weight, point = _layer(half, rho=1e-3)
    d = point - weight.float()
    parts = products.split(d, half, weight)
    assert [p.dtype for p, _ in parts] == [half] * products.PARTS
    assert (parts[0][1] is None) == (half == torch.bfloat16)  # float16's are scaled
    approx = sum(p.float() * (1 if s is None else s) for p, s in parts)
    assert (approx - d).abs().max() <= 2.0**-16 * d.abs().max()
    # control: one part leaves the half-precision rounding of the perturbation
    one = products.split(d, half, weight, parts=1)[0]
    one = one[0].float() * (1 if one[1] is None else one[1])
    assert (one - d).abs().max() > 2.0**-16 * d.abs().max()


@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("form", ["linear", "addmm", "matmul-t"])
@pytest.mark.parametrize("held", ["weight", "rounded point"])
def test_a_split_product_and_its_gradients_are_the_float64_ones(half, form, held):
    """Forward, the input's gradient and the point's, against float64 products of the
    same values: within the half-precision output's rounding (the CPU's kernels return
    half precision), and the point's gradient in float32 with it; split around the
    weight the model holds, or (a sharded model's gathered point) around the point
    rounded to half precision."""
    x, weight, point = _layer(half)
    bias = torch.randn(24, dtype=torch.float32)
    upcasts = geosharp.params.UpCasts()
    mode = products.SplitLinears({}, upcasts)
    leaf = point.clone().requires_grad_(True)
    xin = x.clone().requires_grad_(True)
    called = []
    with _counting(called):
        mode.points[id(leaf)] = (leaf, weight if held == "weight" else None)
        with mode:
            x32 = upcasts.up(xin)
            if form == "linear":
                y = F.linear(x32, leaf, bias)
            elif form == "addmm":  # Hugging Face's Conv1D: (in, out) weights
                y = torch.addmm(bias, x32.view(-1, 40), leaf.t()).view(3, 5, 24)
            else:
                y = x32 @ leaf.T + bias
    assert called, "the split product was not taken"
    assert y.dtype == torch.float32
    g = torch.randn(3, 5, 24, generator=torch.Generator().manual_seed(4)).to(half).float()
    y.backward(g)
    xd, pd, gd = x.double().requires_grad_(True), point.double().requires_grad_(True), g.double()
    ref = F.linear(xd, pd, bias.double())
    ref.backward(gd)
    scale = ref.abs().max()
    assert (y.double() - ref).abs().max() <= 2 * ULP[half] * scale
    assert (xin.grad.double() - xd.grad).abs().max() <= 4 * ULP[half] * xd.grad.abs().max()
    assert (leaf.grad.double() - pd.grad).abs().max() <= 2 * ULP[half] * pd.grad.abs().max()
    assert leaf.grad.dtype == torch.float32 and xin.grad.dtype == half


@pytest.mark.parametrize("half", HALVES)
def test_split_around_its_rounding_the_unperturbed_point_is_the_models_own_layer(half):
    """A sharded model's gathered point split around its own rounding: at the weight
    itself the layer is the model's own product with its bias, rounded once; control:
    a perturbed point moves it."""
    x, weight, point = _layer(half)
    bias = torch.randn(24).to(half)
    own = products.mm32(x.view(-1, 40), weight.t(), bias).view(3, 5, 24)
    at_weight = products.split_product(x, None, weight.float().t(), bias)
    assert torch.equal(at_weight, own)
    assert not torch.equal(products.split_product(x, None, point.t(), bias), own)


def test_an_input_that_is_not_a_half_copy_keeps_the_float32_product():
    """A float32 input computed in float32 (not a copy of a half one) is not rounded:
    the product is the float32 one, as before."""
    _, weight, point = _layer(torch.bfloat16)
    mode = products.SplitLinears({}, geosharp.params.UpCasts())
    mode.points[id(point)] = (point, weight)
    x = torch.randn(5, 40)
    called = []
    with _counting(called), mode:
        y = F.linear(x, point)
    assert not called
    assert torch.equal(y, F.linear(x, point))


class _counting:
    def __init__(self, calls):
        self.calls, self.real = calls, products.split_product

    def __enter__(self):
        def counted(*args):
            self.calls.append(1)
            return self.real(*args)

        products.split_product = counted
        return self

    def __exit__(self, *exc):
        products.split_product = self.real


def _float_loss(loss):
    """The family's cross-entropy in float32 from half-precision logits."""
    from hf_zoo import logits_of

    def float_loss(model, inputs):
        logits = logits_of(model(**inputs)).float()
        flat = logits.reshape(-1, logits.shape[-1])
        return F.cross_entropy(flat, torch.arange(flat.shape[0]) % flat.shape[-1])

    return float_loss


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("measure", ["adaptive", "geodesic-inv-attn"])
def test_the_split_measure_is_the_float32_path_within_the_floor(family, half, measure, monkeypatch):
    """At the same perturbations (the average case, one seed), the value with the
    perturbed matrices' products split equals the float32 path's (``split.ENABLED =
    False``) within the reported floor, which is the same (the unperturbed loss is the
    same); the split path ran (its products counted) and the model is left as it was.
    The worst case's search, which follows the gradient, is checked on the LLaMA in
    ``test_half_precision.py`` against the float32 copy."""
    model, inputs, loss = build(family)
    model = model.to(half)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = _float_loss(loss)
    kw = dict(rho=0.5, estimator=geosharp.AverageCase(n_samples=3), seed=1)
    called, out = [], {}
    for split in (True, False):
        monkeypatch.setattr(products, "ENABLED", split)  # forced: this CPU keeps float32
        with _counting(called):
            out[split] = _measure(model, inputs, loss, measure, **kw)
        if split:
            assert called, "the split products did not run"
            n = len(called)
    assert len(called) == n  # and the float32 path took none
    low, ref = out[True], out[False]
    assert "products of the perturbed matrices in parts" in low.settings["precision"]
    assert "in parts" not in ref.settings["precision"]
    assert low.loss == pytest.approx(ref.loss, rel=1e-5) and low.floor > 0
    assert low.floor == pytest.approx(ref.floor, rel=1e-3)
    assert abs(low.value - ref.value) <= low.floor
    assert low.value != ref.value  # control: two computations, not one
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert {p.dtype for p in model.parameters()} == {half}


def _flop_share():
    path = Path(__file__).resolve().parent.parent / "benchmarks/flop_share.py"
    spec = importlib.util.spec_from_file_location("flop_share", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("flop_share", module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("measure", "most"), [("adaptive-attn", 0.05), ("geodesic-inv-attn", 0.10)]
)
def test_the_float32_share_of_a_bf16_llamas_matrix_products_is_small(measure, most):
    """Counted on a bfloat16 LLaMA, attention-only, 2 x 64 tokens: at most 5%
    (adaptive) and 10% (geodesic, its pair maths) of the matrix-product FLOPs run in
    float32. Controls: a training step counts none; the float32 path counts more than
    the bound."""
    bench = _flop_share()
    model, batch = bench.model_and_batch(tokens=64)
    step = bench.count(model, batch, None)
    assert step.share() == 0 and sum(step.flops.values()) > 0
    split = bench.count(model, batch, measure, split=True, n_iters=2)
    before = bench.count(model, batch, measure, split=False, n_iters=2)
    assert split.share() <= most < before.share()
    assert split.flops[torch.bfloat16] > before.flops[torch.bfloat16]


def _measure(model, inputs, loss, measure, **kw):
    """``sharpness(...)``, the floor's warning (random weights) kept quiet."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", geosharp.PrecisionWarning)
        return geosharp.sharpness(model, [inputs], loss, measure, **kw)


def test_a_measure_splits_only_where_the_device_multiplies_into_float32(monkeypatch):
    """By default (``ENABLED = None``) the products are split where the device has a
    half-to-float32 product (CUDA), and kept in float32 elsewhere: the record says
    which."""
    model, inputs, loss = build("llama")
    model = model.to(torch.bfloat16)
    has = products._has_mm32(next(model.parameters()))
    kw = dict(rho=0.5, estimator=geosharp.WorstCase(n_iters=1))
    result = _measure(model, inputs, _float_loss(loss), "adaptive-attn", **kw)
    assert ("in parts" in result.settings["precision"]) == has
    monkeypatch.setattr(products, "ENABLED", True)
    forced = _measure(model, inputs, _float_loss(loss), "adaptive-attn", **kw)
    assert "in parts" in forced.settings["precision"]  # control: the record can say it


def test_the_pair_algebra_in_float64_is_a_small_share_of_the_search():
    """Counted on the bfloat16 LLaMA, 2 x 64 tokens, all four pairs: the pair states'
    ``h x h`` algebra, kept in float64, is at most 3% of the matrix-product FLOPs of 6
    ``geodesic-inv-attn`` steps given the pairs (it does not grow with the tokens: 1.0%
    of 20 steps at 128 tokens). Control: finding and checking the pairs counts float64
    products, near a training step's FLOPs."""
    bench = _flop_share()
    model, batch = bench.model_and_batch(tokens=64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", geosharp.SymmetryWarning)  # every pair verified
        with bench.MatmulFlops() as found:
            symmetries = geosharp.find_symmetries(model, batch, loss_fn=bench.loss)
    assert len(symmetries.pairs) == 4
    step = sum(bench.count(model, batch, None).flops.values())
    assert found.flops[torch.float64] > step / 2
    search = bench.count(model, batch, "geodesic-inv-attn", n_iters=6, symmetries=symmetries)
    assert 0 < search.share(torch.float64) <= 0.03
