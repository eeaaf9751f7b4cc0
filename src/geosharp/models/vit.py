"""Small Hugging Face ViT classifiers for local image data, and a plain training loop."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..params import in_float32
from ..rng import seeded

__all__ = ["accuracy_and_loss", "image_batches", "image_loss", "tiny_vit", "train_image_classifier"]


def tiny_vit(
    image_size: int = 8,
    channels: int = 1,
    classes: int = 10,
    patch_size: int = 2,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    mlp: int = 64,
    seed: int = 0,
) -> nn.Module:
    """A Hugging Face ``ViTForImageClassification`` (dropout off), seeded."""
    from ..errors import require

    transformers = require("transformers", "the demo's ViT")
    ViTConfig, ViTForImageClassification = (
        transformers.ViTConfig,
        transformers.ViTForImageClassification,
    )

    config = ViTConfig(
        image_size=image_size,
        patch_size=patch_size,
        num_channels=channels,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=mlp,
        num_labels=classes,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    with seeded(seed):
        return ViTForImageClassification(config)


def image_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    """Cross-entropy of a Hugging Face image classifier on ``(pixel_values, labels)``."""
    images, labels = batch
    return F.cross_entropy(in_float32(model(pixel_values=images).logits), labels)


def image_batches(
    images: Tensor, labels: Tensor, batch_size: int, shuffle: bool = False, seed: int = 0
) -> Iterator[tuple[Tensor, Tensor]]:
    order = torch.arange(len(labels))
    if shuffle:
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    for start in range(0, len(labels), batch_size):
        idx = order[start : start + batch_size]
        yield images[idx], labels[idx]


def train_image_classifier(
    model: nn.Module,
    images: Tensor,
    labels: Tensor,
    epochs: int = 20,
    lr: float = 3e-3,
    batch_size: int = 64,
    weight_decay: float = 0.0,
    seed: int = 0,
    progress: bool = False,
) -> nn.Module:
    """AdamW with a cosine schedule; returns the model (trained in place, left in eval)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    steps = epochs * ((len(labels) + batch_size - 1) // batch_size)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, max(steps, 1))
    from ..progress import Progress

    epochs_iter = Progress(range(epochs), desc="training", unit="epoch", enabled=progress)
    model.train()
    for epoch in epochs_iter:
        for batch in image_batches(images, labels, batch_size, shuffle=True, seed=seed + epoch):
            optimizer.zero_grad(set_to_none=True)
            image_loss(model, batch).backward()
            optimizer.step()
            schedule.step()
    model.eval()
    optimizer.zero_grad(set_to_none=True)
    return model


@torch.no_grad()
def accuracy_and_loss(
    model: nn.Module, images: Tensor, labels: Tensor, batch_size: int = 512
) -> tuple[float, float]:
    """Accuracy and mean cross-entropy over a data set."""
    correct, total_loss = 0, 0.0
    for x, y in image_batches(images, labels, batch_size):
        logits = model(pixel_values=x).logits
        total_loss += float(F.cross_entropy(in_float32(logits), y, reduction="sum"))
        correct += int((logits.argmax(-1) == y).sum())
    return correct / len(labels), total_loss / len(labels)
