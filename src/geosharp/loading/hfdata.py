"""Data for a Hugging Face checkpoint as its owner made it.

A measure on data the model was not trained on measures another problem: this module
turns files into the batches the checkpoint expects, and refuses what it cannot map.

* the task and its loss from the config (``problem_type``, ``num_labels``), as
  transformers computes it: cross-entropy, MSE for regression, binary cross-entropy
  for multi-label heads (:func:`task_loss`);
* labels as class ids: indices, or names of the config's ``label2id``
  (:func:`label_ids`); class folders matched to its label names (:func:`folder_label_ids`);
* pixels through the checkpoint's own image processor (``preprocessor_config.json``:
  size, rescale, mean, std), :func:`pixel_values`;
* texts within the tokenizer's and the model's limits, with the pad token and the
  vocabulary checked (:func:`tokenized_batches`);
* one pre-flight pass over the batches before anything slow: every input the forward
  takes, no error, the unperturbed loss and accuracy (:func:`preflight`).

Each function returns, beside its result, the lines a user should read (what mapping
was used, how many texts were cut); problems are one-line
:class:`~geosharp.errors.UsageError`.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..errors import UsageError
from ..params import in_float32

__all__ = [
    "TASKS",
    "Fit",
    "causal_lm_loss",
    "check_label_range",
    "class_index",
    "folder_label_ids",
    "image_batches_for",
    "is_causal_lm",
    "label_ids",
    "lm_inputs",
    "pixel_values",
    "preflight",
    "regression_targets",
    "task_loss",
    "task_of",
    "tokenized_batches",
]

TASKS = ("single_label_classification", "regression", "multi_label_classification")
CAUSAL_LM = "causal_lm"
_GENERIC = re.compile(r"LABEL_\d+")


def task_of(config) -> str:
    """The task of a classifier's config, by transformers' rule: ``problem_type`` if
    set, else regression for one output and single-label classification otherwise."""
    kind = getattr(config, "problem_type", None)
    if kind in TASKS:
        return kind
    return "regression" if getattr(config, "num_labels", 2) == 1 else TASKS[0]


def is_causal_lm(config) -> bool:
    """Whether a checkpoint's config says it is a causal language model (its
    ``architectures``, as transformers' Auto classes read them: ``...ForCausalLM``,
    ``...LMHeadModel``)."""
    archs = getattr(config, "architectures", None) or []
    return any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs)


def causal_lm_loss(model: nn.Module, batch: dict) -> Tensor:
    """The next-token loss of a causal language model on a dict batch with
    ``input_ids`` and ``attention_mask``: cross-entropy of the logits at position ``t``
    against the token at ``t + 1``, averaged over the tokens whose target is not
    padding (what transformers computes with ``labels`` set to -100 on padding).

    >>> import torch
    >>> class Uniform(torch.nn.Module):  # every next token equally likely, 5 tokens
    ...     def forward(self, input_ids, attention_mask):
    ...         return type("Out", (), {"logits": torch.zeros(*input_ids.shape, 5)})()
    >>> batch = {"input_ids": torch.tensor([[1, 2, 3], [4, 0, 0]]),
    ...          "attention_mask": torch.tensor([[1, 1, 1], [1, 0, 0]])}
    >>> round(float(causal_lm_loss(Uniform(), batch)), 4)  # log 5 over the 2 targets
    1.6094
    """
    logits = model(**lm_inputs(model, batch)).logits
    return _next_token(logits, batch["input_ids"], batch.get("attention_mask"))[0]


def lm_inputs(model: nn.Module, batch: dict) -> dict:
    """The model's inputs for a causal-LM batch: without ``labels``, and with
    ``position_ids`` counted over real tokens where a row is padded on the left (a
    decoder-only tokenizer's habit) and the model takes them, so that every text sees
    the positions it has alone."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    mask = inputs.get("attention_mask")
    if mask is None or "position_ids" in inputs or not _left_padded(mask):
        return inputs
    try:
        takes = "position_ids" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        takes = False
    if takes:
        inputs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp_min(0)
    return inputs


def _left_padded(mask: Tensor) -> bool:
    """Whether some row has padding before a real token."""
    m = mask.bool()
    return bool((~m[:, :-1] & m[:, 1:]).any())


def _next_token(logits: Tensor, ids: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """The mean next-token loss and, per target token, whether the top logit is it."""
    logits, targets = logits[:, :-1], ids[:, 1:]
    # a target counts where it and the token that predicts it are real (left padding:
    # the first real token is not predicted from padding)
    keep = (
        torch.ones_like(targets, dtype=torch.bool)
        if mask is None
        else mask[:, 1:].bool() & mask[:, :-1].bool()
    )
    if not bool(keep.any()):
        raise UsageError("every text is one token long: no next token to predict")
    flat = logits[keep]
    loss = F.cross_entropy(in_float32(flat), targets[keep])
    return loss, flat.argmax(-1) == targets[keep]


def task_loss(model: nn.Module, batch: dict) -> Tensor:
    """The training loss of a Hugging Face classifier on a dict batch with ``labels``,
    for the task of ``model.config`` (:func:`task_of`): cross-entropy; mean squared
    error for regression; binary cross-entropy with logits for multi-label."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits
    return _loss(task_of(getattr(model, "config", None)), logits, batch["labels"])


def _loss(kind: str, logits: Tensor, labels: Tensor) -> Tensor:
    """The task's loss, in float32 from half-precision logits."""
    logits = in_float32(logits)
    if kind == "regression":
        if logits.shape[-1] == 1:
            logits = logits.squeeze(-1)
        return F.mse_loss(logits, labels.to(logits.dtype).reshape(logits.shape))
    if kind == "multi_label_classification":
        return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))
    return F.cross_entropy(logits, labels)


