"""A shared zoo of small transformers with attention far from uniform.

At the default ``initializer_range=0.02`` attention barely matters and adaptive
sharpness hardly reacts to a symmetry transform; a larger initial scale (0.2) makes
the query/key products matter, which is what the invariance tests need.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F


@dataclass
class Case:
    name: str
    model: nn.Module
    batches: list
    loss_fn: Callable[[nn.Module, object], Tensor]
    inputs: object  # what check_symmetries passes to the model


def _seeded(seed: int):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    return gen


def bert_case(dtype=torch.float64, seed: int = 0) -> Case:
    from transformers import BertConfig, BertForSequenceClassification

    gen = _seeded(seed)
    config = BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        num_labels=3,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        initializer_range=0.2,
    )
    model = BertForSequenceClassification(config).to(dtype)
    ids = torch.randint(0, 50, (2, 8, 10), generator=gen)
    mask = torch.ones_like(ids)
    mask[:, :, 8:] = 0  # some padding
    labels = torch.randint(0, 3, (2, 8), generator=gen)
    batches = [
        {"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(2)
    ]

    def loss_fn(m, b):
        return F.cross_entropy(
            m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits, b["labels"]
        )

    inputs = {"input_ids": ids[0], "attention_mask": mask[0]}
    return Case("bert", model, batches, loss_fn, inputs)


def vit_case(dtype=torch.float64, seed: int = 0) -> Case:
    from transformers import ViTConfig, ViTForImageClassification

    gen = _seeded(seed)
    config = ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=1,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=3,
        initializer_range=0.2,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )
    model = ViTForImageClassification(config).to(dtype)
    x = torch.randn(2, 8, 1, 8, 8, generator=gen, dtype=dtype)
    y = torch.randint(0, 3, (2, 8), generator=gen)
    batches = [(x[i], y[i]) for i in range(2)]

    def loss_fn(m, b):
        return F.cross_entropy(m(pixel_values=b[0]).logits, b[1])

    return Case("vit", model, batches, loss_fn, {"pixel_values": x[0]})


class EncoderClassifier(nn.Module):
    """``nn.TransformerEncoder`` over token embeddings, mean-pooled, linear head."""

    def __init__(self, dim: int = 16, heads: int = 4, layers: int = 2, classes: int = 3):
        super().__init__()
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.encoder(x).mean(1))


def encoder_case(dtype=torch.float64, seed: int = 0) -> Case:
    gen = _seeded(seed)
    model = EncoderClassifier().to(dtype)
    with torch.no_grad():  # attention far from uniform
        for layer in model.encoder.layers:
            layer.self_attn.in_proj_weight.mul_(4.0)
    x = torch.randn(2, 16, 6, 16, generator=gen, dtype=dtype)
    y = torch.randint(0, 3, (2, 16), generator=gen)
    batches = [(x[i], y[i]) for i in range(2)]

    def loss_fn(m, b):
        return F.cross_entropy(m(b[0]), b[1])

    return Case("encoder", model, batches, loss_fn, x[0])


CASES = {"bert": bert_case, "vit": vit_case, "encoder": encoder_case}


# --- every supported attention layout (discovery and invariance tests) ------------------


class _LazyTransformers:
    """``transformers``, imported on first use (the zoo's CASES need only torch)."""

    def __getattr__(self, name):
        import transformers

        return getattr(transformers, name)


tf = _LazyTransformers()
F64 = torch.float64


@dataclass
class Architecture:
    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[], dict]
    loss_fn: Callable[[nn.Module, object], Tensor]
    module: str  # the attention module of layer 0
    pairs: list  # the (kind, group, shape) of its pairs
    n_pairs: int  # pairs in the whole model

    def case(self) -> Case:
        """A float64 model in eval mode (seed 0), its batch and loss."""
        torch.manual_seed(0)
        model = _ready(self.build())
        batch = self.batch()
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        return Case(self.name, model, [batch], self.loss_fn, inputs)


