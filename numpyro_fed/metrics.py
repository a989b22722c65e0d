"""Distances between distributions and predictive metrics (numpy/scipy).

Every function accepts numpy arrays, jax arrays or nested lists and returns
numpy values or Python floats.

>>> import numpy as np
>>> from numpyro_fed import metrics
>>> metrics.gaussian_w2(np.zeros(2), np.eye(2), np.ones(2), np.eye(2))
1.4142135623730951
"""

from __future__ import annotations

import math
import numbers
from typing import Callable, NamedTuple

import numpy as np
from scipy import special
from scipy.integrate import trapezoid

from numpyro_fed._checks import check_int, check_positive

__all__ = [
    "ReliabilityDiagram",
    "accuracy",
    "expected_calibration_error",
    "gaussian_w2",
    "gaussian_w2_from_samples",
    "kde_1d",
    "kl_1d",
    "kl_metric_1d",
    "classification_metrics",
    "regression_metrics",
    "log_predictive_density",
    "marginal_w1",
    "maximum_calibration_error",
    "reliability_diagram",
    "rmse",
]

# Tolerances for inputs that are mathematically exact but numerically not:
# covariances from np.cov / float32 samplers, softmax rows from jax.
_SYMMETRY_RTOL = 1e-6
_PSD_RTOL = 1e-8
_PROB_ATOL = 1e-6
_ROW_SUM_ATOL = 1e-3


# --------------------------------------------------------------------------
# input checks


def _as_float_array(value, name: str) -> np.ndarray:
    try:
        array = np.asarray(value, dtype=float)
    except (TypeError, ValueError) as error:
        raise TypeError(f"{name} must be a numeric array, got {type(value).__name__}") from error
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name} must not contain NaN or infinite values")
    return array


def _check_mean_cov(mean, cov, which: str) -> tuple[np.ndarray, np.ndarray]:
    mean = _as_float_array(mean, f"mean{which}")
    cov = _as_float_array(cov, f"cov{which}")
    if mean.ndim == 0:
        mean = mean[None]
    if cov.ndim == 0:
        cov = cov[None, None]
    if mean.ndim != 1:
        raise ValueError(f"mean{which} must be 1-D (d,), got shape {mean.shape}")
    d = mean.shape[0]
    if cov.shape != (d, d):
        raise ValueError(f"cov{which} must have shape ({d}, {d}) to match mean{which}, got {cov.shape}")
    scale = max(float(np.max(np.abs(cov))), np.finfo(float).tiny)
    if np.max(np.abs(cov - cov.T)) > _SYMMETRY_RTOL * scale:
        raise ValueError(f"cov{which} must be symmetric")
    cov = (cov + cov.T) / 2
    if np.linalg.eigvalsh(cov).min() < -_PSD_RTOL * scale:
        raise ValueError(f"cov{which} must be positive semi-definite")
    return mean, cov


def _psd_sqrt(matrix: np.ndarray) -> np.ndarray:
    """Square root of a symmetric PSD matrix.

    An eigendecomposition is used rather than ``scipy.linalg.sqrtm``: sqrtm's
    Schur method can return complex parts or lose symmetry on (nearly)
    singular input, whereas here negative round-off eigenvalues are clipped
    and the result is symmetric and real by construction.
    """
    eigenvalues, eigenvectors = np.linalg.eigh((matrix + matrix.T) / 2)
    return (eigenvectors * np.sqrt(np.clip(eigenvalues, 0.0, None))) @ eigenvectors.T


def _as_samples_2d(samples, name: str) -> np.ndarray:
    samples = _as_float_array(samples, name)
    if samples.ndim == 1:
        samples = samples[:, None]
    if samples.ndim != 2:
        raise ValueError(f"{name} must have shape (S,) or (S, d), got {samples.shape}")
    if samples.shape[0] == 0:
        raise ValueError(f"{name} must hold at least one sample")
    return samples


def _check_grid(grid) -> np.ndarray:
    grid = _as_float_array(grid, "grid")
    if grid.ndim != 1 or grid.size < 2:
        raise ValueError(f"grid must be 1-D with at least 2 points, got shape {grid.shape}")
    if np.any(np.diff(grid) <= 0):
        raise ValueError("grid must be strictly increasing")
    return grid


# --------------------------------------------------------------------------
# Wasserstein distances


