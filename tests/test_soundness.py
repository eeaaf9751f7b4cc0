"""Sound by construction, on attention written by hand (``tests/attention_zoo.py``):
the user's model comes back as the same objects with the same bits (aliased modules,
tied weights), no pair is called verified that an independent transform of the whole
model refutes, no true pair is called absent, no miss is unlabelled, nothing crashes.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

import geosharp
from attention_zoo import CASES, Plain, Stack, build, loss_fn
from geosharp.symmetry import (
    Dropped,
    Symmetries,
    check_symmetries,
    declare_pair,
    find_symmetries,
    reparameterize,
    verify_symmetries,
)
from hf_zoo import build as build_hf

F64 = torch.float64


def snapshot(model):
    """Every registered name (aliases included) -> (object, bits)."""
    out = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for attr, t in module.__dict__[kind].items():
                if t is not None:
                    out[f"{prefix}.{attr}"] = (t, t.detach().clone(), t.dtype, type(t))
    return out


def assert_unchanged(model, before):
    now = snapshot(model)
    assert now.keys() == before.keys()
    for name, (obj, bits, dtype, cls) in before.items():
        t = now[name][0]
        assert t is obj and type(t) is cls and t.dtype == dtype, name
        assert torch.equal(t.detach(), bits), name


def _element(group: str, heads: int, h: int, cond: float, g) -> torch.Tensor:
    """A random element of ``group``, built here from its definition (not geosharp's):
    ``GL``: ``U diag(s) V``; rotary groups: a complex scalar (``orthogonal``: of modulus
    one) on each plane; ``orthogonal``: ``Q`` of a QR factorisation."""
    if group == "GL":
        U, _ = torch.linalg.qr(torch.randn(heads, h, h, generator=g, dtype=F64))
        V, _ = torch.linalg.qr(torch.randn(heads, h, h, generator=g, dtype=F64))
        return U @ torch.diag_embed(torch.logspace(0, -math.log10(cond), h, dtype=F64)) @ V
    if group == "orthogonal":
        return torch.linalg.qr(torch.randn(heads, h, h, generator=g, dtype=F64))[0]
    half = torch.arange(h // 2)
    a, b = (2 * half, 2 * half + 1) if "interleaved" in group else (half, half + h // 2)
    modulus = 1.0 if group.endswith("orthogonal") else 1.7
    angle = 2 * math.pi * torch.rand(heads, h // 2, generator=g, dtype=F64)
    A = torch.zeros(heads, h, h, dtype=F64)
    A[:, a, a] = A[:, b, b] = modulus * torch.cos(angle)
    A[:, a, b], A[:, b, a] = -modulus * torch.sin(angle), modulus * torch.sin(angle)
    return A


def whole_model_change(model, x, pair, cond=10.0, seed=0) -> float:
    """Relative change of the whole model's output when ``pair`` is transformed by a
    random ``A`` of its group, written here without geosharp's transforms."""
    g = torch.Generator().manual_seed(seed)
    heads, _, _, h = pair.shape
    A = _element(pair.group, heads, h, cond, g)
    moved = copy.deepcopy(model)
    params = dict(moved.named_parameters())
    with torch.no_grad():
        for blocks, M in ((pair.g_blocks, A), (pair.h_blocks, torch.linalg.inv(A).mT)):
            X = torch.cat([params[b.param].view(-1)[b.index] for b in blocks], dim=1)
            X = X @ M
            row = 0
            for b in blocks:
                params[b.param].view(-1)[b.index] = X[:, row : row + b.shape[1]]
                row += b.shape[1]
        y, y2 = model(x), moved(x)
    return float((y2 - y).abs().max() / y.abs().max())


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hand_written_attention(case):
    model, x = build(case)
    before = snapshot(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sym = find_symmetries(model, x, loss_fn=loss_fn)  # never a crash
        assert_unchanged(model, before)
        # torch has no CPU backward of flex_attention: the average case needs none
        estimator = geosharp.WorstCase(n_iters=2) if case.backward else geosharp.AverageCase(2)
        result = geosharp.sharpness(model, [x], loss_fn, "geodesic-inv", 0.05, estimator)
        assert_unchanged(model, before)
        # what the precision resolves: torchtitan's rotary computes in float32
        tolerance = max([1e-9] + [10 * c.tolerance for c in sym.verified.values()])
        if sym.pairs:
            assert check_symmetries(model, x, sym, tolerance=tolerance).ok
            assert_unchanged(model, before)
    # every pair called verified is a symmetry of the whole model
    for pair in sym.pairs:
        check = sym.verified[pair.name]
        assert check.ok and check.conclusive, pair.name
        assert whole_model_change(model, x, pair) < tolerance, pair.name
    assert result.symmetry_complete == sym.complete
    if case.groups:
        assert tuple(sorted(p.group for p in sym.pairs)) == case.groups, sym.summary()
    if case.outcome == "found":
        assert len(sym.pairs) == case.expect and sym.complete, sym.summary()
    else:  # a miss is allowed, never a silent one
        assert len(sym.pairs) <= case.expect
        assert not sym.complete or len(sym.pairs) == case.expect, sym.summary()
    # a drop called exact ("no such symmetry") leaves no true pair out
    assert len(sym.pairs) == case.expect or any(not d.exact for d in sym.dropped)


def test_a_declared_non_symmetry_is_refuted_through_masked_logits():
    """A module that also returns masked scores (-1e9): a wrong pair still reads large."""
    model, x = build(next(c for c in CASES if c.name == "masked-logits"))
    q = model.blocks[0].q.weight
    wrong = declare_pair(model, G=[(q, lambda w: w[:4].T)], H=[(q, lambda w: w[4:].T)],
                         module="blocks.0", kind="query-query")  # fmt: skip
    sym = Symmetries([wrong], find_symmetries(model, x, loss_fn=loss_fn, warn=False).parameters)
    assert sym.unverified == ["blocks.0:query-query"] and not sym.complete
    checked = verify_symmetries(model, sym, x, loss_fn=loss_fn)
    assert "blocks.0:query-query" not in {p.name for p in checked.pairs}
    assert "not a symmetry" in checked.ignored["blocks.0"][0].reason
    before = snapshot(model)
    with pytest.raises(ValueError, match="never checked on the model"):
        reparameterize(model, sym)  # no batch: an unverified layout is refused
    with pytest.raises(ValueError, match="could not be verified"):
        reparameterize(model, sym, batch=x)
    assert_unchanged(model, before)


def test_a_pair_another_process_could_not_verify_is_dropped_everywhere():
    """``verify_symmetries(agree=...)`` (a sharded model's verdicts, agreed over
    processes): a pair verified here but not on another process is dropped, with that
    reason; verdicts that agree keep every pair verified."""
    model, x = build(next(c for c in CASES if c.name == "plain"))
    found = find_symmetries(model, x, loss_fn=loss_fn)
    assert len(found.pairs) == 2 and found.complete
    bare = Symmetries(found.pairs, found.parameters)  # nothing verified yet
    elsewhere = torch.tensor([0.0, 1.0])  # the second pair failed on another process

    def agree(failed):
        return torch.maximum(failed, elsewhere)

    one = verify_symmetries(model, bare, x, loss_fn=loss_fn, agree=agree)
    first, second = (p.name for p in found.pairs)
    assert [p.name for p in one.pairs] == [first] and list(one.verified) == [first]
    assert any("failed on another process" in d.reason for d in one.dropped)
    both = verify_symmetries(model, bare, x, loss_fn=loss_fn, agree=lambda failed: failed)
    assert [p.name for p in both.pairs] == [first, second] and both.complete


def test_one_warning_names_an_ignored_module_and_an_unchecked_pair():
    """A measure whose symmetries both leave a module element-wise (not understood) and
    use a pair that no numerical check confirmed says both in one warning, and
    ``strict=True`` refuses with both; the command line's status line names an unchecked
    pair too (``--strict``: a one-line error, exit 2)."""
    model, x = build(next(c for c in CASES if c.name == "plain"))
    found = find_symmetries(model, x, loss_fn=loss_fn)
    first, second = found.pairs
    sym = Symmetries(
        [second], found.parameters, verified={},
        dropped=[Dropped(first.module, first.kind, "a layout not understood", exact=False)],
    )  # fmt: skip
    kw = dict(rho=0.05, estimator=geosharp.WorstCase(n_iters=1), symmetries=sym)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        geosharp.sharpness(model, [x], loss_fn, "geodesic-inv", **kw)
    (message,) = [str(w.message) for w in said if w.category is geosharp.SymmetryWarning]
    assert "1 module measured element-wise" in message, message
    assert f"1 pair block used without a numerical check on the model ({second.name})" in message
    with pytest.raises(ValueError, match=r"element-wise.*without a numerical check"):
        geosharp.sharpness(model, [x], loss_fn, "geodesic-inv", strict=True, **kw)
    # the command line's status line: a warning, and with --strict a one-line error
    from geosharp.cli.commands import _say_symmetry_status

    lines = []
    unchecked = Symmetries([second], found.parameters)
    _say_symmetry_status(unchecked, ["geodesic-inv"], False, lines.append)
    assert lines == [
        "warning: geodesic measures: 1 pair block used without a numerical check on the "
        f"model ({second.name}); see geosharp symmetries MODEL"
    ]
    with pytest.raises(geosharp.UsageError, match="without a numerical check"):
        _say_symmetry_status(unchecked, ["geodesic-inv"], True, lines.append)
    _say_symmetry_status(unchecked, [], True, lines.append)  # no geodesic measure: silent
    assert len(lines) == 1


def test_the_tolerance_follows_the_precision_and_the_control_must_move():
    """A pair the output does not depend on is not called verified: its control does
    not move."""
    torch.manual_seed(0)
    model = Stack(Plain).to(F64).eval()
    with torch.no_grad():
        model.blocks[0].o.weight.zero_()  # the attention's output is its bias alone
    x = torch.randn(4, 6, 5, dtype=F64)
    sym = find_symmetries(model, x, loss_fn=loss_fn, warn=False)
    assert sym.pairs == [] and not sym.complete
    assert all("barely depends" in d.reason for d in sym.ignored["blocks.0"])


@pytest.mark.parametrize("family", ["t5", "marian"])
def test_shared_embeddings_come_back_as_they_were(family):
    """T5 and Marian register one embedding under several names."""
    model, inputs, loss = build_hf(family)
    model = model.float()  # transformers 4.x builds Marian's float64 causal mask wrongly
    before = snapshot(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        value = loss(model, inputs)
        geosharp.sharpness(model, [inputs], loss, "adaptive", 0.05, geosharp.WorstCase(n_iters=2))
        geosharp.sharpness(
            model, [inputs], loss, "geodesic-inv", 0.05, geosharp.WorstCase(n_iters=2)
        )
    assert_unchanged(model, before)
    assert torch.equal(loss(model, inputs), value)


@pytest.mark.parametrize("family", ["gpt-neo", "gpt-j", "codegen"])
def test_float32_inside_float64_keeps_its_pairs_on_a_badly_conditioned_copy(family):
    """Part of their attention runs in float32 inside a float64 model: the tolerance
    follows what float32 resolves on the copy's own conditioning."""
    model, inputs, loss = build_hf(family)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = find_symmetries(model, inputs, loss_fn=loss, warn=False)
        moved = copy.deepcopy(model)
        reparameterize(moved, found, cond=100, seed=1)
        again = find_symmetries(moved, inputs, loss_fn=loss, warn=False)
    assert len(again.pairs) == len(found.pairs) > 0 and again.complete
    assert {v.dtype for v in again.verified.values()} == {"float64"}


def test_parameters_the_batch_does_not_use_are_said():
    """GPT-2 with cross-attention, traced without encoder states: no pair is claimed for
    it, and its parameters are listed as unused by the traced batch."""
    import transformers as tf

    config = tf.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=32,
                           add_cross_attention=True)  # fmt: skip
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(config).double().eval()
    ids = {"input_ids": torch.randint(0, 50, (2, 5))}
    sym = find_symmetries(model, ids, warn=False)
    assert any(".crossattention." in n for n in sym.idle)
    assert not any(".crossattention." in n for p in sym.pairs for n in p.params)
    assert "not used by the traced batch" in sym.summary()
    with_states = {**ids, "encoder_hidden_states": torch.randn(2, 4, 16, dtype=F64)}
    assert not any(".crossattention." in n for n in find_symmetries(model, with_states).idle)


class _Checkpointed(torch.nn.Module):
    """A block whose forward runs under ``torch.utils.checkpoint``: its backward
    recomputes the forward pass."""

    def __init__(self, reentrant):
        super().__init__()
        self.inner, self.reentrant = Plain(), reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.inner, x, use_reentrant=self.reentrant)


def test_activation_checkpointing_gives_the_same_numbers():
    """The recomputation during backward sees the perturbed point (it saw the model's own
    weights: adaptive sharpness 0.012646 for 0.012690, without a word); reentrant
    checkpointing, which cannot differentiate with respect to chosen tensors, is a
    one-line error with its fix."""
    from geosharp.errors import UsageError
    from geosharp.measures import hessian_trace

    plain, x = build(next(c for c in CASES if c.name == "plain"))
    torch.manual_seed(0)
    ckpt = Stack(lambda: _Checkpointed(False)).to(F64).eval()
    ckpt.load_state_dict(_renamed(plain.state_dict()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = [find_symmetries(m, x, loss_fn=loss_fn) for m in (plain, ckpt)]
        assert [len(s.pairs) for s in found] == [2, 2] and found[1].complete
        for measure in ("adaptive", "geodesic-inv"):
            values = [
                geosharp.sharpness(
                    m, [x], loss_fn, measure, 0.5, geosharp.WorstCase(n_iters=3)
                ).value
                for m in (plain, ckpt)
            ]
            assert values[0] == pytest.approx(values[1], rel=1e-12), measure
        traces = [hessian_trace(m, [x], loss_fn, "geodesic-inv", n_probes=2).value
                  for m in (plain, ckpt)]  # fmt: skip
    assert traces[0] == pytest.approx(traces[1], rel=1e-10)
    reentrant = Stack(lambda: _Checkpointed(True)).to(F64).eval()
    before = snapshot(reentrant)
    with pytest.raises(UsageError, match="use_reentrant=False"):
        geosharp.sharpness(reentrant, [x], loss_fn, "adaptive", 0.5, geosharp.WorstCase(n_iters=1))
    assert_unchanged(reentrant, before)


class _CheckpointedOnData(torch.nn.Module):
    """A block checkpointed on the data itself (its input needs no gradient), a head."""

    def __init__(self, reentrant):
        super().__init__()
        self.block = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh())
        self.head, self.reentrant = torch.nn.Linear(6, 2), reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return self.head(checkpoint(self.block, x, use_reentrant=self.reentrant))


def test_a_reentrant_checkpoint_whose_input_needs_no_gradient_is_refused():
    """Its parameters get no gradient (torch only warns): Auto-PGD would move the head
    alone and report the head's value. Refused with the fix; the non-reentrant one, and
    a measure of the head alone, are measured."""
    from geosharp.errors import UsageError
    from geosharp.measures import hessian_trace

    torch.manual_seed(0)
    x = torch.randn(16, 6, dtype=F64)
    reentrant = _CheckpointedOnData(True).to(F64)
    plain = _CheckpointedOnData(False).to(F64)
    plain.load_state_dict(reentrant.state_dict())
    before = snapshot(reentrant)
    estimator = geosharp.WorstCase(n_iters=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own warning
        for measure in ("adaptive", "geodesic-inv"):
            with pytest.raises(UsageError, match=r"block\.0\.weight and 1 more get no gradient"):
                geosharp.sharpness(reentrant, [x], loss_fn, measure, 0.5, estimator)
        with pytest.raises(UsageError, match="use_reentrant=False"):
            hessian_trace(reentrant, [x], loss_fn, "adaptive", n_probes=1)
        assert_unchanged(reentrant, before)
        head = ["head.weight", "head.bias"]
        values = [
            geosharp.sharpness(m, [x], loss_fn, "adaptive", 0.5, estimator, parameters=head).value
            for m in (reentrant, plain)
        ]
    assert values[0] == pytest.approx(values[1], rel=1e-12)
    whole = geosharp.sharpness(plain, [x], loss_fn, "adaptive", 0.5, estimator).value
    assert whole > values[1]  # the block's parameters count


def _renamed(state):
    """The plain stack's weights under the checkpointed stack's names."""
    out = {}
    for k, v in state.items():
        parts = k.split(".")
        if parts[0] == "blocks":
            parts.insert(2, "inner")
        out[".".join(parts)] = v
    return out


def test_no_gradient_for_what_is_not_perturbed():
    """An attention-only measure: the other parameters do not require grad while it
    runs (no gradient computed for them), and every flag is back afterwards, also when
    the loss raises."""
    model, x = build(next(c for c in CASES if c.name == "plain"))
    attention = {n for n, _ in model.named_parameters() if n.startswith("blocks.0.")}
    seen = []

    def watching(m, batch):
        seen.append({n for n, p in m.named_parameters() if p.requires_grad})
        return loss_fn(m, batch)

    geosharp.sharpness(
        model, [x], watching, "adaptive", 0.1, geosharp.WorstCase(n_iters=2), parameters=attention
    )
    assert seen and all(s == set() or s <= attention for s in seen)
    assert all(p.requires_grad for p in model.parameters())

    def failing(m, batch):
        if len(seen) > 3:
            raise RuntimeError("out of memory")
        return watching(m, batch)

    seen.clear()
    with pytest.raises(RuntimeError, match="out of memory"):
        geosharp.sharpness(
            model,
            [x],
            failing,
            "adaptive",
            0.1,
            geosharp.WorstCase(n_iters=5),
            parameters=attention,
        )
    assert all(p.requires_grad for p in model.parameters())


class _OneValueTwoHeadings(torch.nn.Module):
    """One value projection read as 2 heads by one attention and as 4 by another: the
    value/output pairs overlap in different layouts, so no joint pair exists."""

    def __init__(self):
        super().__init__()
        lin = torch.nn.Linear
        self.q1, self.k1, self.q2, self.k2, self.v = (lin(8, 8) for _ in range(5))
        self.o1, self.o2 = lin(8, 8), lin(8, 8)

    @staticmethod
    def attend(q, k, v, heads):
        def split(t):
            return t.view(*t.shape[:2], heads, -1).transpose(1, 2)

        y = (split(q) @ split(k).transpose(-1, -2)).softmax(-1) @ split(v)
        return y.transpose(1, 2).reshape(q.shape)

    def forward(self, x):
        v = self.v(x)
        a = self.o1(self.attend(self.q1(x), self.k1(x), v, 2))
        return a + self.o2(self.attend(self.q2(x), self.k2(x), v, 4))


def test_a_parameter_in_pairs_of_two_layouts_is_dropped_and_said():
    torch.manual_seed(0)
    model = Stack(_OneValueTwoHeadings).to(F64).eval()
    x = torch.randn(4, 6, 5, dtype=F64)
    before = snapshot(model)
    sym = find_symmetries(model, x, loss_fn=loss_fn, warn=False)
    # two attentions computed in one module: their query/key pairs, numbered
    assert sorted(p.kind for p in sym.pairs) == ["query-key", "query-key-2"]
    assert not sym.complete
    assert any("no joint pair" in d.reason for d in sym.dropped)
    assert_unchanged(model, before)


def test_hugging_face_gradient_checkpointing_is_kept_during_a_measure():
    """``gradient_checkpointing_enable()`` on a Hugging Face model: transformers
    checkpoints a layer only in training mode; a measure puts the model in eval mode
    but the layers that hold the flag in training mode (their dropout stays off), so
    that backward recomputes their activations: the attention runs twice per
    evaluation, the values are those of the model without it. A reentrant checkpoint
    is left off, said. Discovery finds the same verified pairs; the model is left in
    training mode with checkpointing on."""
    from geosharp.measures import hessian_trace

    plain, inputs, loss = build_hf("llama")
    ckpt = copy.deepcopy(plain)
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ckpt.train()
    before = snapshot(ckpt)
    found = [find_symmetries(m, inputs, loss_fn=loss) for m in (plain, ckpt)]
    assert [len(s.pairs) for s in found] == [len(found[0].pairs)] * 2 and found[1].complete
    assert sorted(found[0].verified) == sorted(found[1].verified)
    for measure in ("adaptive", "geodesic-inv"):
        results, calls = [], []
        for m in (plain, ckpt):
            count = []
            attention = next(x for n, x in m.named_modules() if n.endswith("layers.0.self_attn"))
            handle = attention.register_forward_hook(lambda *_, count=count: count.append(1))
            results.append(
                geosharp.sharpness(m, [inputs], loss, measure, 0.1, geosharp.WorstCase(2))
            )
            handle.remove()
            calls.append(len(count))
        assert results[0].value == pytest.approx(results[1].value, rel=1e-12), measure
        assert [r.settings["checkpointing"] for r in results] == [False, True]
        assert calls[1] >= calls[0] + 3, calls  # each of the 3 evaluations recomputes
    traces = [hessian_trace(m, [inputs], loss, "geodesic-inv", n_probes=2).value
              for m in (plain, ckpt)]  # fmt: skip
    assert traces[0] == pytest.approx(traces[1], rel=1e-10)
    assert ckpt.training and ckpt.is_gradient_checkpointing
    assert_unchanged(ckpt, before)
    reentrant = copy.deepcopy(plain)
    reentrant.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.warns(UserWarning, match="use_reentrant"):
        off = geosharp.sharpness(reentrant, [inputs], loss, "adaptive", 0.1, geosharp.WorstCase(2))
    assert off.settings["checkpointing"] is False


def test_a_measure_under_checkpointing_keeps_no_cache_and_transformers_says_nothing():
    """transformers logs "`use_cache=True` is incompatible with gradient checkpointing"
    in a training-mode forward of a checkpointed model that caches (the control); a
    measure turns the cache off (and back on after), so it is not said."""
    import logging

    from transformers.utils import logging as hf_logging

    model, inputs, loss = build_hf("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = True
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        hf_logging.warning_once.cache_clear()
        geosharp.sharpness(model, [inputs], loss, "adaptive", 0.1, geosharp.WorstCase(2))
        quiet = list(said)
        assert model.config.use_cache is True
        hf_logging.warning_once.cache_clear()
        model.train()
        loss(model, inputs).backward()  # the control: training as usual says it
    finally:
        logger.removeHandler(handler)
    assert not [m for m in quiet if "cach" in m.lower()], quiet
    assert [m for m in said if "cach" in m.lower()]


def test_a_true_symmetry_above_the_a_priori_round_off_is_verified():
    """A LLaMA layer (8 query heads per key/value head, width 2048, every weight
    N(0, 0.02), the norms too: small inputs) changes under its rotary query-key
    symmetry by more than ``4 eps cond kappa`` (7.6e-14 against 7.1e-14, once called
    not a symmetry); the unit's measured round-off floor keeps it, with a margin."""
    import transformers as tf

    config = tf.LlamaConfig(
        vocab_size=64, hidden_size=2048, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=32, num_key_value_heads=4,
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    sym = find_symmetries(model, warn=False)
    assert sorted(p.kind for p in sym.pairs) == ["query-key", "value-output"]
    assert sym.complete
    qk = next(v for v in sym.verified.values() if "query-key" in v.pair)
    a_priori = 4 * torch.finfo(torch.float64).eps * 10 * 8  # kappa = sqrt(h) here
    assert qk.change > 0.5 * a_priori and qk.change < qk.tolerance / 2
