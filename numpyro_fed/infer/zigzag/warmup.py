"""Warmup of the control variates: re-centering them on the trajectory, turning them off
when they do not pay, and detecting a stalled chain."""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple
import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from numpyro_fed._checks import user_origin, warn_user
from numpyro_fed.infer.zigzag.control_variates import ControlVariates, control_variate_reference, rate_scales
from numpyro_fed.infer.zigzag.proposers import Proposers
from numpyro_fed.infer.zigzag.state import SampleInfo, ZigZagState

__all__ = ["BUFFER_SIZE", "COSTLIER_MARGIN", "STALL_MIN_PROPOSALS", "WarmupState", "init_warmup", "warmup_adaptation"]

#: warmup positions kept to compare the rates with and without control variates
BUFFER_SIZE = 16
#: fewer proposals without a switch are not evidence of a stall
STALL_MIN_PROPOSALS = 50
#: the control variates are turned off only if they make the rates this much larger: where
#: they change nothing (one client, a Gaussian with clients whose gradients share a sign) the
#: comparison is a tie decided by round-off
COSTLIER_MARGIN = 0.05


class WarmupState(NamedTuple):
    """The warmup's state, per chain (``FedZigZagState.adapt``): the control variates'
    reference (:class:`~numpyro_fed.infer.zigzag.ControlVariates`, or ``None``), whether they
    are on, the current warmup window's path integral and duration, the last
    ``BUFFER_SIZE`` warmup positions, whether the chain has stalled, and the set-up calls
    its decisions made through a federation (``(2,)`` int32: ``"value_and_grad"`` and
    ``"hessian"`` messages per client; counted with or without one)."""

    reference: ControlVariates | None
    active: jax.Array
    window_sum: jax.Array
    window_time: jax.Array
    buffer: jax.Array
    stalled: jax.Array
    client_calls: jax.Array


def init_warmup(reference: ControlVariates | None, active: bool, u) -> WarmupState:
    """The warmup's state before the first draw, for a chain starting at ``u``."""
    return WarmupState(
        reference=reference, active=jnp.asarray(active),
        window_sum=jnp.zeros_like(u), window_time=jnp.zeros((), u.dtype),
        buffer=jnp.zeros((BUFFER_SIZE,) + u.shape, u.dtype), stalled=jnp.zeros((), bool),
        client_calls=jnp.zeros(2, jnp.int32),
    )


