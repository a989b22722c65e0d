"""Gaussians in natural parameters: the family PVI's ``q``, prior and factors live in.

A mean-field (diagonal) Gaussian has ``eta2`` of shape ``(d,)``; a full-rank one ``(d, d)``
(``eta2 = -precision / 2``, symmetric). The functions below take either: the family is the
shape of ``eta2`` (static under ``jit``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = [
    "CAVITY_FLOOR",
    "as_full",
    "entropy",
    "gaussian_prior",
    "GaussianNatural",
    "is_full",
    "kl_divergence",
    "loc_cov_factor",
    "loc_scale",
    "natural",
    "proper",
    "proper_cavity",
    "sample",
    "sample_log_density",
    "whiten",
]


class GaussianNatural(NamedTuple):
    """Natural parameters of a diagonal Gaussian (or of a Gaussian factor).

    :ivar eta1: ``precision * mean``.
    :ivar eta2: ``-precision / 2``.
    """

    eta1: jax.Array
    eta2: jax.Array


def natural(loc, scale) -> GaussianNatural:
    """Natural parameters of ``N(loc, scale^2)``.

    >>> eta = natural(jnp.array([1.0]), jnp.array([2.0]))
    >>> float(eta.eta1[0]), float(eta.eta2[0])
    (0.25, -0.125)
    """
    precision = 1.0 / jnp.square(scale)
    return GaussianNatural(precision * loc, -0.5 * precision)


def is_full(eta: GaussianNatural) -> bool:
    """Whether ``eta`` is full-rank (``eta2`` a ``(..., d, d)`` matrix) rather than
    diagonal; static (from shapes)."""
    return eta.eta2.ndim == eta.eta1.ndim + 1


def as_full(eta: GaussianNatural) -> GaussianNatural:
    """``eta`` as a full-rank Gaussian (a diagonal one's ``eta2`` on the diagonal)."""
    if is_full(eta):
        return eta
    return GaussianNatural(eta.eta1, eta.eta2[..., :, None] * jnp.eye(eta.eta2.shape[-1], dtype=eta.eta2.dtype))


def loc_cov_factor(eta: GaussianNatural):
    """``(loc, L)`` of a proper Gaussian: ``L`` the lower Cholesky factor of its covariance
    (full-rank) or its scales (diagonal), so that ``loc + L @ eps`` (``loc + L * eps``) is a
    draw."""
    if not is_full(eta):
        return loc_scale(eta)
    precision = -2.0 * eta.eta2
    eye = jnp.eye(precision.shape[-1], dtype=precision.dtype)
    # Sigma's lower Cholesky factor from the flipped one of P, never forming Sigma (whose own
    # factorization fails in float32 once P's condition number nears 1e7, as on raw covariates):
    # with J the reversal and J P J = K K^T, P = (J K J)(J K J)^T with J K J upper triangular,
    # so Sigma = L L^T with L = J K^-T J lower triangular
    flipped = jnp.linalg.cholesky(precision[::-1, ::-1])
    chol = jax.scipy.linalg.solve_triangular(flipped, eye, lower=True).T[::-1, ::-1]
    return chol @ (chol.T @ eta.eta1), chol


def loc_scale(eta: GaussianNatural):
    """``(loc, scale)`` of a proper Gaussian given by its natural parameters (inverse of
    :func:`natural`); full-rank: ``scale`` the marginal standard deviations."""
    if is_full(eta):
        loc, chol = loc_cov_factor(eta)
        return loc, jnp.sqrt(jnp.sum(jnp.square(chol), axis=-1))
    precision = -2.0 * eta.eta2
    return eta.eta1 / precision, 1.0 / jnp.sqrt(precision)


def sample(rng_key, eta: GaussianNatural, num_samples: int):
    """``(num_samples, d)`` draws of the Gaussian ``eta`` (either family)."""
    return sample_log_density(rng_key, eta, num_samples)[0]


def sample_log_density(rng_key, eta: GaussianNatural, num_samples: int):
    """``(draws, log_q)``: :func:`sample`'s draws (the same, from the same key) and the log
    density of ``eta`` at each, ``(num_samples,)``.

    >>> x, log_q = sample_log_density(jax.random.PRNGKey(0), natural(jnp.zeros(2), jnp.ones(2)), 3)
    >>> bool(jnp.allclose(log_q, jax.scipy.stats.norm.logpdf(x).sum(-1)))
    True
    """
    loc, factor = loc_cov_factor(eta)
    eps = jax.random.normal(rng_key, (num_samples,) + loc.shape, loc.dtype)
    draws = loc + (eps @ factor.T if is_full(eta) else factor * eps)
    # x = loc + L eps: log q(x) = log N(eps; 0, I) - log |det L| (L triangular or a diagonal)
    log_det = jnp.sum(jnp.log(jnp.abs(jnp.diagonal(factor) if is_full(eta) else factor)))
    log_q = -0.5 * jnp.sum(jnp.square(eps), axis=-1) - 0.5 * loc.shape[-1] * jnp.log(2 * jnp.pi) - log_det
    return draws, log_q


def proper(eta: GaussianNatural):
    """``(d,)`` bool: where ``eta`` is a proper, finite Gaussian (diagonal: coordinate by
    coordinate; full-rank: all coordinates or none, from the precision's Cholesky factor)."""
    if not is_full(eta):
        return (eta.eta2 < 0) & jnp.isfinite(eta.eta1) & jnp.isfinite(eta.eta2)
    chol = jnp.linalg.cholesky(-2.0 * eta.eta2)
    ok = jnp.all(jnp.isfinite(chol)) & jnp.all(jnp.isfinite(eta.eta1)) & jnp.all(jnp.diagonal(chol) > 0)
    return jnp.broadcast_to(ok, eta.eta1.shape)


def entropy(eta: GaussianNatural):
    """Entropy of a proper Gaussian, up to the constant ``d / 2 log(2 pi e)``."""
    _, factor = loc_cov_factor(eta)
    return jnp.sum(jnp.log(jnp.diagonal(factor) if is_full(eta) else factor))


def kl_divergence(q: GaussianNatural, p: GaussianNatural):
    """``KL(q || p)`` of two proper Gaussians (diagonal: summed over coordinates)."""
    if is_full(q) or is_full(p):
        q, p = as_full(q), as_full(p)
        loc_q, chol_q = loc_cov_factor(q)
        loc_p, _ = loc_cov_factor(p)
        precision_p = -2.0 * p.eta2
        diff = loc_q - loc_p
        trace = jnp.sum(precision_p * (chol_q @ chol_q.T))
        logdet_p = 2.0 * jnp.sum(jnp.log(jnp.diagonal(jnp.linalg.cholesky(precision_p))))
        logdet_q = 2.0 * jnp.sum(jnp.log(jnp.diagonal(chol_q)))
        return 0.5 * (trace + diff @ precision_p @ diff - diff.shape[-1] - logdet_p - logdet_q)
    loc_q, scale_q = loc_scale(q)
    loc_p, scale_p = loc_scale(p)
    ratio = jnp.square(scale_q / scale_p)
    return 0.5 * jnp.sum(ratio + jnp.square((loc_q - loc_p) / scale_p) - 1.0 - jnp.log(ratio))


def tree_add(a, b, scale=1.0):
    """``a + scale * b`` leaf by leaf."""
    return jax.tree_util.tree_map(lambda x, y: x + scale * y, a, b)


def tree_sub(a, b):
    """``a - b`` leaf by leaf."""
    return jax.tree_util.tree_map(lambda x, y: x - y, a, b)


def flatten(eta: GaussianNatural):
    """``(..., 2d)``: ``eta1`` then ``eta2`` (the vector that is clipped and noised)."""
    return jnp.concatenate([eta.eta1, eta.eta2], axis=-1)


def unflatten(vector) -> GaussianNatural:
    """Inverse of :func:`flatten`."""
    d = vector.shape[-1] // 2
    return GaussianNatural(vector[..., :d], vector[..., d:])


def gaussian_prior(prior_potential: Callable, d: int, *, dtype=None, rtol: float | None = None) -> GaussianNatural:
    """The natural parameters of ``exp(-prior_potential)`` if it is a diagonal Gaussian on
    the flat unconstrained space; a ValueError otherwise.

    The potential's gradient must be ``g0 + h * z`` with ``h > 0``: ``h`` is read off at
    ``z = 1`` and the identity is checked at two random points.

    >>> eta = gaussian_prior(lambda z: 0.5 * jnp.sum((z - 1.0) ** 2 / 4.0), 2)
    >>> [float(v) for v in loc_scale(eta)[0]], [float(v) for v in loc_scale(eta)[1]]
    ([1.0, 1.0], [2.0, 2.0])
    """
    dtype = dtype or jnp.zeros(()).dtype
    if rtol is None:
        rtol = 1e-6 if dtype == jnp.float64 else 1e-3
    grad = jax.jit(jax.grad(prior_potential))
    g0 = grad(jnp.zeros(d, dtype))
    h = grad(jnp.ones(d, dtype)) - g0
    probes = jax.random.normal(jax.random.PRNGKey(0), (2, d), dtype) * 2.0
    for z in probes:
        if not jnp.allclose(grad(z), g0 + h * z, rtol=rtol, atol=rtol * (1.0 + jnp.max(jnp.abs(g0)))):
            raise ValueError(
                "PVI needs a Gaussian prior with independent coordinates on the unconstrained "
                "latent space (e.g. Normal priors on real-valued sites); this model's prior "
                "potential is not quadratic and separable"
            )
    if not bool(jnp.all(h > 0)):
        raise ValueError("the model's prior is not a proper Gaussian (non-positive precision)")
    return GaussianNatural(-g0, -0.5 * h)


#: a cavity's precision, in units of ``q``'s, is raised to at least this in every direction for
#: the local fit (where the other factors' Monte Carlo noise or round-off made it improper)
CAVITY_FLOOR = 1e-3


def whiten(eta: GaussianNatural, loc0, chol0) -> GaussianNatural:
    """``eta`` (full-rank natural parameters, proper or not) in the coordinates ``u`` with
    ``theta = loc0 + chol0 @ u``."""
    return GaussianNatural(chol0.T @ (eta.eta1 + 2.0 * eta.eta2 @ loc0), chol0.T @ eta.eta2 @ chol0)


def proper_cavity(cavity_u: GaussianNatural, floor=CAVITY_FLOOR) -> GaussianNatural:
    """A whitened cavity (``q`` standard normal) whose precision's eigenvalues below ``floor``
    are raised to it, the precision added centred on ``q``'s mean: the local fit's cavity.
    Unchanged where the cavity is proper to that extent. PVI's cavity ``q / t_m`` is proper in
    exact arithmetic with exact local fits; the Monte Carlo noise of the other clients' fits
    (or float32 round-off on raw covariates, precisions far apart) can leave it improper in a
    direction this client's rows do not inform, and the local ELBO would then be unbounded."""
    precision = -(cavity_u.eta2 + cavity_u.eta2.T)
    values, vectors = jnp.linalg.eigh(precision)
    raised = (vectors * (jnp.maximum(values, floor) - values)) @ vectors.T
    repaired = GaussianNatural(cavity_u.eta1, cavity_u.eta2 - 0.5 * raised)  # q's mean is 0 here
    return jax.tree_util.tree_map(lambda a, b: jnp.where(jnp.min(values) < floor, a, b), repaired, cavity_u)
