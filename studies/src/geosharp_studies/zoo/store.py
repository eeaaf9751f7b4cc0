"""A zoo on disk: its directory layout, atomic model files, the shares of ``torchrun``
ranks, and the check that refuses to mix zoos made with other settings."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from geosharp import distributed as gd
from geosharp.errors import UsageError

from .presets import ZooPreset

__all__ = [
    "check_preset",
    "missing",
    "model_complete",
    "my_share",
    "read_json",
    "save_model",
    "zoo_dir",
]


def zoo_dir(out: str | Path, preset: ZooPreset) -> Path:
    return Path(out) / preset.zoo


def model_complete(model_dir: Path) -> bool:
    return (model_dir / "meta.json").exists()


def save_model(model, directory: Path) -> None:
    """``config.json`` + ``model.safetensors``, loadable with ``from_pretrained``.
    (``save_pretrained`` writes weights on rank 0 only once a process group exists.)"""
    from safetensors.torch import save_model as save_safetensors

    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(directory)
    save_safetensors(model.cpu(), str(directory / "model.safetensors"), metadata={"format": "pt"})


def missing(record: dict, grid: dict[str, Sequence[float]]) -> bool:
    """Whether ``record`` lacks any ``(key, rho)`` of ``grid``."""
    done = record.get("measures", {})
    return any(repr(rho) not in done.get(name, {}) for name, radii in grid.items() for rho in radii)


def read_json(path: Path) -> dict:
    """The JSON object in ``path``, ``{}`` when there is no file yet."""
    return json.loads(path.read_text()) if path.exists() else {}


def my_share(pending: list[dict]) -> list[dict]:
    """This process's share of the ``pending`` models: all of them in a plain run; under
    ``torchrun``, every ``world_size``-th one from ``rank``. Every rank lists ``pending``
    from the files before any rank starts writing (hence the barrier), so the shares
    are disjoint and cover everything; each model's files are written by one rank only,
    and are the same files a single process writes."""
    gd.barrier()
    return [pending[i] for i in gd.shard(len(pending))]


# what is measured may grow: a new measure never changes the values already stored
GROWS = ("measures", "rho_factors", "primary", "secondary", "average_case", "traces")


def _grown(old, new) -> bool:
    """Whether ``new`` keeps every entry of ``old`` (a list or a dict) unchanged."""
    if isinstance(old, dict) and isinstance(new, dict):
        return all(k in new and new[k] == v for k, v in old.items())
    if isinstance(old, list) and isinstance(new, list):
        return all(v in new for v in old)
    return False


def check_preset(preset: ZooPreset, out: str | Path) -> None:
    """An error if ``out`` holds a zoo made with another preset (mixing populations):
    every setting must match the stored ``preset.json`` but ``n_models`` (adding models
    never changes the earlier ones) and the lists of what is measured (``GROWS``), which
    may gain entries but not change or lose one."""
    stored = read_json(zoo_dir(out, preset) / "preset.json")
    if not stored:
        return
    current = json.loads(json.dumps(asdict(preset)))

    def describe(key: str) -> str:
        a, b = stored.get(key), current.get(key)
        scalar = not isinstance(a, (dict, list)) and not isinstance(b, (dict, list))
        return f"{key} ({a!r} there, {b!r} now)" if scalar else key

    defaults = {
        f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        for f in dataclasses.fields(ZooPreset)
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    }

    def same(key: str) -> bool:  # a setting added after the zoo was made: its default
        was = stored.get(key)
        if key not in stored and key in defaults:
            was = json.loads(json.dumps(defaults[key]))
        if key in GROWS:
            return _grown(was, current.get(key))
        return was == current.get(key)

    diff = [
        describe(key)
        for key in sorted(set(stored) | set(current))
        if key != "n_models" and not same(key)
    ]
    if diff:
        raise UsageError(
            f"{zoo_dir(out, preset)} holds a zoo made with other settings, which differ in "
            f"{', '.join(diff)}: "
            "use another --out, or the --zoo/--preset it was made with"
        )
