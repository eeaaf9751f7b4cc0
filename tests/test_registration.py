"""Declaring pairs by hand: ``declare_pair``, ``Symmetries.with_pairs`` and
``register_handler`` for custom modules, and the runnable example of
``docs/architectures.md``."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import geosharp
from geosharp.symmetry import (
    check_symmetries,
    declare_pair,
    find_symmetries,
    reparameterize,
)
from geosharp.symmetry import registry as handler_registry

F64 = torch.float64
DOCS = Path(__file__).resolve().parents[1] / "docs" / "architectures.md"


class LowRank(nn.Module):
    """``tanh(U V x)``: the pair ``(U, V^T)`` is a GL(r) symmetry."""

    def __init__(self, d_in=6, rank=3, d_out=5):
        super().__init__()
        self.U = nn.Parameter(torch.randn(d_out, rank))
        self.V = nn.Parameter(torch.randn(rank, d_in))
        self.head = nn.Linear(d_out, 2)

    def forward(self, x):
        return self.head(torch.tanh(x @ self.V.T @ self.U.T))


class FusedSelfAttention(nn.Module):
    """Self-attention with raw parameters: ``w_qkv`` ``(3 d, d)`` holds (q | k | v) x
    heads x d_head, ``w_out`` ``(d, d)``."""

    def __init__(self, dim=8, heads=2):
        super().__init__()
        self.heads, self.d_head = heads, dim // heads
        self.w_qkv = nn.Parameter(torch.randn(3 * dim, dim) / dim**0.5)
        self.w_out = nn.Parameter(torch.randn(dim, dim) / dim**0.5)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (x @ self.w_qkv.T).view(b, n, 3, self.heads, self.d_head).permute(2, 0, 3, 1, 4)
        y = torch.softmax(q @ k.transpose(-1, -2), -1) @ v
        return y.transpose(1, 2).reshape(b, n, d) @ self.w_out.T


def fused_attention_pairs(module, prefix, name_of):
    """A handler for FusedSelfAttention, built with declare_pair."""
    heads, dh = module.heads, module.d_head
    d = heads * dh

    def rows(start):  # head blocks (heads, d_in, d_head) of rows start .. start + d
        return lambda w: w[start : start + d].reshape(heads, dh, -1).transpose(1, 2)

    qkv = module.w_qkv
    return [
        declare_pair(
            name_of, G=[(qkv, rows(0))], H=[(qkv, rows(d))], module=prefix, kind="query-key"
        ),
        declare_pair(
            name_of,
            G=[(qkv, rows(2 * d))],
            H=[(module.w_out, lambda w: w.reshape(-1, heads, dh).transpose(0, 1))],
            module=prefix,
            kind="value-output",
        ),
    ]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.attn = FusedSelfAttention()
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        h = self.embed(x)
        return self.out((h + self.attn(h)).mean(1))


def test_declare_pair_on_a_model():
    torch.manual_seed(0)
    model = LowRank().to(F64)
    pair = declare_pair(model, G=["U"], H=[("V", lambda w: w.T)], module="", kind="low-rank")
    assert pair.shape == (1, 5, 6, 3) and pair.params == ("U", "V")
    symmetries = find_symmetries(model).with_pairs(pair)
    assert [p.kind for p in symmetries.pairs] == ["low-rank"]
    x = torch.randn(4, 6, dtype=F64)
    assert check_symmetries(model, x, symmetries, cond=100).ok

    def loss(m, batch):
        return m(batch).pow(2).mean()

    moved = copy.deepcopy(model)
    reparameterize(moved, symmetries, cond=100, seed=1, batch=x)
    for metric, rho in (("inv", 0.1), ("mix", 0.01)):
        a, b = (
            geosharp.sharpness(
                m,
                [x],
                loss,
                geosharp.Geometry.named("geodesic", metric=metric),
                rho=rho,
                symmetries=symmetries,
                estimator=geosharp.WorstCase(n_iters=10),
            ).value
            for m in (model, moved)
        )
        assert abs(a - b) <= 1e-2 * abs(a)


def test_register_handler_for_a_custom_class(monkeypatch):
    torch.manual_seed(0)
    model = Net().to(F64)
    x = torch.randn(3, 5, 4, dtype=F64)
    with pytest.warns(UserWarning, match="does not understand.*<root>"):
        assert find_symmetries(model).pairs == []  # no batch: nothing traced, said

    monkeypatch.setitem(handler_registry._HANDLERS, FusedSelfAttention, fused_attention_pairs)
    symmetries = find_symmetries(model, warn=False)  # the handler's pairs, the rest untraced
    assert symmetries.unrecognized == [""] and not symmetries.complete
    assert find_symmetries(model, x).complete
    assert [(p.kind, p.shape) for p in symmetries.pairs] == [
        ("query-key", (2, 8, 8, 4)),
        ("value-output", (2, 8, 8, 4)),
    ]
    check = check_symmetries(model, x, cond=100)
    assert check.ok and check.max_rel_change < 1e-12
    assert "GL(4) x 2 heads" in symmetries.summary()


def test_a_wrong_declaration_is_caught_by_the_self_check():
    torch.manual_seed(0)
    model = Net().to(F64)
    qkv = model.attn.w_qkv
    # Queries of head 0 against the keys of head 1: not a symmetry.
    wrong = declare_pair(
        model,
        G=[(qkv, lambda w: w[0:4].T)],
        H=[(qkv, lambda w: w[12:16].T)],
        module="attn",
        kind="query-key",
    )
    symmetries = find_symmetries(model, warn=False).with_pairs(wrong)
    assert "attn" not in symmetries.unrecognized  # the declared module is no longer flagged
    assert symmetries.unverified == ["attn:query-key"] and not symmetries.complete
    check = check_symmetries(model, torch.randn(3, 5, 4, dtype=F64), symmetries, cond=100)
    assert not check.ok
    assert "attn:query-key" in str(check)


def test_declare_pair_errors():
    model = LowRank()
    with pytest.raises(ValueError, match="unknown parameter"):
        declare_pair(model, G=["W"], H=["V"])
    with pytest.raises(ValueError, match=r"\(rows, h\)"):
        declare_pair(model, G=[("U", lambda w: w[0])], H=["V"])
    with pytest.raises(ValueError, match="not a parameter"):
        declare_pair(model, G=[torch.zeros(5, 3)], H=["V"])
    with pytest.raises(ValueError, match=r"G is \(heads=1, h=3\)"):
        declare_pair(model, G=["U"], H=["V"])  # h = 3 vs h = 6
    with pytest.raises(ValueError, match="even head dimension"):
        declare_pair(model, G=["U"], H=[("V", lambda w: w.T)], group="rotary")
    with pytest.raises(TypeError, match="tensors themselves"):
        declare_pair(lambda t: "x", G=["U"], H=["V"])
    pair = declare_pair(model, G=["U"], H=[("V", lambda w: w.T)])
    symmetries = find_symmetries(model).with_pairs(pair)
    with pytest.raises(ValueError, match="two symmetric pairs"):
        symmetries.with_pairs(pair)


def test_docs_example_runs():
    text = DOCS.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "docs/architectures.md has no python example"
    saved = dict(handler_registry._HANDLERS)
    try:
        for code in blocks:
            exec(compile(code, str(DOCS), "exec"), {"__name__": "docs_example"})
    finally:
        handler_registry._HANDLERS.clear()
        handler_registry._HANDLERS.update(saved)
