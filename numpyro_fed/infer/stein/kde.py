"""Gaussian kernel density estimates of particle sets: DSVGD's densities ``q`` and ``t_k``."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from numpyro_fed._checks import check_positive
from numpyro_fed.infer.stein.kernels import squared_distances

__all__ = [
    "AUTO_KDE_FACTOR",
    "check_kde_bandwidth",
    "kde_grad_log_density",
    "kde_log_density",
    "kde_score_fn",
    "shrunk_kde",
]

#: The kernel of ``kde_bandwidth="auto"``, in standard deviations of the particles (per
#: coordinate, in whitened coordinates); with the shrinkage of :func:`shrunk_kde` the KDE is
#: then close to a Gaussian with the particles' moments. Smaller factors keep more of the
#: particles' shape but make the ratios of KDEs in DSVGD's targets noisier: Silverman's rule
#: (0.59 for 20 particles in 5 dimensions) left the spread of a logistic regression's
#: particles 1.3-1.7 times the posterior's, 0.85 within 5% (docs/guide/dsvgd.md).
AUTO_KDE_FACTOR = 0.85


def dtype_eps(dtype) -> float:
    return float(jnp.finfo(dtype).eps)


def kde_log_density(theta, centers, bandwidth) -> jax.Array:
    """Log density of the Gaussian KDE ``(1/N) sum_n N(theta | centers_n, diag(bandwidth^2))``.

    :param theta: ``(M, d)`` query points.
    :param centers: ``(N, d)`` particles.
    :param bandwidth: standard deviation of the Gaussian kernel: a scalar, or ``(d,)`` (one per
        coordinate).
    :return: ``(M,)``.

    >>> import jax.numpy as jnp
    >>> [round(v, 4) for v in kde_log_density(jnp.zeros((1, 1)), jnp.zeros((1, 1)), 1.0).tolist()]
    [-0.9189]
    """
    d = theta.shape[-1]
    bandwidth = jnp.broadcast_to(jnp.asarray(bandwidth, theta.dtype), (d,))
    logits = -squared_distances(theta / bandwidth, centers / bandwidth) / 2.0
    return (
        jax.nn.logsumexp(logits, axis=1)
        - math.log(centers.shape[0])
        - 0.5 * jnp.sum(jnp.log(2.0 * jnp.pi * bandwidth**2))
    )


def kde_grad_log_density(theta, centers, bandwidth) -> jax.Array:
    """Gradient of :func:`kde_log_density` at each query point, ``(M, d)``.

    ``sum_n w_n(theta) (centers_n - theta) / bandwidth^2`` with softmax weights: finite even
    far from every center. ``bandwidth``: a scalar or ``(d,)``.

    >>> import jax.numpy as jnp
    >>> kde_grad_log_density(jnp.array([[1.0]]), jnp.array([[0.0]]), 0.5).tolist()
    [[-4.0]]
    """
    bandwidth = jnp.asarray(bandwidth, theta.dtype)
    logits = -squared_distances(theta / bandwidth, centers / bandwidth) / 2.0
    weights = jax.nn.softmax(logits, axis=1)
    return (weights @ centers - theta) / bandwidth**2


def shrunk_kde(centers, factor):
    """A Gaussian KDE that keeps the mean and the per-coordinate variance of its particles.

    Returns ``(centers', bandwidth)`` for :func:`kde_grad_log_density`: the kernel's standard
    deviation is ``factor`` times the particles' own, per coordinate, and the particles are
    first shrunk towards their mean by ``sqrt(1 - factor^2)`` (West 1993), so that the KDE is
    not wider than the particles (a plain KDE adds the kernel's variance to theirs).
    Coordinates in which the particles coincide get a kernel of width ``factor``.

    >>> import jax.numpy as jnp
    >>> c, h = shrunk_kde(jnp.array([[-1.0], [1.0]]), 0.6)
    >>> [round(v, 4) for v in c[:, 0].tolist()], round(float(h[0]), 4)  # variance 0.8^2 + 0.6^2 = 1
    ([-0.8, 0.8], 0.6)
    """
    mean = jnp.mean(centers, axis=0)
    sd = jnp.std(centers, axis=0)
    tiny = 10.0 * dtype_eps(centers.dtype) * (1.0 + jnp.abs(mean))
    sd = jnp.where(sd > tiny, sd, 1.0)
    shrink = math.sqrt(1.0 - factor**2)
    return mean + shrink * (centers - mean), factor * sd


def check_kde_bandwidth(kde_bandwidth):
    """``"auto"`` or a positive float (checked).

    >>> check_kde_bandwidth("auto"), check_kde_bandwidth(0.55)
    ('auto', 0.55)
    """
    if isinstance(kde_bandwidth, str):
        if kde_bandwidth != "auto":
            raise ValueError(f"kde_bandwidth must be 'auto' or a positive number, got {kde_bandwidth!r}")
        return kde_bandwidth
    return check_positive(kde_bandwidth, "kde_bandwidth")


def kde_score_fn(kde_bandwidth) -> Callable:
    """``(x, centers) -> grad log KDE(centers)(x)``: with ``"auto"``, the moment-keeping KDE
    (:func:`shrunk_kde`) with a kernel of :data:`AUTO_KDE_FACTOR` standard deviations, in the
    coordinates that whiten the centers (:func:`~numpyro_fed.infer.stein.whitening.whitening`:
    their full covariance when ``N > 2 d``), so that it keeps their correlations;
    otherwise a plain KDE of standard deviation ``kde_bandwidth``.

    >>> import jax.numpy as jnp
    >>> kde_score_fn(0.5)(jnp.array([[1.0]]), jnp.array([[0.0]])).tolist()
    [[-4.0]]
    """
    if kde_bandwidth == "auto":
        from numpyro_fed.infer.stein.whitening import whitening  # whitening imports this module

        def score(x, centers):
            # In the coordinates that whiten the centers (their full covariance when N > 2 d),
            # so that the KDE keeps their correlations too, not only each coordinate's variance.
            w = whitening(centers)
            shrunk, bandwidth = shrunk_kde(w.to_z(centers), AUTO_KDE_FACTOR)
            g = kde_grad_log_density(w.to_z(x), shrunk, bandwidth)
            return jax.scipy.linalg.solve_triangular(w.chol, g.T, lower=True, trans=1).T

        return score
    return lambda x, centers: kde_grad_log_density(x, centers, kde_bandwidth)
