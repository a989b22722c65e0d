"""Warmup of the federated Zig-Zag sampler: the sample interval fitted to the posterior's
scale, the control variates re-centered on the trajectory or turned off when they do not pay,
and a stalled chain detected.

**The sample interval.** A draw is the position after ``interval`` units of process time. The
process moves at unit speed in every coordinate, so what matters is the interval in posterior
sds: the posterior contracts like ``1/sqrt(n)`` with ``n`` rows, and a fixed interval spans
more and more sds (and switches) as ``n`` grows. With ``sample_interval`` left at its default
the warmup sets ``interval = INTERVAL_SDS x`` the smallest marginal posterior sd of the
process's coordinates (``u`` with a preconditioner), estimated exactly from the warmup's
piecewise-linear path (its time averages of ``x`` and ``x^2``). Before the first estimate (the
first ``1/8`` of the warmup) the interval follows the switching rate: a Gaussian coordinate of
sd ``s`` switches at rate ``1 / (s sqrt(2 pi))`` in equilibrium, so ``d`` coordinates switching
``Lambda`` times per unit time have a (harmonic) mean sd of about ``d / (Lambda sqrt(2 pi))``.
The estimates are refreshed at ``1/8``, ``1/4``, ``1/2`` and the end of the warmup (all but
the first from the whole path after ``1/8``, which drops the approach to equilibrium); after
the warmup the interval is fixed and the chain is an exact Zig-Zag process sampled at equal
times.

**The interval and the slowest direction.** Three sds of the smallest coordinate is enough
where the coordinates mix at the pace of their own scales; on a posterior the process
crosses slowly (a centred hierarchy, where the group scale moves only as fast as the spread of
its many effects) a draw that short is correlated with many after it. Over the last warmup
window (the interval is constant there) the draws' autocorrelations at lags 1, 2, 4, ..., 64
are accumulated for every coordinate; at the end of the warmup the largest integrated
autocorrelation time ``tau`` (in draws; its tail past the last lag extrapolated
geometrically) sets a floor: the interval is at least the window's interval times
``tau / TARGET_AUTOCORRELATION``, at most ``MAX_INTERVAL_GROWTH`` times it, so that the
slowest coordinate keeps a good share of its draws effective (see :data:`TARGET_AUTOCORRELATION`).
"""

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

__all__ = [
    "BUFFER_SIZE",
    "COSTLIER_MARGIN",
    "DEFAULT_INTERVAL",
    "INITIAL_INTERVAL",
    "INTERVAL_SDS",
    "LAGS",
    "MAX_INTERVAL_GROWTH",
    "STALL_MIN_PROPOSALS",
    "TARGET_AUTOCORRELATION",
    "WarmupState",
    "accumulate_lags",
    "autocorrelation_time",
    "init_warmup",
    "interval_windows",
    "warmup_adaptation",
]

