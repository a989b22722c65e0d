"""Gradient-based decentralized samplers, the baselines of the D-ADMMS paper (Section 6.1):
their pure cores.

All three run one agent per client on a communication graph, exchange iterates with the
neighbors once per iteration, and use full local gradients of ``f_i`` (the client's
potential plus its share of the prior, see :mod:`numpyro_fed.infer.admm.agents`):

* **D-SGLD** (Gürbüzbalaban et al. 2021), Eq. (22):
  ``x_i <- sum_j S_ij x_j - eta grad f_i(x_i) + sqrt(2 eta) w_i``;
* **D-SGHMC** (Gürbüzbalaban et al. 2021), Eqs. (23)-(24):
  ``v_i <- v_i - eta (gamma v_i + grad f_i(x_i)) + sqrt(2 gamma eta) w_i``,
  ``x_i <- sum_j S_ij x_j + eta v_i``;
* **D-ULA** (Parayil et al. 2021), Eq. (25):
  ``x_i <- x_i - zeta_k sum_{j in N_i} (x_i - x_j) - alpha_k N grad f_i(x_i) + sqrt(2 alpha_k) w_i``
  with ``w_i ~ N(0, N I)``, ``alpha_k = alpha_0 / (230 + k)^chi_2``,
  ``zeta_k = zeta_0 / (230 + k)^chi_1``.

``S`` is the doubly stochastic Metropolis matrix of the graph
(:func:`~numpyro_fed.infer.admm.topology.metropolis_weights`). Each algorithm is
``init_<name>(x) -> state`` (the agents' own states, stacked) and ``build_<name>_program(...)``,
what each agent runs (an :class:`~numpyro_fed.federation.decentralized.AgentProgram`): every
agent updates from its own gradient, its own noise (drawn from its own key) and its
neighbors' iterates, on any network (:meth:`Federation.agent_network
<numpyro_fed.federation.Federation.agent_network>`: in this process or one Ray actor per
agent).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from numpyro_fed._checks import check_positive, check_real
from numpyro_fed.federation.decentralized import AgentProgram, neighbors
from numpyro_fed.infer.admm.agents import AgentPotentials, attach_block

__all__ = [
    "GradientInfo",
    "SGHMCState",
    "SGLDState",
    "ULAState",
    "build_dsghmc_program",
    "build_dsgld_program",
    "build_dula_program",
    "init_dsghmc",
    "init_dsgld",
    "init_dula",
    "largest_curvatures",
]


class SGLDState(NamedTuple):
    """:ivar x: ``(N, d)`` the agents' iterates."""

    x: jax.Array


class SGHMCState(NamedTuple):
    """:ivar x: ``(N, d)`` iterates; :ivar v: ``(N, d)`` momenta (zero at the start)."""

    x: jax.Array
    v: jax.Array


class ULAState(NamedTuple):
    """:ivar x: ``(N, d)`` iterates; :ivar k: ``(N,)`` each agent's iteration counter (for the
    step sizes)."""

    x: jax.Array
    k: jax.Array


class GradientInfo(NamedTuple):
    """:ivar primal_residual: ``(N,)`` ``sqrt(sum_{j in N_i} ||x_i - x_j||^2)`` after the step."""

    primal_residual: jax.Array


def init_dsgld(x) -> SGLDState:
    """D-SGLD's state at the agents' iterates ``x`` (``(N, d)``)."""
    return SGLDState(jnp.asarray(x))


def init_dsghmc(x) -> SGHMCState:
    """D-SGHMC's state at ``x`` (``(N, d)``), momenta zero."""
    x = jnp.asarray(x)
    return SGHMCState(x, jnp.zeros_like(x))


def init_dula(x) -> ULAState:
    """D-ULA's state at ``x`` (``(N, d)``), every agent at iteration 0.

    >>> init_dula(jnp.ones((3, 2))).k.shape
    (3,)
    """
    x = jnp.asarray(x)
    return ULAState(x, jnp.zeros(x.shape[0], x.dtype))


