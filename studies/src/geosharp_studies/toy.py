r"""``geosharp study toy``: the scalar toy model of the paper's appendix D (Figures 1, 6).

Two scalar parameters ``(u, v)``, one data point ``(x, y)``, the network ``f = u v x`` and
the square loss ``l(u, v) = 1/2 (x u v - y)^2``. The loss depends on ``beta = u v`` only,
so it is constant on the orbits ``(u, v) -> (a u, v / a)`` (hyperbolas ``u v = const``).
Write ``r = x beta - y`` for the residual and ``l'(beta) = x r``, ``l''(beta) = x^2``.

Euclidean quantities (not constant on orbits):

* gradient ``(x r v, x r u)``, norm ``|x r| sqrt(u^2 + v^2)``;
* Hessian trace ``d^2 l/du^2 + d^2 l/dv^2 = x^2 (u^2 + v^2)``.

Riemannian quantities, ``inv`` metric ``g = du^2/u^2 + dv^2/v^2`` (MATH.md section 5;
constant on orbits, functions of ``beta`` alone):

* gradient ``(u^2 dl/du, v^2 dl/dv)``, norm^2 ``= u^2 (dl/du)^2 + v^2 (dl/dv)^2
  = 2 beta^2 l'(beta)^2``, i.e. ``sqrt(2) |x beta r|``;
* Hessian trace (see :func:`riemannian_hessian_trace`) ``2 x beta (2 x beta - y)``.

Geodesics (:func:`geodesic_inv`, :func:`geodesic_mix`) have closed forms; they are
checked against a metric-agnostic numerical geodesic (:func:`numerical_geodesic`:
Christoffel symbols from the metric by automatic differentiation, RK4) in the tests.

Outputs (``--out``, default ``runs/toy``): ``toy_checks.json``; figures (``--figures``,
default ``--out``): ``toy_figure1.png`` (loss, Euclidean and Riemannian gradient norm)
and ``toy_figure6.png`` (adds the Hessian traces and the geodesics).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from geosharp.cli.options import positive_float
from geosharp.cli.plots import require_matplotlib, save_png

__all__ = [
    "christoffel",
    "euclidean_grad_norm",
    "euclidean_hessian_trace",
    "geodesic_inv",
    "geodesic_mix",
    "inv_metric",
    "loss",
    "main",
    "mix_metric",
    "numerical_geodesic",
    "numerical_riemannian_hessian",
    "orbit_variation",
    "riemannian_grad_norm",
    "riemannian_hessian_trace",
]


# --- the model ---------------------------------------------------------------------------


def loss(u, v, x: float = 1.0, y: float = 1.0):
    """``1/2 (x u v - y)^2`` (numpy arrays or torch tensors)."""
    return 0.5 * (x * u * v - y) ** 2


def euclidean_grad_norm(u, v, x: float = 1.0, y: float = 1.0):
    """``||(dl/du, dl/dv)||_2 = |x r| sqrt(u^2 + v^2)``."""
    r = x * u * v - y
    return np.abs(x * r) * np.sqrt(u**2 + v**2)


def riemannian_grad_norm(u, v, x: float = 1.0, y: float = 1.0, metric: str = "inv"):
    """Norm of the Riemannian gradient in its own metric.

    ``inv``: ``grad = (u^2 dl/du, v^2 dl/dv)``, ``||grad||^2 = u^2 dl/du^2 + v^2 dl/dv^2 =
    2 beta^2 (x r)^2``. ``mix`` (``g = v^2 du^2 + u^2 dv^2``): ``grad = (dl/du / v^2,
    dl/dv / u^2)``, ``||grad||^2 = 2 (x r)^2``. Both depend on ``beta`` only.
    """
    beta = u * v
    r = x * beta - y
    if metric == "inv":
        return np.sqrt(2.0) * np.abs(x * beta * r)
    if metric == "mix":
        return np.sqrt(2.0) * np.abs(x * r) * np.ones_like(beta)
    raise ValueError(f"metric must be 'inv' or 'mix', got {metric!r}")


def euclidean_hessian_trace(u, v, x: float = 1.0, y: float = 1.0):
    """``d^2 l/du^2 + d^2 l/dv^2 = x^2 (v^2 + u^2)`` (independent of ``y``)."""
    return x**2 * (u**2 + v**2)


def riemannian_hessian_trace(u, v, x: float = 1.0, y: float = 1.0, metric: str = "inv"):
    r"""Trace of the Riemannian Hessian of the loss on the quotient ``M / GL(1)``.

    Derivation (``inv`` metric). The quotient is one-dimensional (coordinate ``beta``),
    so the trace is ``Hess l(e, e)`` for a unit horizontal vector ``e``. Horizontal
    vectors at ``(u, v)`` are ``xi = w (u, v)`` (``xi_u / u = xi_v / v``) with
    ``||xi||^2 = xi_u^2/u^2 + xi_v^2/v^2 = 2 w^2``, so ``e`` has ``w = 1/sqrt(2)``. For any
    tangent ``e``, ``Hess l(e, e) = d^2/dt^2 l(gamma(t))`` at ``t = 0`` along the geodesic
    with ``gamma'(0) = e``; a horizontal geodesic of the total space projects to a
    geodesic of the quotient (Riemannian submersion). The exact geodesic is
    ``u exp(w t)``, ``v exp(w t)`` (MATH.md section 5), hence
    ``beta(t) = beta exp(2 w t) = beta exp(sqrt(2) t)``, ``beta' = sqrt(2) beta`` and
    ``beta'' = 2 beta`` at ``t = 0``, and

        Hess l(e, e) = l''(beta) beta'^2 + l'(beta) beta''
                     = 2 (beta^2 l''(beta) + beta l'(beta))
                     = 2 x beta (2 x beta - y).

    In the coordinates ``(log|u|, log|v|)`` the ``inv`` metric is the flat
    ``da^2 + db^2`` and the orbits are the straight lines ``a + b = const``: the vertical
    direction is a geodesic along which ``l`` is constant, so the trace over the whole
    two-dimensional total space, ``g^{ij} Hess_ij``, is the same number (checked in the
    tests against Christoffel symbols computed by automatic differentiation).

    Properties: a function of ``beta`` only (constant on orbits); ``2 y^2`` at the
    minima ``x beta = y``; ``0`` on the axes ``beta = 0``; negative for ``x beta`` between 0
    and ``y / 2``, where ``l`` is concave along the geodesic (``l(beta e^s)`` in ``s``),
    which the Euclidean trace ``x^2 (u^2 + v^2) >= 0`` cannot show.

    ``mix`` metric: the quotient metric is ``dbeta^2 / 2`` (flat), the unit-speed
    geodesic is ``beta + sqrt(2) t`` and ``Hess l(e, e) = 2 l''(beta) = 2 x^2``, a
    constant (returned for completeness).
    """
    beta = u * v
    if metric == "inv":
        return 2.0 * x * beta * (2.0 * x * beta - y)
    if metric == "mix":
        return 2.0 * x**2 * np.ones_like(beta)
    raise ValueError(f"metric must be 'inv' or 'mix', got {metric!r}")


# --- geodesics -------------------------------------------------------------------------


def geodesic_inv(u0: float, v0: float, xi_u: float, xi_v: float, t):
    """Exact ``inv`` geodesic ``(u0 exp(t xi_u / u0), v0 exp(t xi_v / v0))`` (any ``xi``:
    in ``(log|u|, log|v|)`` the metric is flat)."""
    t = np.asarray(t, dtype=np.float64)
    return u0 * np.exp(t * xi_u / u0), v0 * np.exp(t * xi_v / v0)


def geodesic_mix(u0: float, v0: float, w: float, t):
    """Exact horizontal ``mix`` geodesic from ``(u0, v0)`` with ``xi = w (u0, v0)``:
    ``(u0, v0) sqrt(1 + 2 w t)``, so ``beta(t) = beta0 (1 + 2 w t)`` is a straight line
    (``dbeta = 2 w beta0``). Defined while ``1 + 2 w t > 0``: the geodesic ends where
    ``beta`` reaches 0."""
    t = np.asarray(t, dtype=np.float64)
    s = np.sqrt(1.0 + 2.0 * w * t)
    return u0 * s, v0 * s


def inv_metric(theta: torch.Tensor) -> torch.Tensor:
    """``diag(1/u^2, 1/v^2)``."""
    return torch.diag(1.0 / theta**2)


def mix_metric(theta: torch.Tensor) -> torch.Tensor:
    """``diag(v^2, u^2)``."""
    return torch.diag(torch.stack([theta[1] ** 2, theta[0] ** 2]))


Metric = Callable[[torch.Tensor], torch.Tensor]


def christoffel(metric: Metric, theta: torch.Tensor) -> torch.Tensor:
    """``Gamma[k, i, j] = 1/2 g^{kl} (d_i g_lj + d_j g_li - d_l g_ij)`` from any metric
    function by automatic differentiation (float64)."""
    theta = theta.detach().to(torch.float64)
    g = metric(theta)
    dg = torch.autograd.functional.jacobian(metric, theta)  # dg[l, j, i] = d_i g_lj
    g_inv = torch.linalg.inv(g)
    # term[l, i, j] = d_i g_lj + d_j g_li - d_l g_ij
    term = dg.permute(0, 2, 1) + dg - dg.permute(2, 0, 1)
    return 0.5 * torch.einsum("kl,lij->kij", g_inv, term)


def numerical_geodesic(
    metric: Metric, theta0, xi0, t: float = 1.0, steps: int = 2000
) -> np.ndarray:
    """Integrate ``gamma'' = -Gamma(gamma', gamma')`` from ``(theta0, xi0)`` to time ``t``
    with classical RK4; returns ``gamma(t)``."""
    theta = torch.as_tensor(theta0, dtype=torch.float64).clone()
    vel = torch.as_tensor(xi0, dtype=torch.float64).clone()

    def rhs(p: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gamma = christoffel(metric, p)
        return q, -torch.einsum("kij,i,j->k", gamma, q, q)

    h = t / steps
    for _ in range(steps):
        k1 = rhs(theta, vel)
        k2 = rhs(theta + 0.5 * h * k1[0], vel + 0.5 * h * k1[1])
        k3 = rhs(theta + 0.5 * h * k2[0], vel + 0.5 * h * k2[1])
        k4 = rhs(theta + h * k3[0], vel + h * k3[1])
        theta = theta + h / 6 * (k1[0] + 2 * k2[0] + 2 * k3[0] + k4[0])
        vel = vel + h / 6 * (k1[1] + 2 * k2[1] + 2 * k3[1] + k4[1])
    return theta.numpy()


def numerical_riemannian_hessian(
    metric: Metric, theta, x: float = 1.0, y: float = 1.0
) -> np.ndarray:
    """``Hess_ij = d_i d_j l - Gamma^k_ij d_k l`` (the (0,2) Riemannian Hessian of the
    loss in the coordinates ``(u, v)``), by automatic differentiation."""
    theta = torch.as_tensor(theta, dtype=torch.float64)

    def f(p: torch.Tensor) -> torch.Tensor:
        return loss(p[0], p[1], x, y)

    grad = torch.autograd.functional.jacobian(f, theta)
    hess = torch.autograd.functional.hessian(f, theta)
    return (hess - torch.einsum("kij,k->ij", christoffel(metric, theta), grad)).numpy()


def orbit_variation(fn: Callable, u: float, v: float, scales: Sequence[float]) -> float:
    """Largest relative change of ``fn(a u, v / a)`` over ``scales`` (0: constant on the
    orbit through ``(u, v)``)."""
    values = np.array([fn(a * u, v / a) for a in scales], dtype=np.float64)
    ref = max(np.abs(values).max(), 1e-300)
    return float((values.max() - values.min()) / ref)


# --- the study -----------------------------------------------------------------------------


def _checks(x: float, y: float) -> dict:
    """Orbit invariance and geodesic agreement, for the JSON record."""
    scales = np.exp(np.linspace(-1.5, 1.5, 13))
    points = [(0.7, 1.1), (-1.3, 0.4), (0.3, -0.5), (1.6, 1.2)]
    quantities = {
        "loss": lambda u, v: loss(u, v, x, y),
        "euclidean_grad_norm": lambda u, v: euclidean_grad_norm(u, v, x, y),
        "riemannian_grad_norm": lambda u, v: riemannian_grad_norm(u, v, x, y),
        "euclidean_hessian_trace": lambda u, v: euclidean_hessian_trace(u, v, x, y),
        "riemannian_hessian_trace": lambda u, v: riemannian_hessian_trace(u, v, x, y),
    }
    variation = {
        name: max(orbit_variation(fn, u, v, scales) for u, v in points)
        for name, fn in quantities.items()
    }
    u0, v0, xi = 0.8, -1.3, (0.3, -0.5)
    exact = np.array(geodesic_inv(u0, v0, *xi, 1.0))
    numeric = numerical_geodesic(inv_metric, [u0, v0], xi, 1.0, steps=400)
    w = 0.2
    exact_mix = np.array(geodesic_mix(u0, v0, w, 1.0))
    numeric_mix = numerical_geodesic(mix_metric, [u0, v0], [w * u0, w * v0], 1.0, steps=400)
    return {
        "x": x,
        "y": y,
        "max_relative_variation_on_orbits": variation,
        "geodesic_inv_max_abs_error": float(np.abs(exact - numeric).max()),
        "geodesic_mix_max_abs_error": float(np.abs(exact_mix - numeric_mix).max()),
    }


def plot_toy(
    path_fig1: Path, path_fig6: Path, x: float, y: float, lim: float = 2.0, resolution: int = 301
) -> None:
    """Level sets of the loss, gradient norms and Hessian traces over ``[-lim, lim]^2``
    with the symmetry orbits ``u v = c`` (dashed) overlaid."""
    require_matplotlib()
    import matplotlib.pyplot as plt

    grid = np.linspace(-lim, lim, resolution)
    U, V = np.meshgrid(grid, grid)
    panels = {
        "loss": (loss(U, V, x, y), "(a) loss $\\frac{1}{2}(xuv-y)^2$"),
        "egrad": (euclidean_grad_norm(U, V, x, y), "(b) Euclidean gradient norm"),
        "rgrad": (riemannian_grad_norm(U, V, x, y), "(c) Riemannian gradient norm"),
        "ehess": (euclidean_hessian_trace(U, V, x, y), "(d) Euclidean Hessian trace"),
        "rhess": (riemannian_hessian_trace(U, V, x, y), "(e) Riemannian Hessian trace"),
    }

    def draw(ax, key: str) -> None:
        Z, title = panels[key]
        levels = _levels(Z)
        cs = ax.contourf(U, V, Z, levels=levels, cmap="viridis", extend="max")
        ax.contour(U, V, Z, levels=levels[::2], colors="k", linewidths=0.4)
        for c in (-2.0, -1.0, -0.25, 0.25, 1.0, 2.0):  # orbits u v = c
            ax.contour(U, V, U * V, levels=[c], colors="w", linewidths=0.7, linestyles="--")
        if key in ("rhess", "ehess") and Z.min() < 0 < Z.max():
            ax.contour(U, V, Z, levels=[0.0], colors="r", linewidths=1.0)
            title += " (red: 0)"
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("$u$", fontsize=8)
        ax.set_ylabel("$v$", fontsize=8)
        ax.set_aspect("equal")
        ax.tick_params(labelsize=7)
        bar = plt.colorbar(cs, ax=ax, shrink=0.8, format="%.2g")
        bar.ax.tick_params(labelsize=6)

    fig, axes = plt.subplots(1, 3, figsize=(11.5, 3.6))
    for ax, key in zip(axes, ("loss", "egrad", "rgrad")):
        draw(ax, key)
    fig.suptitle(
        f"Scalar toy model $f = uvx$, $(x, y) = ({x:g}, {y:g})$; white dashed: "
        "symmetry orbits $uv$ = const",
        fontsize=10,
    )
    fig.tight_layout()
    save_png(fig, path_fig1, dpi=90)
    plt.close(fig)

    fig, axes = plt.subplots(2, 3, figsize=(11.5, 7.2))
    for ax, key in zip(axes.flat, ("loss", "egrad", "rgrad", None, "ehess", "rhess")):
        if key is not None:
            draw(ax, key)
    _draw_geodesics(axes[1, 0], U, V, x, y)
    fig.suptitle(
        "Scalar toy model: Riemannian (inv) quantities are constant on the "
        "orbits, Euclidean ones are not",
        fontsize=10,
    )
    fig.tight_layout()
    save_png(fig, path_fig6, dpi=90)
    plt.close(fig)


def _levels(Z: np.ndarray) -> np.ndarray:
    """Levels at quantiles of ``Z`` over the plotted square (every band covers a similar
    area, so the structure near the valley stays visible next to the large corners)."""
    levels = np.unique(np.quantile(Z, np.linspace(0.0, 0.97, 16)))
    if levels.size < 2:
        levels = np.array([levels[0], levels[0] + 1.0])
    return levels


def _draw_geodesics(ax, U, V, x: float, y: float) -> None:
    """Closed-form ``inv`` geodesics (lines) and RK4 integration (dots) from one point."""
    for c in (0.25, 0.54, 1.0, 2.0):  # orbits u v = c
        ax.contour(U, V, U * V, levels=[c], colors="0.6", linewidths=0.7, linestyles="--")
    u0, v0 = 0.6, 0.9
    t = np.linspace(0.0, 1.0, 50)
    for angle in np.linspace(0, 2 * np.pi, 8, endpoint=False):
        xi = (0.9 * np.cos(angle) * u0, 0.9 * np.sin(angle) * v0)
        cu, cv = geodesic_inv(u0, v0, *xi, t)
        ax.plot(cu, cv, color="C0", linewidth=1.2)
        pts = np.array(
            [numerical_geodesic(inv_metric, [u0, v0], xi, s, steps=40) for s in (0.5, 1.0)]
        )
        ax.plot(pts[:, 0], pts[:, 1], "o", color="C3", markersize=3)
    w = 0.5
    for sign in (1.0, -1.0):
        cu, cv = geodesic_mix(u0, v0, sign * w, np.linspace(0, 0.99, 50))
        ax.plot(cu, cv, color="C1", linewidth=1.2)
    ax.plot([u0], [v0], "k*", markersize=8)
    ax.set_title(
        "geodesics from $\\star$: inv (blue), horizontal mix (orange);\n"
        "red dots: RK4 with autodiff Christoffel symbols; dashed: orbits",
        fontsize=8,
    )
    ax.set_xlim(-0.1, 2.0)
    ax.set_ylim(-0.1, 2.0)
    ax.set_aspect("equal")
    ax.set_xlabel("$u$", fontsize=8)
    ax.set_ylabel("$v$", fontsize=8)
    ax.tick_params(labelsize=7)


DESCRIPTION = (
    "Scalar toy model of the paper's appendix D: level sets of the loss, the Euclidean and "
    "Riemannian gradient norms and Hessian traces (Figures 1, 6)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The study's command-line options (``geosharp study toy --help``)."""
    parser.add_argument("--out", default="runs/toy", help="directory for toy_checks.json")
    parser.add_argument("--figures", default=None, help="directory for the PNGs (default --out)")
    parser.add_argument("--x", type=float, default=1.0, help="the data point's input (1)")
    parser.add_argument("--y", type=float, default=1.0, help="the data point's label (1)")
    parser.add_argument("--lim", type=positive_float, default=2.0, help="plot [-lim, lim]^2 (2)")


def main(argv: Sequence[str] | None = None) -> int:
    from geosharp.cli.options import Parser

    parser = Parser(prog="geosharp study toy", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(list(argv) if argv is not None else None))


def run(args: argparse.Namespace) -> int:
    """Run the study for parsed options (matplotlib is checked before any work)."""
    require_matplotlib()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fig_dir = Path(args.figures) if args.figures else out
    fig_dir.mkdir(parents=True, exist_ok=True)
    checks = _checks(args.x, args.y)
    fig1, fig6 = fig_dir / "toy_figure1.png", fig_dir / "toy_figure6.png"
    plot_toy(fig1, fig6, args.x, args.y, args.lim)
    checks["figures"] = [str(fig1), str(fig6)]
    (out / "toy_checks.json").write_text(json.dumps(checks, indent=2))
    print(f"scalar toy model, (x, y) = ({args.x:g}, {args.y:g})")
    print("largest relative variation along symmetry orbits (0 = invariant):")
    for name, value in checks["max_relative_variation_on_orbits"].items():
        print(f"  {name:<26} {value:.3g}")
    print(
        f"closed-form vs RK4 geodesic, max abs error: inv "
        f"{checks['geodesic_inv_max_abs_error']:.2g}, mix "
        f"{checks['geodesic_mix_max_abs_error']:.2g}"
    )
    print(f"figures: {fig1}, {fig6}")
    return 0
