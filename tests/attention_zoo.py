"""Attention written by hand, the way research and 2026 LLM code writes it, for the
soundness suite (``tests/test_soundness.py``): each case is a small float64 model, a
batch, and the truth about its symmetries, known by construction.

``expect``: the pair blocks that are symmetries of the whole model (query/key,
value/output per attention, products of projections elsewhere); ``groups``: their
groups, where given; ``outcome``: what discovery must do, ``"found"`` (every expected
pair, verified, result complete) or ``"labelled"`` (a miss is allowed, but said: the
result is not complete). ``ids``: the model reads token ids (a batch of 4 x 6 ids
below 11), not vectors; ``backward``: torch can differentiate it on the CPU (not
``flex_attention``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

D, HEADS = 8, 2
DH = D // HEADS


def _split(t, heads=HEADS):
    b, n, _ = t.shape
    return t.view(b, n, heads, -1).transpose(1, 2)


def _merge(t):
    b, h, n, d = t.shape
    return t.transpose(1, 2).reshape(b, n, h * d)


class Plain(nn.Module):
    """Separate q, k, v, o; optional per-head scalars and gates."""

    def __init__(self, variant="plain"):
        super().__init__()
        self.variant = variant
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.temp = nn.Parameter(torch.rand(HEADS, 1, 1) + 0.5)  # per head
        self.head_scale = nn.Parameter(torch.rand(1, HEADS, 1, 1) + 0.5)
        self.feature_scale = nn.Parameter(torch.rand(DH) + 0.5)  # per feature: no GL
        self.gate = nn.Linear(D, HEADS)

    def forward(self, x):
        q, k, v = _split(self.q(x)), _split(self.k(x)), _split(self.v(x))
        if self.variant == "query-temperature":
            q = q * self.temp
        if self.variant == "data-temperature":
            q = q * F.softplus(self.gate(x)).transpose(1, 2).unsqueeze(-1)
        if self.variant == "feature-scale":
            q = q * self.feature_scale
        scores = q @ k.transpose(-1, -2) / math.sqrt(DH)
        if self.variant == "score-temperature":
            scores = scores * self.temp
        y = scores.softmax(-1) @ v
        if self.variant == "head-scale":
            y = y * self.head_scale
        if self.variant == "sigmoid-gate":
            y = y * torch.sigmoid(self.gate(x)).transpose(1, 2).unsqueeze(-1)
        return self.o(_merge(y))


class EinsumHeadsLast(nn.Module):
    """Raw parameters, einsum with heads on the last axis."""

    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv = (
            nn.Parameter(torch.randn(D, HEADS, DH) / D**0.5) for _ in "qkv"
        )
        self.wo = nn.Parameter(torch.randn(HEADS, DH, D) / D**0.5)

    def forward(self, x):
        q, k, v = (torch.einsum("bnd,dhe->bneh", x, w) for w in (self.wq, self.wk, self.wv))
        a = torch.einsum("bneh,bmeh->bhnm", q, k).softmax(-1)
        y = torch.einsum("bhnm,bmeh->bneh", a, v)
        return torch.einsum("bneh,hed->bnd", y, self.wo)


class Interleaved(nn.Module):
    """One fused projection, (q | k | v) interleaved per head."""

    def __init__(self):
        super().__init__()
        self.qkv, self.o = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, HEADS, 3, DH).permute(3, 0, 2, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.o(_merge(y))


class GroupedQuery(nn.Module):
    """Four query heads share two key/value heads."""

    def __init__(self):
        super().__init__()
        self.q, self.o = nn.Linear(D, 4 * 2), nn.Linear(4 * 2, D)
        self.kv = nn.Linear(D, 2 * 2 * 2)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, 4, 2).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, 2, 2).permute(2, 0, 3, 1, 4)
        k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        y = (q @ k.transpose(-1, -2)).softmax(-1) @ v
        return self.o(_merge(y))


class Landmarks(nn.Module):
    """Keys and values averaged over segments of tokens (Nystrom-like landmarks)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x):
        q, k, v = _split(self.q(x)), _split(self.k(x)), _split(self.v(x))
        b, h, n, d = k.shape
        k = k.reshape(b, h, n // 2, 2, d).mean(3)
        v = v.reshape(b, h, n // 2, 2, d).sum(3)
        return self.o(_merge((q @ k.transpose(-1, -2)).softmax(-1) @ v))


class CumulativeKeys(Plain):
    """Each key the running mean of the keys up to it (a cumulative sum over tokens)."""

    def forward(self, x):
        q, k, v = _split(self.q(x)), _split(self.k(x)), _split(self.v(x))
        counts = torch.arange(1, k.shape[2] + 1, dtype=k.dtype).view(1, 1, -1, 1)
        k = k.cumsum(2) / counts
        return self.o(_merge((q @ k.transpose(-1, -2)).softmax(-1) @ v))


class TokenMixer(nn.Module):
    """Linear attention, ``Q (K^T V)``: a symmetry of the values and outputs exists, the
    query/key form is not a bilinear score; the name says nothing."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x):
        q, k, v = (_split(f(x)).softmax(-1) for f in (self.q, self.k)), None, None
        q, k = q
        v = _split(self.v(x))
        return self.o(_merge(q @ (k.transpose(-1, -2) @ v)))


@torch.library.custom_op("geosharp_zoo::kernel", mutates_args=())
def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.softmax(q @ k.transpose(-1, -2), -1) @ v


@kernel.register_fake
def _(q, k, v):
    return torch.empty_like(q)


def _kernel_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _kernel_backward(ctx, grad):
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        out = torch.softmax(q @ k.transpose(-1, -2), -1) @ v
        return torch.autograd.grad(out, (q, k, v), grad)


kernel.register_autograd(_kernel_backward, setup_context=_kernel_setup)


class OpaqueMixer(nn.Module):
    """An opaque kernel in a class whose name says nothing of attention."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x):
        return self.o(_merge(kernel(_split(self.q(x)), _split(self.k(x)), _split(self.v(x)))))


class MaskedLogits(Plain):
    """Returns the attention output and its masked scores (-1e9 on the future)."""

    def forward(self, x):
        q, k, v = _split(self.q(x)), _split(self.k(x)), _split(self.v(x))
        n = x.shape[1]
        scores = q @ k.transpose(-1, -2)
        masked = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -1e9)
        return self.o(_merge(masked.softmax(-1) @ v)), masked


def _angles(n, d):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    return torch.arange(n, dtype=torch.float64)[:, None] * inv[None, :]  # (n, d/2)


class RotaryComplex(Plain):
    """Rotary embeddings as complex multiplication (Meta's LLaMA code)."""

    def forward(self, x):
        q, k, v = _split(self.q(x)), _split(self.k(x)), _split(self.v(x))
        b, h, n, d = q.shape
        freqs = torch.polar(torch.ones(n, d // 2, dtype=torch.float64), _angles(n, d))

        def rotate(t):
            z = torch.view_as_complex(t.reshape(b, h, n, d // 2, 2).contiguous())
            return torch.view_as_real(z * freqs).reshape(b, h, n, d)

        q, k = rotate(q), rotate(k)
        return self.o(_merge((q @ k.transpose(-1, -2)).softmax(-1) @ v))


class RotaryMatrix(Plain):
    """Rotary embeddings as an explicit rotation matrix per position."""

    def forward(self, x):
        q, k, v = _split(self.q(x)), _split(self.k(x)), _split(self.v(x))
        n, d = q.shape[2], q.shape[3]
        a = _angles(n, d)
        cos, sin = torch.cos(a), torch.sin(a)
        R = torch.zeros(n, d, d, dtype=torch.float64)
        j = torch.arange(d // 2)
        R[:, 2 * j, 2 * j], R[:, 2 * j + 1, 2 * j + 1] = cos, cos
        R[:, 2 * j, 2 * j + 1], R[:, 2 * j + 1, 2 * j] = -sin, sin
        q = torch.einsum("bhnd,nde->bhne", q, R)
        k = torch.einsum("bhnd,nde->bhne", k, R)
        return self.o(_merge((q @ k.transpose(-1, -2)).softmax(-1) @ v))


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2): low-rank queries and keys/values from
    latents, and a decoupled rotary part, one key head shared by all query heads."""

    def __init__(self, latent=6, rope=2):
        super().__init__()
        self.rope = rope
        self.q_down, self.q_up = nn.Linear(D, latent), nn.Linear(latent, HEADS * (DH + rope))
        self.kv_down = nn.Linear(D, latent + rope)
        self.k_up, self.v_up = nn.Linear(latent, D), nn.Linear(latent, D)
        self.o = nn.Linear(D, D)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q_up(self.q_down(x)).view(b, n, HEADS, DH + self.rope).transpose(1, 2)
        q_nope, q_rope = q[..., :DH], q[..., DH:]
        c, k_rope = self.kv_down(x).split([self.kv_down.out_features - self.rope, self.rope], -1)
        k_nope, v = _split(self.k_up(c)), _split(self.v_up(c))
        a = _angles(n, self.rope)
        cos, sin = torch.cos(a), torch.sin(a)

        def rotate(t):
            t1, t2 = t[..., :1], t[..., 1:]
            return torch.cat([t1 * cos - t2 * sin, t1 * sin + t2 * cos], -1)

        q_rope, k_rope = rotate(q_rope), rotate(k_rope[:, None].expand(b, HEADS, n, self.rope))
        q, k = torch.cat([q_nope, q_rope], -1), torch.cat([k_nope, k_rope], -1)
        return self.o(_merge((q @ k.transpose(-1, -2)).softmax(-1) @ v))


class WindowGlobal(Plain):
    """Attention within windows of 3 tokens, each window also attending to a learned
    global token."""

    def __init__(self):
        super().__init__()
        self.global_token = nn.Parameter(torch.randn(1, 1, D))

    def forward(self, x):
        b, n, _ = x.shape
        w = 3
        q, k, v = self.q(x), self.k(x), self.v(x)
        g_k, g_v = self.k(self.global_token), self.v(self.global_token)

        def windows(t):
            return t.view(b, n // w, w, HEADS, DH).permute(0, 1, 3, 2, 4)  # b, nw, h, w, d

        def glob(t):
            return t.view(1, 1, HEADS, 1, DH).expand(b, n // w, HEADS, 1, DH)

        q, k, v = (
            windows(q),
            torch.cat([windows(k), glob(g_k)], 3),
            torch.cat([windows(v), glob(g_v)], 3),
        )
        y = (q @ k.transpose(-1, -2)).softmax(-1) @ v  # b, nw, h, w, d
        return self.o(y.permute(0, 1, 3, 2, 4).reshape(b, n, D))


class Stack(nn.Module):
    """Blocks with a residual stream, a head; options to tie and share weights."""

    def __init__(self, block, layers=1, tie_output=False, share_values=False, alias_norm=False):
        super().__init__()
        self.embed = nn.Linear(5, D)
        self.norm = nn.LayerNorm(D)
        if alias_norm:
            self.norm_again = self.norm  # one module under two names
        self.blocks = nn.ModuleList(block() for _ in range(layers))
        if share_values:
            for b in self.blocks[1:]:
                b.v = self.blocks[0].v
        self.head = nn.Linear(D, D)
        if tie_output:  # the head reads the first block's output weight
            self.head.weight = self.blocks[0].o.weight

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            out = block(self.norm(h))
            h = h + (out[0] if isinstance(out, tuple) else out)
        return self.head(h).mean(1)


def _rotate_half(t, cos, sin):
    t1, t2 = t.chunk(2, -1)
    return torch.cat([t1 * cos - t2 * sin, t1 * sin + t2 * cos], -1)


def _cos_sin(n, d):
    a = _angles(n, d)
    return torch.cos(a), torch.sin(a)


class Mamba2(nn.Module):
    """A Mamba-2 mixer as a sequential scan: ``in_proj`` to (z, x, B, C, dt), a causal
    depthwise convolution and SiLU on (x, B, C) (``conv=False``: none, so B and C meet
    linearly), a scalar decay per head, the state updated by an outer product and read by
    ``einsum(state, C)``, a gated output."""

    def __init__(self, conv=True, heads=2, p=4, n=4):
        super().__init__()
        self.conv_on, self.heads, self.p, self.n = conv, heads, p, n
        inner = heads * p
        self.in_proj = nn.Linear(D, 2 * inner + 2 * n + heads)
        self.conv = nn.Conv1d(inner + 2 * n, inner + 2 * n, 3, groups=inner + 2 * n, padding=2)
        self.A_log = nn.Parameter(torch.rand(heads))
        self.D_skip = nn.Parameter(torch.ones(heads))
        self.dt_bias = nn.Parameter(torch.rand(heads))
        self.out_proj = nn.Linear(inner, D)

    def forward(self, u):
        b, L, _ = u.shape
        h, p, n = self.heads, self.p, self.n
        z, xBC, dt = self.in_proj(u).split([h * p, h * p + 2 * n, h], -1)
        if self.conv_on:
            xBC = F.silu(self.conv(xBC.transpose(1, 2))[..., :L].transpose(1, 2))
        x, B, C = xBC.split([h * p, n, n], -1)
        x = x.reshape(b, L, h, p)
        dt = F.softplus(dt + self.dt_bias)
        A = -torch.exp(self.A_log)
        state = x.new_zeros(b, h, p, n)
        ys = []
        for t in range(L):
            decay = torch.exp(dt[:, t] * A)
            update = torch.einsum("bhp,bn->bhpn", x[:, t] * dt[:, t, :, None], B[:, t])
            state = state * decay[..., None, None] + update
            ys.append(torch.einsum("bhpn,bn->bhp", state, C[:, t]))
        y = torch.stack(ys, 1) + x * self.D_skip[:, None]
        return self.out_proj(y.reshape(b, L, h * p) * F.silu(z))


class Mamba1(nn.Module):
    """A Mamba-1 mixer as Hugging Face's slow path writes it: ``in_proj`` to (x, gate), a
    causal depthwise convolution and SiLU, ``x_proj`` to (dt, B, C), ``dt_proj`` and
    softplus, a decay per channel and state, ``deltaB_u`` by a three-operand einsum, the
    state read by ``matmul(state, C)``."""

    def __init__(self, inner=8, n=4, rank=2):
        super().__init__()
        self.inner, self.n, self.rank = inner, n, rank
        self.in_proj = nn.Linear(D, 2 * inner)
        self.conv = nn.Conv1d(inner, inner, 3, groups=inner, padding=2)
        self.x_proj = nn.Linear(inner, rank + 2 * n, bias=False)
        self.dt_proj = nn.Linear(rank, inner)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, n + 1).float()).repeat(inner, 1))
        self.D_skip = nn.Parameter(torch.ones(inner))
        self.out_proj = nn.Linear(inner, D)

    def forward(self, u):
        b, L, _ = u.shape
        x, gate = self.in_proj(u).transpose(1, 2).chunk(2, 1)
        x = F.silu(self.conv(x)[..., :L])
        dt, B, C = self.x_proj(x.transpose(1, 2)).split([self.rank, self.n, self.n], -1)
        dt = F.softplus(self.dt_proj(dt)).transpose(1, 2)  # b d L
        A = -torch.exp(self.A_log)
        dA = torch.exp(A[None, :, None, :] * dt[:, :, :, None])  # b d L n
        dBu = torch.einsum("bdl,bln,bdl->bdln", dt, B, x)
        state = x.new_zeros(b, self.inner, self.n)
        ys = []
        for t in range(L):
            state = dA[:, :, t] * state + dBu[:, :, t]
            ys.append(torch.matmul(state, C[:, t, :].unsqueeze(-1))[:, :, 0])
        y = torch.stack(ys, -1) + x * self.D_skip[None, :, None]
        return self.out_proj((y * F.silu(gate)).transpose(1, 2))


class GShardMoE(nn.Module):
    """A GShard-style mixture of experts: softmax gates, top-1 dispatch by einsum into
    expert slots, experts as one stacked weight, outputs combined by einsum."""

    def __init__(self, experts=3, hidden=12):
        super().__init__()
        self.router = nn.Linear(D, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, D, hidden) / D**0.5)
        self.w_out = nn.Parameter(torch.randn(experts, hidden, D) / hidden**0.5)

    def forward(self, x):
        gates = self.router(x).softmax(-1)  # b t e
        top = F.one_hot(gates.argmax(-1), gates.shape[-1]).to(x.dtype)
        combine = gates * top
        dispatched = torch.einsum("bte,btd->ebtd", top, x)
        hidden = F.gelu(torch.einsum("ebtd,edf->ebtf", dispatched, self.w_in))
        out = torch.einsum("ebtf,efd->ebtd", hidden, self.w_out)
        return torch.einsum("bte,ebtd->btd", combine, out)


class Hybrid(nn.Module):
    """Blocks of different kinds in order, each with a pre-norm and a residual."""

    def __init__(self, *blocks):
        super().__init__()
        self.embed = nn.Linear(5, D)
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in blocks)
        self.blocks = nn.ModuleList(b() for b in blocks)
        self.head = nn.Linear(D, D)

    def forward(self, x):
        h = self.embed(x)
        for norm, block in zip(self.norms, self.blocks):
            h = h + block(norm(h))
        return self.head(h).mean(1)


class FunctionalMHA(nn.Module):
    """``F.multi_head_attention_forward`` called directly with parameters of its own."""

    def __init__(self):
        super().__init__()
        self.in_proj_weight = nn.Parameter(torch.randn(3 * D, D) / D**0.5)
        self.in_proj_bias = nn.Parameter(torch.randn(3 * D) * 0.1)
        self.out_weight = nn.Parameter(torch.randn(D, D) / D**0.5)
        self.out_bias = nn.Parameter(torch.randn(D) * 0.1)

    def forward(self, x):
        t = x.transpose(0, 1)  # tokens first
        y, _ = F.multi_head_attention_forward(
            t, t, t, D, HEADS, self.in_proj_weight, self.in_proj_bias, None, None, False, 0.0,
            self.out_weight, self.out_bias, training=False, need_weights=False,
        )  # fmt: skip
        return y.transpose(0, 1)


class MemoryKV(Plain):
    """Learned memory keys and values prepended to every head's keys and values
    (x-transformers' ``num_mem_kv``)."""

    def __init__(self, memories=2):
        super().__init__()
        self.mem_k = nn.Parameter(torch.randn(HEADS, memories, DH))
        self.mem_v = nn.Parameter(torch.randn(HEADS, memories, DH))

    def forward(self, x):
        q, k, v = _split(self.q(x)), _split(self.k(x)), _split(self.v(x))
        b = x.shape[0]
        k = torch.cat([self.mem_k.expand(b, -1, -1, -1), k], 2)
        v = torch.cat([self.mem_v.expand(b, -1, -1, -1), v], 2)
        return self.o(_merge((q @ k.transpose(-1, -2) / DH**0.5).softmax(-1) @ v))


class Sinks(Plain):
    """gpt-oss: a learned logit per head joins every row of the scores before the
    softmax and is dropped after it."""

    def __init__(self):
        super().__init__()
        self.sinks = nn.Parameter(torch.randn(HEADS))

    def forward(self, x):
        q, k, v = _split(self.q(x)), _split(self.k(x)), _split(self.v(x))
        scores = q @ k.transpose(-1, -2) / DH**0.5
        sink = self.sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
        return self.o(_merge(probs @ v))


class Differential(nn.Module):
    """Differential attention: two softmax maps per head subtracted with a learned
    ``lambda``, a per-head RMSNorm (with a weight) on the mixed values."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(D, D), nn.Linear(D, D)
        self.v, self.o = nn.Linear(D, D), nn.Linear(D, D)
        self.lq1, self.lk1, self.lq2, self.lk2 = (
            nn.Parameter(torch.randn(DH // 2) * 0.1) for _ in range(4)
        )
        self.subln = nn.RMSNorm(DH)
        with torch.no_grad():  # a learned weight: no symmetry of values and outputs is left
            self.subln.weight.add_(0.3 * torch.randn(DH))

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, 2 * HEADS, DH // 2).transpose(1, 2)
        k = self.k(x).view(b, n, 2 * HEADS, DH // 2).transpose(1, 2)
        v = _split(self.v(x))
        a = (q @ k.transpose(-1, -2) / math.sqrt(DH // 2)).softmax(-1).view(b, HEADS, 2, n, n)
        lam = torch.exp((self.lq1 * self.lk1).sum()) - torch.exp((self.lq2 * self.lk2).sum()) + 0.8
        y = (a[:, :, 0] - lam * a[:, :, 1]) @ v
        return self.o(_merge(self.subln(y) * 0.2))


class SoftCapped(Plain):
    """Gemma-2: scores soft-capped by ``cap * tanh(s / cap)``."""

    def forward(self, x):
        q, k, v = _split(self.q(x)), _split(self.k(x)), _split(self.v(x))
        scores = q @ k.transpose(-1, -2) / DH**0.5
        scores = 5.0 * torch.tanh(scores / 5.0)
        return self.o(_merge(scores.softmax(-1) @ v))


class TorchTitan(nn.Module):
    """torchtitan / Meta's LLaMA: grouped-query heads, rotary by ``view_as_complex`` and
    a ``freqs_cis`` table of ``torch.polar``, ``repeat_kv`` by expand and reshape."""

    def __init__(self, heads=4, kv=2, dh=4):
        super().__init__()
        self.heads, self.kv, self.dh = heads, kv, dh
        self.wq = nn.Linear(D, heads * dh, bias=False)
        self.wk = nn.Linear(D, kv * dh, bias=False)
        self.wv = nn.Linear(D, kv * dh, bias=False)
        self.wo = nn.Linear(heads * dh, D, bias=False)

    def forward(self, x):
        b, n, _ = x.shape
        xq = self.wq(x).view(b, n, self.heads, self.dh)
        xk = self.wk(x).view(b, n, self.kv, self.dh)
        xv = self.wv(x).view(b, n, self.kv, self.dh)
        freqs = 1.0 / (10000 ** (torch.arange(0, self.dh, 2, dtype=x.dtype) / self.dh))
        angles = torch.outer(torch.arange(n, dtype=x.dtype), freqs)
        freqs_cis = torch.polar(torch.ones_like(angles), angles).view(1, n, 1, self.dh // 2)

        def rope(t):
            z = torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2))
            return torch.view_as_real(z * freqs_cis).flatten(3).type_as(t)

        xq, xk = rope(xq), rope(xk)
        rep = self.heads // self.kv

        def repeat_kv(t):
            bs, sl, kvh, hd = t.shape
            return t[:, :, :, None, :].expand(bs, sl, kvh, rep, hd).reshape(bs, sl, kvh * rep, hd)

        q, k, v = (t.transpose(1, 2) for t in (xq, repeat_kv(xk), repeat_kv(xv)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, n, -1))


class GroupedEinsum(nn.Module):
    """Grouped-query attention by a grouped einsum: no head is repeated."""

    def __init__(self, kv=2, group=2, dh=2):
        super().__init__()
        self.kv, self.group, self.dh = kv, group, dh
        self.q = nn.Linear(D, kv * group * dh)
        self.kv_proj = nn.Linear(D, 2 * kv * dh)
        self.o = nn.Linear(kv * group * dh, D)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.kv, self.group, self.dh)
        k, v = self.kv_proj(x).view(b, n, 2, self.kv, self.dh).unbind(2)
        s = torch.einsum("bnhgd,bmhd->bhgnm", q, k).softmax(-1)
        y = torch.einsum("bhgnm,bmhd->bnhgd", s, v)
        return self.o(y.reshape(b, n, -1))


class QKRMSNorm(Plain):
    """nanochat: rotary, then queries and keys normalised per head without a weight
    (``F.rms_norm``): a rotation on each plane is left (``rotary=False``: no rotary,
    ``O(h)`` is left)."""

    def __init__(self, rotary=True):
        super().__init__()
        self.rotary = rotary

    def forward(self, x):
        q, k, v = _split(self.q(x)), _split(self.k(x)), _split(self.v(x))
        if self.rotary:
            cos, sin = _cos_sin(x.shape[1], DH)
            q, k = _rotate_half(q, cos, sin), _rotate_half(k, cos, sin)
        q, k = F.rms_norm(q, (DH,)), F.rms_norm(k, (DH,))
        return self.o(_merge(F.scaled_dot_product_attention(q, k, v, is_causal=True)))


class Cosine(Plain):
    """Cosine attention (Swin-v2): ``F.normalize`` on queries and keys, a learned
    temperature per head."""

    def forward(self, x):
        q, k, v = _split(self.q(x)), _split(self.k(x)), _split(self.v(x))
        scores = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-1, -2)
        return self.o(_merge((scores * self.temp.exp()).softmax(-1) @ v))


class LatentV3(nn.Module):
    """DeepSeek-V3's multi-head latent attention, as written by hand: low-rank queries
    through a normalised latent, keys and values from a normalised latent, a decoupled
    rotary part of the keys shared by all heads, queries and keys assembled with
    ``new_empty`` and slice writes."""

    def __init__(self, q_rank=6, kv_rank=6, nope=4, rope=2, dv=4):
        super().__init__()
        self.nope, self.rope, self.dv, self.kv_rank = nope, rope, dv, kv_rank
        self.q_a = nn.Linear(D, q_rank, bias=False)
        self.q_norm = nn.RMSNorm(q_rank)
        self.q_b = nn.Linear(q_rank, HEADS * (nope + rope), bias=False)
        self.kv_a = nn.Linear(D, kv_rank + rope, bias=False)
        self.kv_norm = nn.RMSNorm(kv_rank)
        self.kv_b = nn.Linear(kv_rank, HEADS * (nope + dv), bias=False)
        self.o = nn.Linear(HEADS * dv, D, bias=False)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q_b(self.q_norm(self.q_a(x))).view(b, n, HEADS, -1).transpose(1, 2)
        q_nope, q_pe = q.split([self.nope, self.rope], -1)
        c, k_pe = self.kv_a(x).split([self.kv_rank, self.rope], -1)
        kv = self.kv_b(self.kv_norm(c)).view(b, n, HEADS, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.dv], -1)
        cos, sin = _cos_sin(n, self.rope)
        q_pe = _rotate_half(q_pe, cos, sin)
        k_pe = _rotate_half(k_pe.view(b, 1, n, self.rope), cos, sin)
        query = q.new_empty(b, HEADS, n, self.nope + self.rope)
        query[..., : self.nope] = q_nope
        query[..., self.nope :] = q_pe
        key = q.new_empty(b, HEADS, n, self.nope + self.rope)
        key[..., : self.nope].copy_(k_nope)
        key[..., self.nope :].copy_(k_pe.expand(b, HEADS, n, self.rope))
        scores = query @ key.transpose(-1, -2) / math.sqrt(self.nope + self.rope)
        return self.o(_merge(scores.softmax(-1) @ v))


class SharedWithAdapters(nn.Module):
    """Zamba2: one attention block shared across depth, each call adding a LoRA adapter
    of its own to the queries, keys and values."""

    def __init__(self, calls=2, rank=2):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False) for _ in range(4))
        self.adapters = nn.ModuleList(
            nn.ModuleDict({
                p: nn.Sequential(nn.Linear(D, rank, bias=False), nn.Linear(rank, D, bias=False))
                for p in "qkv"
            })
            for _ in range(calls)
        )  # fmt: skip

    def forward(self, x, call):
        a = self.adapters[call]
        q = _split(self.q(x) + a["q"](x))
        k = _split(self.k(x) + a["k"](x))
        v = _split(self.v(x) + a["v"](x))
        return self.o(_merge(F.scaled_dot_product_attention(q, k, v)))


class SharedStack(nn.Module):
    """A shared block called at two depths, an MLP between the calls."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(5, D)
        self.shared = SharedWithAdapters()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
        self.head = nn.Linear(D, D)

    def forward(self, x):
        h = self.embed(x)
        h = h + self.shared(self.norm1(h), 0)
        h = h + self.mlp(h)
        h = h + self.shared(self.norm2(h), 1)
        return self.head(h).mean(1)


class SharedKV(nn.Module):
    """Keys and values of the first layer read by the second (cross-layer sharing)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(5, D)
        self.k, self.v = nn.Linear(D, D), nn.Linear(D, D)
        self.q1, self.o1, self.q2, self.o2 = (nn.Linear(D, D) for _ in range(4))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, D)

    def forward(self, x):
        h = self.embed(x)
        z = self.norm(h)
        k, v = _split(self.k(z)), _split(self.v(z))
        h = h + self.o1(_merge(F.scaled_dot_product_attention(_split(self.q1(z)), k, v)))
        h = h + self.o2(_merge(F.scaled_dot_product_attention(_split(self.q2(self.norm(h))), k, v)))
        return self.head(h).mean(1)


class Parallel(nn.Module):
    """PaLM / Falcon: attention and MLP in parallel from one norm, multi-query heads."""

    def __init__(self, heads=4, dh=2):
        super().__init__()
        self.heads, self.dh = heads, dh
        self.qkv = nn.Linear(D, (heads + 2) * dh, bias=False)
        self.o = nn.Linear(heads * dh, D, bias=False)
        self.up, self.gate, self.down = nn.Linear(D, 16), nn.Linear(D, 16), nn.Linear(16, D)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).split([self.heads * self.dh, self.dh, self.dh], -1)
        q = q.view(b, n, self.heads, self.dh).transpose(1, 2)
        k, v = k.unsqueeze(1), v.unsqueeze(1)
        y = F.scaled_dot_product_attention(q, k.expand_as(q), v.expand_as(q), is_causal=True)
        mlp = self.down(F.silu(self.gate(x)) * self.up(x))
        return self.o(y.transpose(1, 2).reshape(b, n, -1)) + mlp


class ValueEmbeddings(nn.Module):
    """modded-nanogpt: token ids in, value embeddings mixed into every layer's values
    with learned scalars, queries and keys normalised without a weight, rotary."""

    def __init__(self, vocab=11, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, D)
        self.ve = nn.ModuleList(nn.Embedding(vocab, D) for _ in range(layers))
        self.blocks = nn.ModuleList(Plain() for _ in range(layers))
        self.lambdas = nn.Parameter(torch.tensor([[0.5, 0.5]] * layers))
        self.head = nn.Linear(D, D)

    def forward(self, ids):
        h = F.rms_norm(self.embed(ids), (D,))
        cos, sin = _cos_sin(ids.shape[1], DH)
        for block, ve, lam in zip(self.blocks, self.ve, self.lambdas):
            x = F.rms_norm(h, (D,))
            q, k = _split(block.q(x)), _split(block.k(x))
            v = lam[0] * block.v(x) + lam[1] * ve(ids)
            q, k = _rotate_half(q, cos, sin), _rotate_half(k, cos, sin)
            q, k = F.rms_norm(q, (DH,)), F.rms_norm(k, (DH,))
            y = F.scaled_dot_product_attention(q, k, _split(v), is_causal=True)
            h = h + block.o(_merge(y))
        logits = self.head(F.rms_norm(h, (D,)))
        return 15 * torch.tanh(logits / 15)


class Flex(Plain):
    """``flex_attention`` with a ``score_mod`` that reads the scores and the indices."""

    def forward(self, x):
        from torch.nn.attention.flex_attention import flex_attention

        q, k, v = _split(self.q(x)), _split(self.k(x)), _split(self.v(x))

        def score_mod(score, b, h, q_idx, kv_idx):
            return torch.where(q_idx >= kv_idx, score + 0.1 * (q_idx - kv_idx), -float("inf"))

        return self.o(_merge(flex_attention(q, k, v, score_mod=score_mod)))


class MHAModel(Stack):
    """A root class whose name says attention: nothing about it depends on that."""


@dataclass
class Case:
    name: str
    build: object
    expect: int  # pair blocks of the whole model, by construction
    outcome: str  # "found" or "labelled"
    groups: tuple = ()  # their groups, sorted (checked where given)
    ids: bool = False  # the model reads token ids
    backward: bool = True  # torch differentiates it on the CPU


def _stack(block, **kw):
    return lambda: Stack(block, **kw)


GL2 = ("GL", "GL")
CASES = [
    Case("plain", _stack(Plain), 2, "found", GL2),
    Case("einsum-heads-last", _stack(EinsumHeadsLast), 2, "found"),
    Case("interleaved-qkv-sdpa", _stack(Interleaved), 2, "found"),
    Case("grouped-query", _stack(GroupedQuery), 2, "found"),
    Case("query-temperature", _stack(lambda: Plain("query-temperature")), 2, "found"),
    Case("data-temperature", _stack(lambda: Plain("data-temperature")), 2, "found"),
    Case("score-temperature", _stack(lambda: Plain("score-temperature")), 2, "found"),
    Case("head-scale", _stack(lambda: Plain("head-scale")), 2, "found"),
    Case("sigmoid-gate", _stack(lambda: Plain("sigmoid-gate")), 2, "found"),
    Case("per-feature-scale", _stack(lambda: Plain("feature-scale")), 1, "labelled"),
    Case("landmark-means", _stack(Landmarks), 2, "found"),
    Case("cumulative-keys", _stack(CumulativeKeys), 2, "found"),
    Case("masked-logits", _stack(MaskedLogits), 2, "found"),
    Case("linear-attention", _stack(TokenMixer), 1, "labelled"),
    Case("opaque-kernel", _stack(OpaqueMixer), 2, "labelled"),
    Case("tied-output-head", _stack(Plain, tie_output=True), 1, "labelled"),
    Case("values-shared-by-layers", _stack(Plain, layers=2, share_values=True), 3, "found"),
    Case("aliased-norm", _stack(Plain, alias_norm=True), 2, "found"),
    Case("root-named-mha", lambda: MHAModel(Plain), 2, "found"),
    Case("rotary-complex", _stack(RotaryComplex), 2, "found", ("GL", "rotary-interleaved")),
    Case("rotary-matrix", _stack(RotaryMatrix), 2, "found", ("GL", "rotary-interleaved")),
    Case("latent-attention", _stack(LatentAttention), 3, "found", ("GL", "GL", "rotary")),
    Case("windows-and-global-token", _stack(WindowGlobal), 2, "found"),
    # 2026 LLM code
    Case("mamba2-then-attention", lambda: Hybrid(Mamba2, Plain), 2, "found", GL2),
    Case("attention-then-mamba2", lambda: Hybrid(Plain, Mamba2), 2, "found", GL2),
    # B and C meet linearly (no filter): a GL(state) pair in the scan; the scan's
    # values (x) are read through it, which the trace cannot follow: said
    Case(
        "linear-mamba2-then-attention",
        lambda: Hybrid(lambda: Mamba2(conv=False), Plain),
        3,
        "labelled",
        ("GL", "GL", "GL"),
    ),
    Case("mamba1-then-attention", lambda: Hybrid(Mamba1, Plain), 2, "found", GL2),
    Case("moe-then-attention", lambda: Hybrid(GShardMoE, Plain), 2, "found", GL2),
    Case("granite-hybrid", lambda: Hybrid(Mamba2, GShardMoE, Plain, GShardMoE), 2, "found", GL2),
    Case("functional-mha", _stack(FunctionalMHA), 2, "found", GL2),
    Case("memory-kv", _stack(MemoryKV), 2, "found", GL2),
    Case("attention-sinks", _stack(Sinks), 2, "found", GL2),
    Case("differential", _stack(Differential), 1, "found", ("GL",)),
    Case("soft-capped", _stack(SoftCapped), 2, "found", GL2),
    Case("torchtitan-complex-rotary", _stack(TorchTitan), 2, "found", ("GL", "rotary-interleaved")),
    Case("grouped-einsum", _stack(GroupedEinsum), 2, "found", GL2),
    Case("qk-rms-norm-rotary", _stack(QKRMSNorm), 2, "found", ("GL", "rotary-orthogonal")),
    Case("qk-rms-norm", _stack(lambda: QKRMSNorm(rotary=False)), 2, "found", ("GL", "orthogonal")),
    Case("cosine", _stack(Cosine), 2, "found", ("GL", "orthogonal")),
    Case("latent-v3", _stack(LatentV3), 3, "found", ("GL", "GL", "rotary")),
    Case("shared-block-adapters", SharedStack, 2, "found", GL2),
    Case("kv-shared-across-layers", SharedKV, 2, "found", GL2),
    Case("parallel-multi-query", _stack(Parallel), 2, "found", GL2),
    Case("flex-attention", _stack(Flex), 2, "found", GL2, backward=False),
    Case(
        "value-embeddings",
        ValueEmbeddings,
        4,
        "found",
        ("GL", "GL", "rotary-orthogonal", "rotary-orthogonal"),
        ids=True,
    ),
]


def build(case: Case, seed: int = 0):
    """The case's model (float64, eval mode) and a batch of 4 sequences of 6 tokens
    (vectors of 5, or ids below 11)."""
    torch.manual_seed(seed)
    model = case.build().to(torch.float64).eval()
    g = torch.Generator().manual_seed(seed + 1)
    if case.ids:
        return model, torch.randint(0, 11, (4, 6), generator=g)
    x = torch.randn(4, 6, 5, generator=g, dtype=torch.float64)
    return model, x


def loss_fn(model, x):
    return model(x).pow(2).mean()