def largest_curvatures(potentials: AgentPotentials, x, *, iterations: int = 30, rng_key=None):
    """``(N,)`` the largest absolute eigenvalue of each agent's Hessian at ``x`` (``(d,)``),
    by power iteration on Hessian-vector products (an estimate from below).

    >>> pots = AgentPotentials(lambda x, b, w: b * jnp.sum(x**2), jnp.array([1.0, 3.0]),
    ...                        jnp.array([0.5, 0.5]), 2, 2)
    >>> largest_curvatures(pots, jnp.zeros(2)).round(6).tolist()
    [2.0, 6.0]
    """
    if rng_key is None:
        rng_key = jax.random.PRNGKey(0)
    x = jnp.asarray(x)
    grad = jax.grad(potentials.fn)
    start = jax.random.normal(rng_key, x.shape, dtype=x.dtype)
    tiny = jnp.finfo(x.dtype).tiny

    def one(block, weight):  # runs where the agent lives: returns one number
        def hvp(u):
            return jax.jvp(lambda y: grad(y, block, weight), (x,), (u,))[1]

        def body(_, u):
            h = hvp(u)
            return h / jnp.maximum(jnp.linalg.norm(h), tiny)

        u = lax.fori_loop(0, iterations, body, start / jnp.linalg.norm(start))
        return jnp.linalg.norm(hvp(u))

    return potentials.per_agent("curvature", one)


def _graph_of(mixing):
    return ((mixing != 0) & ~jnp.eye(mixing.shape[0], dtype=bool)).astype(mixing.dtype)


def _residual(x_new, inbox, mask):
    weight = mask.astype(x_new.dtype)
    return jnp.sqrt(jnp.sum(weight * jnp.sum((x_new[None] - inbox) ** 2, axis=1)))


def _mixing_rows(mixing):
    """Each agent's own weight ``S_ii`` (``(N,)``) and its neighbours' ``(N, D)``, in the
    order of its inbox (see :func:`~numpyro_fed.federation.decentralized.neighbors`)."""
    mixing = np.asarray(mixing)
    index, valid = neighbors(_graph_of(jnp.asarray(mixing)))
    rows = np.where(valid, mixing[np.arange(mixing.shape[0])[:, None], index], 0.0)
    return np.diag(mixing).copy(), rows


def _mixing_local(potentials: AgentPotentials, mixing):
    """The gradient of an agent's potential and its local inputs for a mixing sampler: its
    block, its share of the prior, its own weight and its row of ``S``'s neighbor weights."""
    own_weight, neighbor_weights = _mixing_rows(mixing)
    dtype = potentials.prior_weights.dtype
    local = (
        potentials.data,
        potentials.prior_weights,
        jnp.asarray(own_weight, dtype),
        jnp.asarray(neighbor_weights, dtype),
    )
    return jax.grad(potentials.fn), local


def build_dsgld_program(potentials: AgentPotentials, mixing, step_size: float) -> AgentProgram:
    """D-SGLD, Eq. (22), as an :class:`~numpyro_fed.federation.decentralized.AgentProgram`:
    agent ``i`` sends its iterate (``d`` floats) to its neighbours each iteration and mixes
    what it holds with the weights of its row of ``S``; its noise comes from its own key.
    Own state: :class:`SGLDState` (one row).

    :param mixing: ``(N, N)`` doubly stochastic matrix ``S``.
    :param float step_size: ``eta``.

    **Example** (three agents, each ``f_i(x) = x^2 / 6``: together a standard normal), run in
    this process by :class:`~numpyro_fed.federation.InProcess`'s network:

    >>> import jax, jax.numpy as jnp
    >>> from numpyro_fed.federation import InProcess
    >>> from numpyro_fed.infer.admm import make_topology, metropolis_weights
    >>> pots = AgentPotentials(lambda x, b, w: jnp.sum(x**2) / 6, jnp.zeros(3), jnp.full(3, 1 / 3), 3, 1)
    >>> topology = make_topology("ring", 3)
    >>> network = InProcess().agent_network(build_dsgld_program(pots, metropolis_weights(topology), 0.05),
    ...                                     topology.adjacency)
    >>> def run(state, t):
    ...     state, info = network.step(jax.random.PRNGKey(0), t, state)
    ...     return state, state.own.x[0, 0]
    >>> _, draws = jax.lax.scan(run, network.start(init_dsgld(jnp.zeros((3, 1)))), jnp.arange(4000))
    >>> bool(0.7 < draws[500:].std() < 1.5)  # agent 0's draws: about N(0, 1)
    True
    """
    step_size = check_positive(step_size, "step_size")
    grad, local = _mixing_local(potentials, mixing)

    def send(local, key, own, inbox, mask):
        block, prior_weight, self_weight, weights = local
        w = jax.random.normal(key, own.x.shape, dtype=own.x.dtype)
        received = self_weight * own.x + weights @ inbox
        x_new = received - step_size * grad(own.x, block, prior_weight) + jnp.sqrt(2.0 * step_size) * w
        return x_new, x_new

    def receive(local, x_new, inbox, previous_inbox, mask):
        return SGLDState(x_new), GradientInfo(_residual(x_new, inbox, mask))

    return AgentProgram(lambda own: own.x, send, receive, local, attach_block if potentials.deployed else None)


