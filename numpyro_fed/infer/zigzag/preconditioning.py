"""Preconditioning: the process moves in ``u`` with ``x = center + scale u``, the Zig-Zag
counterpart of NUTS's mass matrix (the axis-aligned velocities are not slowed by
correlations or unequal scales when the posterior of ``u`` is close to standard normal)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

import jax
import jax.numpy as jnp

from numpyro_fed.infer.zigzag.bounds import GradientBound, HessianBound
from numpyro_fed.infer.zigzag.proposers import Proposers

__all__ = [
    "Preconditioner",
    "laplace_preconditioner",
    "precondition",
    "preconditioned_bound",
    "preconditioned_row_grad",
    "user_preconditioner",
]


class Preconditioner(NamedTuple):
    """The linear map ``x = center + scale u`` between the model's flat unconstrained space
    ``x`` and the space ``u`` the process moves in. ``scale`` is ``(d,)`` (diagonal) or
    ``(d, d)``.

    >>> import jax.numpy as jnp
    >>> p = Preconditioner(jnp.array([1.0, 2.0]), jnp.array([2.0, 0.5]))
    >>> p.to_x(jnp.array([1.0, 2.0])).tolist(), p.to_u(jnp.array([3.0, 3.0])).tolist()
    ([3.0, 3.0], [1.0, 2.0])
    """

    center: jax.Array
    scale: jax.Array

    def to_x(self, u):
        return self.center + self.direction_to_x(u)

    def direction_to_x(self, v):
        return self.scale * v if self.scale.ndim == 1 else v @ self.scale.T

    def to_u(self, x):
        if self.scale.ndim == 1:
            return (x - self.center) / self.scale
        return jnp.linalg.solve(self.scale, (x - self.center).T).T

    def pull_back(self, rows):
        """Gradients (rows ``(..., d)`` in ``x``) as gradients in ``u``: ``rows @ scale``."""
        return rows * self.scale if self.scale.ndim == 1 else rows @ self.scale

    def matrix(self):
        """``scale`` as a ``(d, d)`` matrix."""
        return jnp.diag(self.scale) if self.scale.ndim == 1 else self.scale

    def abs_matrix(self):
        return jnp.abs(self.matrix())

    def bound_to_u(self, bound):
        """A bound ``H`` on ``|d_i d_k U|`` in ``x`` (``(..., d, d)``) as one in ``u``:
        ``|scale^T h scale| <= |scale|^T H |scale|`` entrywise (NumPy in, NumPy out)."""
        absolute = self.abs_matrix()
        if isinstance(bound, np.ndarray):
            absolute = np.asarray(absolute, bound.dtype)
        return absolute.T @ bound @ absolute

    def third_bound_to_u(self, bound):
        """A bound ``C`` ``(d,)`` on ``|w^T (d_i H) w| / |w|^2`` in ``x`` as one in ``u``: with
        ``y = scale w``, ``|w^T (d_{u_i} H^u) w| = |sum_l scale_li y^T (d_l H) y| <= (|scale|^T
        C)_i |scale|_2^2 |w|^2``."""
        matrix = self.matrix()
        return jnp.abs(matrix).T @ bound * jnp.linalg.norm(matrix, 2) ** 2


def precondition(proposers: Proposers, preconditioner: Preconditioner) -> Proposers:
    """The same proposers as functions of ``u`` (``x = center + scale u``): gradients are
    pulled back (``scale^T grad``) and slopes taken along ``scale v``. The target in ``u`` is
    the image of the posterior under a linear map, so sampling it and mapping back is exact."""
    to_x, along, pull = preconditioner.to_x, preconditioner.direction_to_x, preconditioner.pull_back

    def term_grads_and_slopes(u, v):
        grads, slopes = proposers.term_grads_and_slopes(to_x(u), along(v))
        return pull(grads), pull(slopes)

    def prior_grad_and_slope(u, v):
        grad, slope = proposers.prior_grad_and_slope(to_x(u), along(v))
        return pull(grad), pull(slope)

    return Proposers(
        term_grads_and_slopes=term_grads_and_slopes,
        term_grads=lambda u: pull(proposers.term_grads(to_x(u))),
        term_grad_of=lambda u, j: pull(proposers.term_grad_of(to_x(u), j)),
        prior_grad_and_slope=prior_grad_and_slope,
        num=proposers.num,
    )


def preconditioned_row_grad(grad, preconditioner: Preconditioner):
    """``grad(x, block)`` (a client's or a row's gradient in ``x``) as a function of ``u``:
    ``scale^T grad(center + scale u, block)``, whose Jacobian is the curvature in ``u``
    (``scale^T H scale``): what subsampling draws its rows by and bounds its estimates with.

    >>> import jax.numpy as jnp
    >>> p = Preconditioner(jnp.zeros(2), jnp.array([2.0, 0.5]))
    >>> preconditioned_row_grad(lambda x, block: block * x, p)(jnp.ones(2), jnp.array([1.0, 4.0])).tolist()
    [4.0, 1.0]
    """
    to_x, pull = preconditioner.to_x, preconditioner.pull_back

    def row_grad(u, block):
        return pull(grad(to_x(u), block))

    return row_grad


def preconditioned_bound(bound, preconditioner: Preconditioner):
    """A user's bound in ``x`` as a bound in ``u``: ``|scale^T g| <= |scale|^T G`` and
    ``|scale^T H scale| <= |scale|^T H |scale|`` entrywise."""
    if isinstance(bound, GradientBound):
        absolute = preconditioner.abs_matrix()
        return GradientBound(bound.clients @ absolute, bound.prior @ absolute)
    return HessianBound(preconditioner.bound_to_u(bound.clients), preconditioner.bound_to_u(bound.prior))


def laplace_preconditioner(flat_potential, mode, *, diagonal: bool = False, hessian=None) -> Preconditioner:
    """The Laplace approximation at ``mode``: ``scale`` the Cholesky factor of the inverse
    Hessian there (``diagonal``: ``1 / sqrt`` of the Hessian's diagonal). In a federation this
    is one aggregation round: each client's Hessian at the mode, summed with the prior's
    (pass that as ``hessian``, ``x -> (d, d)``; default ``jax.hessian(flat_potential)``)."""
    hessian = (jax.hessian(flat_potential) if hessian is None else hessian)(mode)
    if diagonal:
        curvature = jnp.diag(hessian)
        if not bool(jnp.all(curvature > 0)):
            raise ValueError(
                "preconditioner='diagonal': the Hessian at the mode has a "
                "non-positive diagonal entry; pass a scale instead"
            )
        return Preconditioner(mode, 1 / jnp.sqrt(curvature))
    scale = jnp.linalg.cholesky(jnp.linalg.inv(hessian))
    if not bool(jnp.all(jnp.isfinite(scale))):
        raise ValueError(
            "preconditioner='laplace': the Hessian at the mode is not positive definite; use 'diagonal' or pass a scale"
        )
    return Preconditioner(mode, scale)


def user_preconditioner(scale, center, d: int, dtype) -> Preconditioner:
    """A user's ``scale``, ``(d,)`` or ``(d, d)``, checked (finite, positive or invertible)."""
    scale = jnp.asarray(scale, dtype)
    if scale.shape not in ((d,), (d, d)):
        raise ValueError(
            f"preconditioner must have shape ({d},) or ({d}, {d}) (the flat "
            f"unconstrained coordinates), got {scale.shape}"
        )
    if not bool(jnp.all(jnp.isfinite(scale))):
        raise ValueError("preconditioner must be finite")
    if scale.ndim == 1 and not bool(jnp.all(scale > 0)):
        raise ValueError("a diagonal preconditioner must be > 0")
    if scale.ndim == 2 and abs(float(jnp.linalg.det(scale))) == 0.0:
        raise ValueError("preconditioner must be an invertible matrix")
    center = center if center is not None else jnp.zeros(d, dtype)
    return Preconditioner(center, scale)
