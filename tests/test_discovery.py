"""Discovery beyond the coverage table: what is not understood is said, never guessed
(warnings, ``result.symmetry``, ``strict``); opaque kernels; the ``meta`` device;
nothing to transform; wrappers; verification in the model's own precision; the model
is left unchanged."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import geosharp
from geosharp.symmetry import check_symmetries, find_symmetries, reparameterize
from hf_zoo import build
from zoo import fused_attention

F64 = torch.float64


class KernelAttention(nn.Module):
    """Heads computed by an opaque kernel, or by aten's math sdpa."""

    def __init__(self, dim=8, heads=2, kernel=True):
        super().__init__()
        self.heads, self.kernel = heads, kernel
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, n, d = x.shape

        def split(t):
            return t.view(b, n, self.heads, -1).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        if self.kernel:
            y = fused_attention(q, k, v)
        else:
            y = torch.ops.aten._scaled_dot_product_attention_math(q, k, v)[0]
        return self.o(y.transpose(1, 2).reshape(b, n, d))


class Net(nn.Module):
    def __init__(self, kernel=True):
        super().__init__()
        self.attn = KernelAttention(kernel=kernel)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.attn(x).mean(1))


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 5, 8, generator=g, dtype=F64), torch.arange(4) % 3


def _loss(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


def _net(kernel=True):
    torch.manual_seed(0)
    return Net(kernel).to(F64).eval()


def test_an_opaque_kernel_is_named_not_guessed():
    model, batch = _net(), _batch()
    with pytest.warns(UserWarning, match="does not understand.*attn"):
        sym = find_symmetries(model, batch, loss_fn=_loss)
    assert sym.pairs == [] and sym.unrecognized == ["attn"]
    (drop,) = sym.ignored["attn"]
    assert "fused_attention" in drop.reason and "cannot look into" in drop.reason
    assert "fused_attention" in sym.summary()


def test_a_geodesic_measure_says_it_is_not_symmetry_correct():
    model, batch = _net(), _batch()
    est = geosharp.WorstCase(n_iters=2)
    with pytest.warns(UserWarning, match="geodesic-inv: 1 module measured element-wise"):
        result = geosharp.sharpness(model, [batch], _loss, "geodesic-inv", 0.1, est)
    assert not result.symmetry_complete
    assert "fused_attention" in result.symmetry["ignored"]["attn"][0]
    assert "NOT symmetry-correct" in str(result)
    assert result.to_dict()["symmetry"]["pairs"] == 0
    with pytest.raises(ValueError, match="strict=True"):
        geosharp.sharpness(model, [batch], _loss, "geodesic-inv", 0.1, est, strict=True)
    # adaptive sharpness has no pairs to miss: no warning, nothing to report
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        adaptive = geosharp.sharpness(model, [batch], _loss, "adaptive", 0.1, est, strict=True)
    assert adaptive.symmetry == {} and adaptive.symmetry_complete


def test_aten_sdpa_kernels_are_read_as_sdpa():
    model, batch = _net(kernel=False), _batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sym = find_symmetries(model, batch, loss_fn=_loss)
    assert [(p.kind, p.shape) for p in sym.pairs] == [
        ("query-key", (2, 9, 9, 4)),
        ("value-output", (2, 9, 8, 4)),
    ]
    assert all(v.ok and v.conclusive for v in sym.verified.values())


def test_nothing_to_transform_or_check_is_never_ok():
    model, batch = _net(), _batch()
    sym = find_symmetries(model, batch, loss_fn=_loss, warn=False)
    twin = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="nothing to transform"):
        assert reparameterize(twin, sym) == {}
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    check = check_symmetries(model, batch[0], sym)
    assert not check.ok and check.status == "nothing to check"
    assert "nothing to check" in str(check)


def test_a_meta_model_is_discovered_without_weights():
    """A model on the meta device: the trace runs on shapes only; nothing is verified
    (there are no weights), and the summary says so."""
    tf = pytest.importorskip("transformers")
    config = tf.LlamaConfig(
        vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sym = find_symmetries(model)
    assert sym.discovery == "trace" and sym.verified == {} and sym.unrecognized == []
    assert [(p.name, p.group, p.shape) for p in sym.pairs[:2]] == [
        ("model.layers.0.self_attn:query-key", "rotary", (2, 1024, 256, 32)),
        ("model.layers.0.self_attn:value-output", "GL", (2, 256, 1024, 32)),
    ]
    assert len(sym.pairs) == 6 and "0 of 6 verified" in sym.summary()
    assert all(p.is_meta for p in model.parameters())


def test_a_trace_that_cannot_run_says_why():
    """``Symmetries.trace_error``: the first line of the error that stopped the trace
    (a forward that reads values, on the meta device), ``None`` where it ran."""

    class Reads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x):
            out = self.attn(x, x, x)[0]
            return out * float(out.detach().cpu().numpy().sum() > 0)  # a value, not a shape

    with torch.device("meta"):
        model = Reads()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        failed = find_symmetries(model, torch.zeros(2, 3, 8, device="meta"), warn=False)
        ran = find_symmetries(model.attn, (torch.zeros(2, 3, 8, device="meta"),) * 3)
    assert failed.discovery == "structure" and failed.trace_error is not None
    assert "\n" not in failed.trace_error and ":" in failed.trace_error
    assert ran.discovery == "trace" and ran.trace_error is None


