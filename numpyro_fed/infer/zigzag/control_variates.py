"""Control variates (Remark 4.3): shifts of the proposers' rates that sum to zero.

Each proposer's rate is shifted by ``c_j = grad(T_j + w_j U_0)(x*) - grad U(x*) / P`` (first
order) or by ``c_j + A_j (x - x*)`` with ``A_j = hess(T_j + w_j U_0)(x*) - hess U(x*) / P``
(second order). The shifts sum to zero over proposers for any prior weights ``w``, so the
target is unchanged, and near the reference point ``x*`` the proposers' rates lose the
client-to-client scatter of their gradients.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from numpyro_fed.infer.zigzag.proposers import Proposers

__all__ = [
    "ControlVariates",
    "Shift",
    "control_variate_reference",
    "rate_scales",
    "shift_at",
    "shift_for",
    "shift_of",
    "shift_slope",
    "switched",
]


class ControlVariates(NamedTuple):
    """What the control variates need at their reference point ``x*`` (Remark 4.3).

    :ivar point: ``x*`` ``(d,)``, flat and unconstrained.
    :ivar term_grads: ``(P, d)`` gradients of the proposers' own terms at ``x*``.
    :ivar prior_grad: ``(d,)`` gradient of the prior's potential at ``x*``.
    :ivar term_hessians: ``(P, d, d)`` Hessians of the proposers' own terms at ``x*``, for
        second-order control variates (``None``: first order).
    :ivar prior_hessian: ``(d, d)`` Hessian of the prior's potential at ``x*`` (second order).
    """

    point: jax.Array
    term_grads: jax.Array
    prior_grad: jax.Array
    term_hessians: jax.Array | None = None
    prior_hessian: jax.Array | None = None

    @property
    def second_order(self) -> bool:
        return self.term_hessians is not None


class Shift(NamedTuple):
    """Every proposer's shift ``constant_j + A_j (x - x*)`` for the current prior weights.

    :ivar constant: ``(P, d)``: ``c_j`` (zeros without control variates).
    :ivar reference: the :class:`ControlVariates` (``None``: no control variates).
    :ivar weights: ``(P,)`` prior weights, for the linear part (``None``: first order).
    """

    constant: jax.Array
    reference: ControlVariates | None
    weights: jax.Array | None


def _mean_gradient(reference: ControlVariates):
    """``grad U(x*) / P``: each proposer's share of the full gradient at the reference."""
    return (reference.term_grads.sum(0) + reference.prior_grad) / reference.term_grads.shape[0]


def _linear_part(reference: ControlVariates, weights, y):
    """``(P, d)``: ``A_j y`` for every proposer, without forming the ``A_j``."""
    num = reference.term_hessians.shape[0]
    mean_hessian = (reference.term_hessians.sum(0) + reference.prior_hessian) / num
    return reference.term_hessians @ y + weights[:, None] * (reference.prior_hessian @ y) - mean_hessian @ y


def shift_for(reference: ControlVariates | None, weights, num: int, d: int, dtype) -> Shift:
    """The :class:`Shift` of every proposer for prior weights ``weights`` ``(P,)``."""
    if reference is None:
        return Shift(jnp.zeros((num, d), dtype), None, None)
    constant = reference.term_grads + weights[:, None] * reference.prior_grad - _mean_gradient(reference)
    return Shift(constant, reference, weights if reference.second_order else None)


def shift_at(shift: Shift, x):
    """``(P, d)`` shifts at ``x``."""
    if shift.weights is None:
        return shift.constant
    return shift.constant + _linear_part(shift.reference, shift.weights, x - shift.reference.point)


def shift_slope(shift: Shift, v):
    """``(P, d)`` derivatives of the shifts along ``v`` (0 for first order)."""
    return 0.0 if shift.weights is None else _linear_part(shift.reference, shift.weights, v)


