"""Kendall's tau and the bootstrap helper of geosharp.studies.stats."""

import itertools

import numpy as np
import pytest
from scipy import stats as scipy_stats

from geosharp.studies.stats import bootstrap_ci, kendall_tau, kendall_tau_with_ci


def brute_force_tau_a(a, b):
    n = len(a)
    total = sum(
        np.sign(a[i] - a[j]) * np.sign(b[i] - b[j]) for i, j in itertools.combinations(range(n), 2)
    )
    return total / (n * (n - 1) / 2)


@pytest.mark.parametrize("seed", range(5))
def test_kendall_tau_matches_scipy_without_ties(seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(40)
    b = 0.5 * a + rng.standard_normal(40)
    expected = scipy_stats.kendalltau(a, b).statistic
    assert kendall_tau(a, b) == pytest.approx(expected, abs=1e-12)
    assert kendall_tau(a, b, variant="b") == pytest.approx(expected, abs=1e-12)


def test_kendall_tau_with_ties():
    rng = np.random.default_rng(3)
    a = rng.integers(0, 4, 30).astype(float)
    b = a + rng.integers(0, 3, 30)
    assert kendall_tau(a, b) == pytest.approx(brute_force_tau_a(a, b), abs=1e-12)
    assert kendall_tau(a, b, variant="b") == pytest.approx(
        scipy_stats.kendalltau(a, b).statistic, abs=1e-12
    )
    # with ties, tau-a is strictly smaller in magnitude than tau-b
    assert abs(kendall_tau(a, b)) < abs(kendall_tau(a, b, variant="b"))


def test_kendall_tau_extremes_and_invariance_to_monotone_maps():
    a = np.array([0.3, 1.2, -0.5, 4.0, 2.2])
    assert kendall_tau(a, a) == 1.0
    assert kendall_tau(a, -a) == -1.0
    b = np.array([1.0, 0.0, 2.0, 5.0, 3.0])
    assert kendall_tau(np.exp(a), b**3) == pytest.approx(kendall_tau(a, b))
    assert np.isnan(kendall_tau([1.0], [2.0]))
    with pytest.raises(ValueError):
        kendall_tau([1.0, 2.0], [1.0])
    with pytest.raises(ValueError):
        kendall_tau([1.0, np.nan], [1.0, 2.0])


def test_bootstrap_ci_reproducible_and_sensible():
    rng = np.random.default_rng(0)
    a = rng.standard_normal(50)
    b = -a + 0.7 * rng.standard_normal(50)
    ci = kendall_tau_with_ci(a, b, n_boot=500, seed=1)
    again = kendall_tau_with_ci(a, b, n_boot=500, seed=1)
    assert ci == again
    assert ci.estimate == pytest.approx(kendall_tau(a, b))
    assert ci.low <= ci.estimate <= ci.high < 0
    assert 0 < ci.std_error < 0.2
    # more data -> narrower interval
    a2 = rng.standard_normal(400)
    b2 = -a2 + 0.7 * rng.standard_normal(400)
    wide = ci.high - ci.low
    narrow = kendall_tau_with_ci(a2, b2, n_boot=300, seed=1)
    assert narrow.high - narrow.low < 0.6 * wide


def test_bootstrap_ci_of_the_mean_matches_normal_theory():
    rng = np.random.default_rng(5)
    x = rng.standard_normal(200) + 3.0
    ci = bootstrap_ci(np.mean, x, n_boot=2000, seed=0)
    se = x.std(ddof=1) / np.sqrt(len(x))
    assert ci.std_error == pytest.approx(se, rel=0.15)
    assert ci.low == pytest.approx(x.mean() - 1.96 * se, abs=0.3 * se)
    assert ci.high == pytest.approx(x.mean() + 1.96 * se, abs=0.3 * se)


def test_bootstrap_ci_validates_arguments():
    with pytest.raises(ValueError):
        bootstrap_ci(np.mean)
    with pytest.raises(ValueError):
        bootstrap_ci(kendall_tau, [1.0, 2.0], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError):
        bootstrap_ci(np.mean, [1.0, 2.0], level=1.5)