def _ids(low: int = 2, high: int = 50, shape=(3, 7), seed: int = 0) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=torch.Generator().manual_seed(seed))


def _pixels(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 3, 8, 8, generator=g, dtype=F64)


def _labels(n: int = 3, classes: int = 3) -> torch.Tensor:
    return torch.arange(n) % classes


def _ready(model: nn.Module) -> nn.Module:
    return model.to(F64).eval()


def _lm_loss(model, batch):
    return model(**batch, labels=batch["input_ids"]).loss


def _cls_loss(model, batch):
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    out = model(**inputs)
    return F.cross_entropy(out.logits, batch["labels"])


def _clip_loss(model, batch):
    return model(**batch, return_loss=True).loss


BERT = dict(
    vocab_size=50,
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=32,
    max_position_embeddings=32,
)
VIT = dict(
    image_size=8,
    patch_size=4,
    num_channels=3,
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=32,
    num_labels=3,
)
LLAMA = dict(
    vocab_size=50,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
)
CLIP_TEXT = dict(
    vocab_size=50,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    max_position_embeddings=16,
)
CLIP_VISION = dict(
    image_size=8,
    patch_size=4,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
)


# --- a timm-style ViT, built locally (timm itself is not importable here) ------------------


class Attention(nn.Module):
    """Multi-head self-attention laid out like timm's ``vision_transformer.Attention``:
    one fused ``qkv`` linear layer whose outputs are ordered (q | k | v) x heads x d."""

    def __init__(self, dim: int, num_heads: int, qk_norm: bool = False, scale_norm: bool = False):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.q_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(0.0)
        self.norm = nn.LayerNorm(dim) if scale_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).view(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        q, k = self.q_norm(q), self.k_norm(k)
        weights = self.attn_drop(torch.softmax(q @ k.transpose(-1, -2) * self.scale, dim=-1))
        heads = (weights @ v).transpose(1, 2).reshape(b, n, c)
        return self.proj_drop(self.proj(self.norm(heads)))


class TinyTimmViT(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 2, depth: int = 2, **attention):
        super().__init__()
        self.patch = nn.Linear(3 * 4 * 4, dim)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.1)
        self.pos = nn.Parameter(torch.randn(1, 5, dim) * 0.1)
        self.blocks = nn.ModuleList()
        for _ in range(depth):
            self.blocks.append(
                nn.ModuleDict(
                    dict(
                        norm1=nn.LayerNorm(dim),
                        attn=Attention(dim, heads, **attention),
                        norm2=nn.LayerNorm(dim),
                        mlp=nn.Sequential(
                            nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim)
                        ),
                    )
                )
            )
        self.head = nn.Linear(dim, 3)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        b = pixel_values.shape[0]
        patches = pixel_values.unfold(2, 4, 4).unfold(3, 4, 4)  # b, c, 2, 2, 4, 4
        patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(b, 4, -1)
        x = torch.cat([self.cls.expand(b, -1, -1), self.patch(patches)], 1) + self.pos
        for block in self.blocks:
            x = x + block["attn"](block["norm1"](x))
            x = x + block["mlp"](block["norm2"](x))
        return self.head(x[:, 0])


def _timm_loss(model, batch):
    return F.cross_entropy(model(batch["pixel_values"]), batch["labels"])


def _clip():
    config = tf.CLIPConfig(text_config=CLIP_TEXT, vision_config=CLIP_VISION, projection_dim=8)
    return tf.CLIPModel(config)


def _gpt2():
    return tf.GPT2LMHeadModel(
        tf.GPT2Config(vocab_size=50, n_embd=16, n_layer=2, n_head=2, n_positions=32)
    )


GL = "GL"
QK_BERT = ("query-key", GL, (2, 17, 17, 8))
VO_BERT = ("value-output", GL, (2, 17, 16, 8))

