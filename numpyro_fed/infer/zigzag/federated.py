"""Algorithm 2 as messages: each client proposes its own next switch, the server takes the
earliest.

In a round the server sends every client the current point ``(x, v)`` (and what stays fixed
during a run: its share of the prior, its control-variate shift, its grid horizon, a search
window); each client simulates, **on its own rows and with its own bound**, the first
switching time of its own rate ``lambda_m`` along the line ``x + t v`` (Poisson thinning
against its exact rate, all local) and sends back that time and the coordinate to flip
(Algorithm 2, step 3; exactly the message Theorem 5.1 is about). The server takes the
earliest (step 4), moves to it and flips that coordinate. One round per switch:

* a proposal that is not the earliest stays valid while the line does not change (the
  clients' processes are Poisson: given no switch before ``s``, the first one after ``s`` is
  the first one), so the end of a sample costs no round;
* a client that found no switch within the search window says how far it searched; when
  that is the earliest horizon, the server moves there and asks again (exact by the strong
  Markov property).

:func:`~numpyro_fed.infer.zigzag.federated_client.client_proposal` is the client's function (it
runs where the client's rows are: ``vmap``-ed in this process, or in a worker; the clients' side
is :mod:`~numpyro_fed.infer.zigzag.federated_client`); :func:`build_federated_kernel` the server's
core, ``kernel(rng_key, state, duration, reference) -> (state, info)``, which reaches the
clients only through ``federation.map`` and so runs unchanged on every backend.
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from numpyro_fed.federation.base import tree_nbytes
from numpyro_fed.infer.zigzag.control_variates import ControlVariates, shift_for
from numpyro_fed.infer.zigzag.federated_client import (
    ClientCounts,
    ClientSettings,
    Proposal,
    client_function,
    client_proposal,
    own_proposal,
    remainder_proposal,
)
from numpyro_fed.infer.zigzag.kernel import (
    accumulate,
    exponential,
    run_for,
    scaled_bounds,
    segment_integrals,
)
from numpyro_fed.infer.zigzag.state import SampleInfo, StepInfo, ZigZagState

__all__ = [
    "ClientCounts",
    "FederatedZigZagState",
    "Pending",
    "Proposal",
    "build_federated_kernel",
    "client_proposal",
    "federated_init",
]

#: the search window is this many times the recent mean time between switches, and each
#: client's grid horizon this many: a window without a switch anywhere has probability
#: about ``exp(-WINDOW_FACTOR)``
WINDOW_FACTOR = 8.0
HORIZON_FACTOR = 4.0


class Pending(NamedTuple):
    """The proposals of the current line, relative to the current point, ``(P,)`` each
    (a :class:`Proposal` per proposer), and whether they are still valid."""

    time: jax.Array
    coordinate: jax.Array
    valid: jax.Array


class FederatedZigZagState(NamedTuple):
    """The server's state in a federation.

    :ivar x: position ``(d,)``; :ivar v: velocity ``(d,)``.
    :ivar prior_weights: ``(P,)`` shares of the prior.
    :ivar scale: running mean of the time between switches: it sets the search window and
        the clients' grid horizons (only times the server received enter it).
    :ivar pending: the :class:`Pending` proposals.
    :ivar client_state: with second-order subsampling, the clients'
        :class:`~numpyro_fed.federation.ClientState` every round starts from (their rows'
        weights, gradient and Hessian at the reference; carried here, not closed over, so the
        compiled loop holds no copy of them as constants); else ``None``.
    """

    x: jax.Array
    v: jax.Array
    prior_weights: jax.Array
    scale: jax.Array
    pending: Pending
    client_state: Any = None


def federated_init(x, rng_key, prior_weights, *, scale: float = 0.1, v=None, client_state=None) -> FederatedZigZagState:
    """The server's state at ``x`` with a uniformly random velocity (unless ``v`` is given)
    and no proposal yet (``client_state``: see :class:`FederatedZigZagState`)."""
    x = jnp.asarray(x)
    if v is None:
        v = jnp.where(jax.random.bernoulli(rng_key, 0.5, x.shape), 1.0, -1.0)
    num = prior_weights.shape[0]
    pending = Pending(jnp.zeros(num, x.dtype), jnp.full(num, -1, jnp.int32), jnp.zeros((), bool))
    return FederatedZigZagState(
        x,
        jnp.asarray(v, x.dtype),
        jnp.asarray(prior_weights, x.dtype),
        jnp.asarray(scale, x.dtype),
        pending,
        client_state,
    )


class FederatedConfig(NamedTuple):
    """The settings of :func:`build_federated_kernel` (see there)."""

    federation: Any
    clients: Any
    settings: ClientSettings
    num_clients: int
    num: int
    bounds: Any
    redistribution_rate: float
    max_proposals: int
    full_covariance: bool
    skeleton_size: int
    preconditioner: Any
    sizes: dict | None


def _round(config: FederatedConfig, key, state: FederatedZigZagState, reference):
    """One round: every proposer's :class:`Proposal` (and counts) from the current point."""
    settings, m, num = config.settings, config.num_clients, config.num
    x, v, weights = state.x, state.v, state.prior_weights
    d, dtype = x.shape[0], x.dtype
    keys = jax.random.split(key, num)
    window = WINDOW_FACTOR * state.scale
    horizons = jnp.full(num, HORIZON_FACTOR * state.scale, dtype)
    broadcast = [x, v, window]
    own = [keys, horizons, weights]
    point = mean_grad = constant = linear = None
    if settings.use_cv:
        shift = shift_for(reference, weights, num, d, dtype)
        point = reference.point
        mean_grad = (reference.term_grads.sum(0) + reference.prior_grad) / num
        constant = shift.constant
        if settings.remainders and num > m:  # the Taylor part on the server's proposer (see _taylor_shares)
            shares = _taylor_shares(reference, num, m)[0]
            mean_grad = shares[0]  # the clients' share: zero
            constant = reference.term_grads + weights[:, None] * reference.prior_grad - shares
        broadcast += [point, mean_grad]
        own.append(constant)
        if settings.second_order and not settings.remainders:  # (with remainders: the clients hold it)
            mean_h = (reference.term_hessians.sum(0) + reference.prior_hessian) / num
            linear = reference.term_hessians + weights[:, None, None] * reference.prior_hessian - mean_h
            own.append(linear)
    if settings.subsample is not None and not settings.remainders:  # each client's own full gradient there
        own.append(reference.term_grads)
    if settings.kind in ("gradient", "hessian"):
        own += [config.bounds.clients, jnp.broadcast_to(config.bounds.prior, (num,) + config.bounds.prior.shape)]
    if settings.remainders:  # the remainders' bound, and the horizon it holds over
        own += [config.bounds.second, jnp.broadcast_to(config.bounds.horizon.astype(dtype), (num,))]
    client_own = [a[:m] for a in own]
    server = None
    if num > m and settings.remainders:
        # the server's proposer holds the Taylor part: its switch comes first, and no client needs
        # to search past it (the clients' processes are independent of it: the earliest switch
        # of all is the earliest of theirs before it, else its own)
        server = _server_proposal(config, x, v, window, point, mean_grad, reference, [a[m] for a in own])
        broadcast[2] = jnp.minimum(window, (server[0] if settings.counts else server).time)
    if settings.remainders:  # the clients' state stays as it is: every round starts from it
        _, replies = config.federation.map("propose", *broadcast, per_client=client_own, state=state.client_state)
    else:
        replies = config.federation.map("propose", *broadcast, per_client=client_own)
    if config.sizes is not None:  # per client and round, known from the shapes at trace time
        config.sizes.update(
            to_client=tree_nbytes(broadcast) + tree_nbytes([a[0] for a in client_own]),
            from_client=tree_nbytes(jax.tree.map(lambda a: a[0], replies)),
        )
    if num > m and server is None:  # the prior's own proposer, on the server: no rows, zero own term
        server = _server_proposal(config, x, v, window, point, mean_grad, reference, [a[m] for a in own])
    if server is not None:
        replies = jax.tree.map(lambda a, b: jnp.concatenate([a, b[None]]), replies, server)
    return replies


