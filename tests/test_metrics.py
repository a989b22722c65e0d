"""Metrics against independent references: scipy, sklearn and closed forms."""

import math

import numpy as np
import pytest
from scipy import stats
from scipy.integrate import trapezoid
from sklearn.metrics import accuracy_score, mean_squared_error

from numpyro_fed import metrics


def random_cov(rng, d, rank=None):
    factor = rng.normal(size=(d, rank or d))
    return factor @ factor.T + (0.1 * np.eye(d) if rank is None else 0.0)


# --------------------------------------------------------------------------
# Wasserstein


def test_marginal_w1_matches_scipy_with_unequal_sizes():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(300, 3))
    b = rng.standard_t(3, size=(457, 3)) + [0.5, -1.0, 0.0]
    got = metrics.marginal_w1(a, b)
    expected = [stats.wasserstein_distance(a[:, j], b[:, j]) for j in range(3)]
    assert got.shape == (3,)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


def test_marginal_w1_one_dimensional_input_and_ties():
    a = np.array([0.0, 0.0, 1.0, 3.0])
    b = np.array([1.0, 1.0, 2.0])
    got = metrics.marginal_w1(a, b)
    assert got.shape == (1,)
    assert got[0] == pytest.approx(stats.wasserstein_distance(a, b), abs=1e-12)
    # shifting a sample moves W1 by exactly the shift
    assert metrics.marginal_w1(a, a + 2.5)[0] == pytest.approx(2.5)


def test_marginal_w1_accepts_jax_arrays():
    jnp = pytest.importorskip("jax.numpy")
    a = np.linspace(0.0, 1.0, 11)
    assert metrics.marginal_w1(jnp.asarray(a), jnp.asarray(a + 1.0))[0] == pytest.approx(1.0, abs=1e-6)


def test_marginal_w1_errors():
    with pytest.raises(ValueError, match="same number of coordinates, got 2 and 3"):
        metrics.marginal_w1(np.zeros((5, 2)), np.zeros((5, 3)))
    with pytest.raises(ValueError, match=r"samples_a must have shape \(S,\) or \(S, d\)"):
        metrics.marginal_w1(np.zeros((5, 2, 1)), np.zeros((5, 2)))
    with pytest.raises(ValueError, match="samples_b must not contain NaN"):
        metrics.marginal_w1(np.zeros(3), [0.0, np.nan])
    with pytest.raises(ValueError, match="samples_a must hold at least one sample"):
        metrics.marginal_w1(np.zeros((0, 2)), np.zeros((3, 2)))


@pytest.mark.parametrize("m1, s1, m2, s2", [(0.0, 1.0, 3.0, 2.0), (-1.5, 0.3, -1.5, 0.3), (2.0, 0.0, 0.0, 1.0)])
def test_gaussian_w2_one_dimensional_closed_form(m1, s1, m2, s2):
    expected = math.sqrt((m1 - m2) ** 2 + (s1 - s2) ** 2)
    assert metrics.gaussian_w2([m1], [[s1**2]], [m2], [[s2**2]]) == pytest.approx(expected, abs=1e-12)
    assert metrics.gaussian_w2(m1, s1**2, m2, s2**2) == pytest.approx(expected, abs=1e-12)


def test_gaussian_w2_commuting_covariances():
    rng = np.random.default_rng(1)
    basis, _ = np.linalg.qr(rng.normal(size=(4, 4)))
    var1 = np.array([0.5, 1.0, 2.0, 7.0])
    var2 = np.array([3.0, 0.1, 2.0, 1.0])
    mean1, mean2 = rng.normal(size=4), rng.normal(size=4)
    cov1 = basis @ np.diag(var1) @ basis.T
    cov2 = basis @ np.diag(var2) @ basis.T
    # commuting case: W2^2 = |dm|^2 + sum (sqrt(a_i) - sqrt(b_i))^2
    expected = math.sqrt(np.sum((mean1 - mean2) ** 2) + np.sum((np.sqrt(var1) - np.sqrt(var2)) ** 2))
    assert metrics.gaussian_w2(mean1, cov1, mean2, cov2) == pytest.approx(expected, rel=1e-10)


