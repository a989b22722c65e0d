"""The agents of a decentralized sampler: what each one knows and what crosses the graph.

Every agent ``i`` (one per client) holds the local potential

    f_i(x) = client_potential_i(x) + w_i * prior_potential(x),   sum_i w_i = 1,

on the flat unconstrained latent vector ``x`` (``w_i = 1/N`` by default, as in Eq. (27) of
the D-ADMMS paper), so that ``sum_i f_i`` is NumPyro's potential energy. The algorithm
cores (:mod:`~numpyro_fed.infer.admm.dadmms`, :mod:`~numpyro_fed.infer.admm.gradient`) see
only :class:`AgentPotentials`, and are what one agent runs from its own data block, its own
state and the messages of its neighbors (an
:class:`~numpyro_fed.federation.decentralized.AgentProgram`); what crosses the graph is the
network's (:meth:`Federation.agent_network <numpyro_fed.federation.Federation.agent_network>`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

import jax
import jax.numpy as jnp

__all__ = ["AgentPotentials", "agent_potentials", "attach_block"]


class AgentPotentials(NamedTuple):
    """The agents' local potentials as one vmappable function.

    :ivar fn: ``(x, block, prior_weight) -> f_i(x)`` for a flat ``x`` of shape ``(d,)``,
        an agent's data block and its share of the prior.
    :ivar data: the stacked client blocks (leading axis ``N``).
    :ivar prior_weights: ``(N,)`` shares of the prior, summing to one.
    :ivar int num_agents: ``N``.
    :ivar int dim: ``d``.
    :ivar ask: deployment on workers (``data`` is ``None``: the agents loaded their own rows
        where they live): ``ask(name, fn, *broadcast) -> (N, ...)``, each agent's
        ``fn(block, prior_weight, *broadcast)`` computed where it lives and sent back (a named
        set-up call, counted in the federation's ledger). ``None`` otherwise.

    >>> pots = AgentPotentials(lambda x, b, w: 0.5 * jnp.sum((x - b) ** 2),
    ...                        jnp.array([0.0, 1.0]), jnp.array([0.5, 0.5]), 2, 1)
    >>> pots.values(jnp.zeros((2, 1))).tolist(), float(pots.total(jnp.ones(1)))
    ([0.0, 0.5], 0.5)
    """

    fn: Callable
    data: Any
    prior_weights: jax.Array
    num_agents: int
    dim: int
    ask: Callable | None = None

    @property
    def deployed(self) -> bool:
        """Whether the agents' blocks are out of this process (only :meth:`per_agent` reaches
        them)."""
        return self.data is None

    def per_agent(self, name: str, fn: Callable, *broadcast):
        """``(N, ...)``: every agent's ``fn(block, prior_weight, *broadcast)``, computed where
        the agent's block is (``vmap``-ped here, or on the agents' workers in deployment,
        where ``name`` labels the set-up call in the ledger).

        >>> pots = AgentPotentials(lambda x, b, w: 0.5 * jnp.sum((x - b) ** 2),
        ...                        jnp.array([0.0, 1.0]), jnp.array([0.5, 0.5]), 2, 1)
        >>> pots.per_agent("size", lambda block, w, s: s * block + w, 2.0).tolist()
        [0.5, 2.5]
        """
        if self.ask is not None:
            return self.ask(name, fn, *broadcast)
        if self.data is None:
            raise ValueError("these agents' blocks are on their workers and no federation reaches them")
        in_axes = (0, 0) + (None,) * len(broadcast)
        return jax.jit(jax.vmap(fn, in_axes=in_axes))(self.data, self.prior_weights, *broadcast)

    def values(self, x):
        """``(N,)`` local potentials at the agents' iterates ``x`` of shape ``(N, d)``."""
        return jax.vmap(self.fn)(x, self.data, self.prior_weights)

    def grads(self, x):
        """``(N, d)`` gradients of the local potentials at ``x`` of shape ``(N, d)``."""
        return jax.vmap(jax.grad(self.fn))(x, self.data, self.prior_weights)

    def total(self, x):
        """The global potential ``sum_i f_i(x)`` at one point ``x`` of shape ``(d,)``."""
        return jnp.sum(jax.vmap(self.fn, in_axes=(None, 0, 0))(x, self.data, self.prior_weights))


def agent_potentials(potential, prior_weights=None, *, data=None, ask=None) -> AgentPotentials:
    """The agents' local potentials of a :class:`~numpyro_fed.FederatedPotential`.

    :param prior_weights: ``None`` (the prior split evenly, ``w_i = 1/N``) or ``(N,)``
        non-negative shares summing to one (e.g. all of it on one agent).
    :param data: deployment in this process: the clients' stacked blocks as their loaders
        built them (e.g. ``InProcess(loader=...)``'s ``blocks``).
    :param ask: deployment on workers: see :attr:`AgentPotentials.ask` (the agents' blocks
        stay where they are).

    >>> import numpyro, numpyro.distributions as dist
    >>> import numpyro_fed as nf
    >>> def model(y):
    ...     mu = numpyro.sample("mu", dist.Normal(0, 1))
    ...     with nf.federated_plate("data", y.shape[0], clients=2):
    ...         numpyro.sample("y", dist.Normal(mu, 1), obs=y)
    >>> pots = agent_potentials(nf.split_potential(model, (jnp.arange(4.0),)))
    >>> pots.num_agents, pots.dim, pots.prior_weights.tolist()
    (2, 1, [0.5, 0.5])
    """
    n = potential.num_clients
    if prior_weights is None:
        weights = np.full(n, 1.0 / n)
    else:
        weights = np.asarray(prior_weights, dtype=float)
        if weights.shape != (n,):
            raise ValueError(f"prior_weights must have shape ({n},) (one per client), got {weights.shape}")
        if not np.all(np.isfinite(weights)) or np.any(weights < 0) or not np.isclose(weights.sum(), 1.0):
            raise ValueError(f"prior_weights must be non-negative and sum to one, got {weights.tolist()}")

    flat = potential.flat()
    # the functions only: a closure over `flat` would hold every client's block
    client_potential, prior_potential = flat.client_potential, flat.prior_potential

    def fn(x, block, prior_weight):
        return client_potential(x, block) + prior_weight * prior_potential(x)

    if data is None:
        data = flat.client_data  # None in deployment
    return AgentPotentials(fn, data, jnp.asarray(weights), n, flat.num_latent, ask)


def attach_block(block, local):
    """``(block,) + local[1:]``: an agent's local in deployment, whose first element (``None``
    on the driver) is the block the agent loaded where it lives (see
    :attr:`~numpyro_fed.federation.decentralized.AgentProgram.attach`).

    >>> attach_block("rows", (None, 0.5))
    ('rows', 0.5)
    """
    return (block,) + tuple(local[1:])
