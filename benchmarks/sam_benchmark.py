"""AdamW vs SAM vs ASAM vs GeodesicSAM (inv, mix) on tiny ViTs, honestly reported.

Tiny ViTs (32 wide, 2 deep, 4 heads, patch 7) trained from scratch on a small
Fashion-MNIST training set with AdamW as the base optimizer, in one of two settings
(:data:`SETTINGS`): ``underfit`` (1,000 images, 30 epochs: training accuracy stays
below 0.9) and ``overfit`` (500 images, 100 epochs: every model fits its training set).
Every method runs over a small radius grid and several seeds; each method's radius is
chosen on a validation split (1,000 other training-pool images) by the mean validation
accuracy over seeds, and test accuracy (5,000 test images) is reported at that radius,
mean with a 95% t-interval over seeds, and paired by seed against AdamW. Each trained
model's final sharpness (:data:`FINAL_SHARPNESS`, on its whole training set) is
recorded too, where the run logged it, so that the table says whether the methods
reach flatter minima in any geometry. Time per step is relative to AdamW, measured
in the same process.

Resumable: one JSON line per (method, rho, seed) in ``OUT/runs.jsonl``; ``OUT/summary.md``
and ``OUT/summary.json`` are rewritten at the end.

    python benchmarks/sam_benchmark.py --setting underfit --out docs/results/sam --seeds 5
    python benchmarks/sam_benchmark.py --setting overfit --out docs/results/sam-overfit
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from geosharp.io import write_json_atomic, write_text_atomic
from geosharp.models.vit import tiny_vit
from geosharp.training.optim import GeodesicSAM
from geosharp_studies.zoo.tasks import VisionTask

OPTIMIZERS = {  # method -> GeodesicSAM measure (None: AdamW alone)
    "adamw": None,
    "sam": "euclidean",
    "asam": "adaptive",
    "geodesic-sam-inv": "geodesic-inv",
    "geodesic-sam-mix": "geodesic-mix",
}
SETTINGS = {  # name -> training-set size, epochs, radius grid of every method
    "underfit": dict(
        n_train=1000,
        epochs=30,
        grids={
            "adamw": [0.0],
            "sam": [0.005, 0.01, 0.02, 0.05],
            "asam": [0.05, 0.1, 0.2, 0.5],
            "geodesic-sam-inv": [0.02, 0.05, 0.1, 0.2],
            "geodesic-sam-mix": [0.002, 0.005, 0.01, 0.02],
        },
    ),
    "overfit": dict(
        n_train=500,
        epochs=100,
        grids={
            "adamw": [0.0],
            "sam": [0.01, 0.02, 0.05, 0.1],
            "asam": [0.1, 0.2, 0.5, 1.0],
            "geodesic-sam-inv": [0.05, 0.1, 0.2, 0.5],
            "geodesic-sam-mix": [0.005, 0.01, 0.02, 0.05],
        },
    ),
}
# Final sharpness of every trained model: (measure, multiple of its default radius);
# worst case, 10 Auto-PGD steps, on the model's whole training set in 2 batches.
FINAL_SHARPNESS = [(m, k) for m in ("adaptive", "geodesic-inv", "geodesic-mix") for k in (1, 4)]
T_975 = {2: 12.71, 3: 4.30, 4: 3.18, 5: 2.78, 6: 2.57, 7: 2.45, 8: 2.36, 9: 2.31, 10: 2.26}


def data(n_train: int, n_val: int, n_test: int):
    xtr, ytr, xte, yte, _ = VisionTask().pool()
    train = (xtr[:n_train], ytr[:n_train])
    val = (xtr[n_train : n_train + n_val], ytr[n_train : n_train + n_val])
    return train, val, (xte[:n_test], yte[:n_test])


@torch.no_grad()
def evaluate(model, x, y, batch: int = 1000) -> tuple[float, float]:
    """Accuracy and mean cross-entropy on ``(x, y)``, in eval mode."""
    model.eval()
    right, total = 0, 0.0
    for s in range(0, len(y), batch):
        logits = model(pixel_values=x[s : s + batch]).logits
        right += int((logits.argmax(-1) == y[s : s + batch]).sum())
        total += float(F.cross_entropy(logits, y[s : s + batch], reduction="sum"))
    return right / len(y), total / len(y)


def accuracy(model, x, y) -> float:
    return evaluate(model, x, y)[0]


def final_sharpness(model, x, y) -> dict:
    """``{"<measure>@<rho>": value}`` for :data:`FINAL_SHARPNESS` on ``(x, y)``."""
    from geosharp import sharpness
    from geosharp.measures import DEFAULT_RHO, WorstCase

    model.eval()
    half = (len(y) + 1) // 2
    batches = [(x[:half], y[:half]), (x[half:], y[half:])]

    def loss_fn(m, batch):
        return F.cross_entropy(m(pixel_values=batch[0]).logits, batch[1])

    out = {}
    for name, k in FINAL_SHARPNESS:
        rho = k * DEFAULT_RHO[name]
        res = sharpness(model, batches, loss_fn, measure=name, rho=rho, estimator=WorstCase(10))
        out[f"{name}@{rho:g}"] = res.value
    return out


def train(method: str, rho: float, seed: int, sets, args) -> dict:
    measure = OPTIMIZERS[method]
    model = tiny_vit(28, 1, 10, 7, hidden=32, layers=2, heads=4, mlp=64, seed=seed)
    (x, y), val, test = sets
    if measure is None:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wd)
    else:
        opt = GeodesicSAM(
            model, torch.optim.AdamW, rho=rho, measure=measure, lr=args.lr, weight_decay=args.wd
        )
    gen = torch.Generator().manual_seed(seed)
    steps, seconds = 0, 0.0
    for _ in range(args.epochs):
        order = torch.randperm(len(y), generator=gen)
        model.train()
        for s in range(0, len(y), args.batch_size):
            idx = order[s : s + args.batch_size]
            xb, yb = x[idx], y[idx]

            def closure(xb=xb, yb=yb):
                loss = F.cross_entropy(model(pixel_values=xb).logits, yb)
                loss.backward()
                return loss

            start = time.perf_counter()
            if measure is None:
                opt.zero_grad(set_to_none=True)
                closure()
                opt.step()
            else:
                opt.zero_grad(set_to_none=True)
                opt.step(closure)
            seconds += time.perf_counter() - start
            steps += 1
    train_acc, train_loss = evaluate(model, x, y)
    return dict(
        method=method,
        rho=rho,
        seed=seed,
        train_acc=train_acc,
        train_loss=train_loss,
        val_acc=accuracy(model, *val),
        test_acc=accuracy(model, *test),
        seconds_per_step=seconds / steps,
        sharpness=final_sharpness(model, x, y),
    )


def t_interval(values) -> tuple[float, float, float]:
    """Mean and its 95% t-interval."""
    v = np.asarray(values, dtype=float)
    half = T_975.get(len(v), 1.96) * v.std(ddof=1) / math.sqrt(len(v)) if len(v) > 1 else 0.0
    return float(v.mean()), float(v.mean() - half), float(v.mean() + half)


def summarise(rows: list[dict], seeds: list[int], grids: dict) -> dict:
    """Per method: the radius chosen on validation, test accuracy (t-interval), the
    paired difference from AdamW, training accuracy and loss, time per step, and the
    final sharpness (mean, and paired minus AdamW's) where every run logged it."""
    out = {}
    base_rows = {r["seed"]: r for r in rows if r["method"] == "adamw" and r["seed"] in seeds}
    base_time = np.mean([r["seconds_per_step"] for r in base_rows.values()])
    for method, grid in grids.items():
        by_rho = {
            rho: [
                r for r in rows if r["method"] == method and r["rho"] == rho and r["seed"] in seeds
            ]
            for rho in grid
        }
        if not all(len(v) == len(seeds) for v in by_rho.values()):
            continue
        rho = max(grid, key=lambda r: np.mean([x["val_acc"] for x in by_rho[r]]))
        chosen = by_rho[rho]
        test, lo, hi = t_interval([x["test_acc"] for x in chosen])
        diff, dlo, dhi = t_interval(
            [x["test_acc"] - base_rows[x["seed"]]["test_acc"] for x in chosen]
        )
        entry = dict(
            rho=rho,
            minus_adamw=diff,
            minus_adamw_ci=[dlo, dhi],
            val_acc={repr(r): float(np.mean([x["val_acc"] for x in v])) for r, v in by_rho.items()},
            test_acc=test,
            ci=[lo, hi],
            train_acc=float(np.mean([x["train_acc"] for x in chosen])),
            time_vs_adamw=float(np.mean([x["seconds_per_step"] for x in chosen]) / base_time),
            n_seeds=len(chosen),
        )
        if all("train_loss" in x for x in chosen):
            entry["train_loss"] = float(np.mean([x["train_loss"] for x in chosen]))
        if all("sharpness" in x and "sharpness" in base_rows[x["seed"]] for x in chosen):
            entry["sharpness"] = {}
            for key in chosen[0]["sharpness"]:
                mean, *_ = t_interval([x["sharpness"][key] for x in chosen])
                d, d_lo, d_hi = t_interval(
                    [x["sharpness"][key] - base_rows[x["seed"]]["sharpness"][key] for x in chosen]
                )
                entry["sharpness"][key] = dict(
                    mean=mean, minus_adamw=d, minus_adamw_ci=[d_lo, d_hi]
                )
        out[method] = entry
    return out


def markdown(summary: dict, args) -> str:
    lines = [
        f"# GeodesicSAM benchmark ({args.setting}): tiny ViTs on {args.n_train:,} "
        "Fashion-MNIST images",
        "",
        f"ViT 32x2 (4 heads, patch 7) from scratch, AdamW lr {args.lr}, weight decay "
        f"{args.wd}, {args.epochs} epochs, batch {args.batch_size}; each method's radius "
        "chosen by mean validation accuracy (1,000 held-out training-pool images); test "
        "accuracy on 5,000 test images, mean over seeds with a 95% t-interval. "
        "Produced by `benchmarks/sam_benchmark.py`.",
        "",
        "| method | radius | test accuracy | minus AdamW, paired by seed | train accuracy "
        "| time per step vs AdamW |",
        "|---|---|---|---|---|---|",
    ]
    for method, s in summary.items():
        lines.append(
            f"| {method} | {s['rho']:g} | {s['test_acc']:.4f} [{s['ci'][0]:.4f}, {s['ci'][1]:.4f}] "
            f"| {s['minus_adamw']:+.4f} [{s['minus_adamw_ci'][0]:+.4f}, "
            f"{s['minus_adamw_ci'][1]:+.4f}] | {s['train_acc']:.4f} | {s['time_vs_adamw']:.2f}x |"
        )
    with_sharpness = {m: s for m, s in summary.items() if "sharpness" in s}
    if with_sharpness:
        keys = list(next(iter(with_sharpness.values()))["sharpness"])
        lines += [
            "",
            "Final sharpness of the trained models at the chosen radius (worst case, 10 "
            "Auto-PGD steps, on each model's whole training set; measure@radius), mean "
            "over seeds and, in brackets, minus AdamW's paired by seed with a 95% "
            "t-interval; final training loss beside it:",
            "",
            "| method | train loss | " + " | ".join(keys) + " |",
            "|---|---|" + "---|" * len(keys),
        ]
        for method, s in with_sharpness.items():
            cells = [
                f"{v['mean']:.3g} ({v['minus_adamw']:+.2g} [{v['minus_adamw_ci'][0]:+.2g}, "
                f"{v['minus_adamw_ci'][1]:+.2g}])"
                for v in s["sharpness"].values()
            ]
            lines.append(
                f"| {method} | {s.get('train_loss', float('nan')):.3g} | "
                + " | ".join(cells)
                + " |"
            )
    return "\n".join(lines) + "\n"


def time_steps(sets, args, n_steps: int) -> dict:
    """Milliseconds per step of every method (its middle radius), side by side in one
    process on the same batches, interleaved in rounds so that load changes hit all
    methods alike; the median over rounds."""
    (x, y), *_ = sets
    methods = {}
    for method, grid in SETTINGS[args.setting]["grids"].items():
        measure = OPTIMIZERS[method]
        model = tiny_vit(28, 1, 10, 7, hidden=32, layers=2, heads=4, mlp=64, seed=0)
        if measure is None:
            opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        else:
            rho = grid[len(grid) // 2]
            opt = GeodesicSAM(model, torch.optim.AdamW, rho=rho, measure=measure, lr=args.lr)
        methods[method] = (model, opt, measure)
    xb, yb = x[: args.batch_size], y[: args.batch_size]
    times = {m: [] for m in methods}
    for _ in range(n_steps):
        for method, (model, opt, measure) in methods.items():

            def closure(model=model):
                loss = F.cross_entropy(model(pixel_values=xb).logits, yb)
                loss.backward()
                return loss

            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            if measure is None:
                closure()
                opt.step()
            else:
                opt.step(closure)
            times[method].append(time.perf_counter() - start)
    ms = {m: 1000 * float(np.median(t[1:])) for m, t in times.items()}
    return {m: dict(ms_per_step=v, vs_adamw=v / ms["adamw"]) for m, v in ms.items()}


FIGURE_SHARPNESS = "geodesic-inv@0.2"  # the final sharpness the figure plots


def figure(summary: dict, rows: list[dict], path: Path) -> None:
    """Test accuracy with its 95% interval, one point per method; beside it, where the
    runs logged final sharpness, test accuracy against :data:`FIGURE_SHARPNESS` for
    every run at its method's chosen radius."""
    from geosharp.cli.plots import require_matplotlib, save_png

    require_matplotlib()
    import matplotlib.pyplot as plt

    names = list(summary)
    means = [summary[n]["test_acc"] for n in names]
    errs = [
        [m - summary[n]["ci"][0] for n, m in zip(names, means)],
        [summary[n]["ci"][1] - m for n, m in zip(names, means)],
    ]
    chosen = [
        r
        for r in rows
        if r["method"] in summary
        and r["rho"] == summary[r["method"]]["rho"]
        and FIGURE_SHARPNESS in r.get("sharpness", {})
    ]
    fig, axes = plt.subplots(1, 2 if chosen else 1, figsize=(10 if chosen else 6, 3.4))
    ax = axes[0] if chosen else axes
    ax.errorbar(range(len(names)), means, yerr=errs, fmt="o", capsize=4, color="k")
    ax.set_xticks(range(len(names)), [f"{n}\nrho={summary[n]['rho']:g}" for n in names], fontsize=7)
    ax.set_ylim(
        min(s["ci"][0] for s in summary.values()) - 0.01,
        max(s["ci"][1] for s in summary.values()) + 0.01,
    )
    ax.set_ylabel("test accuracy")
    if chosen:
        ax = axes[1]
        for name in names:
            pts = [r for r in chosen if r["method"] == name]
            ax.scatter(
                [r["sharpness"][FIGURE_SHARPNESS] for r in pts],
                [r["test_acc"] for r in pts],
                label=name,
                s=18,
            )
        ax.set_xscale("log")
        ax.set_xlabel(f"final sharpness, {FIGURE_SHARPNESS}")
        ax.set_ylabel("test accuracy")
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setting", choices=sorted(SETTINGS), default="underfit")
    p.add_argument("--out", default=None, help="default: runs/sam-<setting>")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=None, help="default: the setting's")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--n-train", type=int, default=None, help="default: the setting's")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--time-steps", type=int, default=0, help="only time N steps of every method")
    args = p.parse_args()
    setting = SETTINGS[args.setting]
    args.epochs = args.epochs or setting["epochs"]
    args.n_train = args.n_train or setting["n_train"]
    out = Path(args.out or f"runs/sam-{args.setting}")
    torch.set_num_threads(args.threads)
    if args.time_steps:
        timing = time_steps(data(args.n_train, 1000, 5000), args, args.time_steps)
        out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out / "timing.json", dict(settings=vars(args), methods=timing))
        for m, t in timing.items():
            print(f"{m:<20} {t['ms_per_step']:7.2f} ms/step  {t['vs_adamw']:.2f}x AdamW")
        return
    out.mkdir(parents=True, exist_ok=True)
    log = out / "runs.jsonl"
    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    done = {(r["method"], r["rho"], r["seed"]) for r in rows}
    sets = data(args.n_train, 1000, 5000)
    seeds = list(range(args.seeds))
    for seed in seeds:
        for method, grid in setting["grids"].items():
            for rho in grid:
                if (method, rho, seed) in done:
                    continue
                row = train(method, rho, seed, sets, args)
                rows.append(row)
                with log.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)
    summary = summarise(rows, seeds, setting["grids"])
    write_json_atomic(out / "summary.json", dict(settings=vars(args), methods=summary))
    write_text_atomic(
        out / "summary.md", markdown(summary, args) + "\n![test accuracy](test_accuracy.png)\n"
    )
    figure(summary, rows, out / "test_accuracy.png")
    print(markdown(summary, args))


if __name__ == "__main__":
    main()
