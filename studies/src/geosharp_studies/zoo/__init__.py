"""Model zoos of small transformers: train, measure sharpness, report rank correlations.

Populations (see ``studies/docs/zoo.md`` for the protocols) are presets
(:mod:`~geosharp_studies.zoo.presets`) of two tasks (:mod:`~geosharp_studies.zoo.tasks`):

* ``vision``: tiny Hugging Face ViTs trained from scratch on Fashion-MNIST,
  hyperparameters sampled from axes (learning rate, weight decay, batch size,
  width/depth, training-set size, label noise, augmentation);
* ``text``: the local pre-trained MiniLM BERT (its first layers) with a mean-pooling
  classifier head, fine-tuned on Rotten Tomatoes: sampled axes (``full``), or one
  recipe and 40 seeds (``seeds``, the population of issue 10).

Layout under ``<out>/<zoo>/`` (:mod:`~geosharp_studies.zoo.store`)::

    preset.json             the settings the zoo was measured with (mixing is refused)
    models/<id>/            config.json + model.safetensors + meta.json (hyperparameters,
                            errors)
    measures/<id>.json      sharpness per measure and radius (value and per-batch values),
                            and the baselines when the preset asks for them
    report/                 report.md, summary.json, models.csv, scatter PNGs; for a
                            preset with a calibration target also endpoints.json, rows.json
                            and the tau-curve PNG

Every file is written atomically (temporary file, then ``os.replace``) and each step
skips what is already complete, so a killed run resumes where it stopped.
"""

from .cli import DESCRIPTION, add_arguments, main, run
from .measure import measure_grid, measure_zoo, measurement_batches, model_baselines
from .presets import (
    ALL_MEASURES,
    MAIN_MEASURES,
    PRESETS,
    SEED_RECIPE,
    ZOOS,
    ZooPreset,
    get_preset,
    sample_hyperparameters,
)
from .report import report_zoo, within_levels
from .store import check_preset, read_json
from .tasks import TASKS, MeanPoolClassifier, Task, task_for
from .train import train_one, train_zoo

__all__ = [
    "ALL_MEASURES",
    "DESCRIPTION",
    "MAIN_MEASURES",
    "PRESETS",
    "SEED_RECIPE",
    "TASKS",
    "ZOOS",
    "MeanPoolClassifier",
    "Task",
    "ZooPreset",
    "add_arguments",
    "check_preset",
    "get_preset",
    "main",
    "measure_grid",
    "measure_zoo",
    "measurement_batches",
    "model_baselines",
    "read_json",
    "report_zoo",
    "run",
    "sample_hyperparameters",
    "task_for",
    "train_one",
    "train_zoo",
    "within_levels",
]
