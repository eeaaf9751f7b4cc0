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
