"""Model zoos of small transformers: train, measure sharpness, report rank correlations.

Two zoos (see ``docs/zoo.md`` for the protocol):

* ``vision``: tiny Hugging Face ViTs (28x28 inputs, patch 7) trained from scratch on
  Fashion-MNIST, hyperparameters sampled from axes (learning rate, weight decay, batch
  size, width/depth, training-set size, label noise, augmentation);
* ``text``: the local pretrained MiniLM BERT truncated to its first layer(s), with a
  mean-pooling classifier head, fine-tuned on Rotten Tomatoes subsets (learning rate,
  epochs, batch size, training-set size, label noise, frozen embeddings).

Layout under ``<out>/<zoo>/``::

    models/<id>/            config.json + model.safetensors + meta.json (hyperparameters,
                            errors)
    measures/<id>.json      sharpness per measure and radius (value and per-batch values)
    report/report.md        tables; report/*.png scatter plots; report/summary.json;
                            report/models.csv (one row per model)

Every file is written atomically (temporary file, then ``os.replace``) and each step
skips what is already complete, so a killed run resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from .. import distributed as gd
from ..data import move_batch
from ..errors import UsageError
from ..io import write_json_atomic, write_text_atomic
from ..measures.catalog import PAPER_TABLE
from .figures import require_matplotlib
from .stats import granulated_tau

__all__ = [
    "PRESETS",
    "ZooPreset",
    "granulated_tau",
    "main",
    "measure_zoo",
    "report_zoo",
    "sample_hyperparameters",
    "train_zoo",
]

ZOOS = ("vision", "text")

MAIN_MEASURES = ("adaptive", "geodesic-inv", "geodesic-mix")
ALL_MEASURES = (
    "adaptive",
    "adaptive-linf",
    "geodesic-inv",
    "geodesic-mix",
    "geodesic-norm-only-inv",
    "geodesic-norm-only-mix",
    "geodesic-curvature-only-inv",
    "geodesic-curvature-only-mix",
)


# --------------------------------------------------------------------------- presets


@dataclass
class ZooPreset:
    """Everything that defines a zoo: hyperparameter axes, data sizes, measurement."""

    zoo: str
    n_models: int
    axes: dict[str, list]  # axis -> choices; each model draws one per axis
    fixed: dict = field(default_factory=dict)  # settings shared by all models
    n_test: int = 1000
    n_points: int = 256  # fixed training points for sharpness (same for every model)
    measure_batch: int = 64
    n_iters: int = 20
    measures: tuple[str, ...] = ALL_MEASURES
    # radii as multiples of DEFAULT_RHO: one grid for all measures, or {measure: grid}
    rho_factors: tuple[float, ...] | dict[str, tuple[float, ...]] = (0.25, 0.5, 1.0, 2.0, 4.0)
    n_boot: int = 1000
    seed: int = 0
    # parameters left unperturbed by every measure (the text zoos: MiniLM's 11.7M-entry
    # word-embedding table, which dominates the cost and only sees the batch's tokens)
    frozen_in_measure: tuple[str, ...] = ()

    def rho_grid(self, measure: str) -> list[float]:
        from ..measures import DEFAULT_RHO

        factors = self.rho_factors
        if isinstance(factors, dict):
            factors = factors[measure]
        return [float(DEFAULT_RHO[measure] * f) for f in factors]


VISION_FULL = ZooPreset(
    zoo="vision",
    n_models=48,
    axes=dict(
        lr=[1e-4, 3e-4, 1e-3, 3e-3],
        weight_decay=[0.0, 0.01, 0.1, 0.5],
        batch_size=[32, 64, 128, 256],
        arch=["32x1", "32x2", "64x2", "64x4"],  # hidden width x layers
        n_train=[500, 1000, 2000, 5000],
        label_noise=[0.0, 0.1, 0.25],
        augment=["none", "shift", "shift+flip"],
    ),
    fixed=dict(epochs=30, heads=4, patch_size=7),
    n_test=2000,
    n_points=512,
    measure_batch=128,
    n_iters=10,
)
VISION_SMOKE = ZooPreset(
    zoo="vision",
    n_models=4,
    axes=dict(
        lr=[1e-3, 3e-3],
        weight_decay=[0.0, 0.1],
        batch_size=[16, 32],
        arch=["8x1", "16x1"],
        n_train=[64, 96],
        label_noise=[0.0, 0.2],
        augment=["none", "shift+flip"],
    ),
    fixed=dict(epochs=2, heads=2, patch_size=7),
    n_test=64,
    n_points=32,
    measure_batch=16,
    n_iters=2,
    measures=ALL_MEASURES,
    rho_factors=(0.5, 2.0),
    n_boot=100,
)
TEXT_FULL = ZooPreset(
    zoo="text",
    n_models=36,
    axes=dict(
        lr=[1e-5, 3e-5, 1e-4, 3e-4],
        epochs=[1, 2, 4],
        batch_size=[16, 32, 64],
        n_train=[500, 1000, 2000, 4000],
        label_noise=[0.0, 0.1, 0.25],
        freeze_embeddings=[False, True],
    ),
    # one encoder layer and 32 tokens (70% of the sentences fit): a forward+backward of
    # MiniLM is compute bound on a CPU, and this keeps the zoo to about two CPU hours
    fixed=dict(max_length=32, weight_decay=0.01, layers=1),
    frozen_in_measure=("bert.embeddings.word_embeddings.weight",),
    n_test=1000,
    n_points=64,
    measure_batch=32,
    n_iters=10,
    rho_factors=(0.25, 1.0, 4.0),
)
TEXT_SMOKE = ZooPreset(
    zoo="text",
    n_models=4,
    axes=dict(
        lr=[3e-5, 3e-4],
        epochs=[1],
        batch_size=[16, 32],
        n_train=[48, 64],
        label_noise=[0.0, 0.2],
        freeze_embeddings=[False, True],
        layers=[1],
    ),
    fixed=dict(max_length=24, weight_decay=0.01),
    frozen_in_measure=("bert.embeddings.word_embeddings.weight",),
    n_test=48,
    n_points=8,
    measure_batch=8,
    n_iters=2,
    measures=(
        "adaptive",
        "adaptive-linf",
        "geodesic-inv",
        "geodesic-mix",
        "geodesic-norm-only-inv",
        "geodesic-curvature-only-inv",
    ),
    rho_factors=(0.5, 2.0),
    n_boot=100,
)
# The recipe of the seed population (MiniLM-L6, all 6 layers, mean pooling and a
# linear head, Rotten Tomatoes): one fixed training set and recipe, only the seed varies.
SEED_RECIPE = dict(
    lr=5e-5,
    epochs=5,
    batch_size=32,
    n_train=1000,
    label_noise=0.0,
    freeze_embeddings=False,
    layers=6,
    max_length=32,
    weight_decay=0.01,
)
# The seed population (issue 10): MiniLM-L6 fine-tunes that differ only in their seed
# (pilot.SEED_RECIPE: one training set, no label noise, converged to ~0.5% training error).
# Radii fixed by the two pilot models before any gap was seen (docs/results/study/pilot):
# s(2 rho)/s(rho) first reaches 3 at x4-x8 for adaptive and mix, and at x1 for inv.
TEXT_SEEDS = ZooPreset(
    zoo="text",
    n_models=40,
    axes={},
    fixed={k: v for k, v in SEED_RECIPE.items()},
    frozen_in_measure=("bert.embeddings.word_embeddings.weight",),
    n_test=2000,
    n_points=128,
    measure_batch=64,
    n_iters=20,
    measures=MAIN_MEASURES,
    rho_factors={
        "adaptive": (2.0, 4.0, 8.0, 16.0),
        "geodesic-mix": (2.0, 4.0, 8.0, 16.0),
        "geodesic-inv": (0.125, 0.25, 0.5, 1.0),
    },
    seed=1,
)
PRESETS: dict[tuple[str, str], ZooPreset] = {
    ("vision", "full"): VISION_FULL,
    ("vision", "smoke"): VISION_SMOKE,
    ("text", "full"): TEXT_FULL,
    ("text", "smoke"): TEXT_SMOKE,
    ("text", "seeds"): TEXT_SEEDS,
}


def get_preset(zoo: str, preset: str) -> ZooPreset:
    try:
        return PRESETS[(zoo, preset)]
    except KeyError:
        known = ", ".join(f"{z}/{p}" for z, p in PRESETS)
        raise UsageError(f"no preset {preset!r} for the {zoo} zoo: choose one of {known}") from None


def sample_hyperparameters(preset: ZooPreset) -> list[dict]:
    """One hyperparameter dict per model, drawn deterministically from ``preset.seed``.

    Model ``i`` draws each axis uniformly from its choices with the generator seeded by
    ``(seed, i)``, so adding models never changes the earlier ones."""
    out = []
    for i in range(preset.n_models):
        rng = np.random.default_rng([preset.seed, i])
        hp = {
            axis: choices[int(rng.integers(len(choices)))] for axis, choices in preset.axes.items()
        }
        for k, v in hp.items():
            if isinstance(v, np.generic):
                hp[k] = v.item()
        hp.update(preset.fixed)
        hp["seed"] = int(preset.seed * 1000 + i)
        hp["id"] = f"{preset.zoo}-{i:03d}"
        out.append(hp)
    return out


# --------------------------------------------------------------------------- data


def _noisy_labels(labels: Tensor, noise: float, classes: int, seed: int) -> Tensor:
    """Replace a fraction ``noise`` of the labels by a different random class."""
    if noise <= 0:
        return labels.clone()
    gen = torch.Generator().manual_seed(10_000 + seed)
    flip = torch.rand(len(labels), generator=gen) < noise
    shift = torch.randint(1, classes, (len(labels),), generator=gen)
    return torch.where(flip, (labels + shift) % classes, labels)


_VISION_CACHE: dict = {}


def vision_data(n_test: int) -> tuple[Tensor, Tensor, Tensor, Tensor, str]:
    """Normalised train pool (shuffled once, seed 0) and test set. Fashion-MNIST, or
    (if its Debian package is missing) scikit-learn digits resized to 28x28."""
    if "data" not in _VISION_CACHE:
        from ..data import load_digits, load_fashion_mnist

        try:
            train, test = load_fashion_mnist("train"), load_fashion_mnist("test")
            source = "fashion-mnist"
        except FileNotFoundError:
            digits = load_digits()
            digits.images = F.interpolate(digits.images, size=(28, 28), mode="bilinear")
            train, test = digits.split(1297, seed=0)
            source = "digits (Fashion-MNIST missing)"
        order = torch.randperm(len(train.labels), generator=torch.Generator().manual_seed(0))
        _VISION_CACHE["data"] = (
            (train.images[order] - 0.5) / 0.5,
            train.labels[order],
            (test.images - 0.5) / 0.5,
            test.labels,
            source,
        )
    xtr, ytr, xte, yte, source = _VISION_CACHE["data"]
    return xtr, ytr, xte[:n_test], yte[:n_test], source


def vision_train_set(hp: dict) -> tuple[Tensor, Tensor]:
    """The model's training set: a prefix of the pool, with its label noise."""
    xtr, ytr, *_ = vision_data(1)
    n = min(int(hp["n_train"]), len(ytr))
    return xtr[:n], _noisy_labels(ytr[:n], float(hp["label_noise"]), 10, int(hp["seed"]))


