"""Diagonal networks: symmetry discovery, closed forms against the general Auto-PGD path,
invariance under rescaling, training, and a smoke run of ``geosharp study diagonal``."""

import copy
import csv
import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch import nn

import geosharp
from geosharp_studies import diagonal as study
from geosharp_studies.diagonal_net import (
    DiagonalNet,
    adaptive_sharpness_diagonal,
    geodesic_sharpness_inv,
    geodesic_sharpness_mix,
    quadratic_terms,
    squared_loss,
    trust_region_max,
)

F64 = torch.float64


def random_instance(seed, n=12, d=6, scale=1.0, noise=1.0):
    """A diagonal net with entries of u, v bounded away from 0 and a non-zero loss."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, d))
    u = rng.choice([-1, 1], d) * rng.uniform(0.5, 1.5, d) * scale
    v = rng.choice([-1, 1], d) * rng.uniform(0.5, 1.5, d) / scale
    y = X @ (u * v) + noise * rng.standard_normal(n)
    return X, y, u, v


def as_net(u, v):
    return DiagonalNet(len(u), torch.as_tensor(u, dtype=F64), torch.as_tensor(v, dtype=F64))


def batch_of(X, y):
    return [(torch.as_tensor(X, dtype=F64), torch.as_tensor(y, dtype=F64))]


# --- the model and its symmetry ----------------------------------------------------------


def test_find_symmetries_returns_one_gl1_pair_per_coordinate():
    net = DiagonalNet(7)
    sym = geosharp.find_symmetries(net)
    assert [p.shape for p in sym.pairs] == [(7, 1, 1, 1)]
    assert sym.elementwise == []
    (pair,) = sym.pairs
    assert pair.g_blocks[0].param == "u" and pair.h_blocks[0].param == "v"
    assert pair.g_blocks[0].index.view(-1).tolist() == list(range(7))

    # nested in a container, with a prefix, next to an unrelated layer
    model = nn.Sequential(nn.Linear(3, 7), DiagonalNet(7))
    sym = geosharp.find_symmetries(model)
    assert sym.pairs[0].module == "1"
    assert sym.pairs[0].params == ("1.u", "1.v")
    assert sym.elementwise == ["0.weight", "0.bias"]


def test_symmetry_self_check_and_reparameterize():
    X, _, u, v = random_instance(0)
    net = as_net(u, v)
    x = torch.as_tensor(X, dtype=F64)
    assert geosharp.check_symmetries(net, x).ok
    before = net(x).detach()
    moved = copy.deepcopy(net)
    geosharp.reparameterize(moved, cond=10.0, seed=1, batch=x)
    assert not torch.allclose(moved.u, net.u)
    torch.testing.assert_close(moved(x), before, rtol=1e-12, atol=1e-12)


# --- closed forms ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_trust_region_is_the_global_maximum(seed):
    rng = np.random.default_rng(seed)
    d = 4
    M = rng.standard_normal((d, d))
    A = M @ M.T
    g = rng.standard_normal(d)
    r = 0.8
    value, x = trust_region_max(A, g, r)
    assert np.linalg.norm(x) == pytest.approx(r, rel=1e-10)
    assert value == pytest.approx(g @ x + 0.5 * x @ A @ x, rel=1e-12)
    # optimality: (lam I - A) x = g with lam >= lambda_max(A)
    lam = (x @ (A @ x + g)) / (x @ x)
    np.testing.assert_allclose(lam * x - A @ x, g, atol=1e-8)
    assert lam >= np.linalg.eigvalsh(A)[-1] - 1e-9
    # and no sampled point of the ball does better
    Z = rng.standard_normal((20000, d))
    Z *= r / np.linalg.norm(Z, axis=1, keepdims=True)
    sampled = Z @ g + 0.5 * np.einsum("ij,jk,ik->i", Z, A, Z)
    assert sampled.max() <= value + 1e-12
    assert sampled.max() >= value - 0.2 * abs(value)


def test_trust_region_hard_case_and_zero_gradient():
    A = np.diag([3.0, 1.0, -2.0])
    value, x = trust_region_max(A, np.zeros(3), 0.5)
    assert value == pytest.approx(0.5 * 3.0 * 0.25)
    assert abs(x[0]) == pytest.approx(0.5)
    # gradient orthogonal to the top eigenvector, small: hard case
    g = np.array([0.0, 0.1, 0.1])
    value, x = trust_region_max(A, g, 1.0)
    assert np.linalg.norm(x) == pytest.approx(1.0)
    brute = max(
        g @ z + 0.5 * z @ A @ z
        for z in np.random.default_rng(0).standard_normal((20000, 3))
        for z in [z / np.linalg.norm(z)]
    )
    assert value >= brute - 1e-12
    # negative definite with the unconstrained maximiser inside the ball
    value, x = trust_region_max(-np.eye(2), np.array([0.1, 0.0]), 1.0)
    np.testing.assert_allclose(x, [0.1, 0.0])
    assert value == pytest.approx(0.005)


def test_mix_closed_form_is_the_rho_squared_lambda_max_at_an_interpolating_point():
    # MATH.md section 7: at zero gradient the trust-region value is rho^2 lambda_max(X^T X/n)
    rng = np.random.default_rng(1)
    X = rng.standard_normal((5, 9))
    beta = rng.standard_normal(9)
    y = X @ beta
    lam = np.linalg.eigvalsh(X.T @ X / 5)[-1]
    assert geodesic_sharpness_mix(X, y, beta, 0.1) == pytest.approx(0.01 * lam, rel=1e-9)


def test_sign_preserving_mix_ball_is_smaller_and_respects_the_signs():
    rng = np.random.default_rng(2)
    X = rng.standard_normal((10, 8))
    beta = rng.standard_normal(8)
    beta[:4] = 1e-6 * np.sign(beta[:4])  # four coordinates at the end of their geodesic
    y = X @ beta
    free = geodesic_sharpness_mix(X, y, beta, 0.3)
    ball = geodesic_sharpness_mix(X, y, beta, 0.3, sign_preserving=True)
    assert ball < free
    # the same maximum restricted to the four free coordinates bounds it from below
    _, _, A = quadratic_terms(X, y, beta)
    sub, _ = trust_region_max(A[4:, 4:], np.zeros(4), np.sqrt(2) * 0.3)
    assert ball >= sub - 1e-12
    # far from zero the constraint is inactive: the values agree
    beta_far = rng.choice([-1.0, 1.0], 8) * rng.uniform(2, 3, 8)
    y_far = X @ beta_far + 0.1
    assert geodesic_sharpness_mix(X, y_far, beta_far, 0.3, sign_preserving=True) == (
        pytest.approx(geodesic_sharpness_mix(X, y_far, beta_far, 0.3), rel=1e-9)
    )


# --- the general Auto-PGD path against the closed forms -----------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_auto_pgd_agrees_with_closed_forms_on_random_instances(seed):
    X, y, u, v = random_instance(seed)
    net, batches = as_net(u, v), batch_of(X, y)
    beta = u * v
    rho, rho_mix = 0.05, 0.02

    def apgd(**kw):
        return geosharp.sharpness(
            net, batches, squared_loss, **kw, estimator=geosharp.WorstCase(n_iters=100)
        ).value

    adaptive = apgd(measure="adaptive", rho=rho)
    inv = apgd(measure="geodesic-inv", rho=rho)
    mix = apgd(measure="geodesic-mix", rho=rho_mix)
    ref_adaptive = adaptive_sharpness_diagonal(X, y, u, v, rho)
    ref_inv = geodesic_sharpness_inv(X, y, beta, rho)
    bound_mix = geodesic_sharpness_mix(X, y, beta, rho_mix)
    assert ref_adaptive > 0 and ref_inv > 0 and bound_mix > 0
    # same objective, both maximisers: agree closely
    assert adaptive == pytest.approx(ref_adaptive, rel=1e-3)
    # second-order vs exact exponential geodesic: differ at O(rho^3)
    assert inv == pytest.approx(ref_inv, rel=0.03)
    # the trust-region optimum bounds mix from above (up to the O(rho^3) of the
    # second-order geodesic) and Auto-PGD approaches it within a few percent
    assert 0.97 * bound_mix <= mix <= bound_mix * 1.01
    # ... and the sign constraint is inactive here
    assert geodesic_sharpness_mix(X, y, beta, rho_mix, sign_preserving=True) == (
        pytest.approx(bound_mix, rel=1e-9)
    )


def test_auto_pgd_agreement_at_an_interpolating_point_needs_both_signs():
    # At zero training loss the quadratic model is even in xi; the third-order term of
    # the geodesic decides between +-v_max. Antithetic restarts find the better one.
    X, _, u, v = random_instance(7, n=6, d=10)
    y = X @ (u * v)
    batch = batch_of(X, y)[0]
    net = as_net(u, v)
    rho = 0.2
    best, zero = study.apgd_sharpness(
        net, batch, squared_loss, "geodesic", rho, n_iters=100, n_restarts=1
    )
    default = geosharp.sharpness(
        net,
        [batch],
        squared_loss,
        geosharp.Geometry.named("geodesic"),
        rho=rho,
        estimator=geosharp.WorstCase(n_iters=100),
    )
    assert zero == pytest.approx(default.value, rel=1e-12)
    ref = geodesic_sharpness_inv(X, y, u * v, rho)
    assert best == pytest.approx(ref, rel=0.03)
    assert best >= zero


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_geodesic_sharpness_is_invariant_to_rescaling(metric):
    X, y, u, v = random_instance(4)
    rho = 0.05 if metric == "inv" else 0.02
    a = np.exp(np.random.default_rng(0).uniform(-1.5, 1.5, len(u)))
    values, euclidean = [], []
    for uu, vv in ((u, v), (a * u, v / a)):
        net = as_net(uu, vv)
        values.append(
            geosharp.sharpness(
                net,
                batch_of(X, y),
                squared_loss,
                geosharp.Geometry.named("geodesic", metric=metric),
                rho=rho,
                estimator=geosharp.WorstCase(n_iters=50),
            ).value
        )
        euclidean.append(
            geosharp.sharpness(
                net,
                batch_of(X, y),
                squared_loss,
                geosharp.Geometry.named("euclidean"),
                rho=rho,
                estimator=geosharp.WorstCase(n_iters=50),
            ).value
        )
    assert values[1] == pytest.approx(values[0], rel=1e-8)
    # the test can fail: Euclidean sharpness is not invariant
    assert abs(euclidean[1] - euclidean[0]) > 0.1 * abs(euclidean[0])


def test_reduced_forms_are_invariant_to_rescaling():
    X, y, u, v = random_instance(5)
    a = np.exp(np.random.default_rng(1).uniform(-2, 2, len(u)))
    # the reduced geodesic forms see beta only; adaptive sees (u, v) and is invariant too
    assert adaptive_sharpness_diagonal(X, y, a * u, v / a, 0.1) == pytest.approx(
        adaptive_sharpness_diagonal(X, y, u, v, 0.1), rel=1e-9
    )
    assert geodesic_sharpness_inv(X, y, (a * u) * (v / a), 0.1) == pytest.approx(
        geodesic_sharpness_inv(X, y, u * v, 0.1), rel=1e-9
    )


# --- training and the study ---------------------------------------------------------------


def test_training_reaches_the_target_and_conserves_u2_minus_v2():
    rng = np.random.default_rng(0)
    X = rng.standard_normal((10, 15))
    beta_star = np.zeros(15)
    beta_star[:2] = [1.0, -0.7]
    y = X @ beta_star
    hparams = [
        {"alpha": 0.3, "lr": 0.01, "batch_size": 10},
        {"alpha": 0.1, "lr": 0.02, "batch_size": 5},
        {"alpha": 0.5, "lr": 50.0, "batch_size": 10},
    ]  # diverges: halved until stable
    out = study.train_diagonal_networks(X, y, hparams, target_loss=1e-5, max_steps=100_000)
    assert out.converged.all()
    assert (out.train_loss <= 1e-5).all()
    assert out.lr_used[2] < 50.0 and out.lr_used[:2].tolist() == [0.01, 0.02]
    # gradient descent with a small step nearly conserves u^2 - v^2 = alpha^2
    drift = np.abs(out.u[0] ** 2 - out.v[0] ** 2 - 0.09).max()
    assert drift < 0.01
    assert np.abs(out.v[0]).min() > 0  # v leaves its zero initialisation


def test_smoke_study_writes_results_and_figures(tmp_path):
    config = study.DiagonalStudyConfig.smoke()
    fig_dir = tmp_path / "figures"
    summary = study.run_study(config, tmp_path, fig_dir, progress=False)
    assert summary["n_converged"] == config.n_networks
    with (tmp_path / "networks.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == config.n_networks
    assert all(float(r["train_loss"]) <= config.target_loss * 1.0001 for r in rows)
    saved = json.loads((tmp_path / "summary.json").read_text())
    for key in ("adaptive", "geodesic-inv", "reduced-inv", "reduced-mix-ball"):
        assert -1.0 <= saved["taus"][key]["tau"] <= 1.0
    # Auto-PGD with antithetic restarts matches the exact inv geodesic (O(rho^3) apart)
    ratio = saved["apgd_vs_reduced"]["geodesic-inv / reduced-inv"]
    assert 0.97 < ratio["min"] <= ratio["max"] < 1.001
    ratio = saved["apgd_vs_reduced"]["adaptive / reduced-adaptive"]
    assert 0.99 < ratio["min"] <= ratio["max"] < 1.01
    for name in ("diagonal_scatter.png", "diagonal_scatter_all.png"):
        path = fig_dir / name
        assert path.exists() and 5_000 < path.stat().st_size < 300_000
    # the figures can be redrawn from the saved CSV/JSON alone
    redrawn = study.replot(tmp_path, tmp_path / "again", name="again")
    assert [p.name for p in redrawn] == ["again_scatter.png", "again_scatter_all.png"]
    assert all(p.exists() for p in redrawn)


def test_cli_smoke_run(tmp_path, capsys):
    from geosharp.cli import main

    code = main(
        [
            "study",
            "diagonal",
            "--smoke",
            "--quiet",
            "--no-plots",
            "--networks",
            "4",
            "--n-iters",
            "10",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "-0.68" in printed and "-0.83" in printed and "-0.86" in printed
    assert (tmp_path / "taus.csv").exists()
    assert json.loads((tmp_path / "summary.json").read_text())["config"]["n_networks"] == 4


def test_training_and_measurement_are_seeded():
    config = study.DiagonalStudyConfig.smoke()
    runs = []
    for _ in range(2):
        rng = np.random.default_rng(3)
        problem = study.make_problem(config, rng)
        hparams = study.sample_hyperparameters(config, rng)[:3]
        trained = study.train_diagonal_networks(problem.X, problem.y, hparams, seed=3)
        values = study.measure_network(
            problem, trained.u[0], trained.v[0], replace(config, n_iters=10), seed=3
        )
        runs.append((trained.u, trained.v, values))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    np.testing.assert_array_equal(runs[0][1], runs[1][1])
    assert runs[0][2] == runs[1][2]
