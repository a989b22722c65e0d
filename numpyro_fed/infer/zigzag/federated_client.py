"""The clients' side of Algorithm 2 as messages (:mod:`~numpyro_fed.infer.zigzag.federated` is
the server's): a client's round, :func:`client_proposal`, the first switching time of its own
rate along the current line by thinning against its own bound, on its own rows; and
:func:`client_function`, the ``"propose"`` call of the clients' program built from it (with
second-order subsampling a stateful call: the client's
:class:`~numpyro_fed.infer.zigzag.subsample.SubsampleState` holds its rows' weights, gradient
and Hessian at the reference).
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from numpyro_fed.infer.zigzag.bounds import SampledRowBound, empty_line
from numpyro_fed.infer.zigzag.control_variates import ControlVariates, Shift, shift_for
from numpyro_fed.infer.zigzag.kernel import kernel_config, step
from numpyro_fed.infer.zigzag.preconditioning import precondition
from numpyro_fed.infer.zigzag.proposers import Proposers
from numpyro_fed.infer.zigzag.state import ZigZagState
from numpyro_fed.infer.zigzag.subsample import gradient_estimate, state_estimate

__all__ = [
    "MAX_LOCAL_STEPS",
    "ClientCounts",
    "ClientSettings",
    "Proposal",
    "client_function",
    "client_proposal",
    "own_proposal",
    "remainder_proposal",
]

#: proposals a client makes in one round at most before it answers "none yet" (guards
#: against a rate that explodes along the line)
MAX_LOCAL_STEPS = 10_000


class Proposal(NamedTuple):
    """What a client sends in a round (Algorithm 2, step 3).

    :ivar time: the client's first switching time from the round's start, or (when
        ``coordinate == -1``) how far along the line it searched without one.
    :ivar coordinate: the coordinate whose velocity flips (``int32``), ``-1``: none yet.
    """

    time: jax.Array
    coordinate: jax.Array


class ClientCounts(NamedTuple):
    """Diagnostics a client adds to its reply unless a privacy guarantee is asked for (they
    depend on its data and Theorem 5.1 does not cover them): its local proposals, gradient
    evaluations and proposals whose exact rate exceeded the bound, in the round (``int32``)."""

    proposals: jax.Array
    grad_evals: jax.Array
    violations: jax.Array


def _single(own_grad_and_slope, prior_grad_and_slope, own_estimate=None) -> Proposers:
    """One proposer's :class:`Proposers` (``P = 1``) from its own functions of ``(x, v)``
    (and, with subsampling, ``own_estimate(x, key)``)."""
    return Proposers(
        term_grads_and_slopes=lambda x, v: jax.tree.map(lambda a: a[None], own_grad_and_slope(x, v)),
        term_grads=lambda x: own_grad_and_slope(x, jnp.zeros_like(x))[0][None],
        term_grad_of=lambda x, j: own_grad_and_slope(x, jnp.zeros_like(x))[0],
        prior_grad_and_slope=prior_grad_and_slope,
        num=1,
        term_grad_estimate=None
        if own_estimate is None
        else (lambda x, j, key, reference, coordinate: own_estimate(x, key, coordinate)),
    )


def _own_shift(point, mean_grad, constant, linear) -> Shift | None:
    """A client's own :class:`~numpyro_fed.infer.zigzag.control_variates.Shift`, as a
    one-proposer reference whose arithmetic gives ``constant + linear (x - point)``."""
    if point is None:
        return None
    zeros = jnp.zeros_like(point)
    if linear is None:
        reference = ControlVariates(point, mean_grad[None], zeros)
        return Shift(constant[None], reference, None)
    # one proposer: term_hessians [A], prior_hessian -A and weight 0 give A y
    reference = ControlVariates(point, mean_grad[None], zeros, linear[None], -linear)
    return Shift(constant[None], reference, jnp.zeros(1, point.dtype))


def client_proposal(
    own_grad_and_slope,
    prior_grad_and_slope,
    x,
    v,
    window,
    key,
    horizon,
    weight,
    *,
    kind: str,
    bounds=None,
    excess=0.0,
    grid_size: int = 2,
    safety_factor: float = 1.0,
    shift: Shift | None = None,
    preconditioner=None,
    counts: bool = True,
    own_estimate=None,
):
    """A client's (or the server's prior proposer's) round: the first switching time of its
    own rate along ``x + t v`` within ``window``, by thinning against its exact rate.

    :param own_grad_and_slope: ``(x, v) -> ((d,), (d,))`` of its own term (from its rows).
    :param prior_grad_and_slope: the same for the prior's potential ``U_0``.
    :param weight: its share of the prior. :param horizon: its grid horizon.
    :param own_estimate: with subsampling, ``(x, key, coordinate) -> (d,)``: the estimate of
        its own term's gradient from a batch of its rows, unbiased in ``coordinate`` (the check
        then thins against it).
    :return: ``(Proposal, ClientCounts)`` with ``counts``, else the :class:`Proposal`.
    """
    proposers = _single(own_grad_and_slope, prior_grad_and_slope, own_estimate)
    if preconditioner is not None:
        proposers = precondition(proposers, preconditioner)
    config = kernel_config(
        proposers,
        excess_rates=jnp.reshape(excess, (1,)),
        bounds=kind if bounds is None else bounds,
        grid_size=grid_size,
        safety_factor=safety_factor,
        batched=True,
    )
    d, dtype = x.shape[0], x.dtype
    if shift is None:
        shift = shift_for(None, None, 1, d, dtype)
    state = ZigZagState(
        x=x,
        v=v,
        horizon=jnp.asarray(horizon, dtype),
        prior_weights=jnp.reshape(weight, (1,)).astype(dtype),
        line=empty_line(config.kind, grid_size, 1, d, dtype),
    )
    zero = jnp.zeros((), jnp.int32)

    def searching(carry):
        _, _, elapsed, found, steps, _ = carry
        return ~found & (elapsed < window) & (steps < MAX_LOCAL_STEPS)

    def one_step(carry):
        key, state, elapsed, _, steps, tally = carry
        key, k_step = jax.random.split(key)
        state, info = step(config, k_step, state, window - elapsed, shift=shift)
        tally = ClientCounts(
            tally.proposals + info.proposed,
            tally.grad_evals + info.grad_evals_by_proposer[0],
            tally.violations + info.violated,
        )
        return key, state, elapsed + info.elapsed, info.accepted, steps + 1, tally

    _, final, elapsed, found, _, tally = lax.while_loop(
        searching,
        one_step,
        (key, state, jnp.zeros((), dtype), jnp.zeros((), bool), zero, ClientCounts(zero, zero, zero)),
    )
    coordinate = jnp.where(found, jnp.argmax(final.v != v), -1).astype(jnp.int32)
    proposal = Proposal(elapsed, coordinate)
    return (proposal, tally) if counts else proposal


class ClientSettings(NamedTuple):
    """What every client's round function is built with (see :func:`client_function`)."""

    kind: str
    grid_size: int
    safety_factor: float
    excess: float
    counts: bool
    second_order: bool
    use_cv: bool
    subsample: Any = None  # the SubsampleLayout, with subsampling
    # second-order subsampling: each client keeps its rows' weights, gradient and Hessian at the
    # reference as its client state (a SubsampleState), and its bound is a SampledRowBound
    remainders: bool = False


