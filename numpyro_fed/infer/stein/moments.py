"""Stein's moment correction of a particle set: an affine map that makes the particles satisfy
Stein's first two identities for the target, from the target's score at the particles.

For any target ``p``, ``E_p[grad log p] = 0`` and ``E_p[grad log p (x - m)^T] = -I``
(:mod:`~numpyro_fed.infer.stein.checks` tests these per coordinate). Regressing the score on
the particles, ``g_n ~ b - A (x_n - m)``, estimates the target's precision ``A`` and the
offset of its mean ``A^{-1} b``: exactly for a Gaussian target whatever the particles (``N >
d + 1``), and consistently for any target when the particles are distributed as it (the
least-squares slope is then ``-E[g x^T] C^{-1} = C^{-1}``). The correction moves the particles
by the affine map that gives them that mean and covariance, keeping their shape.
"""

from __future__ import annotations

import math

import numpy as np

import jax
import jax.numpy as jnp

from numpyro_fed.infer.stein.kde import dtype_eps

__all__ = [
    "GAUSSIAN_RESIDUAL",
    "MAX_RESCALE",
    "MOMENT_CORRECTION",
    "MOMENT_TOLERANCE",
    "can_correct",
    "correction_move",
    "correction_settled",
    "stein_misfit",
    "stein_moment_correction",
]

#: The most corrections after DSVGD's last round with ``kde_bandwidth="auto"``
#: (``moment_correction``); they stop earlier once one moves the particles less than
#: :data:`MOMENT_TOLERANCE`.
MOMENT_CORRECTION = 20

#: A correction that moves every coordinate's mean by less than this many of its sds and changes
#: its sd by less than this fraction is the last.
MOMENT_TOLERANCE = 0.01

#: The fraction of the score's variance a linear fit may leave for the target to count as
#: close to Gaussian over the particles: there the corrected moments are trusted; elsewhere a
#: failed Stein check of the uncorrected particles still warns.
GAUSSIAN_RESIDUAL = 0.05

#: The most one correction rescales a direction of the particles (their sd), either way; the
#: rest is left to the next iteration (a guard against a noisy slope).
MAX_RESCALE = 10.0


def correction_move(before, after) -> float:
    """How far a correction from the ``(N, d)`` particles ``before`` to ``after`` moved them:
    the largest, over coordinates, of the move of a coordinate's mean in its sds and of the
    change of its sd (``|log|`` of their ratio).

    >>> import numpy as np
    >>> x = np.random.default_rng(0).normal(size=(20, 2))
    >>> round(correction_move(x, 1.05 * x), 4)
    0.0488
    """
    before, after = np.asarray(before, dtype=float), np.asarray(after, dtype=float)
    sd_before, sd_after = before.std(axis=0), after.std(axis=0)
    safe = np.where(sd_after > 0, sd_after, 1.0)
    moved = np.abs(after.mean(axis=0) - before.mean(axis=0)) / safe
    both = (sd_before > 0) & (sd_after > 0)
    rescaled = np.abs(np.log(np.where(both, sd_after, 1.0) / np.where(both, sd_before, 1.0)))
    return float(max(np.max(moved), np.max(rescaled)))


def correction_settled(before, after, tolerance: float = MOMENT_TOLERANCE) -> bool:
    """Whether a correction from the ``(N, d)`` particles ``before`` to ``after`` moved every
    coordinate's mean by less than ``tolerance`` of its sd and changed its sd by less than
    that fraction (:func:`correction_move`).

    >>> import numpy as np
    >>> x = np.random.default_rng(0).normal(size=(20, 2))
    >>> correction_settled(x, x + 0.001), correction_settled(x, 1.05 * x)
    (True, False)
    """
    return correction_move(before, after) < tolerance


def can_correct(num_particles: int, dim: int) -> bool:
    """Whether ``num_particles`` particles determine the ``d x d`` slope of the regression
    (``N > d + 1``; otherwise the correction is not applied)."""
    return num_particles > dim + 1


