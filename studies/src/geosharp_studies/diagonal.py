r"""``geosharp study diagonal``: sharpness vs generalization for diagonal linear networks.

Reproduces the paper's first result (its section 6.1 and Figure 3): Kendall's tau
between worst-case sharpness and the generalization gap of 50 diagonal linear networks
``f(x) = <u * v, x>`` trained on a sparse regression task.

Set-up (every choice, MATH.md section 7; the paper gives ``d = 200``, 90% zeros, 50
networks trained to a training loss of ``1e-5``; the rest follows the diagonal-network
set-up of the same research group, Andriushchenko et al. 2023 / Pesme et al. 2021):

* data: ``n = 80`` training points, ``d = 200``, ``x ~ N(0, I)``; ground truth ``beta*``
  with ``k = 20`` non-zero entries (90% zeros) at random positions, values ``N(0, 1)``;
  noiseless labels ``y = <beta*, x>``;
* model and initialisation: ``beta = u * v`` with ``u0 = alpha * 1``, ``v0 = 0``. (The
  other common choice, ``u0 = v0 = alpha``, keeps ``u = v`` under gradient flow, since
  ``u^2 - v^2`` is conserved, so ``beta = u^2 >= 0`` could not fit the negative entries
  of ``beta*``. With ``v0 = 0`` the conserved ``u^2 - v^2 = alpha^2`` makes this the
  usual ``u^2 - v^2`` diagonal network in disguise: ``alpha`` moves it from the kernel
  regime, minimum-L2 interpolator, to the rich regime, minimum-L1.) ``dL/dv = u * grad_beta``
  is non-zero at ``v = 0``, so training moves away from the starting point;
* loss ``L = 1/(2n) ||X beta - y||^2``; (stochastic) gradient descent on ``(u, v)``,
  each step on a batch of ``b`` points drawn without replacement (``b = n``: GD);
* hyperparameters, drawn independently per network from a seeded generator:
  ``alpha`` log-uniform in ``[0.01, 1]``, step size log-uniform in ``[0.02, 0.3]``,
  batch size uniform in ``{1, 5, 20, 80}`` (80: full-batch GD). Large steps and small
  batches matter: with noiseless labels the SGD noise vanishes at interpolation, and only
  large-step SGD early in training changes the implicit bias (towards sparser solutions,
  Pesme et al. 2021); with small steps the gap is nearly a function of ``alpha`` (run
  ``--lr-range 0.005 0.05 --batch-sizes 10 20 40 80`` to see it). Training stops at the
  first step with a full-batch training loss ``<= 1e-5`` (at most ``max_steps``). A run
  that diverges is restarted with half the step size (recorded as ``lr_used``);
* generalization gap: loss on a fresh test set of 10,000 points minus the training loss
  (the exact population risk ``1/2 ||beta - beta*||^2`` is recorded as well);
* sharpness on the whole training set (one batch), worst case:

  - ``adaptive``: ``geosharp.sharpness(measure="adaptive")`` (L2 ball, ``rho = 0.1``);
  - ``geodesic-inv``: ``measure="geodesic-inv"``, ``rho = 0.1``: the pairs
    ``(u_j, v_j)`` come from :func:`geosharp.find_symmetries` and the general Auto-PGD
    code measures them with the second-order geodesic;
  - ``geodesic-mix``: ``metric="mix"``, ``rho_mix = 0.01`` (``mix`` measures an absolute
    change of ``beta``; MATH.md section 2);

  each maximised by Auto-PGD (100 steps) from ``xi = 0`` and from ``n_restarts`` (1)
  antithetic pairs ``+-xi0`` of random starts, keeping the best. The antithetic pairs
  matter: at an interpolating point the quadratic model is even in ``xi`` and only the
  third-order term of the geodesic decides which of ``+-v_max`` is the maximum; a zero
  start picks the sign of the (vanishing) training gradient;
* reduced forms (:mod:`geosharp_studies.diagonal_net`): adaptive, ``inv`` with the exact
  exponential geodesic, ``mix`` as the exact trust-region value (unconstrained) and on
  the true geodesic ball, which keeps the signs of ``beta``; the last is what the
  ``mix`` geodesic sharpness is where the second-order expansion fails
  (``studies/docs/diagonal.md``);
  the reduced forms are also evaluated over a grid of radii.

Outputs (``--out``, default ``runs/diagonal``): ``networks.csv`` (one row per network),
``taus.csv``, ``summary.json``; figures (``--figures``, default ``--out``):
``diagonal_scatter.png`` (the paper's Figure 3 analogue) and
``diagonal_scatter_all.png`` (every measure); ``--name`` changes the prefix.
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from geosharp.cli.options import Parser, add_seed
from geosharp.cli.plots import require_matplotlib, save_png
from geosharp.errors import UsageError
from geosharp.geometry.space import Geometry, PerturbationSpace
from geosharp.io import write_json_atomic
from geosharp.layout import ParameterLayout
from geosharp.measures.apgd import auto_pgd
from geosharp.measures.catalog import TABLE
from geosharp.params import functional_loss
from geosharp.symmetry.discovery import find_symmetries

from .diagonal_net import (
    DiagonalNet,
    adaptive_sharpness_diagonal,
    geodesic_sharpness_inv,
    geodesic_sharpness_mix,
    squared_loss,
)
from .stats import kendall_tau, kendall_tau_with_ci

__all__ = [
    "MEASURES",
    "PAPER_TAUS",
    "DiagonalStudyConfig",
    "TrainedNetworks",
    "apgd_sharpness",
    "main",
    "make_problem",
    "measure_network",
    "replot",
    "run_study",
    "sample_hyperparameters",
    "train_diagonal_networks",
    "write_figures",
]

PAPER_TAUS = {name: m.paper_tau["diagonal"] for name, m in TABLE.items() if m.paper_tau}

# name -> (label, paper's measure it corresponds to, how it is computed)
MEASURES: dict[str, tuple[str, str | None, str]] = {
    "adaptive": ("adaptive", "adaptive", "Auto-PGD, geosharp.sharpness path"),
    "geodesic-inv": ("geodesic (inv)", "geodesic-inv", "Auto-PGD, second-order geodesic"),
    "geodesic-mix": ("geodesic (mix)", "geodesic-mix", "Auto-PGD, second-order geodesic"),
    "adaptive-zero-start": ("adaptive, xi0 = 0 only", "adaptive", "geosharp.sharpness default"),
    "geodesic-inv-zero-start": (
        "geodesic (inv), xi0 = 0 only",
        "geodesic-inv",
        "geosharp.sharpness default",
    ),
    "geodesic-mix-zero-start": (
        "geodesic (mix), xi0 = 0 only",
        "geodesic-mix",
        "geosharp.sharpness default",
    ),
    "reduced-adaptive": ("adaptive, reduced", "adaptive", "projected ascent on eps"),
    "reduced-inv": ("inv, exact geodesic", "geodesic-inv", "beta exp(2w), projected ascent"),
    "reduced-mix-ball": (
        "mix, exact geodesic ball",
        "geodesic-mix",
        "beta + d keeping signs, projected ascent",
    ),
    "reduced-mix-tr": (
        "mix, trust region",
        "geodesic-mix",
        "beta + d, exact trust-region solution",
    ),
}
MAIN_PANELS = ("adaptive", "geodesic-inv", "reduced-mix-ball")
# rows of the all-measures figure (None: an empty slot)
ALL_PANELS = (
    ("adaptive", "geodesic-inv", "geodesic-mix", None),
    ("adaptive-zero-start", "geodesic-inv-zero-start", "geodesic-mix-zero-start", None),
    ("reduced-adaptive", "reduced-inv", "reduced-mix-ball", "reduced-mix-tr"),
)


@dataclass
class DiagonalStudyConfig:
    """Every setting of the study (defaults: the paper-sized run)."""

    d: int = 200
    n_train: int = 80
    n_nonzero: int = 20
    n_test: int = 10_000
    n_networks: int = 50
    alpha_range: tuple[float, float] = (0.01, 1.0)
    lr_range: tuple[float, float] = (0.02, 0.3)
    batch_sizes: tuple[int, ...] = (1, 5, 20, 80)
    target_loss: float = 1e-5
    max_steps: int = 300_000
    rho: float = 0.1
    rho_mix: float = 0.01
    n_iters: int = 100
    n_restarts: int = 1
    rho_grid: tuple[float, ...] = (0.025, 0.05, 0.1, 0.2)
    rho_mix_grid: tuple[float, ...] = (0.001, 0.003, 0.01, 0.03, 0.1)
    n_boot: int = 2000
    seed: int = 0

    @classmethod
    def smoke(cls) -> DiagonalStudyConfig:
        """A seconds-long configuration with the same code paths (for tests)."""
        return cls(
            d=30,
            n_train=16,
            n_nonzero=3,
            n_test=2000,
            n_networks=8,
            alpha_range=(0.05, 1.0),
            lr_range=(0.02, 0.2),
            batch_sizes=(2, 8, 16),
            max_steps=60_000,
            n_iters=30,
            n_restarts=1,
            rho_grid=(0.05, 0.1),
            rho_mix_grid=(0.01,),
            n_boot=200,
        )

    def validate(self) -> None:
        """A :class:`~geosharp.errors.UsageError` (a ``ValueError``) for settings that
        cannot run, named as the command line names them."""
        if not 0 < self.n_nonzero <= self.d:
            raise UsageError(f"n_nonzero must be in 1..d={self.d}, got {self.n_nonzero}")
        if any(b < 1 or b > self.n_train for b in self.batch_sizes):
            raise UsageError(f"--batch-sizes must be in 1..n_train={self.n_train}")
        if self.n_networks < 2:
            raise UsageError("--networks: a rank correlation needs at least 2 networks")
        for option, (lo, hi) in (
            ("--alpha-range", self.alpha_range),
            ("--lr-range", self.lr_range),
        ):
            if not 0 < lo <= hi:
                raise UsageError(f"{option} must be positive and ordered (LO <= HI)")


@dataclass
class Problem:
    X: np.ndarray
    y: np.ndarray
    beta_star: np.ndarray
    X_test: np.ndarray
    y_test: np.ndarray


def make_problem(config: DiagonalStudyConfig, rng: np.random.Generator) -> Problem:
    """Sparse noiseless regression: ``X ~ N(0, I)``, ``beta*`` with ``n_nonzero`` entries
    ``N(0, 1)`` at random positions, ``y = X beta*``, and a fresh test set."""
    d = config.d
    X = rng.standard_normal((config.n_train, d))
    beta_star = np.zeros(d)
    support = rng.choice(d, size=config.n_nonzero, replace=False)
    beta_star[support] = rng.standard_normal(config.n_nonzero)
    X_test = rng.standard_normal((config.n_test, d))
    return Problem(X, X @ beta_star, beta_star, X_test, X_test @ beta_star)


def sample_hyperparameters(
    config: DiagonalStudyConfig, rng: np.random.Generator
) -> list[dict[str, float]]:
    """``alpha`` and step size log-uniform, batch size uniform over ``batch_sizes``."""

    def log_uniform(lo: float, hi: float) -> float:
        return float(np.exp(rng.uniform(np.log(lo), np.log(hi))))

    out = []
    for _ in range(config.n_networks):
        out.append(
            {
                "alpha": log_uniform(*config.alpha_range),
                "lr": log_uniform(*config.lr_range),
                "batch_size": int(rng.choice(config.batch_sizes)),
            }
        )
    return out


@dataclass
class TrainedNetworks:
    u: np.ndarray  # (K, d)
    v: np.ndarray
    steps: np.ndarray  # (K,)
    train_loss: np.ndarray
    converged: np.ndarray
    lr_used: np.ndarray
    seconds: float = 0.0


def train_diagonal_networks(
    X: np.ndarray,
    y: np.ndarray,
    hparams: Sequence[dict],
    target_loss: float = 1e-5,
    max_steps: int = 300_000,
    seed: int = 0,
    progress: bool = False,
) -> TrainedNetworks:
    """Train ``len(hparams)`` diagonal networks at once (float64, vectorised over
    networks): SGD on ``(u, v)`` from ``u0 = alpha``, ``v0 = 0`` with each network's step
    size and batch size, until its full-batch loss ``1/(2n) ||X u v - y||^2`` is at most
    ``target_loss``. Finished networks are frozen and dropped from the computation; a
    diverged network is restarted with half its step size."""
    start = time.perf_counter()
    Xt = torch.as_tensor(X, dtype=torch.float64)
    yt = torch.as_tensor(y, dtype=torch.float64)
    n, d = Xt.shape
    K = len(hparams)
    alpha = torch.tensor([h["alpha"] for h in hparams], dtype=torch.float64)
    lr = torch.tensor([h["lr"] for h in hparams], dtype=torch.float64)
    batch = torch.tensor([h["batch_size"] for h in hparams], dtype=torch.float64)
    U = alpha[:, None].repeat(1, d)
    V = torch.zeros(K, d, dtype=torch.float64)
    steps = torch.zeros(K, dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    arange = torch.arange(n)
    idx = torch.arange(K)  # networks still training
    from geosharp.progress import Progress

    bar = Progress(total=K, desc="training diagonal nets", unit="net", enabled=progress)
    initial = 0.5 * float((yt * yt).mean())
    step = 0
    while idx.numel() and step < max_steps:
        u, v = U[idx], V[idx]
        R = (u * v) @ Xt.T - yt  # (k, n)
        cur = 0.5 * (R * R).mean(1)
        diverged = ~torch.isfinite(cur) | (cur > 1e3 * max(initial, 1e-12))
        if bool(diverged.any()):
            bad = idx[diverged]
            lr[bad] /= 2.0
            U[bad] = alpha[bad, None].repeat(1, d)
            V[bad] = 0.0
            steps[bad] = 0
            continue
        finished = cur <= target_loss
        if bool(finished.any()):
            bar.update(int(finished.sum()))
            keep = ~finished
            idx, u, v, R = idx[keep], u[keep], v[keep], R[keep]
            if not idx.numel():
                break
        k = idx.numel()
        b = batch[idx]
        perm = torch.rand(k, n, generator=generator).argsort(1)
        mask = torch.zeros(k, n, dtype=torch.float64).scatter_(
            1, perm, (arange[None, :] < b[:, None]).to(torch.float64)
        )
        grad_beta = (R * mask) @ Xt / b[:, None]
        step_size = lr[idx, None]
        U[idx] = u - step_size * grad_beta * v
        V[idx] = v - step_size * grad_beta * u
        steps[idx] += 1
        step += 1
    bar.close()
    R = (U * V) @ Xt.T - yt
    loss = 0.5 * (R * R).mean(1)
    return TrainedNetworks(
        u=U.numpy(),
        v=V.numpy(),
        steps=steps.numpy(),
        train_loss=loss.numpy(),
        converged=(loss <= target_loss * (1 + 1e-9)).numpy(),
        lr_used=lr.numpy(),
        seconds=time.perf_counter() - start,
    )


def apgd_sharpness(
    model: torch.nn.Module,
    batch: object,
    loss_fn,
    geometry: str,
    rho: float,
    metric: str = "inv",
    n_iters: int = 100,
    n_restarts: int = 2,
    seed: int = 0,
) -> tuple[float, float]:
    """Worst-case sharpness by the library's Auto-PGD in the library's geometry, best of
    a zero start and ``n_restarts`` antithetic pairs ``+-xi0`` of random starts (``xi0``
    Gaussian in the metric, scaled to norm ``rho``). Returns the best value and the
    zero-start value, which is exactly what :func:`geosharp.sharpness` computes."""
    geo = Geometry.named(geometry, metric=metric)
    named = [(n, p) for n, p in model.named_parameters()]
    layout = ParameterLayout.from_named(named)
    theta = {n: p.detach() for n, p in named}
    pairs = find_symmetries(model).pairs if geo.metric is not None else []
    space = PerturbationSpace(theta, layout, pairs, geo)
    evaluate = functional_loss(model, loss_fn)
    with torch.no_grad():
        loss0 = float(evaluate(theta, batch))

    def loss_grad(point: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        point = point.detach().requires_grad_(True)
        loss = evaluate(layout.unflatten(point), batch)
        (grad,) = torch.autograd.grad(loss, point)
        return loss.detach(), out.copy_(grad)

    generator = torch.Generator().manual_seed(seed)
    starts: list[torch.Tensor | None] = [None]
    for _ in range(n_restarts):
        z = space.random(generator)
        z = z * (rho / space.norm(z).clamp_min(1e-300)).to(z.dtype)
        starts += [z, -z]
    values = [float(auto_pgd(loss_grad, space, rho, n_iters, xi0)[0]) for xi0 in starts]
    return max(values) - loss0, values[0] - loss0


def measure_network(
    problem: Problem,
    u: np.ndarray,
    v: np.ndarray,
    config: DiagonalStudyConfig,
    seed: int = 0,
) -> dict[str, float]:
    """All sharpness values of one trained network (see :data:`MEASURES`), plus the
    reduced forms on the radius grids (keys ``reduced-inv@rho``, ...)."""
    X, y = problem.X, problem.y
    net = DiagonalNet(len(u), torch.as_tensor(u), torch.as_tensor(v))
    batch = (torch.as_tensor(X), torch.as_tensor(y))
    common = dict(n_iters=config.n_iters, n_restarts=config.n_restarts, seed=seed)
    beta = u * v
    out = {}
    for key, geometry, metric, rho in (
        ("adaptive", "adaptive", "inv", config.rho),
        ("geodesic-inv", "geodesic", "inv", config.rho),
        ("geodesic-mix", "geodesic", "mix", config.rho_mix),
    ):
        out[key], out[f"{key}-zero-start"] = apgd_sharpness(
            net, batch, squared_loss, geometry, rho, metric=metric, **common
        )
    out.update(
        {
            "reduced-adaptive": adaptive_sharpness_diagonal(X, y, u, v, config.rho, seed=seed),
            "reduced-inv": geodesic_sharpness_inv(X, y, beta, config.rho, seed=seed),
            "reduced-mix-ball": geodesic_sharpness_mix(
                X, y, beta, config.rho_mix, sign_preserving=True, seed=seed
            ),
            "reduced-mix-tr": geodesic_sharpness_mix(X, y, beta, config.rho_mix),
        }
    )
    for rho in config.rho_grid:
        out[f"reduced-adaptive@{rho:g}"] = adaptive_sharpness_diagonal(X, y, u, v, rho, seed=seed)
        out[f"reduced-inv@{rho:g}"] = geodesic_sharpness_inv(X, y, beta, rho, seed=seed)
    for rho in config.rho_mix_grid:
        out[f"reduced-mix-ball@{rho:g}"] = geodesic_sharpness_mix(
            X, y, beta, rho, sign_preserving=True, seed=seed
        )
        out[f"reduced-mix-tr@{rho:g}"] = geodesic_sharpness_mix(X, y, beta, rho)
    return out


def _tau_or_nan(values: np.ndarray, gap: np.ndarray) -> float:
    if not np.all(np.isfinite(values)):
        return float("nan")
    return kendall_tau(values, gap)


def run_study(
    config: DiagonalStudyConfig,
    out_dir: str | Path | None = None,
    figures_dir: str | Path | None = None,
    progress: bool = True,
    plot: bool = True,
    name: str = "diagonal",
) -> dict:
    """Run the whole study; write CSV/JSON (and figures ``{name}_scatter.png``,
    ``{name}_scatter_all.png``) if ``out_dir`` is given. Returns the summary (also
    written as ``summary.json``)."""
    config.validate()
    start = time.perf_counter()
    rng = np.random.default_rng(config.seed)
    problem = make_problem(config, rng)
    hparams = sample_hyperparameters(config, rng)
    trained = train_diagonal_networks(
        problem.X,
        problem.y,
        hparams,
        config.target_loss,
        config.max_steps,
        seed=config.seed,
        progress=progress,
    )

    beta = trained.u * trained.v
    residual_test = beta @ problem.X_test.T - problem.y_test[None, :]
    test_loss = 0.5 * np.mean(residual_test**2, axis=1)
    population = 0.5 * np.sum((beta - problem.beta_star[None, :]) ** 2, axis=1)
    gap = test_loss - trained.train_loss
    gap_population = population - trained.train_loss

    measure_start = time.perf_counter()
    records = []
    from geosharp.progress import Progress

    iterator = Progress(
        range(config.n_networks), desc="measuring sharpness", unit="net", enabled=progress
    )
    for i in iterator:
        values = measure_network(problem, trained.u[i], trained.v[i], config, seed=config.seed + i)
        record = {
            "network": i,
            **hparams[i],
            "lr_used": float(trained.lr_used[i]),
            "steps": int(trained.steps[i]),
            "converged": bool(trained.converged[i]),
            "train_loss": float(trained.train_loss[i]),
            "test_loss": float(test_loss[i]),
            "population_risk": float(population[i]),
            "gap": float(gap[i]),
            "gap_population": float(gap_population[i]),
            "beta_l1": float(np.abs(beta[i]).sum()),
            "beta_min_abs": float(np.abs(beta[i]).min()),
            **values,
        }
        records.append(record)
    measure_seconds = time.perf_counter() - measure_start

    taus = {}
    for key, (label, paper_key, how) in MEASURES.items():
        vals = np.array([r[key] for r in records])
        entry = {"label": label, "how": how, "paper": PAPER_TAUS.get(paper_key or "")}
        if np.all(np.isfinite(vals)):
            ci = kendall_tau_with_ci(vals, gap, n_boot=config.n_boot, seed=config.seed)
            entry.update(
                tau=kendall_tau(vals, gap),
                ci_low=ci.low,
                ci_high=ci.high,
                tau_population_gap=kendall_tau(vals, gap_population),
            )
        else:
            entry.update(
                tau=float("nan"),
                ci_low=float("nan"),
                ci_high=float("nan"),
                tau_population_gap=float("nan"),
            )
        taus[key] = entry
    grid = {}
    for measure, radii in (
        ("reduced-adaptive", config.rho_grid),
        ("reduced-inv", config.rho_grid),
        ("reduced-mix-ball", config.rho_mix_grid),
        ("reduced-mix-tr", config.rho_mix_grid),
    ):
        grid[measure] = {
            f"{rho:g}": _tau_or_nan(np.array([r[f"{measure}@{rho:g}"] for r in records]), gap)
            for rho in radii
        }

    def ratio_stats(a: str, b: str) -> dict:
        ratio = np.array([r[a] / r[b] for r in records])
        return {
            "min": float(ratio.min()),
            "median": float(np.median(ratio)),
            "max": float(ratio.max()),
        }

    agreement = {
        "adaptive / reduced-adaptive": ratio_stats("adaptive", "reduced-adaptive"),
        "geodesic-inv / reduced-inv": ratio_stats("geodesic-inv", "reduced-inv"),
        "geodesic-mix / reduced-mix-ball": ratio_stats("geodesic-mix", "reduced-mix-ball"),
        "reduced-mix-ball / reduced-mix-tr": ratio_stats("reduced-mix-ball", "reduced-mix-tr"),
    }
    summary = {
        "config": asdict(config),
        "taus": taus,
        "taus_over_radius": grid,
        "apgd_vs_reduced": agreement,
        "n_converged": int(trained.converged.sum()),
        "gap_range": [float(gap.min()), float(gap.max())],
        "test_vs_population_max_rel_diff": float(
            np.max(np.abs(test_loss - population) / population)
        ),
        "seconds": {
            "training": trained.seconds,
            "sharpness": measure_seconds,
            "total": time.perf_counter() - start,
        },
        "torch_threads": torch.get_num_threads(),
    }

    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        _write_csv(out / "networks.csv", records)
        _write_csv(
            out / "taus.csv",
            [
                {
                    "measure": k,
                    **{
                        c: e[c]
                        for c in (
                            "label",
                            "how",
                            "tau",
                            "ci_low",
                            "ci_high",
                            "tau_population_gap",
                            "paper",
                        )
                    },
                }
                for k, e in taus.items()
            ],
        )
        if plot:
            fig_dir = Path(figures_dir) if figures_dir is not None else out
            summary["figures"] = [str(p) for p in write_figures(records, taus, fig_dir, name)]
        summary["seconds"]["total"] = time.perf_counter() - start
        write_json_atomic(out / "summary.json", summary)
    return summary


def _write_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            writer.writerow(
                {k: (f"{v:.10g}" if isinstance(v, float) else v) for k, v in row.items()}
            )


def write_figures(
    records: list[dict], taus: dict, fig_dir: str | Path, name: str = "diagonal"
) -> list[Path]:
    """The paper's Figure 3 analogue (``{name}_scatter.png``) and every measure
    (``{name}_scatter_all.png``)."""
    fig_dir = Path(fig_dir)
    fig_dir.mkdir(parents=True, exist_ok=True)
    return [
        plot_scatter(records, taus, fig_dir / f"{name}_scatter.png", (MAIN_PANELS,)),
        plot_scatter(records, taus, fig_dir / f"{name}_scatter_all.png", ALL_PANELS),
    ]


def plot_scatter(
    records: list[dict],
    taus: dict,
    path: Path,
    panels: Sequence[Sequence[str | None]],
) -> Path:
    """One panel per measure (``panels``: rows of measure keys, ``None`` for an empty
    slot): sharpness (x) against generalization gap (y), colour ``log10 alpha``, marker
    the batch size, tau and the paper's value in the title; PNG at ``path``."""
    matplotlib = require_matplotlib()
    import matplotlib.pyplot as plt

    gap = np.array([float(r["gap"]) for r in records])
    log_alpha = np.log10([float(r["alpha"]) for r in records])
    batch = np.array([int(float(r["batch_size"])) for r in records])
    markers = dict(zip(sorted(set(batch.tolist())), "o^sDvP*X"))
    rows, cols = len(panels), max(len(row) for row in panels)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.3 * rows), squeeze=False)
    norm = matplotlib.colors.Normalize(log_alpha.min(), log_alpha.max())
    first = True
    for row_axes, row in zip(axes, panels):
        for ax, key in zip(row_axes, list(row) + [None] * (cols - len(row))):
            if key is None:
                ax.axis("off")
                continue
            x = np.array([float(r[key]) for r in records])
            entry = taus[key]
            for b, marker in markers.items():
                sel = batch == b
                ax.scatter(
                    x[sel],
                    gap[sel],
                    c=log_alpha[sel],
                    cmap="viridis",
                    norm=norm,
                    s=20,
                    marker=marker,
                    edgecolors="none",
                    label=f"batch {b}",
                )
            if np.all(x > 0) and np.all(np.isfinite(x)) and x.max() / x.min() > 30:
                ax.set_xscale("log")
            paper = f" (paper {entry['paper']:+.2f})" if entry.get("paper") is not None else ""
            ax.set_title(f"{entry['label']}\n$\\tau$ = {entry['tau']:+.2f}{paper}", fontsize=9)
            ax.set_xlabel("sharpness", fontsize=8)
            ax.set_ylabel("generalization gap", fontsize=8)
            ax.tick_params(labelsize=7)
            if first:
                handles = [
                    matplotlib.lines.Line2D(
                        [],
                        [],
                        color="0.4",
                        marker=m,
                        linestyle="",
                        markersize=4,
                        label=f"batch {b}",
                    )
                    for b, m in markers.items()
                ]
                ax.legend(handles=handles, fontsize=6, loc="best")
                first = False
    right = 1.0 - 1.0 / (3.6 * cols)  # leave about an inch for the colour bar
    fig.tight_layout(rect=(0.0, 0.0, right, 1.0))
    cax = fig.add_axes((right + 0.05 * (1 - right), 0.2, 0.15 * (1 - right), 0.6))
    mappable = matplotlib.cm.ScalarMappable(norm=norm, cmap="viridis")
    bar = fig.colorbar(mappable, cax=cax)
    bar.set_label(r"$\log_{10}\alpha$ (initialisation scale)", fontsize=8)
    bar.ax.tick_params(labelsize=7)
    save_png(fig, path, dpi=110)
    plt.close(fig)
    return path