def _augment(x: Tensor, mode: str, gen: torch.Generator, max_shift: int = 2) -> Tensor:
    """Random shifts (zero padding, up to ``max_shift`` pixels) and horizontal flips."""
    if mode == "none":
        return x
    out = x
    if "shift" in mode:
        n, _, h, w = x.shape
        padded = F.pad(x, (max_shift,) * 4, value=-1.0)  # -1 is black after normalising
        dy = torch.randint(0, 2 * max_shift + 1, (n,), generator=gen)
        dx = torch.randint(0, 2 * max_shift + 1, (n,), generator=gen)
        rows = (dy[:, None] + torch.arange(h)[None, :])[:, None, :, None]
        cols = (dx[:, None] + torch.arange(w)[None, :])[:, None, None, :]
        idx_n = torch.arange(n)[:, None, None, None]
        out = padded[idx_n, torch.arange(x.shape[1])[None, :, None, None], rows, cols]
    if "flip" in mode:
        flip = torch.rand(len(out), generator=gen) < 0.5
        out = torch.where(flip[:, None, None, None], out.flip(-1), out)
    return out


_TEXT_CACHE: dict = {}


def text_data(max_length: int) -> dict:
    """Tokenised Rotten Tomatoes (shuffled once, seed 0): ``train`` pool and ``test``
    (the last 2,000 sentences of the shuffled set)."""
    key = max_length
    if key not in _TEXT_CACHE:
        from transformers import AutoTokenizer

        from ..data import load_rotten_tomatoes
        from ..hf import resolve_checkpoint

        data = load_rotten_tomatoes()
        order = torch.randperm(len(data.labels), generator=torch.Generator().manual_seed(0))
        texts = [data.texts[int(i)] for i in order]
        labels = data.labels[order]
        tok = AutoTokenizer.from_pretrained(resolve_checkpoint("minilm"), local_files_only=True)
        n_test = 2000

        def encode(ts):
            enc = tok(ts, padding="max_length", truncation=True, max_length=max_length)
            return torch.tensor(enc["input_ids"]), torch.tensor(enc["attention_mask"])

        pool, test = texts[:-n_test], texts[-n_test:]
        _TEXT_CACHE[key] = dict(
            train=(*encode(pool[:8000]), labels[:-n_test][:8000]),
            test=(*encode(test), labels[-n_test:]),
        )
    return _TEXT_CACHE[key]