def test_gaussian_w2_general_against_eigenvalue_formula():
    rng = np.random.default_rng(2)
    for d in (2, 5):
        cov1, cov2 = random_cov(rng, d), random_cov(rng, d)
        mean1, mean2 = rng.normal(size=d), rng.normal(size=d)
        # tr((C2^1/2 C1 C2^1/2)^1/2) = sum_i sqrt(eig_i(C1 C2)), an independent route
        cross = np.sum(np.sqrt(np.linalg.eigvals(cov1 @ cov2).real))
        expected = math.sqrt(np.sum((mean1 - mean2) ** 2) + np.trace(cov1) + np.trace(cov2) - 2 * cross)
        got = metrics.gaussian_w2(mean1, cov1, mean2, cov2)
        assert got == pytest.approx(expected, rel=1e-8)
        assert metrics.gaussian_w2(mean2, cov2, mean1, cov1) == pytest.approx(got, rel=1e-8)
        assert metrics.gaussian_w2(mean1, cov1, mean1, cov1) == pytest.approx(0.0, abs=1e-6)


def test_gaussian_w2_singular_covariances():
    # both supported on the first axis: reduces to the 1-D formula
    got = metrics.gaussian_w2([0.0, 0.0], np.diag([1.0, 0.0]), [0.0, 1.0], np.diag([4.0, 0.0]))
    assert got == pytest.approx(math.sqrt(1.0 + 1.0), abs=1e-12)
    rng = np.random.default_rng(3)
    low_rank = random_cov(rng, 4, rank=2)
    full = random_cov(rng, 4)
    value = metrics.gaussian_w2(np.zeros(4), low_rank, np.zeros(4), full)
    cross = np.sum(np.sqrt(np.clip(np.linalg.eigvals(low_rank @ full).real, 0, None)))
    assert value == pytest.approx(math.sqrt(np.trace(low_rank) + np.trace(full) - 2 * cross), rel=1e-6)


def test_gaussian_w2_from_samples_converges_to_exact_value():
    rng = np.random.default_rng(4)
    cov1, cov2 = random_cov(rng, 3), random_cov(rng, 3)
    mean1, mean2 = np.array([1.0, 0.0, -1.0]), np.zeros(3)
    draws = rng.multivariate_normal(mean1, cov1, size=200_000)
    exact = metrics.gaussian_w2(mean1, cov1, mean2, cov2)
    assert metrics.gaussian_w2_from_samples(draws, mean2, cov2) == pytest.approx(exact, rel=0.02)
    one_d = rng.normal(2.0, 3.0, size=100_000)
    assert metrics.gaussian_w2_from_samples(one_d, [0.0], [[1.0]]) == pytest.approx(math.sqrt(4 + 4), rel=0.02)


def test_gaussian_w2_errors():
    with pytest.raises(ValueError, match="cov1 must be symmetric"):
        metrics.gaussian_w2(np.zeros(2), [[1.0, 0.5], [0.0, 1.0]], np.zeros(2), np.eye(2))
    with pytest.raises(ValueError, match="cov2 must be positive semi-definite"):
        metrics.gaussian_w2(np.zeros(2), np.eye(2), np.zeros(2), np.diag([1.0, -1.0]))
    with pytest.raises(ValueError, match=r"cov1 must have shape \(2, 2\) to match mean1"):
        metrics.gaussian_w2(np.zeros(2), np.eye(3), np.zeros(2), np.eye(2))
    with pytest.raises(ValueError, match="mean1 and mean2 must have the same dimension"):
        metrics.gaussian_w2(np.zeros(2), np.eye(2), np.zeros(3), np.eye(3))
    with pytest.raises(ValueError, match="samples must hold at least 2 draws"):
        metrics.gaussian_w2_from_samples(np.zeros((1, 2)), np.zeros(2), np.eye(2))


# --------------------------------------------------------------------------
# KL and KDE


def gaussian_kl(m1, s1, m2, s2):
    return math.log(s2 / s1) + (s1**2 + (m1 - m2) ** 2) / (2 * s2**2) - 0.5


@pytest.mark.parametrize("m1, s1, m2, s2", [(0.0, 1.0, 1.0, 1.0), (0.5, 0.7, -1.0, 2.0), (2.0, 1.5, 2.0, 0.8)])
def test_kl_1d_matches_gaussian_closed_form(m1, s1, m2, s2):
    grid = np.linspace(-20, 20, 8001)
    expected = gaussian_kl(m1, s1, m2, s2)
    from_callables = metrics.kl_1d(stats.norm(m1, s1).logpdf, stats.norm(m2, s2).logpdf, grid)
    assert from_callables == pytest.approx(expected, rel=1e-6, abs=1e-9)
    # values on the grid, unnormalised by arbitrary constants: same answer
    from_values = metrics.kl_1d(stats.norm(m1, s1).logpdf(grid) + 3.0, stats.norm(m2, s2).logpdf(grid) - 7.0, grid)
    assert from_values == pytest.approx(expected, rel=1e-6, abs=1e-9)


