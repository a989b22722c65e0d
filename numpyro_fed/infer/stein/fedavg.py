"""The FedAvg core, the DSVGD paper's point-estimate baseline: one client per round runs
optimizer steps on its share of the negative log posterior from the server's point and
uploads the result.

:func:`init`, the client's function (:func:`client_functions`, run where the client lives)
and the round ``step(rng_key, state, federation, client) -> (state, info)``
(:func:`build_kernel`), written against the federation seam.

>>> import jax, jax.numpy as jnp, optax
>>> from numpyro_fed.federation import ClientProgram, InProcess
>>> # N(0, 1) prior, L_k(x) = (x - b_k)^2 / 2, b = (0, 3): client 1 minimizes (x - 3)^2 / 2 + x^2 / 4, at 2
>>> functions, stateful = client_functions(lambda x: x, lambda x, block: x - block, num_clients=2,
...                                        num_local_steps=200, optim=optax.sgd(0.1))
>>> federation = InProcess().start(ClientProgram.stacked(functions, jnp.array([0.0, 3.0])))
>>> state, info = build_kernel()(jax.random.PRNGKey(0), init(jnp.zeros((1, 1))), federation, 1)
>>> round(float(state.particles[0, 0]), 4), info.client.tolist()
(2.0, 1)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from numpyro_fed.infer.stein.dsvgd import batched_client_grad

__all__ = ["BaselineInfo", "ParticleState", "build_kernel", "client_functions", "descend", "init", "rms_move"]


class ParticleState(NamedTuple):
    """:ivar particles: ``(N, d)`` (``(1, d)``: FedAvg's point); :ivar round: rounds done."""

    particles: jax.Array
    round: jax.Array


class BaselineInfo(NamedTuple):
    """:ivar client: the scheduled client (-1: all, centralized); :ivar move: root mean square
    move of the particles in the round."""

    client: jax.Array
    move: jax.Array


def rms_move(new, old) -> jax.Array:
    """Root mean square distance between the rows of ``new`` and ``old`` (``(N, d)``)."""
    return jnp.sqrt(jnp.mean(jnp.sum((new - old) ** 2, axis=-1)))


def init(particles) -> ParticleState:
    """The state of a run from ``particles`` (``(N, d)``; FedAvg's point: ``(1, d)``)."""
    return ParticleState(jnp.asarray(particles), jnp.zeros((), jnp.int32))


def descend(rng_key, params, grad_fn: Callable, num_steps: int, optim):
    """``num_steps`` steps of the optax ``optim`` on ``grad_fn(x, key_t)``, a fresh key per
    step, from a fresh optimizer state.

    >>> import jax, jax.numpy as jnp, optax
    >>> x = descend(jax.random.PRNGKey(0), jnp.ones(1), lambda x, key: x - 3.0, 200, optax.sgd(0.1))
    >>> round(float(x[0]), 4)
    3.0
    """

    def step(carry, key):
        x, opt_state = carry
        updates, opt_state = optim.update(grad_fn(x, key), opt_state, x)
        return (x + updates, opt_state), None

    (x, _), _ = lax.scan(step, (params, optim.init(params)), jax.random.split(rng_key, num_steps))
    return x


def client_functions(
    prior_grad: Callable,
    client_grad: Callable,
    *,
    num_clients: int,
    num_local_steps: int,
    optim,
    stochastic_client_grad: Callable | None = None,
) -> tuple[dict, dict]:
    """What a FedAvg client runs, ``(functions, stateful)``: ``"update"``, ``(block, point,
    key) -> point'``, ``num_local_steps`` steps of ``optim`` on its objective ``L_k + (1/K)
    (-log p_0)`` (its loss plus its share of the prior, so that the clients' objectives add
    up to the negative log posterior) from the server's point; ``key``: one key per step
    (the minibatches of ``stochastic_client_grad``). It keeps no state.

    :param prior_grad: ``(d,) -> (d,)``, the gradient of ``-log p_0``.
    :param client_grad: ``((d,), block) -> (d,)``, the gradient of ``L_k``.
    :param int num_clients: ``K``.
    """
    share = 1.0 / num_clients
    prior = jax.vmap(prior_grad)
    grad = batched_client_grad(client_grad, stochastic_client_grad)
    stochastic = stochastic_client_grad is not None

    def update(block, point, key):
        def objective_grad(p, step_key):
            return grad(p, block, step_key if stochastic else None) + share * prior(p)

        return descend(key, point, objective_grad, num_local_steps, optim)

    return {"update": update}, {}


def build_kernel() -> Callable:
    """One round of FedAvg: ``step(rng_key, state, federation, client) -> (state, info)``:
    the scheduled ``client`` receives the server's point and the round's key through
    ``federation`` (started on :func:`client_functions`) and returns its new point, which
    the server keeps."""

    def step(rng_key, state: ParticleState, federation, client):
        point = federation.one("update", client, state.particles, rng_key)
        info = BaselineInfo(jnp.asarray(client), rms_move(point, state.particles))
        return ParticleState(point, state.round + 1), info

    return step
