"""A client's factor in DSVGD's default (``kde_bandwidth="auto"``): the carrier its local
particles encode it with, and the power of its old factor in the cavity, both chosen from the
particles' precisions so that no round's target is improper.

Far from its particles a moment-keeping KDE (:func:`~numpyro_fed.infer.stein.kde.shrunk_kde`)
has its kernel's curvature, ``1 / f^2`` times the particles' precision; ratios of KDEs, which
make DSVGD's targets, are then Gaussian there, with a precision that is a difference of the
particles' precisions. With 20 particles those are noisy estimates, and a difference of them
can lose definiteness: the target is then improper and SVGD's particles run away. The
functions here keep every such difference definite with a margin, at the Gaussian level.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from numpyro_fed.infer.stein.kde import AUTO_KDE_FACTOR
from numpyro_fed.infer.stein.whitening import whitening

__all__ = [
    "AUTO_TAIL",
    "CARRIER_MARGIN",
    "CAVITY_MARGIN",
    "carrier_score_of",
    "carrier_weight",
    "cavity_power",
    "gaussian_score",
    "negative_hessian",
    "precision_of",
]

#: far from its particles a moment-keeping KDE's curvature is its kernel's: ``1 / f^2`` times
#: their precision (``f`` = :data:`~numpyro_fed.infer.stein.kde.AUTO_KDE_FACTOR`).
AUTO_TAIL = 1.0 / AUTO_KDE_FACTOR**2

#: the least fraction of ``P_q + H_k`` the tilted target's Gaussian precision must keep
#: (:func:`cavity_power`).
CAVITY_MARGIN = 0.25


def precision_of(particles):
    """``(d, d)``: the inverse covariance of ``particles`` as
    :func:`~numpyro_fed.infer.stein.whitening.whitening` estimates it (full when ``N > 2 d``,
    per coordinate otherwise)."""
    w = whitening(particles)
    inverse = jax.scipy.linalg.solve_triangular(w.chol, jnp.eye(particles.shape[-1], dtype=particles.dtype), lower=True)
    return inverse.T @ inverse


def negative_hessian(score_fn, at):
    """``(d, d)``: ``-sym(d score / dx)`` at the point ``at`` (``score_fn``: ``(N, d) -> (N, d)``)."""
    jac = jax.jacfwd(lambda v: score_fn(v[None])[0])(at)
    return -(jac + jac.T) / 2.0


def cavity_power(global_particles, local_particles, carrier_score, client_grad, temperature):
    """``gamma`` in ``[0, 1]``: the power of the client's old factor in its cavity
    ``q^(i-1) / t_k^gamma`` (and in its new factor ``t_k^gamma q^(i) / q^(i-1)``), 1 unless
    the tilted target would be improper.

    Far from the particles (precisions ``P_q`` of the global particles, ``P_l`` of the local
    ones, each KDE's curvature there its kernel's, ``P / f^2`` with ``f`` =
    :data:`~numpyro_fed.infer.stein.kde.AUTO_KDE_FACTOR`; ``P_c`` of the carrier, ``H_k`` the
    curvature of ``L_k / alpha`` at the global particles' mean) the tilted target's precision
    is ``A + gamma B``, ``A = P_q / f^2 + H_k``, ``B = P_c - P_l / f^2``, about ``-T_k``.
    At a fixed point with exact densities ``A + B = P_q``, at least half of ``A``;
    with 20 particles ``P_l`` is a noisy estimate and ``A + B`` can lose definiteness, which
    makes the tilted target improper and the particles run away. The largest ``gamma`` with
    ``A + gamma B >= CAVITY_MARGIN A`` is then used: a damped cavity, as in expectation
    propagation; the new factor is consistent with it (``q^(i) = cavity x
    t_k^(i)``), and at a fixed point (``q^(i) = q^(i-1)``) nothing changes."""
    mean = jnp.mean(global_particles, axis=0)
    a = AUTO_TAIL * precision_of(global_particles) + negative_hessian(lambda x: -client_grad(x) / temperature, mean)
    b = negative_hessian(carrier_score, mean) - AUTO_TAIL * precision_of(local_particles)
    values, vectors = jnp.linalg.eigh((a + a.T) / 2.0)
    ok = jnp.all(jnp.isfinite(values)) & (jnp.min(values) > 0)
    root_inverse = (vectors / jnp.sqrt(jnp.where(values > 0, values, 1.0))) @ vectors.T
    lowest = jnp.min(jnp.linalg.eigvalsh(root_inverse @ ((b + b.T) / 2.0) @ root_inverse))
    gamma = jnp.where(lowest < 0, (1.0 - CAVITY_MARGIN) / jnp.maximum(-lowest, 1e-30), 1.0)
    gamma = jnp.clip(gamma, 0.0, 1.0)
    return jnp.where(ok & jnp.isfinite(gamma), gamma, 1.0)


#: the least fraction of the new global particles' precision that a client's carrier times its
#: new factor must keep (:func:`carrier_weight`).
CARRIER_MARGIN = 0.25


def carrier_weight(new_global, previous_precision, old_factor_precision, prior_score):
    """The weight ``beta >= 0`` of a client's new carrier ``c_k' = p_0 N(m, C)^beta`` (``m``, ``C``
    the moments of ``new_global``): the least that keeps ``c_k' t_k^(i)`` proper with a margin.

    Far from the particles, ``t_k^(i) = t_k^(i-1)^gamma q^(i) / q^(i-1)`` has the precision
    ``T = (P_new - P_prev) / f^2 + old_factor_precision`` (``P_prev``: ``previous_precision``,
    NaN where ``q^(i-1) = p_0`` exactly, then the prior's curvature;
    ``old_factor_precision``: ``gamma`` times that of ``t_k^(i-1)``, 0 on a first visit), and
    ``c_k' t_k^(i)`` the precision ``H_0 + T + beta P_new`` (``H_0`` the prior's curvature at
    the particles' mean). ``beta`` is the least with ``H_0 + T + beta P_new >= CARRIER_MARGIN
    P_new``: 0 where the client's rows identify its factor and the prior is proper."""
    mean = jnp.mean(new_global, axis=0)
    p_new = precision_of(new_global)
    h_0 = negative_hessian(prior_score, mean)
    p_prev = jnp.where(jnp.all(jnp.isfinite(previous_precision)), previous_precision, h_0 / AUTO_TAIL)
    s = h_0 + AUTO_TAIL * (p_new - p_prev) + old_factor_precision
    values, vectors = jnp.linalg.eigh((p_new + p_new.T) / 2.0)
    root_inverse = (vectors / jnp.sqrt(jnp.where(values > 0, values, 1.0))) @ vectors.T
    lowest = jnp.min(jnp.linalg.eigvalsh(root_inverse @ ((s + s.T) / 2.0) @ root_inverse))
    beta = jnp.maximum(CARRIER_MARGIN - lowest, 0.0)
    return jnp.where(jnp.isfinite(beta), beta, 1.0)


def carrier_score_of(carrier, prior_score) -> Callable:
    """``grad log c_k`` of a carrier ``(mean, chol, weight)`` (:class:`LocalState`)."""
    mean, chol, weight = carrier
    gaussian = gaussian_score(mean, chol)
    return lambda x: prior_score(x) + weight * gaussian(x)


def gaussian_score(mean, chol) -> Callable:
    """``(N, d) -> (N, d)``: the score of ``N(mean, chol chol^T)`` (``chol`` lower-triangular)."""

    def score(x):
        u = jax.scipy.linalg.solve_triangular(chol, (x - mean).T, lower=True)
        return -jax.scipy.linalg.solve_triangular(chol, u, lower=True, trans=1).T

    return score
