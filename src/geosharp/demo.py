"""``geosharp demo``: the built-in default job, offline, about a minute on 2 CPU cores.

1. Train a tiny Hugging Face ViT (2 layers, 4 heads of 8) on scikit-learn's digits.
2. Measure Euclidean, adaptive and geodesic (``inv`` and ``mix``) worst-case sharpness
   on 1024 training points (4 batches of 256, averaged per batch as in the paper).
3. Re-parameterise the model by a random symmetry: every query/key and value/output
   pair ``(G, H) -> (G A, H A^{-T})`` with condition number ``cond``. The network
   computes the same function (the output change is printed).
4. Measure again and print which numbers moved.
"""

from __future__ import annotations

import copy
import time

import torch

from .data import load_digits
from .io import write_json_atomic
from .measures import DEFAULT_RHO, sharpness
from .models.vit import (
    accuracy_and_loss,
    image_batches,
    image_loss,
    tiny_vit,
    train_image_classifier,
)
from .symmetry import check_symmetries, find_symmetries, reparameterize

__all__ = ["DEMO_MEASURES", "run_demo"]

# (label, measure name): each at its default radius (DEFAULT_RHO); radii of different
# geometries mean different things (MATH.md section 2).
DEMO_MEASURES = (
    ("euclidean", "euclidean"),
    ("adaptive", "adaptive"),
    ("geodesic inv", "geodesic-inv"),
    ("geodesic mix", "geodesic-mix"),
)


def run_demo(
    seed: int = 0,
    n_iters: int = 20,
    cond: float = 100.0,
    json_path: str | None = None,
    epochs: int = 40,
    print_fn=print,
) -> int:
    start = time.perf_counter()
    data = load_digits()
    train, test = data.split(1500, seed=seed)
    print_fn(
        f"geosharp demo: tiny ViT on scikit-learn digits ({len(train.labels)} train, "
        f"{len(test.labels)} test), seed {seed}"
    )
    model = tiny_vit(seed=seed)
    train_image_classifier(
        model, train.images, train.labels, epochs=epochs, seed=seed, progress=True
    )
    train_acc, train_loss = accuracy_and_loss(model, train.images, train.labels)
    test_acc, test_loss = accuracy_and_loss(model, test.images, test.labels)
    print_fn(
        f"trained in {time.perf_counter() - start:.1f}s: train accuracy {train_acc:.3f}, "
        f"test accuracy {test_acc:.3f}"
    )

    symmetries = find_symmetries(model)
    n_pairs = sum(p.shape[0] for p in symmetries.pairs)
    probe = train.images[:64]
    check = check_symmetries(model, probe, symmetries)
    print_fn(
        f"found {n_pairs} GL(8) pairs in {len(symmetries.by_module())} attention modules; {check}"
    )

    twin = copy.deepcopy(model)
    reparameterize(twin, find_symmetries(twin), cond=cond, seed=seed + 1)
    with torch.no_grad():
        before = model(pixel_values=probe).logits
        after = twin(pixel_values=probe).logits
        output_change = float((after - before).abs().max())
        weight_change = max(
            float((a - b).abs().max() / b.abs().max())
            for a, b in zip(twin.parameters(), model.parameters())
        )
    print_fn(
        f"re-parameterised by random symmetries (condition number {cond:g}): weights "
        f"changed by up to {weight_change:.0%}, logits by {output_change:.1e}"
    )

    batches = list(image_batches(train.images[:1024], train.labels[:1024], 256))
    rows = []
    for label, name in DEMO_MEASURES:
        values, rho = [], DEFAULT_RHO[name]
        for net in (model, twin):
            result = sharpness(
                net,
                batches,
                image_loss,
                measure=name,
                rho=rho,
                n_iters=n_iters,
                seed=seed,
                progress=True,
            )
            values.append(result.value)
        change = abs(values[1] - values[0]) / max(abs(values[0]), 1e-12)
        rows.append(
            dict(
                measure=label,
                rho=rho,
                original=values[0],
                reparameterised=values[1],
                relative_change=change,
            )
        )

    print_fn("")
    print_fn(
        f"{'measure':<14} {'rho':>6} {'original':>10} {'re-param.':>10} {'change':>9}  invariant?"
    )
    for r in rows:
        verdict = "yes" if r["relative_change"] < 0.01 else "NO - moved by the symmetry"
        print_fn(
            f"{r['measure']:<14} {r['rho']:>6g} {r['original']:>10.4g} "
            f"{r['reparameterised']:>10.4g} {_percent(r['relative_change']):>9}  {verdict}"
        )
    print_fn("")
    print_fn(
        "Both networks compute the same function; only the geodesic measures, which live "
        "on the quotient\nby the attention symmetries, give them the same sharpness. "
        "Sharpness values of different\ngeometries are not comparable at one rho "
        "(see README, 'Choosing rho')."
    )
    print_fn(f"total time {time.perf_counter() - start:.1f}s")

    if json_path:
        payload = dict(
            seed=seed,
            n_iters=n_iters,
            cond=cond,
            train_accuracy=train_acc,
            test_accuracy=test_acc,
            train_loss=train_loss,
            test_loss=test_loss,
            symmetry_check=check.max_rel_change,
            output_change=output_change,
            measures=rows,
        )
        write_json_atomic(json_path, payload)
    return 0


def _percent(x: float) -> str:
    """A relative change as a percentage, in scientific notation below 0.01%."""
    return f"{x:.2%}" if x >= 1e-4 or x == 0 else f"{100 * x:.0e}%"
