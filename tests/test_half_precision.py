"""A half-precision model is measured with float32 only where the perturbation lives:
the modules that own perturbed parameters compute in float32, the rest in the model's
own precision, on its own weights (no float32 copy of the whole model)."""

from __future__ import annotations

import copy
import warnings
import weakref

import pytest
import torch

import geosharp
from census import alive, measure_only
from hf_zoo import build


@pytest.mark.parametrize("split", [None, True])
@pytest.mark.parametrize("measure", ["geodesic-inv", "adaptive"])
def test_bfloat16_llama_attention_only_equals_its_float32_copy_within_the_floor(
    measure, split, monkeypatch
):
    """Also with the perturbed matrices' products split into bfloat16 parts (forced:
    this CPU keeps them in float32 by default)."""
    from geosharp.measures.backends import split as products

    monkeypatch.setattr(products, "ENABLED", split)
    model, inputs, loss = build("llama")
    model = model.to(torch.bfloat16)
    reference = copy.deepcopy(model).float()  # the same bf16 weights, in float32
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    attention = [n for n, _ in model.named_parameters() if ".self_attn." in n]
    kw = dict(estimator=geosharp.WorstCase(n_iters=5), parameters=attention)
    with warnings.catch_warnings():  # a value near what bf16 resolves is warned about
        warnings.simplefilter("ignore", geosharp.PrecisionWarning)
        low = geosharp.sharpness(model, [inputs], loss, measure, 0.1, **kw)
    ref = geosharp.sharpness(reference, [inputs], loss, measure, 0.1, **kw)
    parts = "bfloat16 products of the perturbed matrices in parts, " if split else ""
    assert low.settings["precision"] == (
        parts + "float32 in the perturbed modules, bfloat16 elsewhere"
    )
    assert low.settings["dtype"] == "float32"  # the perturbation itself
    # Auto-PGD's gradient: the model's width on a straight step, as its training step's
    assert low.settings["gradient"] == ("bfloat16" if measure == "adaptive" else "float32")
    assert ref.settings["gradient"] == "float32"
    assert abs(low.value - ref.value) <= low.floor
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_a_bfloat16_model_is_read_in_place_in_float32():
    """The perturbed parameters are not copied: the space reads the model's bf16
    tensors piece by piece in float32 (exactly), its tangents are float32."""
    from geosharp.geometry import Geometry, PerturbationSpace
    from geosharp.measures.problem import find_target

    model, inputs, loss = build("llama")
    model = model.to(torch.bfloat16)
    attention = [n for n, _ in model.named_parameters() if ".self_attn." in n]
    geo = Geometry.named("geodesic")
    target = find_target(model, geo, attention, None, probe=(inputs, loss))
    assert target.upcast and target.dtype == torch.float32
    own = dict(model.named_parameters())
    assert all(t.data_ptr() == own[n].data_ptr() for n, t in target.theta.items())
    space = PerturbationSpace(target.theta, target.layout, target.pairs, geo, dtype=torch.float32)
    assert space.empty().dtype == torch.float32
    flat = target.layout.flatten({n: t.float() for n, t in target.theta.items()})
    assert torch.equal(space.elementwise.theta_flat(), flat)
    adaptive = Geometry.named("adaptive")
    scale = PerturbationSpace(target.theta, target.layout, [], adaptive, dtype=torch.float32)
    assert torch.equal(scale.elementwise.scale, flat.abs())


def test_a_module_with_submodules_and_perturbed_weights_is_measured_all_in_float32():
    """Where a perturbed parameter sits in a module that also holds submodules, its
    forward cannot be cast alone: the whole model computes in float32 (said)."""

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(4))
            self.inner = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.inner(x) * self.scale

    torch.manual_seed(0)
    model = torch.nn.Sequential(Scaled(), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    half = copy.deepcopy(model).to(torch.bfloat16)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))

    def loss(m, b):
        return torch.nn.functional.cross_entropy(m(b[0].to(m[2].weight.dtype)).float(), b[1])

    low = geosharp.sharpness(
        half, [(x, y)], loss, "adaptive", 0.1, estimator=geosharp.WorstCase(n_iters=3)
    )
    ref = geosharp.sharpness(
        copy.deepcopy(half).float(),
        [(x, y)],
        loss,
        "adaptive",
        0.1,
        estimator=geosharp.WorstCase(n_iters=3),
    )
    assert low.settings["precision"] == "float32"
    assert low.value == pytest.approx(ref.value, rel=1e-5)


