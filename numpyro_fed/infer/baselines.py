"""Gradient-based decentralised samplers: the baselines of the D-ADMMS paper (Section 6.1).

All three run one agent per client on a communication graph, exchange iterates with the
neighbours once per iteration, and use full local gradients of ``f_i`` (the client's
potential plus its share of the prior, see :mod:`numpyro_fed.infer.agents`):

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
(:func:`~numpyro_fed.infer.topology.metropolis_weights`). Defaults are the paper's
hyper-parameters for its linear regression (Section 6.2.2); its logistic regression
(Section 6.3.2) uses ``eta = 0.0003`` (D-SGLD) and ``eta = 0.02, gamma = 30`` (D-SGHMC).
Like :class:`~numpyro_fed.DADMMS`, one MCMC sample is one iteration of all agents, reported
as one agent's iterate (``agent=0`` by default); every agent's iterates and the network
average are recorded beside it (:meth:`~numpyro_fed.infer.agents.DecentralisedKernel.agent_draws`,
:meth:`~numpyro_fed.infer.agents.DecentralisedKernel.network_average`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple
import warnings

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from numpyro_fed._checks import check_positive, check_real
from numpyro_fed.infer.agents import AgentPotentials, DecentralisedKernel
from numpyro_fed.infer.topology import metropolis_weights

__all__ = [
    "DSGHMC",
    "DSGLD",
    "DULA",
    "GradientInfo",
    "SGHMCState",
    "SGLDState",
    "ULAState",
    "build_dsghmc_kernel",
    "build_dsgld_kernel",
    "build_dula_kernel",
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
    """:ivar x: ``(N, d)`` iterates; :ivar k: iteration counter (for the step sizes)."""

    x: jax.Array
    k: jax.Array


class GradientInfo(NamedTuple):
    """:ivar primal_residual: ``(N,)`` ``sqrt(sum_{j in N_i} ||x_i - x_j||^2)`` after the step."""

    primal_residual: jax.Array


def _residual(adjacency, x):
    degrees = jnp.sum(adjacency, axis=1)
    sq = jnp.sum(x**2, axis=1)
    total = degrees * sq - 2.0 * jnp.sum(x * (adjacency @ x), axis=1) + adjacency @ sq
    return jnp.sqrt(jnp.maximum(total, 0.0))


def largest_curvatures(potentials: AgentPotentials, x, *, iterations: int = 30, rng_key=None):
    """``(N,)`` the largest absolute eigenvalue of each agent's Hessian at ``x`` (``(d,)``),
    by power iteration on Hessian-vector products (an estimate from below)."""
    if rng_key is None:
        rng_key = jax.random.PRNGKey(0)
    x = jnp.asarray(x)
    grad = jax.grad(potentials.fn)
    start = jax.random.normal(rng_key, x.shape, dtype=x.dtype)
    tiny = jnp.finfo(x.dtype).tiny

    def one(block, weight):
        def hvp(u):
            return jax.jvp(lambda y: grad(y, block, weight), (x,), (u,))[1]

        def body(_, u):
            h = hvp(u)
            return h / jnp.maximum(jnp.linalg.norm(h), tiny)

        u = lax.fori_loop(0, iterations, body, start / jnp.linalg.norm(start))
        return jnp.linalg.norm(hvp(u))

    return jax.jit(jax.vmap(one))(potentials.data, potentials.prior_weights)


def _warn_unstable(name, potentials, x0, gain, advice):
    """Warns when ``gain(curvature) >= 1`` for the stiffest agent at the starting point: the
    linearised update is then unstable. On a quadratic potential the iterates then run away;
    elsewhere they may settle where the curvature is lower (e.g. logistic regression away
    from zero), so this is a warning, and :meth:`check_run` reports runs that did diverge."""
    curvatures = np.asarray(largest_curvatures(potentials, x0))
    if not np.all(np.isfinite(curvatures)):
        return
    agent = int(np.argmax(curvatures))
    curvature = float(curvatures[agent])
    if gain(curvature) >= 1.0:
        warnings.warn(
            f"{name}: the largest curvature of an agent's potential at the starting point is "
            f"{curvature:.3g} (agent {agent}); with these step sizes the update linearised there is "
            f"unstable, so the iterates may run away (they do on a Gaussian model): {advice(curvature)}",
            RuntimeWarning,
            stacklevel=4,
        )


def build_dsgld_kernel(potentials: AgentPotentials, mixing, step_size: float) -> Callable:
    """D-SGLD, Eq. (22): ``kernel(rng_key, SGLDState) -> (SGLDState, GradientInfo)``.

    :param mixing: ``(N, N)`` doubly stochastic matrix ``S``.
    """
    step_size = check_positive(step_size, "step_size")
    mixing = jnp.asarray(mixing, dtype=potentials.prior_weights.dtype)
    adjacency = (mixing != 0) & ~jnp.eye(mixing.shape[0], dtype=bool)

    def kernel(rng_key, state):
        x = state.x
        w = jax.random.normal(rng_key, x.shape, dtype=x.dtype)
        x_new = mixing @ x - step_size * potentials.grads(x) + jnp.sqrt(2.0 * step_size) * w
        return SGLDState(x_new), GradientInfo(_residual(adjacency.astype(x.dtype), x_new))

    return kernel


def build_dsghmc_kernel(potentials: AgentPotentials, mixing, step_size: float, friction: float) -> Callable:
    """D-SGHMC, Eqs. (23)-(24): ``kernel(rng_key, SGHMCState) -> (SGHMCState, GradientInfo)``."""
    step_size = check_positive(step_size, "step_size")
    friction = check_positive(friction, "friction")
    mixing = jnp.asarray(mixing, dtype=potentials.prior_weights.dtype)
    adjacency = (mixing != 0) & ~jnp.eye(mixing.shape[0], dtype=bool)

    def kernel(rng_key, state):
        x, v = state
        w = jax.random.normal(rng_key, x.shape, dtype=x.dtype)
        v_new = v - step_size * (friction * v + potentials.grads(x)) + jnp.sqrt(2.0 * friction * step_size) * w
        x_new = mixing @ x + step_size * v_new
        return SGHMCState(x_new, v_new), GradientInfo(_residual(adjacency.astype(x.dtype), x_new))

    return kernel


def build_dula_kernel(potentials: AgentPotentials, adjacency, *, alpha0: float, zeta0: float,
                      chi1: float, chi2: float, offset: float = 230.0) -> Callable:
    """D-ULA, Eq. (25): ``kernel(rng_key, ULAState) -> (ULAState, GradientInfo)``."""
    alpha0, zeta0 = check_positive(alpha0, "alpha0"), check_real(zeta0, "zeta0")
    chi1, chi2, offset = check_real(chi1, "chi1"), check_real(chi2, "chi2"), check_positive(offset, "offset")
    if zeta0 < 0:
        raise ValueError(f"zeta0 must be >= 0, got {zeta0}")
    adjacency = jnp.asarray(adjacency, dtype=potentials.prior_weights.dtype)
    degrees = jnp.sum(adjacency, axis=1)
    n = potentials.num_agents

    def kernel(rng_key, state):
        x, k = state
        alpha = alpha0 / (offset + k) ** chi2
        zeta = zeta0 / (offset + k) ** chi1
        w = jnp.sqrt(n) * jax.random.normal(rng_key, x.shape, dtype=x.dtype)  # w ~ N(0, N I)
        disagreement = degrees[:, None] * x - adjacency @ x
        x_new = x - zeta * disagreement - alpha * n * potentials.grads(x) + jnp.sqrt(2.0 * alpha) * w
        return ULAState(x_new, k + 1), GradientInfo(_residual(adjacency, x_new))

    return kernel


class DSGLD(DecentralisedKernel):
    """Decentralised SGLD (Eq. (22)) with Metropolis weights, as an ``MCMCKernel``.

    :param float step_size: ``eta`` (the paper: 0.009 for linear regression, 0.0003 for
        logistic regression).

    Other arguments (``topology``, ``prior_weights``, ``init_scale``, ``partition``,
    ``agent``) and the output are those of :class:`~numpyro_fed.DADMMS`.

    >>> import jax, numpyro, numpyro.distributions as dist
    >>> from numpyro.infer import MCMC
    >>> import numpyro_fed as nf
    >>> def model(y):
    ...     mu = numpyro.sample("mu", dist.Normal(0, 10))
    ...     with nf.federated_plate("data", y.shape[0], clients=4):
    ...         numpyro.sample("y", dist.Normal(mu, 1), obs=y)
    >>> mcmc = MCMC(nf.DSGLD(model, topology="ring"), num_warmup=0, num_samples=20, progress_bar=False)
    >>> mcmc.run(jax.random.PRNGKey(0), jax.numpy.zeros(40))
    >>> mcmc.get_samples()["mu"].shape, nf.DSGLD.agent_draws(mcmc)["mu"].shape
    ((20,), (20, 4))
    """

    info_names = GradientInfo._fields

    def __init__(self, model, *, topology="ring", step_size: float = 0.009, prior_weights=None,
                 init_scale: float = 1.0, partition=None, agent: int = 0):
        super().__init__(model, topology=topology, prior_weights=prior_weights, init_scale=init_scale,
                         partition=partition, agent=agent)
        self.step_size = check_positive(step_size, "step_size")

    @property
    def divergence_advice(self):
        return f"lower step_size (now {self.step_size:g})"

    def _build(self, potentials, topology, x0):
        # x' = x - eta f''(x) x on the consensus direction: stable for eta * curvature < 2
        _warn_unstable("DSGLD", potentials, x0, lambda c: self.step_size * c / 2.0,
                       lambda c: f"use step_size below {2.0 / c:.2g} (now {self.step_size:g}), e.g. {0.2 / c:.2g}")
        kernel = build_dsgld_kernel(potentials, metropolis_weights(topology.adjacency), self.step_size)
        return SGLDState, kernel


class DSGHMC(DecentralisedKernel):
    """Decentralised SGHMC (Eqs. (23)-(24)) with Metropolis weights, as an ``MCMCKernel``.

    :param float step_size: ``eta`` (the paper: 0.1 for linear, 0.02 for logistic regression).
    :param float friction: ``gamma`` (the paper: 7 for linear, 30 for logistic regression).

    Momenta start at zero. Other arguments as :class:`DSGLD`.
    """

    info_names = GradientInfo._fields

    def __init__(self, model, *, topology="ring", step_size: float = 0.1, friction: float = 7.0,
                 prior_weights=None, init_scale: float = 1.0, partition=None, agent: int = 0):
        super().__init__(model, topology=topology, prior_weights=prior_weights, init_scale=init_scale,
                         partition=partition, agent=agent)
        self.step_size = check_positive(step_size, "step_size")
        self.friction = check_positive(friction, "friction")

    @property
    def divergence_advice(self):
        return f"lower step_size (now {self.step_size:g})"

    def _build(self, potentials, topology, x0):
        # the scalar linearisation (v, x) -> ((1 - eta gamma) v - eta c x, x + eta v') is stable
        # iff eta gamma < 2 and eta^2 c < 2 (2 - eta gamma) (Jury's conditions)
        eta, gamma = self.step_size, self.friction
        _warn_unstable("DSGHMC", potentials, x0,
                       lambda c: max(eta * gamma / 2.0, eta**2 * c / max(2.0 * (2.0 - eta * gamma), 1e-300)),
                       lambda c: f"lower step_size (now {eta:g}) so that step_size * friction < 2 and "
                                 f"step_size^2 * {c:.3g} < 2 (2 - step_size * friction)")
        kernel = build_dsghmc_kernel(potentials, metropolis_weights(topology.adjacency), self.step_size,
                                     self.friction)
        return (lambda x: SGHMCState(x, jnp.zeros_like(x))), kernel


class DULA(DecentralisedKernel):
    """Decentralised ULA (Eq. (25)) with decaying step sizes, as an ``MCMCKernel``.

    ``alpha_k = alpha0 / (230 + k)^chi2`` and ``zeta_k = zeta0 / (230 + k)^chi1``, ``k``
    counting iterations from the start (warm-up included).

    :param float alpha0: 0.00082 in the paper.
    :param float zeta0: 0.48 in the paper.
    :param float chi1: ``None``: the paper's choice, 0.55 on a complete graph, else 0.05.
    :param float chi2: 0.05 in the paper.

    Other arguments as :class:`DSGLD`.
    """

    info_names = GradientInfo._fields
    divergence_advice = "lower alpha0 or zeta0"

    def __init__(self, model, *, topology="ring", alpha0: float = 0.00082, zeta0: float = 0.48,
                 chi1: float | None = None, chi2: float = 0.05, prior_weights=None, init_scale: float = 1.0,
                 partition=None, agent: int = 0):
        super().__init__(model, topology=topology, prior_weights=prior_weights, init_scale=init_scale,
                         partition=partition, agent=agent)
        self.alpha0 = check_positive(alpha0, "alpha0")
        self.zeta0 = check_real(zeta0, "zeta0")
        if self.zeta0 < 0:
            raise ValueError(f"zeta0 must be >= 0, got {zeta0}")
        self.chi1 = None if chi1 is None else check_real(chi1, "chi1")
        self.chi2 = check_real(chi2, "chi2")

    def _build(self, potentials, topology, x0):
        chi1 = self.chi1
        if chi1 is None:
            chi1 = 0.55 if topology.num_edges == topology.num_agents * (topology.num_agents - 1) // 2 and topology.num_agents > 2 else 0.05
        laplacian = np.diag(topology.degrees) - topology.adjacency
        zeta = self.zeta0 / 230.0**chi1
        if topology.num_edges and zeta * np.linalg.eigvalsh(laplacian).max() >= 2.0:
            warnings.warn(
                f"DULA: the first consensus step zeta_0 / 230^chi1 = {zeta:.3g} times the largest "
                f"Laplacian eigenvalue {np.linalg.eigvalsh(laplacian).max():.3g} is >= 2, so the "
                "consensus update diverges at first; lower zeta0 or raise chi1",
                RuntimeWarning,
                stacklevel=2,
            )
        # the first gradient step alpha_0 / 230^chi2 * N * f'': stable below 2
        first = self.alpha0 / 230.0**self.chi2 * topology.num_agents
        _warn_unstable("DULA", potentials, x0, lambda c: first * c / 2.0,
                       lambda c: f"lower alpha0 (now {self.alpha0:g}) below "
                                 f"{2.0 / (c * topology.num_agents) * 230.0**self.chi2:.2g}")
        kernel = build_dula_kernel(potentials, topology.adjacency, alpha0=self.alpha0, zeta0=self.zeta0,
                                   chi1=chi1, chi2=self.chi2)
        return (lambda x: ULAState(x, jnp.zeros((), x.dtype))), kernel
