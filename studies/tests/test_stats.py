"""Kendall's tau and the bootstrap helper of geosharp_studies.stats."""

import itertools

import numpy as np
import pytest
from scipy import stats as scipy_stats

from geosharp_studies.stats import bootstrap_ci, kendall_tau, kendall_tau_with_ci, reach_tau


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


def test_partial_tau_removes_a_shared_cause():
    from geosharp_studies.stats import partial_tau

    rng = np.random.default_rng(0)
    z = rng.normal(size=300)
    x, y = z + 0.3 * rng.normal(size=300), z + 0.3 * rng.normal(size=300)
    tau = kendall_tau(x, y)
    assert tau > 0.5  # correlated through z only
    # Kendall's partial tau shrinks a shared cause's agreement a lot, though not to 0
    assert abs(partial_tau(x, y, z)) < 0.5 * tau
    w = x + 0.1 * rng.normal(size=300)  # agrees with x beyond what z explains
    assert partial_tau(x, w, z) > 0.8
    assert partial_tau(x, x, y) == pytest.approx(1.0)


def test_tau_difference_is_paired_and_reselects_the_radius():
    from geosharp_studies.stats import calibrated_index, kendall_tau_with_ci, tau_difference

    rng = np.random.default_rng(1)
    gap = rng.normal(size=40)
    a = gap + 0.8 * rng.normal(size=40)
    same = tau_difference(a, a, gap, n_boot=300)
    assert same.estimate == same.low == same.high == 0.0
    # b is a plus tiny noise: each tau is uncertain, their difference is not
    b = a + 0.01 * rng.normal(size=40)
    diff = tau_difference(a, b, gap, n_boot=300)
    single = kendall_tau_with_ci(a, gap, n_boot=300)
    assert diff.high - diff.low < 0.25 * (single.high - single.low)
    # a measure tied to the gap beats noise, and the interval says so
    better = tau_difference(gap + 0.1 * rng.normal(size=40), rng.normal(size=40), gap, n_boot=300)
    assert better.low > 0.3

    # two radii: the rule is applied to the full data and again inside every resample
    grid = np.stack([1e-3 * np.exp(a), 1e-1 * np.exp(rng.normal(size=40))])
    calls = []

    def select(values):
        calls.append(values.shape)
        return calibrated_index(values, 1e-3)

    other = rng.normal(size=40)
    ci = tau_difference(grid, other, gap, select_a=select, n_boot=50)
    assert len(calls) == 51 and all(shape == (2, 40) for shape in calls)
    assert calibrated_index(grid, 1e-3) == 0
    expected = kendall_tau(grid[0], gap, "b") - kendall_tau(other, gap, "b")
    assert ci.estimate == pytest.approx(expected)
    absolute = tau_difference(-a, a, gap, absolute=True, n_boot=50)
    assert absolute.estimate == 0.0
    with pytest.raises(ValueError, match="select"):
        tau_difference(grid, grid, gap)


def test_star_design_gives_exact_one_axis_groups_and_a_granulated_tau_with_ci():
    from geosharp_studies.design import star_design
    from geosharp_studies.stats import granulated_tau, granulated_tau_ci, grouped_granulated_tau

    rng = np.random.default_rng(0)
    bases = [{"lr": lr, "wd": wd, "bs": 32} for lr, wd in [(1, 0), (2, 0.1), (3, 0), (1, 0.1)]]
    configs, groups = star_design(bases, {"lr": [1, 2, 3], "wd": [0, 0.1], "bs": [16, 64]})
    assert len(configs) == 4 * (1 + 2 + 1 + 2)
    for b, by_axis in enumerate(groups):
        for axis, members in by_axis.items():
            base = configs[members[0]]
            assert base["varied"] is None and base["base"] == b
            for i in members[1:]:  # differs from its base in `axis` alone
                diff = {k for k in ("lr", "wd", "bs") if configs[i][k] != base[k]}
                assert diff == {axis} and configs[i]["varied"] == axis

    gap = np.array([c["lr"] + 10 * c["wd"] + c["bs"] / 16 for c in configs]) + rng.normal(
        scale=0.01, size=len(configs)
    )
    same = granulated_tau_ci(gap, gap, groups, n_boot=200)
    assert same.estimate == same.low == same.high == 1.0
    assert granulated_tau_ci(-gap, gap, groups, n_boot=200).estimate == -1.0
    noise = granulated_tau_ci(rng.normal(size=len(configs)), gap, groups, n_boot=200)
    assert noise.low < 0 < noise.high
    # on a star design the pair-based variant agrees with the exact one for a perfect measure
    hps = [{k: c[k] for k in ("lr", "wd", "bs")} for c in configs]
    assert granulated_tau(gap, gap, hps, ["lr", "wd", "bs"])["granulated"] == 1.0
    by_axis = {}
    for g in groups:
        for axis, idx in g.items():
            by_axis.setdefault(axis, []).append(idx)
    assert grouped_granulated_tau(gap, gap, by_axis)["per_axis"]["lr"]["groups"] == 4
    with pytest.raises(ValueError, match="no value"):
        star_design([{"lr": 1}], {"wd": [0.1]})


def test_reach_tau_ranks_the_columns_taus_by_their_median():
    """Columns whose tau with the target rises with their median give +1 whatever their
    order; shuffling which median goes with which tau breaks it; the interval resamples
    models, so it holds the estimate and is reproducible."""
    rng = np.random.default_rng(0)
    gap = rng.normal(size=30)
    noise = rng.normal(size=(5, 30))
    weights = np.linspace(0.0, 3.0, 5)  # more of the gap in the larger columns
    columns = np.exp(weights[:, None] * gap + noise) * (10.0 ** np.arange(5))[:, None]
    taus = [kendall_tau(c, gap, "b") for c in columns]
    expected = kendall_tau(np.median(columns, axis=1), taus, "b")
    ci = reach_tau(columns, gap, n_boot=200, seed=1)
    assert ci.estimate == pytest.approx(expected) and expected == pytest.approx(1.0)
    assert ci.low <= ci.estimate <= ci.high and ci == reach_tau(columns, gap, n_boot=200, seed=1)
    assert reach_tau(columns[::-1], gap, n_boot=10).estimate == pytest.approx(1.0)
    scrambled = (
        columns / (10.0 ** np.arange(5))[:, None] * (10.0 ** np.array([4, 0, 3, 1, 2]))[:, None]
    )
    assert reach_tau(scrambled, gap, n_boot=10).estimate < 0.5
    with pytest.raises(ValueError, match="columns >= 2"):
        reach_tau(columns[:1], gap)
    with pytest.raises(ValueError, match="one target per model"):
        reach_tau(columns, gap[:-1])