def label_names(config) -> dict[int, str] | None:
    """The config's class names by id, or ``None`` when they are transformers'
    placeholders ``LABEL_0, LABEL_1, ...`` (no names given)."""
    names = {int(k): str(v) for k, v in (getattr(config, "id2label", None) or {}).items()}
    if not names or all(_GENERIC.fullmatch(v) for v in names.values()):
        return None
    return names


def folder_label_ids(classes: Sequence[str], config) -> tuple[list[int], str]:
    """The class id of each folder name in ``classes`` and a line saying how.

    Folders named by class index (``0``, ``1``, ...) are those classes; otherwise each
    folder must be one of the config's label names (case aside), and a folder that is
    not is an error naming both lists. A model whose labels have no names takes the
    folders in sorted order only when there are exactly as many as it has classes.

    >>> from types import SimpleNamespace
    >>> config = SimpleNamespace(id2label={0: "zebra", 1: "apple"}, num_labels=2)
    >>> folder_label_ids(["apple", "zebra"], config)
    ([1, 0], 'labels: apple=1, zebra=0 (folders matched to the checkpoint label names)')
    """
    n = int(getattr(config, "num_labels", 0) or 0)
    names = label_names(config)
    if all(c.isascii() and c.isdigit() for c in classes):
        ids, how = [int(c) for c in classes], "folders named by class index"
    elif names is not None:
        lookup = {v.lower(): k for k, v in names.items()}
        unknown = [c for c in classes if c.lower() not in lookup]
        if unknown:
            raise UsageError(
                f"class folders {_listing(unknown)} are not among the model's label names "
                f"{_listing([names[k] for k in sorted(names)])}: name each folder after its "
                "label (config.json id2label)"
            )
        ids, how = (
            [lookup[c.lower()] for c in classes],
            "folders matched to the checkpoint label names",
        )
    elif len(classes) == n:
        ids, how = list(range(n)), "folders in sorted order; the checkpoint names no labels"
    else:
        raise UsageError(
            f"{len(classes)} class folders for a model of {n} unnamed classes: which folder is "
            f"which class is unknown; name the folders by class index (0 to {n - 1})"
        )
    outside = [c for c, i in zip(classes, ids, strict=True) if not 0 <= i < n]
    if n and outside:
        raise UsageError(
            f"class folder {outside[0]!r} is outside the model's {n} classes (0 to {n - 1})"
        )
    pairs = [f"{c}={i}" for c, i in zip(classes, ids, strict=True)]
    return ids, f"labels: {_listing(pairs, quote=False)[1:-1]} ({how})"