#: warmup positions kept to compare the rates with and without control variates
BUFFER_SIZE = 16
#: fewer proposals without a switch are not evidence of a stall
STALL_MIN_PROPOSALS = 50
#: the control variates are turned off only if they make the rates this much larger: where
#: they change nothing (one client, a Gaussian with clients whose gradients share a sign) the
#: comparison is a tie decided by round-off
COSTLIER_MARGIN = 0.05
#: the adapted sample interval in smallest marginal posterior sds. A draw's effective size
#: grows about linearly with the interval up to about 4 sds on logistic regression (where
#: successive draws are anti-correlated: ESS above the number of draws), then falls; its cost
#: grows linearly once the switches dominate the fixed cost of a draw. So ESS per second is
#: flat from 1 to 4 sds where the switches dominate (large N) and grows up to 4 sds where the
#: fixed cost does (small N); 3 sds is near the best in both regimes without sitting next to
#: the fall after 4 (``benchmarks/zigzag_scale.py --sweep``; benchmarks/README.md)
INTERVAL_SDS = 3.0
#: the first warmup draw's interval when ``sample_interval`` adapts (then the switching rate
#: sets it, from the second draw)
INITIAL_INTERVAL = 0.1
#: ``sample_interval`` when it is not given and there is no warmup to adapt it
DEFAULT_INTERVAL = 1.0
#: the lags (in draws) at which the last warmup window's autocorrelations are measured
LAGS = (1, 2, 4, 8, 16, 32, 64)
#: the integrated autocorrelation time (in draws) the adapted interval allows the slowest
#: coordinate, as the warmup estimates it. The estimate from one window of a few hundred
#: draws is noisy and runs low where the autocorrelation time is long against the window: on
#: the centred radon model (tests/zoo/real_models.py) it gave 15 draws where the sampling
#: phase's draws at the same interval had 30. With 2.5 the slowest coordinate keeps about one
#: effective draw in 5 at such an estimate (the real tier's target is 1 in 10)
TARGET_AUTOCORRELATION = 2.5
#: the autocorrelation may lengthen the interval at most this many times (a bound on the cost
#: of a draw; a chain that needs more is left to ``check_run``'s effective-draws warning)
MAX_INTERVAL_GROWTH = 16.0


class WarmupState(NamedTuple):
    """The warmup's state, per chain (``FedZigZagState.adapt``): the control variates'
    reference (:class:`~numpyro_fed.infer.zigzag.ControlVariates`, or ``None``), whether they
    are on, the current warmup window's path integral and duration, the last
    ``BUFFER_SIZE`` warmup positions, whether the chain has stalled; and the sample
    interval: ``interval`` (process time between draws, fixed after the warmup), the path's
    integrals of ``x`` and ``x^2`` (its diagonal) and its duration and switches since the
    current estimation window began (``scale_sum``, ``scale_square``, ``scale_time``,
    ``scale_events``); over the last window, the draws' sums, sums of squares and lagged
    products (:data:`LAGS`) about the window's first draw and the last ``max(LAGS)`` draws
    (``lag_shift``, ``lag_sum``, ``lag_square``, ``lag_products``, ``lag_counts``,
    ``lag_ring``)."""

    reference: ControlVariates | None
    active: jax.Array
    window_sum: jax.Array
    window_time: jax.Array
    buffer: jax.Array
    stalled: jax.Array
    interval: jax.Array
    scale_sum: jax.Array
    scale_square: jax.Array
    scale_time: jax.Array
    scale_events: jax.Array
    lag_shift: jax.Array | None = None
    lag_sum: jax.Array | None = None
    lag_square: jax.Array | None = None
    lag_products: jax.Array | None = None
    lag_counts: jax.Array | None = None
    lag_ring: jax.Array | None = None


def init_warmup(reference: ControlVariates | None, active: bool, u, interval=DEFAULT_INTERVAL) -> WarmupState:
    """The warmup's state before the first draw, for a chain starting at ``u``, whose first
    draw lasts ``interval``."""
    return WarmupState(
        reference=reference,
        active=jnp.asarray(active),
        window_sum=jnp.zeros_like(u),
        window_time=jnp.zeros((), u.dtype),
        buffer=jnp.zeros((BUFFER_SIZE,) + u.shape, u.dtype),
        stalled=jnp.zeros((), bool),
        interval=jnp.asarray(interval, u.dtype),
        scale_sum=jnp.zeros_like(u),
        scale_square=jnp.zeros_like(u),
        scale_time=jnp.zeros((), u.dtype),
        scale_events=jnp.zeros((), u.dtype),
        lag_shift=jnp.zeros_like(u),
        lag_sum=jnp.zeros_like(u),
        lag_square=jnp.zeros_like(u),
        lag_products=jnp.zeros((len(LAGS),) + u.shape, u.dtype),
        lag_counts=jnp.zeros(len(LAGS), u.dtype),
        lag_ring=jnp.zeros((max(LAGS),) + u.shape, u.dtype),
    )