def test_a_meta_model_with_partial_rotary_and_fused_heads():
    tf = pytest.importorskip("transformers")
    config = tf.GPTNeoXConfig(
        vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, rotary_pct=0.25,
    )  # fmt: skip
    with torch.device("meta"):
        model = tf.GPTNeoXForCausalLM(config)
    kinds = [(p.kind, p.group, p.shape[3]) for p in find_symmetries(model).pairs[:3]]
    assert kinds == [("query-key", "rotary", 4), ("query-key-pass", "GL", 12),
                     ("value-output", "GL", 16)]  # fmt: skip


class Wrapper(nn.Module):
    """A classifier around a Hugging Face model, with a forward of its own."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.head = nn.Linear(32, 2)

    def forward(self, batch: dict):
        return self.head(self.inner(input_ids=batch["ids"]).last_hidden_state[:, 0])


def test_a_wrapper_without_a_batch_traces_its_hugging_face_models():
    pytest.importorskip("transformers")
    inner, _, _ = build("llama")
    model = Wrapper(inner.model).to(F64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sym = find_symmetries(model)  # random inputs do not fit Wrapper.forward
    assert sym.discovery == "trace" and sym.unrecognized == []
    assert [p.name for p in sym.pairs[:2]] == [
        "inner.layers.0.self_attn:query-key",
        "inner.layers.0.self_attn:value-output",
    ]
    assert all(v.ok for v in sym.verified.values()) and len(sym.verified) == len(sym.pairs)


class Float32Only(KernelAttention):
    """An attention that refuses float64 (as fused kernels do): verified in float32."""

    def forward(self, x):
        if x.dtype != torch.float32:
            raise RuntimeError("float32 only")
        return super().forward(x)


def test_verification_falls_back_to_the_model_precision():
    torch.manual_seed(0)
    model = nn.Sequential(Float32Only(kernel=False))
    x = torch.randn(3, 5, 8)
    sym = find_symmetries(model, x)
    assert {v.dtype for v in sym.verified.values()} == {"float32"}
    eps = torch.finfo(torch.float32).eps  # the tolerance is what float32 resolves
    assert all(v.ok and v.conclusive and v.tolerance >= 40 * eps for v in sym.verified.values())


def test_discovery_leaves_the_model_unchanged():
    model, batch = _net(kernel=False), _batch()
    model.train()
    before = copy.deepcopy(model.state_dict())
    find_symmetries(model, batch, loss_fn=_loss)
    assert model.training and all(m.training for m in model.modules())
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name])

    def failing(m, b):
        m(b[0])
        raise RuntimeError("the user's loss fails")

    with pytest.raises(RuntimeError, match="the user's loss fails"):
        find_symmetries(model, batch, loss_fn=failing)
    assert model.training
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name])


def test_the_trace_runs_on_two_examples_and_verification_on_the_batch():
    """The trace keeps an integer record beside each activation: it runs on the first
    two examples of the batch; the checks use the whole batch."""
    model = _net(kernel=False)
    x, y = torch.randn(8, 5, 8, dtype=F64), torch.arange(8) % 3
    seen = []

    def loss(m, batch):
        seen.append(len(batch[0]))
        return _loss(m, batch)

    sym = find_symmetries(model, (x, y), loss_fn=loss)
    assert seen == [2, 8] and len(sym.verified) == 2


class HandWritten(nn.Module):
    """Attention written by hand, in no library's layout: one fused weight (q | k | v),
    4 query heads sharing 2 key/value heads, a bias added to the queries after the
    projection, and a rotary embedding on planes (2j, 2j+1) of the first 4 of 8 columns."""

    def __init__(self, dim=16, heads=4, kv_heads=2, d=8, rot=4):
        super().__init__()
        self.heads, self.kv, self.d, self.rot = heads, kv_heads, d, rot
        self.w = nn.Parameter(torch.randn((heads + 2 * kv_heads) * d, dim) / dim**0.5)
        self.q_bias = nn.Parameter(0.1 * torch.randn(heads, d))
        self.out = nn.Parameter(torch.randn(dim, heads * d) / dim**0.5)

    def rotate(self, x):  # x: (b, heads, n, d)
        n = x.shape[-2]
        angle = torch.arange(n, dtype=x.dtype)[:, None] * 0.3 ** torch.arange(self.rot // 2)
        cos, sin = angle.cos().repeat_interleave(2, -1), angle.sin().repeat_interleave(2, -1)
        r, rest = x[..., : self.rot], x[..., self.rot :]
        swapped = torch.stack((-r[..., 1::2], r[..., ::2]), -1).flatten(-2)
        return torch.cat([r * cos + swapped * sin, rest], -1)

    def forward(self, x):
        b, n, _ = x.shape
        h, kv, d = self.heads, self.kv, self.d
        q, k, v = (x @ self.w.t()).split([h * d, kv * d, kv * d], -1)
        q = q.view(b, n, h, d).transpose(1, 2) + self.q_bias[:, None, :]
        k, v = (t.view(b, n, kv, d).transpose(1, 2).repeat_interleave(h // kv, 1) for t in (k, v))
        q, k = self.rotate(q), self.rotate(k)
        y = torch.softmax(q @ k.transpose(-1, -2) / d**0.5, -1) @ v
        return y.transpose(1, 2).reshape(b, n, h * d) @ self.out.t()


def test_a_hand_written_attention_is_found_from_what_it_computes():
    torch.manual_seed(0)
    model = nn.Sequential(HandWritten()).to(F64)
    x = torch.randn(3, 6, 16, dtype=F64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sym = find_symmetries(model, x)
    assert [(p.kind, p.group, p.shape) for p in sym.pairs] == [
        # G stacks the 2 query heads (16 input rows + the added bias row each) of a key head
        ("query-key", "rotary-interleaved", (2, 34, 16, 4)),
        ("query-key-pass", "GL", (2, 34, 16, 4)),
        ("value-output", "GL", (2, 16, 32, 8)),
    ]
    assert all(v.ok and v.conclusive for v in sym.verified.values()) and len(sym.verified) == 3
    assert check_symmetries(model, x, sym, cond=100).max_rel_change < 1e-12
    # a full GL(8) on the query/key columns is not a symmetry: the rotation forbids it
    from geosharp.symmetry import PairSpec, Symmetries
    from geosharp.symmetry.groups import random_matrices

    qk = sym.pairs[0]
    gl = PairSpec(qk.module, "qk-as-GL", qk.g_blocks, qk.h_blocks)  # the rotated columns, GL(4)
    transforms = {gl.name: random_matrices(2, 4, 100.0)}
    moved = copy.deepcopy(model)
    reparameterize(moved, Symmetries([gl], sym.parameters), transforms=transforms, unverified=True)
    assert (moved(x) - model(x)).abs().max() > 1e-3 * model(x).abs().max()


def test_an_input_projection_in_front_of_multi_head_attention_is_no_reason_for_a_label():
    """A Linear patch embedding before nn.TransformerEncoder: every pair found and
    verified, and the model complete (it was labelled element-wise for "projection
    features of patch.weight enter multi_head_attention_forward", and strict refused)."""

    class Patches(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.patch = torch.nn.Linear(48, 32)
            layer = torch.nn.TransformerEncoderLayer(
                32, 4, dim_feedforward=64, dropout=0.0, batch_first=True
            )
            self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = torch.nn.Linear(32, 3)

        def forward(self, x):
            return self.head(self.encoder(self.patch(x)).mean(1))

    torch.manual_seed(0)
    model = Patches().double().eval()
    x = torch.randn(4, 9, 48, dtype=torch.float64)
    batch = (x, torch.randint(0, 3, (4,)))

    def loss(m, b):
        return torch.nn.functional.cross_entropy(m(b[0]), b[1])

    found = geosharp.find_symmetries(model, batch, loss_fn=loss)
    assert len(found.pairs) == 4 and len(found.verified) == 4
    assert found.complete and not found.ignored and not found.unrecognized
    estimator = geosharp.WorstCase(n_iters=1)
    result = geosharp.sharpness(model, [batch], loss, "geodesic-inv", 0.05, estimator, strict=True)
    assert result.symmetry["ignored"] == {} and result.symmetry["verified"] == 4


def test_reparameterize_and_check_take_the_batch_sharpness_takes_with_its_loss_fn():
    """batch=(inputs, labels) failed with the model's own TypeError from inside
    discovery; with loss_fn= it is the batch sharpness() takes, without it one line
    says what batch must be, before anything runs."""

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            return self.head(self.mha(x, x, x, need_weights=False)[0].mean(1))

    torch.manual_seed(0)
    model = Attention().double()
    batch = (torch.randn(3, 5, 8, dtype=F64), torch.tensor([0, 1, 0]))

    def loss(m, b):
        return F.cross_entropy(m(b[0]), b[1])

    for call in (reparameterize, check_symmetries):
        with pytest.raises(geosharp.UsageError, match=r"model\(\*batch\).*loss_fn=") as err:
            call(copy.deepcopy(model), batch=batch)
        assert "\n" not in str(err.value)
    twin = copy.deepcopy(model)
    reparameterize(twin, batch=batch, loss_fn=loss)
    assert not torch.equal(twin.mha.in_proj_weight, model.mha.in_proj_weight)
    with torch.no_grad():
        assert float(loss(twin, batch)) == pytest.approx(float(loss(model, batch)), rel=1e-12)
    check = check_symmetries(model, batch, loss_fn=loss)
    assert check.ok and check.n_pairs == 2 and 0 < check.max_rel_change < 1e-12
