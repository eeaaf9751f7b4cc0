"""Training: every model of a zoo, each written atomically once complete."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from geosharp import distributed as gd
from geosharp.errors import UsageError
from geosharp.io import write_json_atomic
from geosharp.loading.data import move_batch

from .presets import ZooPreset, sample_hyperparameters
from .store import check_preset, model_complete, my_share, read_json, save_model, zoo_dir
from .tasks import Task, task_for

__all__ = ["prepare", "train_one", "train_zoo"]


def prepare(preset: ZooPreset, out: str | Path, device: torch.device | None = None) -> None:
    """Give the preset's task its pre-trained model, if it has one: trained once with
    ``preset.pretrain`` (plus the preset's fixed architecture) into
    ``<out>/<zoo>/pretrained/`` (atomically, rank 0 only), loaded from there after."""
    task = task_for(preset.zoo)
    if task.pretrain is None:
        return
    directory = zoo_dir(out, preset) / "pretrained"
    hp = {**preset.fixed, **preset.pretrain, "id": "pretrained"}
    if gd.rank_and_world()[0] == 0 and not model_complete(directory):
        start = time.time()
        model, metrics = train_one(hp, task.pretrain, preset.n_test, device=device)
        tmp = directory.with_name(".pretrained.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        save_model(model, tmp)
        meta = dict(id="pretrained", hyperparameters=hp, **metrics)
        meta["train_seconds"] = time.time() - start
        write_json_atomic(tmp / "meta.json", meta)
        shutil.rmtree(directory, ignore_errors=True)
        os.replace(tmp, directory)
    gd.barrier()
    stored = read_json(directory / "meta.json")["hyperparameters"]
    if stored != json.loads(json.dumps(hp)):
        raise UsageError(f"{directory} was pre-trained with other settings; use another --out")
    task.use_pretrained(task.pretrain.load_model(directory))


def train_one(hp: dict, zoo: str | Task, n_test: int, device: torch.device | None = None):
    """Train one model (on ``device``, CPU by default) with AdamW and a cosine schedule;
    returns ``(model, metrics)`` (errors, losses and gaps on the training and test sets).
    ``zoo``: the zoo's name or its task."""
    task = task_for(zoo) if isinstance(zoo, str) else zoo
    model = task.build_model(hp).to(device or "cpu")
    train_data, test_data = task.train_set(hp), task.test_set(hp, n_test)
    params = task.trainable(model, hp)
    chosen = {id(p) for p in params}
    for p in model.parameters():
        p.requires_grad_(id(p) in chosen)
    n, bs, epochs = len(train_data[-1]), int(hp["batch_size"]), int(hp["epochs"])
    optimizer = torch.optim.AdamW(
        params, lr=float(hp["lr"]), weight_decay=float(hp["weight_decay"])
    )
    steps = epochs * ((n + bs - 1) // bs)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, max(steps, 1))
    gen = torch.Generator().manual_seed(int(hp["seed"]))
    model.train()
    for _ in range(epochs):
        order = torch.randperm(n, generator=gen)
        for start in range(0, n, bs):
            batch = task.batch(train_data, order[start : start + bs], hp, gen)
            optimizer.zero_grad(set_to_none=True)
            task.train_loss(model, move_batch(batch, device), hp).backward()
            optimizer.step()
            schedule.step()
    for p in model.parameters():
        p.requires_grad_(True)
    model.eval()
    train_err, train_loss = task.evaluate(model, train_data, device=device)
    test_err, test_loss = task.evaluate(model, test_data, device=device)
    metrics = dict(
        train_error=train_err,
        train_loss=train_loss,
        test_error=test_err,
        test_loss=test_loss,
        error_gap=test_err - train_err,
        loss_gap=test_loss - train_loss,
        n_train_actual=n,
        n_test=len(test_data[-1]),
        data=task.source,
    )
    return model, metrics


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
    from geosharp.progress import Progress

    check_preset(preset, out)
    prepare(preset, out, device=device)
    root = zoo_dir(out, preset) / "models"
    root.mkdir(parents=True, exist_ok=True)
    if gd.rank_and_world()[0] == 0:
        write_json_atomic(zoo_dir(out, preset) / "preset.json", asdict(preset))
    trained = []
    hps = my_share(
        [hp for hp in sample_hyperparameters(preset) if not model_complete(root / hp["id"])]
    )
    bar = Progress(hps, desc=f"train {preset.zoo}", unit="model", enabled=progress)
    for hp in bar:
        final = root / hp["id"]
        start = time.time()
        model, metrics = train_one(hp, preset.zoo, preset.n_test, device=device)
        tmp = root / f".{hp['id']}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        save_model(model, tmp)
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
