"""The P-DSVGD core (Kassab & Simeone, Algorithm 5): several clients per round.

The scheduled clients each run DSVGD's client function
(:func:`numpyro_fed.infer.stein.dsvgd.build_client`) from the server's particles and upload
their *local* particles (:func:`client_functions`); the server then distills
``q^(i) = p_0 prod_k t_k^(i)`` (Eq. (28)) into its ``N`` particles with SVGD steps (Eq. (29),
:func:`build_server`). :func:`build_kernel` composes them through the federation seam:
``step(rng_key, state, federation, clients) -> (state, info)``. The state is a
:class:`PDSVGDState`: the server keeps the local particles the clients uploaded; each client
keeps its own :class:`~numpyro_fed.infer.stein.dsvgd.LocalState` (its client state).

>>> import jax, jax.numpy as jnp
>>> from numpyro_fed.federation import ClientProgram, InProcess
>>> from numpyro_fed.infer.stein import adagrad_momentum
>>> # N(0, 1) prior, two clients with L_k(x) = (x - 2)^2 / 2: the posterior is N(4/3, 1/3)
>>> prior_grad, optim = (lambda x: x), adagrad_momentum(0.1)
>>> functions, stateful = client_functions(prior_grad, lambda x, block: x - block, num_local_steps=300,
...                                        num_distill_steps=300, optim=optim)
>>> federation = InProcess().start(ClientProgram.stacked(functions, jnp.array([2.0, 2.0]), stateful=stateful))
>>> step = build_kernel(build_server(prior_grad, num_server_steps=300, server_optim=optim))
>>> x0 = jax.random.normal(jax.random.PRNGKey(0), (50, 1))
>>> state, info = step(None, init(x0, federation), federation, jnp.array([0, 1]))
>>> abs(float(state.global_particles.mean()) - 4 / 3) < 0.15
True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from numpyro_fed.federation import ClientState
from numpyro_fed.infer.stein.curvature import round_frame
from numpyro_fed.infer.stein.dsvgd import DSVGDInfo, initial_local_states, round_config
from numpyro_fed.infer.stein.dsvgd import client_functions as dsvgd_client_functions
from numpyro_fed.infer.stein.kde import kde_score_fn
from numpyro_fed.infer.stein.svgd import staged_svgd

__all__ = ["PDSVGDState", "build_kernel", "build_server", "client_functions", "init"]


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


def init(particles, federation) -> PDSVGDState:
    """Algorithm 5's initial state: every client's local particles are copies of the prior
    draws ``particles``, handed to the clients of the started ``federation`` through its
    ``init_state`` (see :func:`numpyro_fed.infer.stein.dsvgd.init`).

    >>> import jax.numpy as jnp
    >>> from numpyro_fed.federation import ClientProgram, InProcess
    >>> federation = InProcess().start(ClientProgram.stacked({}, jnp.zeros((3, 1))))
    >>> init(jnp.zeros((5, 2)), federation).uploads.shape
    (3, 5, 2)
    """
    particles = jnp.asarray(particles)
    num_clients = federation.num_clients
    local = initial_local_states(particles, num_clients)
    return PDSVGDState(
        particles,
        local.local_particles,
        federation.init_state(local),
        jnp.zeros(num_clients, bool),
        jnp.zeros((), jnp.int32),
    )


def build_server(
    prior_grad: Callable,
    *,
    num_server_steps: int,
    server_optim,
    kde_bandwidth: float | str = "auto",
    svgd_bandwidth=None,
) -> Callable:
    """The P-DSVGD server: ``server(state, clients, uploads) -> (state, info)``.

    ``clients``: ``(C,)`` distinct indices of the round's clients; ``uploads``: their new
    local particles, ``(C, N, d)``. The server's particles move ``num_server_steps`` SVGD
    steps towards ``p_0 prod_k t_k`` over the clients visited so far (``t_k = 1`` for the
    others), each ``t_k`` the KDE of client ``k``'s local particles over the prior. With
    ``kde_bandwidth="auto"``, in the coordinates that whiten the server's particles.
    """
    config = round_config(prior_grad, lambda x, block: x, None, kde_bandwidth, svgd_bandwidth)
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

        new_global = frame.from_z(
            staged_svgd(
                frame.to_z(state.global_particles),
                server_score,
                num_server_steps,
                server_optim,
                config.svgd_bandwidth,
                stages=config.stages,
                curvature=config.curvature,
            )
        )
        move = jnp.sqrt(jnp.mean(jnp.sum((new_global - state.global_particles) ** 2, axis=-1)))
        return (
            state._replace(
                global_particles=new_global, uploads=local_particles, visited=visited, round=state.round + 1
            ),
            DSVGDInfo(jnp.asarray(clients), move),
        )

    return server


def client_functions(prior_grad: Callable, client_grad: Callable, **options) -> tuple[dict, dict]:
    """What a P-DSVGD client runs, ``(functions, stateful)``: one function of its own
    :class:`~numpyro_fed.infer.stein.dsvgd.LocalState`, ``"update"``, ``(block, local,
    global_particles, first, [key]) -> (local', (N, d))``, its new local particles, kept and
    uploaded (Algorithm 5). Arguments as
    :func:`numpyro_fed.infer.stein.dsvgd.client_functions`."""
    update = dsvgd_client_functions(prior_grad, client_grad, **options)[1]["update"]

    def upload(*args):
        local, _ = update(*args)
        return local, local.local_particles

    return {}, {"update": upload}


def build_kernel(server_fn: Callable, stochastic: bool = False) -> Callable:
    """One round of P-DSVGD: ``step(rng_key, state, federation, clients) -> (state, info)``.
    Each of the ``(C,)`` scheduled ``clients`` (distinct indices) receives the server's
    particles through ``federation`` (started on :func:`client_functions`), moves its own
    local particles and uploads them (the clients run in parallel: ``vmap`` in process);
    then ``server_fn`` (:func:`build_server`) distills them. ``stochastic``: each client gets
    its own key split from ``rng_key`` (otherwise ``rng_key`` is unused and may be ``None``)."""

    def step(rng_key, state: PDSVGDState, federation, clients):
        first = ~jnp.any(state.visited)
        own = ()
        if stochastic:
            keys = jax.random.split(rng_key, clients.shape[0])
            # each scheduled client's key in its row (the others are not sent)
            own = (jnp.zeros((state.visited.shape[0],) + keys.shape[1:], keys.dtype).at[clients].set(keys),)
        client_states, uploads = federation.one(
            "update", clients, state.global_particles, first, own=own, state=state.clients
        )
        return server_fn(state._replace(clients=client_states), clients, uploads)

    return step