def build_dsghmc_program(potentials: AgentPotentials, mixing, step_size: float, friction: float) -> AgentProgram:
    """D-SGHMC, Eqs. (23)-(24), as an agent program (see :func:`build_dsgld_program`); own
    state :class:`SGHMCState`.

    :param mixing: ``(N, N)`` doubly stochastic matrix ``S``.
    :param float step_size: ``eta``.
    :param float friction: ``gamma``.
    """
    step_size = check_positive(step_size, "step_size")
    friction = check_positive(friction, "friction")
    grad, local = _mixing_local(potentials, mixing)

    def send(local, key, own, inbox, mask):
        block, prior_weight, self_weight, weights = local
        w = jax.random.normal(key, own.x.shape, dtype=own.x.dtype)
        v_new = (
            own.v
            - step_size * (friction * own.v + grad(own.x, block, prior_weight))
            + jnp.sqrt(2.0 * friction * step_size) * w
        )
        x_new = self_weight * own.x + weights @ inbox + step_size * v_new
        return SGHMCState(x_new, v_new), x_new

    def receive(local, pending, inbox, previous_inbox, mask):
        return pending, GradientInfo(_residual(pending.x, inbox, mask))

    return AgentProgram(lambda own: own.x, send, receive, local, attach_block if potentials.deployed else None)


def build_dula_program(
    potentials: AgentPotentials, *, alpha0: float, zeta0: float, chi1: float, chi2: float, offset: float = 230.0
) -> AgentProgram:
    """D-ULA, Eq. (25), as an agent program (see :func:`build_dsgld_program`); own state
    :class:`ULAState` (:func:`init_dula`) with one iteration counter per agent.

    :param float alpha0: gradient step ``alpha_k = alpha0 / (offset + k)^chi2``.
    :param float zeta0: consensus step ``zeta_k = zeta0 / (offset + k)^chi1``.
    """
    alpha0, zeta0 = check_positive(alpha0, "alpha0"), check_real(zeta0, "zeta0")
    chi1, chi2, offset = check_real(chi1, "chi1"), check_real(chi2, "chi2"), check_positive(offset, "offset")
    if zeta0 < 0:
        raise ValueError(f"zeta0 must be >= 0, got {zeta0}")
    n = potentials.num_agents
    grad = jax.grad(potentials.fn)
    local = (potentials.data, potentials.prior_weights)

    def send(local, key, own, inbox, mask):
        block, prior_weight = local
        x, k = own
        degree = jnp.sum(mask, dtype=x.dtype)
        alpha = alpha0 / (offset + k) ** chi2
        zeta = zeta0 / (offset + k) ** chi1
        w = jnp.sqrt(n) * jax.random.normal(key, x.shape, dtype=x.dtype)  # w ~ N(0, N I)
        x_new = (
            x
            - zeta * (degree * x - jnp.sum(inbox, axis=0))
            - alpha * n * grad(x, block, prior_weight)
            + jnp.sqrt(2.0 * alpha) * w
        )
        return ULAState(x_new, k + 1), x_new

    def receive(local, pending, inbox, previous_inbox, mask):
        return pending, GradientInfo(_residual(pending.x, inbox, mask))

    return AgentProgram(lambda own: own.x, send, receive, local, attach_block if potentials.deployed else None)