def client_function(clients, settings: ClientSettings, preconditioner=None):
    """The function every client runs in a round, ``f(block, *broadcast, *own)``, for the
    :class:`~numpyro_fed.federation.ClientProgram` (name ``"propose"``).

    Broadcast: ``x, v, window`` and, with control variates, the reference point and the mean
    gradient there. Own: ``key, horizon, weight``, with control variates the shift's constant
    (and linear part), with subsampling the client's own gradient at the reference point,
    with a user's (or the subsampling's) bound the client's row of it (and the prior's).

    With second-order subsampling (``settings.remainders``) the function is stateful,
    ``f(block, state, x, v, window, point, mean_grad, key, horizon, weight, constant, row,
    prior, second, bound_horizon) -> (state, proposal)``: the client's
    :class:`~numpyro_fed.infer.zigzag.subsample.SubsampleState` holds the rest."""
    if settings.remainders:
        return partial(_propose_from_state, clients, settings)

    def propose(block, x, v, window, *rest):
        rest = list(rest)
        point = mean_grad = None
        if settings.use_cv:
            point, mean_grad = rest.pop(0), rest.pop(0)
        key, horizon, weight = rest.pop(0), rest.pop(0), rest.pop(0)
        constant = linear = None
        if settings.use_cv:
            constant = rest.pop(0)
            linear = rest.pop(0) if settings.second_order else None
        estimate = None
        if settings.subsample is not None:
            reference_grad = rest.pop(0)
            uniform = partial(
                gradient_estimate,
                clients.grad,
                settings.subsample,
                block=block,
                point=point,
                reference_grad=reference_grad,
            )
            estimate = lambda y, key, coordinate: uniform(y, key)  # noqa: E731
        bounds = None
        if settings.kind in ("gradient", "hessian"):
            row, prior = rest.pop(0), rest.pop(0)
            bounds = (row, prior)
        own = lambda y, u: jax.jvp(lambda z: clients.grad(z, block), (y,), (u,))  # noqa: E731
        return own_proposal(
            own,
            clients.prior_grad_and_slope,
            settings,
            x,
            v,
            window,
            key,
            horizon,
            weight,
            point,
            mean_grad,
            constant,
            linear,
            bounds,
            preconditioner,
            estimate,
        )

    return propose