def replot(
    out_dir: str | Path, figures_dir: str | Path | None = None, name: str = "diagonal"
) -> list[Path]:
    """Redraw the figures of a finished run from its ``networks.csv`` and
    ``summary.json`` (no training, no measuring)."""
    out = Path(out_dir)
    with (out / "networks.csv").open() as f:
        records = list(csv.DictReader(f))
    taus = json.loads((out / "summary.json").read_text())["taus"]
    return write_figures(records, taus, figures_dir if figures_dir is not None else out, name)


def format_table(summary: dict) -> str:
    """The tau table, measured next to the paper's values."""
    lines = [
        f"{'measure':<30} {'computed by':<42} {'tau':>6}  {'95% CI':>16}  {'paper':>6}",
    ]
    for entry in summary["taus"].values():
        paper = f"{entry['paper']:+.2f}" if entry["paper"] is not None else ""
        ci = f"[{entry['ci_low']:+.2f}, {entry['ci_high']:+.2f}]"
        lines.append(
            f"{entry['label']:<30} {entry['how']:<42} {entry['tau']:+6.2f}  {ci:>16}  {paper:>6}"
        )
    return "\n".join(lines)


DESCRIPTION = (
    "Diagonal linear networks: Kendall tau between worst-case sharpness (adaptive, geodesic "
    "inv, geodesic mix) and the generalization gap (paper's section 6.1, Figure 3)."
)


