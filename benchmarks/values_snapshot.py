"""The measures' values on the test zoo, as JSON: run it with two versions of the core
and compare, to check that a change of the core keeps every measured value.

    python benchmarks/values_snapshot.py new.json
    PYTHONPATH=/path/to/old/checkout/src python benchmarks/values_snapshot.py old.json

``docs/results/values_snapshot.json`` holds the values of the last check (torch 2.13.0,
transformers 5.24.0, CPU, one thread; other versions move values in their last digits):
the redesign of ``sharpness()`` (estimators owning their per-batch
estimate, ``geosharp.measures.problem``) left all 312 bit for bit as they were; so did
the gradient written over its point and the half-precision weights read in place
(issue 35). Random draws made per block (:mod:`geosharp.geometry.draws`, so that a
sharded process draws only its slices) changed the random numbers: the 96 average-case
values and the 26 of the 96 two-start values where the random start wins moved, the
other 190 stayed bit for bit. Regenerated again after the rest of issue 35's changes to
the step's arithmetic (the direction and the momentum combination written in place):
43 values had moved in their last digits (25 float64 ones by at most 2.6e-14 relative,
18 float32 ones by at most 8.4e-6), the other 269 bit for bit; keeping the best point as
the iterate itself (no copy) then changed none of the 312. The element-wise step done run
by run (its dot products summed per run of up to 2^20 entries, the scale applied as
``c kd`` and the point written in the same pass) moved 58 in their last digits (30
float64 ones by at most 2.8e-14 relative, 28 float32 ones by at most 9.4e-6); the other
254 stayed bit for bit. The pair states reading the base point's blocks where used, not
holding them, changed none; reading them in their weights' layout (the products then
take a transposed view) moved 28 geodesic values in their last digits (19 float64 ones
by at most 2.0e-13 absolute, 3.9e-12 relative; 9 float32 ones by at most 1.8e-7
absolute, one to three units in the last place of the loss); the other 284 stayed bit
for bit.

Covers the float64 and float32 zoo models (``tests/zoo.py``), eight geometries, two
radii, one and two Auto-PGD starts and the average case (288 values, about a minute),
and every attention layout of ``tests/zoo.ARCHITECTURES`` (GPT-2, LLaMA, CLIP, ...) in
float64 under the geodesic and adaptive measures (24 values more).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import geosharp
from zoo import ARCHITECTURES, CASES

SETTINGS = {
    "adaptive": ("adaptive", {}),
    "adaptive-linf": ("adaptive", dict(p=float("inf"))),
    "geodesic-inv": ("geodesic", dict(metric="inv")),
    "geodesic-mix": ("geodesic", dict(metric="mix")),
    "geodesic-norm-only-inv": ("geodesic-norm-only", dict(metric="inv")),
    "geodesic-curvature-only-mix": ("geodesic-curvature-only", dict(metric="mix")),
    "euclidean": ("euclidean", {}),
    "adaptive-exp": ("adaptive", dict(elementwise_step="exp")),
}

# the keys of earlier snapshots, which spelled the estimator in flat keywords
ESTIMATORS = {
    "[]": geosharp.WorstCase(n_iters=20),
    "[('starts', 2)]": geosharp.WorstCase(n_iters=20, starts=2),
    "[('kind', 'average'), ('n_samples', 3)]": geosharp.AverageCase(n_samples=3),
}


def main(path: str) -> None:
    torch.set_num_threads(1)
    out = {}
    for dtype in (torch.float64, torch.float32):
        for name, make in CASES.items():
            case = make(dtype=dtype)
            for measure, (geometry, kw) in SETTINGS.items():
                for rho in (0.01, 0.05):
                    for extra, estimator in ESTIMATORS.items():
                        value = geosharp.sharpness(
                            case.model, case.batches, case.loss_fn,
                            geosharp.Geometry.named(geometry, **kw), rho=rho, estimator=estimator,
                        ).value  # fmt: skip
                        out[f"{dtype}|{name}|{measure}|{rho}|{extra}"] = value
    for name, arch in ARCHITECTURES.items():
        case = arch.case()
        for measure in ("adaptive", "geodesic-inv", "geodesic-mix"):
            value = geosharp.sharpness(
                case.model,
                case.batches,
                case.loss_fn,
                measure,
                rho=0.05,
                estimator=geosharp.WorstCase(n_iters=10),
            ).value
            out[f"{torch.float64}|{name}|{measure}|0.05|architectures"] = value
    Path(path).write_text(json.dumps(out, indent=0))
    print(f"{len(out)} values in {path}")


if __name__ == "__main__":
    main(sys.argv[1])