def warmup_adaptation(proposers: Proposers, *, num_warmup, recenter, order, can_switch_off,
                      max_proposals, sample_interval, reference_fn=None):
    """``update(adapt, state, info, i) -> adapt`` after draw ``i`` (the process's state and
    its :class:`~numpyro_fed.infer.zigzag.SampleInfo`).

    * Re-centering (no mode was found): the reference moves to the mean of the trajectory over
      the warmup windows ending at 1/8, 1/4, 1/2 and all of the warmup (each window's mean,
      the last one over the second half), and the control variates are on from the first.
    * At the end of the warmup the expected rates with and without the control variates are
      compared at the last warmup positions; if the shifts make them larger (by more than
      ``COSTLIER_MARGIN``), they are turned off for good (with a warning).
    * A draw that ends at ``max_proposals`` (>= 50) without a single switch is a stall: during
      warmup with control variates on they are turned off; otherwise the chain stops (its
      remaining draws repeat the last position, each marked ``hit_event_cap``) and a warning
      names the remedy.

    ``reference_fn(point) -> ControlVariates`` re-centers (default
    :func:`~numpyro_fed.infer.zigzag.control_variate_reference` on ``proposers``; with a
    federation the one that asks the clients).
    """
    if reference_fn is None:
        reference_fn = partial(control_variate_reference, proposers, order=order)
    # messages per client of a re-centering and of the end-of-warmup comparison
    recenter_calls = jnp.asarray([1, int(order == 2)], jnp.int32)
    compare_calls = jnp.asarray([BUFFER_SIZE, 0], jnp.int32)
    ends = sorted({max(1, math.ceil(f * num_warmup)) for f in (1 / 8, 1 / 4, 1 / 2, 1)}) if num_warmup else []
    window_ends = jnp.asarray(ends if recenter else [0], jnp.int32)
    origin = user_origin()  # the user's line that started the run, for the callback's warnings

    def update(adapt: WarmupState, state: ZigZagState, info: SampleInfo, i):
        warm = i < num_warmup
        fallback_possible = can_switch_off and adapt.reference is not None
        stalled_now = (info.hit_event_cap & (info.num_events == 0) & ~adapt.stalled
                       & (info.num_proposals >= min(max_proposals, STALL_MIN_PROPOSALS))
                       & (max_proposals >= STALL_MIN_PROPOSALS))
        switch_off = stalled_now & warm & adapt.active if fallback_possible else jnp.zeros((), bool)
        adapt = adapt._replace(stalled=adapt.stalled | (stalled_now & ~switch_off),
                               active=adapt.active & ~switch_off)
        cheaper = jnp.ones((), bool)
        if num_warmup and adapt.reference is not None:
            slot = i % BUFFER_SIZE
            adapt = adapt._replace(
                window_sum=adapt.window_sum + jnp.where(warm, info.path_integral, 0.0),
                window_time=adapt.window_time + jnp.where(warm, info.elapsed, 0.0),
                buffer=jnp.where(warm, adapt.buffer.at[slot].set(state.x), adapt.buffer),
            )
            if recenter:
                def move(adapt):
                    point = adapt.window_sum / adapt.window_time
                    return adapt._replace(
                        reference=reference_fn(point),
                        active=adapt.active | ~adapt.stalled,
                        client_calls=adapt.client_calls + recenter_calls,
                        window_sum=jnp.zeros_like(adapt.window_sum),
                        window_time=jnp.zeros_like(adapt.window_time),
                    )

                at_end = warm & jnp.any(i + 1 == window_ends) & (adapt.window_time > 0)
                adapt = lax.cond(at_end & ~switch_off, move, lambda a: a, adapt)
            if fallback_possible:
                def compare(adapt):
                    filled = jnp.arange(BUFFER_SIZE) < jnp.minimum(i + 1, BUFFER_SIZE)
                    weights = state.prior_weights
                    with_cv, without = jax.vmap(lambda x: rate_scales(proposers, adapt.reference, weights, x))(adapt.buffer)
                    with_cv = jnp.sum(jnp.where(filled, with_cv, 0.0))
                    return with_cv <= (1 + COSTLIER_MARGIN) * jnp.sum(jnp.where(filled, without, 0.0))

                last = (i + 1 == num_warmup) & adapt.active
                cheaper = lax.cond(last, compare, lambda a: jnp.ones((), bool), adapt)
                adapt = adapt._replace(active=adapt.active & cheaper,
                                       client_calls=adapt.client_calls + jnp.where(last, compare_calls, 0))
        report = partial(_report_adaptation, max_proposals=max_proposals,
                         sample_interval=sample_interval, origin=origin)
        lax.cond(stalled_now | switch_off | ~cheaper,
                 lambda: jax.debug.callback(report, i, stalled_now & ~switch_off, switch_off, ~cheaper),
                 lambda: None)
        return adapt

    return update


def _report_adaptation(i, stalled, switched_off, costlier, *, max_proposals, sample_interval, origin=None):
    """Host side of the warmup's decisions: one warning per decision."""
    i, stalled, switched_off, costlier = (np.asarray(a) for a in (i, stalled, switched_off, costlier))
    if np.any(switched_off):
        warn_user(
            f"FedZigZag: control variates turned off at warmup draw {int(np.max(i))}: a draw made "
            f"max_proposals={int(max_proposals)} proposals without a switch with them on (their "
            "reference point is a poor center for this posterior); the chain continues without",
            RuntimeWarning, origin)
    if np.any(costlier):
        warn_user(
            "FedZigZag: control variates turned off at the end of the warmup: at the last warmup "
            "positions they made the switching rates larger, not smaller (the posterior is far "
            "from Gaussian around the reference point)",
            RuntimeWarning, origin)
    if np.any(stalled):
        warn_user(
            f"FedZigZag: a chain stalled at draw {int(np.max(i))}: max_proposals="
            f"{int(max_proposals)} proposals without a single switch; its remaining draws repeat "
            "its last position (marked hit_event_cap). The process is caught where the rates are "
            "huge: reparametrize the model (e.g. non-centered), pass control_variates=False, or "
            f"shorten sample_interval={sample_interval}",
            RuntimeWarning, origin)