def _parser() -> argparse.ArgumentParser:
    parser = Parser(prog="geosharp study diagonal", description=DESCRIPTION)
    add_arguments(parser)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The study's command-line options (``geosharp study diagonal --help``)."""
    parser.add_argument(
        "--out",
        default="runs/diagonal",
        help="directory for CSV/JSON results (default: runs/diagonal)",
    )
    parser.add_argument(
        "--figures", default=None, help="directory for the PNG figures (default: --out)"
    )
    add_seed(parser, "data, hyperparameters and SGD")
    parser.add_argument("--networks", type=int, help="number of networks (50)")
    parser.add_argument(
        "--rho", type=float, help="radius of adaptive and geodesic-inv sharpness, relative (0.1)"
    )
    parser.add_argument(
        "--rho-mix",
        type=float,
        help="radius of geodesic-mix sharpness, absolute change of beta (0.01)",
    )
    parser.add_argument("--n-iters", type=int, help="Auto-PGD steps per start (100)")
    parser.add_argument(
        "--restarts", type=int, help="antithetic pairs of random Auto-PGD starts besides xi = 0 (1)"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny configuration that runs in seconds (checks the pipeline)",
    )
    parser.add_argument(
        "--alpha-range",
        type=float,
        nargs=2,
        metavar=("LO", "HI"),
        help="initialisation scales, log-uniform (0.01 1)",
    )
    parser.add_argument(
        "--lr-range",
        type=float,
        nargs=2,
        metavar=("LO", "HI"),
        help="step sizes, log-uniform (0.02 0.3)",
    )
    parser.add_argument(
        "--batch-sizes",
        type=int,
        nargs="+",
        metavar="B",
        help="batch sizes to draw from (1 5 20 80); n_train = GD",
    )
    parser.add_argument(
        "--name", default="diagonal", help="file-name prefix of the figures (diagonal)"
    )
    parser.add_argument(
        "--replot", action="store_true", help="only redraw the figures from the CSV/JSON in --out"
    )
    parser.add_argument("--no-plots", action="store_true", help="skip the figures")
    parser.add_argument("--quiet", action="store_true", help="no progress reports")


