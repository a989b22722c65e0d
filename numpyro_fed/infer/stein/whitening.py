"""Affine changes of coordinates that make DSVGD independent of the parameters' units."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from numpyro_fed.infer.stein.kde import dtype_eps

__all__ = ["Whitening", "whitening"]


class Whitening(NamedTuple):
    """An affine change of coordinates ``z = chol^{-1} (x - mean)`` of the latent space.

    :ivar mean: ``(d,)``.
    :ivar chol: ``(d, d)`` lower-triangular, ``chol chol^T`` the covariance it whitens.
    """

    mean: jax.Array
    chol: jax.Array

    def to_z(self, x):
        """``(..., d)`` points to whitened coordinates."""
        flat = jnp.reshape(x - self.mean, (-1, x.shape[-1]))
        z = jax.scipy.linalg.solve_triangular(self.chol, flat.T, lower=True).T
        return jnp.reshape(z, x.shape)

    def from_z(self, z):
        """Whitened coordinates back to ``(..., d)`` points."""
        return self.mean + z @ self.chol.T

    def score_to_z(self, g):
        """A gradient (score) with respect to ``x`` as one with respect to ``z``: ``chol^T g``."""
        return g @ self.chol


def whitening(particles, full: bool | None = None) -> Whitening:
    """The :class:`Whitening` that gives ``particles`` (``(N, d)``) mean 0 and identity
    covariance.

    ``full``: whiten with the full covariance (Cholesky factor; a ridge of ``sqrt(eps)``
    times its diagonal keeps it positive definite) or, if ``False``, with the per-coordinate
    standard deviations only. ``None`` (default): full when ``N > 2 d`` (enough particles to
    estimate ``d (d + 1) / 2`` covariances), per coordinate otherwise. Coordinates in which
    the particles coincide (e.g. ``N = 1``) keep a scale of 1.

    Under a change of units ``x' = a * x + b`` (``a`` a positive vector) the whitened
    coordinates of ``x'`` are those of ``x``, exactly.

    >>> import jax.numpy as jnp
    >>> w = whitening(jnp.array([[0.0, 10.0], [2.0, 30.0], [4.0, 20.0]]), full=False)
    >>> [[round(v, 4) for v in row] for row in w.to_z(jnp.array([[2.0, 20.0]])).tolist()]
    [[0.0, 0.0]]
    """
    n, d = particles.shape
    full = (n > 2 * d) if full is None else bool(full)
    mean = jnp.mean(particles, axis=0)
    centered = particles - mean
    var = jnp.mean(centered * centered, axis=0)
    tiny = (10.0 * dtype_eps(particles.dtype) * (1.0 + jnp.abs(mean))) ** 2
    degenerate = ~(var > tiny)
    var = jnp.where(degenerate, 1.0, var)
    if not full:
        return Whitening(mean, jnp.diag(jnp.sqrt(var)))
    cov = centered.T @ centered / n
    cov = jnp.where(degenerate[:, None] | degenerate[None, :], 0.0, cov)
    cov = cov + jnp.diag(jnp.where(degenerate, 1.0, math.sqrt(dtype_eps(particles.dtype)) * var))
    return Whitening(mean, jnp.linalg.cholesky(cov))
