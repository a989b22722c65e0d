"""Partitioned variational inference (PVI, Ashman et al. 2022): the server side and the round.

The approximation is a Gaussian over the flat unconstrained latent vector (mean-field or
full-rank: the shape of ``eta2``),

    q(theta) = p(theta) [t_0(theta)] prod_m t_m(theta),

held as natural parameters ``eta = (precision * mean, -precision / 2)``: those of the prior's
exact Gaussian part, of the server's prior factor ``t_0`` when the prior is not a proper
Gaussian (:mod:`~numpyro_fed.infer.pvi.prior`; refined by the server at the start of each
round) and of one factor ``t_m`` per client, so that ``eta_q = eta_prior [+ eta_0] + sum_m
eta_m``. Each client runs :func:`~numpyro_fed.infer.pvi.client.client_update`
on its own rows and what the server sends (``q``) and returns the change ``Delta`` of its
factor; the server (:func:`server_update`) adds ``damping * Delta`` to ``q``, and the client
to its factor, which it keeps (its client state, :class:`ClientFactor`; with
``dp="virtual"`` its virtual factors, which the server never sees). Where that would leave a
coordinate of ``q`` with a non-positive precision, the coordinate keeps its previous value
in ``q`` and in the factor (counted in ``PVIInfo.rejected``): the server tells the client
which coordinates of its update it applied with its next request (``applied``), and the
client adds its update there first. This only post-processes released values.

With a trusted aggregator (synchronous schedule), each client's noise standard deviation is
divided by ``sqrt(M)``: the sum the aggregator releases carries the full noise (Theorems 11,
14 of Heikkilä et al. 2023).

Schedules: ``"sequential"`` (clients in turn, the server updating after each:
``federation.one``) and ``"synchronous"`` (all clients from the same ``q``:
``federation.map``). One *round* visits every client once (:func:`build_step`) or, for
:class:`~numpyro_fed.GaussianPVI`, the one client it schedules (:func:`build_client_step`);
both are written with the same visit (:func:`build_visit`). The core in BlackJAX's shape:
:func:`init`, the clients' functions (:func:`client_functions`, run on each client's own
block by a :class:`~numpyro_fed.federation.Federation`) and the server's pure
``step(rng_key, state, federation) -> (state, info)`` (:func:`build_step`; ``federation`` a
started federation running :func:`client_functions`, :class:`~numpyro_fed.InProcess` in one
process); :class:`~numpyro_fed.DPPVI`, :class:`~numpyro_fed.GaussianPVI` and the baselines
are faces.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from numpyro_fed.federation import ClientState
from numpyro_fed.federation.base import resolve_min_clients
from numpyro_fed.infer.pvi.client import LocalConfig, client_update
from numpyro_fed.infer.pvi.gaussian import (
    GaussianNatural,
    proper,
    tree_add,
)
from numpyro_fed.infer.pvi.layout import BlockLayout, ClientData, shard_layout
from numpyro_fed.infer.pvi.loss import (
    LOSS_STREAM,
    build_loss,
    draw_q,
    expected_log_lik,
    federated_negative_elbo,
    loss_of_client_terms,
    negative_elbo,
)

__all__ = [
    "BlockLayout",
    "ClientData",
    "ClientFactor",
    "PVIInfo",
    "PVIState",
    "ClientReply",
    "accepts",
    "build_client_step",
    "build_loss",
    "build_step",
    "build_visit",
    "check_dropout",
    "client_factors",
    "client_functions",
    "expected_log_lik",
    "federated_negative_elbo",
    "init",
    "negative_elbo",
    "resolve_factor",
    "server_update",
    "shard_layout",
]

#: ``build_step``'s schedules of the clients' visits within a round.
SCHEDULES = ("sequential", "synchronous")
#: draws of q a client evaluates at once in the importance check ("log_lik_draws")
DRAW_BATCH = 16


class ClientFactor(NamedTuple):
    """What a PVI client keeps between its visits (its client state).

    :ivar GaussianNatural factor: its factor ``t_m`` (``(d,)`` each) or, with
        ``dp="virtual"``, its virtual factors ``t_{m,k}`` (``(K, d)`` each), as of before its
        last update.
    :ivar GaussianNatural pending: ``damping`` times the change its last update made to
        them (zeros before its first), added where the server applied that update (it says
        where in the client's next request).
    """

    factor: GaussianNatural
    pending: GaussianNatural


class PVIState(NamedTuple):
    """The server's natural parameters and the clients' state.

    :ivar GaussianNatural q: the global approximation, ``(d,)`` each.
    :ivar GaussianNatural prior: the prior, ``(d,)``.
    :ivar GaussianNatural factors: the server's record of each client's factor ``t_m``,
        ``(M, d)``: its initial (public) value plus the changes the client sent, where
        applied (what crossed the wire; never sent back).
    :ivar clients: a :class:`~numpyro_fed.federation.ClientState` of every client's
        :class:`ClientFactor` (stacked in ``values`` in process; on its worker with an engine
        backend); :func:`client_factors` reads it in process.
    :ivar applied: ``(M, d)`` bool, the coordinates of each client's last update that the
        server applied (sent with the client's next request).
    :ivar round: rounds run so far (an int array).
    :ivar prior_factor: the prior factor ``t_0`` the server refines
        (:mod:`~numpyro_fed.infer.pvi.prior`; ``q = prior x t_0 x prod_m t_m``), or ``None``
        when ``prior`` is the whole prior (a proper Gaussian).
    :ivar absent: ``(M,)`` bool, the clients whose last visit failed (a run with
        ``min_clients``, see :func:`build_step`): their factors are as before that visit.
    """

    q: GaussianNatural
    prior: GaussianNatural
    factors: GaussianNatural
    clients: ClientState
    applied: jax.Array
    round: jax.Array = 0
    prior_factor: GaussianNatural | None = None
    absent: jax.Array | None = None


class PVIInfo(NamedTuple):
    """Diagnostics of one round.

    :ivar rejected: ``(M,)`` (sequential: per client update) or ``()`` (synchronous):
        coordinates of an update not applied because they would make ``q`` improper.
    :ivar clipped: ``(M,)`` fraction of clipped terms (per-example gradients or shard
        changes) in each client's update; zero without clipping.
    :ivar residual: ``(M,)`` each client's local-optimization residual (see
        :func:`~numpyro_fed.infer.pvi.client.optimize_local`; the largest over its shards).
    :ivar loss: the negative ELBO (:func:`negative_elbo`; ``nan`` when a client did not
        answer its call) of ``q`` after the round (:func:`build_client_step`) or, for
        :func:`build_step`, of ``q`` as the round starts (before the prior's refinement), each
        client's term computed in its update call (one message per client per round; the
        face reports the loss after each round, see :class:`~numpyro_fed.DPPVI`).
    :ivar prior_residual: the residual of the server's refinement of the prior factor this
        round (``None`` without one).
    :ivar participated: ``(M,)`` bool, the clients whose update the round applied (every
        client visited answered, unless a run with ``min_clients`` went on without some).
    """

    rejected: jax.Array
    clipped: jax.Array
    residual: jax.Array
    loss: jax.Array
    prior_residual: jax.Array | None = None
    participated: jax.Array | None = None


def _initial_client_state(
    prior: GaussianNatural, num_clients: int, num_virtual: int | None = None, factors: GaussianNatural | None = None
) -> ClientFactor:
    """Every client's initial :class:`ClientFactor`, stacked: its factor ``factors[m]``
    (default zero; public values) or, with ``num_virtual`` (``dp="virtual"``), that many
    virtual factors at zero; nothing pending."""
    lead = (num_clients,) if num_virtual is None else (num_clients, num_virtual)
    zeros = jax.tree_util.tree_map(lambda x: jnp.zeros(lead + x.shape, x.dtype), prior)
    if factors is not None and num_virtual is None:
        return ClientFactor(factors, zeros)
    return ClientFactor(zeros, zeros)


def init(
    prior: GaussianNatural,
    num_clients: int,
    num_virtual: int | None = None,
    *,
    factors: GaussianNatural | None = None,
    federation=None,
    q: GaussianNatural | None = None,
    prior_factor: GaussianNatural | None = None,
) -> PVIState:
    """``q`` is ``q`` (default the prior); the factors are ``factors`` (default zero) and,
    with ``num_virtual`` (``dp="virtual"``), each client's virtual factors are zero; the
    server's prior factor is ``prior_factor`` (``None``: the prior is exact). With a started
    ``federation`` the clients receive their initial :class:`ClientFactor` through its
    ``init_state`` and keep it; otherwise it is kept in this process.

    >>> import jax.numpy as jnp
    >>> from numpyro_fed.infer.pvi.gaussian import GaussianNatural
    >>> state = init(GaussianNatural(jnp.zeros(2), -0.5 * jnp.ones(2)), 3, num_virtual=4)
    >>> state.factors.eta1.shape, state.clients.values.factor.eta1.shape
    ((3, 2), (3, 4, 2))
    """
    d = prior.eta1.shape[-1]
    if factors is None:
        factors = jax.tree_util.tree_map(lambda x: jnp.zeros((num_clients,) + x.shape, x.dtype), prior)
    own = _initial_client_state(prior, num_clients, num_virtual, factors)
    clients = ClientState(own, jnp.zeros(num_clients, jnp.int32)) if federation is None else federation.init_state(own)
    return PVIState(
        q=prior if q is None else q,
        prior=prior,
        factors=factors,
        clients=clients,
        applied=jnp.zeros((num_clients, d), bool),
        round=jnp.zeros((), jnp.int32),
        prior_factor=prior_factor,
        absent=jnp.zeros(num_clients, bool),
    )


def resolve_factor(own: ClientFactor, applied) -> GaussianNatural:
    """A client's factor (or virtual factors) with its last update added where the server
    applied it (``applied``, what the server sends with its next request)."""
    return jax.tree_util.tree_map(lambda t, p: jnp.where(applied, t + p, t), own.factor, own.pending)


def client_factors(state: PVIState) -> GaussianNatural:
    """Every client's current factor (``(M, d)`` each) or, with ``dp="virtual"``, virtual
    factors (``(M, K, d)``), from a state whose client state is kept in this process
    (:class:`~numpyro_fed.federation.InProcess`; with an engine backend they are on the
    workers and a ``ValueError`` says so). A diagnostic: the server never reads them."""
    if not jax.tree_util.tree_leaves(state.clients.values):
        raise ValueError(
            "the clients' factors are held by the clients (an engine backend's workers): this state has no copy of them"
        )
    return jax.vmap(resolve_factor)(state.clients.values, state.applied)


def server_update(state: PVIState, new_q, new_factors, accept=True):
    """Applies a proposed ``q`` and the server's record of the factors, coordinate by
    coordinate: where the new ``q`` would not be a proper Gaussian (or not finite), the
    coordinate keeps its old values (one coordinate's noise must not discard a whole update).
    ``accept`` false (a scalar) keeps every coordinate (:func:`accepts`).

    :return: ``(state, ok)``: ``ok`` (``(d,)`` bool) the coordinates applied (the clients
        whose update it was learn it with their next request).
    """
    ok = proper(new_q) & accept
    pick = lambda new, old: jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), new, old)
    return state._replace(q=pick(new_q, state.q), factors=pick(new_factors, state.factors)), ok


class ClientReply(NamedTuple):
    """What a client returns in a round (:func:`client_functions`' ``"update"``).

    :ivar GaussianNatural delta: the change of its factor, ``(d,)`` each: the paper's message
        (noised on the client when private).
    :ivar clipped: the fraction of clipped terms (a diagnostic).
    :ivar residual: the local optimization's residual (a diagnostic).
    :ivar log_lik: its term of the loss at the draws of ``q`` sent with the call
        (:func:`~numpyro_fed.infer.pvi.loss.expected_log_lik`, before its update; a
        diagnostic), or ``None`` when none were sent.
    """

    delta: GaussianNatural
    clipped: jax.Array
    residual: jax.Array
    log_lik: jax.Array | None = None


def client_functions(
    row_log_lik: Callable,
    config: LocalConfig,
    *,
    dp: str | None = None,
    trusted_aggregator: bool = False,
    num_clients: int = 1,
    batch_cap: int | None = None,
    auto_clip: bool = False,
    damping: float = 1.0,
    loss_draws: bool = False,
) -> tuple[dict, dict]:
    """The functions a PVI client runs on its own :class:`ClientData` block (one client's
    slice), as a :class:`~numpyro_fed.federation.ClientProgram` takes them: ``(functions,
    stateful)``.

    * ``stateful["update"]``: ``(block, own, q, [thetas,] [first,] key, applied) -> (own',
      ClientReply)`` where ``own`` is the client's :class:`ClientFactor` (its client state),
      ``q`` the global approximation the server sends, ``thetas`` (with ``loss_draws`` only,
      ``(S, d)``) draws of ``q`` for the loss, ``first`` (with ``auto_clip`` only) whether
      this is the state's first round, ``key`` the client's key of the round and ``applied``
      (``(d,)`` bool) the coordinates of its last update that the server applied. The client
      adds that update to its factor there, computes its new change from the cavity ``q /
      t_m`` (the DP noise and clipping happen here, on the client), keeps ``damping`` times it
      as pending and replies with the change (and, with ``loss_draws``, its term of the loss
      at ``thetas``: the loss then costs no message of its own).
    * ``functions["expected_log_lik"]``: ``(block, thetas (S, d)) -> ()``, the sum over the
      client's rows of the Monte Carlo estimate of ``E_q[log p(x | theta)]`` at the draws
      ``thetas``: the diagnostic behind :func:`negative_elbo` (not one of the algorithm's
      messages).
    * ``functions["curvature"]``: ``(block, thetas (S, d)) -> (d, d)``, minus the Hessian of
      the client's log-likelihood averaged over the draws: the mean-field check's.
    * ``functions["log_lik_draws"]``: ``(block, thetas (S, d)) -> (S,)``, the client's
      log-likelihood at each draw: its term of the importance check's ratios ``p / q``
      (:func:`~numpyro_fed.infer.pvi.diagnostics.importance_check`).
    """
    noise_divisor = float(np.sqrt(num_clients)) if trusted_aggregator else 1.0

    def update(block, own: ClientFactor, q, *args):
        thetas, args = (args[0], args[1:]) if loss_draws else (None, args)
        if auto_clip:
            first, key, applied = args
            clip_norm = jnp.where(first, block.clip_first, block.clip_later)
        else:
            (key, applied), clip_norm = args, None
        log_lik = None if thetas is None else expected_log_lik(row_log_lik, thetas, block.rows, block.valid)
        factor = resolve_factor(own, applied)
        if dp == "virtual":
            factor_arg, virtual_arg = None, factor
        else:
            factor_arg = factor
            virtual_arg = GaussianNatural(
                jnp.zeros((1,) + factor.eta1.shape, factor.eta1.dtype),
                jnp.zeros((1,) + factor.eta2.shape, factor.eta2.dtype),
            )
        delta, virtual_delta, clipped, residual = client_update(
            key,
            row_log_lik,
            q,
            factor_arg,
            virtual_arg,
            block.rows,
            block.valid,
            block.shard_index,
            block.shard_valid,
            config,
            dp=dp,
            noise_multiplier=block.noise_multiplier,
            noise_divisor=noise_divisor,
            batch_cap=batch_cap,
            with_residual=True,
            clip_norm=clip_norm,
        )
        change = virtual_delta if dp == "virtual" else delta
        pending = jax.tree_util.tree_map(lambda d: damping * d, change)
        return ClientFactor(factor, pending), ClientReply(delta, clipped, residual, log_lik)

    def client_expected_log_lik(block, thetas):
        return expected_log_lik(row_log_lik, thetas, block.rows, block.valid)

    def client_log_lik(block):
        # the client's log-likelihood, a function of theta: the sum over its valid rows
        return lambda theta: jnp.sum(jnp.where(block.valid, row_log_lik(theta, block.rows), 0.0))

    def curvature(block, thetas):
        # minus the Hessian of the client's log-likelihood, averaged over the draws thetas
        return -jnp.mean(jax.vmap(jax.hessian(client_log_lik(block)))(thetas), axis=0)

    def log_lik_draws(block, thetas):
        # the client's log-likelihood at each draw (S,): its term of the importance ratios; in
        # batches of draws, so that the (draws, rows) values held at once stay small
        return lax.map(client_log_lik(block), thetas, batch_size=DRAW_BATCH)

    functions = {
        "expected_log_lik": client_expected_log_lik,
        "curvature": curvature,
        "log_lik_draws": log_lik_draws,
    }
    return functions, {"update": update}


def _skip_absent(answered, new: PVIState, old: PVIState) -> PVIState:
    """``new``'s ``q``, factors and ``applied`` if the visited client ``answered``, else
    ``old``'s: a client that did not answer leaves them as they were (its factor unchanged
    that round, which PVI allows: any subset of the clients may update in a round)."""
    keep = lambda a, b: jnp.where(answered, a, b)  # noqa: E731
    kept = (new.q, new.factors, new.applied), (old.q, old.factors, old.applied)
    q, factors, applied = jax.tree_util.tree_map(keep, *kept)
    return new._replace(q=q, factors=factors, applied=applied)


def accepts(residual, max_residual):
    """Whether the server applies an update whose local fit ended with ``residual`` (in
    ``q``'s scales; ``(M,)`` or a scalar): always with ``max_residual=None`` (a private run,
    where the residual, computed from the rows, must not decide what is released), else when
    it is finite and at most ``max_residual``. An update from a fit that failed by orders of
    magnitude is rejected whole, as one that would make ``q`` improper is coordinate by
    coordinate: ``q`` and the client's factor stay, and the client is told none of it was
    applied."""
    if max_residual is None:
        return jnp.ones(jnp.shape(residual), bool)
    return jnp.isfinite(residual) & (residual <= max_residual)


def build_visit(
    *, damping: float = 1.0, auto_clip: bool = False, partial: bool = False, max_residual: float | None = None
) -> Callable:
    """A pure ``visit(state, m, key, federation, thetas=None) -> (state, (rejected, clipped,
    residual, answered, log_lik))``: client ``m``'s update (its key of the round ``key``) and
    the server's update after it.

    What crosses: down, ``q`` (``2 d`` numbers), ``thetas`` if given (draws of a ``q`` for the
    loss; the client's functions then take them, ``loss_draws`` of :func:`client_functions`),
    with ``auto_clip`` whether it is the state's first round, the key, and which coordinates
    of the client's last update were applied (``d`` booleans); up, :class:`ClientReply` (with
    ``thetas``, its ``log_lik``). The client's factor (or virtual factors) stays with it. The
    server (:func:`server_update`) adds ``damping`` times the reply to ``q`` and to its record
    of client ``m``'s factor. ``partial``: a client that fails or does not answer is skipped
    (``answered`` false): ``q``, its factor and its client state stay as they were.
    ``max_residual``: an update whose local fit's residual is above it (or not finite) is not
    applied (:func:`accepts`; counted in ``rejected`` as all of its coordinates).
    """

    def visit(state: PVIState, m, key, federation, thetas=None):
        draws = () if thetas is None else (thetas,)
        sent = (state.q, *draws, state.round == 0) if auto_clip else (state.q, *draws)
        # own: client m's slice of what was applied of its last update
        out = federation.one("update", m, *sent, key, own=(state.applied,), state=state.clients, partial=partial)
        clients, reply, answered = out if partial else out + (jnp.asarray(True),)
        delta = reply.delta
        new_factors = jax.tree_util.tree_map(lambda all_, d: all_.at[m].add(damping * d), state.factors, delta)
        accept = accepts(reply.residual, max_residual)
        new, ok = server_update(state, tree_add(state.q, delta, damping), new_factors, accept)
        new = new._replace(clients=clients, applied=new.applied.at[m].set(ok))
        if partial:
            new = _skip_absent(answered, new, state)
            ok = ok | ~answered
        return new, (jnp.sum(~ok), reply.clipped, reply.residual, answered, reply.log_lik)

    return visit


def _count_round(state: PVIState, federation, min_clients=None) -> PVIState:
    """Counts the round and checks that ``min_clients`` clients are still in
    (``state.absent``: a :class:`~numpyro_fed.federation.ClientError` naming those out
    otherwise)."""
    state = state._replace(round=state.round + 1)
    if min_clients is not None:
        state = state._replace(absent=federation.require(state.absent, min_clients))
    return state


#: ``jax.random.fold_in`` stream of a round's key that the server's prior update uses.
PRIOR_STREAM = 2


def _refine_prior(rng_key, state: PVIState, prior_update):
    """The server's refinement of the prior factor at the start of a round (if any)."""
    if prior_update is None:
        return state, None
    return prior_update(state, jax.random.fold_in(rng_key, PRIOR_STREAM))


def check_dropout(min_clients, num_clients: int, trusted_aggregator: bool = False) -> int | None:
    """``min_clients`` of a run of ``num_clients`` clients as :func:`build_step` takes it
    (``None``: every client must answer), or a ``ValueError`` naming it: above
    ``num_clients``, or below it with a trusted aggregator (each client's noise is divided by
    ``sqrt(M)`` so that the sum of all ``M`` carries the guarantee's noise; a sum without
    some of them would carry less)."""
    resolved = resolve_min_clients(min_clients, num_clients)
    if resolved is not None and trusted_aggregator:
        raise ValueError(
            f"min_clients={min_clients} needs trusted_aggregator=False: with a trusted aggregator each "
            f"client's noise is divided by sqrt({num_clients}), so a round without some clients would carry "
            "less noise than the guarantee counts"
        )
    return resolved


def build_step(
    config: LocalConfig,
    *,
    num_clients: int,
    schedule: str = "sequential",
    damping: float = 1.0,
    auto_clip: bool = False,
    prior_update: Callable | None = None,
    prior_potential: Callable | None = None,
    min_clients: int | None = None,
    max_residual: float | None = None,
) -> Callable:
    """A pure ``step(rng_key, state, federation) -> (state, info)``: one round, visiting
    every client once through ``federation`` (a started
    :class:`~numpyro_fed.federation.Federation` running :func:`client_functions`; pass it as
    an argument of ``jit``, it is a pytree), ``info`` a :class:`PVIInfo`.

    ``"sequential"``: the clients in turn (:func:`build_visit`, ``federation.one``), each
    from the ``q`` the previous one left; ``"synchronous"``: every client from the same ``q``
    (``federation.map``, the same messages), the server adding the sum of the replies.
    Client ``m``'s key is ``jax.random.split(rng_key, num_clients)[m]``. With
    ``prior_update`` (:func:`~numpyro_fed.infer.pvi.prior.build_prior_update`), the server
    first refines the prior factor; ``prior_potential`` then enters the loss (see
    :func:`negative_elbo`).

    **The loss costs no message.** The server draws ``config.num_mc_samples`` draws of ``q``
    as the round starts (with ``jax.random.fold_in(rng_key, LOSS_STREAM)``) and sends them
    with each client's update; the client returns its term there with its change (the
    clients' functions built with ``loss_draws=True``). ``info.loss`` is therefore the loss of
    ``q`` *before* the round: one message per client per round instead of two (a deployed
    round costs about a message's start-up per call).

    **Clients that drop out.** ``min_clients`` (``None``: every client must answer, and one
    that fails stops the round with a :class:`~numpyro_fed.federation.ClientError`): the
    clients' calls are ``partial``, a client that fails or does not answer is skipped (its
    factor, and its part of ``q``, stay as before the round: PVI lets any subset of the
    clients update in a round) and marked in ``state.absent``; it rejoins at its next visit
    from its client state. A round after which fewer than ``min_clients`` clients answered
    raises the :class:`~numpyro_fed.federation.ClientError` naming those out.
    ``info.participated`` records who took part.

    ``max_residual`` (non-private runs): an update whose local fit failed (residual above
    it, or not finite) is not applied (:func:`accepts`).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    partial = min_clients is not None

    def synchronous(keys, state, federation, thetas):
        sent = (state.q, thetas, state.round == 0) if auto_clip else (state.q, thetas)
        out = federation.map("update", *sent, per_client=(keys, state.applied), state=state.clients, partial=partial)
        clients, reply, answered = out if partial else out + (jnp.ones(num_clients, bool),)
        accept = accepts(reply.residual, max_residual)
        take = answered & accept
        rows = lambda a, x: jnp.reshape(a, (num_clients,) + (1,) * (jnp.ndim(x) - 1))  # noqa: E731
        deltas = jax.tree_util.tree_map(lambda d: jnp.where(rows(take, d), d, 0), reply.delta)  # none of who failed
        new_factors = tree_add(state.factors, deltas, damping)
        total = jax.tree_util.tree_map(lambda x: jnp.sum(x, axis=0), deltas)
        new, ok = server_update(state, tree_add(state.q, total, damping), new_factors)
        mine = jnp.where(rows(accept, state.applied), jnp.broadcast_to(ok, state.applied.shape), False)
        applied = jnp.where(rows(answered, state.applied), mine, state.applied)
        new = new._replace(clients=clients, applied=applied)
        rejected = jnp.sum(~ok) + jnp.sum(answered & ~accept) * ok.size
        return new, (rejected, reply.clipped, reply.residual, answered, reply.log_lik)

    visit = build_visit(damping=damping, auto_clip=auto_clip, partial=partial, max_residual=max_residual)

    def sequential(keys, state, federation, thetas):
        visit_m = lambda state, m: visit(state, m, keys[m], federation, thetas)  # noqa: E731
        return lax.scan(visit_m, state, jnp.arange(num_clients))

    visit_all = synchronous if schedule == "synchronous" else sequential

    def step(rng_key, state: PVIState, federation):
        keys = jax.random.split(rng_key, num_clients)
        start = state.q  # the loss's q: as the round starts, before the prior's refinement
        thetas = draw_q(jax.random.fold_in(rng_key, LOSS_STREAM), start, config.num_mc_samples)
        state, prior_residual = _refine_prior(rng_key, state, prior_update)
        state, (rejected, clipped, residual, answered, log_liks) = visit_all(keys, state, federation, thetas)
        state = _count_round(state._replace(absent=~answered), federation, min_clients)  # every client was visited
        loss = loss_of_client_terms(start, state.prior, thetas, prior_potential, log_liks, answered)
        return state, PVIInfo(rejected, clipped, residual, loss, prior_residual, answered)

    return step


def build_client_step(
    num_mc_samples: int,
    *,
    damping: float = 1.0,
    prior_update: Callable | None = None,
    prior_potential: Callable | None = None,
    min_clients: int | None = None,
    max_residual: float | None = None,
) -> Callable:
    """A pure ``step(rng_key, state, federation, client) -> (state, info)``: a round that
    visits only ``client`` (:func:`build_visit`, with ``rng_key`` as the client's key), as
    :class:`~numpyro_fed.GaussianPVI` schedules them; ``info`` a :class:`PVIInfo` whose
    ``rejected``, ``clipped`` and ``residual`` are that client's. ``prior_update``,
    ``prior_potential``: as :func:`build_step`'s.

    ``min_clients``: a scheduled client that fails is skipped (``q`` and its factor stay) and
    counted out (``state.absent``) until a later visit of it answers; the run stops with the
    :class:`~numpyro_fed.federation.ClientError` when fewer than ``min_clients`` clients are
    in (the clients whose last visit answered, or not yet visited). ``max_residual``: as
    :func:`build_step`'s."""
    visit = build_visit(damping=damping, partial=min_clients is not None, max_residual=max_residual)

    def step(rng_key, state: PVIState, federation, client):
        num_clients = state.applied.shape[0]
        state, prior_residual = _refine_prior(rng_key, state, prior_update)
        state, (rejected, clipped, residual, answered, _) = visit(state, client, rng_key, federation)
        absent = jnp.zeros(num_clients, bool) if state.absent is None else state.absent
        state = state._replace(absent=absent.at[client].set(~answered))
        participated = jnp.zeros(num_clients, bool).at[client].set(answered)
        state = _count_round(state, federation, min_clients)
        # the round reached one client: the loss of the new q is a call to every client
        key = jax.random.fold_in(rng_key, LOSS_STREAM)
        loss = federated_negative_elbo(
            key, federation, state.q, state.prior, num_mc_samples, prior_potential, partial=min_clients is not None
        )
        return state, PVIInfo(rejected, clipped, residual, loss, prior_residual, participated)

    return step
