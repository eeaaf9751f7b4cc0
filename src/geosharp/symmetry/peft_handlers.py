"""Handlers for ``peft``'s LoRA layers (checked against peft 0.21).

A LoRA layer adds ``scale * B A x`` to its base layer's output, ``B`` (``out x r``) and
``A`` (``r x in``): the output depends on ``B`` and ``A`` only through ``B A``, so
``(G, H) = (B, A^T)`` is a ``GL(r)`` pair, one per adapter (MATH.md section 1). DoRA
(``use_dora``) rescales ``W0 + scale * B A`` column-wise by its own norm, again a
function of ``B A``: the same pair. Other LoRA variants (aLoRA, Arrow, ...) are left
element-wise. Registered by qualified class name; ``peft`` is not imported.

Layers handled: ``Linear`` (also over GPT-2's ``Conv1D``), ``Embedding``
(``lora_embedding_B @ lora_embedding_A``), ``Conv1d/2d/3d`` with ``groups == 1``
(``B``'s kernel is ``1 x ... x 1``, ``A`` flattened to ``r x in * kernel``). The base
layer's own weights are not part of these pairs.
"""

from __future__ import annotations

from torch import nn

from .pairs import Block, PairSpec, positions
from .registry import NameOf, register_handler

__all__: list[str] = []

_P = "peft.tuners.lora.layer."


def _variant_ok(module: nn.Module, adapter: str, dora: bool) -> bool:
    variant = getattr(module, "lora_variant", {}).get(adapter)
    if variant is None:
        return True
    name = variant.__name__ if isinstance(variant, type) else type(variant).__name__
    return dora and name.startswith("Dora")


def _pair(
    module: str, adapter: str, name_of: NameOf, B: nn.Parameter, A: nn.Parameter, rank: int
) -> PairSpec:
    """``G = B`` viewed ``out x r``, ``H = A^T`` viewed ``in x r``."""
    g = positions(B).reshape(-1, rank)
    h = positions(A).reshape(rank, -1).t()
    return PairSpec(
        module,
        f"lora[{adapter}]",
        (Block(name_of(B), g.unsqueeze(0)),),
        (Block(name_of(A), h.unsqueeze(0)),),
    )


def _lora_linear(module: nn.Module, prefix: str, name_of: NameOf) -> list[PairSpec]:
    pairs = []
    for adapter, lora_a in module.lora_A.items():
        lora_b = module.lora_B[adapter]
        if not (isinstance(lora_a, nn.Linear) and isinstance(lora_b, nn.Linear)):
            continue
        if lora_a.bias is not None or not _variant_ok(module, adapter, dora=True):
            continue
        pairs.append(
            _pair(prefix, adapter, name_of, lora_b.weight, lora_a.weight, lora_a.out_features)
        )
    return pairs


def _lora_embedding(module: nn.Module, prefix: str, name_of: NameOf) -> list[PairSpec]:
    pairs = []
    for adapter, A in module.lora_embedding_A.items():
        if not _variant_ok(module, adapter, dora=False):
            continue
        B = module.lora_embedding_B[adapter]
        pairs.append(_pair(prefix, adapter, name_of, B, A, A.shape[0]))
    return pairs


def _lora_conv(module: nn.Module, prefix: str, name_of: NameOf) -> list[PairSpec]:
    pairs = []
    for adapter, lora_a in module.lora_A.items():
        lora_b = module.lora_B[adapter]
        if (
            lora_b.groups != 1
            or lora_a.groups != 1
            or lora_a.bias is not None
            or any(k != 1 for k in lora_b.kernel_size)
            or not _variant_ok(module, adapter, dora=False)
        ):
            continue
        pairs.append(
            _pair(prefix, adapter, name_of, lora_b.weight, lora_a.weight, lora_a.out_channels)
        )
    return pairs


register_handler(_P + "Linear", _lora_linear)
register_handler(_P + "Embedding", _lora_embedding)
for _conv in ("Conv1d", "Conv2d", "Conv3d"):
    register_handler(_P + _conv, _lora_conv)
