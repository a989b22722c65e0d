"""The U-DSVGD core (Kassab & Simeone, Algorithm 4): DSVGD without distillation.

Each client keeps the global iterates before and after each of its rounds (its buffer, its
client state: :class:`Buffer`) and computes ``grad log t_k^(i-1)`` by the recursion (15)
over them, ``sum_{j in I_k} grad log q^(j) - grad log q^(j-1)`` with ``q^(0) = p_0``. The
server sends the global particles and the round's index; the client returns the new global
particles. :func:`init`, :func:`client_functions` (run where the client lives) and
:func:`build_kernel`'s ``step(rng_key, state, federation, client) -> (state, info)``, written
against the federation seam.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from numpyro_fed.federation import ClientState
from numpyro_fed.infer.stein.dsvgd import DSVGDInfo, check_key, round_config, start_and_frame
from numpyro_fed.infer.stein.kde import kde_score_fn
from numpyro_fed.infer.stein.svgd import staged_svgd

__all__ = ["Buffer", "UDSVGDState", "build_client", "build_kernel", "client_functions", "init"]


class Buffer(NamedTuple):
    """What a U-DSVGD client keeps (its client state): the global iterates before and after
    each round it was scheduled in.

    :ivar history: ``(I + 1, N, d)``: row ``j`` holds ``theta^(j)`` where the client saw it
        (rows ``j - 1`` and ``j`` of each of its rounds ``j``), zeros elsewhere.
    :ivar mine: ``(I,)`` bool, the rounds (``j - 1``, 0-based) it was scheduled in.
    """

    history: jax.Array
    mine: jax.Array


class UDSVGDState(NamedTuple):
    """State of U-DSVGD (Algorithm 4).

    :ivar global_particles: ``(N, d)``.
    :ivar clients: a :class:`~numpyro_fed.federation.ClientState` of every client's
        :class:`Buffer` (stacked in ``values`` in process; on its worker with an engine
        backend).
    :ivar scheduled: ``(I,)`` int, the client of each round (``-1``: not yet run).
    :ivar round: rounds done.
    """

    global_particles: jax.Array
    clients: ClientState
    scheduled: jax.Array
    round: jax.Array


def init(particles, num_rounds: int, federation) -> UDSVGDState:
    """Buffers sized for ``num_rounds`` rounds, empty, handed to the clients of the started
    ``federation`` through its ``init_state``, and the initial particles ``(N, d)``.

    >>> import jax.numpy as jnp
    >>> from numpyro_fed.federation import ClientProgram, InProcess
    >>> federation = InProcess().start(ClientProgram.stacked({}, jnp.zeros((2, 1))))
    >>> init(jnp.zeros((5, 2)), 3, federation).clients.values.history.shape
    (2, 4, 5, 2)
    """
    particles = jnp.asarray(particles)
    num_clients = federation.num_clients
    buffers = Buffer(
        jnp.zeros((num_clients, num_rounds + 1) + particles.shape, particles.dtype),
        jnp.zeros((num_clients, num_rounds), bool),
    )
    return UDSVGDState(
        particles, federation.init_state(buffers), jnp.full(num_rounds, -1, jnp.int32), jnp.zeros((), jnp.int32)
    )


def build_client(
    prior_grad: Callable,
    client_grad: Callable,
    *,
    num_local_steps: int,
    optim,
    kde_bandwidth: float | str = "auto",
    svgd_bandwidth=None,
    temperature: float = 1.0,
    stochastic_client_grad: Callable | None = None,
) -> Callable:
    """A U-DSVGD client: ``client(rng_key, global_particles, history, mine, round, block) -> (N, d)``.

    ``global_particles`` is what the server sends (``q^(i-1)``'s particles, equal to
    ``history[round]``, ``round`` the rounds done); the client's buffer is ``history`` (``(I + 1, N, d)``) at the rounds
    ``j`` where ``mine[j - 1]`` is true (the rows ``j - 1`` and ``j``); ``mine`` is ``(I,)``
    bool. Returns the new global particles, the client's upload. Options as
    :func:`numpyro_fed.infer.stein.dsvgd.build_client`.
    """
    config = round_config(prior_grad, client_grad, stochastic_client_grad, kde_bandwidth, svgd_bandwidth)
    kde_score = kde_score_fn(config.kde_bandwidth)

    def client(rng_key, global_particles, history, mine, round_, block):
        check_key(rng_key, stochastic_client_grad)
        key = rng_key if stochastic_client_grad is not None else None
        start, frame = start_and_frame(config, global_particles, block, temperature, round_ == 0)
        history_z = frame.to_z(history)

        def iterate_scores(x):  # grad log q^(j) for j = 0..I, q^(0) the prior
            kde = jax.vmap(kde_score, in_axes=(None, 0))(x, history_z)
            return kde.at[0].set(frame.prior_score(x))

        def tilted_score(x, step_key=None):
            scores = iterate_scores(x)
            factor = jnp.sum(jnp.where(mine[:, None, None], scores[1:] - scores[:-1], 0.0), axis=0)
            return scores[round_] - factor - frame.client_grad(x, block, step_key) / temperature

        return frame.from_z(
            staged_svgd(
                frame.to_z(start),
                tilted_score,
                num_local_steps,
                optim,
                config.svgd_bandwidth,
                key,
                config.stages,
                config.curvature,
            )
        )

    return client


def client_functions(prior_grad: Callable, client_grad: Callable, **options) -> tuple[dict, dict]:
    """What a U-DSVGD client runs, ``(functions, stateful)``: one function of its own
    :class:`Buffer`, ``"update"``, ``(block, buffer, global_particles, round, [key]) ->
    (buffer', (N, d))``: it files the particles it received at ``round`` (the index of the
    round) in its buffer, computes the new global particles, files them and returns them.
    Options as :func:`build_client`."""
    client_fn = build_client(prior_grad, client_grad, **options)

    def update(block, buffer: Buffer, global_particles, round_, key=None):
        history = buffer.history.at[round_].set(global_particles)
        new_global = client_fn(key, global_particles, history, buffer.mine, round_, block)
        return Buffer(history.at[round_ + 1].set(new_global), buffer.mine.at[round_].set(True)), new_global

    if options.get("stochastic_client_grad") is None:
        return {}, {
            "update": lambda block, buffer, global_particles, round_: update(block, buffer, global_particles, round_)
        }
    return {}, {"update": update}


def build_kernel(stochastic: bool = False) -> Callable:
    """One round of U-DSVGD: ``step(rng_key, state, federation, client) -> (state, info)``:
    the scheduled ``client`` receives the global particles and the round's index through
    ``federation`` (started on :func:`client_functions`) and returns the new global
    particles. ``stochastic``: the round's ``rng_key`` goes to the client (its minibatches;
    otherwise it is unused and may be ``None``)."""

    def step(rng_key, state: UDSVGDState, federation, client):
        key = (rng_key,) if stochastic else ()
        clients, new_global = federation.one(
            "update", client, state.global_particles, state.round, *key, state=state.clients
        )
        move = jnp.sqrt(jnp.mean(jnp.sum((new_global - state.global_particles) ** 2, axis=-1)))
        state = UDSVGDState(
            new_global,
            clients,
            state.scheduled.at[state.round].set(jnp.asarray(client, state.scheduled.dtype)),
            state.round + 1,
        )
        return state, DSVGDInfo(jnp.asarray(client), move)

    return step
