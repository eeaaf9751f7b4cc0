"""Symmetry discovery on torch.nn attention, and the self-check that catches mistakes."""

import warnings

import pytest
import torch
from torch import nn

import geosharp
from geosharp.symmetry import Block, PairSpec, positions, register_handler

F64 = torch.float64


def shapes(sym):
    return [(p.kind, p.shape) for p in sym.pairs]


def test_packed_multihead_attention():
    mha = nn.MultiheadAttention(12, 3, dtype=F64)
    sym = geosharp.find_symmetries(mha)
    # (heads, n, m, h): biases absorbed as one more row of G (and of H for query/key)
    assert shapes(sym) == [("query-key", (3, 13, 13, 4)), ("value-output", (3, 13, 12, 4))]
    assert sym.elementwise == ["out_proj.bias"]
    q = torch.randn(5, 2, 12, dtype=F64)
    assert geosharp.check_symmetries(mha, (q, q, q), cond=100).ok


def test_separate_qkv_weights_and_bias_kv():
    """kdim/vdim != embed_dim stores q/k/v separately; add_bias_kv appends a learned key
    and value (extra rows of H and G)."""
    mha = nn.MultiheadAttention(8, 2, kdim=5, vdim=7, add_bias_kv=True, dtype=F64)
    sym = geosharp.find_symmetries(mha)
    assert shapes(sym) == [("query-key", (2, 9, 7, 4)), ("value-output", (2, 9, 8, 4))]
    q = torch.randn(4, 3, 8, dtype=F64)
    k = torch.randn(6, 3, 5, dtype=F64)
    v = torch.randn(6, 3, 7, dtype=F64)
    check = geosharp.check_symmetries(mha, (q, k, v), cond=100)
    assert check.ok, str(check)


def test_no_bias():
    mha = nn.MultiheadAttention(8, 2, bias=False, dtype=F64)
    sym = geosharp.find_symmetries(mha)
    assert shapes(sym) == [("query-key", (2, 8, 8, 4)), ("value-output", (2, 8, 8, 4))]
    assert sym.elementwise == []


def test_transformer_decoder_self_and_cross_attention():
    layer = nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, dtype=F64)
    sym = geosharp.find_symmetries(layer)
    assert [p.module for p in sym.pairs] == ["self_attn"] * 2 + ["multihead_attn"] * 2
    tgt, memory = torch.randn(5, 2, 8, dtype=F64), torch.randn(7, 2, 8, dtype=F64)
    assert geosharp.check_symmetries(layer, (tgt, memory), cond=100).ok


def test_full_transformer_stacks_all_layers():
    model = nn.Transformer(
        8, 2, num_encoder_layers=2, num_decoder_layers=1, dim_feedforward=16, dropout=0.0, dtype=F64
    )
    sym = geosharp.find_symmetries(model)
    assert len(sym.pairs) == 2 * 2 + 2 * 2  # 2 encoder layers, 1 decoder with 2 attentions
    src, tgt = torch.randn(6, 2, 8, dtype=F64), torch.randn(4, 2, 8, dtype=F64)
    assert geosharp.check_symmetries(model, (src, tgt), cond=100).ok


class MyAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(4, 4)
        self.k = nn.Linear(4, 4)

    def forward(self, x):
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        return scores.softmax(-1) @ x


def test_unrecognised_attention_is_reported_not_guessed():
    """Without a batch nothing can be traced, whatever the classes are called: what no
    handler declares is flagged, never guessed."""
    model = nn.Sequential(MyAttention(), nn.Linear(4, 2))
    with pytest.warns(UserWarning, match="does not understand.*<root>"):
        sym = geosharp.find_symmetries(model)
    assert sym.pairs == [] and sym.unrecognized == [""] and sym.discovery == "structure"
    assert "no forward pass ran, so 0.q.weight and 5 more" in sym.ignored[""][0].reason
    assert "NOT RECOGNISED" in sym.summary()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        geosharp.find_symmetries(model, warn=False)


