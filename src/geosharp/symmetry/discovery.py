"""``find_symmetries``: walk a model and collect the GL(h) pairs of its attention."""

from __future__ import annotations

import re
import warnings

from torch import Tensor, nn

from . import handlers, hf_handlers, peft_handlers  # noqa: F401  (register the built-ins)
from .pairs import PairSpec, Symmetries
from .registry import handler_for, nested_pairs

__all__ = ["find_symmetries"]

_ATTENTION_LIKE = re.compile(r"attention|attn|selfatt|mha", re.IGNORECASE)


def find_symmetries(model: nn.Module, warn: bool = True) -> Symmetries:
    """Find the parameter symmetries of ``model``.

    Every module with a registered handler contributes its pairs (MATH.md section 1):
    per attention head a query/key and a value/output pair with biases absorbed, of
    group ``GL(d_head)``, or the rotary subgroup for query/key under RoPE; with
    grouped-query attention, the blocks of heads that share a key/value head are
    stacked into one pair; LoRA adapters give ``GL(r)`` pairs ``(B, A^T)``. All other
    parameters stay in the element-wise (adaptive) geometry.
    Modules whose class name looks like attention but that no handler knows are
    listed in ``Symmetries.unrecognized`` and, if ``warn``, in a warning: their
    symmetry is ignored, never guessed.

    >>> import torch
    >>> layer = torch.nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16)
    >>> sym = find_symmetries(layer)
    >>> [(p.kind, p.shape) for p in sym.pairs]  # (heads, n, m, h)
    [('query-key', (2, 9, 9, 4)), ('value-output', (2, 9, 8, 4))]
    """
    named = list(model.named_parameters())
    if not named:
        raise ValueError("the model has no parameters: there is nothing to measure")
    names = {id(p): n for n, p in named}

    def name_of(tensor: Tensor) -> str:
        try:
            return names[id(tensor)]
        except KeyError:
            raise ValueError(
                "a handler pointed at a tensor that is not a parameter of the model"
            ) from None

    pairs: list[PairSpec] = []
    unrecognized: list[str] = []
    done: list[str] = []  # handled or reported: their descendants are not visited
    for prefix, module in model.named_modules():
        if any(_inside(prefix, d) for d in done):
            continue
        handler = handler_for(module)
        if handler is not None:
            pairs.extend(handler(module, prefix, name_of))
            done.append(prefix)
        elif _ATTENTION_LIKE.search(type(module).__name__) and _owns_parameters(module):
            unrecognized.append(prefix or f"<root {type(module).__name__}>")
            done.append(prefix)
            # Its own symmetry is unknown, but known modules inside it (LoRA adapters)
            # still contribute their pairs.
            pairs.extend(nested_pairs(module, prefix, name_of))

    symmetries = Symmetries(
        pairs=pairs,
        parameters={n: tuple(p.shape) for n, p in named},
        unrecognized=unrecognized,
    )
    symmetries.validate()
    if warn and unrecognized:
        warnings.warn(
            "geosharp does not recognise these attention-like modules; their parameters "
            "are measured element-wise and their symmetries ignored: "
            + ", ".join(unrecognized)
            + ". Declare their pairs with geosharp.register_handler if they have any.",
            stacklevel=2,
        )
    return symmetries


def _inside(name: str, ancestor: str) -> bool:
    return ancestor == "" or name == ancestor or name.startswith(ancestor + ".")


def _owns_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())