def test_hessian_trace_of_a_bfloat16_model_is_that_of_its_float32_copy():
    """The Hessian trace differentiates twice through the whole forward: it runs on
    float32 copies of every weight of a half-precision model (casting only the perturbed
    modules, as sharpness does, moved the trace of this LLaMA by 20%: bf16 activations in
    a double backward), and leaves the model as it was."""
    from geosharp.measures import hessian_trace

    model, inputs, loss = build("llama")
    model = model.to(torch.bfloat16)
    reference = copy.deepcopy(model).float()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    attention = [n for n, _ in model.named_parameters() if ".self_attn." in n]
    kw = dict(n_probes=3, parameters=attention)
    low = hessian_trace(model, [inputs], loss, "geodesic-inv", **kw)
    ref = hessian_trace(reference, [inputs], loss, "geodesic-inv", **kw)
    assert low.settings["dtype"] == "float32"
    assert low.value == pytest.approx(ref.value, rel=1e-6)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def _two_layers():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    net = net.to(torch.bfloat16)
    for owner in (net[0], net[2]):
        owner.float()
    return net, (net[0], net[2])


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_half_input_is_saved_for_backward_as_itself_not_as_its_float32_copy(
    monkeypatch, checkpointed
):
    """A module computing in float32 beside a bfloat16 model gets float32 copies of its
    inputs; backward needs them (a weight's gradient), and they were kept from forward
    to backward: at 2048 tokens, 1.78 vectors of a 1.1B LLaMA's attention on a GPU. They
    are saved as the bfloat16 inputs, cast up again in backward: freed after the
    forward, the gradients bit for bit the same (also under activation checkpointing,
    whose saved-tensor hooks act first)."""
    from torch.utils.checkpoint import checkpoint

    from geosharp import params

    # (batch, tokens, features): a linear layer saves its input as a two-dimensional view
    x = torch.randn(2, 5, 8, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))

    def run():
        net, owners = _two_layers()
        copies = []
        with params.computing_in_float32(owners, torch.bfloat16):
            for owner in owners:  # after the cast: sees the float32 copies
                owner.register_forward_pre_hook(lambda m, a: copies.append(weakref.ref(a[0])))
            out = checkpoint(net, x, use_reentrant=False) if checkpointed else net(x)
            alive = [c() is not None for c in copies]
            out.float().square().sum().backward()
        assert [c().dtype for c in copies if c() is not None] == []  # after backward
        return alive, [p.grad for p in net.parameters()]

    alive, grads = run()
    monkeypatch.setattr(params.UpCasts, "_top", None)  # keep the float32 copies
    kept, reference = run()
    assert alive == [False, False]
    assert kept == [False, False] if checkpointed else kept == [True, True]
    assert all(torch.equal(g, r) for g, r in zip(grads, reference))


def test_a_half_input_changed_in_place_after_its_module_ran_is_refused():
    """A half input saved as itself is read again in backward: changed in place in
    between, it would give a wrong weight gradient; that is an error, never silent."""
    from geosharp import params

    net, owners = _two_layers()
    x = torch.randn(5, 8, dtype=torch.bfloat16)
    with params.computing_in_float32(owners[:1], torch.bfloat16):
        out = net[0](x)
        x.mul_(2)
        with pytest.raises(RuntimeError, match="changed in place after"):
            out.float().sum().backward()


def test_a_float32_copy_changed_in_place_inside_its_module_is_refused():
    """The same where the module changes its own (float32) input after saving it."""
    from geosharp import params

    class Scales(torch.nn.Linear):
        def forward(self, x):
            y = super().forward(x)
            x.mul_(2)  # the float32 copy, saved by the linear map above
            return y

    torch.manual_seed(0)
    owner = Scales(8, 3).to(torch.bfloat16).float()
    x = torch.randn(5, 8, dtype=torch.bfloat16)
    with params.computing_in_float32([owner], torch.bfloat16):
        out = owner(x)
        with pytest.raises(RuntimeError, match="changed in place after"):
            out.float().sum().backward()


