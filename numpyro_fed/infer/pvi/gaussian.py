"""Diagonal Gaussians in natural parameters: the family PVI's ``q``, prior and factors live in."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["GaussianNatural", "gaussian_prior", "kl_divergence", "loc_scale", "natural"]


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


def loc_scale(eta: GaussianNatural):
    """``(loc, scale)`` of a proper Gaussian given by its natural parameters (inverse of
    :func:`natural`)."""
    precision = -2.0 * eta.eta2
    return eta.eta1 / precision, 1.0 / jnp.sqrt(precision)


def kl_divergence(q: GaussianNatural, p: GaussianNatural):
    """``KL(q || p)`` of two proper diagonal Gaussians, summed over coordinates."""
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