def gaussian_w2(mean1, cov1, mean2, cov2) -> float:
    """2-Wasserstein distance between two Gaussians, in closed form.

    .. math::

        W_2^2 = \\lVert m_1 - m_2 \\rVert^2 + \\operatorname{tr}\\bigl(
        C_1 + C_2 - 2 (C_2^{1/2} C_1 C_2^{1/2})^{1/2} \\bigr)

    (Givens & Shortt 1984). Covariances may be singular. Scalars are read as
    1-D means/variances.

    :param mean1: mean ``(d,)``.
    :param cov1: covariance ``(d, d)``, symmetric positive semi-definite.
    :param mean2: mean ``(d,)``.
    :param cov2: covariance ``(d, d)``, symmetric positive semi-definite.
    :returns: the distance (not squared).
    :raises ValueError: on mismatched shapes, or a non-symmetric or
        indefinite covariance.

    >>> gaussian_w2(0.0, 1.0, 3.0, 4.0)  # 1-D: sqrt((0-3)^2 + (1-2)^2)
    3.1622776601683795
    """
    mean1, cov1 = _check_mean_cov(mean1, cov1, "1")
    mean2, cov2 = _check_mean_cov(mean2, cov2, "2")
    if mean1.shape != mean2.shape:
        raise ValueError(f"mean1 and mean2 must have the same dimension, got {mean1.shape} and {mean2.shape}")
    sqrt_cov2 = _psd_sqrt(cov2)
    cross = _psd_sqrt(sqrt_cov2 @ cov1 @ sqrt_cov2)
    squared = np.sum((mean1 - mean2) ** 2) + np.trace(cov1) + np.trace(cov2) - 2.0 * np.trace(cross)
    # Round-off can push identical distributions a hair below zero.
    return math.sqrt(max(float(squared), 0.0))


def gaussian_w2_from_samples(samples, mean, cov) -> float:
    """W2 between the Gaussian fitted to ``samples`` and ``N(mean, cov)``.

    The fit uses the sample mean and the unbiased (``ddof=1``) sample
    covariance, as in the D-ADMMS experiments where the iterates' law is
    Gaussian.

    :param samples: draws of shape ``(S, d)`` (or ``(S,)`` for ``d = 1``), ``S >= 2``.
    :param mean: target mean ``(d,)``.
    :param cov: target covariance ``(d, d)``.

    >>> import numpy as np
    >>> draws = np.random.default_rng(0).normal(size=(100_000, 2))
    >>> bool(gaussian_w2_from_samples(draws, np.zeros(2), np.eye(2)) < 0.02)
    True
    """
    samples = _as_samples_2d(samples, "samples")
    if samples.shape[0] < 2:
        raise ValueError("samples must hold at least 2 draws to estimate a covariance")
    sample_cov = np.atleast_2d(np.cov(samples, rowvar=False, ddof=1))
    return gaussian_w2(samples.mean(axis=0), sample_cov, mean, cov)


def _w1_1d(a: np.ndarray, b: np.ndarray) -> float:
    # W1 = integral |F_a - F_b| over the real line; both CDFs are step
    # functions, constant between consecutive points of the pooled sample.
    a = np.sort(a)
    b = np.sort(b)
    pooled = np.sort(np.concatenate([a, b]))
    widths = np.diff(pooled)
    cdf_a = np.searchsorted(a, pooled[:-1], side="right") / a.size
    cdf_b = np.searchsorted(b, pooled[:-1], side="right") / b.size
    return float(np.sum(np.abs(cdf_a - cdf_b) * widths))


def marginal_w1(samples_a, samples_b) -> np.ndarray:
    """Exact 1-Wasserstein distance between the empirical marginals, per coordinate.

    :param samples_a: draws of shape ``(S_a,)`` or ``(S_a, d)``.
    :param samples_b: draws of shape ``(S_b,)`` or ``(S_b, d)``; ``S_b`` may
        differ from ``S_a``, ``d`` may not.
    :returns: array of ``d`` distances.

    >>> marginal_w1([0.0, 1.0], [0.5, 1.5, 2.5]).round(4).tolist()
    [1.0]
    """
    samples_a = _as_samples_2d(samples_a, "samples_a")
    samples_b = _as_samples_2d(samples_b, "samples_b")
    if samples_a.shape[1] != samples_b.shape[1]:
        raise ValueError(
            f"samples_a and samples_b must have the same number of coordinates, "
            f"got {samples_a.shape[1]} and {samples_b.shape[1]}"
        )
    return np.array([_w1_1d(samples_a[:, j], samples_b[:, j]) for j in range(samples_a.shape[1])])