@pytest.mark.parametrize(
    ("measure", "rho", "dtype", "float32", "half"),
    [
        ("adaptive", 1.0, torch.bfloat16, 3, 1),
        ("adaptive-linf", 0.2, torch.bfloat16, 3, 1),
        ("geodesic-inv", 2.0, torch.bfloat16, 4, 0),
        ("adaptive", 1.0, torch.float16, 3, 1),
    ],
)
def test_vectors_alive_at_each_evaluation_of_a_half_model(measure, rho, dtype, float32, half):
    """A straight step keeps the gradient in bfloat16, as wide as the model's training
    step's (a float16 model's too: bfloat16 has float32's range), in a buffer of its
    own, and the iterate in the float32 buffer of its point: at most three float32
    vectors of the perturbed beside it (``xi``, its previous and best values), where the
    point and a float32 gradient sharing one buffer made four. A geodesic step pulls
    the gradient back in float32: four float32 vectors."""
    from hf_zoo import logits_of

    model, inputs, _ = build("llama")
    model = model.to(dtype)

    def loss(m, batch):  # in float32: values that bfloat16 would round alike differ
        logits = logits_of(m(**batch)).float()
        return -torch.log_softmax(logits, -1)[..., 0].mean()

    attention = [n for n, p in model.named_parameters() if ".self_attn." in n]
    numel = sum(p.numel() for n, p in model.named_parameters() if n in attention)
    counts = []

    def vectors() -> dict[torch.dtype, int]:
        seen = list(alive(numel).values())
        return {d: seen.count(d) for d in (torch.float32, torch.bfloat16)}

    def census(event, i, iterate):
        if event == "evaluated" and i > 0:
            counts.append(vectors())

    with measure_only(), warnings.catch_warnings():
        warnings.simplefilter("ignore", geosharp.PrecisionWarning)
        result = geosharp.sharpness(
            model, [inputs], loss, measure, rho, parameters=attention, callback=census,
            estimator=geosharp.WorstCase(n_iters=12),
        )  # fmt: skip
    assert max(c[torch.float32] for c in counts) == float32, counts
    assert max(c[torch.bfloat16] for c in counts) == half, counts
    assert result.settings["gradient"] == ("bfloat16" if half else "float32")


# A confident classifier: the loss that a half-precision model's logits give


@pytest.fixture(scope="module")
def confident():
    """A 2-layer MLP fit to a training loss ~1e-4 (float32), the batch it was fit on."""
    torch.manual_seed(0)
    x = torch.randn(64, 16)
    y = (x[:, 0] > 0).long()
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
    opt = torch.optim.Adam(net.parameters(), 1e-2)
    for _ in range(600):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return net, (x, y)


def _half_loss(model, batch):  # the logits' own precision, as a naive loss_fn computes
    inputs, labels = batch
    return torch.nn.functional.cross_entropy(model(inputs.to(model[0].weight.dtype)), labels)


def _float_loss(model, batch):
    inputs, labels = batch
    logits = model(inputs.to(model[0].weight.dtype))
    return torch.nn.functional.cross_entropy(logits.float(), labels)


def _adaptive(model, batch, loss, **kw):
    estimator = geosharp.WorstCase(n_iters=10)
    return geosharp.sharpness(model, [batch], loss, "adaptive", 0.05, estimator, seed=0, **kw)


def test_a_confident_bfloat16_classifier_is_within_its_floor_of_the_float32_copy(confident):
    net, batch = confident
    half = copy.deepcopy(net).to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", geosharp.PrecisionWarning)
        low = _adaptive(half, batch, _float_loss)
    ref = _adaptive(half.float(), batch, _float_loss)
    assert 0 < low.loss < 1e-3 and low.floor > 0
    assert abs(low.value - ref.value) <= low.floor
    assert abs(low.loss - ref.loss) <= low.floor  # the floor covers the logits' rounding