def _taylor_shares(reference, num: int, num_clients: int):
    """``(gradients (P, d), Hessians (P, d, d))``: each proposer's share of the potential's
    Taylor part at the reference point, ``grad U(x*)`` and ``hess U(x*)``, with second-order
    subsampling. With the server's own proposer (``P > M``) it takes all of it and the clients
    none: a client's shifted rate is then its remainder alone (a few checks per round, where
    an equal share would make every client search for its own first switch of the Gaussian
    approximation's rate, ``P`` times the checks of a superposition), and the server's is
    the Taylor part's exact, affine rate (no rows). Otherwise equal shares ``1 / P``."""
    total_grad = reference.term_grads.sum(0) + reference.prior_grad
    total_hessian = reference.term_hessians.sum(0) + reference.prior_hessian
    if num > num_clients:
        pick = (jnp.arange(num) == num_clients).astype(total_grad.dtype)
    else:
        pick = jnp.full(num, 1.0 / num, total_grad.dtype)
    return pick[:, None] * total_grad, pick[:, None, None] * total_hessian


def _server_proposal(config: FederatedConfig, x, v, window, point, mean_grad, reference, own_s):
    """The round of the prior's own proposer (on the server, no rows: a zero own term,
    estimated exactly), from its slice ``own_s`` of the round's own arguments."""
    settings = config.settings
    zero_term = lambda y, u: (jnp.zeros_like(y), jnp.zeros_like(y))  # noqa: E731
    key_s, horizon_s, weight_s = own_s[:3]
    rest = own_s[3:]
    constant_s = rest.pop(0) if settings.use_cv else None
    if settings.remainders:
        zeros = jnp.zeros_like(reference.prior_hessian)
        grad_shares, hessian_shares = _taylor_shares(reference, config.num, config.num_clients)
        return remainder_proposal(
            zero_term,
            config.clients.prior_grad_and_slope,
            settings,
            (x, v, window, key_s, horizon_s, weight_s),
            (point, grad_shares[-1], constant_s, jnp.zeros_like(x), zeros, hessian_shares[-1], reference.prior_hessian),
            tuple(rest),
            lambda y, key, coordinate: jnp.zeros_like(y),
        )
    linear_s = rest.pop(0) if settings.use_cv and settings.second_order else None
    estimate_s = None
    if settings.subsample is not None:  # no rows: a zero own term, estimated exactly
        rest.pop(0)
        estimate_s = lambda y, key, coordinate: jnp.zeros_like(y)  # noqa: E731
    bounds_s = (rest.pop(0), rest.pop(0)) if settings.kind in ("gradient", "hessian") else None
    return own_proposal(
        zero_term,
        config.clients.prior_grad_and_slope,
        settings,
        x,
        v,
        window,
        key_s,
        horizon_s,
        weight_s,
        point,
        mean_grad,
        constant_s,
        linear_s,
        bounds_s,
        config.preconditioner,
        estimate_s,
    )


