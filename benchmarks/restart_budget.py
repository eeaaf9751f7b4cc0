"""What Auto-PGD's restart rule costs: geosharp evaluates a best point again when a
restart goes back to it (that evaluation is an iteration of the budget; no copy of its
gradient is kept), where the reference keeps the gradient (one parameter-sized vector
more) and steps from the best point at once (``auto_pgd(..., keep_best_gradient=True)``).

    python benchmarks/restart_budget.py [--json out.json]

The demo's tiny ViT trained on scikit-learn digits (seeds 0 and 1, 40 epochs), 4 batches
of 256 images; adaptive, geodesic-inv and geodesic-mix at 1x and 4x their default
radius, worst case with 10, 20 and 100 Auto-PGD iterations. Per run: both values, their
relative difference, the forward+backward passes of each (counted through the
callback) and the restarts.
"""

from __future__ import annotations

import argparse
import functools
import json
from unittest import mock


def main() -> None:
    import warnings

    import torch

    from geosharp import WorstCase, sharpness
    from geosharp.cli.demo import (
        image_batches,
        image_loss,
        load_digits,
        tiny_vit,
        train_image_classifier,
    )
    from geosharp.measures import apgd, estimators
    from geosharp.measures.catalog import DEFAULT_RHO

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(2)
    reference = functools.partial(apgd.auto_pgd, keep_best_gradient=True)
    data = load_digits()
    rows = []
    for seed in (0, 1):
        train, _ = data.split(1500, seed=seed)
        model = tiny_vit(seed=seed)
        train_image_classifier(model, train.images, train.labels, epochs=40, seed=seed)
        batches = list(image_batches(train.images[:1024], train.labels[:1024], 256))
        for measure in ("adaptive", "geodesic-inv", "geodesic-mix"):
            for scale in (1.0, 4.0):
                for n_iters in (10, 20, 100):
                    row = dict(seed=seed, measure=measure, rho_scale=scale, n_iters=n_iters)
                    for rule in ("revisit", "kept gradient"):
                        evaluations = [0]

                        def count(event, i, iterate, evaluations=evaluations):
                            evaluations[0] += event == "evaluate"

                        with mock.patch.object(
                            estimators,
                            "auto_pgd",
                            reference if rule != "revisit" else apgd.auto_pgd,
                        ):
                            result = sharpness(
                                model, batches, image_loss, measure=measure,
                                rho=scale * DEFAULT_RHO[measure],
                                estimator=WorstCase(n_iters=n_iters), seed=seed, callback=count,
                            )  # fmt: skip
                        row[rule] = dict(
                            value=result.value,
                            evaluations=evaluations[0],
                            restarts=sum(len(t.restarts) for t in result.traces),
                        )
                    new, ref = row["revisit"], row["kept gradient"]
                    row["relative_difference"] = new["value"] / ref["value"] - 1
                    rows.append(row)
                    print(
                        f"seed {seed} {measure:<13} {scale:g}x rho, {n_iters:>3} iterations: "
                        f"{new['value']:.7g} (revisit) vs {ref['value']:.7g} (kept gradient), "
                        f"{row['relative_difference']:+.1e}; forward+backward "
                        f"{new['evaluations']} vs {ref['evaluations']}, restarts "
                        f"{new['restarts']} vs {ref['restarts']}",
                        flush=True,
                    )
    worst = min(rows, key=lambda r: r["relative_difference"])
    best = max(rows, key=lambda r: r["relative_difference"])
    print(
        f"relative difference over {len(rows)} runs: {worst['relative_difference']:+.1e} to "
        f"{best['relative_difference']:+.1e}; forward+backward equal in "
        f"{sum(r['revisit']['evaluations'] == r['kept gradient']['evaluations'] for r in rows)}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