def _listing(items: Sequence[str], quote: bool = True, most: int = 8) -> str:
    shown = [repr(x) if quote else str(x) for x in items[:most]]
    more = f", ... ({len(items)} in all)" if len(items) > most else ""
    return "[" + ", ".join(shown) + more + "]"


def pixel_values(images: list, config, processor) -> tuple[Tensor, str]:
    """``(N, C, H, W)`` model inputs of PIL ``images`` and a line saying how: through
    ``processor`` (the checkpoint's image processor) if given, else resized to
    ``config.image_size`` and scaled as ``(x - 0.5) / 0.5`` (the ViT default)."""
    from .data import to_unit_tensor

    if processor is not None:
        pixels = processor(images=images, return_tensors="pt")["pixel_values"]
        return pixels.float(), f"pixels: the checkpoint's {type(processor).__name__}"
    size = config.image_size
    pixels = (to_unit_tensor(images, size) - 0.5) / 0.5
    return pixels, (
        f"pixels: resized to {size}x{size}, (x - 0.5) / 0.5 (the checkpoint has no "
        "preprocessor_config.json; save its image processor with it to use its own)"
    )


def check_label_range(labels: Tensor, num_labels: int) -> None:
    """An error naming the first label outside ``[0, num_labels)`` (no check when the
    number of classes is unknown, 0)."""
    outside = (labels < 0) | (labels >= num_labels)
    if num_labels and bool(outside.any()):
        bad = int(labels[outside][0])
        raise UsageError(
            f"label {bad} is outside the model's {num_labels} classes (0 to "
            f"{num_labels - 1}): use the labels the model was trained with"
        )


def class_index(label: object) -> int | None:
    """``label`` as a class index when it is one, written in ASCII digits (``"2"``,
    ``" -1"``); ``None`` otherwise (a class name; ``"²"`` is a digit to Python's
    ``isdigit`` but no number ``int`` reads).

    >>> class_index(" 2"), class_index("\u00b2"), class_index("cat")
    (2, None, None)
    """
    key = str(label).strip()
    digits = key[1:] if key.startswith("-") else key
    return int(key) if digits.isascii() and digits.isdigit() else None


def label_ids(labels: list, config, num_labels: int) -> Tensor:
    """Integer class ids of ``labels`` (ints, digit strings, or class names of the
    model's ``label2id``); an error when one lies outside ``[0, num_labels)``."""
    names = {str(k).lower(): int(v) for k, v in (getattr(config, "label2id", None) or {}).items()}
    ids = []
    for label in labels:
        key = str(label).strip()
        if isinstance(label, bool):
            value = int(label)
        elif isinstance(label, int):
            value = label
        elif class_index(key) is not None:
            value = class_index(key)
        elif key.lower() in names:
            value = names[key.lower()]
        else:
            known = ", ".join(sorted(names)) or "none"
            raise UsageError(
                f"label {label!r} is neither a class index nor one of the model's label names "
                f"({known})"
            )
        ids.append(value)
    ids = torch.tensor(ids, dtype=torch.long)
    check_label_range(ids, num_labels)
    return ids


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