def federated_step(config: FederatedConfig, rng_key, state: FederatedZigZagState, max_time, reference=None):
    """One step of the server: a round if the proposals are stale, then to the earliest
    switch, the end of the searched part of the line, a redistribution of the prior, or
    ``max_time``, whichever comes first.

    :return: ``(state, info, rounds, counts)``: a
        :class:`~numpyro_fed.infer.zigzag.StepInfo`, the rounds made (0 or 1) and the
        clients' :class:`ClientCounts` ``(P,)`` each (zeros without counts).
    """
    k_round, k_redistribute = jax.random.split(rng_key)
    num, dtype = config.num, state.x.dtype
    zeros = jnp.zeros(num, jnp.int32)

    def ask(state):
        replies = _round(config, k_round, state, reference)
        proposal, tally = replies if config.settings.counts else (replies, ClientCounts(zeros, zeros, zeros))
        pending = Pending(proposal.time.astype(dtype), proposal.coordinate, jnp.ones((), bool))
        return state._replace(pending=pending), jnp.ones((), jnp.int32), tally

    def keep(state):
        return state, jnp.zeros((), jnp.int32), ClientCounts(zeros, zeros, zeros)

    state, rounds, tally = lax.cond(state.pending.valid, keep, ask, state)
    pending = state.pending
    found = pending.coordinate >= 0
    limit = jnp.min(jnp.where(found, jnp.inf, pending.time))  # everyone searched this far
    event_times = jnp.where(found, pending.time, jnp.inf)
    winner = jnp.argmin(event_times)
    event = event_times[winner]
    stop = jnp.minimum(max_time, limit)
    if config.redistribution_rate > 0:
        k_clock, k_weights = jax.random.split(k_redistribute)
        tau_redistribute = exponential(k_clock, (), dtype) / config.redistribution_rate
    else:
        tau_redistribute = jnp.asarray(jnp.inf, dtype)
    switch = (event <= stop) & (event <= tau_redistribute)
    redistribute = ~switch & (tau_redistribute < stop)
    tau = jnp.where(switch, event, jnp.where(redistribute, tau_redistribute, stop))
    path, square = segment_integrals(state.x, state.v, tau, config.full_covariance)
    x = state.x + tau * state.v
    coordinate = jnp.maximum(pending.coordinate[winner], 0)
    v = jnp.where(switch, state.v.at[coordinate].multiply(-1.0), state.v)
    weights = state.prior_weights
    if config.redistribution_rate > 0:
        weights = jnp.where(redistribute, jax.random.dirichlet(k_weights, jnp.ones(num, dtype)), weights)
    exhausted = ~switch & ~redistribute & (stop >= limit)
    valid = ~switch & ~redistribute & ~exhausted
    moved = Pending(pending.time - tau, pending.coordinate, valid)
    # the running time between switches: only times the server received
    scale = jnp.where(
        switch,
        0.95 * state.scale + 0.05 * event,
        jnp.where(exhausted & (limit >= WINDOW_FACTOR * state.scale * 0.999), 2.0 * state.scale, state.scale),
    )
    one_hot = zeros.at[winner].set(1)
    info = StepInfo(
        elapsed=tau,
        proposed=switch,
        accepted=switch,
        violated=jnp.zeros((), bool),
        events_by_proposer=one_hot * switch,
        grad_evals_by_proposer=tally.grad_evals,
        path_integral=path,
        path_square_integral=square,
    )
    return FederatedZigZagState(x, v, weights, scale, moved, state.client_state), info, rounds, tally


