"""Cores of the point-estimate and Langevin baselines: FedAvg's local descent and distributed
SGLD's local Langevin steps."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["descend", "sgld_run"]


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