# --------------------------------------------------------------------------
# 1-D densities


def _log_density_on_grid(log_density, grid: np.ndarray, name: str) -> np.ndarray:
    values = log_density(grid) if callable(log_density) else log_density
    try:
        values = np.asarray(values, dtype=float)
    except (TypeError, ValueError) as error:
        raise TypeError(f"{name} must be a callable or an array of log-density values") from error
    if values.shape != grid.shape:
        raise ValueError(
            f"{name} must give one log-density value per grid point: shape {values.shape} != grid {grid.shape}"
        )
    if np.any(np.isnan(values)) or np.any(values == np.inf):
        raise ValueError(f"{name} must not contain NaN or +inf")
    if np.all(values == -np.inf):
        raise ValueError(f"{name} is zero on the whole grid")
    return values


def _normalize_log_density(log_values: np.ndarray, grid: np.ndarray) -> np.ndarray:
    peak = log_values.max()
    log_norm = peak + np.log(trapezoid(np.exp(log_values - peak), grid))
    return log_values - log_norm


def kl_1d(log_p: Callable | np.ndarray, log_q: Callable | np.ndarray, grid) -> float:
    """KL divergence ``KL(p || q)`` between two 1-D densities, by quadrature.

    Both densities are renormalized on ``grid`` (trapezoid rule), so
    unnormalized log densities are fine; the grid should cover the mass of
    ``p``. Where ``p`` vanishes the integrand is 0; where ``q`` vanishes but
    ``p`` does not, the result is ``inf``.

    :param log_p: callable ``grid -> log p(grid)`` or the values on ``grid``.
    :param log_q: callable or values, likewise.
    :param grid: strictly increasing 1-D grid.
    :returns: the divergence in nats.

    >>> import numpy as np
    >>> from scipy import stats
    >>> grid = np.linspace(-10, 10, 2001)
    >>> kl = kl_1d(stats.norm(0, 1).logpdf, stats.norm(1, 1).logpdf, grid)
    >>> round(kl, 6)  # closed form: (0 - 1)^2 / 2
    0.5
    """
    grid = _check_grid(grid)
    log_p = _normalize_log_density(_log_density_on_grid(log_p, grid, "log_p"), grid)
    log_q = _normalize_log_density(_log_density_on_grid(log_q, grid, "log_q"), grid)
    p = np.exp(log_p)
    support = p > 0
    if np.any(support & (log_q == -np.inf)):
        return math.inf
    integrand = np.zeros_like(grid)
    integrand[support] = p[support] * (log_p[support] - log_q[support])
    return float(trapezoid(integrand, grid))


