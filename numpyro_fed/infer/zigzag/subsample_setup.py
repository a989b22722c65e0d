"""FedZigZag's subsampling set-up: the clients' bounds on their rate estimates, computed once
at ``init`` (``FedZigZag(subsample_size=...)``; the estimates themselves are
:mod:`~numpyro_fed.infer.zigzag.subsample`'s).

Each client bounds its rows' curvature (first order) or their remainder after the Taylor term
(second order) over points around the reference: the reference, the origin and
2.5 posterior sds around it; one unit away (the probe points) it checks that the bound does
not grow, else it warns that the automatic bound holds near the posterior only. During warmup
a draw with a violation doubles the bound (:func:`grow_bound`).

Second order through a federation (the clients' thinning): each client computes its rows'
weights, and its gradient and Hessian at the reference, once, in the stateful set-up call
``"row_remainders"`` (:func:`remainder_state`), and keeps them as its client state
(:class:`~numpyro_fed.infer.zigzag.subsample.SubsampleState`); it sends the server only what
the bound needs (``(2, d, d)``, ``(2, d)`` and ``(d,)`` numbers).
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any, NamedTuple

import numpy as np

import jax
import jax.numpy as jnp

from numpyro_fed._checks import warn_user
from numpyro_fed.infer.zigzag.bounds import HessianBound, SampledRowBound, per_proposer_bound
from numpyro_fed.infer.zigzag.subsample import (
    AUTOMATIC_MARGIN,
    THIRD_FLOOR,
    THIRD_GROWTH,
    RowHessianBound,
    SubsampleState,
    importance_weights,
    row_weights,
    third_weights,
)

__all__ = [
    "REMAINDER_CALL",
    "SubsampleBoundSetup",
    "grow_bound",
    "initial_subsample_state",
    "remainder_state",
    "subsample_bounds",
    "subsample_order",
]

#: the name of the clients' stateful set-up call of second order through a federation
REMAINDER_CALL = "row_remainders"


class SubsampleBoundSetup(NamedTuple):
    """What the subsampling's bounds are computed with.

    :ivar bounds: the ``bounds`` given (``"grid"``: automatic, or a :class:`RowHessianBound`).
    :ivar subsample_size: ``b`` (named in the warnings and errors).
    :ivar preconditioner: the run's :class:`~numpyro_fed.infer.zigzag.Preconditioner` or ``None``.
    :ivar federation: the federation whose clients answer a ``"row_curvature"`` call (each
        client thinning its own proposals), or ``None`` (the server's thinning, in process).
    :ivar blocks: with the server's thinning: the clients' stacked blocks, held in this process
        by the federation (every row's importance weight is computed from them).
    :ivar timings: filled with the seconds the clients' set-up call took (through a
        federation: the workers' compilation and computation, in parallel, and the round trip).
    """

    bounds: Any
    subsample_size: int
    preconditioner: Any = None
    federation: Any = None
    blocks: Any = None
    timings: Any = None

    @property
    def user_bound(self):
        return self.bounds if isinstance(self.bounds, RowHessianBound) else None


def subsample_order(control_variates, bounds) -> int:
    """The control variates' order with ``subsample_size``: second (in process and through a
    federation) unless ``"first_order"`` is asked for or a :class:`RowHessianBound` without
    ``third`` is given."""
    if control_variates in ("first_order", "second_order"):
        return 1 if control_variates == "first_order" else 2
    if isinstance(bounds, RowHessianBound) and bounds.third is None:
        return 1
    return 2


def _preconditioned_row_bound(row_bound, preconditioner, *rows):
    """A user's per-row curvature bound in ``x`` as one in ``u``: ``|S|^T |B| |S|``."""
    d = preconditioner.center.shape[-1]
    return preconditioner.bound_to_u(jnp.broadcast_to(jnp.abs(jnp.asarray(row_bound(*rows))), (d, d)))


def _preconditioned_row_third(row_third, preconditioner, *rows):
    """A user's per-row third-derivative bound in ``x`` as one in ``u``
    (:meth:`~numpyro_fed.infer.zigzag.Preconditioner.third_bound_to_u`)."""
    d = preconditioner.center.shape[-1]
    return preconditioner.third_bound_to_u(jnp.broadcast_to(jnp.abs(jnp.asarray(row_third(*rows))), (d,)))


def _remainder_weights(kappa, valid, *, margin, floor):
    """The :class:`RowWeights` of the rows' remainder bounds ``kappa`` ``(M, n_max, d)`` (mask
    ``valid`` ``(M, n_max)``): times ``margin``, plus ``floor`` times the client's mean (a row
    whose third derivative vanishes where it was looked at, e.g. a logistic row with a zero
    logit, is still drawn)."""
    sizes = jnp.maximum(jnp.sum(valid, axis=1), 1)
    mean = kappa.sum(1, keepdims=True) / sizes[:, None, None]
    kappa = jnp.where(valid[..., None], margin * (kappa + floor * mean), 0.0)
    return importance_weights(jnp.swapaxes(kappa, 1, 2))


def _remainder_margins(row_third):
    """``(margin, floor)`` of the remainder weights: a user's ``third`` bound is exact."""
    return (1.0, 0.0) if row_third is not None else (AUTOMATIC_MARGIN, THIRD_FLOOR)


def initial_subsample_state(num_clients: int, num_rows: int, d: int, dtype) -> SubsampleState:
    """Every client's :class:`~numpyro_fed.infer.zigzag.subsample.SubsampleState` before the
    set-up call (zeros, leading axis ``M``): its shapes, the same on every client (``num_rows``:
    the largest client's rows)."""
    square = jnp.zeros((num_clients, d, d), dtype)
    return SubsampleState(
        jnp.zeros((num_clients, d, num_rows), jnp.int32), jnp.zeros((num_clients, d), dtype), square, square, square
    )


def remainder_state(
    grad,
    value_and_grad,
    hessian,
    layout,
    row_third,
    block,
    state,
    bound_points,
    probe_points,
    mean_hessian,
    prior_hessian,
):
    """Client side, the stateful set-up call ``"row_remainders"`` (second order through a
    federation): ``(new_state, reply)``. The new state (kept by the client) is its rows'
    remainder weights (:func:`~numpyro_fed.infer.zigzag.subsample.third_weights`, as the
    server's thinning computes them in process), its gradient and Hessian at the reference
    point ``bound_points[0]``, and the proposers' mean Hessian and the prior's there (sent by
    the server). The reply is what the server's bound needs: ``(level, spread, sup, finite)``,
    the client-level terms' curvature ``(2, d, d)``, the rows' summed remainder bounds around
    and away from the posterior ``(2, d)``, the importance-sampled remainders' bound ``(d,)``
    and whether every row's bound is finite.

    :param value_and_grad: ``(block, x) -> (value, (d,))`` and :param hessian: ``(block, x) ->
        (d, d)``: the client's set-up calls (:func:`~numpyro_fed.infer.zigzag.setup.setup_functions`),
        whose replies at the reference point are the server's control variates.
    """
    num_rows = state.cumulative.shape[-1]
    level, kappa, spread = third_weights(grad, layout, block, bound_points, probe_points, row_third)
    valid = block["valid"][layout.plate]
    pad = num_rows - kappa.shape[0]  # a client with fewer rows than the largest (deployment)
    kappa, valid = jnp.pad(kappa, ((0, pad), (0, 0))), jnp.pad(valid, (0, pad))
    margin, floor = _remainder_margins(row_third)
    weights = _remainder_weights(kappa[None], valid[None], margin=margin, floor=floor)
    point = bound_points[0]
    new = SubsampleState(
        weights.cumulative[0],
        value_and_grad(block, point)[1],
        hessian(block, point),
        mean_hessian.astype(point.dtype),
        prior_hessian.astype(point.dtype),
    )
    return new, (level, spread, weights.sup[0], jnp.isfinite(kappa).all())


def _larger_away(values, factor, axes):
    """``(larger, finite)`` per leading index of ``values`` ``(n, 2, ...)``: the values one unit
    from the reference point (``[:, 1]``) exceed ``factor`` times those around the posterior
    (``[:, 0]``) anywhere, or are not all finite."""
    around, away = np.asarray(values[:, 0], np.float64), np.asarray(values[:, 1], np.float64)
    finite = np.isfinite(away).all(axis=axes)
    larger = (np.where(np.isfinite(away), away, 0.0) > factor * around * (1 + 1e-6) + 1e-12).any(axis=axes)
    return larger, finite


def _warn_local_bound(subsample_size, subject, undefined, ratio, exact):
    """The warning of an automatic subsampling bound that holds near the posterior only:
    ``subject`` (e.g. "the curvature of client 0") is not finite one unit from the reference
    point for ``undefined`` (a list of names), or is up to ``ratio`` times larger there."""
    if undefined:
        how = (
            f"is not finite one unit from the reference point for {', '.join(undefined)} (the "
            "log-density or its derivatives overflow or are undefined there, e.g. a probability "
            "that rounds to 0 or 1)"
        )
    else:
        how = (
            f"grows away from the posterior (one unit from the reference point it is up to {ratio:.3g} "
            "times the largest found around the posterior: not bounded globally, e.g. a log link or "
            "a scale parameter)"
        )
    warn_user(
        f"FedZigZag(subsample_size={subsample_size}): {subject} {how}. "
        "The automatic bound holds near the posterior only: proposals whose "
        "estimated rate exceeds it are counted (sample_stats num_violations, check_run), and "
        "each warmup draw with one doubles the bound. For an exact run pass "
        f"bounds={exact} valid everywhere, or subsample_size=None",
        RuntimeWarning,
    )


def _at_x(fn, preconditioner, u):
    """``fn`` of ``x`` as a function of ``u`` (``x = center + scale u``)."""
    return fn(preconditioner.to_x(u))


def _curvature_points(setup: SubsampleBoundSetup, reference, hessian, order):
    """``(bound_points, probe_points, sd)``: the points the bounds hold over (the reference,
    the origin of ``x`` and 2.5 posterior sds around the reference), those one unit of ``x``
    away where a growing curvature shows itself, and the posterior sds (from the Hessian at
    the reference), all in the process's space."""
    point = reference.point
    d, dtype = point.shape[0], point.dtype
    pre = setup.preconditioner
    x_point = pre.to_x(point) if pre is not None else point
    if order == 2:  # the second-order control variates hold it, in the process's space
        total = np.asarray(reference.term_hessians.sum(0) + reference.prior_hessian, np.float64)
    else:
        total = np.asarray(hessian(x_point), np.float64)  # through the federation: one "hessian" call
        if pre is not None:
            scale = np.asarray(pre.matrix(), np.float64)
            total = scale.T @ total @ scale
    try:
        variances = np.diag(np.linalg.inv(total))
    except np.linalg.LinAlgError:
        variances = np.full(d, np.nan)
    variances = np.where(
        np.isfinite(variances) & (variances > 0), variances, 1.0 / np.maximum(np.abs(np.diag(total)), 1e-12)
    )
    sd = np.sqrt(variances)
    # the probe points' signs are part of the bound's definition, not of the chain's randomness:
    # drawn from a fixed key, so a model gets the same bound whatever the run's key and on every
    # backend (the clients receive the points), and no generator outside JAX's keys is used
    signs = np.asarray(jax.random.rademacher(jax.random.PRNGKey(0), (4, d)), np.float64)
    center = np.asarray(point, np.float64)
    # the origin of x (where a GLM's curvature peaks) and, one unit of x away from the
    # reference, the points where a curvature that grows shows itself
    origin = np.zeros((1, d)) if pre is None else np.asarray(pre.to_u(jnp.zeros((1, d), dtype)), np.float64)
    bound_points = jnp.asarray(np.concatenate([center[None], origin, center + 2.5 * sd * signs]), dtype)
    probe_points = jnp.asarray(center + signs if pre is None else pre.to_u(x_point + jnp.asarray(signs, dtype)), dtype)
    return bound_points, probe_points, sd


def _prior_curvature(setup: SubsampleBoundSetup, potential, bound_points, probe_points):
    """``(2, d, d)``: the prior's largest ``|d_i d_k U_0|`` over ``bound_points`` and over
    ``probe_points`` (in ``u`` with a preconditioner), on the server."""
    pre = setup.preconditioner
    prior_potential = potential.flat().prior_potential
    if pre is not None:
        prior_potential = partial(_at_x, prior_potential, pre)
    prior_hessians = np.abs(
        np.asarray(
            jax.jit(jax.vmap(jax.hessian(prior_potential)))(jnp.concatenate([bound_points, probe_points])), np.float64
        )
    )
    num_bound = bound_points.shape[0]
    return np.stack([prior_hessians[:num_bound].max(0), prior_hessians[num_bound:].max(0)])


def _prior_bound(setup: SubsampleBoundSetup, prior):
    """The prior's curvature bound: the user's (in ``u`` with a preconditioner) or the
    automatic one from ``prior`` (:func:`_prior_curvature`)."""
    user = setup.user_bound
    if user is None or user.prior is None:
        return AUTOMATIC_MARGIN * prior[0]
    prior_bound = np.asarray(user.prior, np.float64)
    if setup.preconditioner is not None:
        prior_bound = setup.preconditioner.bound_to_u(np.abs(prior_bound))
    return prior_bound


def subsample_bounds(
    setup: SubsampleBoundSetup, potential, layout, reference, hessian, row_grad, num_proposers, order=1
):
    """``(bound, weights, unbounded_curvature)``: the clients' bounds on their rate estimates
    (a :class:`HessianBound` laid out per proposer with the clients' thinning, with the server's a
    :class:`~numpyro_fed.infer.zigzag.bounds.SampledRowBound`), the rows' importance weights
    with the server's thinning (``None`` with the clients', whose batches are uniform), and whether the
    automatic bound found a curvature that grows away from the posterior (then it warns: the
    bound is local). Each client's row comes from its own rows (in a federation: one
    ``"row_curvature"`` call), the prior's from the server.

    With a preconditioner (in process) everything is in ``u``: the reference point is there,
    ``row_grad`` a row's gradient in ``u`` (:func:`preconditioned_row_grad`), and the
    curvatures are those of the potential of ``u``."""
    bound_points, probe_points, sd = _curvature_points(setup, reference, hessian, order)
    if order == 2:
        return _second_order_bounds(
            setup,
            potential,
            layout,
            row_grad,
            num_proposers,
            bound_points,
            probe_points,
            float(np.min(sd)),
            reference,
        )
    return _first_order_bounds(setup, potential, layout, row_grad, num_proposers, bound_points, probe_points)


def _first_order_bounds(
    setup: SubsampleBoundSetup, potential, layout, row_grad, num_proposers, bound_points, probe_points
):
    """:func:`subsample_bounds` of first order: against the rows' curvature."""
    d, dtype = bound_points.shape[-1], bound_points.dtype
    pre = setup.preconditioner
    row_bound = setup.user_bound.rows if setup.user_bound is not None else None
    if row_bound is not None and pre is not None:  # |S^T H S| <= |S|^T |H| |S| entrywise
        row_bound = partial(_preconditioned_row_bound, row_bound, pre)
    weights = None
    if setup.federation is not None:
        curvature = setup.federation.map("row_curvature", bound_points, probe_points)
    else:  # the server's thinning, in process: every row's weight too, for the importance sampling
        curvature, level, weights = jax.jit(
            jax.vmap(
                partial(
                    row_weights,
                    row_grad,
                    layout,
                    bound_points=bound_points,
                    probe_points=probe_points,
                    row_bound=row_bound,
                )
            )
        )(setup.blocks)
        weights = jnp.swapaxes(weights, 1, 2)  # (M, d, n_max)
        level = np.asarray(level, np.float64)[:, 0]
    curvature = np.asarray(curvature, np.float64)  # (M, 2, d, d)
    prior = _prior_curvature(setup, potential, bound_points, probe_points)
    if not (np.isfinite(curvature[:, 0]).all() and np.isfinite(prior[0]).all()):
        raise ValueError(
            f"FedZigZag(subsample_size={setup.subsample_size}): the curvature bound is not "
            "finite (a row's Hessian is inf or nan near the posterior: at the reference point, "
            "the origin or 2.5 posterior sds around the reference); pass subsample_size=None"
        )
    unbounded = _warn_growing_curvature(setup, curvature, prior)
    margin = 1.0 if row_bound is not None and not layout.client_terms else AUTOMATIC_MARGIN
    prior_bound = _prior_bound(setup, prior)
    if weights is None:  # uniform batches: the largest row's curvature n_m times
        bound = HessianBound(np.maximum(margin * curvature[:, 0], 0.0), np.maximum(prior_bound, 0.0))
        return per_proposer_bound(bound, potential.num_clients, num_proposers, d, dtype), None, unbounded
    # rows drawn in proportion to their curvature: the level terms' Hessian bound, and the
    # rows' sum of curvatures against the largest distance to the reference
    weights = jax.jit(importance_weights)(weights)
    level_bound = per_proposer_bound(
        HessianBound(np.maximum(AUTOMATIC_MARGIN * level, 0.0), np.maximum(prior_bound, 0.0)),
        potential.num_clients,
        num_proposers,
        d,
        dtype,
    )
    sup = margin * np.asarray(weights.sup, np.float64)
    if num_proposers > potential.num_clients:
        sup = np.concatenate([sup, np.zeros((1, d))])
    if not np.isfinite(sup).all():
        raise ValueError(
            f"FedZigZag(subsample_size={setup.subsample_size}): the curvature bound is not "
            "finite (a row's Hessian is inf or nan near the posterior); pass subsample_size=None"
        )
    bound = SampledRowBound(level_bound.clients, level_bound.prior, jnp.asarray(sup, dtype))
    return bound, weights, unbounded


def _warn_growing_curvature(setup: SubsampleBoundSetup, curvature, prior) -> bool:
    """Warns when a client's curvature ``(M, 2, d, d)`` or the prior's (unless the user bounds
    it) is larger one unit away, or not finite there (a probability that rounds to 0 or 1, a
    log-density undefined there): the bound then holds near the posterior only. Returns
    whether it warned."""
    user_prior = setup.user_bound is not None and setup.user_bound.prior is not None
    slack = lambda b: b * (1 + 1e-6) + 1e-12  # noqa: E731
    finite_part = lambda a: np.where(np.isfinite(a), a, 0.0)  # noqa: E731
    finite = np.isfinite(curvature[:, 1]).all(axis=(-1, -2))
    larger = (finite_part(curvature[:, 1]) > slack(curvature[:, 0])).any(axis=(-1, -2))
    grows = [f"client {m}" for m in np.flatnonzero(larger | ~finite)]
    prior_finite = bool(np.isfinite(prior[1]).all())
    if not user_prior and (not prior_finite or (finite_part(prior[1]) > slack(prior[0])).any()):
        grows.append("the prior")
    if grows:
        undefined = [f"client {m}" for m in np.flatnonzero(~finite)]
        if not (user_prior or prior_finite):
            undefined.append("the prior")
        ratio = max(
            float(np.max(curvature[:, 1] / np.maximum(curvature[:, 0], 1e-300))),
            0.0 if user_prior else float(np.max(prior[1] / np.maximum(prior[0], 1e-300))),
        )
        _warn_local_bound(
            setup.subsample_size, f"the curvature of {', '.join(grows)}", undefined, ratio, "RowHessianBound(...)"
        )
    return bool(grows)


def _second_order_bounds(
    setup: SubsampleBoundSetup,
    potential,
    layout,
    row_grad,
    num_proposers,
    bound_points,
    probe_points,
    horizon,
    reference,
):
    """Second order: ``(SampledRowBound, weights, unbounded)``: the rows drawn in proportion to
    their remainder bounds (:func:`third_weights`), and the bound of the exactly computed terms'
    Hessian variation (twice their largest curvature: the prior's, the client-level terms').
    ``weights`` is the :class:`RowWeights` in process (the server's thinning), or through a
    federation the clients' :class:`~numpyro_fed.federation.ClientState` after the
    ``"row_remainders"`` call (each client keeps its weights)."""
    d, dtype = bound_points.shape[-1], bound_points.dtype
    row_third = setup.user_bound.third if setup.user_bound is not None else None
    pre = setup.preconditioner
    if row_third is not None and pre is not None:
        row_third = partial(_preconditioned_row_third, row_third, pre)
    if setup.federation is not None:
        level, spread, second, finite, weights = _clients_remainders(
            setup, layout, reference, bound_points, probe_points
        )
    else:
        level, kappa, spread = jax.jit(
            jax.vmap(
                partial(
                    third_weights,
                    row_grad,
                    layout,
                    bound_points=bound_points,
                    probe_points=probe_points,
                    row_third=row_third,
                )
            )
        )(setup.blocks)
        margin, floor = _remainder_margins(row_third)
        weights = jax.jit(partial(_remainder_weights, margin=margin, floor=floor))(
            kappa, setup.blocks["valid"][layout.plate]
        )
        finite, second = bool(np.isfinite(np.asarray(kappa)).all()), np.asarray(weights.sup, np.float64)
    level, spread = np.asarray(level, np.float64), np.asarray(spread, np.float64)
    prior = _prior_curvature(setup, potential, bound_points, probe_points)
    if not (finite and np.isfinite(level[:, 0]).all() and np.isfinite(prior[0]).all()):
        raise ValueError(
            f"FedZigZag(subsample_size={setup.subsample_size}): the remainder bound is not "
            "finite (a row's third derivative is inf or nan near the posterior); pass "
            "subsample_size=None"
        )
    unbounded = _warn_growing_third(setup, potential.num_clients, level, spread, prior, row_third is not None)
    prior_bound = _prior_bound(setup, prior)
    # |H(y) - H(x*)| <= 2 max |H| for the terms computed exactly
    variation = HessianBound(2 * AUTOMATIC_MARGIN * level[:, 0], 2 * np.maximum(prior_bound, 0.0))
    variation = per_proposer_bound(variation, potential.num_clients, num_proposers, d, dtype)
    if num_proposers > potential.num_clients:
        second = np.concatenate([second, np.zeros((1, d))])
    bound = SampledRowBound(
        variation.clients,
        variation.prior,
        jnp.zeros((num_proposers, d), dtype),
        jnp.asarray(second, dtype),
        jnp.asarray(horizon, dtype),
    )
    return bound, weights, unbounded


def _clients_remainders(setup: SubsampleBoundSetup, layout, reference, bound_points, probe_points):
    """Through a federation: every client's ``"row_remainders"`` call (:func:`remainder_state`)
    from its initial client state: ``(level, spread, second, finite, client_state)``."""
    federation = setup.federation
    d, dtype = bound_points.shape[-1], bound_points.dtype
    # the clients' states have one shape: the largest client's rows (known from the shapes)
    num_rows = max(int(spec["valid"][layout.plate].shape[0]) for spec in federation.block_specs)
    num = reference.term_hessians.shape[0]
    # each client's share of the Hessian at the reference: none when the server's own proposer
    # takes the Taylor part (see federated._taylor_shares), else 1 / P
    mean_hessian = (reference.term_hessians.sum(0) + reference.prior_hessian) / num
    if num > federation.num_clients:
        mean_hessian = jnp.zeros_like(mean_hessian)
    start = time.perf_counter()
    state = federation.init_state(initial_subsample_state(federation.num_clients, num_rows, d, dtype))
    state, (level, spread, second, finite) = federation.map(
        REMAINDER_CALL, bound_points, probe_points, mean_hessian, reference.prior_hessian, state=state
    )
    level = np.asarray(level, np.float64)  # waits for the clients
    if setup.timings is not None:
        setup.timings[REMAINDER_CALL] = time.perf_counter() - start
    return level, spread, np.asarray(second, np.float64), bool(np.asarray(finite).all()), state


def _warn_growing_third(setup: SubsampleBoundSetup, num_clients, level, spread, prior, user_third) -> bool:
    """Warns when, one unit away, the rows' third derivative is much larger (a log link), the
    curvature of the exactly computed terms larger, or either not finite: the automatic bound
    then holds near the posterior only. Returns whether it warned."""
    user_prior = setup.user_bound is not None and setup.user_bound.prior is not None
    rows_larger, rows_finite = _larger_away(spread, THIRD_GROWTH, axes=-1)
    if user_third:
        rows_larger, rows_finite = np.zeros_like(rows_larger), np.ones_like(rows_finite)
    level_larger, level_finite = _larger_away(level, 1.0, axes=(-1, -2))
    prior_larger, prior_finite = _larger_away(prior[None], 1.0, axes=(-1, -2))
    if user_prior:
        prior_larger, prior_finite = np.zeros(1, bool), np.ones(1, bool)
    names = [f"client {m}" for m in range(num_clients)] + ["the prior"]
    rows_grow = [names[m] for m in np.flatnonzero(rows_larger | ~rows_finite)]
    exact_grow = [
        names[k] for k in np.flatnonzero(np.concatenate([level_larger | ~level_finite, prior_larger | ~prior_finite]))
    ]
    finite = np.concatenate([rows_finite & level_finite, prior_finite])
    unbounded = bool(rows_grow or exact_grow)
    if unbounded:
        subject = " and ".join(
            ([f"the rows' third derivative of {', '.join(rows_grow)}"] if rows_grow else [])
            + ([f"the curvature of {', '.join(exact_grow)}"] if exact_grow else [])
        )
        ratios = [level[:, 1] / np.maximum(level[:, 0], 1e-300)]
        if not user_third:
            ratios.append(spread[:, 1] / np.maximum(spread[:, 0], 1e-300))
        if not user_prior:
            ratios.append(prior[1] / np.maximum(prior[0], 1e-300))
        ratio = max(float(np.max(np.where(np.isfinite(r), r, 0.0))) for r in ratios)
        _warn_local_bound(
            setup.subsample_size,
            subject,
            [names[k] for k in np.flatnonzero(~finite)],
            ratio,
            "RowHessianBound(..., third=...)",
        )
    return unbounded


def grow_bound(bound_scale, info, i, *, num_warmup, subsample_size, origin):
    """A warmup draw with a bound violation doubles the subsampling's bound (with a warning)."""
    grow = (i < num_warmup) & (info.num_violations > 0)
    # under vmap (vectorized chains) both branches run: the host checks ``grow`` again
    jax.lax.cond(
        grow,
        lambda: jax.debug.callback(
            partial(_report_growth, subsample_size=subsample_size, origin=origin), grow, i, bound_scale * 2
        ),
        lambda: None,
    )
    return jnp.where(grow, bound_scale * 2, bound_scale)


def _report_growth(grow, i, scale, *, subsample_size, origin):
    grow, i, scale = np.asarray(grow), np.asarray(i), np.asarray(scale)
    if not np.any(grow):
        return
    i, scale = i[grow], scale[grow]
    warn_user(
        f"FedZigZag(subsample_size={subsample_size}): warmup draw {int(np.max(i))} had estimated rates "
        f"above their bound; the bound is now {float(np.max(scale)):g} times the clients' (counted in "
        "num_violations; after warmup it stays fixed)",
        RuntimeWarning,
        origin,
    )