def regression_targets(labels: Sequence) -> Tensor:
    """Float targets of a regression head (an error naming the first row that is not a
    number)."""
    out = []
    for row, label in enumerate(labels, 1):
        try:
            value = float(label)
        except (TypeError, ValueError):
            value = None
        if value is None or not math.isfinite(value):
            what = "not a number" if value is None else "not a finite number"
            raise UsageError(
                f"data row {row}: label {label!r} is {what}, and the model is a regression "
                "head (num_labels=1)"
            )
        out.append(value)
    return torch.tensor(out, dtype=torch.float32)


def tokenized_batches(
    tokenizer, config, texts: list, labels: Tensor | None, batch_size: int, max_length: int
) -> tuple[list[dict], list[str]]:
    """Tokenised batches of ``texts`` (``(a, b)`` pairs: sentence pairs) and the lines
    to show; ``labels=None`` for a causal LM (no labels; its padding is masked out of
    the loss, so a missing pad token is the end-of-text token). ``max_length`` is capped
    at the tokenizer's and the model's position limits, and the number of texts cut is
    said; a length too short for the special tokens (a causal LM: for a next token), a
    classifier's missing pad token, and ids outside the model's vocabulary are errors."""
    notes: list[str] = []
    pairs = bool(texts) and isinstance(texts[0], tuple)
    first = [t[0] for t in texts] if pairs else list(texts)
    second = [t[1] for t in texts] if pairs else None
    limits = {"--max-length": max_length}
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and positions > 0:
        limits["the model's positions"] = positions
    model_max = getattr(tokenizer, "model_max_length", None)
    if isinstance(model_max, int) and 0 < model_max < 1_000_000:
        limits["the tokenizer's model_max_length"] = model_max
    why, length = min(limits.items(), key=lambda kv: kv[1])
    if length < max_length:
        notes.append(
            f"note: --max-length {max_length} is above {why} ({length}): texts cut at {length}"
        )
    special = tokenizer.num_special_tokens_to_add(pair=pairs)
    if length <= special:
        raise UsageError(
            f"--max-length {max_length} leaves no room for text: the tokenizer adds {special} "
            f"special tokens; use at least {special + 1}"
        )
    if labels is None and length - special < 2:
        raise UsageError(
            f"--max-length {max_length} leaves no next token to predict: use at least {special + 2}"
        )
    if tokenizer.pad_token is None and batch_size > 1 and len(texts) > 1:
        pad = getattr(config, "pad_token_id", None)
        if pad is None and labels is None and tokenizer.eos_token is not None:
            pad = tokenizer.eos_token_id
            notes.append("note: padding with the end-of-text token (masked out of the loss)")
        if pad is None:
            raise UsageError(
                "the tokenizer has no pad token and config.json no pad_token_id, so texts of "
                "different lengths cannot share a batch: set pad_token_id in config.json to "
                "the id the model was fine-tuned with (often eos_token_id), or --batch-size 1"
            )
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(int(pad))
    full = tokenizer(first, second, truncation=False)["input_ids"]
    cut = sum(len(ids) > length for ids in full)
    if cut:
        notes.append(
            f"note: {cut} of {len(texts)} texts are longer than {length} tokens and were cut"
        )
    vocab = getattr(config, "vocab_size", None)
    batches = []
    for start in range(0, len(texts), batch_size):
        end = min(start + batch_size, len(texts))
        enc = tokenizer(
            first[start:end],
            second[start:end] if second is not None else None,
            padding=True,
            truncation=True,
            max_length=length,
            return_tensors="pt",
        )
        batch = dict(enc)
        if labels is not None:
            batch["labels"] = labels[start:end]
        batches.append(batch)
    if isinstance(vocab, int) and vocab > 0:
        top = max(int(b["input_ids"].max()) for b in batches)
        if top >= vocab:
            raise UsageError(
                f"the tokenizer gives token id {top} but the model's vocabulary has {vocab} "
                f"(the tokenizer has {len(tokenizer)}): pass the tokenizer the model was "
                "trained with (--tokenizer DIR)"
            )
    if isinstance(vocab, int) and vocab > 0 and len(tokenizer) > vocab:
        notes.append(
            f"warning: the tokenizer has {len(tokenizer)} tokens and the model's vocabulary "
            f"{vocab}: is it the tokenizer the model was trained with?"
        )
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is not None:
        ids = torch.cat([b["input_ids"][b["attention_mask"].bool()] for b in batches])
        share = float((ids == unk).float().mean()) if ids.numel() else 0.0
        if share > 0.2:
            notes.append(
                f"warning: {share:.0%} of the tokens are unknown to the tokenizer: is it the "
                "one the model was trained with?"
            )
    return batches, notes