def interval_windows(num_warmup: int) -> list[int]:
    """The warmup draws after which the sample interval is re-estimated from the path's sds
    (``ceil`` of ``1/8``, ``1/4``, ``1/2`` and all of ``num_warmup``).

    >>> interval_windows(1000)
    [125, 250, 500, 1000]
    """
    return sorted({max(1, math.ceil(f * num_warmup)) for f in (1 / 8, 1 / 4, 1 / 2, 1)}) if num_warmup else []


def accumulate_lags(adapt: WarmupState, x, i, start):
    """The draw ``x`` (number ``i``) added to the last window's lagged products (the window
    begins at draw ``start``)."""
    k = i - start  # the draw's place in the window
    first = k == 0
    shift = jnp.where(first, x, adapt.lag_shift)
    y = x - shift
    size = adapt.lag_ring.shape[0]
    lags = jnp.asarray(LAGS)
    earlier = adapt.lag_ring[(k - lags) % size]  # (lags, d): the draws ``lag`` before this one
    has = (lags <= k).astype(x.dtype)
    return adapt._replace(
        lag_shift=shift,
        lag_sum=adapt.lag_sum + y,
        lag_square=adapt.lag_square + y * y,
        lag_products=adapt.lag_products + has[:, None] * earlier * y,
        lag_counts=adapt.lag_counts + has,
        lag_ring=adapt.lag_ring.at[k % size].set(y),
    )


def autocorrelation_time(adapt: WarmupState):
    """``(d,)`` integrated autocorrelation times (in draws) of the last window's draws: twice
    the integral of the autocorrelation over the lags (1 at lag 0, made non-increasing, and
    geometric between :data:`LAGS`), cut where it first falls to 0.05 or below, or continued past the last lag by
    the geometric decay of the last two (at most ``4 max(LAGS)`` more). A lag counts where three
    quarters of the window's draws have a partner that far back; a coordinate that did not
    move has 1."""
    dtype = adapt.lag_sum.dtype
    n = jnp.maximum(adapt.lag_counts[0] + 1, 1.0)
    mean = adapt.lag_sum / n
    variance = adapt.lag_square / n - mean * mean
    counts = jnp.maximum(adapt.lag_counts, 1.0)
    rho = (adapt.lag_products / counts[:, None] - mean * mean) / jnp.where(variance > 0, variance, 1.0)
    usable = (adapt.lag_counts >= 0.75 * n)[:, None] & (variance > 0)
    lags = jnp.asarray((0,) + LAGS, dtype)
    rho = jnp.concatenate([jnp.ones_like(mean)[None], jnp.where(usable, rho, 0.0)])
    rho = lax.cummin(rho, axis=0)  # monotone, as Geyer's initial sequence: no rise from noise
    # cut at the first lag whose autocorrelation is small: from there on it adds noise only
    small = jnp.cumsum(rho <= 0.05, axis=0) > 0
    rho = jnp.where(small, jnp.maximum(rho, 0.0), rho)
    rho = jnp.where(jnp.cumsum(small, axis=0) > 1, 0.0, rho)
    # each segment's integral exact for a geometric decay between positive ends, else linear
    upper, lower, width = rho[:-1], rho[1:], (lags[1:] - lags[:-1])[:, None]
    geometric = (lower > 0) & (upper > lower * (1 + 1e-6))
    ratio = jnp.log(jnp.where(geometric, upper / jnp.where(geometric, lower, 1.0), 2.0))
    area = jnp.sum(width * jnp.where(geometric, (upper - lower) / ratio, (upper + lower) / 2), axis=0)
    last, before = rho[-1], rho[-2]
    decay = jnp.clip(jnp.where((last > 0.05) & (before > last), last / before, 0.0), 0.0, 0.999)
    per_lag = -(lags[-1] - lags[-2]) / jnp.log(jnp.where(decay > 0, decay, 0.5))
    tail = jnp.where(decay > 0, last * jnp.minimum(per_lag, 4 * lags[-1]), 0.0)
    tau = 2 * (area + tail)
    return jnp.where(variance > 0, jnp.maximum(tau, 1.0), 1.0).astype(dtype)


