"""Measure a text model on the embedding rows its batches use.

A token absent from every measurement batch has a zero gradient in its embedding row.
From a zero start Auto-PGD never moves that row (its steps, its momentum and the
projection onto the ball all keep zeros at zero), so the worst case over the whole
table equals the worst case over the rows of the tokens present, while the whole table
(11.7M of MiniLM's 22.7M parameters) would set the cost of every step.
:func:`compact_vocabulary` makes the restriction explicit: it swaps the table for its
used rows and remaps the token ids, for as long as a ``with`` block lasts.

Random starts and average-case noise then live on the used rows only: the same as
drawing them on the whole table with the absent rows held at zero.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from ..errors import UsageError

__all__ = ["compact_vocabulary"]


def _embedding_name(model: nn.Module, embedding: str | None) -> str:
    if embedding is not None:
        try:
            module = model.get_submodule(embedding)
        except AttributeError:
            raise UsageError(
                f"compact_vocabulary: the model has no submodule {embedding!r}; "
                "pass the name of its token-embedding module"
            ) from None
        if not isinstance(module, nn.Embedding):
            raise UsageError(
                f"compact_vocabulary: {embedding!r} is a {type(module).__name__}, not an "
                "nn.Embedding; pass the name of the token-embedding module"
            )
        return embedding
    getter = getattr(model, "get_input_embeddings", None)
    target = getter() if callable(getter) else None
    for name, module in model.named_modules():
        if module is target and isinstance(module, nn.Embedding):
            return name
    raise UsageError(
        "compact_vocabulary: cannot tell which module embeds the tokens; pass "
        "embedding='<module name>' (e.g. 'bert.embeddings.word_embeddings')"
    )


def _ids(batch, key: str) -> Tensor:
    if isinstance(batch, Tensor):
        return batch
    if isinstance(batch, dict) and key in batch:
        return batch[key]
    raise UsageError(
        f"compact_vocabulary: a batch is a {type(batch).__name__} without {key!r}; "
        f"pass dict batches holding the token ids under {key!r} (or key='<name>')"
    )


def _with_ids(batch, ids: Tensor, key: str):
    if isinstance(batch, Tensor):
        return ids
    return {**batch, key: ids}


@contextmanager
def compact_vocabulary(
    model: nn.Module,
    batches: Sequence,
    embedding: str | None = None,
    key: str = "input_ids",
) -> Iterator[list]:
    """Inside the block, ``model``'s token embedding holds only the rows of the tokens
    in ``batches``; yields the batches with their ids remapped to those rows.

    The rows are copies, so the model's own table never changes; the original module
    is back in place when the block ends, also when it raises. The compact table keeps
    the parameter's name, so ``parameters=[...]`` selections still apply.

    Args:
        model: the model (Hugging Face models name their table themselves).
        batches: dict batches with token ids under ``key``, or tensors of ids.
        embedding: the ``nn.Embedding``'s module name, if the model cannot say.
        key: where the ids are in a dict batch.

    >>> emb = nn.Sequential(nn.Embedding(10, 2))
    >>> with compact_vocabulary(emb, [torch.tensor([[7, 3, 7]])], embedding="0") as b:
    ...     b[0].tolist(), emb[0].num_embeddings
    ([[1, 0, 1]], 2)
    >>> emb[0].num_embeddings
    10
    """
    name = _embedding_name(model, embedding)
    table = model.get_submodule(name)
    for other, p in model.named_parameters(remove_duplicate=False):
        if p is table.weight and not other.startswith(f"{name}."):
            raise UsageError(
                f"compact_vocabulary: {name}.weight is tied to {other}; a tied table "
                "cannot be restricted to the batches' rows, measure without it"
            )
    ids = [_ids(b, key) for b in batches]
    if not ids:
        raise UsageError("compact_vocabulary: no batches given")
    device = table.weight.device
    used = torch.unique(torch.cat([i.reshape(-1).to(device) for i in ids]))
    if int(used.min()) < 0 or int(used.max()) >= table.num_embeddings:
        raise UsageError(
            f"compact_vocabulary: token ids span {int(used.min())}..{int(used.max())} but "
            f"the table has {table.num_embeddings} rows; the batches do not fit this model"
        )
    padding = None
    if table.padding_idx is not None and bool((used == table.padding_idx).any()):
        padding = int(torch.searchsorted(used, torch.tensor(table.padding_idx, device=device)))
    compact = nn.Embedding(
        len(used),
        table.embedding_dim,
        padding_idx=padding,
        max_norm=table.max_norm,
        norm_type=table.norm_type,
        scale_grad_by_freq=table.scale_grad_by_freq,
        sparse=table.sparse,
        device=device,
        dtype=table.weight.dtype,
    )
    with torch.no_grad():
        compact.weight.copy_(table.weight[used])
    compact.weight.requires_grad_(table.weight.requires_grad)
    compact.train(table.training)
    remapped = [
        _with_ids(b, torch.searchsorted(used, i.to(device)).to(i.device), key)
        for b, i in zip(batches, ids, strict=True)
    ]
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, compact)
    try:
        yield remapped
    finally:
        setattr(parent, child, table)