def test_a_bfloat16_loss_rounded_to_zero_has_a_floor_not_zero_and_says_so(confident):
    """log-softmax of confident bf16 logits rounds the loss to exactly 0: the floor is
    the loss that float32 arithmetic on the same outputs gives, never 0."""
    net, batch = confident
    half = copy.deepcopy(net).to(torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _adaptive(half, batch, _half_loss)
    assert result.loss == 0 and result.value == 0
    with torch.no_grad():
        float_loss = float(_float_loss(half, batch))
    assert result.floor >= 0.5 * float_loss > 0
    said = [str(w.message) for w in caught if w.category is geosharp.PrecisionWarning]
    assert any("the loss is computed in bfloat16" in m for m in said)
    assert any("round-off floor" in m and "a float32 copy of the model" in m for m in said)
    assert all(w.filename == __file__ for w in caught if w.category is geosharp.PrecisionWarning)
    with pytest.raises(geosharp.UsageError, match=r"model\.float\(\)"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", geosharp.PrecisionWarning)
            _adaptive(half, batch, _half_loss, strict=True)


def test_a_float32_loss_of_exactly_zero_has_a_floor(confident):
    """A float32 loss rounded to 0 (margins 24 to 65, a loss of 5e-12 in float64) by a
    loss function that casts the outputs to float32: its floor is what float32
    arithmetic on outputs of that size rounds away, not 0."""
    net, batch = confident
    sharp = copy.deepcopy(net)
    with torch.no_grad():
        sharp[2].weight.mul_(3)
        sharp[2].bias.mul_(3)
        assert float(_float_loss(sharp, batch)) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", geosharp.PrecisionWarning)
        result = _adaptive(sharp, batch, _float_loss)
    assert result.loss == 0 and result.floor > 1e-7


def test_a_block_near_its_floor_is_named(confident):
    net, batch = confident
    half = copy.deepcopy(net).to(torch.bfloat16)
    kw = dict(per="layer", strict=True)
    with pytest.raises(geosharp.UsageError, match=r"adaptive \[\S+\] at rho") as err:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", geosharp.PrecisionWarning)
            geosharp.block_sharpness(half, [batch], _half_loss, "adaptive", 0.05,
                                     geosharp.WorstCase(n_iters=2), **kw)  # fmt: skip
    assert "--dtype float32" in err.value.message(cli=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        geosharp.block_sharpness(half, [batch], _half_loss, "adaptive", 0.05,
                                 geosharp.WorstCase(n_iters=2), per="layer")  # fmt: skip
    near = [w for w in caught if "round-off floor" in str(w.message)]
    assert near and all(str(w.message).startswith("[") for w in near)
    assert all(w.filename == __file__ for w in near)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_built_in_losses_are_float32_from_half_logits(dtype):
    from types import SimpleNamespace

    from geosharp.loading.hf import classification_loss
    from geosharp.loading.hfdata import TASKS, causal_lm_loss, task_loss
    from geosharp.models.vit import image_loss

    class Logits(torch.nn.Module):
        def __init__(self, shape, problem_type=None):
            super().__init__()
            self.shape = shape
            self.config = SimpleNamespace(problem_type=problem_type, num_labels=shape[-1])

        def forward(self, **_):
            return SimpleNamespace(logits=torch.randn(self.shape).to(dtype))

    labels = {"single_label_classification": torch.tensor([0, 1]),
              "multi_label_classification": torch.tensor([[0, 1], [1, 0]]),
              "regression": torch.randn(2, 2)}  # fmt: skip
    for kind in TASKS:
        loss = task_loss(Logits((2, 2), kind), {"x": None, "labels": labels[kind]})
        assert loss.dtype == torch.float32, kind
    assert classification_loss(Logits((2, 3)), {"labels": torch.tensor([0, 2])}).dtype == (
        torch.float32
    )
    assert image_loss(Logits((2, 3)), (None, torch.tensor([0, 2]))).dtype == torch.float32
    ids = {"input_ids": torch.tensor([[1, 2, 0]]), "attention_mask": torch.ones(1, 3)}
    assert causal_lm_loss(Logits((1, 3, 5)), ids).dtype == torch.float32


@pytest.mark.parametrize(
    "precision, python, cli",
    [
        ("bfloat16 autocast", "no autocast", "no --autocast"),
        ("float32 in the perturbed modules, bfloat16 elsewhere", "float()", "--dtype float32"),
        ("float32; 2 parameters in bfloat16, as their modules", "float()", "--dtype float32"),
        ("float32", "float64", "float64: the Python API"),
        ("float64", "a larger rho", "a larger --rho"),
    ],
)
def test_the_floor_advice_names_the_fix_where_the_user_is(precision, python, cli):
    from geosharp.measures.problem import floor_message

    assert python in floor_message("adaptive", 0.1, 1e-9, 1e-9, precision)
    assert cli in floor_message("adaptive", 0.1, 1e-9, 1e-9, precision, cli=True)