def _adapt_interval(adapt: WarmupState, info: SampleInfo, i, ends, x=None):
    """The interval after warmup draw ``i`` (see the module's docstring)."""
    dtype = adapt.interval.dtype
    d = adapt.scale_sum.shape[-1]
    square = info.path_square_integral
    if square.ndim > info.path_integral.ndim:  # full_covariance: the diagonal
        square = jnp.diagonal(square, axis1=-2, axis2=-1)
    adapt = adapt._replace(
        scale_sum=adapt.scale_sum + info.path_integral,
        scale_square=adapt.scale_square + square,
        scale_time=adapt.scale_time + info.elapsed,
        scale_events=adapt.scale_events + info.num_events.astype(dtype),
    )
    time = adapt.scale_time
    # the switching rate's rule, until the first window's end; (events + 1) keeps it finite
    # and lets the interval grow geometrically while the process has not switched yet
    by_rate = INTERVAL_SDS * d * time / (math.sqrt(2 * math.pi) * (adapt.scale_events + 1))
    mean = adapt.scale_sum / time
    sd = jnp.sqrt(jnp.maximum(jnp.min(adapt.scale_square / time - mean * mean), 0.0))
    by_sd = INTERVAL_SDS * sd
    at_end = jnp.any(i + 1 == ends)

    def usable(value):
        return (time > 0) & jnp.isfinite(value) & (value > 0)

    interval = jnp.where((i + 1 < ends[0]) & usable(by_rate), by_rate, adapt.interval)
    interval = jnp.where(at_end & usable(by_sd), by_sd, interval)
    if x is not None and ends.shape[0] > 1:  # the last window's autocorrelation
        start = ends[-2]
        adapt = lax.cond(i >= start, lambda a: accumulate_lags(a, x, i, start), lambda a: a, adapt)
        window = adapt

        def with_floor(interval):  # at the warmup's last draw only: the window's estimate
            tau = jnp.max(autocorrelation_time(window))
            slowest = window.interval * jnp.minimum(tau / TARGET_AUTOCORRELATION, MAX_INTERVAL_GROWTH)
            return jnp.where(usable(slowest), jnp.maximum(interval, slowest), interval).astype(interval.dtype)

        interval = lax.cond(i + 1 == ends[-1], with_floor, lambda v: v, interval)
    adapt = adapt._replace(interval=interval.astype(dtype))
    # the first window (the approach to equilibrium) is forgotten
    restart = i + 1 == ends[0]
    return adapt._replace(
        scale_sum=jnp.where(restart, 0.0, adapt.scale_sum),
        scale_square=jnp.where(restart, 0.0, adapt.scale_square),
        scale_time=jnp.where(restart, 0.0, adapt.scale_time),
        scale_events=jnp.where(restart, 0.0, adapt.scale_events),
    )


