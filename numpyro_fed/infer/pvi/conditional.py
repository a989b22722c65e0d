"""A client's Gaussian over its own latents given the global ones, ``q(z_m | theta)``, for PVI
with client-local latents and a structured ``q(theta) prod_m q(z_m | theta)``.

``q(z_m | theta) = N(P_zz^-1 (eta_z - P_zg theta), P_zz^-1)`` is held in natural parameters as
the rows of the joint Gaussian over ``(theta, z_m)`` that belong to ``z_m``: a
:class:`~numpyro_fed.infer.pvi.gaussian.GaussianNatural` with ``eta1 = eta_z`` ``(L,)`` and
``eta2 = -[P_zg, P_zz] / 2`` ``(L, d_g + L)``. Its size depends on the client's own
coordinates, never on its rows. With the server's full-rank ``q(theta)`` it makes the joint
(:func:`joint`), a full-rank Gaussian over ``(theta, z_m)`` whose ``theta``-marginal is
``q(theta)``; a client's local fit of that joint is cut back (:func:`split`) into its new
``theta``-marginal (whose change is the client's message) and its new conditional (which the
client keeps). The family holds the posterior's conditional independence of the clients'
latents given the global ones, and the dependence of each client's latents on the global
ones (a group scale and the effects it scales), which a mean-field ``q(theta) q(z_m)`` drops.
"""

from __future__ import annotations

import numpy as np

import jax
import jax.numpy as jnp

from numpyro_fed.infer.pvi.gaussian import GaussianNatural

__all__ = ["conditional_entropy", "draw_conditional", "initial_conditional", "joint", "mask_padding", "split"]

_HALF_LOG_2_PI_E = 0.5 * float(np.log(2 * np.pi * np.e))


def initial_conditional(loc, scale, num_global: int) -> GaussianNatural:
    """``q(z_m | theta) = N(loc, diag(scale^2))``, independent of ``theta``.

    >>> cond = initial_conditional(jnp.array([1.0]), jnp.array([2.0]), 2)
    >>> cond.eta2.shape, float(cond.eta1[0])
    ((1, 3), 0.25)
    """
    precision = 1.0 / jnp.square(scale)
    zeros = jnp.zeros(loc.shape + (num_global,), loc.dtype)
    return GaussianNatural(precision * loc, jnp.concatenate([zeros, jnp.diag(-0.5 * precision)], axis=-1))


def _blocks(cond: GaussianNatural):
    num_global = cond.eta2.shape[-1] - cond.eta2.shape[-2]
    return -2.0 * cond.eta2[:, :num_global], -2.0 * cond.eta2[:, num_global:]  # P_zg, P_zz


def _solve_local(p_zz, rhs):
    chol = jnp.linalg.cholesky(0.5 * (p_zz + p_zz.T))
    return jax.scipy.linalg.cho_solve((chol, True), rhs)


def joint(q: GaussianNatural, cond: GaussianNatural) -> GaussianNatural:
    """The full-rank joint ``q(theta) q(z_m | theta)`` over ``(theta, z_m)`` from the full-rank
    ``q(theta)`` and the conditional: its precision is ``[[P_q + P_gz P_zz^-1 P_zg, P_gz],
    [P_zg, P_zz]]`` and its ``eta1`` ``[eta_q + P_gz P_zz^-1 eta_z, eta_z]``."""
    p_zg, p_zz = _blocks(cond)
    num_global = p_zg.shape[-1]
    solved = _solve_local(p_zz, jnp.concatenate([p_zg, cond.eta1[:, None]], axis=-1))
    p_gg = -2.0 * q.eta2 + p_zg.T @ solved[:, :num_global]
    eta1_g = q.eta1 + p_zg.T @ solved[:, num_global]
    precision = jnp.block([[0.5 * (p_gg + p_gg.T), p_zg.T], [p_zg, p_zz]])
    return GaussianNatural(jnp.concatenate([eta1_g, cond.eta1]), -0.5 * precision)


def split(joint_eta: GaussianNatural, num_global: int):
    """``(q(theta), q(z_m | theta))`` of a full-rank joint over ``(theta, z_m)``: the marginal
    (the Schur complement of its ``z_m`` block) and the conditional (its ``z_m`` rows)."""
    precision = -2.0 * joint_eta.eta2
    p_gg, p_zg = precision[:num_global, :num_global], precision[num_global:, :num_global]
    p_zz = precision[num_global:, num_global:]
    eta1_g, eta1_z = joint_eta.eta1[:num_global], joint_eta.eta1[num_global:]
    solved = _solve_local(p_zz, jnp.concatenate([p_zg, eta1_z[:, None]], axis=-1))
    marginal = p_gg - p_zg.T @ solved[:, :num_global]
    q = GaussianNatural(eta1_g - p_zg.T @ solved[:, num_global], -0.25 * (marginal + marginal.T))
    return q, GaussianNatural(eta1_z, joint_eta.eta2[num_global:])


def mask_padding(cond: GaussianNatural, valid) -> GaussianNatural:
    """The conditional with its padding coordinates (``valid`` false) a standard normal,
    independent of every other coordinate."""
    num_global = cond.eta2.shape[-1] - cond.eta2.shape[-2]
    cols = jnp.concatenate([jnp.ones(num_global, bool), valid])
    keep = valid[:, None] & cols[None, :]
    pad_diag = jnp.concatenate([jnp.zeros((valid.size, num_global), bool), jnp.diag(~valid)], axis=-1)
    eta2 = jnp.where(keep, cond.eta2, jnp.where(pad_diag, -0.5, 0.0).astype(cond.eta2.dtype))
    return GaussianNatural(jnp.where(valid, cond.eta1, 0.0), eta2)


def draw_conditional(cond: GaussianNatural, thetas, eps):
    """``(S, L)`` draws of ``q(z_m | theta)`` at ``thetas (S, d_g)`` from standard normal
    ``eps (S, L)``."""
    p_zg, p_zz = _blocks(cond)
    chol = jnp.linalg.cholesky(0.5 * (p_zz + p_zz.T))
    means = jax.scipy.linalg.cho_solve((chol, True), cond.eta1[:, None] - p_zg @ thetas.T).T
    # P_zz = C C^T: C^-T eps has covariance P_zz^-1
    return means + jax.scipy.linalg.solve_triangular(chol, eps.T, lower=True, trans=1).T


def conditional_entropy(cond: GaussianNatural, valid):
    """``H[q(z_m | theta)]`` (the same for every ``theta``) over the ``valid`` coordinates
    (padding coordinates, standard normals independent of the rest, add nothing)."""
    _, p_zz = _blocks(cond)
    chol = jnp.linalg.cholesky(0.5 * (p_zz + p_zz.T))
    return jnp.sum(jnp.where(valid, _HALF_LOG_2_PI_E - jnp.log(jnp.diagonal(chol)), 0.0))
