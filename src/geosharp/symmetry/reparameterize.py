"""Acting on a model with a random symmetry transform (re-parameterisation)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn

from ..errors import warn_user
from .discovery import find_symmetries, verify_symmetries
from .groups import checked_cond, random_transforms, transform_parameters
from .pairs import Symmetries

__all__ = ["reparameterize"]


@torch.no_grad()
def reparameterize(
    model: nn.Module,
    symmetries: Symmetries | None = None,
    cond: float = 10.0,
    seed: int = 0,
    transforms: Mapping[str, Tensor] | None = None,
    *,
    batch: object = None,
    loss_fn: Callable[[nn.Module, object], Tensor] | None = None,
    unverified: bool = False,
) -> dict[str, Tensor]:
    """Apply a random (or given) symmetry transform to ``model`` **in place**.

    The function computed by the model does not change (up to round-off); every
    pair's blocks become ``(G A, H A^{-T})``. Returns the transforms used. Pairs are
    verified on ``batch`` first (passed as in :func:`find_symmetries`: the model's
    inputs, or with ``loss_fn`` the batch ``sharpness()`` takes; default, random inputs
    for a Hugging Face model); pairs that were never checked on the model
    (declared by hand, found without inputs) are refused, unless ``unverified=True``
    applies them as declared. A model with no pairs is left as it is, with a warning
    (there is nothing to transform: comparing a measure before and after would prove
    nothing). Copy the model first (``copy.deepcopy``) to keep the original.
    """
    if transforms is None:
        cond = checked_cond(cond)  # before anything is touched
    if symmetries is None:
        symmetries = find_symmetries(model, batch, loss_fn=loss_fn)
    elif batch is not None and symmetries.unverified:
        checked = verify_symmetries(model, symmetries, batch, loss_fn=loss_fn)
        refuted = [n for n in symmetries.unverified if n not in checked.verified]
        if refuted:
            raise ValueError(
                f"reparameterize: {', '.join(refuted)} could not be verified on the batch "
                "(see verify_symmetries(model, symmetries, batch).summary()): the model is "
                "unchanged"
            )
        symmetries = checked
    if symmetries.unverified and not unverified:
        names = symmetries.unverified
        raise ValueError(
            f"reparameterize: {len(names)} pair block{'s' * (len(names) != 1)} never checked "
            f"on the model ({names[0]}); a pair that is not a symmetry would change its "
            "function: pass batch= to verify them, or unverified=True to apply them as declared"
        )
    if not symmetries.pairs:
        warn_user(
            "reparameterize: nothing to transform, the model has no symmetric pairs (see "
            "find_symmetries(model).summary()); the model is unchanged"
        )
        return {}
    transforms = dict(transforms or random_transforms(symmetries, cond, seed))
    named = dict(model.named_parameters())
    new = transform_parameters(
        {n: p.detach() for n, p in named.items()}, symmetries.pairs, transforms
    )
    for name in {n for pair in symmetries.pairs for n in pair.params}:
        named[name].copy_(new[name])
    return transforms