def shift_of(shift: Shift, j, coordinate, x):
    """Proposer ``j``'s shift of ``coordinate`` at ``x`` (the winner's check)."""
    value = shift.constant[j, coordinate]
    if shift.weights is None:
        return value
    reference = shift.reference
    num = reference.term_hessians.shape[0]
    mean_row = (reference.term_hessians[:, coordinate].sum(0) + reference.prior_hessian[coordinate]) / num
    row = reference.term_hessians[j, coordinate] + shift.weights[j] * reference.prior_hessian[coordinate] - mean_row
    return value + row @ (x - reference.point)


def control_variate_reference(proposers: Proposers, reference, *, order: int = 1) -> ControlVariates:
    """:class:`ControlVariates` at the reference point ``x*``: one aggregation round in which
    every proposer sends its gradient at ``x*`` (and, with ``order=2``, its Hessian there:
    ``d`` Hessian-vector products per client).

    With second order each proposer's shifted gradient is ``grad U(x) / P`` up to second
    order around ``x*``: the clients' rates no longer scatter when their curvatures differ
    (few rows per client, many coordinates).

    **Example**

    >>> import jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> import numpyro_fed as nf
    >>> from numpyro_fed.infer.zigzag import control_variate_reference, proposers_from_potential
    >>> def model(y):
    ...     mu = numpyro.sample("mu", dist.Normal(0, 1))
    ...     with nf.federated_plate("data", 4, clients=2):
    ...         numpyro.sample("y", dist.Normal(mu, 1), obs=y)
    >>> proposers, _ = proposers_from_potential(nf.split_potential(model, (jnp.arange(4.0),)))
    >>> cv = control_variate_reference(proposers, jnp.zeros(1))
    >>> cv.term_grads[:, 0].tolist(), cv.second_order
    ([-1.0, -5.0, 0.0], False)
    """
    if order not in (1, 2):
        raise ValueError(f"order must be 1 or 2, got {order!r}")
    reference = jnp.asarray(reference)
    prior_grad = proposers.prior_grad_and_slope(reference, jnp.zeros_like(reference))[0]
    term_grads = proposers.term_grads(reference)
    if order == 1:
        return ControlVariates(reference, term_grads, prior_grad)
    basis = jnp.eye(reference.shape[0], dtype=reference.dtype)
    # column k of every Hessian is its product with e_k
    term_hessians = jax.vmap(lambda e: proposers.term_grads_and_slopes(reference, e)[1], out_axes=2)(basis)
    prior_hessian = jax.vmap(lambda e: proposers.prior_grad_and_slope(reference, e)[1], out_axes=1)(basis)
    # symmetrize: the products are exact up to rounding
    term_hessians = (term_hessians + jnp.swapaxes(term_hessians, 1, 2)) / 2
    prior_hessian = (prior_hessian + prior_hessian.T) / 2
    return ControlVariates(reference, term_grads, prior_grad, term_hessians, prior_hessian)


def switched(reference: ControlVariates, on) -> ControlVariates:
    """``reference`` when ``on``, else one with zero gradients and Hessians (no shift): the
    warmup turns the control variates off without changing the kernel's structure."""
    return reference._replace(
        term_grads=jnp.where(on, reference.term_grads, 0.0),
        prior_grad=jnp.where(on, reference.prior_grad, 0.0),
        **(
            {}
            if reference.term_hessians is None
            else dict(
                term_hessians=jnp.where(on, reference.term_hessians, 0.0),
                prior_hessian=jnp.where(on, reference.prior_hessian, 0.0),
            )
        ),
    )


def rate_scales(proposers: Proposers, reference: ControlVariates, weights, x):
    """``(with, without)``: ``sum_j sum_i |d_i T_j(x) - c_ji(x)|`` with the control variates'
    shifts and without them, twice the expected switching rate over velocities at ``x``."""
    prior_grad = proposers.prior_grad_and_slope(x, jnp.zeros_like(x))[0]
    grads = proposers.term_grads(x) + weights[:, None] * prior_grad
    shift = shift_at(shift_for(reference, weights, proposers.num, x.shape[0], x.dtype), x)
    return jnp.abs(grads - shift).sum(), jnp.abs(grads).sum()
