"""Attention written by hand, the way research code writes it, for the soundness suite
(``tests/test_soundness.py``): each case is a small float64 model, a batch, and the
truth about its symmetries, known by construction.

``expect``: the pair kinds that are GL symmetries of the whole model (query/key,
value/output per attention); ``outcome``: what discovery must do, ``"found"`` (every
expected pair, verified, result complete) or ``"labelled"`` (a miss is allowed, but
said: the result is not complete).
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


class MHAModel(Stack):
    """A root class whose name says attention: nothing about it depends on that."""


@dataclass
class Case:
    name: str
    build: object
    expect: int  # GL pairs of the whole model, by construction
    outcome: str  # "found" or "labelled"


def _stack(block, **kw):
    return lambda: Stack(block, **kw)


CASES = [
    Case("plain", _stack(Plain), 2, "found"),
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
    Case("rotary-complex", _stack(RotaryComplex), 2, "labelled"),
    Case("rotary-matrix", _stack(RotaryMatrix), 2, "labelled"),
    Case("latent-attention", _stack(LatentAttention), 2, "labelled"),
    Case("windows-and-global-token", _stack(WindowGlobal), 2, "found"),
]


def build(case: Case, seed: int = 0):
    """The case's model (float64, eval mode) and a batch of 4 sequences of 6 tokens."""
    torch.manual_seed(seed)
    model = case.build().to(torch.float64).eval()
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(4, 6, 5, generator=g, dtype=torch.float64)
    return model, x


def loss_fn(model, x):
    return model(x).pow(2).mean()
