"""What ``low_memory=True`` costs: the forward+backward passes it adds by recomputing
the best point's gradient at a restart that goes back to a best point other than the
current one (the default keeps that gradient, one parameter-sized vector more).

    python benchmarks/low_memory_cost.py [--json out.json]

The demo's tiny ViT trained on scikit-learn digits (seeds 0 and 1, 40 epochs), 4 batches
of 256 images; adaptive, geodesic-inv and geodesic-mix at 1x and 4x their default
radius, worst case with 20 and 100 Auto-PGD iterations. Per run: the forward+backward
passes of the default, ``batches x (n_iters + 1)``, and the extra ones of
``low_memory=True`` (counted through the callback), with the restarts.
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    import warnings

    import torch

    from geosharp import WorstCase, sharpness
    from geosharp.demo import (
        image_batches,
        image_loss,
        load_digits,
        tiny_vit,
        train_image_classifier,
    )
    from geosharp.measures.catalog import DEFAULT_RHO

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(2)
    data = load_digits()
    rows = []
    for seed in (0, 1):
        train, _ = data.split(1500, seed=seed)
        model = tiny_vit(seed=seed)
        train_image_classifier(model, train.images, train.labels, epochs=40, seed=seed)
        batches = list(image_batches(train.images[:1024], train.labels[:1024], 256))
        for measure in ("adaptive", "geodesic-inv", "geodesic-mix"):
            for scale in (1.0, 4.0):
                for n_iters in (20, 100):
                    evaluations = [0]

                    def count(event, i, iterate, evaluations=evaluations):
                        evaluations[0] += event == "evaluate"

                    result = sharpness(
                        model, batches, image_loss, measure=measure,
                        rho=scale * DEFAULT_RHO[measure], estimator=WorstCase(n_iters=n_iters),
                        seed=seed, callback=count, low_memory=True,
                    )  # fmt: skip
                    default = len(batches) * (n_iters + 1)
                    row = dict(seed=seed, measure=measure, rho_scale=scale, n_iters=n_iters)
                    row |= dict(default=default, extra=evaluations[0] - default)
                    row["restarts"] = sum(len(t.restarts) for t in result.traces)
                    rows.append(row)
                    print(
                        f"seed {seed} {measure:<13} {scale:g}x rho, {n_iters:>3} iterations: "
                        f"{row['extra']:>2} extra forward+backward of {default} "
                        f"({row['extra'] / default:.0%}), {row['restarts']} restarts",
                        flush=True,
                    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