@dataclass
class Fit:
    """The unperturbed loss of the pre-flight pass and, for classifiers, the accuracy
    (multi-label: of each label's decision)."""

    loss: float
    accuracy: float | None
    n: int
    notes: list[str] = field(default_factory=list)

    unit: str = "points"

    def __str__(self) -> str:
        acc = "" if self.accuracy is None else f", accuracy {self.accuracy:.1%}"
        return f"unperturbed loss {self.loss:.4g}{acc} on {self.n} {self.unit}"


def preflight(model: nn.Module, batches: list[dict], source: str, task: str | None = None) -> Fit:
    """One forward pass over ``batches`` (no gradient) before anything slow: inputs the
    model's ``forward`` does not take, a forward that fails and a loss that is not
    finite are one-line errors; the result is the unperturbed loss and accuracy. The
    loss is the mean over batches of each batch's mean loss (per target token for a
    causal LM, per point otherwise): the average the measures report as ``loss`` and
    measure sharpness against."""
    from ..params import evaluation_mode

    accepted = [
        name
        for name, p in inspect.signature(model.forward).parameters.items()
        if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    ]
    inputs = [name for name in accepted if name != "labels"]
    unknown = sorted(set(batches[0]) - {"labels"} - set(accepted))
    main = getattr(model, "main_input_name", None)
    if unknown or (main in accepted and main not in batches[0]):
        what = f"takes no input {unknown[0]!r}" if unknown else f"needs its input {main!r}"
        raise UsageError(
            f"--data {source}: {type(model).__name__} {what}; its inputs are "
            f"{', '.join(inputs[:8])}{', ...' if len(inputs) > 8 else ''}"
        )
    kind = task or task_of(getattr(model, "config", None))
    total, right, count, n = 0.0, 0.0, 0, 0
    with torch.no_grad(), evaluation_mode(model):
        for batch in batches:
            inputs = (
                lm_inputs(model, batch)
                if kind == CAUSAL_LM
                else {k: v for k, v in batch.items() if k != "labels"}
            )
            try:
                logits = model(**inputs).logits
            except (
                RuntimeError,
                ValueError,
                IndexError,
                TypeError,
                KeyError,
                AttributeError,
            ) as err:
                why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise UsageError(
                    f"--data {source}: the model cannot run on it ({type(err).__name__}: "
                    f"{why}); check the inputs' names, shapes and dtypes"
                ) from None
            if kind == CAUSAL_LM:
                loss, hits = _next_token(logits, batch["input_ids"], batch.get("attention_mask"))
                total += float(loss)
                right, count, n = right + float(hits.sum()), count + len(hits), n + len(hits)
                continue
            labels = batch["labels"]
            size = len(labels)
            total += float(_loss(kind, logits, labels))
            n += size
            if kind == TASKS[0]:
                right += float((logits.argmax(-1) == labels).sum())
                count += size
            elif kind == TASKS[2]:
                right += float(((logits > 0) == (labels > 0.5)).sum())
                count += labels.numel()
    loss = total / len(batches)
    if not math.isfinite(loss):
        raise UsageError(
            f"--data {source}: the unperturbed loss is {loss}; check the model and the data"
        )
    unit = "target tokens" if kind == CAUSAL_LM else "points"
    return Fit(loss, right / count if count else None, n, unit=unit)