_ARCHITECTURES = {
    "clip": (
        _clip,
        lambda: {"input_ids": _ids(), "pixel_values": _pixels()},
        _clip_loss,
        "text_model.encoder.layers.0.self_attn",
        [QK_BERT, VO_BERT],
        8,
    ),
    "gpt2": (
        _gpt2,
        lambda: {"input_ids": _ids(0)},
        _lm_loss,
        "transformer.h.0.attn",
        [QK_BERT, VO_BERT],
        4,
    ),
    "roberta": (
        lambda: tf.RobertaForSequenceClassification(
            tf.RobertaConfig(**BERT, pad_token_id=1, num_labels=3, initializer_range=0.3)
        ),
        lambda: {"input_ids": _ids(), "labels": _labels()},
        _cls_loss,
        "roberta.encoder.layer.0.attention",
        [QK_BERT, VO_BERT],
        4,
    ),
    "distilbert": (
        lambda: tf.DistilBertForSequenceClassification(
            tf.DistilBertConfig(
                vocab_size=50,
                dim=16,
                n_layers=2,
                n_heads=2,
                hidden_dim=32,
                max_position_embeddings=32,
                num_labels=3,
                initializer_range=0.3,
            )
        ),
        lambda: {"input_ids": _ids(), "labels": _labels()},
        _cls_loss,
        "distilbert.transformer.layer.0.attention",
        [QK_BERT, VO_BERT],
        4,
    ),
    "vit": (
        lambda: tf.ViTForImageClassification(tf.ViTConfig(**VIT)),
        lambda: {"pixel_values": _pixels(), "labels": _labels()},
        _cls_loss,
        "vit.layers.0.attention",
        [QK_BERT, VO_BERT],
        4,
    ),
    "deit": (
        lambda: tf.DeiTForImageClassificationWithTeacher(tf.DeiTConfig(**VIT)),
        lambda: {"pixel_values": _pixels(), "labels": _labels()},
        _cls_loss,
        "deit.layers.0.attention",
        [QK_BERT, VO_BERT],
        4,
    ),
    "timm": (
        lambda: TinyTimmViT(),
        lambda: {"pixel_values": _pixels(), "labels": _labels()},
        _timm_loss,
        "blocks.0.attn",
        [QK_BERT, VO_BERT],
        4,
    ),
    # LLaMA with grouped-query attention: 4 query heads, 2 key/value heads of size 8;
    # no biases, so G/H rows are d_in = 32 per head, stacked over the 2 query heads.
    "llama": (
        lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**LLAMA)),
        lambda: {"input_ids": _ids(0)},
        _lm_loss,
        "model.layers.0.self_attn",
        [("query-key", "rotary", (2, 64, 32, 8)), ("value-output", GL, (2, 32, 64, 8))],
        4,
    ),
}


ARCHITECTURES = {
    name: Architecture(name, build, batch, loss_fn, module, pairs, n_pairs)
    for name, (build, batch, loss_fn, module, pairs, n_pairs) in _ARCHITECTURES.items()
}
"""Every supported attention layout, as a tiny random float64 model: its builder, one
batch, its loss, the attention module of its first layer with the pairs expected there,
and the number of pairs in all."""


# --- an attention kernel the trace cannot look into ----------------------------------------


@torch.library.custom_op("geosharp_tests::fused_attention", mutates_args=())
def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention by a kernel of a compiled library (as flash-attention is): the trace
    sees the call, not what it computes."""
    return torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, -1) @ v


@fused_attention.register_fake
def _(q, k, v):
    return torch.empty_like(q)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        out = torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, -1) @ v
        return torch.autograd.grad(out, (q, k, v), grad)


fused_attention.register_autograd(_backward, setup_context=_setup)


def opaque_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
    """A stand-in for ``F.scaled_dot_product_attention`` that runs the opaque kernel
    (masks ignored): monkeypatch it in to simulate a flash-attention model."""
    return fused_attention(query, key, value)
