"""The U-DSVGD core (Kassab & Simeone, Algorithm 4): DSVGD without distillation.

Each client keeps the global iterates before and after each of its rounds (its buffer) and
computes ``grad log t_k^(i-1)`` by the recursion (15) over them,
``sum_{j in I_k} grad log q^(j) - grad log q^(j-1)`` with ``q^(0) = p_0``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from numpyro_fed.infer.stein.dsvgd import DSVGDInfo, _config, check_key
from numpyro_fed.infer.stein.kde import kde_score_fn
from numpyro_fed.infer.stein.svgd import staged_svgd
from numpyro_fed.infer.stein.whitening import round_frame

__all__ = ["UDSVGDState", "build_client", "build_kernel", "build_round", "client_functions", "init"]


class UDSVGDState(NamedTuple):
    """State of U-DSVGD (Algorithm 4).

    :ivar global_particles: ``(N, d)``.
    :ivar history: ``(I + 1, N, d)``, the global iterates ``theta^(0..I)`` (row ``j`` filled
        once round ``j`` is done). Client ``k``'s buffer is the rows ``j - 1, j`` of the rounds
        ``j`` it was scheduled in; :attr:`scheduled` says which.
    :ivar scheduled: ``(I,)`` int, the client of each round (``-1``: not yet run).
    :ivar round: rounds done.
    """

    global_particles: jax.Array
    history: jax.Array
    scheduled: jax.Array
    round: jax.Array


def init(particles, num_rounds: int) -> UDSVGDState:
    """Buffers sized for ``num_rounds`` rounds from the initial particles ``(N, d)``.

    >>> import jax.numpy as jnp
    >>> init(jnp.zeros((5, 2)), 3).history.shape
    (4, 5, 2)
    """
    particles = jnp.asarray(particles)
    history = jnp.zeros((num_rounds + 1,) + particles.shape, particles.dtype).at[0].set(particles)
    return UDSVGDState(particles, history, jnp.full(num_rounds, -1, jnp.int32), jnp.zeros((), jnp.int32))


def build_client(prior_grad: Callable, client_grad: Callable, *, num_local_steps: int, optim,
                 kde_bandwidth: float | str = "auto", svgd_bandwidth=None, temperature: float = 1.0,
                 stochastic_client_grad: Callable | None = None) -> Callable:
    """A U-DSVGD client: ``client(rng_key, global_particles, history, mine, round, block) -> (N, d)``.

    ``global_particles`` is what the server sends (``q^(i-1)``'s particles, equal to
    ``history[round]``, ``round`` the rounds done); the client's buffer is ``history`` (``(I + 1, N, d)``) at the rounds
    ``j`` where ``mine[j - 1]`` is true (the rows ``j - 1`` and ``j``); ``mine`` is ``(I,)``
    bool. Returns the new global particles, the client's upload. Options as
    :func:`numpyro_fed.infer.stein.dsvgd.build_client`.
    """
    config = _config(prior_grad, client_grad, stochastic_client_grad, kde_bandwidth, svgd_bandwidth)
    kde_score = kde_score_fn(config.kde_bandwidth)

    def client(rng_key, global_particles, history, mine, round_, block):
        check_key(rng_key, stochastic_client_grad)
        key = rng_key if stochastic_client_grad is not None else None
        frame = round_frame(config.kde_bandwidth, global_particles, config.prior_score, config.client_grad)
        history_z = frame.to_z(history)

        def iterate_scores(x):  # grad log q^(j) for j = 0..I, q^(0) the prior
            kde = jax.vmap(kde_score, in_axes=(None, 0))(x, history_z)
            return kde.at[0].set(frame.prior_score(x))

        def tilted_score(x, step_key=None):
            scores = iterate_scores(x)
            factor = jnp.sum(jnp.where(mine[:, None, None], scores[1:] - scores[:-1], 0.0), axis=0)
            return scores[round_] - factor - frame.client_grad(x, block, step_key) / temperature

        return frame.from_z(staged_svgd(frame.to_z(global_particles), tilted_score, num_local_steps, optim,
                                        config.svgd_bandwidth, key, config.stages))

    return client


def client_functions(prior_grad: Callable, client_grad: Callable, **options) -> dict:
    """What a U-DSVGD client runs on its own block: ``"update"``, ``(block,
    global_particles, [key,] history, mine, round) -> (N, d)`` the new global particles.
    ``history`` and ``mine`` are the client's buffer (the global iterates before and after
    its rounds), which the server stores for it (they are the server's own iterates) and
    sends with the call. Options as :func:`build_client`."""
    client_fn = build_client(prior_grad, client_grad, **options)
    if options.get("stochastic_client_grad") is None:
        def update(block, global_particles, history, mine, round_):
            return client_fn(None, global_particles, history, mine, round_, block)
    else:
        def update(block, global_particles, key, history, mine, round_):
            return client_fn(key, global_particles, history, mine, round_, block)
    return {"update": update}


def build_round(stochastic: bool = False) -> Callable:
    """One round of U-DSVGD through a federation: ``step(rng_key, state, client, federation)
    -> (state, info)``."""

    def step(rng_key, state: UDSVGDState, client, federation):
        mine = _rounds_of(state, client)
        key = (rng_key,) if stochastic else ()
        new_global = federation.one("update", client, state.global_particles, *key, state.history, mine,
                                    state.round)
        return _server_update(state, client, new_global)

    return step


def _rounds_of(state: UDSVGDState, client):
    """The mask of the rounds so far in which ``client`` was scheduled (its buffer)."""
    return (state.scheduled == client) & (jnp.arange(state.scheduled.shape[0]) < state.round)


def _server_update(state: UDSVGDState, client, new_global):
    move = jnp.sqrt(jnp.mean(jnp.sum((new_global - state.global_particles) ** 2, axis=-1)))
    state = UDSVGDState(
        new_global,
        state.history.at[state.round + 1].set(new_global),
        state.scheduled.at[state.round].set(jnp.asarray(client, state.scheduled.dtype)),
        state.round + 1,
    )
    return state, DSVGDInfo(jnp.asarray(client), move)


def build_kernel(prior_grad: Callable, client_grad: Callable, **options) -> Callable:
    """One round of U-DSVGD as ``step(rng_key, state, client, block) -> (state, info)``.

    Options as :func:`build_client`; ``rng_key`` as in
    :func:`numpyro_fed.infer.stein.dsvgd.build_kernel`.
    """
    client_fn = build_client(prior_grad, client_grad, **options)

    def step(rng_key, state: UDSVGDState, client, block):
        new_global = client_fn(rng_key, state.global_particles, state.history, _rounds_of(state, client),
                               state.round, block)
        return _server_update(state, client, new_global)

    return step