def test_kl_1d_is_infinite_when_q_vanishes_on_support_of_p():
    # fine grid: the trapezoid rule blurs the uniform's jumps by one grid step
    grid = np.linspace(-5, 5, 100_001)
    narrow_uniform = np.where(np.abs(grid) <= 1, 0.0, -np.inf)
    assert metrics.kl_1d(stats.norm().logpdf, narrow_uniform, grid) == math.inf
    # the other way round is finite: log(1/2) - E_U[log phi] over U(-1, 1)
    expected = -math.log(2) + 0.5 * math.log(2 * math.pi) + 1 / 6
    assert metrics.kl_1d(narrow_uniform, stats.norm().logpdf, grid) == pytest.approx(expected, rel=1e-3)


def test_kl_1d_errors():
    grid = np.linspace(-1, 1, 5)
    with pytest.raises(ValueError, match="grid must be strictly increasing"):
        metrics.kl_1d(np.zeros(5), np.zeros(5), grid[::-1])
    with pytest.raises(ValueError, match="log_q must give one log-density value per grid point"):
        metrics.kl_1d(np.zeros(5), np.zeros(4), grid)
    with pytest.raises(ValueError, match="log_p is zero on the whole grid"):
        metrics.kl_1d(np.full(5, -np.inf), np.zeros(5), grid)
    with pytest.raises(ValueError, match="grid must be 1-D with at least 2 points"):
        metrics.kl_1d(np.zeros(1), np.zeros(1), [0.0])


