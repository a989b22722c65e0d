"""The federated Zig-Zag process (Federated PDMC, Bierkens & Duncan 2022, Algorithm 2).

The target is ``exp(-U(x))`` with ``U = sum_j U_j`` over *proposers* ``j``: the clients
(each holding its own term of a :class:`~numpyro_fed.FederatedPotential`) and, by default,
the server holding the prior (Remark 3.2). From a state ``(x, v)``, ``v`` in ``{-1, +1}^d``,
every proposer draws its next switching time from its own rates

    lambda_{j,i}(t) = max(0, v_i (d_i U_j(x + t v) - c_{j,i})) + rho_j / d,

where ``c_j`` are control-variate shifts with ``sum_j c_j = 0`` (Remark 4.3) and ``rho_j`` is
the excess (refreshment) rate. The server takes the earliest proposal and the winner alone
checks it against its exact rate. After every proposal, accepted or not, all proposers
rebuild their bounds from the new point when the line changed (exact by the strong Markov
property).

The core in BlackJAX's shape: :func:`init` gives a :class:`ZigZagState`; :func:`step` (one
proposal, or the end of a line or of the time allowed) and :func:`advance` (a duration of
process time, one MCMC sample) are pure ``(rng_key, state, ...) -> (state, info)``; and
:func:`build_kernel` fixes the settings. Nothing here knows NumPyro:
:class:`~numpyro_fed.FedZigZag` is the face.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from numpyro_fed.infer.zigzag.bounds import SampledRowBound, bound_kind, current_line, empty_line
from numpyro_fed.infer.zigzag.control_variates import ControlVariates, Shift, shift_for, shift_of
from numpyro_fed.infer.zigzag.proposals import exponential, grid_proposals, line_proposals
from numpyro_fed.infer.zigzag.proposers import Proposers
from numpyro_fed.infer.zigzag.state import KernelConfig, SampleInfo, StepInfo, ZigZagState

__all__ = [
    "accumulate",
    "advance",
    "build_kernel",
    "exact_rate",
    "init",
    "kernel_config",
    "run_for",
    "segment_integrals",
    "step",
    "thinning_decision",
]


def init(x, rng_key, prior_weights, *, horizon: float = 1.0, v=None, bounds="grid", grid_size: int = 2) -> ZigZagState:
    """Initial state at ``x`` with a uniformly random velocity (unless ``v`` is given).

    :param prior_weights: ``(P,)`` initial shares of the prior (summing to one).
    :param bounds: and ``grid_size``: as given to :func:`build_kernel` (they fix the shape
        of the kept :class:`~numpyro_fed.infer.zigzag.state.LineBound`).

    >>> import jax, jax.numpy as jnp
    >>> state = init(jnp.zeros(3), jax.random.PRNGKey(0), jnp.array([0.5, 0.5]))
    >>> state.x.shape, bool(jnp.all(jnp.abs(state.v) == 1)), bool(state.line.valid)
    ((3,), True, False)
    """
    x = jnp.asarray(x)
    if v is None:
        v = jnp.where(jax.random.bernoulli(rng_key, 0.5, x.shape), 1.0, -1.0)
    prior_weights = jnp.asarray(prior_weights, x.dtype)
    return ZigZagState(
        x=x,
        v=jnp.asarray(v, x.dtype),
        horizon=jnp.asarray(horizon, x.dtype),
        prior_weights=prior_weights,
        line=empty_line(bound_kind(bounds), grid_size, prior_weights.shape[0], x.shape[0], x.dtype),
    )


def kernel_config(
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
    full_covariance: bool = False,
    skeleton_size: int = 0,
) -> KernelConfig:
    """The :class:`~numpyro_fed.infer.zigzag.KernelConfig` of :func:`build_kernel` (same
    arguments but ``reference``, which is only checked here)."""
    kind = bound_kind(bounds)
    if isinstance(bounds, SampledRowBound):
        if reference is not None and reference.second_order != (bounds.second is not None):
            raise ValueError(
                "a SampledRowBound with second-order remainders needs second-order control "
                "variates, and first-order control variates one without"
            )
    elif reference is not None and reference.second_order and kind in ("gradient", "hessian"):
        raise ValueError(
            "second-order control variates need the automatic bounds ('grid' or 'affine'): "
            f"a {type(bounds).__name__} does not bound the linear part of their shift"
        )
    excess = jnp.zeros(proposers.num) if excess_rates is None else jnp.asarray(excess_rates)
    return KernelConfig(
        proposers=proposers,
        kind=kind,
        bounds=None if isinstance(bounds, str) else bounds,
        excess=excess,
        redistribution_rate=float(redistribution_rate),
        grid_size=int(grid_size),
        safety_factor=float(safety_factor),
        max_proposals=int(max_proposals),
        batched=bool(batched),
        full_covariance=bool(full_covariance),
        skeleton_size=int(skeleton_size),
    )


def build_kernel(proposers: Proposers, *, reference: ControlVariates | None = None, **settings):
    """Builds ``kernel(rng_key, state, duration, reference=None) -> (state, info)``: the
    process run for ``duration`` (:func:`advance`, a :class:`~numpyro_fed.infer.zigzag.SampleInfo`).

    :param proposers: the proposers' gradient functions.
    :param reference: :class:`~numpyro_fed.infer.zigzag.ControlVariates` at the reference
        point ``x*`` (``None``: no control variates); a ``reference`` given to the kernel
        replaces it (same structure: the warmup re-centers it).
    :param settings: the kernel's settings, by keyword (the fields of
        :class:`~numpyro_fed.infer.zigzag.KernelConfig`):

        * ``excess_rates``: ``(P,)`` excess (refreshment) rate of each proposer, split evenly
          over coordinates.
        * ``redistribution_rate``: rate of the Poisson clock that redraws the prior's
          shares ``w ~ Dirichlet(1, ..., 1)`` (Appendix D, Algorithm 4); 0: fixed shares.
        * ``bounds``: ``"grid"``: the automatic grid bound; ``"affine"``: exact inversion
          of ``max(0, a + b t)`` from the rate and its slope at the start of each line, exact
          when the potential is quadratic (Gaussian targets), elsewhere checked and counted;
          a :class:`~numpyro_fed.GradientBound` or :class:`~numpyro_fed.HessianBound` with one
          row per *proposer* (see :func:`~numpyro_fed.infer.zigzag.per_proposer_bound`).
        * ``grid_size``: ``K`` grid points per horizon for the automatic bound.
        * ``safety_factor``: bounds are multiplied by this (>= 1).
        * ``max_proposals``: proposals allowed per call (guards against a rate that
          explodes); reaching it sets ``hit_event_cap``.
        * ``batched``: the kernel will run under ``vmap`` (vectorized chains): the grid is
          then evaluated at all its points in one batch. The counts of gradient evaluations are
          the same either way (they count what the algorithm needs).
        * ``full_covariance``: integrate ``x x^T`` in full (else its diagonal).
        * ``skeleton_size``: switches recorded per call (0: none).

    **Example**: a standard normal target held by two clients.

    >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> import numpyro_fed as nf
    >>> from numpyro_fed.infer import zigzag
    >>> def model(y):
    ...     mu = numpyro.sample("mu", dist.Normal(0, 1))
    ...     with nf.federated_plate("data", 4, clients=2):
    ...         numpyro.sample("y", dist.Normal(mu, 1), obs=y)
    >>> proposers, weights = zigzag.proposers_from_potential(nf.split_potential(model, (jnp.zeros(4),)))
    >>> kernel = jax.jit(zigzag.build_kernel(proposers))
    >>> state = zigzag.init(jnp.zeros(1), jax.random.PRNGKey(0), weights)
    >>> state, info = kernel(jax.random.PRNGKey(1), state, 10.0)
    >>> round(float(info.elapsed), 3), int(info.num_events) > 0, int(info.num_violations)
    (10.0, True, 0)
    """
    return partial(advance, kernel_config(proposers, reference=reference, **settings), default_reference=reference)


def segment_integrals(a, v, tau, full_covariance: bool):
    """``(int x, int x x^T)`` over the straight segment from ``a`` along ``v`` for ``tau``:
    ``tau (a + b) / 2`` and ``tau (a a^T + b b^T) / 3 + tau (a b^T + b a^T) / 6`` (only its
    diagonal unless ``full_covariance``), with ``b = a + tau v``.

    >>> import jax.numpy as jnp
    >>> path, square = segment_integrals(jnp.zeros(1), jnp.ones(1), 2.0, False)
    >>> float(path[0]), round(float(square[0]), 4)  # int_0^2 t dt, int_0^2 t^2 dt
    (2.0, 2.6667)
    """
    b = a + tau * v
    if full_covariance:
        square = tau * ((jnp.outer(a, a) + jnp.outer(b, b)) / 3 + (jnp.outer(a, b) + jnp.outer(b, a)) / 6)
    else:
        square = tau * (a * a + b * b + a * b) / 3
    return tau * (a + b) / 2, square


def exact_rate(config: KernelConfig, state: ZigZagState, x, proposer, coordinate, shift: Shift, key=None):
    """Client side of the check: proposer ``proposer``'s exact rate of ``coordinate`` at ``x``
    (only the winner evaluates its gradient; the server adds its prior share). With
    subsampling (``proposers.term_grad_estimate``) the rate of an unbiased estimate of its
    gradient from a batch of its rows drawn with ``key``."""
    proposers = config.proposers
    prior_grad = proposers.prior_grad_and_slope(x, state.v)[0]
    if proposers.term_grad_estimate is not None:
        own = proposers.term_grad_estimate(x, proposer, key, shift.reference, coordinate)
    else:
        own = proposers.term_grad_of(x, proposer)
    grad = own + state.prior_weights[proposer] * prior_grad
    rate = jnp.maximum(state.v[coordinate] * (grad[coordinate] - shift_of(shift, proposer, coordinate, x)), 0.0)
    if config.kind == "grid":  # line bounds give the excess its own clock
        rate = rate + config.excess.astype(x.dtype)[proposer] / x.shape[0]
    return rate


def thinning_decision(rate, bound, certain, uniform):
    """Server side of the check: ``(accept, violated)``. A refreshment (``certain``) is
    accepted; otherwise the proposal is accepted with probability ``rate / bound``, and a
    rate above its bound (beyond rounding: 1e-6 relative, or 64 ulps where the dtype is
    coarser) is a violation.

    >>> import jax.numpy as jnp
    >>> accept, violated = thinning_decision(jnp.array(1.0), jnp.array(2.0), jnp.array(False), jnp.array(0.4))
    >>> bool(accept), bool(violated)  # 0.4 * 2 < 1
    (True, False)
    >>> bool(thinning_decision(jnp.array(3.0), jnp.array(2.0), jnp.array(False), jnp.array(0.9))[1])
    True
    """
    slack = max(1e-6, 64 * float(jnp.finfo(jnp.result_type(rate)).eps))
    violated = ~certain & (rate > bound * (1 + slack) + 1e-12)
    return certain | (uniform * bound < rate), violated


def _moved(state: ZigZagState, tau, full_covariance: bool, num: int):
    """``(x + tau v, StepInfo)`` of a straight move with nothing else happening."""
    path, square = segment_integrals(state.x, state.v, tau, full_covariance)
    zeros = jnp.zeros(num, jnp.int32)
    no = jnp.zeros((), bool)
    return state.x + tau * state.v, StepInfo(
        elapsed=tau,
        proposed=no,
        accepted=no,
        violated=no,
        events_by_proposer=zeros,
        grad_evals_by_proposer=zeros,
        path_integral=path,
        path_square_integral=square,
    )


def step(
    config: KernelConfig,
    rng_key,
    state: ZigZagState,
    max_time,
    reference: ControlVariates | None = None,
    *,
    shift: Shift | None = None,
) -> tuple[ZigZagState, StepInfo]:
    """One step of the process, at most ``max_time`` long: to the earliest proposal (checked
    by its proposer, decided by the server), the end of the current line's bound, a
    redistribution of the prior, or ``max_time``, whichever comes first.

    :param shift: the proposers' :class:`~numpyro_fed.infer.zigzag.control_variates.Shift`
        as given (a client's own row, in a federation), instead of the one ``reference``
        gives.
    :return: ``(state, info)``, a :class:`~numpyro_fed.infer.zigzag.StepInfo`.
    """
    k_clock, k_coordinate, k_coordinate_clocks, k_accept, k_redistribute = jax.random.split(rng_key, 5)
    num, d, dtype = config.proposers.num, state.x.shape[0], state.x.dtype
    if shift is None:
        shift = shift_for(reference, state.prior_weights, num, d, dtype)
    line, evaluations = current_line(config, state, shift)
    evaluations = jnp.full(num, evaluations, jnp.int32)
    if config.kind == "grid":
        proposals = grid_proposals(line, k_clock, k_coordinate)
        line_left = line.times[-1] - line.position
    else:
        excess = config.excess.astype(dtype) / d
        proposals = line_proposals(line, excess, k_clock, k_coordinate, k_coordinate_clocks)
        line_left = jnp.asarray(jnp.inf, dtype)
        if getattr(config.bounds, "horizon", None) is not None:  # a bound that holds up to a horizon
            line_left = config.bounds.horizon.astype(dtype) - line.position
    winner = jnp.argmin(proposals.tau)
    tau_win = proposals.tau[winner]
    stop = jnp.minimum(line_left, max_time)

    def no_event():
        x, info = _moved(state, stop, config.full_covariance, num)
        at_horizon = line_left <= max_time
        # at the horizon the grid's last point is where the next bound starts
        kept = line._replace(valid=~at_horizon, reuse=at_horizon, position=line.position + stop)
        horizon = jnp.where(at_horizon, state.horizon * 1.01, state.horizon)
        return state._replace(x=x, line=kept, horizon=horizon), info

    def proposal():
        coordinate = proposals.coordinate[winner]
        x, info = _moved(state, tau_win, config.full_covariance, num)
        # subsampling draws its batch from a key of its own (the other draws stay as they were)
        k_batch = jax.random.fold_in(k_accept, 1) if config.proposers.term_grad_estimate is not None else None
        rate = exact_rate(config, state, x, winner, coordinate, shift, k_batch)
        accept, violated = thinning_decision(
            rate, proposals.bound[winner], proposals.certain[winner], jax.random.uniform(k_accept, (), dtype)
        )
        v = jnp.where(accept, state.v.at[coordinate].multiply(-1.0), state.v)
        horizon = jnp.where(violated, state.horizon / 2, jnp.where(accept, state.horizon, state.horizon / 1.04))
        # a rejection leaves the line, hence its bound, as it was; with subsampling the bound
        # costs no gradient and is tighter from the new point: it is rebuilt there
        keep = ~(accept | violated)
        if config.proposers.term_grad_estimate is not None:
            keep = jnp.zeros((), bool)
        kept = line._replace(valid=keep, reuse=jnp.zeros((), bool), position=line.position + tau_win)
        one_hot = jnp.zeros(num, jnp.int32).at[winner].set(1)
        info = info._replace(
            proposed=jnp.ones((), bool),
            accepted=accept,
            violated=violated,
            events_by_proposer=one_hot * accept,
            grad_evals_by_proposer=one_hot,
        )
        return state._replace(x=x, v=v, horizon=horizon, line=kept), info

    branches = [no_event, proposal]
    index = jnp.where(tau_win < stop, 1, 0)
    if config.redistribution_rate > 0:
        k_redistribution_clock, k_weights = jax.random.split(k_redistribute)
        tau_redistribute = exponential(k_redistribution_clock, (), dtype) / config.redistribution_rate

        def redistribute():
            x, info = _moved(state, tau_redistribute, config.full_covariance, num)
            weights = jax.random.dirichlet(k_weights, jnp.ones(num, dtype))
            invalid = line._replace(valid=jnp.zeros((), bool), reuse=jnp.zeros((), bool))
            return state._replace(x=x, prior_weights=weights, line=invalid), info

        branches.append(redistribute)
        index = jnp.where(tau_redistribute < jnp.minimum(tau_win, stop), 2, index)
    new, info = lax.switch(index, branches)
    return new, info._replace(grad_evals_by_proposer=info.grad_evals_by_proposer + evaluations)


def accumulate(total: SampleInfo, state: ZigZagState, info: StepInfo) -> SampleInfo:
    """``total`` with one more step's ``info`` added; an accepted switch is recorded in the
    skeleton (at the step's end: ``state`` after the step), beyond its capacity dropped."""
    elapsed = total.elapsed + info.elapsed
    total = total._replace(
        num_events=total.num_events + info.accepted,
        num_proposals=total.num_proposals + info.proposed,
        num_violations=total.num_violations + info.violated,
        events_by_proposer=total.events_by_proposer + info.events_by_proposer,
        grad_evals_by_proposer=total.grad_evals_by_proposer + info.grad_evals_by_proposer,
        elapsed=elapsed,
        path_integral=total.path_integral + info.path_integral,
        path_square_integral=total.path_square_integral + info.path_square_integral,
    )
    capacity = total.skeleton_times.shape[0]
    if not capacity:
        return total
    slot = jnp.where(info.accepted, total.skeleton_count, capacity)
    return total._replace(
        skeleton_times=total.skeleton_times.at[slot].set(elapsed, mode="drop"),
        skeleton_x=total.skeleton_x.at[slot].set(state.x, mode="drop"),
        skeleton_v=total.skeleton_v.at[slot].set(state.v, mode="drop"),
        skeleton_count=total.skeleton_count + info.accepted,
    )


def scaled_bounds(config, bound_scale):
    """``config`` with its user/row bound multiplied by ``bound_scale`` (``None``: as it is):
    the subsampling warmup grows the bound after a violation."""
    if bound_scale is None or config.bounds is None:
        return config
    bounds = config.bounds
    return config._replace(
        bounds=bounds._replace(
            **{
                name: getattr(bounds, name) * bound_scale
                for name in bounds._fields
                if name != "horizon" and getattr(bounds, name) is not None
            }
        )
    )


def run_for(one_step, rng_key, state, duration, total: SampleInfo, *, within_budget):
    """The loop of every core: steps, each with its own key, until ``duration`` of process
    time has passed or the budget is spent; ``hit_event_cap`` says the latter.

    :param one_step: ``(rng_key, state, remaining, total) -> (state, total, elapsed)``: one
        step at most ``remaining`` long, its info accumulated into ``total``.
    :param total: the empty :class:`~numpyro_fed.infer.zigzag.SampleInfo` the steps add to.
    :param within_budget: ``total -> bool``: another step is allowed (e.g. proposals below
        ``max_proposals``).
    :return: ``(state, total)``.
    """

    def not_done(carry):
        _, _, total, remaining = carry
        return (remaining > 0) & within_budget(total)

    def body(carry):
        key, state, total, remaining = carry
        key, k_step = jax.random.split(key)
        state, total, elapsed = one_step(k_step, state, remaining, total)
        return key, state, total, remaining - elapsed

    _, state, total, remaining = lax.while_loop(
        not_done, body, (rng_key, state, total, jnp.asarray(duration, state.x.dtype))
    )
    return state, total._replace(hit_event_cap=remaining > 0)


def advance(
    config: KernelConfig,
    rng_key,
    state: ZigZagState,
    duration,
    reference: ControlVariates | None = None,
    *,
    default_reference: ControlVariates | None = None,
    bound_scale=None,
) -> tuple[ZigZagState, SampleInfo]:
    """Runs the process for ``duration`` (at most ``config.max_proposals`` proposals): one
    :func:`step` after another, each with its own key, their infos accumulated
    (:func:`run_for`).

    :param bound_scale: multiplies a user's or the subsampling's bound (``None``: 1).
    :return: ``(state, info)``, a :class:`~numpyro_fed.infer.zigzag.SampleInfo`.
    """
    reference = default_reference if reference is None else reference
    config = scaled_bounds(config, bound_scale)
    num, d, dtype = config.proposers.num, state.x.shape[0], state.x.dtype
    empty = SampleInfo.zeros(num, d, dtype, skeleton_size=config.skeleton_size, full_covariance=config.full_covariance)

    def one_step(key, state, remaining, total):
        state, info = step(config, key, state, remaining, reference)
        return state, accumulate(total, state, info), info.elapsed

    return run_for(
        one_step,
        rng_key,
        state,
        duration,
        empty,
        within_budget=lambda total: total.num_proposals < config.max_proposals,
    )