def kde_1d(samples, grid, bandwidth: float) -> np.ndarray:
    """Gaussian kernel density estimate of 1-D samples, evaluated on ``grid``.

    :param samples: draws of shape ``(S,)`` (or ``(S, 1)``).
    :param grid: points of shape ``(G,)`` at which to evaluate.
    :param bandwidth: standard deviation of the Gaussian kernel, ``> 0``
        (DSVGD's experiments use 0.55).
    :returns: density values of shape ``(G,)``.

    >>> import numpy as np
    >>> kde_1d([0.0], np.array([0.0]), 1.0).round(4).tolist()  # N(0|0,1)
    [0.3989]
    """
    samples = _as_samples_2d(samples, "samples")
    if samples.shape[1] != 1:
        raise ValueError(f"samples must be 1-D draws, got shape {samples.shape}")
    samples = samples[:, 0]
    grid = _as_float_array(grid, "grid")
    if grid.ndim != 1:
        raise ValueError(f"grid must be 1-D, got shape {grid.shape}")
    if (
        isinstance(bandwidth, bool)
        or not isinstance(bandwidth, numbers.Real)
        or not (math.isfinite(bandwidth) and bandwidth > 0)
    ):
        raise ValueError(f"bandwidth must be a finite number > 0, got {bandwidth!r}")
    density = np.zeros(grid.shape)
    # Chunked so that S x G never materialises for large sample sets.
    chunk = max(1, 2**22 // max(grid.size, 1))
    for start in range(0, samples.size, chunk):
        z = (grid[:, None] - samples[None, start : start + chunk]) / bandwidth
        density += np.exp(-0.5 * z**2).sum(axis=1)
    return density / (samples.size * bandwidth * math.sqrt(2 * math.pi))


# --------------------------------------------------------------------------
# predictive metrics


def _check_probs_and_labels(probs, y) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return (confidence of the predicted class, predicted class, label)."""
    probs = _as_float_array(probs, "probs")
    y = _as_float_array(y, "y")
    if y.ndim != 1:
        raise ValueError(f"y must be 1-D (n,), got shape {y.shape}")
    if np.any(y != np.round(y)) or np.any(y < 0):
        raise ValueError("y must hold non-negative integer class labels")
    if probs.ndim not in (1, 2):
        raise ValueError(f"probs must have shape (n,) (binary) or (n, K), got {probs.shape}")
    if probs.shape[0] != y.shape[0]:
        raise ValueError(f"probs and y must have the same number of rows, got {probs.shape[0]} and {y.shape[0]}")
    if probs.size and (probs.min() < -_PROB_ATOL or probs.max() > 1 + _PROB_ATOL):
        raise ValueError("probs must lie in [0, 1]")
    y = y.astype(np.int64)
    if probs.ndim == 1:
        if np.any(y > 1):
            raise ValueError("y must be 0/1 when probs has shape (n,) (probability of class 1)")
        # A tie at 0.5 predicts class 1, as sigmoid(x) >= 0.5 in the papers.
        predicted = (probs >= 0.5).astype(np.int64)
        confidence = np.where(predicted == 1, probs, 1.0 - probs)
    else:
        if np.any(np.abs(probs.sum(axis=1) - 1.0) > _ROW_SUM_ATOL):
            raise ValueError("each row of probs (n, K) must sum to 1")
        if np.any(y >= probs.shape[1]):
            raise ValueError(f"y holds a label >= K = {probs.shape[1]} (the number of columns of probs)")
        predicted = np.argmax(probs, axis=1)
        confidence = probs[np.arange(probs.shape[0]), predicted]
    if y.size == 0:
        raise ValueError("probs and y must hold at least one row")
    return confidence, predicted, y


def accuracy(probs, y) -> float:
    """Fraction of correct predictions.

    :param probs: probabilities of class 1, shape ``(n,)`` (binary; ``>= 0.5``
        predicts 1), or class probabilities ``(n, K)`` (argmax predicts).
    :param y: integer labels ``(n,)`` (floats holding integers are fine).

    >>> accuracy([0.9, 0.2, 0.6], [1, 0, 0])
    0.6666666666666666
    """
    _, predicted, y = _check_probs_and_labels(probs, y)
    return float(np.mean(predicted == y))


def log_predictive_density(log_lik_draws) -> float:
    """Mean log pointwise predictive density.

    ``mean_i log( (1/S) sum_s p(y_i | theta_s) )`` computed stably as
    ``logsumexp - log S``.

    :param log_lik_draws: ``log p(y_i | theta_s)`` of shape ``(S, n)``.

    >>> import numpy as np
    >>> round(log_predictive_density(np.log([[0.2, 0.5], [0.4, 0.5]])), 6)  # mean(log .3, log .5)
    -0.94856
    """
    log_lik_draws = _as_float_array(log_lik_draws, "log_lik_draws")
    if log_lik_draws.ndim != 2 or 0 in log_lik_draws.shape:
        raise ValueError(f"log_lik_draws must have shape (S, n) with S, n >= 1, got {log_lik_draws.shape}")
    num_draws = log_lik_draws.shape[0]
    return float(np.mean(special.logsumexp(log_lik_draws, axis=0) - math.log(num_draws)))


class ReliabilityDiagram(NamedTuple):
    """Binned calibration statistics (empty bins hold NaN confidence/accuracy)."""

    bin_edges: np.ndarray
    confidence: np.ndarray
    accuracy: np.ndarray
    counts: np.ndarray


def reliability_diagram(probs, y, num_bins: int = 10) -> ReliabilityDiagram:
    """Mean confidence, accuracy and count per equal-width confidence bin.

    Confidence is the probability of the predicted class (top-label
    calibration, Guo et al. 2017): ``max(p, 1-p)`` for binary ``probs`` of
    shape ``(n,)``, the row maximum for ``(n, K)``. Bin ``b`` holds
    confidences in ``(b/B, (b+1)/B]`` (the first bin also holds 0).

    :param probs: ``(n,)`` probabilities of class 1 or ``(n, K)``.
    :param y: integer labels ``(n,)``.
    :param num_bins: number of bins ``B >= 1``.

    >>> diagram = reliability_diagram([0.95, 0.85, 0.15], [1, 0, 0], num_bins=10)
    >>> diagram.counts.tolist()[-2:], diagram.accuracy[-2:].tolist()
    ([2, 1], [0.5, 1.0])
    """
    if isinstance(num_bins, bool) or not isinstance(num_bins, numbers.Integral) or num_bins < 1:
        raise ValueError(f"num_bins must be an integer >= 1, got {num_bins!r}")
    confidence, predicted, y = _check_probs_and_labels(probs, y)
    correct = (predicted == y).astype(float)
    bin_index = np.clip(np.ceil(confidence * num_bins).astype(np.int64) - 1, 0, num_bins - 1)
    counts = np.bincount(bin_index, minlength=num_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_confidence = np.bincount(bin_index, weights=confidence, minlength=num_bins) / counts
        mean_accuracy = np.bincount(bin_index, weights=correct, minlength=num_bins) / counts
    return ReliabilityDiagram(
        bin_edges=np.linspace(0.0, 1.0, num_bins + 1),
        confidence=mean_confidence,
        accuracy=mean_accuracy,
        counts=counts,
    )


def expected_calibration_error(probs, y, num_bins: int = 10) -> float:
    """Expected calibration error: ``sum_b (n_b / n) |accuracy_b - confidence_b|``.

    Bins as in :func:`reliability_diagram`.

    >>> round(expected_calibration_error([0.95, 0.85, 0.15], [1, 0, 0]), 4)  # (2*.35 + .05)/3
    0.25
    """
    diagram = reliability_diagram(probs, y, num_bins)
    filled = diagram.counts > 0
    gaps = np.abs(diagram.accuracy[filled] - diagram.confidence[filled])
    return float(np.sum(diagram.counts[filled] * gaps) / diagram.counts.sum())


def maximum_calibration_error(probs, y, num_bins: int = 10) -> float:
    """Maximum calibration error: the largest ``|accuracy_b - confidence_b|`` over non-empty bins.

    >>> round(maximum_calibration_error([0.95, 0.85, 0.15], [1, 0, 0]), 4)
    0.35
    """
    diagram = reliability_diagram(probs, y, num_bins)
    filled = diagram.counts > 0
    return float(np.max(np.abs(diagram.accuracy[filled] - diagram.confidence[filled])))


def rmse(pred, y) -> float:
    """Root mean squared error between predictions and targets of the same shape.

    >>> rmse([1.0, 2.0], [1.0, 4.0])
    1.4142135623730951
    """
    pred = _as_float_array(pred, "pred")
    y = _as_float_array(y, "y")
    if pred.shape != y.shape:
        raise ValueError(f"pred and y must have the same shape, got {pred.shape} and {y.shape}")
    if pred.size == 0:
        raise ValueError("pred and y must not be empty")
    return float(np.sqrt(np.mean((pred - y) ** 2)))


# --------------------------------------------------------------------------
# per-round metric factories (the ``metrics=`` of the SVGD family): draws -> values


def kl_metric_1d(site: str, log_target: Callable, grid, bandwidth: float = 0.55) -> Callable:
    """A per-round metric: ``KL(target || KDE of the particles)`` for a scalar site.

    The particles' density is their Gaussian KDE with standard deviation ``bandwidth`` (the
    DSVGD paper's ``q``); both densities are renormalized on ``grid`` (see :func:`kl_1d`).

    :param str site: a scalar latent site.
    :param log_target: ``grid -> log target density`` (unnormalized is fine).
    :param grid: increasing 1-D grid covering the target's mass.

    >>> import numpy as np
    >>> from scipy import stats
    >>> grid = np.linspace(-8, 8, 2001)
    >>> metric = kl_metric_1d("mu", stats.norm(0, 1).logpdf, grid, bandwidth=0.3)
    >>> draws = {"mu": stats.norm(0, 1).ppf((np.arange(200) + 0.5) / 200)}
    >>> metric(draws) < 0.05
    True
    """
    grid = np.asarray(grid, dtype=float)
    bandwidth = check_positive(bandwidth, "bandwidth")
    target = np.asarray(log_target(grid), dtype=float)

    def metric(draws):
        values = np.asarray(draws[site], dtype=float).reshape(-1)
        with np.errstate(divide="ignore"):
            log_q = np.log(kde_1d(values, grid, bandwidth))
        return kl_1d(target, log_q, grid)

    return metric


def classification_metrics(
    probability_fn: Callable, X_test, y_test, *, num_bins: int = 10, reliability: bool = False
) -> Callable:
    """Per-round metrics for a classifier: accuracy, log predictive density, MCE.

    :param probability_fn: ``(draws, X) -> (S, n)`` probability of class 1 under each draw
        (``draws`` a dict of constrained values with a leading axis of ``S`` draws), or
        ``(S, n, C)`` class probabilities.
    :param X_test: held-out inputs, passed to ``probability_fn`` unchanged.
    :param y_test: held-out integer labels ``(n,)``.
    :param int num_bins: bins of the reliability diagram and of the maximum calibration error.
    :param bool reliability: also record each round's reliability diagram
        (``reliability_confidence``, ``reliability_accuracy``, ``reliability_counts``).

    The prediction is the average of the draws' probabilities (DSVGD's Appendix A.3).

    >>> import numpy as np
    >>> metric = classification_metrics(lambda draws, X: np.tile(X, (2, 1)), np.array([0.9, 0.2]),
    ...                                 np.array([1, 0]))
    >>> out = metric({})
    >>> out["accuracy"], round(out["log_predictive_density"], 4)
    (1.0, -0.1643)
    """
    y = np.asarray(y_test).astype(np.int64)
    num_bins = check_int(num_bins, "num_bins", minimum=1)

    def metric(draws):
        probs = np.asarray(probability_fn(draws, X_test), dtype=float)
        probs = np.clip(probs, 1e-12, 1 - 1e-12) if probs.ndim == 2 else np.clip(probs, 1e-12, 1.0)
        mean = probs.mean(axis=0)
        if probs.ndim == 2:
            log_lik = np.where(y[None, :] == 1, np.log(probs), np.log1p(-probs))
        else:
            mean = mean / mean.sum(axis=1, keepdims=True)
            log_lik = np.log(np.take_along_axis(probs, y[None, :, None], axis=2)[..., 0])
        out = {
            "accuracy": accuracy(mean, y),
            "log_predictive_density": log_predictive_density(log_lik),
            "maximum_calibration_error": maximum_calibration_error(mean, y, num_bins),
        }
        if reliability:
            diagram = reliability_diagram(mean, y, num_bins)
            out["reliability_confidence"] = diagram.confidence
            out["reliability_accuracy"] = diagram.accuracy
            out["reliability_counts"] = diagram.counts
        return out

    return metric


def regression_metrics(predict_fn: Callable, X_test, y_test, *, y_scale: float = 1.0) -> Callable:
    """Per-round metrics for regression: RMSE of the predictive mean and log predictive density.

    :param predict_fn: ``(draws, X) -> (mean, scale)``, each ``(S, n)``: the Gaussian
        predictive of each draw (``scale`` may be ``None``: no log density then).
    :param y_test: held-out targets ``(n,)``.
    :param float y_scale: multiplies the RMSE (e.g. the training ``y`` standard deviation to
        report it in original units); the log density is on the scale of ``y_test``.

    >>> import numpy as np
    >>> metric = regression_metrics(lambda draws, X: (np.tile(X, (3, 1)), None), np.array([1.0, 2.0]),
    ...                             np.array([1.0, 4.0]))
    >>> metric({})
    {'rmse': 1.4142135623730951}
    """
    y = np.asarray(y_test, dtype=float)
    y_scale = check_positive(y_scale, "y_scale")

    def metric(draws):
        mean, scale = predict_fn(draws, X_test)
        mean = np.asarray(mean, dtype=float)
        out = {"rmse": y_scale * rmse(mean.mean(axis=0), y)}
        if scale is not None:
            scale = np.broadcast_to(np.asarray(scale, dtype=float), mean.shape)
            log_lik = -0.5 * ((y - mean) / scale) ** 2 - np.log(scale) - 0.5 * math.log(2 * math.pi)
            out["log_predictive_density"] = log_predictive_density(log_lik)
        return out

    return metric
