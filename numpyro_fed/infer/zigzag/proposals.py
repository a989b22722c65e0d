"""Event-time proposals: every proposer's first arrival of its bounding Poisson process.

Each function is what the proposers compute on their own (in a federation: each client
from its own row of the bound, with its own random key); the server then takes the
earliest (:func:`~numpyro_fed.infer.zigzag.kernel.step`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from numpyro_fed.infer.zigzag.state import LineBound

__all__ = ["Proposals", "affine_first_arrival", "exponential", "grid_proposals", "line_proposals"]


class Proposals(NamedTuple):
    """Every proposer's proposal, ``(P,)`` each.

    :ivar tau: time of the proposal from the current point (``inf``: none on this line).
    :ivar coordinate: the coordinate whose velocity would flip.
    :ivar bound: the bound on that coordinate's rate at ``tau`` (``inf`` for a refreshment).
    :ivar certain: the proposal is a refreshment, accepted without a check.
    """

    tau: jax.Array
    coordinate: jax.Array
    bound: jax.Array
    certain: jax.Array


def exponential(key, shape, dtype):
    """Standard exponential draws, ``-log(U)`` with ``U`` bounded away from 0."""
    return -jnp.log(jax.random.uniform(key, shape, dtype, minval=jnp.finfo(dtype).tiny))


def affine_first_arrival(a, b, e):
    """First time ``t`` with ``int_0^t max(0, a + b s) ds = e`` (``inf`` if never), elementwise.

    >>> import jax.numpy as jnp
    >>> float(affine_first_arrival(jnp.array(0.0), jnp.array(2.0), jnp.array(1.0)))  # t^2 = 1
    1.0
    """
    b_safe = jnp.where(b == 0, 1.0, b)
    # b > 0: the rate is zero until s0 = max(0, -a/b), then grows linearly
    s0 = jnp.maximum(0.0, -a / b_safe)
    a0 = jnp.maximum(a, 0.0)
    rising = s0 + (-a0 + jnp.sqrt(a0**2 + 2 * b_safe * e)) / b_safe
    # b < 0: a falling rate integrates to at most a^2 / (2|b|)
    reachable = (a > 0) & (a**2 / (2 * jnp.abs(b_safe)) > e)
    falling = jnp.where(reachable, (-a + jnp.sqrt(jnp.maximum(a**2 + 2 * b_safe * e, 0.0))) / b_safe, jnp.inf)
    constant = jnp.where(a > 0, e / jnp.where(a > 0, a, 1.0), jnp.inf)
    return jnp.where(b > 0, rising, jnp.where(b < 0, falling, constant))


def grid_proposals(line: LineBound, k_clock, k_coordinate) -> Proposals:
    """First arrivals after ``line.position`` of each proposer's piecewise-constant bound
    (the excess rate is part of the bound); the coordinate by inverse CDF of the proposer's
    bounds in the segment of its arrival."""
    num_segments, num, d = line.bound.shape
    dtype = line.bound.dtype
    exponentials = exponential(k_clock, (num,), dtype)
    edges, position = line.times, line.position
    lengths = jnp.clip(edges[1:] - jnp.maximum(edges[:-1], position), 0.0)  # (K-1,)
    totals = line.bound.sum(-1)  # (K-1, P)
    cumulative = jnp.cumsum(totals * lengths[:, None], axis=0)
    segment = jnp.sum(cumulative < exponentials[None, :], axis=0)  # first crossing, K-1 if none
    has_event = segment < num_segments
    segment = jnp.minimum(segment, num_segments - 1)
    before = jnp.where(segment > 0, jnp.take_along_axis(cumulative, jnp.maximum(segment - 1, 0)[None], 0)[0], 0.0)
    rate_in_segment = jnp.take_along_axis(totals, segment[None], 0)[0]
    tau = (
        jnp.maximum(edges[segment], position)
        - position
        + (exponentials - before) / jnp.where(rate_in_segment > 0, rate_in_segment, 1.0)
    )
    tau = jnp.where(has_event, tau, jnp.inf)
    coordinate_bounds = line.bound[segment, jnp.arange(num)]  # (P, d)
    cumulative_bounds = jnp.cumsum(coordinate_bounds, -1)
    picks = jax.random.uniform(k_coordinate, (num,), dtype) * cumulative_bounds[:, -1]
    coordinates = jnp.minimum(jnp.sum(cumulative_bounds < picks[:, None], -1), d - 1)
    bound_values = jnp.take_along_axis(coordinate_bounds, coordinates[:, None], -1)[:, 0]
    return Proposals(tau, coordinates, bound_values, jnp.zeros(num, bool))


def line_proposals(line: LineBound, excess, k_clock, k_coordinate, k_coordinate_clocks) -> Proposals:
    """Exact first arrivals of ``max(0, a + b t)`` after ``line.position`` per proposer and
    coordinate, plus each proposer's excess clock (``excess`` ``(P,)`` per coordinate: a
    refreshment of a uniformly chosen coordinate, always accepted)."""
    _, num, d = line.bound.shape
    dtype = line.bound.dtype
    a, b = line.bound[0] + line.bound[1] * line.position, line.bound[1]
    times = affine_first_arrival(a, b, exponential(k_coordinate_clocks, (num, d), dtype))
    coordinates = jnp.argmin(times, -1)
    tau = jnp.min(times, -1)
    bound_values = jnp.maximum(a + b * tau[:, None], 0.0)[jnp.arange(num), coordinates]
    # excess clocks: rate d * excess per proposer, a uniformly chosen coordinate
    total_excess = excess * d
    tau_excess = jnp.where(
        total_excess > 0, exponential(k_clock, (num,), dtype) / jnp.where(total_excess > 0, total_excess, 1.0), jnp.inf
    )
    excess_coordinate = jnp.minimum((jax.random.uniform(k_coordinate, (num,), dtype) * d).astype(jnp.int32), d - 1)
    from_excess = tau_excess < tau
    return Proposals(
        jnp.where(from_excess, tau_excess, tau),
        jnp.where(from_excess, excess_coordinate, coordinates),
        jnp.where(from_excess, jnp.inf, bound_values),
        from_excess,
    )
