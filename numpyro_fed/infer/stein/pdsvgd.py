"""The P-DSVGD core (Kassab & Simeone, Algorithm 5): several clients per round.

The scheduled clients each run DSVGD's client function
(:func:`numpyro_fed.infer.stein.dsvgd.build_client`) from the server's particles and upload
their *local* particles; :func:`build_server` then distills ``q^(i) = p_0 prod_k t_k^(i)``
(Eq. (28)) into the server's ``N`` particles with SVGD steps (Eq. (29)). The state is
:class:`~numpyro_fed.infer.stein.dsvgd.DSVGDState`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from numpyro_fed.infer.stein.dsvgd import (ClientMessage, DSVGDInfo, DSVGDState, _config, build_client,
                                          check_key)
from numpyro_fed.infer.stein.dsvgd import client_functions as dsvgd_client_functions
from numpyro_fed.infer.stein.kde import kde_score_fn
from numpyro_fed.infer.stein.svgd import staged_svgd
from numpyro_fed.infer.stein.whitening import round_frame

__all__ = ["build_kernel", "build_round", "build_server", "client_functions"]


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

    def server(state: DSVGDState, clients, uploads):
        frame = round_frame(config.kde_bandwidth, state.global_particles, config.prior_score, config.client_grad)
        local_particles = state.local_particles.at[clients].set(uploads)
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
        return (DSVGDState(new_global, local_particles, visited, state.round + 1),
                DSVGDInfo(jnp.asarray(clients), move))

    return server


def client_functions(prior_grad: Callable, client_grad: Callable, **options) -> dict:
    """What a P-DSVGD client runs on its own block: ``"update"``, ``(block,
    global_particles, first, [key,] local_particles, visited) -> (N, d)`` its new local
    particles (its upload, Algorithm 5). Arguments as
    :func:`numpyro_fed.infer.stein.dsvgd.client_functions`."""
    update = dsvgd_client_functions(prior_grad, client_grad, **options)["update"]
    return {"update": lambda *args: update(*args).local_particles}


def build_round(server_fn: Callable, stochastic: bool = False) -> Callable:
    """One round of P-DSVGD through a federation: ``step(rng_key, state, clients, federation)
    -> (state, info)``. Each of the ``(C,)`` scheduled ``clients`` receives the server's
    particles (and its stored local particles) and returns its new local particles; then
    ``server_fn`` (:func:`build_server`) distills them. ``stochastic``: each client gets its
    own key split from ``rng_key``."""

    def step(rng_key, state: DSVGDState, clients, federation):
        first = ~jnp.any(state.visited)
        own = (state.local_particles, state.visited)

        def one_client(client, key):
            extra = (key,) if stochastic else ()
            return federation.one("update", client, state.global_particles, first, *extra, own=own)

        if stochastic:
            uploads = jax.vmap(one_client)(clients, jax.random.split(rng_key, clients.shape[0]))
        else:
            uploads = jax.vmap(lambda c: one_client(c, None))(clients)
        return server_fn(state, clients, uploads)

    return step


def build_kernel(prior_grad: Callable, client_grad: Callable, *, num_server_steps: int,
                 server_optim=None, **options) -> Callable:
    """One round of P-DSVGD as ``step(rng_key, state, clients, blocks) -> (state, info)``.

    ``clients``: an ``(C,)`` array of distinct indices; ``blocks``: their data, stacked. The
    clients run in parallel (``vmap``), each with its own key split from ``rng_key`` (with
    ``stochastic_client_grad`` only). ``options`` as
    :func:`numpyro_fed.infer.stein.dsvgd.build_client`; ``server_optim`` defaults to ``optim``.

    >>> import jax, jax.numpy as jnp
    >>> from numpyro_fed.infer.stein import adagrad_momentum, dsvgd
    >>> # N(0, 1) prior, two clients with L_k(x) = (x - 2)^2 / 2: the posterior is N(4/3, 1/3)
    >>> step = build_kernel(lambda x: x, lambda x, block: x - block, num_local_steps=300,
    ...                     num_distill_steps=300, num_server_steps=300, optim=adagrad_momentum(0.1))
    >>> x0 = jax.random.normal(jax.random.PRNGKey(0), (50, 1))
    >>> state, info = step(None, dsvgd.init(x0, 2), jnp.array([0, 1]), jnp.array([2.0, 2.0]))
    >>> abs(float(state.global_particles.mean()) - 4 / 3) < 0.15
    True
    """
    server_optim = options["optim"] if server_optim is None else server_optim
    stochastic = options.get("stochastic_client_grad")
    client_fn = build_client(prior_grad, client_grad, **options)
    server_fn = build_server(prior_grad, num_server_steps=num_server_steps, server_optim=server_optim,
                             kde_bandwidth=options.get("kde_bandwidth", "auto"),
                             svgd_bandwidth=options.get("svgd_bandwidth"))

    def step(rng_key, state: DSVGDState, clients, blocks):
        check_key(rng_key, stochastic)
        message = ClientMessage(state.global_particles, ~jnp.any(state.visited))

        def one_client(key, local, visited, block):
            return client_fn(key, message, local, visited, block).local_particles

        locals_, visited = state.local_particles[clients], state.visited[clients]
        if stochastic is None:
            uploads = jax.vmap(lambda local, seen, block: one_client(None, local, seen, block))(
                locals_, visited, blocks)
        else:
            uploads = jax.vmap(one_client)(jax.random.split(rng_key, clients.shape[0]), locals_, visited, blocks)
        return server_fn(state, clients, uploads)

    return step
