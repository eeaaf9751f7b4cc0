"""Inputs that fit a Hugging Face model's config, for discovery without the user's data.

Symmetry discovery runs one forward pass; when the user gives no batch, a model with a
``config`` (any ``transformers`` model: its ``main_input_name`` says what it reads) gets
a small random one: token ids, images, audio samples or log-mel features, and decoder
ids for an encoder-decoder. ``transformers`` itself is not imported.
"""

from __future__ import annotations

import inspect
import math

import torch
from torch import Tensor, nn

__all__ = ["example_inputs"]


def example_inputs(
    model: nn.Module, batch: int = 2, length: int = 8, seed: int = 0
) -> dict[str, Tensor] | None:
    """Random inputs for ``model`` from its config (``None`` when it has none or its
    input kind is unknown); on the model's device (``meta`` included)."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    device = _device(model)
    g = torch.Generator().manual_seed(seed)
    main = getattr(model, "main_input_name", "input_ids")
    text = getattr(config, "text_config", None) or config
    vision = getattr(config, "vision_config", None) or config
    out: dict[str, Tensor] = {}
    if main == "input_ids" or getattr(config, "text_config", None) is not None:
        vocab = getattr(text, "vocab_size", None)
        if not vocab:
            return None
        limit = getattr(text, "max_position_embeddings", None) or length
        n = max(2, min(length, int(limit) - 2 if limit and limit > 4 else length))
        out["input_ids"] = torch.randint(min(4, vocab - 1), vocab, (batch, n), generator=g)
        out["attention_mask"] = torch.ones(batch, n, dtype=torch.long)
    if main == "pixel_values" or getattr(config, "vision_config", None) is not None:
        size = getattr(vision, "image_size", None)
        size = size if isinstance(size, int) else (size[0] if size else 32)
        channels = getattr(vision, "num_channels", 3)
        out["pixel_values"] = torch.randn(batch, channels, size, size, generator=g)
    if main == "input_features":
        mels = getattr(config, "num_mel_bins", 80)
        frames = 2 * getattr(config, "max_source_positions", 1500)
        out["input_features"] = torch.randn(batch, mels, frames, generator=g)
    if main == "input_values":
        ratio = getattr(config, "inputs_to_logits_ratio", None) or math.prod(
            getattr(config, "conv_stride", (320,))
        )
        kernel = max(getattr(config, "conv_kernel", (10,)))
        out["input_values"] = torch.randn(batch, int(ratio) * length + int(kernel), generator=g)
    if not out:
        return None
    if getattr(config, "is_encoder_decoder", False):
        vocab = getattr(config, "vocab_size", None) or getattr(text, "vocab_size", None)
        if vocab:
            out["decoder_input_ids"] = torch.randint(
                min(4, vocab - 1), vocab, (batch, max(2, length // 2)), generator=g
            )
    dtype = _float_dtype(model)
    accepted = _accepted(model)
    return {
        k: (v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device))
        for k, v in out.items()
        if accepted is None or k in accepted
    }


def _accepted(model: nn.Module) -> set[str] | None:
    """The keyword arguments ``model.forward`` takes (``None``: any)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return set(params)


def _device(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    return torch.device("cpu")


def _float_dtype(model: nn.Module) -> torch.dtype:
    for t in model.parameters():
        if t.is_floating_point():
            return t.dtype
    return torch.float32