def federated_advance(
    config: FederatedConfig,
    rng_key,
    state: FederatedZigZagState,
    duration,
    reference=None,
    *,
    default_reference=None,
    bound_scale=None,
):
    """Runs the server for ``duration`` of process time (at most ``config.max_proposals``
    rounds; the loop is the core's, :func:`~numpyro_fed.infer.zigzag.kernel.run_for`):
    ``(state, info)``, a :class:`~numpyro_fed.infer.zigzag.SampleInfo` whose
    ``num_proposals`` counts the clients' local proposals and ``rounds`` the rounds.
    ``bound_scale`` multiplies the clients' bound rows sent in each round (``None``: 1)."""
    reference = default_reference if reference is None else reference
    config = scaled_bounds(config, bound_scale)
    num, d, dtype = config.num, state.x.shape[0], state.x.dtype
    empty = SampleInfo.zeros(num, d, dtype, skeleton_size=config.skeleton_size, full_covariance=config.full_covariance)

    def one_step(key, state, remaining, total):
        state, info, made, tally = federated_step(config, key, state, remaining, reference)
        view = ZigZagState(state.x, state.v, state.scale, state.prior_weights, None)
        total = accumulate(total, view, info)
        total = total._replace(
            num_proposals=(total.num_proposals - info.proposed + tally.proposals.sum()).astype(jnp.int32),
            num_violations=(total.num_violations + tally.violations.sum()).astype(jnp.int32),
            rounds=total.rounds + made,
        )
        return state, total, info.elapsed

    return run_for(
        one_step, rng_key, state, duration, empty, within_budget=lambda total: total.rounds < config.max_proposals
    )


def build_federated_kernel(
    federation,
    clients,
    *,
    num_clients: int,
    prior_on_server: bool,
    reference: ControlVariates | None = None,
    excess_rate: float = 0.0,
    redistribution_rate: float = 0.0,
    bounds="grid",
    grid_size: int = 2,
    safety_factor: float = 1.0,
    max_proposals: int = 1_000_000,
    full_covariance: bool = False,
    skeleton_size: int = 0,
    preconditioner=None,
    counts: bool = True,
    second_order: bool = False,
    sizes: dict | None = None,
    subsample=None,
):
    """``(kernel, client_fn)``: the server's ``kernel(rng_key, state, duration, reference=None)
    -> (state, info)`` (a :class:`FederatedZigZagState` and a
    :class:`~numpyro_fed.infer.zigzag.SampleInfo`), reaching the clients only through
    ``federation.map("propose", ...)``, and the clients' function for that call.

    :param clients: the :class:`~numpyro_fed.infer.zigzag.ClientFunctions`.
    :param dict sizes: filled when the kernel is traced with the bytes of one round's message
        to a client (``"to_client"``) and of its reply (``"from_client"``).
    :param bool counts: clients add their :class:`ClientCounts` to each reply (diagnostics;
        off under a privacy guarantee).
    :param subsample: a :class:`~numpyro_fed.infer.zigzag.subsample.SubsampleLayout`: each
        client checks its proposals against an estimate from a batch of its rows (needs the
        ``reference`` and a :class:`~numpyro_fed.HessianBound` laid out per proposer as
        ``bounds``: the clients' ``n_m`` times their rows' curvature bound; with
        ``second_order``, a :class:`~numpyro_fed.infer.zigzag.bounds.SampledRowBound`). Other settings as in
        :func:`~numpyro_fed.infer.zigzag.build_kernel`; ``max_proposals`` bounds the rounds
        per call.
        With ``subsample`` and ``second_order`` every round is a stateful call from the
        clients' state the server's state carries (:class:`FederatedZigZagState`).
    """
    from numpyro_fed.infer.zigzag.bounds import bound_kind

    kind = bound_kind(bounds)
    settings = ClientSettings(
        kind,
        int(grid_size),
        float(safety_factor),
        float(excess_rate),
        bool(counts),
        bool(second_order),
        reference is not None,
        subsample,
        subsample is not None and bool(second_order),
    )
    config = FederatedConfig(
        federation=federation,
        clients=clients,
        settings=settings,
        num_clients=int(num_clients),
        num=int(num_clients) + bool(prior_on_server),
        bounds=None if isinstance(bounds, str) else bounds,
        redistribution_rate=float(redistribution_rate),
        max_proposals=int(max_proposals),
        full_covariance=bool(full_covariance),
        skeleton_size=int(skeleton_size),
        preconditioner=preconditioner,
        sizes=sizes,
    )
    return (
        partial(federated_advance, config, default_reference=reference),
        client_function(clients, settings, preconditioner),
    )
