"""How the text populations' records in ``<preset>/run/`` were produced (not part of
the package). Run from the repository root under ``torchrun`` (one thread per rank):

    OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 studies/results/study/driver.py seeds
    OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 studies/results/study/driver.py seeds --phase2
    OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 studies/results/study/driver.py hparams

It does what ``geosharp zoo all --zoo text --preset <preset> --out runs/<preset>`` does,
in an order that survives the loss of the machine (weights are not committed):

* phase 1, the main grid, ``world_size`` models at a time: train them, measure them,
  then the next ones, so a lost machine loses only the models in flight;
* phase 2, the secondary pass (the full preset; what is measured may grow), after
  retraining any model whose weights are gone.

After every step rank 0 mirrors the small records (``preset.json``, each model's
``meta.json``, ``measures/*.json``) from ``runs/<preset>/text`` into
``studies/results/study/<preset>/run/text``, and at start restores the missing ones from
there. ``geosharp zoo report --zoo text --preset <preset> --out
studies/results/study/<preset>/run`` reads the records alone."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

from geosharp import distributed as gd
from geosharp.io import write_text_atomic
from geosharp_studies.zoo.measure import measure_zoo
from geosharp_studies.zoo.presets import get_preset
from geosharp_studies.zoo.store import missing
from geosharp_studies.zoo.train import train_zoo

NAME = next((a for a in sys.argv[1:] if not a.startswith("-")), "seeds")
OUT = Path("runs") / NAME
MIRROR = Path("studies/results/study") / NAME / "run"
FULL = get_preset("text", NAME)
MAIN_ONLY = dataclasses.replace(FULL, secondary={}, average_case=(), traces=())


def copy_atomic(src: Path, dst: Path) -> None:
    write_text_atomic(dst, src.read_text())


def main_grid_done(record: dict) -> bool:
    return "baselines" in record and not missing(record, MAIN_ONLY.passes()[0])


def restore(phase: int) -> None:
    """Copy the mirrored records back; a ``meta.json`` only where the model's weights
    are not needed again (phase 1, main grid measured), so the rest are retrained."""
    for src in (MIRROR / "text").rglob("*.json"):
        rel = src.relative_to(MIRROR)
        dst = OUT / rel
        if dst.exists():
            continue
        if rel.parts[1] == "models":
            record_path = MIRROR / "text" / "measures" / f"{rel.parts[2]}.json"
            record = json.loads(record_path.read_text()) if record_path.exists() else {}
            if phase == 2 or not main_grid_done(record):
                continue
        copy_atomic(src, dst)


def mirror() -> None:
    zdir = OUT / "text"
    files = [zdir / "preset.json", *zdir.glob("models/*/meta.json"), *zdir.glob("measures/*.json")]
    for src in files:
        if src.exists():
            copy_atomic(src, MIRROR / src.relative_to(OUT))


def main() -> None:
    torch.set_num_threads(1)
    rank, world = gd.init()
    lead = rank == 0
    phase = 2 if "--phase2" in sys.argv else 1
    if lead:
        restore(phase)
    gd.barrier()

    def step(preset) -> None:
        train_zoo(preset, OUT, progress=False)
        gd.barrier()
        if lead:
            mirror()
        measure_zoo(preset, OUT, progress=False, on_model_done=lambda _: lead and mirror())
        gd.barrier()
        if lead:
            mirror()

    if phase == 1:
        sizes = [*range(world, FULL.n_models, world), FULL.n_models]
        for n in sizes:
            step(dataclasses.replace(MAIN_ONLY, n_models=n))
            if lead:
                print(f"main grid through {n} models", flush=True)
    else:
        step(FULL)
        if lead:
            print("secondary pass complete", flush=True)


if __name__ == "__main__":
    main()
