"""The distributed SGLD core (Ahn et al. 2014), a baseline of the DSVGD paper: the server's
``N`` chains go to one scheduled client per round, which moves them with Langevin steps on
its data, its gradient scaled up to the whole data set, and returns them.

:func:`~numpyro_fed.infer.stein.fedavg.init` (the state is FedAvg's
:class:`~numpyro_fed.infer.stein.fedavg.ParticleState`), the client's function
(:func:`client_functions`) and the round ``step(rng_key, state, federation, client) ->
(state, info)`` (:func:`build_kernel`), written against the federation seam.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from numpyro_fed.infer.stein.dsvgd import batched_client_grad
from numpyro_fed.infer.stein.fedavg import BaselineInfo, ParticleState, rms_move

__all__ = ["build_kernel", "client_functions", "sgld_run", "step_size"]


def sgld_run(rng_key, particles, grad_potential: Callable, num_steps: int, step_size_fn: Callable, first_step):
    """``num_steps`` Langevin steps ``x <- x - (eps/2) grad U + N(0, eps)``, ``eps =
    step_size_fn(first_step + t)``; ``grad_potential(x, key)`` gets a fresh key per step
    (minibatches).

    >>> import jax, jax.numpy as jnp
    >>> x = sgld_run(jax.random.PRNGKey(0), jnp.zeros((2000, 1)), lambda x, key: x, 500,
    ...              lambda t: 0.05, 0)  # N(0, 1)
    >>> abs(float(x.var()) - 1.0) < 0.15
    True
    """

    def step(x, inputs):
        t, key = inputs
        k_noise, k_batch = jax.random.split(key)
        eps = step_size_fn(first_step + t)
        noise = jax.random.normal(k_noise, x.shape, x.dtype)
        return x - 0.5 * eps * grad_potential(x, k_batch) + jnp.sqrt(eps) * noise, None

    keys = jax.random.split(rng_key, num_steps)
    x, _ = lax.scan(step, particles, (jnp.arange(num_steps), keys))
    return x


def step_size(a0: float) -> Callable:
    """The paper's annealed step size ``t -> a0 (0.5 + t)^(-0.55)``, ``t`` the global step count."""
    return lambda t: a0 * (0.5 + t) ** -0.55


def client_functions(
    prior_grad: Callable,
    client_grad: Callable,
    *,
    num_local_steps: int,
    a0: float,
    stochastic_client_grad: Callable | None = None,
) -> tuple[dict, dict]:
    """What a distributed SGLD client runs, ``(functions, stateful)``: ``"update"``,
    ``(block, chains, scale, first_step, key) -> chains'``, ``num_local_steps`` Langevin steps
    on ``grad U ≈ grad(-log p_0) + scale grad L_k`` (``scale``: ``n / n_k / alpha``, from the
    server) with step sizes :func:`step_size` from the global step ``first_step``; ``key``: the
    noise (and the minibatches of ``stochastic_client_grad``). It keeps no state."""
    prior = jax.vmap(prior_grad)
    grad = batched_client_grad(client_grad, stochastic_client_grad)
    stochastic = stochastic_client_grad is not None
    step_size_fn = step_size(a0)

    def update(block, chains, scale, first_step, key):
        def grad_potential(p, step_key):
            return prior(p) + scale * grad(p, block, step_key if stochastic else None)

        return sgld_run(key, chains, grad_potential, num_local_steps, step_size_fn, first_step)

    return {"update": update}, {}


def build_kernel(client_sizes, *, num_local_steps: int, temperature: float = 1.0) -> Callable:
    """One round of distributed SGLD: ``step(rng_key, state, federation, client) -> (state,
    info)``. The server sends the scheduled ``client`` the chains, the scale of its gradient
    (``n / n_k / temperature``, from the public ``client_sizes``, ``(K,)``), the global step
    count and the round's key through ``federation`` (started on :func:`client_functions`);
    the client returns the moved chains."""
    sizes = jnp.asarray(client_sizes)

    def step(rng_key, state: ParticleState, federation, client):
        x0 = state.particles
        scale = jnp.sum(sizes).astype(x0.dtype) / sizes[client].astype(x0.dtype) / temperature
        x = federation.one("update", client, x0, scale, state.round * num_local_steps, rng_key)
        return ParticleState(x, state.round + 1), BaselineInfo(jnp.asarray(client), rms_move(x, x0))

    return step
