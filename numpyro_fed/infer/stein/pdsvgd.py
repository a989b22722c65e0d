"""The P-DSVGD core (Kassab & Simeone, Algorithm 5): several clients per round.

The scheduled clients each run DSVGD's client function
(:func:`numpyro_fed.infer.stein.dsvgd.build_client`) from the server's particles and upload
their *local* particles; :func:`build_server` then distills ``q^(i) = p_0 prod_k t_k^(i)``
(Eq. (28)) into the server's ``N`` particles with SVGD steps (Eq. (29)). The state is a
:class:`PDSVGDState`: the server keeps the local particles the clients uploaded; each client
keeps its own :class:`~numpyro_fed.infer.stein.dsvgd.LocalState` (its client state).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from numpyro_fed.federation import ClientState
from numpyro_fed.infer.stein.dsvgd import (ClientMessage, DSVGDInfo, LocalState, _config, build_client, check_key,
                                          in_process, initial_local_states, put_client, take_client)
from numpyro_fed.infer.stein.dsvgd import client_functions as dsvgd_client_functions
from numpyro_fed.infer.stein.kde import kde_score_fn
from numpyro_fed.infer.stein.svgd import staged_svgd
from numpyro_fed.infer.stein.whitening import round_frame

__all__ = ["PDSVGDState", "build_kernel", "build_round", "build_server", "client_functions", "init"]


class PDSVGDState(NamedTuple):
    """State of P-DSVGD (Algorithm 5).

    :ivar global_particles: ``(N, d)``, the server's particles ``phi``.
    :ivar uploads: ``(K, N, d)``, the local particles each client uploaded in its last round
        (what the server distills; a client not yet visited: the initial draws, unused).
    :ivar clients: a :class:`~numpyro_fed.federation.ClientState` of every client's
        :class:`~numpyro_fed.infer.stein.dsvgd.LocalState` (see
        :class:`~numpyro_fed.infer.stein.dsvgd.DSVGDState`).
    :ivar visited: ``(K,)`` bool, the clients the server has scheduled.
    :ivar round: rounds done.
    """

    global_particles: jax.Array
    uploads: jax.Array
    clients: ClientState
    visited: jax.Array
    round: jax.Array


def init(particles, num_clients: int, federation=None) -> PDSVGDState:
    """Algorithm 5's initial state: every client's local particles are copies of the prior
    draws (sent through ``federation.init_state`` when a started federation is given).

    >>> import jax.numpy as jnp
    >>> init(jnp.zeros((5, 2)), 3).uploads.shape
    (3, 5, 2)
    """
    particles = jnp.asarray(particles)
    local = initial_local_states(particles, num_clients)
    return PDSVGDState(particles, local.local_particles,
                       in_process(local) if federation is None else federation.init_state(local),
                       jnp.zeros(num_clients, bool), jnp.zeros((), jnp.int32))


def build_server(prior_grad: Callable, *, num_server_steps: int, server_optim,
                 kde_bandwidth: float | str = "auto", svgd_bandwidth=None) -> Callable:
    """The P-DSVGD server: ``server(state, clients, uploads) -> (state, info)``.

    ``clients``: ``(C,)`` distinct indices of the round's clients; ``uploads``: their new
    local particles, ``(C, N, d)``. The server's particles move ``num_server_steps`` SVGD
    steps towards ``p_0 prod_k t_k`` over the clients visited so far (``t_k = 1`` for the
    others), each ``t_k`` the KDE of client ``k``'s local particles over the prior. With
    ``kde_bandwidth="auto"``, in the coordinates that whiten the server's particles.
    """
    config = _config(prior_grad, lambda x, block: x, None, kde_bandwidth, svgd_bandwidth)
    kde_score = kde_score_fn(config.kde_bandwidth)

    def server(state: PDSVGDState, clients, uploads):
        frame = round_frame(config.kde_bandwidth, state.global_particles, config.prior_score, config.client_grad)
        local_particles = state.uploads.at[clients].set(uploads)
        visited = state.visited.at[clients].set(True)
        all_locals_z = frame.to_z(local_particles)

        def server_score(x):  # Eq. (28): grad log p_0 + sum_k grad log t_k^(i), t_k = 1 if unvisited
            prior = frame.prior_score(x)
            factors = jax.vmap(kde_score, in_axes=(None, 0))(x, all_locals_z) - prior  # locals encode p_0 t_k
            factors = jnp.where(visited[:, None, None], factors, 0.0)
            return prior + jnp.sum(factors, axis=0)

        new_global = frame.from_z(staged_svgd(frame.to_z(state.global_particles), server_score,
                                              num_server_steps, server_optim, config.svgd_bandwidth,
                                              stages=config.stages))
        move = jnp.sqrt(jnp.mean(jnp.sum((new_global - state.global_particles) ** 2, axis=-1)))
        return (state._replace(global_particles=new_global, uploads=local_particles, visited=visited,
                               round=state.round + 1),
                DSVGDInfo(jnp.asarray(clients), move))

    return server


def client_functions(prior_grad: Callable, client_grad: Callable, **options) -> dict:
    """What a P-DSVGD client runs on its own block and its own
    :class:`~numpyro_fed.infer.stein.dsvgd.LocalState` (``stateful`` functions):
    ``"update"``, ``(block, local, global_particles, first, [key]) -> (local', (N, d))``, its
    new local particles, kept and uploaded (Algorithm 5). Arguments as
    :func:`numpyro_fed.infer.stein.dsvgd.client_functions`."""
    update = dsvgd_client_functions(prior_grad, client_grad, **options)["update"]

    def upload(*args):
        local, _ = update(*args)
        return local, local.local_particles

    return {"update": upload}


def build_round(server_fn: Callable, stochastic: bool = False) -> Callable:
    """One round of P-DSVGD through a federation: ``step(rng_key, state, clients, federation)
    -> (state, info)``. Each of the ``(C,)`` scheduled ``clients`` receives the server's
    particles, moves its own local particles and uploads them; then ``server_fn``
    (:func:`build_server`) distills them. ``stochastic``: each client gets its own key split
    from ``rng_key``."""

    def step(rng_key, state: PDSVGDState, clients, federation):
        first = ~jnp.any(state.visited)
        own = ()
        if stochastic:
            keys = jax.random.split(rng_key, clients.shape[0])
            # each scheduled client's key in its row (the others are not sent)
            own = (jnp.zeros((state.visited.shape[0],) + keys.shape[1:], keys.dtype).at[clients].set(keys),)
        client_states, uploads = federation.one("update", clients, state.global_particles, first, own=own,
                                                state=state.clients)
        return server_fn(state._replace(clients=client_states), clients, uploads)

    return step


def build_kernel(prior_grad: Callable, client_grad: Callable, *, num_server_steps: int,
                 server_optim=None, **options) -> Callable:
    """One round of P-DSVGD as ``step(rng_key, state, clients, blocks) -> (state, info)``.

    ``clients``: an ``(C,)`` array of distinct indices; ``blocks``: their data, stacked (the
    clients' states kept in this process, :func:`init` without a federation). The
    clients run in parallel (``vmap``), each with its own key split from ``rng_key`` (with
    ``stochastic_client_grad`` only). ``options`` as
    :func:`numpyro_fed.infer.stein.dsvgd.build_client`; ``server_optim`` defaults to ``optim``.

    >>> import jax, jax.numpy as jnp
    >>> from numpyro_fed.infer.stein import adagrad_momentum
    >>> # N(0, 1) prior, two clients with L_k(x) = (x - 2)^2 / 2: the posterior is N(4/3, 1/3)
    >>> step = build_kernel(lambda x: x, lambda x, block: x - block, num_local_steps=300,
    ...                     num_distill_steps=300, num_server_steps=300, optim=adagrad_momentum(0.1))
    >>> x0 = jax.random.normal(jax.random.PRNGKey(0), (50, 1))
    >>> state, info = step(None, init(x0, 2), jnp.array([0, 1]), jnp.array([2.0, 2.0]))
    >>> abs(float(state.global_particles.mean()) - 4 / 3) < 0.15
    True
    """
    server_optim = options["optim"] if server_optim is None else server_optim
    stochastic = options.get("stochastic_client_grad")
    client_fn = build_client(prior_grad, client_grad, **options)
    server_fn = build_server(prior_grad, num_server_steps=num_server_steps, server_optim=server_optim,
                             kde_bandwidth=options.get("kde_bandwidth", "auto"),
                             svgd_bandwidth=options.get("svgd_bandwidth"))

    def step(rng_key, state: PDSVGDState, clients, blocks):
        check_key(rng_key, stochastic)
        message = ClientMessage(state.global_particles, ~jnp.any(state.visited))

        def one_client(key, local, visited, block):
            return client_fn(key, message, local, visited, block).local_particles

        mine = take_client(state.clients, clients)
        locals_, visited = mine.local_particles, mine.visited
        if stochastic is None:
            uploads = jax.vmap(lambda local, seen, block: one_client(None, local, seen, block))(
                locals_, visited, blocks)
        else:
            uploads = jax.vmap(one_client)(jax.random.split(rng_key, clients.shape[0]), locals_, visited, blocks)
        client_states = put_client(state.clients, clients, LocalState(uploads, jnp.ones_like(visited)))
        return server_fn(state._replace(clients=client_states), clients, uploads)

    return step