def own_proposal(
    own,
    prior,
    settings,
    x,
    v,
    window,
    key,
    horizon,
    weight,
    point,
    mean_grad,
    constant,
    linear,
    bounds,
    preconditioner,
    own_estimate=None,
):
    """:func:`client_proposal` of a client (or the server's prior proposer) from a round's
    arguments: its shift from the reference (``constant`` and, second order, ``linear``), its
    bound's rows (``bounds``: a user's or the first-order subsampling's ``(row, prior)``)."""
    from numpyro_fed.infer.zigzag.bounds import GradientBound, HessianBound

    if bounds is not None:
        cls = GradientBound if settings.kind == "gradient" else HessianBound
        bounds = cls(bounds[0][None], bounds[1])
    return _settings_proposal(
        own,
        prior,
        settings,
        (x, v, window, key, horizon, weight),
        bounds=bounds,
        shift=_own_shift(point, mean_grad, constant, linear),
        preconditioner=preconditioner,
        own_estimate=own_estimate,
    )


def _settings_proposal(own, prior, settings, line, *, bounds, shift, preconditioner=None, own_estimate=None):
    """:func:`client_proposal` along ``line = (x, v, window, key, horizon, weight)`` with the
    round's :class:`ClientSettings` (kind, excess, grid, safety factor, counts)."""
    return client_proposal(
        own,
        prior,
        *line,
        kind=settings.kind,
        bounds=bounds,
        excess=settings.excess,
        grid_size=settings.grid_size,
        safety_factor=settings.safety_factor,
        shift=shift,
        preconditioner=preconditioner,
        counts=settings.counts,
        own_estimate=own_estimate,
    )


def _propose_from_state(
    clients, settings, block, state, x, v, window, point, mean_grad, key, horizon, weight, constant, *bound
):
    """A client's round with second-order subsampling (see :func:`client_function`): its
    estimate and its shift's linear part come from its state, computed once on its rows."""
    own = lambda y, u: jax.jvp(lambda z: clients.grad(z, block), (y,), (u,))  # noqa: E731
    estimate = partial(state_estimate, clients.grad, settings.subsample, block, state, point)
    proposal = remainder_proposal(
        own,
        clients.prior_grad_and_slope,
        settings,
        (x, v, window, key, horizon, weight),
        (point, mean_grad, constant, state.grad, state.hessian, state.mean_hessian, state.prior_hessian),
        bound,
        estimate,
    )
    return state, proposal


def remainder_proposal(own, prior, settings, line, reference, bound, estimate):
    """:func:`client_proposal` against the second-order subsampling's
    :class:`~numpyro_fed.infer.zigzag.bounds.SampledRowBound` (``bound``: its row, the
    prior's, the remainders' ``second`` and the horizon it holds over), with the proposer's
    own shift: ``constant + A (x - x*)``, ``A = H + w H_0 - mean_hessian``, laid out as a
    one-proposer :class:`~numpyro_fed.infer.zigzag.ControlVariates` whose mean gradient and
    Hessian are the proposers' shares (what the bound's Taylor part is made of) and whose own
    gradient and Hessian are this proposer's (the rounding of the terms that cancel)."""
    x, v, window, key, horizon, weight = line
    point, mean_grad, constant, grad, hessian, mean_hessian, prior_hessian = reference
    row, prior_row, second, bound_horizon = bound
    linear = hessian + weight * prior_hessian - mean_hessian
    # weight 0 in the shift: term_hessians - mean gives A; the sums over the one proposer give the means
    control = ControlVariates(point, grad[None], mean_grad - grad, (linear + mean_hessian)[None], -linear)
    shift = Shift(constant[None], control, jnp.zeros(1, x.dtype))
    bounds = SampledRowBound(row[None], prior_row, jnp.zeros((1,) + second.shape, x.dtype), second[None], bound_horizon)
    return _settings_proposal(own, prior, settings, line, bounds=bounds, shift=shift, own_estimate=estimate)
