"""The core of centralized SVGD on the pooled potential (the DSVGD paper's reference): every
SVGD step asks every client for the gradient of its term at the particles (its minibatch
estimate with ``stochastic_client_grad``) and moves the particles towards
``p_0 exp(-(1/alpha) sum_k L_k)``; a round is ``num_steps`` steps, the optimizer's state kept
across rounds.

:func:`init`, the client's function (:func:`client_functions`) and the round
``step(rng_key, state, federation) -> (state, info)`` (:func:`build_kernel`), written against
the federation seam.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from numpyro_fed.infer.stein import svgd as svgd_core
from numpyro_fed.infer.stein.dsvgd import batched_client_grad
from numpyro_fed.infer.stein.fedavg import BaselineInfo, rms_move

__all__ = ["SVGDRoundState", "build_kernel", "client_functions", "init"]


class SVGDRoundState(NamedTuple):
    """:ivar particles: ``(N, d)``; :ivar opt_state: the optimizer's state (kept across
    rounds); :ivar round: rounds done."""

    particles: jax.Array
    opt_state: Any
    round: jax.Array


def init(particles, optim) -> SVGDRoundState:
    """The state of a run from ``particles`` (``(N, d)``) with a fresh optimizer state."""
    particles = jnp.asarray(particles)
    return SVGDRoundState(particles, optim.init(particles), jnp.zeros((), jnp.int32))


def client_functions(client_grad: Callable, stochastic_client_grad: Callable | None = None) -> tuple[dict, dict]:
    """What a client runs, ``(functions, stateful)``: ``"grad"``, ``(block, x (N, d), [key])
    -> (N, d)``, the gradient of its term ``L_k`` at every particle (with
    ``stochastic_client_grad``, its minibatch estimate drawn with ``key``). It keeps no state."""
    grad = batched_client_grad(client_grad, stochastic_client_grad)
    if stochastic_client_grad is None:
        return {"grad": lambda block, x: grad(x, block)}, {}
    return {"grad": lambda block, x, key: grad(x, block, key)}, {}


def build_kernel(
    prior_grad: Callable, optim, *, num_steps: int, temperature: float = 1.0, bandwidth=None, stochastic: bool = False
) -> Callable:
    """A round of centralized SVGD, ``num_steps`` SVGD steps
    (:func:`numpyro_fed.infer.stein.svgd.build_kernel`): ``step(rng_key, state, federation)
    -> (state, info)``. Each step's score is ``grad log p_0 - (1/temperature) sum_k grad L_k``,
    every client's gradient asked through ``federation`` (``"grad"``, started on
    :func:`client_functions`; ``stochastic``: each client gets its own key for its
    minibatch, split from the step's key). ``info.client`` is -1 (every client in every step).

    >>> import jax, jax.numpy as jnp
    >>> from numpyro_fed.federation import ClientProgram, InProcess
    >>> from numpyro_fed.infer.stein import adagrad_momentum
    >>> # N(0, 1) prior, two clients with L_k(x) = (x - 2)^2 / 2: the posterior is N(4/3, 1/3)
    >>> functions, stateful = client_functions(lambda x, block: x - block)
    >>> federation = InProcess().start(ClientProgram.stacked(functions, jnp.array([2.0, 2.0])))
    >>> optim = adagrad_momentum(0.1)
    >>> step = build_kernel(lambda x: x, optim, num_steps=500)
    >>> x0 = jax.random.normal(jax.random.PRNGKey(0), (50, 1))
    >>> state, info = step(jax.random.PRNGKey(1), init(x0, optim), federation)
    >>> abs(float(state.particles.mean()) - 4 / 3) < 0.05
    True
    """
    prior_score = jax.vmap(lambda x: -prior_grad(x))

    def step(rng_key, state: SVGDRoundState, federation):
        def score(x, key):
            if stochastic:
                grads = federation.map("grad", x, per_client=(jax.random.split(key, federation.num_clients),))
            else:
                grads = federation.map("grad", x)
            return prior_score(x) - jnp.sum(grads, axis=0) / temperature

        kernel = svgd_core.build_kernel(score, optim, bandwidth)
        inner = svgd_core.SVGDState(state.particles, state.opt_state)
        inner, _ = lax.scan(lambda s, k: (kernel(k, s)[0], None), inner, jax.random.split(rng_key, num_steps))
        info = BaselineInfo(jnp.asarray(-1), rms_move(inner.particles, state.particles))
        return SVGDRoundState(inner.particles, inner.opt_state, state.round + 1), info

    return step