def _fit(particles, scores):
    """The least-squares fit of :func:`stein_moment_correction`, in the coordinates ``z`` that
    whiten the particles: ``(mean, chol, z, b, S, residual)``, ``g ~ b - S z`` (``S``
    symmetrised)."""
    n = particles.shape[0]
    mean = jnp.mean(particles, axis=0)
    centered = particles - mean
    cov = centered.T @ centered / n
    cov = cov + jnp.diag(math.sqrt(dtype_eps(particles.dtype)) * jnp.diag(cov) + jnp.finfo(cov.dtype).tiny)
    chol = jnp.linalg.cholesky(cov)
    z = jax.scipy.linalg.solve_triangular(chol, centered.T, lower=True).T
    g = scores @ chol  # scores in z
    b = jnp.mean(g, axis=0)
    slope = -((g - b).T @ z) / n
    residual = jnp.sum((g - b + z @ slope.T) ** 2) / jnp.maximum(jnp.sum((g - b) ** 2), jnp.finfo(g.dtype).tiny)
    return mean, chol, z, b, 0.5 * (slope + slope.T), residual


def stein_misfit(particles, scores):
    """How far ``(N, d)`` particles are from satisfying Stein's first two identities for the
    target whose score at them is ``scores``: ``|b|^2 + |S - I|_F^2`` in the coordinates that
    whiten them (``b`` the mean score, ``S`` the fitted precision of
    :func:`stein_moment_correction`); 0 at a fixed point of the correction.

    >>> import jax, jax.numpy as jnp
    >>> x = jax.random.normal(jax.random.PRNGKey(0), (20, 2))
    >>> y, _ = stein_moment_correction(x, -(x - 3.0))  # N(3, I): one correction is exact
    >>> float(stein_misfit(x, -(x - 3.0))) > 1, float(stein_misfit(y, -(y - 3.0))) < 1e-6
    (True, True)
    """
    _, _, _, b, slope, _ = _fit(particles, scores)
    return jnp.sum(b**2) + jnp.sum((slope - jnp.eye(slope.shape[0], dtype=slope.dtype)) ** 2)


def stein_moment_correction(particles, scores):
    """``(new particles, residual)``: the ``(N, d)`` particles moved by the affine map that
    gives them the mean and covariance of the Gaussian whose score best fits ``scores``
    (``(N, d)``, the target's ``grad log p`` at the particles) in least squares, and the
    fraction of the scores' variance (in whitened coordinates) that the fit leaves: 0 for a
    Gaussian target, larger the less Gaussian the target is over the particles.

    Works in the coordinates that whiten the particles (their covariance, with a ridge of
    ``sqrt(eps)`` times its diagonal): there the fitted precision is ``S = -mean(g z^T)``
    (symmetrised; ``I`` when the particles' covariance is the target's), and the new particles
    are ``S^{-1} mean(g) + S^{-1/2} z``. Directions in which ``S`` is not positive (the target
    is not log-concave there, at the particles' scale) are left as they are, and a direction's
    sd changes by at most :data:`MAX_RESCALE` per call.

    >>> import jax, jax.numpy as jnp
    >>> x = jax.random.normal(jax.random.PRNGKey(0), (20, 2))
    >>> mu, sd = jnp.array([3.0, -1.0]), jnp.array([0.5, 2.0])
    >>> y, residual = stein_moment_correction(x, -(x - mu) / sd**2)  # N(mu, diag(sd^2)) from 20 draws of N(0, I)
    >>> [round(v, 2) for v in y.mean(0).tolist()], [round(v, 2) for v in y.std(0).tolist()]
    ([3.0, -1.0], [0.5, 2.0])
    >>> round(float(residual), 4)
    0.0
    """
    mean, chol, z, b, slope, residual = _fit(particles, scores)
    eigenvalues, vectors = jnp.linalg.eigh(slope)
    positive = eigenvalues > 0
    # precision 1 where not positive (no change of scale), capped changes elsewhere
    eigenvalues = jnp.where(positive, jnp.clip(eigenvalues, MAX_RESCALE**-2, MAX_RESCALE**2), 1.0)
    b_eigen = vectors.T @ b
    shift = vectors @ jnp.where(positive, b_eigen / eigenvalues, 0.0)
    scale = (vectors / jnp.sqrt(eigenvalues)) @ vectors.T  # S^{-1/2}
    new_z = shift + z @ scale.T
    return mean + new_z @ chol.T, residual
