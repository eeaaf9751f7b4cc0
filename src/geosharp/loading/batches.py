"""The measurement batches of ``--data``: what it names (:func:`data_kind`), the task of
the checkpoint (:func:`resolve_task`), and the batches loaded as the checkpoint's owner
made them (:func:`load_batches`; :mod:`geosharp.loading.hfdata`: label names, image
processor, tokenizer limits), with the lines that say how.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import MissingInputError, UsageError

__all__ = ["BUILTIN_DATA", "BUILTIN_IMAGES", "data_kind", "load_batches", "resolve_task"]

BUILTIN_IMAGES = ("digits", "fashion-mnist")
BUILTIN_DATA = (*BUILTIN_IMAGES, "rotten-tomatoes")


def data_kind(source: str) -> str:
    """What ``--data`` names: ``builtin``, ``table``, ``datasets``, ``images`` or ``pt``."""
    from .data import TABLE_SUFFIXES, is_datasets_dir, is_image_folder

    if source in BUILTIN_DATA:
        return "builtin"
    path = Path(source)
    if not path.exists():
        raise MissingInputError(
            f"--data {source}: no such file or directory (built-in: {', '.join(BUILTIN_DATA)})"
        )
    if path.is_dir():
        if is_datasets_dir(path):
            return "datasets"
        if is_image_folder(path):
            return "images"
        raise UsageError(
            f"--data {source}: a directory must be a datasets save_to_disk directory or an "
            "image folder root/<class>/<image>"
        )
    if path.suffix.lower() in TABLE_SUFFIXES:
        return "table"
    if path.suffix.lower() == ".pt":
        return "pt"
    raise UsageError(
        f"--data {source}: unknown format {path.suffix or '(no suffix)'}; use .csv, .tsv, "
        ".jsonl, .pt, a datasets directory or an image folder"
    )


def resolve_task(option: str, config) -> str:
    """The task of ``--task`` (``auto``: a causal LM when config.json's architectures
    say so, else the classifier's task of :func:`geosharp.loading.hfdata.task_of`)."""
    from .hfdata import CAUSAL_LM, is_causal_lm, task_of

    archs = getattr(config, "architectures", None) or []
    if option == "causal-lm" and archs and not is_causal_lm(config):
        raise UsageError(
            f"--task causal-lm: the checkpoint is a {archs[0]}, not a causal language model "
            "(its config.json names no ...ForCausalLM or ...LMHeadModel): its next-token loss "
            "would be a random head's; drop --task, or give a causal LM checkpoint"
        )
    if option == "causal-lm" or (option == "auto" and is_causal_lm(config)):
        return CAUSAL_LM
    return task_of(config)


def load_batches(args, path: Path, config) -> tuple[list[dict], list[str]]:
    """The measurement batches of ``--data`` for the model in ``path``, loaded as the
    checkpoint's owner made them (:mod:`geosharp.loading.hfdata`), and the lines that say how
    (label mapping, pixels, texts cut)."""
    from . import data as datasets
    from . import hfdata
    from .hf import is_vision, load_tokenizer
    from .hfdata import check_label_range, label_ids

    source, n = args.data, args.n_points
    kind = data_kind(source)
    vision = is_vision(config)
    classes = int(getattr(config, "num_labels", 0) or 0)
    task = resolve_task(args.task, config)
    is_image_source = source in BUILTIN_IMAGES or kind == "images"
    is_text_source = source == "rotten-tomatoes" or kind in ("table", "datasets")
    if vision and is_text_source:
        raise UsageError(f"--data {source} is text data but {args.model} is a vision model")
    if not vision and is_image_source:
        raise UsageError(f"--data {source} is image data but {args.model} is a text model")

    if task == hfdata.CAUSAL_LM:
        return _lm_batches(args, path, config)
    if kind == "pt":
        return _tensor_batches(source, n, args.batch_size, classes, task), []
    if task != hfdata.TASKS[0] and (is_image_source or source == "rotten-tomatoes"):
        raise UsageError(
            f"{args.model} is a {task.replace('_', '-')} head (config.json problem_type / "
            f"num_labels) and --data {source} holds class labels: give data with its targets"
        )
    if task == hfdata.TASKS[2]:
        raise UsageError(
            f"{args.model} is a multi-label head: give --data as a .pt file whose 'labels' "
            f"tensor holds one row of {classes} 0/1 targets per data point"
        )
    if is_image_source:
        return _image_batches(args, path, config, classes)

    tokenizer = load_tokenizer(Path(args.tokenizer) if args.tokenizer else path)
    notes = []
    if source == "rotten-tomatoes":
        text = datasets.load_rotten_tomatoes()
        order = torch.randperm(len(text.labels), generator=torch.Generator().manual_seed(args.seed))
        texts = [text.texts[i] for i in order[:n]]
        labels = text.labels[order[:n]]
        check_label_range(labels, classes)
        notes.append("labels: 0 = rotten, 1 = fresh (the data's class indices)")
    else:
        rows = datasets.read_texts(
            source, args.text_column, args.label_column, split=args.split, limit=n
        )
        texts = rows.texts
        if task == hfdata.TASKS[1]:
            labels = hfdata.regression_targets(rows.labels)
            notes.append("targets: numbers (regression head, mean squared error)")
        else:
            labels = label_ids(rows.labels, config, classes)
            notes.append(_label_note(rows.labels, labels))
    batches, more = hfdata.tokenized_batches(
        tokenizer, config, texts, labels, args.batch_size, args.max_length
    )
    return batches, [*notes, *more]


def _lm_batches(args, path: Path, config) -> tuple[list[dict], list[str]]:
    """Batches of texts for a causal LM (no labels: the next-token loss)."""
    from . import data as datasets
    from . import hfdata
    from .hf import load_tokenizer

    source, n = args.data, args.n_points
    if source != "rotten-tomatoes" and data_kind(source) not in ("table", "datasets"):
        raise UsageError(
            f"{args.model} is a causal LM: give --data as texts (.txt, .csv, .tsv, .jsonl, "
            "a datasets directory, or rotten-tomatoes)"
        )
    if "," in args.text_column:
        raise UsageError("a causal LM reads one text column: give --text-column NAME")
    tokenizer = load_tokenizer(Path(args.tokenizer) if args.tokenizer else path)
    if source == "rotten-tomatoes":
        text = datasets.load_rotten_tomatoes()
        order = torch.randperm(len(text.labels), generator=torch.Generator().manual_seed(args.seed))
        texts = [text.texts[i] for i in order[:n]]
    else:
        rows = datasets.read_texts(source, args.text_column, None, split=args.split, limit=n)
        texts = rows.texts
    batches, notes = hfdata.tokenized_batches(
        tokenizer, config, texts, None, args.batch_size, args.max_length
    )
    return batches, ["texts: next-token loss, mean over the tokens (padding masked)", *notes]


def _label_note(raw: list, ids: torch.Tensor) -> str:
    """How the labels of a text file became class ids."""
    from .hfdata import class_index

    named = {}
    for label, i in zip(raw, ids.tolist(), strict=True):
        if not (isinstance(label, int) or class_index(label) is not None):
            named.setdefault(str(label).strip(), i)
    if not named:
        return "labels: class indices as given"
    shown = ", ".join(f"{k}={v}" for k, v in sorted(named.items(), key=lambda kv: kv[1])[:8])
    return f"labels: {shown} (names matched to the checkpoint label2id)"


def _image_batches(args, path: Path, config, classes: int) -> tuple[list[dict], list[str]]:
    """Batches of an image folder or built-in image set, through the checkpoint's image
    processor where it has one."""
    from . import data as datasets
    from . import hfdata
    from .hf import load_image_processor
    from .hfdata import check_label_range, image_batches_for

    source, n = args.data, args.n_points
    processor = load_image_processor(path)
    notes = []
    if args.data in BUILTIN_IMAGES:
        images = (
            datasets.load_digits() if source == "digits" else datasets.load_fashion_mnist("train")
        )
        x, y = images.images[:n], images.labels[:n]
        check_label_range(y, classes)
        notes.append(f"labels: the data's class indices 0 to {images.classes - 1}")
        if processor is None:
            notes.append(
                f"pixels: resized to {config.image_size}x{config.image_size}, (x - 0.5) / 0.5 "
                "(the checkpoint has no preprocessor_config.json)"
            )
            return list(image_batches_for(config, x, y, args.batch_size)), notes
        pil = _as_pil(x, datasets.image_mode(config.num_channels))
    else:
        items, folders = datasets.image_folder_items(source, n, args.seed)
        if not items:
            raise UsageError(
                f"{source} has no images in class sub-directories (root/<class>/<image>)"
            )
        ids, how = hfdata.folder_label_ids(folders, config)
        notes.append(how)
        y = torch.tensor([ids[c] for _, c in items], dtype=torch.long)
        pil = datasets.read_images([f for f, _ in items], datasets.image_mode(config.num_channels))
    pixels, how = hfdata.pixel_values(pil, config, processor)
    notes.append(how)
    batches = [
        {"pixel_values": pixels[s : s + args.batch_size], "labels": y[s : s + args.batch_size]}
        for s in range(0, len(y), args.batch_size)
    ]
    return batches, notes


def _as_pil(images: torch.Tensor, mode: str) -> list:
    """``(N, C, H, W)`` images in [0, 1] as 8-bit PIL images in ``mode`` (what an image
    processor reads, rescaling included)."""
    from PIL import Image

    array = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    out = []
    for a in array:
        image = Image.fromarray(a[..., 0] if a.shape[-1] == 1 else a)
        out.append(image.convert(mode))
    return out


def _tensor_batches(source: str, n: int, batch_size: int, classes: int, task: str) -> list[dict]:
    """Batches of a ``.pt`` dict of tensors, one row per data point in each; ``labels``
    fit the task: class indices, regression targets, or rows of 0/1 targets."""
    from .hfdata import check_label_range

    try:
        tensors = torch.load(source, weights_only=True)
    except Exception as err:  # any unreadable file is the user's to fix
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UsageError(f"--data {source}: torch.load cannot read it ({first})") from None
    if not isinstance(tensors, dict) or not isinstance(tensors.get("labels"), torch.Tensor):
        raise UsageError(
            f"--data {source} must hold a dict of input tensors with a 'labels' entry "
            f"(found {type(tensors).__name__}); save e.g. {{'pixel_values': x, 'labels': y}}"
        )
    labels = tensors["labels"]
    other = {k: v for k, v in tensors.items() if not isinstance(v, torch.Tensor)}
    if other:
        key = next(iter(other))
        raise UsageError(
            f"--data {source}: {key!r} is a {type(other[key]).__name__}, not a tensor; "
            "save only tensors, one row per data point"
        )
    lengths = {k: len(v) if v.dim() else 0 for k, v in tensors.items()}
    if len(set(lengths.values())) > 1:
        raise UsageError(
            f"--data {source}: the tensors hold different numbers of data points "
            f"({', '.join(f'{k} {m}' for k, m in lengths.items())}); give each one row per point"
        )
    got = f"got {str(labels.dtype).removeprefix('torch.')} of shape {tuple(labels.shape)}"
    if labels.is_complex() or (labels.dtype == torch.bool and task != "multi_label_classification"):
        raise UsageError(f"--data {source}: 'labels' are not numbers ({got})")
    if task == "regression":
        if labels.dim() not in (1, 2) or (labels.dim() == 2 and labels.shape[1] != classes):
            raise UsageError(
                f"--data {source}: 'labels' of a regression head with {classes} output(s) must "
                f"be (N,) or (N, {classes}) numbers, {got}"
            )
        bad = (~torch.isfinite(labels.double())).nonzero()
        if len(bad):
            where = tuple(int(i) for i in bad[0])
            raise UsageError(
                f"--data {source}: 'labels' row {where[0]} holds {float(labels[where]):g}; "
                "a regression target must be a finite number"
            )
    elif task == "multi_label_classification":
        if labels.dim() != 2 or labels.shape[1] != classes:
            raise UsageError(
                f"--data {source}: 'labels' of a multi-label head must be (N, {classes}) "
                f"0/1 targets, {got}"
            )
        outside = ((labels != 0) & (labels != 1)).nonzero()
        if len(outside):
            row, col = (int(i) for i in outside[0])
            raise UsageError(
                f"--data {source}: 'labels' row {row} holds {float(labels[row, col]):g} for "
                f"label {col}; a multi-label head's targets are 0 or 1 (binary cross-entropy)"
            )
    else:
        if labels.is_floating_point() or labels.dim() != 1:
            raise UsageError(
                f"--data {source}: 'labels' must be a 1-d tensor of class indices (integers), {got}"
            )
        check_label_range(labels, classes)
    n = min(n, len(labels))
    return [
        {k: v[s : min(s + batch_size, n)] for k, v in tensors.items()}
        for s in range(0, n, batch_size)
    ]