def text_train_set(hp: dict) -> tuple[Tensor, Tensor, Tensor]:
    ids, mask, labels = text_data(int(hp["max_length"]))["train"]
    n = min(int(hp["n_train"]), len(labels))
    noisy = _noisy_labels(labels[:n], float(hp["label_noise"]), 2, int(hp["seed"]))
    return ids[:n], mask[:n], noisy


def _text_batch(ids, mask, labels, idx=None) -> dict:
    if idx is not None:
        ids, mask, labels = ids[idx], mask[idx], labels[idx]
    keep = int(mask.sum(1).max())  # drop all-padding columns
    return {"input_ids": ids[:, :keep], "attention_mask": mask[:, :keep], "labels": labels}


# --------------------------------------------------------------------------- models


def build_model(hp: dict, zoo: str):
    if zoo == "vision":
        from ..models.vit import tiny_vit

        width, depth = (int(v) for v in str(hp["arch"]).split("x"))
        return tiny_vit(
            image_size=28,
            channels=1,
            classes=10,
            patch_size=int(hp["patch_size"]),
            hidden=width,
            layers=depth,
            heads=int(hp["heads"]),
            mlp=2 * width,
            seed=int(hp["seed"]),
        )
    from transformers import BertModel

    from ..hf import quiet_transformers, resolve_checkpoint

    with quiet_transformers(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(hp["seed"]))
        bert = BertModel.from_pretrained(
            resolve_checkpoint("minilm"),
            add_pooling_layer=False,
            local_files_only=True,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        model = MeanPoolClassifier(bert, num_labels=2)
    n_layers = int(hp["layers"])
    model.bert.encoder.layer = model.bert.encoder.layer[:n_layers]
    model.config.num_hidden_layers = n_layers
    return model


class MeanPoolClassifier(torch.nn.Module):
    """A BERT encoder, the mean of its last hidden states over the non-padding tokens,
    and a linear classifier: the head MiniLM (a sentence-transformers model) was trained
    for. After one layer its ``[CLS]`` state carries no sentence information (a linear
    probe on it scores the majority-class rate on Rotten Tomatoes, one on the mean 75%),
    and ``BertForSequenceClassification`` fine-tuned from it predicts the majority
    class."""

    def __init__(self, bert, num_labels: int = 2):
        super().__init__()
        self.bert = bert
        self.config = bert.config
        self.config.num_labels = num_labels
        self.classifier = torch.nn.Linear(bert.config.hidden_size, num_labels)

    def forward(self, input_ids: Tensor, attention_mask: Tensor):
        from transformers.modeling_outputs import SequenceClassifierOutput

        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp_min(1.0)
        return SequenceClassifierOutput(logits=self.classifier(pooled))

    @classmethod
    def load(cls, directory: Path) -> MeanPoolClassifier:
        from safetensors.torch import load_model
        from transformers import BertConfig, BertModel

        config = BertConfig.from_pretrained(directory, local_files_only=True)
        model = cls(BertModel(config, add_pooling_layer=False), num_labels=config.num_labels)
        load_model(model, str(directory / "model.safetensors"))
        return model


def load_zoo_model(model_dir: Path, zoo: str):
    if zoo == "vision":
        from transformers import ViTForImageClassification

        from ..hf import quiet_transformers

        with quiet_transformers():
            return ViTForImageClassification.from_pretrained(
                model_dir, local_files_only=True
            ).eval()
    return MeanPoolClassifier.load(Path(model_dir)).eval()


def _vision_loss(model, batch) -> Tensor:
    x, y = batch
    return F.cross_entropy(model(pixel_values=x).logits, y)


def _text_loss(model, batch) -> Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return F.cross_entropy(logits, batch["labels"])


def loss_fn_for(zoo: str):
    return _vision_loss if zoo == "vision" else _text_loss


@torch.no_grad()
def _evaluate(
    model, zoo: str, data: tuple, batch_size: int = 256, device: torch.device | None = None
) -> tuple[float, float]:
    """(error, mean cross-entropy)."""
    model.eval()
    labels = data[-1]
    wrong, total = 0, 0.0
    for start in range(0, len(labels), batch_size):
        sl = slice(start, start + batch_size)
        if zoo == "vision":
            logits = model(pixel_values=move_batch((data[0][sl],), device)[0]).logits
        else:
            b = move_batch(_text_batch(data[0][sl], data[1][sl], labels[sl]), device)
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        y = labels[sl].to(logits.device)
        total += float(F.cross_entropy(logits, y, reduction="sum"))
        wrong += int((logits.argmax(-1) != y).sum())
    return wrong / len(labels), total / len(labels)


def train_one(hp: dict, zoo: str, n_test: int, device: torch.device | None = None):
    """Train one model (on ``device``, CPU by default); returns ``(model, metrics)``."""
    model = build_model(hp, zoo).to(device or "cpu")
    if zoo == "vision":
        x, y = vision_train_set(hp)
        *_, xte, yte, source = vision_data(n_test)
        train_data, test_data = (x, y), (xte, yte)
        params = list(model.parameters())
    else:
        ids, mask, y = text_train_set(hp)
        te = text_data(int(hp["max_length"]))["test"]
        train_data = (ids, mask, y)
        test_data = tuple(t[:n_test] for t in te)
        source = "rotten-tomatoes"
        if hp.get("freeze_embeddings"):
            for p in model.bert.embeddings.parameters():
                p.requires_grad_(False)
        params = [p for p in model.parameters() if p.requires_grad]
    n, bs, epochs = len(y), int(hp["batch_size"]), int(hp["epochs"])
    optimizer = torch.optim.AdamW(
        params, lr=float(hp["lr"]), weight_decay=float(hp["weight_decay"])
    )
    steps = epochs * ((n + bs - 1) // bs)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, max(steps, 1))
    gen = torch.Generator().manual_seed(int(hp["seed"]))
    loss_fn = loss_fn_for(zoo)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(n, generator=gen)
        for start in range(0, n, bs):
            idx = order[start : start + bs]
            if zoo == "vision":
                batch = (_augment(x[idx], str(hp["augment"]), gen), y[idx])
            else:
                batch = _text_batch(ids, mask, y, idx)
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model, move_batch(batch, device)).backward()
            optimizer.step()
            schedule.step()
    for p in model.parameters():
        p.requires_grad_(True)
    model.eval()
    train_err, train_loss = _evaluate(model, zoo, train_data, device=device)
    test_err, test_loss = _evaluate(model, zoo, test_data, device=device)
    metrics = dict(
        train_error=train_err,
        train_loss=train_loss,
        test_error=test_err,
        test_loss=test_loss,
        error_gap=test_err - train_err,
        loss_gap=test_loss - train_loss,
        n_train_actual=n,
        n_test=len(test_data[-1]),
        data=source,
    )
    return model, metrics


def _zoo_dir(out: str | Path, preset: ZooPreset) -> Path:
    return Path(out) / preset.zoo


def _model_complete(model_dir: Path) -> bool:
    return (model_dir / "meta.json").exists()


def _save_model(model, directory: Path) -> None:
    """``config.json`` + ``model.safetensors``, loadable with ``from_pretrained``.
    (``save_pretrained`` writes weights on rank 0 only once a process group exists.)"""
    from safetensors.torch import save_model

    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(directory)
    save_model(model.cpu(), str(directory / "model.safetensors"), metadata={"format": "pt"})


def read_json(path: Path) -> dict:
    """The JSON object in ``path``, ``{}`` when there is no file yet."""
    return json.loads(path.read_text()) if path.exists() else {}


def _my_share(pending: list[dict]) -> list[dict]:
    """This process's share of the ``pending`` models: all of them in a plain run; under
    ``torchrun``, every ``world_size``-th one from ``rank``. Every rank lists ``pending``
    from the files before any rank starts writing (hence the barrier), so the shares
    are disjoint and cover everything; each model's files are written by one rank only,
    and are the same files a single process writes."""
    gd.barrier()
    return [pending[i] for i in gd.shard(len(pending))]


def train_zoo(
    preset: ZooPreset,
    out: str | Path,
    progress: bool = True,
    on_model_done: Callable[[str], None] | None = None,
    device: torch.device | None = None,
) -> list[str]:
    """Train every model of the zoo that is not complete yet; returns the ids trained.

    A model directory is complete once its ``meta.json`` exists; it is built in a
    temporary sibling directory and moved into place with ``os.replace``."""
    from ..progress import Progress

    check_preset(preset, out)
    root = _zoo_dir(out, preset) / "models"
    root.mkdir(parents=True, exist_ok=True)
    if gd.rank_and_world()[0] == 0:
        write_json_atomic(_zoo_dir(out, preset) / "preset.json", asdict(preset))
    trained = []
    hps = _my_share(
        [hp for hp in sample_hyperparameters(preset) if not _model_complete(root / hp["id"])]
    )
    bar = Progress(hps, desc=f"train {preset.zoo}", unit="model", enabled=progress)
    for hp in bar:
        final = root / hp["id"]
        start = time.time()
        model, metrics = train_one(hp, preset.zoo, preset.n_test, device=device)
        tmp = root / f".{hp['id']}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        _save_model(model, tmp)
        meta = dict(id=hp["id"], zoo=preset.zoo, hyperparameters=hp, **metrics)
        meta["train_seconds"] = time.time() - start
        write_json_atomic(tmp / "meta.json", meta)
        if final.exists():  # an incomplete leftover (no meta.json)
            shutil.rmtree(final)
        os.replace(tmp, final)
        trained.append(hp["id"])
        if on_model_done is not None:
            on_model_done(hp["id"])
    return trained


# --------------------------------------------------------------------------- measure


def measurement_batches(preset: ZooPreset, hp: dict) -> list:
    """The fixed training points (the first ``n_points`` of the pool, a prefix of every
    model's training set), with the labels that model was trained on, in batches."""
    bs = preset.measure_batch
    if preset.zoo == "vision":
        x, y = vision_train_set(hp)
        x, y = x[: preset.n_points], y[: preset.n_points]
        return [(x[s : s + bs], y[s : s + bs]) for s in range(0, len(y), bs)]
    ids, mask, y = text_train_set(hp)
    n = min(preset.n_points, len(y))
    return [_text_batch(ids[s : s + bs], mask[s : s + bs], y[s : s + bs]) for s in range(0, n, bs)]


def measure_zoo(
    preset: ZooPreset,
    out: str | Path,
    progress: bool = True,
    on_model_done: Callable[[str], None] | None = None,
    device: torch.device | None = None,
) -> list[str]:
    """Measure every trained model at every (measure, radius) of the preset.

    ``measures/<id>.json`` is rewritten atomically after each (measure, radius), so a
    killed run loses at most one of them, and is marked ``complete`` at the end."""
    from ..progress import Progress

    zdir = _zoo_dir(out, preset)
    mdir = zdir / "measures"
    mdir.mkdir(parents=True, exist_ok=True)
    done_ids = []
    hps = _my_share(
        [
            hp
            for hp in sample_hyperparameters(preset)
            if _model_complete(zdir / "models" / hp["id"])
            and not read_json(mdir / f"{hp['id']}.json").get("complete")
        ]
    )
    bar = Progress(hps, desc=f"measure {preset.zoo}", unit="model", enabled=progress)
    for hp in bar:
        path = mdir / f"{hp['id']}.json"
        record = read_json(path)
        record.setdefault("id", hp["id"])
        record.setdefault("n_points", preset.n_points)
        record.setdefault("batch_size", preset.measure_batch)
        record.setdefault("n_iters", preset.n_iters)
        model = load_zoo_model(zdir / "models" / hp["id"], preset.zoo).to(device or "cpu")
        batches = [move_batch(b, device) for b in measurement_batches(preset, hp)]
        perturbed = None
        if preset.frozen_in_measure:
            frozen = set(preset.frozen_in_measure)
            perturbed = [n for n, _ in model.named_parameters() if n not in frozen]
            record.setdefault("unperturbed_parameters", sorted(frozen))
        grid = {name: preset.rho_grid(name) for name in preset.measures}
        measure_grid(
            record,
            path,
            model,
            batches,
            loss_fn_for(preset.zoo),
            grid,
            n_iters=preset.n_iters,
            seed=preset.seed,
            parameters=perturbed,
        )
        done_ids.append(hp["id"])
        if on_model_done is not None:
            on_model_done(hp["id"])
    return done_ids


def measure_grid(
    record: dict,
    path: Path,
    model,
    batches,
    loss_fn,
    grid: dict[str, Sequence[float]],
    n_iters: int,
    seed: int,
    **sharpness_kwargs,
) -> dict:
    """Fill ``record["measures"][measure][repr(rho)]`` (value, per-batch values, loss,
    per-batch losses) for every ``(measure, rho)`` of ``grid`` not in it yet, rewriting
    ``path`` atomically after each; then mark the record ``complete``."""
    from ..measures import sharpness

    results = record.setdefault("measures", {})
    for name, radii in grid.items():
        per_rho = results.setdefault(name, {})
        for rho in radii:
            if repr(rho) in per_rho:
                continue
            res = sharpness(
                model,
                batches,
                loss_fn,
                measure=name,
                rho=rho,
                n_iters=n_iters,
                seed=seed,
                **sharpness_kwargs,
            )
            per_rho[repr(rho)] = dict(
                value=res.value,
                per_batch=list(res.per_batch),
                loss=res.loss,
                per_batch_loss=list(res.per_batch_loss),
            )
            write_json_atomic(path, record)
    record["complete"] = True
    write_json_atomic(path, record)
    return record


# --------------------------------------------------------------------------- report


def _load_zoo(preset: ZooPreset, out: str | Path) -> tuple[list[dict], list[dict]]:
    zdir = _zoo_dir(out, preset)
    metas, records = [], []
    for hp in sample_hyperparameters(preset):
        mpath = zdir / "models" / hp["id"] / "meta.json"
        rpath = zdir / "measures" / f"{hp['id']}.json"
        if not mpath.exists() or not rpath.exists():
            continue
        rec = json.loads(rpath.read_text())
        if not rec.get("complete"):
            continue
        metas.append(json.loads(mpath.read_text()))
        records.append(rec)
    return metas, records


def _values(records: list[dict], name: str, rho_key: str) -> np.ndarray:
    return np.array([r["measures"][name][rho_key]["value"] for r in records], dtype=float)


def _tau_ci(x: np.ndarray, y: np.ndarray, n_boot: int, seed: int) -> dict:
    from .stats import kendall_tau, kendall_tau_with_ci

    if len(x) < 2 or not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        nan = float("nan")
        return dict(tau=nan, low=nan, high=nan)
    ci = kendall_tau_with_ci(x, y, n_boot=n_boot, seed=seed)
    return dict(tau=kendall_tau(x, y, variant="b"), low=ci.low, high=ci.high)


def within_levels(
    values: np.ndarray, gap: np.ndarray, levels: Sequence, n_boot: int, seed: int
) -> dict:
    """Kendall tau (with bootstrap interval) within each level of a confounder (e.g. the
    label noise, which alone moves the error gap of noisy-label models below zero), and
    their mean weighted by the number of pairs in each level."""
    out, weights, taus = {}, [], []
    levels = np.asarray([str(v) for v in levels])
    for level in sorted(set(levels.tolist()), key=float):
        at = levels == level
        entry = _tau_ci(values[at], gap[at], n_boot, seed) if at.sum() >= 3 else None
        if entry is None:
            continue
        entry["n"] = int(at.sum())
        out[level] = entry
        if np.isfinite(entry["tau"]):
            taus.append(entry["tau"])
            weights.append(at.sum() * (at.sum() - 1) / 2)
    mean = float(np.average(taus, weights=weights)) if taus else float("nan")
    return dict(levels=out, mean=mean)


def analyse(
    preset: ZooPreset, metas: list[dict], records: list[dict], target: float | None = None
) -> dict:
    """Every statistic of the report (a JSON-able dict)."""
    gaps = {
        "error": np.array([m["error_gap"] for m in metas]),
        "loss": np.array([m["loss_gap"] for m in metas]),
    }
    hps = [m["hyperparameters"] for m in metas]
    axes = [a for a in preset.axes if len({str(h[a]) for h in hps}) > 1]
    grid: dict = {}
    for name in preset.measures:
        grid[name] = {}
        for rho in preset.rho_grid(name):
            key = repr(rho)
            vals = _values(records, name, key)
            entry = dict(rho=rho, median_increase=float(np.median(vals)))
            for gname, gap in gaps.items():
                entry[f"tau_{gname}"] = _tau_ci(vals, gap, preset.n_boot, preset.seed)
            entry["granulated_error"] = granulated_tau(vals, gaps["error"], hps, axes)
            grid[name][key] = entry
    # best radius: largest |tau| with the error gap on the grid (the sign is reported)
    best = {}
    for name, entries in grid.items():
        finite = [e for e in entries.values() if np.isfinite(e["tau_error"]["tau"])]
        if finite:
            best[name] = max(finite, key=lambda e: abs(e["tau_error"]["tau"]))
    # calibration: a common target median loss increase; per measure the grid radius
    # whose median increase is closest to it in log scale
    if target is None:
        mids = [
            list(entries.values())[len(entries) // 2]["median_increase"]
            for entries in grid.values()
        ]
        mids = [m for m in mids if m > 0]
        target = float(np.median(mids)) if mids else 0.0
    calibrated = {}
    for name, entries in grid.items():

        def dist(e):
            m = e["median_increase"]
            if m <= 0 or target <= 0:
                return abs(m - target)
            return abs(np.log(m) - np.log(target))

        calibrated[name] = min(entries.values(), key=dist)
    stratified = {}
    if "label_noise" in axes:
        for sel, chosen in (("best", best), ("calibrated", calibrated)):
            stratified[sel] = {
                name: within_levels(
                    _values(records, name, repr(e["rho"])),
                    gaps["error"],
                    [h["label_noise"] for h in hps],
                    preset.n_boot,
                    preset.seed,
                )
                for name, e in chosen.items()
            }
    return dict(
        zoo=preset.zoo,
        n_models=len(metas),
        axes=axes,
        target_median_increase=target,
        grid=grid,
        best=best,
        calibrated=calibrated,
        within_label_noise=stratified,
        models=[
            dict(
                id=m["id"],
                **{k: m[k] for k in ("train_error", "test_error", "error_gap", "loss_gap")},
            )
            for m in metas
        ],
    )


def _fmt(t: dict) -> str:
    if not np.isfinite(t["tau"]):
        return "n/a"
    return f"{t['tau']:+.2f} [{t['low']:+.2f}, {t['high']:+.2f}]"


def format_report(summary: dict, figures: Sequence[str] = ()) -> str:
    zoo = summary["zoo"]
    setting = (
        "Fashion-MNIST, tiny ViTs from scratch"
        if zoo == "vision"
        else "Rotten Tomatoes, MiniLM fine-tunes"
    )
    lines = [
        f"# Sharpness vs generalization: {zoo} zoo",
        "",
        f"{summary['n_models']} models; hyperparameter axes varied: {', '.join(summary['axes'])}.",
        "Kendall tau (tau-b) between each measure and the generalization gap, with 95% "
        "percentile bootstrap intervals over models.",
        "",
        "## The paper's table next to ours",
        "",
        "| setting | adaptive | geodesic, inv | geodesic, mix |",
        "|---|---|---|---|",
    ]
    for row in PAPER_TABLE:
        lines.append(f"| {row[0]} (paper) | {row[1]:+.2f} | {row[2]:+.2f} | {row[3]:+.2f} |")
    for label, sel in (("best radius", "best"), ("calibrated radius", "calibrated")):
        cells = [
            _fmt(summary[sel][m]["tau_error"]) if m in summary[sel] else "n/a"
            for m in MAIN_MEASURES
        ]
        lines.append(
            f"| {setting}, {summary['n_models']} models, {label} (ours) | "
            + " | ".join(cells)
            + " |"
        )
    lines += [
        "",
        f"Calibrated radii: each measure at the grid radius whose median loss increase "
        f"over the zoo is closest (log scale) to {summary['target_median_increase']:.4g}.",
        "",
        "## All measures",
        "",
        "| measure | best rho | tau (error gap) | tau (loss gap) | granulated tau | "
        "calibrated rho | tau at calibrated rho |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, e in summary["best"].items():
        c = summary["calibrated"][name]
        gran = e["granulated_error"]["granulated"]
        lines.append(
            f"| {name} | {e['rho']:.4g} | {_fmt(e['tau_error'])} | {_fmt(e['tau_loss'])} | "
            f"{gran:+.2f} | {c['rho']:.4g} | {_fmt(c['tau_error'])} |"
        )
    lines += [
        "",
        "## The whole grid",
        "",
        "| measure | rho | median loss increase | tau (error gap) | tau (loss gap) "
        "| granulated tau |",
        "|---|---|---|---|---|---|",
    ]
    for name, entries in summary["grid"].items():
        for e in entries.values():
            lines.append(
                f"| {name} | {e['rho']:.4g} | {e['median_increase']:.4g} | {_fmt(e['tau_error'])} "
                f"| {_fmt(e['tau_loss'])} | {e['granulated_error']['granulated']:+.2f} |"
            )
    strat = summary.get("within_label_noise") or {}
    if strat:
        levels = sorted({lv for d in strat["best"].values() for lv in d["levels"]}, key=float)
        lines += [
            "",
            "## Within each label-noise level",
            "",
            "Training labels with noise `q` make the training error (measured on those "
            "labels) large, so noise alone moves a model's error gap down; Kendall tau "
            "within each noise level removes that confounder (mean weighted by pairs).",
            "",
            "| measure | radius | "
            + " | ".join(f"noise {float(lv):g}" for lv in levels)
            + " | weighted mean |",
            "|---|---|" + "---|" * (len(levels) + 1),
        ]
        for sel in ("best", "calibrated"):
            for name in MAIN_MEASURES:
                if name not in strat[sel]:
                    continue
                d = strat[sel][name]
                cells = [
                    f"{_fmt(d['levels'][lv])} (n={d['levels'][lv]['n']})"
                    if lv in d["levels"]
                    else "n/a"
                    for lv in levels
                ]
                rho = summary[sel][name]["rho"]
                row = f"| {name} | {sel} ({rho:.4g}) | " + " | ".join(cells)
                mean = f"{d['mean']:+.2f}" if np.isfinite(d["mean"]) else "n/a"
                lines.append(row + f" | {mean} |")
    lines += [
        "",
        "Granulated tau: per hyperparameter axis, the mean of sign(d measure) sign(d gap) over "
        "the pairs of models that differ in that axis and in the fewest other axes; averaged "
        "over axes (see `geosharp.studies.stats.granulated_tau`).",
        "",
    ]
    if figures:
        lines += ["## Figures", ""] + [f"![{Path(f).stem}]({Path(f).name})" for f in figures] + [""]
    return "\n".join(lines)


def write_scatter(
    summary: dict, records: list[dict], metas: list[dict], path: Path, sel: str
) -> Path:
    """Measure vs error gap for adaptive, geodesic inv and mix (paper's Figures 4, 5);
    points coloured by the models' label noise."""
    require_matplotlib()
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    gap = np.array([m["error_gap"] for m in metas])
    noise = np.array([float(m["hyperparameters"].get("label_noise", 0.0)) for m in metas])
    levels = sorted(set(noise.tolist()))
    colours = plt.get_cmap("viridis")(np.linspace(0.0, 0.85, max(len(levels), 1)))
    fig, axs = plt.subplots(1, len(MAIN_MEASURES), figsize=(4 * len(MAIN_MEASURES), 3.4))
    for ax, name in zip(np.atleast_1d(axs), MAIN_MEASURES, strict=False):
        if name not in summary[sel]:
            ax.set_visible(False)
            continue
        e = summary[sel][name]
        vals = _values(records, name, repr(e["rho"]))
        for level, colour in zip(levels, colours, strict=True):
            at = noise == level
            ax.scatter(vals[at], gap[at], s=14, color=colour, label=f"label noise {level:g}")
        ax.set_xlabel(f"{name} (rho={e['rho']:.3g})")
        ax.set_ylabel("test - train error")
        tau = e["tau_error"]["tau"]
        ax.set_title(f"tau = {tau:+.2f}" if np.isfinite(tau) else "tau = n/a")
        if np.all(vals > 0) and vals.max() > 10 * vals.min():
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.tick_params(axis="x", labelrotation=30)
    if len(levels) > 1:
        np.atleast_1d(axs)[0].legend(fontsize=7, loc="best")
    fig.suptitle(f"{summary['zoo']} zoo, {sel} radius")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def report_zoo(preset: ZooPreset, out: str | Path, target: float | None = None) -> dict:
    """Write ``report/report.md``, ``report/summary.json``, ``report/models.csv`` (one row
    per model) and the scatter PNGs."""
    metas, records = _load_zoo(preset, out)
    if len(metas) < 2:
        raise UsageError(
            f"the report needs at least 2 trained and measured models in "
            f"{_zoo_dir(out, preset)}, found {len(metas)}: run train and measure first"
        )
    summary = analyse(preset, metas, records, target=target)
    rdir = _zoo_dir(out, preset) / "report"
    figures = [
        write_scatter(summary, records, metas, rdir / f"{preset.zoo}_scatter_{sel}.png", sel)
        for sel in ("best", "calibrated")
    ]
    write_json_atomic(rdir / "summary.json", summary)
    write_text_atomic(rdir / "models.csv", models_table(preset, metas, records))
    write_text_atomic(rdir / "report.md", format_report(summary, [str(f) for f in figures]))
    return summary


def models_table(preset: ZooPreset, metas: list[dict], records: list[dict]) -> str:
    """One CSV row per model: id, hyperparameters, train/test error and loss, gaps, and
    the sharpness of every measure at every radius (column ``<measure>@<rho>``)."""
    import csv
    import io

    axes = list(preset.axes) + [k for k in preset.fixed if k not in preset.axes]
    metrics = ["train_error", "test_error", "train_loss", "test_loss", "error_gap", "loss_gap"]
    columns = [(name, repr(rho)) for name in preset.measures for rho in preset.rho_grid(name)]
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["id", *axes, *metrics, *(f"{m}@{r}" for m, r in columns)])
    for meta, record in zip(metas, records, strict=True):
        hp = meta["hyperparameters"]
        row = [meta["id"], *(hp.get(a) for a in axes), *(meta[k] for k in metrics)]
        row += [record["measures"][m][r]["value"] for m, r in columns]
        writer.writerow(row)
    return buffer.getvalue()


# --------------------------------------------------------------------------- CLI


DESCRIPTION = (
    "Model zoos (vision: ViTs on Fashion-MNIST, text: MiniLM on Rotten Tomatoes): train, "
    "measure and report; every step resumes where a killed run stopped."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The zoo's command-line options (``geosharp zoo --help``)."""
    from ..options import add_device, positive_float, positive_int

    p.add_argument("action", choices=("train", "measure", "report", "all"))
    p.add_argument("--zoo", choices=ZOOS, default="vision", help="vision or text (vision)")
    p.add_argument(
        "--preset",
        choices=sorted({name for _, name in PRESETS}),
        default="smoke",
        help="smoke, full, or seeds (text only: the seed population); (smoke)",
    )
    p.add_argument("--out", default="runs/zoo", help="results directory (runs/zoo)")
    p.add_argument("--n-models", type=positive_int, help="override the preset's number of models")
    p.add_argument("--target", type=positive_float, help="calibration target median loss increase")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads (1)")
    add_device(p)
    p.add_argument("--no-progress", action="store_true", help="no progress reports")


def _parser() -> argparse.ArgumentParser:
    from ..options import Parser

    p = Parser(prog="geosharp zoo", description=DESCRIPTION)
    add_arguments(p)
    return p


def check_preset(preset: ZooPreset, out: str | Path) -> None:
    """An error if ``out`` holds a zoo made with another preset (mixing populations):
    every setting must match the stored ``preset.json`` but ``n_models`` (adding models
    never changes the earlier ones)."""
    stored = read_json(_zoo_dir(out, preset) / "preset.json")
    if not stored:
        return
    current = json.loads(json.dumps(asdict(preset)))

    def describe(key: str) -> str:
        a, b = stored.get(key), current.get(key)
        scalar = not isinstance(a, (dict, list)) and not isinstance(b, (dict, list))
        return f"{key} ({a!r} there, {b!r} now)" if scalar else key

    diff = [
        describe(key)
        for key in sorted(set(stored) | set(current))
        if key != "n_models" and stored.get(key) != current.get(key)
    ]
    if diff:
        raise UsageError(
            f"{_zoo_dir(out, preset)} holds a zoo made with other settings, which differ in "
            f"{', '.join(diff)}: "
            "use another --out, or the --zoo/--preset it was made with"
        )


def main(argv: Sequence[str] | None = None) -> int:
    return run(_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run the zoo action for parsed options; settings are checked before any work."""
    import dataclasses

    from ..options import check_device

    preset = get_preset(args.zoo, args.preset)
    if args.n_models is not None:
        preset = dataclasses.replace(preset, n_models=args.n_models)
    device = check_device(args.device)
    check_preset(preset, args.out)
    if args.action in ("report", "all"):
        require_matplotlib()  # the report's figures; before hours of training
    torch.set_num_threads(max(1, args.threads))
    rank, world = gd.init()  # under torchrun every rank takes its share of the models
    who = f"[rank {rank}/{world}] " if world > 1 else ""
    progress = not args.no_progress and rank == 0
    if args.action in ("train", "all"):
        ids = train_zoo(preset, args.out, progress=progress, device=device)
        print(f"{who}trained {len(ids)} model(s) in {Path(args.out) / preset.zoo / 'models'}")
        gd.barrier()
    if args.action in ("measure", "all"):
        ids = measure_zoo(preset, args.out, progress=progress, device=device)
        print(f"{who}measured {len(ids)} model(s) in {Path(args.out) / preset.zoo / 'measures'}")
        gd.barrier()
    if args.action in ("report", "all") and rank == 0:
        summary = report_zoo(preset, args.out, target=args.target)
        path = Path(args.out) / preset.zoo / "report" / "report.md"
        print(f"report of {summary['n_models']} models: {path}")
    return 0