def test_custom_attention_is_found_from_what_it_computes():
    """With a batch, the trace finds the query/key pair of the same module, verifies it,
    and says why there is no value/output pair (its values are the raw input)."""
    torch.manual_seed(0)
    model = nn.Sequential(MyAttention(), nn.Linear(4, 2)).to(F64)
    x = torch.randn(3, 5, 4, dtype=F64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sym = geosharp.find_symmetries(model, x)
    assert [(p.kind, p.group, p.shape) for p in sym.pairs] == [("query-key", "GL", (1, 5, 5, 4))]
    assert sym.verified["0:query-key"].ok and sym.verified["0:query-key"].conclusive
    assert sym.unrecognized == [] and sym.attention == ["0"]
    (drop,) = sym.dropped
    assert (drop.kind, drop.exact) == ("value-output", True) and "not projected" in drop.reason
    assert geosharp.check_symmetries(model, x, sym, cond=100).ok


class Wrong(nn.Module):
    """Scores use q(x) k(x)^T, but we will (wrongly) declare a value/output-like pair
    between q and the *input* of k, which is not a symmetry."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(4, 4, bias=False)
        self.k = nn.Linear(4, 4, bias=False)

    def forward(self, x):
        return (self.q(x) @ self.k(x).transpose(-1, -2)).softmax(-1) @ x


def test_self_check_names_a_wrong_pair():
    def wrong_handler(module, prefix, name_of):
        wq = positions(module.q.weight)  # (out, in)
        wk = positions(module.k.weight)
        # Declares G = W_Q (not W_Q^T): not the product structure of the scores.
        return [
            PairSpec(
                prefix,
                "wrong",
                (Block(name_of(module.q.weight), wq[None]),),
                (Block(name_of(module.k.weight), wk.t()[None]),),
            )
        ]

    register_handler(Wrong, wrong_handler)
    model = nn.Sequential(Wrong()).double()
    x = torch.randn(3, 5, 4, dtype=F64)
    # Discovery verifies every pair on the batch: the wrong declaration is dropped, with a
    # warning that names it, and the layout traced from the forward pass is used instead.
    with pytest.warns(UserWarning, match=r"0:wrong: dropped, a transform .* used instead"):
        sym = geosharp.find_symmetries(model, x)
    assert [(p.kind, p.shape) for p in sym.pairs] == [("query-key", (1, 4, 4, 4))]
    assert sym.unrecognized == [] and sym.verified["0:query-key"].ok
    # Unverified, the self-check on the whole model names the culprit.
    check = geosharp.check_symmetries(model, x, geosharp.find_symmetries(model, verify=False))
    assert not check.ok and check.status == "failed"
    assert "0:wrong" in check.per_pair and "0:wrong" in str(check)


def test_entries_claimed_twice_are_rejected():
    def twice(module, prefix, name_of):
        w = positions(module.weight)[None]
        name = name_of(module.weight)
        return [PairSpec(prefix, "a", (Block(name, w),), (Block(name, w),))]

    class Twice(nn.Linear):
        pass

    register_handler(Twice, twice)
    with pytest.raises(ValueError, match="claimed by two symmetric pairs"):
        geosharp.find_symmetries(Twice(3, 3))


def test_reparameterize_in_place_and_returns_transforms():
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, dtype=F64)
    x = torch.randn(5, 3, 8, dtype=F64)
    layer.eval()
    with torch.no_grad():
        before = layer(x)
        transforms = geosharp.reparameterize(layer, cond=100, seed=2, batch=x)
        after = layer(x)
    assert set(transforms) == {"self_attn:query-key", "self_attn:value-output"}
    A = transforms["self_attn:query-key"]
    s = torch.linalg.svdvals(A)
    assert torch.allclose(s.max(-1).values / s.min(-1).values, torch.full((2,), 100.0, dtype=F64))
    assert torch.allclose(before, after, atol=1e-10)


@pytest.mark.parametrize("scale", [1.0, 1e-3, 1e-7])
def test_cancellation_equals_the_product_norms(scale):
    """``max_head |G|_F |H|_F / |G H^T|_F`` from the ``h x h`` Gram matrices equals the
    one from the product, also when the product nearly cancels (a ratio of about
    ``1 / scale``; past 10^4 the product itself is used)."""
    from geosharp.symmetry.verify import _cancellation

    gen = torch.Generator().manual_seed(0)
    G = torch.randn(3, 7, 4, generator=gen, dtype=torch.float64)
    H = torch.randn(3, 5, 4, generator=gen, dtype=torch.float64)
    G[..., 3] *= scale  # G H^T = sum_c G_c H_c^T: only the small column survives
    H[..., :3] *= scale
    tensors = {"g": G.reshape(-1), "h": H.reshape(-1)}
    pair = PairSpec(
        "m",
        "query-key",
        (Block("g", torch.arange(84).view(3, 7, 4)),),
        (Block("h", torch.arange(60).view(3, 5, 4)),),
    )
    product = torch.linalg.matrix_norm(G @ H.mT)
    expected = float((torch.linalg.matrix_norm(G) * torch.linalg.matrix_norm(H) / product).max())
    assert _cancellation(tensors, pair, "") == pytest.approx(max(1.0, expected), rel=1e-8)
    assert scale == 1.0 or expected > 0.1 / scale