def warmup_adaptation(
    proposers: Proposers,
    *,
    num_warmup,
    recenter,
    order,
    can_switch_off,
    max_proposals,
    reference_fn=None,
    interval_warmup: int = 0,
):
    """``update(adapt, state, info, i) -> adapt`` after draw ``i`` (the process's state and
    its :class:`~numpyro_fed.infer.zigzag.SampleInfo`).

    * The sample interval adapts over the first ``interval_warmup`` draws (0: it stays as
      :func:`init_warmup` set it; see the module's docstring).

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
    window_ends = jnp.asarray(interval_windows(num_warmup) if recenter and num_warmup else [0], jnp.int32)
    interval_ends = jnp.asarray(interval_windows(int(interval_warmup)) or [0], jnp.int32)
    origin = user_origin()  # the user's line that started the run, for the callback's warnings

    def update(adapt: WarmupState, state: ZigZagState, info: SampleInfo, i):
        warm = i < num_warmup
        if interval_warmup:
            adapt = lax.cond(
                i < interval_warmup, lambda a: _adapt_interval(a, info, i, interval_ends, state.x), lambda a: a, adapt
            )
        fallback_possible = can_switch_off and adapt.reference is not None
        stalled_now = (
            info.hit_event_cap
            & (info.num_events == 0)
            & ~adapt.stalled
            & (info.num_proposals >= min(max_proposals, STALL_MIN_PROPOSALS))
            & (max_proposals >= STALL_MIN_PROPOSALS)
        )
        switch_off = stalled_now & warm & adapt.active if fallback_possible else jnp.zeros((), bool)
        adapt = adapt._replace(stalled=adapt.stalled | (stalled_now & ~switch_off), active=adapt.active & ~switch_off)
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
                        window_sum=jnp.zeros_like(adapt.window_sum),
                        window_time=jnp.zeros_like(adapt.window_time),
                    )

                at_end = warm & jnp.any(i + 1 == window_ends) & (adapt.window_time > 0)
                adapt = lax.cond(at_end & ~switch_off, move, lambda a: a, adapt)
            if fallback_possible:

                def compare(adapt):
                    filled = jnp.arange(BUFFER_SIZE) < jnp.minimum(i + 1, BUFFER_SIZE)
                    weights = state.prior_weights
                    with_cv, without = jax.vmap(lambda x: rate_scales(proposers, adapt.reference, weights, x))(
                        adapt.buffer
                    )
                    with_cv = jnp.sum(jnp.where(filled, with_cv, 0.0))
                    return with_cv <= (1 + COSTLIER_MARGIN) * jnp.sum(jnp.where(filled, without, 0.0))

                last = (i + 1 == num_warmup) & adapt.active
                cheaper = lax.cond(last, compare, lambda a: jnp.ones((), bool), adapt)
                adapt = adapt._replace(active=adapt.active & cheaper)
        report = partial(_report_adaptation, max_proposals=max_proposals, origin=origin)
        lax.cond(
            stalled_now | switch_off | ~cheaper,
            lambda: jax.debug.callback(report, i, stalled_now & ~switch_off, switch_off, ~cheaper, adapt.interval),
            lambda: None,
        )
        return adapt

    return update


def _report_adaptation(i, stalled, switched_off, costlier, interval, *, max_proposals, origin=None):
    """Host side of the warmup's decisions: one warning per decision."""
    i, stalled, switched_off, costlier = (np.asarray(a) for a in (i, stalled, switched_off, costlier))
    sample_interval = f"{float(np.max(interval)):.3g}"
    if np.any(switched_off):
        warn_user(
            f"FedZigZag: control variates turned off at warmup draw {int(np.max(i))}: a draw made "
            f"max_proposals={int(max_proposals)} proposals without a switch with them on (their "
            "reference point is a poor center for this posterior); the chain continues without",
            RuntimeWarning,
            origin,
        )
    if np.any(costlier):
        warn_user(
            "FedZigZag: control variates turned off at the end of the warmup: at the last warmup "
            "positions they made the switching rates larger, not smaller (the posterior is far "
            "from Gaussian around the reference point)",
            RuntimeWarning,
            origin,
        )
    if np.any(stalled):
        warn_user(
            f"FedZigZag: a chain stalled at draw {int(np.max(i))}: max_proposals="
            f"{int(max_proposals)} proposals without a single switch; its remaining draws repeat "
            "its last position (marked hit_event_cap). The process is caught where the rates are "
            "huge: reparametrize the model (e.g. non-centered), pass control_variates=False, or "
            f"shorten sample_interval={sample_interval}",
            RuntimeWarning,
            origin,
        )