def main(argv: Sequence[str] | None = None) -> int:
    return run(_parser().parse_args(list(argv) if argv is not None else None))


def run(args: argparse.Namespace) -> int:
    """Run the study for parsed options (matplotlib is checked before any work)."""
    if not args.no_plots:
        require_matplotlib("run the study with --no-plots")
    if args.replot:
        for path in replot(args.out, args.figures, args.name):
            print(f"wrote {path}")
        return 0
    config = DiagonalStudyConfig.smoke() if args.smoke else DiagonalStudyConfig()
    changes = dict(
        seed=args.seed,
        n_networks=args.networks,
        rho=args.rho,
        rho_mix=args.rho_mix,
        n_iters=args.n_iters,
        n_restarts=args.restarts,
        alpha_range=tuple(args.alpha_range) if args.alpha_range else None,
        lr_range=tuple(args.lr_range) if args.lr_range else None,
        batch_sizes=tuple(args.batch_sizes) if args.batch_sizes else None,
    )
    config = replace(config, **{k: v for k, v in changes.items() if v is not None})
    summary = run_study(
        config,
        args.out,
        args.figures,
        progress=not args.quiet,
        plot=not args.no_plots,
        name=args.name,
    )
    print(
        f"diagonal networks: d={config.d}, n={config.n_train}, "
        f"{config.n_nonzero} non-zeros, {config.n_networks} networks "
        f"({summary['n_converged']} reached training loss <= {config.target_loss:g}); "
        f"gap in [{summary['gap_range'][0]:.3g}, {summary['gap_range'][1]:.3g}]"
    )
    print(
        f"rho = {config.rho:g} (adaptive, inv), rho_mix = {config.rho_mix:g} (mix); "
        f"Auto-PGD {config.n_iters} steps x {1 + 2 * config.n_restarts} starts"
    )
    print(format_table(summary))
    print("Auto-PGD / reduced form (min, median, max):")
    for name, stats in summary["apgd_vs_reduced"].items():
        print(f"  {name:<36} {stats['min']:.4g}  {stats['median']:.4g}  {stats['max']:.4g}")
    seconds = summary["seconds"]
    print(
        f"time: training {seconds['training']:.1f} s, sharpness {seconds['sharpness']:.1f} s, "
        f"total {seconds['total']:.1f} s; results in {args.out}"
    )
    return 0