@pytest.mark.parametrize("num_samples", [50, 6000])  # 6000 x 1000 crosses the chunk size
def test_kde_1d_matches_scipy_gaussian_kde(num_samples):
    rng = np.random.default_rng(5)
    samples = np.r_[rng.normal(-2, 0.5, num_samples // 2), rng.normal(1, 1, num_samples - num_samples // 2)]
    grid = np.linspace(-6, 6, 1000)
    bandwidth = 0.55
    # gaussian_kde's kernel std is factor * sample std (ddof=1)
    reference = stats.gaussian_kde(samples, bw_method=bandwidth / samples.std(ddof=1))(grid)
    np.testing.assert_allclose(metrics.kde_1d(samples, grid, bandwidth), reference, rtol=1e-10, atol=1e-14)


def test_kde_1d_integrates_to_one_and_errors():
    grid = np.linspace(-10, 10, 4001)
    density = metrics.kde_1d(np.array([-1.0, 0.0, 2.5]), grid, 0.3)
    assert trapezoid(density, grid) == pytest.approx(1.0, rel=1e-8)
    with pytest.raises(ValueError, match="bandwidth must be a finite number > 0"):
        metrics.kde_1d([0.0], grid, 0.0)
    with pytest.raises(ValueError, match="samples must be 1-D draws"):
        metrics.kde_1d(np.zeros((3, 2)), grid, 1.0)


# --------------------------------------------------------------------------
# predictive metrics


def test_accuracy_binary_and_multiclass_match_sklearn():
    rng = np.random.default_rng(6)
    probs = rng.uniform(size=500)
    y = rng.integers(0, 2, size=500)
    assert metrics.accuracy(probs, y) == pytest.approx(accuracy_score(y, probs >= 0.5))
    logits = rng.normal(size=(500, 4))
    class_probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    labels = rng.integers(0, 4, size=500)
    assert metrics.accuracy(class_probs, labels) == pytest.approx(accuracy_score(labels, class_probs.argmax(1)))
    # labels stored as floats (as the loaders return them) are fine
    assert metrics.accuracy(probs, y.astype(float)) == metrics.accuracy(probs, y)


def test_accuracy_accepts_jax_arrays():
    jnp = pytest.importorskip("jax.numpy")
    assert metrics.accuracy(jnp.array([0.9, 0.1, 0.5]), jnp.array([1, 1, 1])) == pytest.approx(2 / 3)


def test_log_predictive_density_matches_direct_formula_and_is_stable():
    rng = np.random.default_rng(7)
    log_lik = rng.normal(-1.0, 0.5, size=(200, 30))
    direct = np.mean(np.log(np.mean(np.exp(log_lik), axis=0)))
    assert metrics.log_predictive_density(log_lik) == pytest.approx(direct, rel=1e-12)
    # exp(-1000) underflows; the answer is still exact
    assert metrics.log_predictive_density(np.full((10, 3), -1000.0)) == pytest.approx(-1000.0)
    with pytest.raises(ValueError, match=r"log_lik_draws must have shape \(S, n\)"):
        metrics.log_predictive_density(np.zeros(5))


def brute_force_ece_mce(confidence, correct, num_bins):
    ece, mce = 0.0, 0.0
    for b in range(num_bins):
        lo, hi = b / num_bins, (b + 1) / num_bins
        in_bin = (confidence > lo) & (confidence <= hi) if b else (confidence <= hi)
        if in_bin.any():
            gap = abs(correct[in_bin].mean() - confidence[in_bin].mean())
            ece += in_bin.mean() * gap
            mce = max(mce, gap)
    return ece, mce


@pytest.mark.parametrize("num_bins", [5, 10, 15])
def test_calibration_errors_match_brute_force_binning(num_bins):
    rng = np.random.default_rng(8)
    logits = 2 * rng.normal(size=(400, 3))
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    y = rng.integers(0, 3, size=400)
    confidence = probs.max(axis=1)
    correct = (probs.argmax(axis=1) == y).astype(float)
    ece, mce = brute_force_ece_mce(confidence, correct, num_bins)
    assert metrics.expected_calibration_error(probs, y, num_bins) == pytest.approx(ece, abs=1e-12)
    assert metrics.maximum_calibration_error(probs, y, num_bins) == pytest.approx(mce, abs=1e-12)


def test_binary_calibration_uses_predicted_class_confidence():
    probs = np.array([0.95, 0.85, 0.15, 0.3])
    y = np.array([1, 0, 0, 1])
    # confidences .95 (right), .85 (wrong), .85 (right), .7 (wrong)
    diagram = metrics.reliability_diagram(probs, y, num_bins=10)
    assert diagram.counts.tolist() == [0, 0, 0, 0, 0, 0, 1, 0, 2, 1]
    np.testing.assert_allclose(diagram.confidence[[6, 8, 9]], [0.7, 0.85, 0.95])
    np.testing.assert_allclose(diagram.accuracy[[6, 8, 9]], [0.0, 0.5, 1.0])
    assert np.all(np.isnan(diagram.accuracy[[0, 1, 7]]))
    expected_ece = (0.7 + 2 * 0.35 + 0.05) / 4
    assert metrics.expected_calibration_error(probs, y) == pytest.approx(expected_ece)
    assert metrics.maximum_calibration_error(probs, y) == pytest.approx(0.7)


def test_calibrated_predictions_have_small_ece():
    rng = np.random.default_rng(9)
    probs = rng.uniform(size=200_000)
    y = (rng.uniform(size=probs.size) < probs).astype(int)
    assert metrics.expected_calibration_error(probs, y) < 0.01
    overconfident = np.clip(probs + 0.3 * np.sign(probs - 0.5), 0, 1)
    assert metrics.expected_calibration_error(overconfident, y) > 0.2


def test_rmse_matches_sklearn():
    rng = np.random.default_rng(10)
    pred, y = rng.normal(size=100), rng.normal(size=100)
    assert metrics.rmse(pred, y) == pytest.approx(math.sqrt(mean_squared_error(y, pred)))
    with pytest.raises(ValueError, match=r"pred and y must have the same shape, got \(100,\) and \(99,\)"):
        metrics.rmse(pred, y[:-1])


def test_classification_metric_errors():
    with pytest.raises(ValueError, match="probs and y must have the same number of rows"):
        metrics.accuracy([0.1, 0.2], [0])
    with pytest.raises(ValueError, match=r"probs must lie in \[0, 1\]"):
        metrics.accuracy([1.2, 0.2], [0, 1])
    with pytest.raises(ValueError, match=r"each row of probs \(n, K\) must sum to 1"):
        metrics.accuracy([[0.5, 0.6]], [0])
    with pytest.raises(ValueError, match="y must hold non-negative integer class labels"):
        metrics.accuracy([0.1, 0.2], [0, 0.5])
    with pytest.raises(ValueError, match=r"y must be 0/1 when probs has shape \(n,\)"):
        metrics.accuracy([0.1, 0.2], [0, 2])
    with pytest.raises(ValueError, match="y holds a label >= K = 2"):
        metrics.accuracy([[0.5, 0.5]], [2])
    with pytest.raises(ValueError, match="num_bins must be an integer >= 1"):
        metrics.expected_calibration_error([0.1], [0], num_bins=0)
