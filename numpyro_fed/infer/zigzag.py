"""Federated Zig-Zag sampler (Federated PDMC, Bierkens & Duncan 2022, Algorithm 2).

The target is ``exp(-U(x))`` with ``U = sum_j U_j`` over *proposers* ``j``: the clients
(each holding its own term of a :class:`~numpyro_fed.FederatedPotential`) and, by default,
the server holding the prior (Remark 3.2). From a state ``(x, v)``, ``v`` in ``{-1, +1}^d``,
every proposer draws its next switching time from its own rates

    lambda_{j,i}(t) = max(0, v_i (d_i U_j(x + t v) - c_{j,i})) + rho_j / d,

where ``c_j`` are control-variate shifts with ``sum_j c_j = 0`` (Remark 4.3: the sum over
proposers, hence the target, is unchanged) and ``rho_j`` is the excess (refreshment) rate.
The server takes the earliest proposal and the winner alone checks it against its exact rate.

Event times are simulated by Poisson thinning with bounds computed automatically along the
trajectory (the grid bound of Andral & Kamatani 2024): over a horizon ``[0, H]``, ``K``
grid points give each rate and its slope (a gradient and a Jacobian-vector product), and the
bound on a segment is ``max(f_k, f_{k+1}, where the tangents meet, 0)``. Rates above their
bound are counted as violations. After every proposal, accepted or not, all proposers
rebuild their bounds from the new point (exact by the strong Markov property; vectorised,
this costs no more wall time than redrawing one client).

This module is the functional core: :func:`init` and :func:`build_kernel` know nothing of
NumPyro. :class:`numpyro_fed.infer.FedZigZag` wraps them as an ``MCMCKernel``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple
import math
import warnings

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from numpyro.diagnostics import effective_sample_size
from numpyro.infer.initialization import init_to_uniform
from numpyro.infer.mcmc import MCMCKernel

from numpyro_fed._checks import check_int, check_positive, check_real
from numpyro_fed.potential import split_potential
from numpyro_fed.privacy import (
    PrivacyGuarantee,
    calibrate_excess_rate,
    switching_time_epsilon,
)

__all__ = [
    "ControlVariates",
    "FedZigZag",
    "FedZigZagState",
    "GradientBound",
    "HessianBound",
    "ModeSearch",
    "Preconditioner",
    "Proposers",
    "ZigZagState",
    "build_kernel",
    "control_variate_reference",
    "init",
    "precondition",
    "proposers_from_potential",
]


class Proposers(NamedTuple):
    """The proposers' terms, as pure functions of the flat position.

    Proposer ``j``'s term is ``T_j(x) + w_j U_0(x)``: its own term (a client's potential;
    zero for the server) plus a share ``w_j`` of the prior ``U_0`` (the weights sum to one,
    so the proposers' terms always add up to the potential).

    :ivar term_grads_and_slopes: ``(x, v) -> ((P, d), (P, d))``: gradients of the own terms
        and their derivatives along ``v`` (Hessian-vector products).
    :ivar term_grads: ``x -> (P, d)``: the gradients alone.
    :ivar term_grad_of: ``(x, j) -> (d,)``: the gradient of proposer ``j``'s own term alone
        (the winner's check: only that proposer evaluates).
    :ivar prior_grad_and_slope: ``(x, v) -> ((d,), (d,))`` for ``U_0``.
    :ivar int num: ``P``.
    """

    term_grads_and_slopes: Callable
    term_grads: Callable
    term_grad_of: Callable
    prior_grad_and_slope: Callable
    num: int


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


class GradientBound(NamedTuple):
    """User-supplied bounds on the gradients: constant switching-rate bounds.

    ``|d_i U_m(x)| <= clients[m, i]`` and ``|d_i U_0(x)| <= prior[i]`` for every ``x``, with
    ``U_m`` client ``m``'s potential and ``U_0`` the prior's (everything outside the
    federated plates, Jacobians included), on the flat unconstrained space
    (:meth:`~numpyro_fed.FederatedPotential.ravel` gives the order). Each proposer's rate is
    then bounded by a constant, the next switching time is drawn exactly, and only the winner
    evaluates its gradient: no gradient is evaluated to propose (Appendix F.3 of the paper:
    heavy-tailed likelihoods have bounded gradients).

    :ivar clients: broadcastable to ``(M, d)``, finite and ``>= 0``; each client computes its
        own row from its own data.
    :ivar prior: broadcastable to ``(d,)``, finite and ``>= 0``.

    With control variates, each rate is shifted by a constant ``c`` and its bound grows by
    ``|c|`` (added automatically). A bound the rate exceeds is counted as a violation and
    reported by :meth:`FedZigZag.check_run`.
    """

    clients: jax.Array
    prior: jax.Array = 0.0


class HessianBound(NamedTuple):
    """User-supplied bounds on the Hessians: switching-rate bounds affine in time.

    ``|d_i d_k U_m(x)| <= clients[m, i, k]`` and ``|d_i d_k U_0(x)| <= prior[i, k]`` for
    every ``x`` (notation as in :class:`GradientBound`). Along a line ``x + t v`` the rate of
    coordinate ``i`` then grows at most like ``sum_k H_ik t`` (Appendix A of the paper), and
    the first event of ``max(0, a + b t)`` is drawn exactly:

    * without control variates ``a`` is the rate at ``t = 0``: one gradient per proposer
      and proposal, no Hessian-vector product;
    * with control variates (reference point ``x*``), ``a = v_i d_i U(x*) / P +
      (H |x - x*|)_i``: **no gradient at all** to propose, only the winner evaluates its
      own (the super-efficient regime of Bierkens, Fearnhead & Roberts 2019).

    For a logistic regression client with rows ``X_m``: ``clients[m] = |X_m|^T |X_m| / 4``;
    for a ``Normal(0, s)`` prior on every coordinate: ``prior = eye(d) / s**2``.

    :ivar clients: broadcastable to ``(M, d, d)``, finite and ``>= 0``.
    :ivar prior: broadcastable to ``(d, d)``, finite and ``>= 0``.
    """

    clients: jax.Array
    prior: jax.Array = 0.0


def _proposer_bound(bound, num_clients: int, num_proposers: int, d: int, dtype):
    """The user's client/prior bound arrays, checked and laid out per proposer (a zero row
    for the server's prior proposer, which has no own term)."""
    trailing = (d,) if isinstance(bound, GradientBound) else (d, d)
    name = type(bound).__name__
    arrays = []
    for field, shape in (("clients", (num_clients,) + trailing), ("prior", trailing)):
        value = np.asarray(getattr(bound, field), dtype=float)
        try:
            value = np.broadcast_to(value, shape)
        except ValueError:
            raise ValueError(
                f"{name}.{field} must broadcast to {shape} (M={num_clients} clients, d={d} "
                f"unconstrained coordinates), got shape {value.shape}"
            ) from None
        if not np.all(np.isfinite(value)) or np.any(value < 0):
            raise ValueError(f"{name}.{field} must be finite and >= 0")
        arrays.append(value)
    clients, prior = arrays
    if num_proposers > num_clients:
        clients = np.concatenate([clients, np.zeros((1,) + trailing)])
    return type(bound)(jnp.asarray(clients, dtype), jnp.asarray(prior, dtype))


class LineBound(NamedTuple):
    """The switching-rate bound of the current line ``x + t v``, kept between proposals.

    A bound holds for the whole line it was built on, so after a rejected proposal, or when
    a sample is taken, the next proposals are drawn from the rest of it (the bounding
    processes are Poisson: memoryless) and nothing is re-evaluated. It is rebuilt after a
    switch or a redistribution of the prior, and when the line reaches its horizon, where
    the last grid point's values are reused as the new first one.

    :ivar valid: the bound belongs to the current line.
    :ivar position: time travelled on the line since the bound was built.
    :ivar reuse: ``end_grads``/``end_slopes`` hold the values at the current point.
    :ivar bound: grid bounds ``(K-1, P, d)`` per segment, or ``(2, P, d)``: the ``a`` and
        ``b`` of ``max(0, a + b t)`` for the line bounds.
    :ivar times: ``(K,)`` the grid's times (grid bounds only).
    :ivar end_grads: ``(P, d)`` gradients at the grid's last point; ``end_slopes`` their
        derivatives along ``v``.
    """

    valid: jax.Array
    position: jax.Array
    reuse: jax.Array
    bound: jax.Array
    times: jax.Array
    end_grads: jax.Array
    end_slopes: jax.Array


class ZigZagState(NamedTuple):
    """State of the federated Zig-Zag process.

    :ivar x: position ``(d,)`` (flat, unconstrained; with a preconditioner, ``u``).
    :ivar v: velocity ``(d,)`` in ``{-1, +1}``.
    :ivar horizon: current horizon of the automatic bounds.
    :ivar rng_key: random key.
    :ivar num_events: accepted switches since the last sample.
    :ivar num_proposals: proposals (accepted or not) since the last sample.
    :ivar num_violations: proposals whose exact rate exceeded its bound.
    :ivar events_by_proposer: ``(P,)`` accepted switches per proposer since the last sample.
    :ivar grad_evals_by_proposer: ``(P,)`` gradient evaluations per proposer since the last sample.
    :ivar hit_event_cap: whether the last sample stopped at ``max_proposals``.
    :ivar prior_weights: ``(P,)`` shares of the prior, summing to one.
    :ivar elapsed: process time since the start of the last call.
    :ivar path_integral: ``(d,)`` integral of the piecewise-linear path ``x(t)`` over the
        last call (exact: the path is linear between events).
    :ivar path_square_integral: integral of ``x(t) x(t)^T``: ``(d,)`` (its diagonal) or
        ``(d, d)`` with ``full_covariance``.
    :ivar skeleton_times: ``(S,)`` times (since the start of the last call) of the first
        ``S`` switches of the last call; ``skeleton_x``/``skeleton_v`` ``(S, d)`` the
        positions and new velocities there; ``skeleton_count`` how many switches there were
        (more than ``S`` means the buffer overflowed).
    :ivar line: the :class:`LineBound` of the current line.
    """

    x: jax.Array
    v: jax.Array
    horizon: jax.Array
    rng_key: jax.Array
    num_events: jax.Array
    num_proposals: jax.Array
    num_violations: jax.Array
    events_by_proposer: jax.Array
    grad_evals_by_proposer: jax.Array
    hit_event_cap: jax.Array
    prior_weights: jax.Array
    elapsed: jax.Array
    path_integral: jax.Array
    path_square_integral: jax.Array
    skeleton_times: jax.Array
    skeleton_x: jax.Array
    skeleton_v: jax.Array
    skeleton_count: jax.Array
    line: LineBound


def init(x, rng_key, prior_weights, *, horizon: float = 1.0, v=None, skeleton_size: int = 0,
         full_covariance: bool = False, bounds="grid", grid_size: int = 2) -> ZigZagState:
    """Initial state at ``x`` with a uniformly random velocity (unless ``v`` is given).

    :param prior_weights: ``(P,)`` initial shares of the prior (summing to one).
    :param int skeleton_size: switches recorded per call (0: none).
    :param bool full_covariance: integrate ``x x^T`` in full (else its diagonal).
    :param bounds: and ``grid_size``: as given to :func:`build_kernel` (they fix the shape
        of the kept :class:`LineBound`).
    """
    x = jnp.asarray(x)
    key_v, rng_key = jax.random.split(rng_key)
    if v is None:
        v = jnp.where(jax.random.bernoulli(key_v, 0.5, x.shape), 1.0, -1.0).astype(x.dtype)
    prior_weights = jnp.asarray(prior_weights, x.dtype)
    zeros = jnp.zeros(prior_weights.shape[0], jnp.int32)
    return ZigZagState(
        x=x, v=jnp.asarray(v, x.dtype), horizon=jnp.asarray(horizon, x.dtype), rng_key=rng_key,
        num_events=jnp.zeros((), jnp.int32), num_proposals=jnp.zeros((), jnp.int32),
        num_violations=jnp.zeros((), jnp.int32), events_by_proposer=zeros,
        grad_evals_by_proposer=zeros, hit_event_cap=jnp.zeros((), bool),
        prior_weights=prior_weights,
        elapsed=jnp.zeros((), x.dtype),
        path_integral=jnp.zeros_like(x),
        path_square_integral=jnp.zeros((x.shape[0],) * (2 if full_covariance else 1), x.dtype),
        skeleton_times=jnp.zeros(skeleton_size, x.dtype),
        skeleton_x=jnp.zeros((skeleton_size, x.shape[0]), x.dtype),
        skeleton_v=jnp.zeros((skeleton_size, x.shape[0]), x.dtype),
        skeleton_count=jnp.zeros((), jnp.int32),
        line=_empty_line(bounds, grid_size, prior_weights.shape[0], x.shape[0], x.dtype),
    )


def _empty_line(bounds, grid_size, num, d, dtype) -> LineBound:
    rows = grid_size - 1 if _bound_kind(bounds) == "grid" else 2
    return LineBound(
        valid=jnp.zeros((), bool), position=jnp.zeros((), dtype), reuse=jnp.zeros((), bool),
        bound=jnp.zeros((rows, num, d), dtype), times=jnp.zeros(grid_size, dtype),
        end_grads=jnp.zeros((num, d), dtype), end_slopes=jnp.zeros((num, d), dtype),
    )


def _move(state: ZigZagState, tau) -> ZigZagState:
    """Advances ``x`` by ``tau v`` and integrates the straight segment exactly:
    int x = tau (a + b) / 2 and int x x^T = tau (a a^T + b b^T) / 3 + tau (a b^T + b a^T) / 6."""
    a, b = state.x, state.x + tau * state.v
    if state.path_square_integral.ndim == 2:
        square = tau * ((jnp.outer(a, a) + jnp.outer(b, b)) / 3 + (jnp.outer(a, b) + jnp.outer(b, a)) / 6)
    else:
        square = tau * (a * a + b * b + a * b) / 3
    return state._replace(
        x=b,
        elapsed=state.elapsed + tau,
        path_integral=state.path_integral + tau * (a + b) / 2,
        path_square_integral=state.path_square_integral + square,
    )


def segment_bounds(times, rates, slopes):
    """Upper bounds of signed rates on each segment of a grid, from values and slopes.

    :param times: ``(K,)`` grid times. :param rates: ``(K, ...)`` signed rates at the grid
    points. :param slopes: ``(K, ...)`` their time derivatives.
    :return: ``(K-1, ...)`` bounds, non-negative: ``max(f_k, f_{k+1}, tangent meeting, 0)``.
    """
    t0, t1 = times[:-1], times[1:]
    shape = (-1,) + (1,) * (rates.ndim - 1)
    t0, t1 = t0.reshape(shape), t1.reshape(shape)
    f0, f1, s0, s1 = rates[:-1], rates[1:], slopes[:-1], slopes[1:]
    # Tangent lines f0 + s0 (t - t0) and f1 + s1 (t - t1) meet where a rising rate turns.
    denominator = s0 - s1
    safe = jnp.where(denominator > 0, denominator, 1.0)
    t_meet = (f1 - f0 + s0 * t0 - s1 * t1) / safe
    inside = (denominator > 0) & (t_meet > t0) & (t_meet < t1)
    meet_value = jnp.where(inside, f0 + s0 * (t_meet - t0), -jnp.inf)
    return jnp.maximum(jnp.maximum(f0, f1), jnp.maximum(meet_value, 0.0))


def _affine_first_arrival(a, b, e):
    """First time ``t`` with ``int_0^t max(0, a + b s) ds = e`` (``inf`` if never), elementwise."""
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


def _bound_kind(bounds) -> str:
    if isinstance(bounds, GradientBound):
        return "gradient"
    if isinstance(bounds, HessianBound):
        return "hessian"
    if isinstance(bounds, str) and bounds in ("grid", "affine"):
        return bounds
    raise ValueError(
        f"bounds must be 'grid', 'affine', a GradientBound or a HessianBound, got {bounds!r}"
    )


def build_kernel(
    proposers: Proposers,
    *,
    reference: ControlVariates | None = None,
    excess_rates=None,
    redistribution_rate: float = 0.0,
    bounds="grid",
    grid_size: int = 2,
    safety_factor: float = 1.0,
    max_proposals: int = 1_000_000,
    batched: bool = False,
):
    """Builds ``kernel(state, duration) -> state`` running the process for ``duration``.

    :param proposers: the proposers' gradient functions.
    :param reference: :class:`ControlVariates` at the reference point ``x*``; each
        proposer's rate is then shifted by ``c_j = grad(T_j + w_j U_0)(x*) - grad U(x*) / P``,
        which sums to zero over proposers for any weights (the target is unchanged).
        With Hessians in ``reference`` (second order) the shift also has a linear part,
        ``c_j + A_j (x - x*)`` with ``A_j = hess(T_j + w_j U_0)(x*) - hess U(x*) / P``, which
        sums to zero as well. ``None``: no control variates.
    :param excess_rates: ``(P,)`` excess (refreshment) rate of each proposer, split evenly
        over coordinates.
    :param float redistribution_rate: rate of the Poisson clock that redraws the prior's
        shares ``w ~ Dirichlet(1, ..., 1)`` (Appendix D, Algorithm 4); 0: fixed shares.
    :param bounds: ``"grid"``: the automatic grid bound; ``"affine"``: exact inversion
        of ``max(0, a + b t)`` from the rate and its slope at the start of each line, exact
        when the potential is quadratic (Gaussian targets), elsewhere checked and counted;
        a :class:`GradientBound` or :class:`HessianBound` whose ``clients`` field has one
        row per *proposer* (``(P, d)`` or ``(P, d, d)``; the server's row is zero).
    :param int grid_size: ``K`` grid points per horizon for the automatic bound.
    :param float safety_factor: bounds are multiplied by this (>= 1).
    :param int max_proposals: proposals allowed per call (guards against a rate that
        explodes); reaching it sets ``hit_event_cap``.
    :param bool batched: the kernel will run under ``vmap`` (vectorized chains), where both
        branches of a conditional run: the grid is then evaluated at all its points in one
        batch, rather than skipping the first point when it is the last one of the previous
        line. The counts of gradient evaluations are the same either way (they count what
        the algorithm needs, not what the batching computes).
    """
    num = proposers.num
    kind = _bound_kind(bounds)
    # gradient evaluations every proposer makes to build a line bound (the grid's are counted
    # where it is built: K, or K - 1 when its first point is reused)
    evaluations_per_step = {"affine": 1, "hessian": 0 if reference is not None else 1, "gradient": 0}.get(kind)
    second_order = reference is not None and reference.term_hessians is not None
    if second_order and kind in ("gradient", "hessian"):
        raise ValueError(
            "second-order control variates need the automatic bounds ('grid' or 'affine'): "
            f"a {type(bounds).__name__} does not bound the linear part of their shift"
        )
    built_reference = reference

    def kernel(state: ZigZagState, duration, reference: ControlVariates | None = None) -> ZigZagState:
        """Runs the process for ``duration``; ``reference`` replaces the control variates'
        reference point given to :func:`build_kernel` (same structure; warmup re-centres it)."""
        reference = built_reference if reference is None else reference
        # grad U(x*) / P: each proposer's share of the full gradient at the reference point
        mean_gradient = None if reference is None else (reference.term_grads.sum(0) + reference.prior_grad) / num
        # hess U(x*) / P, the second-order counterpart
        mean_hessian = (reference.term_hessians.sum(0) + reference.prior_hessian) / num if second_order else None
        d = state.x.shape[0]
        dtype = state.x.dtype
        excess = (jnp.zeros(num, dtype) if excess_rates is None else jnp.asarray(excess_rates, dtype)) / d
        fractions = jnp.linspace(0.0, 1.0, grid_size, dtype=dtype)
        yes, no = jnp.ones((), bool), jnp.zeros((), bool)

        def shift_for(weights):
            """``(c, A)``: every proposer's shift is ``c_j + A_j (x - x*)`` (``A = None``: first
            order or no control variates, the shift is the constant ``c_j``)."""
            if reference is None:
                return jnp.zeros((num, d), dtype), None
            constant = reference.term_grads + weights[:, None] * reference.prior_grad - mean_gradient
            return constant, (weights if second_order else None)

        def linear_part(weights, y):
            """``(P, d)``: ``A_j y`` for every proposer, without forming the ``A_j``."""
            return (reference.term_hessians @ y + weights[:, None] * (reference.prior_hessian @ y)
                    - mean_hessian @ y)

        def shift_at(shift, x):
            """``(P, d)`` shifts at ``x``."""
            constant, weights = shift
            return constant if weights is None else constant + linear_part(weights, x - reference.point)

        def shift_slope(shift, v):
            """``(P, d)`` derivatives of the shifts along ``v``."""
            return 0.0 if shift[1] is None else linear_part(shift[1], v)

        def grads_and_slopes(x, v, weights):
            term_g, term_s = proposers.term_grads_and_slopes(x, v)
            prior_g, prior_s = proposers.prior_grad_and_slope(x, v)
            return term_g + weights[:, None] * prior_g, term_s + weights[:, None] * prior_s

        def line_coefficients(state, shift):
            """``(a, b)``, each ``(P, d)``: every rate is at most ``max(0, a + b t)`` along the
            current line (``"affine"``: the rate's own tangent at ``t = 0``)."""
            x, v, weights = state.x, state.v, state.prior_weights
            if kind == "affine":
                grads, slopes = grads_and_slopes(x, v, weights)
                return v * (grads - shift_at(shift, x)), v * (slopes - shift_slope(shift, v))
            if kind == "gradient":
                gradient_bound = bounds.clients + weights[:, None] * bounds.prior
                return gradient_bound + jnp.abs(shift[0]), jnp.zeros_like(gradient_bound)
            hessian = bounds.clients + weights[:, None, None] * bounds.prior  # (P, d, d)
            growth = hessian.sum(-1)
            if reference is None:
                prior_grad = proposers.prior_grad_and_slope(x, jnp.zeros_like(x))[0]
                grads = proposers.term_grads(x) + weights[:, None] * prior_grad
                return v * grads, growth
            # |d_i T_j(y) - d_i T_j(x*)| <= sum_k H_jik |y_k - x*_k| <= (H_j |x - x*|)_i + t (H_j 1)_i
            return v * mean_gradient + hessian @ jnp.abs(x - reference.point), growth

        # -- building a line's bound ------------------------------------------------------

        def build_grid(state, shift):
            """Grid bound over [0, horizon]. At a horizon the values at t = 0 are the last grid
            point's, kept in the line bound, and a single chain evaluates the other K - 1
            points only; otherwise all K points are evaluated in one batch (one batched call
            costs much less than K single ones on CPU)."""
            line = state.line
            times = fractions * state.horizon

            def at(ts):  # (len(ts), P, d): every proposer's gradient and slope at x + t v
                return jax.vmap(lambda t: grads_and_slopes(state.x + t * state.v, state.v, state.prior_weights))(ts)

            def reusing():
                grads, slopes = at(times[1:])
                return (jnp.concatenate([line.end_grads[None], grads]),
                        jnp.concatenate([line.end_slopes[None], slopes]))

            grads, slopes = at(times) if batched else lax.cond(line.reuse, reusing, lambda: at(times))
            shifts = shift_at(shift, state.x)
            shift_slopes = shift_slope(shift, state.v)
            if shift[1] is not None:  # the shift moves along the line: c + A (x + t v - x*)
                shifts = shifts + times[:, None, None] * shift_slopes
            signed = state.v * (grads - shifts)
            bound = safety_factor * segment_bounds(times, signed, state.v * (slopes - shift_slopes)) + excess[:, None]
            return line._replace(valid=yes, position=jnp.zeros((), dtype), reuse=no, bound=bound,
                                 times=times, end_grads=grads[-1], end_slopes=slopes[-1])

        def build_line(state, shift):
            a, b = line_coefficients(state, shift)
            return state.line._replace(valid=yes, position=jnp.zeros((), dtype), reuse=no,
                                       bound=safety_factor * jnp.stack([a, b]))

        def current_line(state, shift):
            """``(line bound, gradient evaluations per proposer)``: kept, rebuilt, or (grid, at
            the horizon) rebuilt from the last grid point's values."""
            line = state.line
            count = partial(jnp.asarray, dtype=jnp.int32)
            if kind != "grid":
                return lax.cond(line.valid, lambda: (line, count(0)),
                                lambda: (build_line(state, shift), count(evaluations_per_step)))
            return lax.cond(
                line.valid & (line.position < line.times[-1]),
                lambda: (line, count(0)),
                lambda: (build_grid(state, shift), count(jnp.where(line.reuse, grid_size - 1, grid_size))),
            )

        # -- proposals from the rest of the line's bound ----------------------------------

        def grid_proposals(line, uniforms, exponentials):
            """First arrivals after ``line.position`` of each proposer's piecewise-constant bound."""
            edges, position = line.times, line.position
            lengths = jnp.clip(edges[1:] - jnp.maximum(edges[:-1], position), 0.0)  # (K-1,)
            totals = line.bound.sum(-1)  # (K-1, P)
            cumulative = jnp.cumsum(totals * lengths[:, None], axis=0)
            segment = jnp.sum(cumulative < exponentials[None, :], axis=0)  # first crossing, K-1 if none
            has_event = segment < grid_size - 1
            segment = jnp.minimum(segment, grid_size - 2)
            before = jnp.where(segment > 0, jnp.take_along_axis(cumulative, jnp.maximum(segment - 1, 0)[None], 0)[0], 0.0)
            rate_in_segment = jnp.take_along_axis(totals, segment[None], 0)[0]
            tau = (jnp.maximum(edges[segment], position) - position
                   + (exponentials - before) / jnp.where(rate_in_segment > 0, rate_in_segment, 1.0))
            tau = jnp.where(has_event, tau, jnp.inf)
            # each proposer's coordinate, by inverse CDF of its bounds in its segment
            coordinate_bounds = line.bound[segment, jnp.arange(num)]  # (P, d)
            cumulative_bounds = jnp.cumsum(coordinate_bounds, -1)
            picks = uniforms[num: 2 * num] * cumulative_bounds[:, -1]
            coordinates = jnp.minimum(jnp.sum(cumulative_bounds < picks[:, None], -1), d - 1)
            bound_values = jnp.take_along_axis(coordinate_bounds, coordinates[:, None], -1)[:, 0]
            return tau, coordinates, bound_values, jnp.zeros(num, bool)

        def line_proposals(line, uniforms, exponentials):
            """Exact first arrivals of max(0, a + b t) after ``line.position`` per proposer and
            coordinate, plus each proposer's excess clock (always accepted)."""
            a, b = line.bound[0] + line.bound[1] * line.position, line.bound[1]
            e = -jnp.log(uniforms[2 * num + 2:]).reshape(num, d)
            times = _affine_first_arrival(a, b, e)
            coordinates = jnp.argmin(times, -1)
            tau = jnp.min(times, -1)
            bound_values = jnp.maximum(a + b * tau[:, None], 0.0)[jnp.arange(num), coordinates]
            # excess clocks: rate d * excess per proposer, a uniformly chosen coordinate
            total_excess = excess * d
            tau_excess = jnp.where(total_excess > 0, exponentials / jnp.where(total_excess > 0, total_excess, 1.0), jnp.inf)
            excess_coordinate = jnp.minimum((uniforms[num: 2 * num] * d).astype(jnp.int32), d - 1)
            from_excess = tau_excess < tau
            return (
                jnp.where(from_excess, tau_excess, tau),
                jnp.where(from_excess, excess_coordinate, coordinates),
                jnp.where(from_excess, jnp.inf, bound_values),
                from_excess,
            )

        def one_step(carry):
            state, remaining = carry
            # One split and one batch of uniforms per step: threefry dominates small steps on CPU.
            # Each uniform has one use: [0, P) every proposer's exponential clock, [P, 2P) its
            # coordinate pick, 2P the acceptance test, 2P + 1 the redistribution clock, and for
            # the line bounds 2P + 2 on one exponential per proposer and coordinate.
            key, key_step = jax.random.split(state.rng_key)
            size = 2 * num + 2 + (0 if kind == "grid" else num * d)
            uniforms = jax.random.uniform(key_step, (size,), dtype, minval=jnp.finfo(dtype).tiny)
            shift = shift_for(state.prior_weights)
            line, evaluations = current_line(state, shift)
            state = state._replace(rng_key=key, grad_evals_by_proposer=state.grad_evals_by_proposer + evaluations)
            exponentials = -jnp.log(uniforms[:num])
            if kind == "grid":
                tau, coordinates, bound_values, certain = grid_proposals(line, uniforms, exponentials)
                line_left = line.times[-1] - line.position
            else:
                tau, coordinates, bound_values, certain = line_proposals(line, uniforms, exponentials)
                line_left = jnp.asarray(jnp.inf, dtype)
            winner = jnp.argmin(tau)
            tau_win = tau[winner]
            stop = jnp.minimum(line_left, remaining)

            def no_event(_):
                moved = _move(state, stop)
                at_horizon = line_left <= remaining
                # at the horizon the grid's last point is where the next bound starts
                kept = line._replace(valid=~at_horizon, reuse=at_horizon, position=line.position + stop)
                horizon = jnp.where(at_horizon, state.horizon * 1.01, state.horizon)
                return moved._replace(line=kept, horizon=horizon), remaining - stop

            def proposal(_):
                coordinate = coordinates[winner]
                bound = bound_values[winner]
                moved = _move(state, tau_win)
                x_new = moved.x
                prior_grad = proposers.prior_grad_and_slope(x_new, state.v)[0]
                grad = proposers.term_grad_of(x_new, winner) + state.prior_weights[winner] * prior_grad
                constant, weights = shift
                winner_shift = constant[winner, coordinate]
                if weights is not None:  # row `coordinate` of A_winner, applied to x - x*
                    row = (reference.term_hessians[winner, coordinate] + weights[winner] * reference.prior_hessian[coordinate]
                           - mean_hessian[coordinate])
                    winner_shift = winner_shift + row @ (x_new - reference.point)
                rate = jnp.maximum(state.v[coordinate] * (grad[coordinate] - winner_shift), 0.0)
                if kind == "grid":  # line bounds give the excess its own clock
                    rate = rate + excess[winner]
                # rounding slack: 1e-6 relative, or 64 ulps where the dtype is coarser
                violated = ~certain[winner] & (rate > bound * (1 + max(1e-6, 64 * float(jnp.finfo(dtype).eps))) + 1e-12)
                accept = certain[winner] | (uniforms[2 * num] * bound < rate)
                v_new = jnp.where(accept, state.v.at[coordinate].multiply(-1.0), state.v)
                horizon_new = jnp.where(violated, state.horizon / 2, jnp.where(accept, state.horizon, state.horizon / 1.04))
                # a rejection leaves the line, hence its bound, as it was
                kept = line._replace(valid=~(accept | violated), reuse=no, position=line.position + tau_win)
                if moved.skeleton_times.shape[0]:  # record the switch (beyond capacity: dropped)
                    slot = jnp.where(accept, moved.skeleton_count, moved.skeleton_times.shape[0])
                    moved = moved._replace(
                        skeleton_times=moved.skeleton_times.at[slot].set(moved.elapsed, mode="drop"),
                        skeleton_x=moved.skeleton_x.at[slot].set(x_new, mode="drop"),
                        skeleton_v=moved.skeleton_v.at[slot].set(v_new, mode="drop"),
                    )
                new = moved._replace(
                    v=v_new, horizon=horizon_new, line=kept,
                    skeleton_count=moved.skeleton_count + accept,
                    num_events=state.num_events + accept,
                    num_proposals=state.num_proposals + 1,
                    num_violations=state.num_violations + violated,
                    events_by_proposer=state.events_by_proposer.at[winner].add(accept.astype(jnp.int32)),
                    grad_evals_by_proposer=state.grad_evals_by_proposer.at[winner].add(1),
                )
                return new, remaining - tau_win

            if redistribution_rate <= 0:
                return lax.cond(tau_win < stop, proposal, no_event, None)

            tau_redist = -jnp.log(uniforms[2 * num + 1]) / redistribution_rate

            def redistribute(_):
                weights = jax.random.dirichlet(jax.random.fold_in(key_step, 1), jnp.ones(num, dtype))
                new = _move(state, tau_redist)._replace(prior_weights=weights, line=line._replace(valid=no, reuse=no))
                return new, remaining - tau_redist

            branch = jnp.where(tau_redist < jnp.minimum(tau_win, stop), 2, jnp.where(tau_win < stop, 1, 0))
            return lax.switch(branch, [no_event, proposal, redistribute], None)

        def not_done(carry):
            state, remaining = carry
            return (remaining > 0) & (state.num_proposals < max_proposals)

        fresh = state._replace(
            elapsed=jnp.zeros_like(state.elapsed),
            path_integral=jnp.zeros_like(state.path_integral),
            path_square_integral=jnp.zeros_like(state.path_square_integral),
            skeleton_count=jnp.zeros_like(state.skeleton_count),
            num_events=jnp.zeros_like(state.num_events),
            num_proposals=jnp.zeros_like(state.num_proposals),
            num_violations=jnp.zeros_like(state.num_violations),
            events_by_proposer=jnp.zeros_like(state.events_by_proposer),
            grad_evals_by_proposer=jnp.zeros_like(state.grad_evals_by_proposer),
        )
        final, remaining = lax.while_loop(not_done, one_step, (fresh, jnp.asarray(duration, dtype)))
        return final._replace(hit_event_cap=remaining > 0)

    return kernel


# -- NumPyro face ---------------------------------------------------------------------------


def proposers_from_potential(potential, *, prior: str = "server") -> Proposers:
    """The proposers of a :class:`~numpyro_fed.FederatedPotential` and their initial prior
    weights.

    :param str prior: ``"server"``: the prior is an extra proposer held by the server
        (index ``M``); ``"clients"``: each client's term carries ``prior / M``;
        ``"redistribute"``: each client's term carries a random share of the prior,
        redrawn over time (Appendix D).
    :return: ``(proposers, prior_weights)``.
    """
    if prior not in _PRIOR_MODES:
        raise ValueError(f"prior must be one of {_PRIOR_MODES}, got {prior!r}")
    data = potential.client_data
    num_clients = potential.num_clients
    on_server = prior == "server"

    def prior_term(flat):
        return potential.prior_potential_fn(potential.unravel(flat))

    def client_term(flat, block):
        return potential.client_potential_fn(potential.unravel(flat), block)

    client_grad, prior_grad = jax.grad(client_term), jax.grad(prior_term)

    def term_grads_and_slopes(x, v):
        def one(block):
            return jax.jvp(lambda f: client_grad(f, block), (x,), (v,))

        grads, slopes = jax.vmap(one)(data)
        if on_server:  # the server's own term is zero: it proposes from the prior alone
            grads = jnp.concatenate([grads, jnp.zeros_like(grads[:1])])
            slopes = jnp.concatenate([slopes, jnp.zeros_like(slopes[:1])])
        return grads, slopes

    def term_grads(x):
        grads = jax.vmap(lambda block: client_grad(x, block))(data)
        if on_server:
            grads = jnp.concatenate([grads, jnp.zeros_like(grads[:1])])
        return grads

    def term_grad_of(x, j):
        block = jax.tree.map(
            lambda a: lax.dynamic_index_in_dim(a, jnp.minimum(j, num_clients - 1), keepdims=False), data
        )
        if not on_server:
            return client_grad(x, block)
        return lax.cond(j == num_clients, lambda: jnp.zeros_like(x), lambda: client_grad(x, block))

    def prior_grad_and_slope(x, v):
        return jax.jvp(prior_grad, (x,), (v,))

    num = num_clients + on_server
    weights = jnp.zeros(num).at[-1].set(1.0) if on_server else jnp.full(num, 1.0 / num)
    return Proposers(term_grads_and_slopes, term_grads, term_grad_of, prior_grad_and_slope, num), weights


class Preconditioner(NamedTuple):
    """The linear map ``x = center + scale u`` between the model's flat unconstrained space
    ``x`` and the space ``u`` the process moves in. ``scale`` is ``(d,)`` (diagonal) or
    ``(d, d)``; a good one makes the posterior of ``u`` close to standard normal, so that
    the axis-aligned Zig-Zag velocities are not slowed by correlations or unequal scales (the
    role a mass matrix plays for NUTS)."""

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

    def abs_matrix(self):
        return jnp.diag(jnp.abs(self.scale)) if self.scale.ndim == 1 else jnp.abs(self.scale)


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


def _preconditioned_bound(bound, preconditioner: Preconditioner):
    """A user's bound in ``x`` as a bound in ``u``: ``|scale^T g| <= |scale|^T G`` and
    ``|scale^T H scale| <= |scale|^T H |scale|`` entrywise."""
    absolute = preconditioner.abs_matrix()
    if isinstance(bound, GradientBound):
        return GradientBound(bound.clients @ absolute, bound.prior @ absolute)
    return HessianBound(absolute.T @ bound.clients @ absolute, absolute.T @ bound.prior @ absolute)


def control_variate_reference(proposers: Proposers, reference, *, order: int = 1) -> ControlVariates:
    """:class:`ControlVariates` at the reference point ``x*``: what :func:`build_kernel`
    needs to shift every proposer's rate by ``c_j = grad(T_j + w_j U_0)(x*) - grad U(x*) / P``.
    The shifts sum to zero, so the target is unchanged, and near ``x*`` each proposer's rate
    loses the client-to-client scatter of the gradients (the O(sqrt(NM)) excess of
    Section 4.1).

    ``order=2`` also records every proposer's Hessian at ``x*`` (``d`` Hessian-vector
    products per client: in a federation, one round in which each client sends its
    Hessian), so that the shift becomes ``c_j + A_j (x - x*)`` with
    ``A_j = hess(T_j + w_j U_0)(x*) - hess U(x*) / P``. Each proposer's shifted gradient is
    then ``grad U(x) / P`` up to second order around ``x*``: the clients' rates no longer
    scatter when their curvatures differ (few rows per client, many coordinates)."""
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
    # symmetrise: the products are exact up to rounding
    term_hessians = (term_hessians + jnp.swapaxes(term_hessians, 1, 2)) / 2
    prior_hessian = (prior_hessian + prior_hessian.T) / 2
    return ControlVariates(reference, term_grads, prior_grad, term_hessians, prior_hessian)


class FedZigZagState(NamedTuple):
    """NumPyro-facing state: ``z`` (unconstrained sites, as NumPyro's ``z``), the sample
    index ``i``, the process state ``core`` (:class:`ZigZagState`) and ``rng_key``, the key
    the next sample starts from (NumPyro replaces it to continue a chain with a new key, as
    in ``mcmc.post_warmup_state``). Diagnostics are read with
    ``extra_fields=("core.num_events", "core.events_by_proposer", ...)``."""

    i: jax.Array
    z: dict
    core: ZigZagState
    rng_key: jax.Array
    adapt: "_Adaptation" = None


class FedZigZag(MCMCKernel):
    """Federated Zig-Zag sampler as a NumPyro :class:`~numpyro.infer.mcmc.MCMCKernel`.

    Each client proposes its next switching time from its own term of the potential (see
    :func:`~numpyro_fed.split_potential`); the server takes the earliest. One MCMC sample is
    the position after ``sample_interval`` units of process time, so draws are equally
    spaced in time (stopping on time, not on events, keeps them unbiased).

    :param model: a NumPyro model with a :class:`~numpyro_fed.federated_plate`.
    :param float sample_interval: process time between two samples (> 0).
    :param control_variates: ``True`` re-splits the clients' terms around a reference
        point (the MAP, found at initialisation from the aggregated gradient) so that the
        sum is unchanged but spurious switches vanish; ``None`` (default): on when M > 1.
        When the posterior has no mode (a funnel) the reference is re-centred during warmup
        on the warmup trajectory; at the end of warmup the control variates are kept only if
        they lower the switching rates at the last warmup positions, and a warmup draw that
        stalls with them (``max_proposals`` proposals, no switch) turns them off, with a
        warning (see :attr:`mode_search` and the user guide).
        ``"second_order"`` also matches the clients' Hessians at the reference point (one
        more aggregation round, in which each client sends its ``d x d`` Hessian there): the
        re-split terms then agree to second order, which removes the spurious switches that
        remain when clients hold few rows for many coordinates (their curvatures differ).
        It needs the automatic bounds (``"grid"`` or ``"affine"``).
    :param str prior: ``"server"`` (the prior proposes on its own), ``"clients"``
        (shared evenly among the clients' terms), the two options of Remark 3.2, or
        ``"redistribute"`` (Appendix D, Algorithm 4: random shares of the prior, redrawn at
        ``redistribution_rate``).
    :param float redistribution_rate: rate of the prior's redistribution (> 0 with
        ``prior="redistribute"``; the paper uses 0.1).
    :param float excess_rate: refreshment rate ``rho`` added to every proposer (>= 0).
    :param str bounds: ``"grid"`` (default): automatic bounds on a grid along the
        trajectory, for any differentiable potential; ``"affine"``: exact inversion of the
        rate's linear extrapolation ``max(0, a + b t)``, exact (no rejections) when the
        potential is quadratic, e.g. a Gaussian target; used elsewhere, its violations are
        counted and reported. Or bounds the user derived (Appendices A and F of the paper):
        a :class:`GradientBound` (constant rates: no gradient evaluated to propose) or a
        :class:`HessianBound` (rates affine in time; with control variates, no gradient
        evaluated to propose either), with one row per client, computed by each client
        from its own data.
    :param int grid_size: grid points of the automatic bound (>= 2).
    :param float safety_factor: multiplies the automatic bounds (>= 1).
    :param float initial_horizon: starting horizon of the bounds (> 0).
    :param float dp_sensitivity: ``K > 1``, a bound on how much one row of a client can
        change that client's switching intensity (e.g. the bound on the covariates' norm in
        logistic regression, Example 5.2). Setting it turns on the privacy guarantee of
        Theorem 5.1, reported as :attr:`privacy` and in InferenceData ``attrs``.
    :param float dp_epsilon: target epsilon *per switching time*; with ``dp_sensitivity``
        and ``dp_delta``, ``excess_rate`` is chosen by (7) unless given.
    :param float dp_delta: delta per switching time, in (0, 1).
    :param int skeleton_size: switches recorded per sample for plots (0: none); read them
        with :meth:`skeleton`.
    :param bool full_covariance: integrate the full ``x x^T`` along the path (else only its
        diagonal) for :meth:`trajectory_moments`.
    :param preconditioner: the process moves in ``u`` with ``x = center + scale u`` (``x``
        the flat unconstrained latent vector), the Zig-Zag counterpart of NUTS's mass
        matrix: ``None`` (default); ``"laplace"``: ``scale`` the Cholesky factor of the
        inverse Hessian at the mode (found as for the control variates; in a federation one
        round in which each client sends its Hessian there); ``"diagonal"``: its diagonal
        only; or a user's ``scale``, ``(d,)`` or an invertible ``(d, d)``. Correlated or
        badly scaled posteriors mix many times faster; the draws, trajectory moments and
        skeleton are reported in ``x``.
    :param dict partition: as for :func:`~numpyro_fed.split_potential`.
    :param init_strategy: NumPyro init strategy: where the chain starts, or, with control
        variates or a computed preconditioner, where the search for the mode starts (the
        chains then start at the mode, if there is one). ``init_params`` given to ``MCMC.run`` take
        precedence; with ``num_chains > 1`` and ``chain_method="vectorized"`` the chains
        run under one ``vmap`` and share the mode, the preconditioner and the split.

    A sample that makes ``max_proposals`` proposals (at least 50) without one switch stops
    its chain: the remaining draws repeat its last position, are marked ``hit_event_cap``,
    and a warning names the remedies. After ``init``, :attr:`mode_search` (a
    :class:`ModeSearch`) says whether a mode was found.

    The privacy guarantee covers **each switching time a client sends, one message at a
    time**; it is not composed over the many messages of a run. Control variates need one
    aggregation round of gradients that the theorem does not cover, so they are off when a
    guarantee is asked for (and asking for both is an error).

    **Example**

    >>> import jax, numpyro, numpyro.distributions as dist
    >>> from numpyro.infer import MCMC
    >>> import numpyro_fed as nf
    >>> def model(y):
    ...     mu = numpyro.sample("mu", dist.Normal(0, 10))
    ...     with nf.federated_plate("data", y.shape[0], clients=4):
    ...         numpyro.sample("y", dist.Normal(mu, 1), obs=y)
    >>> y = 1.0 + jax.random.normal(jax.random.PRNGKey(0), (100,))
    >>> mcmc = MCMC(nf.FedZigZag(model, sample_interval=0.2), num_warmup=100, num_samples=2000,
    ...             progress_bar=False)
    >>> mcmc.run(jax.random.PRNGKey(1), y)
    >>> abs(float(mcmc.get_samples()["mu"].mean() - y.sum() / (100 + 0.01))) < 0.05
    True
    """

    sample_field = "z"

    def __init__(
        self,
        model,
        *,
        sample_interval: float = 1.0,
        control_variates: bool | str | None = None,
        prior: str = "server",
        redistribution_rate: float = 0.1,
        excess_rate: float = 0.0,
        bounds="grid",
        grid_size: int = 2,
        safety_factor: float = 1.0,
        initial_horizon: float = 0.1,
        max_proposals: int = 1_000_000,
        partition=None,
        init_strategy=init_to_uniform,
        dp_sensitivity: float | None = None,
        dp_epsilon: float | None = None,
        dp_delta: float | None = None,
        skeleton_size: int = 0,
        full_covariance: bool = False,
        preconditioner=None,
    ):
        self._model = model
        if isinstance(preconditioner, str) and preconditioner not in ("laplace", "diagonal"):
            raise ValueError(f"preconditioner must be None, 'laplace', 'diagonal' or an array, got {preconditioner!r}")
        self.preconditioner = preconditioner
        self.preconditioning = None
        self.skeleton_size = check_int(skeleton_size, "skeleton_size", minimum=0)
        self.full_covariance = bool(full_covariance)
        self.sample_interval = check_positive(sample_interval, "sample_interval")
        if excess_rate is None or check_real(excess_rate, "excess_rate") < 0:
            raise ValueError(f"excess_rate must be >= 0, got {excess_rate}")
        self.excess_rate = float(excess_rate)
        _bound_kind(bounds)
        self.bounds = bounds
        self.grid_size = check_int(grid_size, "grid_size", minimum=2)
        self.safety_factor = check_real(safety_factor, "safety_factor")
        if self.safety_factor < 1:
            raise ValueError(f"safety_factor must be >= 1, got {safety_factor}")
        self.initial_horizon = check_positive(initial_horizon, "initial_horizon")
        self.max_proposals = check_int(max_proposals, "max_proposals", minimum=1)
        if prior not in _PRIOR_MODES:
            raise ValueError(f"prior must be one of {_PRIOR_MODES}, got {prior!r}")
        self.prior = prior
        self.redistribution_rate = check_positive(redistribution_rate, "redistribution_rate") if prior == "redistribute" else 0.0
        if not (control_variates is None or isinstance(control_variates, (bool, np.bool_))
                or control_variates == "second_order"):
            raise ValueError(
                f"control_variates must be None, True, False or 'second_order', got {control_variates!r}"
            )
        if control_variates == "second_order" and not isinstance(bounds, str):
            raise ValueError(
                "control_variates='second_order' needs the automatic bounds ('grid' or 'affine'): "
                f"a {type(bounds).__name__} does not bound the linear part of the shift"
            )
        self.control_variates = control_variates
        self.privacy = self._privacy_guarantee(dp_sensitivity, dp_epsilon, dp_delta)
        self.partition = partition
        self.init_strategy = init_strategy
        self.federated_potential = None
        self.reference_point = None

    def _privacy_guarantee(self, sensitivity, epsilon, delta):
        if sensitivity is None:
            if epsilon is not None or delta is not None:
                raise ValueError("dp_epsilon/dp_delta need dp_sensitivity (the bound K of Theorem 5.1)")
            return None
        if delta is None:
            raise ValueError("dp_sensitivity needs dp_delta")
        if self.control_variates:
            raise ValueError(
                f"control_variates={self.control_variates!r} with a privacy guarantee: the control "
                "variates' aggregation round is not covered by Theorem 5.1"
            )
        self.control_variates = False
        if isinstance(self.preconditioner, str):
            raise ValueError(
                f"preconditioner={self.preconditioner!r} with a privacy guarantee: the round of "
                "Hessians it needs is not covered by Theorem 5.1 (pass a fixed scale; K must then "
                "bound the change of the preconditioned intensities)"
            )
        if epsilon is not None:
            target = check_positive(epsilon, "dp_epsilon")
            if self.excess_rate == 0.0:
                self.excess_rate = calibrate_excess_rate(sensitivity, target, delta)
            achieved = switching_time_epsilon(sensitivity, self.excess_rate, delta)
            if achieved > target:
                raise ValueError(
                    f"excess_rate={self.excess_rate} gives epsilon={achieved:.4g} per switching "
                    f"time, above dp_epsilon={target}; leave excess_rate unset to calibrate it"
                )
        elif self.excess_rate <= 0.0:
            raise ValueError("a privacy guarantee needs excess_rate > 0 (or dp_epsilon to calibrate it)")
        return PrivacyGuarantee(
            epsilon=switching_time_epsilon(sensitivity, self.excess_rate, delta),
            delta=float(delta),
            scope="each switching time a client sends (per message, not composed over the run)",
            neighbouring=f"one row of one client changed, moving its intensity by at most K={sensitivity}",
            method="Theorem 5.1 of Bierkens & Duncan (2022), excess rate "
                   f"rho={self.excess_rate:.6g} per client",
        )

    @property
    def model(self):
        return self._model

    @property
    def default_fields(self):
        fields = _DIAGNOSTICS + ("elapsed", "path_integral", "path_square_integral")
        if self.skeleton_size:
            fields += ("skeleton_times", "skeleton_x", "skeleton_v", "skeleton_count")
        return ("z",) + tuple("core." + name for name in fields)

    def check_run(self, mcmc, *, strict: bool = False, min_ess: float = 50.0):
        """Says what went wrong in a run, if anything: proposals whose exact rate exceeded its
        automatic bound (each one biases the chain slightly), samples cut short by
        ``max_proposals``, and draws too few to summarise: a site's element with fewer than
        ``min_ess`` effective draws (NumPyro's estimator over the chains), whose
        mean then carries a Monte Carlo error above ``1 / sqrt(min_ess)`` (0.14) of its sd.
        Warns, or raises ``RuntimeError`` when ``strict``.
        :func:`~numpyro_fed.to_inference_data` calls it.

        :return: ``(num_violations, num_proposals, num_capped_samples)``.
        """
        fields = mcmc.get_extra_fields()
        problems = []
        for site, value in mcmc.get_samples(group_by_chain=True).items():
            value = np.asarray(jax.device_get(value), dtype=np.float64)
            if value.shape[1] < 4 or not np.all(np.isfinite(value)):
                continue
            with np.errstate(divide="ignore", invalid="ignore"):
                ess = np.asarray(effective_sample_size(value)).reshape(-1)
            ess = np.where(np.isfinite(ess), ess, np.inf)  # a constant coordinate has no error
            if ess.min() < min_ess:
                j = int(np.argmin(ess))
                where = f"{site!r}" + (f" (element {j} of {ess.size})" if ess.size > 1 else "")
                problems.append(
                    f"{where} has {ess[j]:.3g} effective draws (fewer than {min_ess:g}): its summaries "
                    "carry a large Monte Carlo error; run more num_samples (or chains), a longer "
                    "num_warmup, or a larger sample_interval"
                )
        violations = int(jnp.sum(fields["core.num_violations"]))
        proposals = int(jnp.sum(fields["core.num_proposals"]))
        capped = int(jnp.sum(fields["core.hit_event_cap"]))
        if violations:
            kind = _bound_kind(self.bounds)
            remedy = {
                "grid": "automatic bound (the chain is then slightly biased): raise safety_factor or grid_size",
                "affine": "affine extrapolation (the potential is not quadratic along lines; the "
                          "chain is biased): use bounds='grid' or a user-supplied bound",
                "gradient": "GradientBound: it is not a bound for this model (the chain is biased); "
                            "check each client's bound on |d_i U_m|",
                "hessian": "HessianBound: it is not a bound for this model (the chain is biased); "
                           "check each client's bound on |d_i d_k U_m|",
            }[kind]
            problems.append(f"{violations} of {proposals} proposals had an exact rate above its {remedy}")
        if capped:
            problems.append(
                f"{capped} samples stopped at max_proposals={self.max_proposals} before "
                f"sample_interval={self.sample_interval}: the rate is exploding or the "
                "interval is too long for the cap"
            )
        if problems:
            message = "FedZigZag: " + "; ".join(problems)
            if strict:
                raise RuntimeError(message)
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        return violations, proposals, capped

    def trajectory_moments(self, mcmc):
        """Mean and covariance (or variance) of the whole sampled path, computed exactly
        from the piecewise-linear trajectory rather than from the draws; on the flat
        unconstrained space (see :meth:`FederatedPotential.unravel`).

        :return: ``{"mean": (d,), "cov": (d, d)}`` with ``full_covariance``, else
            ``{"mean": (d,), "var": (d,)}``.
        """
        fields = mcmc.get_extra_fields()
        duration = float(jnp.sum(fields["core.elapsed"]))
        mean = jnp.sum(fields["core.path_integral"], 0) / duration
        second = jnp.sum(fields["core.path_square_integral"], 0) / duration
        full = second.ndim == 2
        cov = second - jnp.outer(mean, mean) if full else second - mean**2
        pre = self.preconditioning
        if pre is not None:  # the path was integrated in u; x = center + scale u
            if not full and pre.scale.ndim == 2:
                raise ValueError("with a dense preconditioner the variances of x need full_covariance=True")
            mean = pre.to_x(mean)
            if full:
                cov = (pre.scale[:, None] * cov * pre.scale[None, :] if pre.scale.ndim == 1
                       else pre.scale @ cov @ pre.scale.T)
            else:
                cov = pre.scale**2 * cov
        return {"mean": mean, "cov": cov} if full else {"mean": mean, "var": cov}

    def skeleton(self, mcmc, *, chain: int = 0):
        """The recorded switches of one chain's sampling phase: ``(times, positions,
        velocities)`` with times counted from the first sample's start, positions flat
        unconstrained. The path is the straight line between consecutive points."""
        if not self.skeleton_size:
            raise ValueError("no skeleton was recorded: pass skeleton_size > 0 to FedZigZag")
        fields = jax.device_get(mcmc.get_extra_fields(group_by_chain=True))
        if not 0 <= chain < fields["core.elapsed"].shape[0]:
            raise ValueError(f"chain must be in [0, {fields['core.elapsed'].shape[0]}), got {chain}")
        fields = {name: value[chain] for name, value in fields.items()}
        counts = np.asarray(fields["core.skeleton_count"])
        if (counts > self.skeleton_size).any():
            warnings.warn(
                f"{int((counts > self.skeleton_size).sum())} samples had more than "
                f"skeleton_size={self.skeleton_size} switches; the skeleton misses some of them",
                stacklevel=2,
            )
        offsets = np.concatenate([[0.0], np.cumsum(fields["core.elapsed"])[:-1]])
        kept = np.arange(self.skeleton_size)[None, :] < np.minimum(counts, self.skeleton_size)[:, None]
        times = (fields["core.skeleton_times"] + offsets[:, None])[kept]
        positions, velocities = fields["core.skeleton_x"][kept], fields["core.skeleton_v"][kept]
        if self.preconditioning is not None:  # recorded in u: x = center + scale u moves along scale v
            positions = np.asarray(self.preconditioning.to_x(positions))
            velocities = np.asarray(self.preconditioning.direction_to_x(velocities))
        return times, positions, velocities

    def sample_stats(self, extra_fields):
        """Diagnostics by name from ``MCMC.get_extra_fields(group_by_chain=True)``:
        ``{name: (array, dims)}``; per-client counts get a ``client`` dim, the prior's
        proposer (when it is the server's) its own entries."""
        stats = {}
        num_clients = self.federated_potential.num_clients
        for name in _DIAGNOSTICS:
            value = extra_fields.get("core." + name)
            if value is None:
                continue
            value = jax.device_get(value)
            if name.endswith("_by_proposer"):
                base = name[: -len("_by_proposer")]
                stats[base + "_by_client"] = (value[..., :num_clients], ["client"])
                if self.prior == "server":
                    stats[base + "_by_prior"] = (value[..., num_clients], [])
            else:
                stats[name] = (value, [])
        return stats

    def get_diagnostics_str(self, state):
        return "{} events, {} proposals".format(int(state.core.num_events), int(state.core.num_proposals))

    def init(self, rng_key, num_warmup, init_params, model_args, model_kwargs):
        # MCMC(..., chain_method="vectorized") passes one key per chain.
        vectorized = jnp.ndim(rng_key) == 2 or (jnp.ndim(rng_key) == 1 and jnp.issubdtype(rng_key.dtype, jax.dtypes.prng_key))
        first_key = rng_key[0] if vectorized else rng_key
        potential = split_potential(
            self._model, model_args, model_kwargs, partition=self.partition,
            init_strategy=self.init_strategy, rng_key=jax.random.fold_in(first_key, 0),
        )
        self.federated_potential = potential
        proposers, prior_weights = proposers_from_potential(potential, prior=self.prior)
        use_cv = potential.num_clients > 1 if self.control_variates is None else bool(self.control_variates)
        ravel = jax.vmap(potential.ravel) if vectorized else potential.ravel
        flat_potential = jax.jit(lambda x: potential.potential(potential.unravel(x)))
        start = potential.ravel(potential.init_params)
        d = start.shape[-1]
        num_warmup = int(num_warmup)
        kind = _bound_kind(self.bounds)
        self.reference_point = None
        self.mode_search = None
        recentre = False  # re-centre the control variates on the warmup trajectory
        if use_cv or isinstance(self.preconditioner, str):
            # one mode for all chains: it is a property of the target
            search_from = start
            if init_params is not None:
                search_from = ravel(init_params)[0] if vectorized else ravel(init_params)
            search = self.mode_search = _find_mode(flat_potential, search_from)
            if search.is_mode:
                self.reference_point = search.point
                start = search.point
            elif isinstance(self.preconditioner, str):
                raise ValueError(
                    f"preconditioner={self.preconditioner!r} is the Laplace approximation at the "
                    f"mode, and the posterior has none here ({_no_mode(search)}): pass "
                    "preconditioner=None or a scale"
                )
            elif num_warmup > 0:
                recentre = True  # the chains start at init_strategy's point
            elif kind == "hessian":
                raise ValueError(
                    f"HessianBound with control variates needs a reference point, and the "
                    f"posterior has no mode here ({_no_mode(search)}): give MCMC num_warmup > 0 "
                    "(the reference is then the mean of the warmup trajectory) or pass "
                    "control_variates=False"
                )
            else:
                warnings.warn(
                    f"FedZigZag: control variates are off: the posterior has no mode "
                    f"({_no_mode(search)}) and without warmup there is no trajectory to centre "
                    "them on; give MCMC num_warmup > 0 to have them",
                    RuntimeWarning, stacklevel=3,
                )
                use_cv = False
        if init_params is not None:
            start = ravel(init_params)

        self.preconditioning = self._preconditioning(flat_potential, d, start.dtype)
        bounds = self.bounds
        if not isinstance(bounds, str):
            bounds = _proposer_bound(bounds, potential.num_clients, proposers.num, d, start.dtype)
        reference = None
        if self.preconditioning is not None:
            proposers = precondition(proposers, self.preconditioning)
            if not isinstance(bounds, str):
                bounds = _preconditioned_bound(bounds, self.preconditioning)
            start = self.preconditioning.to_u(start)
        order = 2 if self.control_variates == "second_order" else 1
        if use_cv:
            # without a mode: a placeholder at the start, inactive until the first re-centring
            point = self.reference_point if self.reference_point is not None else (start[0] if start.ndim == 2 else start)
            if self.preconditioning is not None and self.reference_point is not None:
                point = self.preconditioning.to_u(point)
            reference = control_variate_reference(proposers, point, order=order)
        kernel = jax.jit(build_kernel(
            proposers, reference=reference, excess_rates=jnp.full(proposers.num, self.excess_rate),
            redistribution_rate=self.redistribution_rate, bounds=bounds,
            grid_size=self.grid_size, safety_factor=self.safety_factor, max_proposals=self.max_proposals,
            batched=vectorized,
        ))
        to_x = self.preconditioning.to_x if self.preconditioning is not None else (lambda u: u)
        unravel = potential.unravel
        core_init = partial(init, prior_weights=prior_weights, horizon=self.initial_horizon,
                            bounds=bounds, grid_size=self.grid_size,
                            skeleton_size=self.skeleton_size, full_covariance=self.full_covariance)
        adapt_step = _warmup_adaptation(
            proposers, num_warmup=num_warmup if use_cv else 0, recentre=recentre, order=order,
            can_switch_off=kind != "hessian", max_proposals=self.max_proposals,
            sample_interval=self.sample_interval,
        )

        def sample_fn(state):
            adapt = state.adapt
            duration = jnp.where(adapt.stalled, 0.0, self.sample_interval)  # a stalled chain stops
            control = _active_reference(adapt) if use_cv else None
            core = kernel(state.core._replace(rng_key=state.rng_key), duration, control)
            core = core._replace(hit_event_cap=core.hit_event_cap | adapt.stalled)
            adapt = adapt_step(adapt, core, state.i)
            return FedZigZagState(state.i + 1, unravel(to_x(core.x)), core, core.rng_key, adapt)

        def init_fn(key, u):
            core = core_init(u, key)
            adapt = _Adaptation(
                reference=reference, active=jnp.asarray(use_cv and not recentre),
                window_sum=jnp.zeros_like(u), window_time=jnp.zeros((), u.dtype),
                buffer=jnp.zeros((_BUFFER,) + u.shape, u.dtype), stalled=jnp.zeros((), bool),
            )
            return FedZigZagState(jnp.zeros((), jnp.int32), unravel(to_x(core.x)), core, core.rng_key, adapt)

        if vectorized:
            num_chains = rng_key.shape[0]
            start = jnp.broadcast_to(start, (num_chains,) + start.shape[-1:])
            sample_fn, init_fn = jax.vmap(sample_fn), jax.vmap(init_fn)
        # NumPyro skips init (and this set-up) when it has a state and _sample_fn.
        self._sample_fn = sample_fn
        return init_fn(rng_key, start)

    def _preconditioning(self, flat_potential, d, dtype):
        """The :class:`Preconditioner` asked for, or ``None``."""
        choice = self.preconditioner
        if choice is None:
            return None
        if isinstance(choice, str):
            # the Laplace approximation at the mode: in a federation, one aggregation round
            # (each client's Hessian at x*, summed with the prior's)
            hessian = jax.hessian(flat_potential)(self.reference_point)
            if choice == "diagonal":
                curvature = jnp.diag(hessian)
                if not bool(jnp.all(curvature > 0)):
                    raise ValueError("preconditioner='diagonal': the Hessian at the mode has a "
                                     "non-positive diagonal entry; pass a scale instead")
                return Preconditioner(self.reference_point, 1 / jnp.sqrt(curvature))
            scale = jnp.linalg.cholesky(jnp.linalg.inv(hessian))
            if not bool(jnp.all(jnp.isfinite(scale))):
                raise ValueError("preconditioner='laplace': the Hessian at the mode is not positive "
                                 "definite; use 'diagonal' or pass a scale")
            return Preconditioner(self.reference_point, scale)
        scale = jnp.asarray(choice, dtype)
        if scale.shape not in ((d,), (d, d)):
            raise ValueError(f"preconditioner must have shape ({d},) or ({d}, {d}) (the flat "
                             f"unconstrained coordinates), got {scale.shape}")
        if not bool(jnp.all(jnp.isfinite(scale))):
            raise ValueError("preconditioner must be finite")
        if scale.ndim == 1 and not bool(jnp.all(scale > 0)):
            raise ValueError("a diagonal preconditioner must be > 0")
        if scale.ndim == 2 and abs(float(jnp.linalg.det(scale))) == 0.0:
            raise ValueError("preconditioner must be an invertible matrix")
        center = self.reference_point if self.reference_point is not None else jnp.zeros(d, dtype)
        return Preconditioner(center, scale)

    def sample(self, state, model_args, model_kwargs):
        return self._sample_fn(state)

    def postprocess_fn(self, model_args, model_kwargs):
        if self.federated_potential is None:
            raise RuntimeError("FedZigZag.postprocess_fn needs init() to have run")
        return self.federated_potential.postprocess_fn


_PRIOR_MODES = ("server", "clients", "redistribute")

_DIAGNOSTICS = (
    "num_events",
    "num_proposals",
    "num_violations",
    "events_by_proposer",
    "grad_evals_by_proposer",
    "hit_event_cap",
)


class ModeSearch(NamedTuple):
    """What the search for the control variates' reference point found
    (:attr:`FedZigZag.mode_search`).

    :ivar point: the last iterate ``(d,)`` (flat, unconstrained).
    :ivar is_mode: the Hessian there is positive definite and a Newton step from it moves no
        coordinate by more than ``newton_tolerance`` (0.05) of its Laplace posterior sd.
    :ivar newton_step: ``max_i |(H^{-1} g)_i| / sqrt((H^{-1})_ii)``, the largest Newton step
        in Laplace posterior sds (``inf`` when the Hessian is not positive definite).
    :ivar max_grad: ``max |grad U|`` at ``point``.
    :ivar attempts: BFGS runs made (each from where the previous one stopped).
    """

    point: jax.Array
    is_mode: bool
    newton_step: float
    max_grad: float
    attempts: int


def _find_mode(fn, x0, *, num_steps: int = 200, max_attempts: int = 5,
               newton_tolerance: float = 0.05) -> ModeSearch:
    """The MAP of the aggregated potential, or the report that there is none.

    The test of convergence is statistical, hence independent of the float type and of the
    units: ``x`` is a mode when the Hessian is positive definite and the Newton step to the
    stationary point is at most ``newton_tolerance`` Laplace posterior sds in every
    coordinate (a reference point that close gives the control variates all their benefit).
    BFGS's own gradient tolerance follows the dtype: ``sqrt(eps)`` times the gradient's scale
    at the start, a precision every float type reaches. A funnel (a hierarchical scale with
    client-local effects) has no mode: BFGS walks down its neck, where the Hessian is
    singular or the Newton step is many sds long, and ``is_mode`` is ``False``.
    """
    from jax.scipy.optimize import minimize

    dtype = x0.dtype
    eps = float(jnp.finfo(dtype).eps)
    grad = jax.jit(jax.grad(fn))
    scale = 1.0 + float(jnp.max(jnp.abs(grad(x0))))
    gtol = math.sqrt(eps) * scale if math.isfinite(scale) else 1.0
    run = jax.jit(lambda x: minimize(fn, x, method="BFGS", options={"maxiter": num_steps, "gtol": gtol}).x)
    hessian = jax.jit(jax.hessian(fn))

    def newton_step(x):
        g, h = grad(x), hessian(x)
        h = (h + h.T) / 2
        chol = jnp.linalg.cholesky(h)
        if not bool(jnp.all(jnp.isfinite(chol))):
            return math.inf, g
        step = jax.scipy.linalg.cho_solve((chol, True), g)
        sd = jnp.sqrt(jnp.diag(jax.scipy.linalg.cho_solve((chol, True), jnp.eye(x.shape[0], dtype=dtype))))
        # below the float resolution of x a step cannot be taken: it does not count
        floor = 8 * eps * (1.0 + jnp.abs(x))
        size = float(jnp.max(jnp.maximum(jnp.abs(step) - floor, 0.0) / sd))
        return (size if math.isfinite(size) else math.inf), g

    x, attempts = x0, 0
    step, g = newton_step(x)
    while step > newton_tolerance and attempts < max_attempts:
        attempts += 1
        candidate = run(x)
        if not (bool(jnp.all(jnp.isfinite(candidate))) and float(fn(candidate)) <= float(fn(x))):
            break
        moved = float(jnp.max(jnp.abs(candidate - x)))
        x = candidate
        step, g = newton_step(x)
        if moved == 0.0:
            break
    return ModeSearch(x, step <= newton_tolerance, step, float(jnp.max(jnp.abs(g))), attempts)


# -- warmup: re-centring the control variates, falling back, detecting a stall ---------------

_BUFFER = 16  # warmup positions kept to compare the rates with and without control variates
_STALL_MIN_PROPOSALS = 50  # fewer proposals without a switch are not evidence of a stall


class _Adaptation(NamedTuple):
    """Per chain: the control variates' reference (:class:`ControlVariates`, or ``None``),
    whether they are on, the current warmup window's path integral and duration, the last
    ``_BUFFER`` warmup positions, and whether the chain has stalled."""

    reference: ControlVariates | None
    active: jax.Array
    window_sum: jax.Array
    window_time: jax.Array
    buffer: jax.Array
    stalled: jax.Array


def _no_mode(search: ModeSearch) -> str:
    reason = ("the Hessian is not positive definite" if not math.isfinite(search.newton_step)
              else f"a Newton step is still {search.newton_step:.3g} posterior sds long")
    return f"after {search.attempts} BFGS runs max |grad U| = {search.max_grad:.3g} and {reason}"


def _active_reference(adapt: _Adaptation) -> ControlVariates:
    """The reference the kernel uses: zero gradients and Hessians (no shift) when off."""
    on = adapt.active
    return adapt.reference._replace(
        term_grads=jnp.where(on, adapt.reference.term_grads, 0.0),
        prior_grad=jnp.where(on, adapt.reference.prior_grad, 0.0),
        **({} if adapt.reference.term_hessians is None else dict(
            term_hessians=jnp.where(on, adapt.reference.term_hessians, 0.0),
            prior_hessian=jnp.where(on, adapt.reference.prior_hessian, 0.0))),
    )


def _rate_scales(proposers: Proposers, reference: ControlVariates, weights, x):
    """``(with, without)``: ``sum_j sum_i |d_i T_j(x) - c_ji(x)|`` with the control variates'
    shifts and without them, twice the expected switching rate over velocities at ``x``."""
    prior_grad = proposers.prior_grad_and_slope(x, jnp.zeros_like(x))[0]
    grads = proposers.term_grads(x) + weights[:, None] * prior_grad
    num = proposers.num
    shift = (reference.term_grads + weights[:, None] * reference.prior_grad
             - (reference.term_grads.sum(0) + reference.prior_grad) / num)
    if reference.term_hessians is not None:
        y = x - reference.point
        shift = shift + (reference.term_hessians @ y + weights[:, None] * (reference.prior_hessian @ y)
                         - (reference.term_hessians.sum(0) + reference.prior_hessian) @ y / num)
    return jnp.abs(grads - shift).sum(), jnp.abs(grads).sum()


def _warmup_adaptation(proposers, *, num_warmup, recentre, order, can_switch_off, max_proposals,
                       sample_interval):
    """``step(adapt, core, i) -> adapt`` after draw ``i``.

    * Re-centring (no mode was found): the reference moves to the mean of the trajectory over
      the warmup windows ending at 1/8, 1/4, 1/2 and all of the warmup (each window's mean,
      the last one over the second half), and the control variates are on from the first.
    * At the end of the warmup the expected rates with and without the control variates are
      compared at the last warmup positions; if the shifts make them larger, they are turned
      off for good (with a warning).
    * A draw that ends at ``max_proposals`` (>= 50) without a single switch is a stall: during
      warmup with control variates on they are turned off; otherwise the chain stops (its
      remaining draws repeat the last position, each marked ``hit_event_cap``) and a warning
      names the remedy.
    """
    ends = sorted({max(1, math.ceil(f * num_warmup)) for f in (1 / 8, 1 / 4, 1 / 2, 1)}) if num_warmup else []
    window_ends = jnp.asarray(ends if recentre else [0], jnp.int32)

    def step(adapt: _Adaptation, core: ZigZagState, i):
        warm = i < num_warmup
        fallback_possible = can_switch_off and adapt.reference is not None
        stalled_now = (core.hit_event_cap & (core.num_events == 0) & ~adapt.stalled
                       & (core.num_proposals >= min(max_proposals, _STALL_MIN_PROPOSALS))
                       & (max_proposals >= _STALL_MIN_PROPOSALS))
        switch_off = stalled_now & warm & adapt.active if fallback_possible else jnp.zeros((), bool)
        adapt = adapt._replace(stalled=adapt.stalled | (stalled_now & ~switch_off),
                               active=adapt.active & ~switch_off)
        cheaper = jnp.ones((), bool)
        if num_warmup and adapt.reference is not None:
            slot = i % _BUFFER
            adapt = adapt._replace(
                window_sum=adapt.window_sum + jnp.where(warm, core.path_integral, 0.0),
                window_time=adapt.window_time + jnp.where(warm, core.elapsed, 0.0),
                buffer=jnp.where(warm, adapt.buffer.at[slot].set(core.x), adapt.buffer),
            )
            if recentre:
                def move(adapt):
                    point = adapt.window_sum / adapt.window_time
                    return adapt._replace(
                        reference=control_variate_reference(proposers, point, order=order),
                        active=adapt.active | ~adapt.stalled,
                        window_sum=jnp.zeros_like(adapt.window_sum),
                        window_time=jnp.zeros_like(adapt.window_time),
                    )

                at_end = warm & jnp.any(i + 1 == window_ends) & (adapt.window_time > 0)
                adapt = lax.cond(at_end & ~switch_off, move, lambda a: a, adapt)
            if fallback_possible:
                def compare(adapt):
                    filled = jnp.arange(_BUFFER) < jnp.minimum(i + 1, _BUFFER)
                    weights = core.prior_weights
                    with_cv, without = jax.vmap(lambda x: _rate_scales(proposers, adapt.reference, weights, x))(adapt.buffer)
                    return jnp.sum(jnp.where(filled, with_cv, 0.0)) <= jnp.sum(jnp.where(filled, without, 0.0))

                last = (i + 1 == num_warmup) & adapt.active
                cheaper = lax.cond(last, compare, lambda a: jnp.ones((), bool), adapt)
                adapt = adapt._replace(active=adapt.active & cheaper)
        lax.cond(stalled_now | switch_off | ~cheaper,
                 lambda: jax.debug.callback(_report_adaptation, i, stalled_now & ~switch_off, switch_off,
                                            ~cheaper, max_proposals, sample_interval),
                 lambda: None)
        return adapt

    return step


def _report_adaptation(i, stalled, switched_off, costlier, max_proposals, sample_interval):
    """Host side of the warmup's decisions: one warning per decision."""
    i, stalled, switched_off, costlier = (np.asarray(a) for a in (i, stalled, switched_off, costlier))
    if np.any(switched_off):
        warnings.warn(
            f"FedZigZag: control variates turned off at warmup draw {int(np.max(i))}: a draw made "
            f"max_proposals={int(max_proposals)} proposals without a switch with them on (their "
            "reference point is a poor centre for this posterior); the chain continues without",
            RuntimeWarning, stacklevel=2,
        )
    if np.any(costlier):
        warnings.warn(
            "FedZigZag: control variates turned off at the end of the warmup: at the last warmup "
            "positions they made the switching rates larger, not smaller (the posterior is far "
            "from Gaussian around the reference point)",
            RuntimeWarning, stacklevel=2,
        )
    if np.any(stalled):
        warnings.warn(
            f"FedZigZag: a chain stalled at draw {int(np.max(i))}: max_proposals="
            f"{int(max_proposals)} proposals without a single switch; its remaining draws repeat "
            "its last position (marked hit_event_cap). The process is caught where the rates are "
            "huge: reparametrise the model (e.g. non-centred), pass control_variates=False, or "
            f"shorten sample_interval={sample_interval}",
            RuntimeWarning, stacklevel=2,
        )
