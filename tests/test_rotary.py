"""The subgroups of GL(h) (MATH.md section 1), rotary, orthogonal and their
intersection: their Lie algebras, random elements, and the horizontal projection
(by a Cholesky factor, and by conjugate gradients for a large algebra), checked
against a dense brute-force computation."""

from __future__ import annotations

import pytest
import torch

from geosharp.geometry.pairs import InvMetric, MixMetric
from geosharp.geometry.subgroup import _vertical_gram, _vertical_gram_generic, restrict_state
from geosharp.symmetry import Block, PairSpec
from geosharp.symmetry.groups import lie_algebra_basis, random_group_elements

F64 = torch.float64
METRICS = {"inv": InvMetric(), "inv-eps": InvMetric(eps=1e-2), "mix": MixMetric()}


def _pairs(batch=3, n=9, m=7, h=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    G = torch.randn(batch, n, h, generator=g, dtype=F64)
    H = torch.randn(batch, m, h, generator=g, dtype=F64)
    xi = (
        torch.randn(batch, n, h, generator=g, dtype=F64),
        torch.randn(batch, m, h, generator=g, dtype=F64),
    )
    return G, H, xi


SUBGROUPS = ["rotary", "rotary-interleaved", "orthogonal", "rotary-orthogonal"]


def _dense_basis(h, group="rotary"):
    rows, cols, signs = lie_algebra_basis(group, h)
    basis = torch.zeros(rows.shape[0], h, h, dtype=F64)
    for a in range(rows.shape[0]):
        for s in range(2):
            basis[a, rows[a, s], cols[a, s]] += signs[a, s]
    return basis


def _rotation(h, angles, interleaved=False):
    """RoPE: plane (j, j + h/2) (or (2j, 2j+1)) rotated by angles[j]."""
    c, s = torch.diag_embed(torch.cos(angles)), torch.diag_embed(torch.sin(angles))
    R = torch.cat([torch.cat([c, -s], -1), torch.cat([s, c], -1)], -2)
    if not interleaved:
        return R
    order = torch.stack([torch.arange(h // 2), torch.arange(h // 2) + h // 2], 1).reshape(-1)
    return R[order][:, order]


def test_lie_algebra_is_the_commutant_of_rope():
    h = 8
    basis = _dense_basis(h)
    assert basis.shape[0] == h
    gram = torch.einsum("aij,bij->ab", basis, basis)
    assert torch.equal(gram, 2 * torch.eye(h, dtype=F64))
    R = _rotation(h, torch.rand(h // 2, dtype=F64) * 6)
    for E in basis:
        assert torch.allclose(E @ R, R @ E, atol=1e-14)
    # A generic matrix does not commute: the group really is smaller than GL(h).
    M = torch.randn(h, h, dtype=F64)
    assert not torch.allclose(M @ R, R @ M, atol=1e-3)


@pytest.mark.parametrize("group", ["orthogonal", "rotary-orthogonal"])
def test_orthogonal_algebras_are_skew_and_the_groups_orthogonal(group):
    """``O(h)``: the skew-symmetric matrices, ``h(h-1)/2`` of them; with rotary
    embeddings, the rotations of each plane, which commute with RoPE."""
    h = 6
    basis = _dense_basis(h, group)
    assert basis.shape[0] == (h * (h - 1) // 2 if group == "orthogonal" else h // 2)
    assert torch.equal(basis, -basis.transpose(-1, -2))
    gram = torch.einsum("aij,bij->ab", basis, basis)
    assert torch.equal(gram, 2 * torch.eye(len(basis), dtype=F64))
    A = random_group_elements(group, 5, h, cond=100.0, generator=torch.Generator().manual_seed(0))
    eye = torch.eye(h, dtype=F64).expand(5, h, h)
    assert torch.allclose(A @ A.transpose(-1, -2), eye, atol=1e-12)
    assert torch.allclose(torch.linalg.inv(A).transpose(-1, -2), A, atol=1e-12)  # A^{-T} = A
    if group == "rotary-orthogonal":
        R = _rotation(h, torch.rand(h // 2, dtype=F64) * 6)
        assert torch.allclose(A @ R, R @ A, atol=1e-12)
    # the exponential of the algebra lies in the group
    L = torch.einsum("a,aij->ij", torch.randn(len(basis), dtype=F64), basis)
    E = torch.linalg.matrix_exp(L)
    assert torch.allclose(E @ E.T, torch.eye(h, dtype=F64), atol=1e-12)


def test_random_group_elements_commute_with_rotations_and_have_the_condition_number():
    A = random_group_elements(
        "rotary", 5, 8, cond=100.0, generator=torch.Generator().manual_seed(0)
    )
    R = _rotation(8, torch.rand(4, dtype=F64) * 6)
    assert torch.allclose(A @ R, R @ A, atol=1e-12)
    s = torch.linalg.svdvals(A)
    assert torch.allclose(s[:, 0] / s[:, -1], torch.full((5,), 100.0, dtype=F64))
    # Inverse transpose stays in the group (H -> H A^{-T}).
    B = torch.linalg.inv(A).transpose(-1, -2)
    assert torch.allclose(B @ R, R @ B, atol=1e-12)
    A = random_group_elements("rotary-interleaved", 5, 8, 10.0, torch.Generator().manual_seed(1))
    R = _rotation(8, torch.rand(4, dtype=F64) * 6, interleaved=True)
    assert torch.allclose(A @ R, R @ A, atol=1e-12)


@pytest.mark.parametrize("group", SUBGROUPS)
@pytest.mark.parametrize("metric", list(METRICS))
def test_projection_matches_brute_force(metric, group):
    G, H, xi = _pairs()
    base = METRICS[metric].state(G, H)
    state = restrict_state(base, group)
    basis = _dense_basis(G.shape[-1], group)
    # Brute force: vertical basis V(E_a), Gram matrix and right-hand side from the metric.
    vertical = [base.vertical(E.expand(G.shape[0], -1, -1)) for E in basis]
    M = torch.stack(
        [torch.stack([base.inner(va, vb) for vb in vertical], -1) for va in vertical], -2
    )
    rhs = torch.stack([base.inner(xi, v) for v in vertical], -1)
    c = torch.linalg.solve(M, rhs)
    L = torch.einsum("ba,aij->bij", c, basis)
    expected = (xi[0] - G @ L, xi[1] + H @ L.transpose(-1, -2))

    got = state.project_horizontal(xi)
    assert torch.allclose(got[0], expected[0], atol=1e-10)
    assert torch.allclose(got[1], expected[1], atol=1e-10)
    # g-orthogonal to every vertical direction of the subgroup ...
    assert max(float(base.inner(got, v).abs().max()) for v in vertical) < 1e-10
    assert float(state.horizontal_residual(got).abs().max()) < 1e-10
    # ... idempotent, and larger than the GL(h)-horizontal space, which it contains.
    again = state.project_horizontal(got)
    assert torch.allclose(again[0], got[0], atol=1e-10)
    full = base.project_horizontal(xi)
    kept = state.project_horizontal(full)
    assert torch.allclose(kept[0], full[0], atol=1e-10)
    assert float(base.horizontal_residual(got).abs().max()) > 1e-3


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_conjugate_gradients_solve_a_large_algebra_as_the_dense_factor_does(metric, monkeypatch):
    """``O(h)`` for a large ``h`` is solved matrix-free (conjugate gradients on ``h x h``
    products): the same projection as the Cholesky factor of the dense Gram matrix."""
    from geosharp.geometry import subgroup

    G, H, xi = _pairs(n=20, m=16, h=12)
    dense = restrict_state(METRICS[metric].state(G, H), "orthogonal")
    monkeypatch.setattr(subgroup, "DENSE", 8)  # 66 basis elements: by CG
    matrix_free = restrict_state(METRICS[metric].state(G, H), "orthogonal")
    assert dense.chol is not None and matrix_free.chol is None
    a, b = dense.project_horizontal(xi), matrix_free.project_horizontal(xi)
    assert torch.allclose(a[0], b[0], atol=1e-10) and torch.allclose(a[1], b[1], atol=1e-10)


@pytest.mark.parametrize("group", SUBGROUPS)
@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_fast_gram_matches_generic(metric, group):
    G, H, _ = _pairs(n=12, m=10, h=8)
    state = METRICS[metric].state(G, H)
    rows, cols, signs = lie_algebra_basis(group, 8)
    fast = _vertical_gram(state, rows, cols, signs)
    slow = _vertical_gram_generic(state, rows, cols, signs)
    assert torch.allclose(fast, slow, atol=1e-10)


@pytest.mark.parametrize("group", SUBGROUPS)
@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_projection_is_equivariant_under_the_subgroup(metric, group):
    """Base point (G A, H A^{-T}), tangent (xiG A, xiH A^{-T}): the projection is the
    transformed projection, for A in the subgroup."""
    G, H, xi = _pairs(n=12, m=10, h=8)
    A = random_group_elements(group, G.shape[0], 8, 30.0, torch.Generator().manual_seed(1))
    Ait = torch.linalg.inv(A).transpose(-1, -2)
    state = restrict_state(METRICS[metric].state(G, H), group)
    moved = restrict_state(METRICS[metric].state(G @ A, H @ Ait), group)
    p = state.project_horizontal(xi)
    q = moved.project_horizontal((xi[0] @ A, xi[1] @ Ait))
    assert torch.allclose(q[0], p[0] @ A, atol=1e-9)
    assert torch.allclose(q[1], p[1] @ Ait, atol=1e-9)
    assert torch.allclose(moved.inner(q, q), state.inner(p, p), rtol=1e-10)


def test_pair_spec_rejects_an_odd_rotary_head():
    index = torch.arange(10).view(1, 2, 5)
    with pytest.raises(ValueError, match="even head dimension"):
        PairSpec("m", "query-key", (Block("w", index),), (Block("w", index),), group="rotary")
    with pytest.raises(ValueError, match="unknown symmetry group"):
        PairSpec("m", "query-key", (Block("w", index),), (Block("w", index),), group="SO")


def test_llama_vertical_directions_outside_the_subgroup_change_the_loss():
    """Why the rotary projection keeps more than the GL(h)-horizontal space: under RoPE,
    vertical GL directions V(L) with L outside k change the loss at first order, so they
    are genuine perturbations; directions V(L) with L in k do not."""
    tf = pytest.importorskip("transformers")
    from geosharp.geometry.space import stack_pairs
    from geosharp.layout import ParameterLayout
    from geosharp.symmetry import find_symmetries

    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
        initializer_range=0.3,
    )
    model = tf.LlamaForCausalLM(config).to(F64).eval()
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(0))
    named = list(model.named_parameters())
    layout = ParameterLayout.from_named(named)
    theta = layout.flatten(dict(named)).detach()
    (qk,) = [p for p in find_symmetries(model).pairs if p.kind == "query-key"]
    (block,) = stack_pairs([qk], layout, theta.device)
    G, H = block.gather(theta)

    def loss(flat):
        out = torch.func.functional_call(model, layout.unflatten(flat), (), {"input_ids": ids})
        return torch.nn.functional.cross_entropy(
            out.logits[:, :-1].reshape(-1, 50), ids[:, 1:].reshape(-1)
        )

    flat = theta.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(loss(flat), [flat])
    gG, gH = block.gather(grad)
    h = G.shape[-1]
    basis = _dense_basis(h)

    def derivative(L):  # d/dt loss along V(L) = (G L, -H L^T)
        return float(((gG * (G @ L)).sum() - (gH * (H @ L.transpose(-1, -2))).sum()).abs())

    inside = max(derivative(E.expand(G.shape[0], -1, -1)) for E in basis)
    # E_12 (plane 1 mixed into plane 2) is not in k.
    outside = torch.zeros(G.shape[0], h, h, dtype=F64)
    outside[:, 0, 1] = 1.0
    assert inside < 1e-10
    assert derivative(outside) > 1e-4
