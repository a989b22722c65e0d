"""Distributed ADMM-based sampler (D-ADMMS, Tzikas et al. 2024, Algorithm 1).

``N`` agents on an undirected graph sample from ``exp(-sum_i f_i(x))`` where agent ``i``
alone knows ``f_i`` (its client's potential plus its share of the prior). Each agent holds
an iterate ``x_i`` and a dual variable ``p_i`` (zero at the start). Per iteration, all agents
at once:

1. draw ``w_i ~ N(0, I)`` and solve the noisy proximal step

   .. math::

       x_i^{k+1} = \\arg\\min_x f_i(x) + p_i^\\top x + \\rho \\sum_{j \\in N_i}
       \\Bigl\\lVert x - \\frac{x_i^k + x_j^k}{2} + \\frac{\\sqrt 2}{2 \\rho} w_i \\Bigr\\rVert^2;

2. send ``x_i^{k+1}`` to their neighbours ``N_i``;
3. update ``p_i <- p_i + rho sum_{j in N_i} (x_i^{k+1} - x_j^{k+1})``.

Without the noise (``noise_scale=0``) this is consensus ADMM (C-ADMM), which converges to
the MAP on a connected graph. One noise draw per agent per iteration is shared by all of its
neighbour terms (Eq. (6)); an agent without neighbours has no noise and simply minimises its
own ``f_i + p_i^T x``.

The proximal step is solved in closed form when every ``f_i`` is quadratic (a Gaussian
likelihood and prior, e.g. linear regression), and otherwise by a damped Newton method in a
``lax.while_loop`` (warm-started at ``x_i^k``, with a tolerance and an iteration cap; the
inner iterations and non-convergence are reported per agent and iteration).

This module is the functional core (:func:`init`, :func:`build_kernel`, the solvers);
:class:`DADMMS` is the NumPyro face.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple
import math
import warnings

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from numpyro_fed._checks import check_int, check_positive, check_real
from numpyro_fed.infer.agents import AgentPotentials, DecentralisedKernel, agent_potentials

__all__ = [
    "ADMM",
    "ADMMInfo",
    "ADMMState",
    "DADMMS",
    "QuadraticPotentials",
    "build_kernel",
    "init",
    "newton_prox",
    "quadratic_potentials",
]


class ADMMState(NamedTuple):
    """State of the network.

    :ivar x: ``(N, d)`` the agents' primal iterates (the samples).
    :ivar p: ``(N, d)`` their dual variables.
    """

    x: jax.Array
    p: jax.Array


class ADMMInfo(NamedTuple):
    """Per-agent diagnostics of one iteration, each of shape ``(N,)``.

    :ivar primal_residual: ``sqrt(sum_{j in N_i} ||x_i - x_j||^2)``, the disagreement with
        the neighbours after the step.
    :ivar dual_residual: ``rho sqrt(sum_{j in N_i} ||z_ij^{k+1} - z_ij^k||^2)`` with the edge
        averages ``z_ij = (x_i + x_j) / 2``.
    :ivar inner_iterations: Newton iterations of the proximal step (0 in closed form).
    :ivar converged: whether the proximal step met its tolerance before the cap.
    """

    primal_residual: jax.Array
    dual_residual: jax.Array
    inner_iterations: jax.Array
    converged: jax.Array


class QuadraticPotentials(NamedTuple):
    """Quadratic local potentials ``f_i(x) = x^T H_i x / 2 + g_i^T x + const``.

    :ivar hessians: ``(N, d, d)``.
    :ivar gradients_at_zero: ``(N, d)`` (``g_i``).
    """

    hessians: jax.Array
    gradients_at_zero: jax.Array


def init(x) -> ADMMState:
    """The state at iterates ``x`` (``(N, d)``) with zero dual variables (Algorithm 1).

    >>> init(jnp.ones((3, 2))).p.shape
    (3, 2)
    """
    x = jnp.asarray(x)
    return ADMMState(x, jnp.zeros_like(x))


def quadratic_potentials(potentials: AgentPotentials, x, *, rng_key=None, rtol: float = 1e-6):
    """The agents' potentials as :class:`QuadraticPotentials` if they are quadratic, else ``None``.

    Each ``f_i`` is taken as quadratic when its Hessian at ``x`` predicts its gradient
    exactly (to ``rtol``) at three other points, near and far from ``x``.

    :param x: ``(d,)`` a point where every ``f_i`` is finite.
    """
    if rng_key is None:
        rng_key = jax.random.PRNGKey(0)
    x = jnp.asarray(x)
    grad = jax.grad(potentials.fn)
    hess = jax.hessian(potentials.fn)
    at = jax.jit(jax.vmap(lambda y, block, w: (grad(y, block, w), hess(y, block, w)), in_axes=(None, 0, 0)))
    g_x, h_x = at(x, potentials.data, potentials.prior_weights)
    if not (bool(jnp.all(jnp.isfinite(g_x))) and bool(jnp.all(jnp.isfinite(h_x)))):
        return None
    scales = jnp.array([0.1, 1.0, 10.0])
    directions = jax.random.normal(rng_key, (3, x.shape[0]), dtype=x.dtype)
    for scale, u in zip(scales, directions):
        y = x + scale * (1.0 + jnp.abs(x)) * u
        g_y, _ = at(y, potentials.data, potentials.prior_weights)
        predicted = g_x + jnp.einsum("nij,j->ni", h_x, y - x)
        tol = rtol * (1.0 + jnp.max(jnp.abs(g_y)) + jnp.max(jnp.abs(g_x)))
        if not bool(jnp.all(jnp.abs(g_y - predicted) <= tol)):
            return None
    h_x = (h_x + jnp.swapaxes(h_x, 1, 2)) / 2
    return QuadraticPotentials(h_x, g_x - jnp.einsum("nij,j->ni", h_x, x))


def newton_prox(fn: Callable, *, tolerance: float, max_iterations: int):
    """A damped Newton solver of the proximal problem

        min_x phi(x) = fn(x, *args) + p^T x + (c / 2) ||x - v||^2

    returning ``solve(x_start, v, p, c, *args) -> (x, iterations, converged)``. Steps are
    Newton steps, shortened to the longest of ``2^-k``, ``k`` in ``(0, 1, 2, 3, 5, 7, 10, 14,
    20, 30)``, that meets the Armijo condition (a gradient step if the Newton
    direction is not a descent direction); the solve stops when the step is below
    ``tolerance * (1 + max|x|)`` (converged) or after ``max_iterations`` steps.
    """
    grad = jax.grad(fn)
    hess = jax.hessian(fn)

    def solve(x_start, v, p, c, *args):
        dim = x_start.shape[0]
        eps = jnp.finfo(x_start.dtype).eps
        slack = 8 * eps

        def phi(x):
            return fn(x, *args) + p @ x + 0.5 * c * jnp.sum((x - v) ** 2)

        def newton_step(x):
            g = grad(x, *args) + p + c * (x - v)
            h = hess(x, *args) + c * jnp.eye(dim, dtype=x.dtype)
            step = -jnp.linalg.solve(h, g)
            slope = g @ step
            ok = jnp.all(jnp.isfinite(step)) & (slope < 0)
            step = jnp.where(ok, step, -g)
            slope = jnp.where(ok, slope, -(g @ g))
            return step, slope

        def cond(carry):
            _, k, done = carry
            return (~done) & (k < max_iterations)

        ladder = 0.5 ** jnp.asarray(_LADDER_EXPONENTS, dtype=x_start.dtype)

        def body(carry):
            x, k, _ = carry
            step, slope = newton_step(x)
            small = jnp.max(jnp.abs(step)) <= tolerance * (1.0 + jnp.max(jnp.abs(x)))
            phi_x = phi(x)
            # Backtracking on a fixed, sparse ladder of step lengths, evaluated at once: a while_loop
            # nested in this one never ended under vmap over agents and chains (seen with JAX 0.10.2).
            values = jax.vmap(lambda t: phi(x + t * step))(ladder)
            armijo = (values <= phi_x + 1e-4 * ladder * slope + slack * jnp.abs(phi_x)) & jnp.isfinite(values)
            # Near the minimum (squared Newton decrement below sqrt(eps) |phi|) phi cannot
            # resolve the decrease: take the full step, which is then quadratically convergent.
            full = small | (-slope <= jnp.sqrt(eps) * (1.0 + jnp.abs(phi_x)))
            t = jnp.where(full, 1.0, ladder[jnp.argmax(armijo)])
            t = jnp.where(full | jnp.any(armijo), t, ladder[-1])
            return x + t * step, k + 1, small

        x, k, done = lax.while_loop(cond, body, (x_start, jnp.zeros((), jnp.int32), jnp.zeros((), bool)))
        return x, k, done

    return solve


_LADDER_EXPONENTS = (0, 1, 2, 3, 5, 7, 10, 14, 20, 30)


def _neighbour_means(adjacency, degrees, x):
    """``(N, d)``: ``mean_{j in N_i} (x_i + x_j) / 2`` (zero for agents without neighbours)."""
    safe = jnp.maximum(degrees, 1.0)[:, None]
    return jnp.where(degrees[:, None] > 0, (degrees[:, None] * x + adjacency @ x) / (2.0 * safe), 0.0)


def _edge_norms(adjacency, degrees, a):
    """``(N,)``: ``sqrt(sum_{j in N_i} ||a_i - a_j||^2)``."""
    sq = jnp.sum(a**2, axis=1)
    total = degrees * sq - 2.0 * jnp.sum(a * (adjacency @ a), axis=1) + adjacency @ sq
    return jnp.sqrt(jnp.maximum(total, 0.0))


def _edge_sum_norms(adjacency, degrees, a):
    """``(N,)``: ``sqrt(sum_{j in N_i} ||a_i + a_j||^2)``."""
    sq = jnp.sum(a**2, axis=1)
    total = degrees * sq + 2.0 * jnp.sum(a * (adjacency @ a), axis=1) + adjacency @ sq
    return jnp.sqrt(jnp.maximum(total, 0.0))


def build_kernel(
    potentials: AgentPotentials,
    adjacency,
    rho: float,
    *,
    noise_scale: float = 1.0,
    quadratic: QuadraticPotentials | None = None,
    tolerance: float | None = None,
    max_iterations: int = 50,
) -> Callable:
    """One D-ADMMS iteration of all agents: ``kernel(rng_key, state) -> (state, info)``.

    :param AgentPotentials potentials: the agents' local potentials.
    :param adjacency: ``(N, N)`` symmetric 0/1 matrix (see
        :func:`~numpyro_fed.infer.topology.make_topology`).
    :param float rho: penalty parameter (> 0).
    :param float noise_scale: multiplies the proximal noise; 1 is D-ADMMS, 0 is C-ADMM.
    :param QuadraticPotentials quadratic: solve the proximal step in closed form with these
        (see :func:`quadratic_potentials`); ``None``: Newton's method.
    :param float tolerance: Newton's step tolerance (default ``1e-10`` in float64,
        ``1e-5`` in float32).
    :param int max_iterations: Newton's iteration cap per proximal step.

    **Example** (two agents, Gaussian potentials ``f_i(x) = (x - i)^2 / 2``, C-ADMM finds
    the minimiser of the sum):

    >>> import jax, jax.numpy as jnp
    >>> from numpyro_fed.infer.agents import AgentPotentials
    >>> pots = AgentPotentials(lambda x, b, w: 0.5 * jnp.sum((x - b) ** 2),
    ...                        jnp.array([0.0, 1.0]), jnp.array([0.5, 0.5]), 2, 1)
    >>> kernel = jax.jit(build_kernel(pots, jnp.array([[0.0, 1.0], [1.0, 0.0]]), 1.0, noise_scale=0.0))
    >>> state = init(jnp.zeros((2, 1)))
    >>> for _ in range(60):
    ...     state, info = kernel(jax.random.PRNGKey(0), state)
    >>> state.x.ravel().round(6).tolist()
    [0.5, 0.5]
    """
    rho = check_positive(rho, "rho")
    noise_scale = check_real(noise_scale, "noise_scale")
    if noise_scale < 0:
        raise ValueError(f"noise_scale must be >= 0, got {noise_scale}")
    max_iterations = check_int(max_iterations, "max_iterations", minimum=1)
    adjacency = jnp.asarray(adjacency, dtype=potentials.prior_weights.dtype)
    degrees = jnp.sum(adjacency, axis=1)
    curvature = 2.0 * rho * degrees  # c_i: the proximal term is (c_i / 2) ||x - v_i||^2
    noise_sd = noise_scale * math.sqrt(2.0) / (2.0 * rho)

    if quadratic is not None:
        dim = quadratic.hessians.shape[-1]
        systems = quadratic.hessians + curvature[:, None, None] * jnp.eye(dim, dtype=quadratic.hessians.dtype)
        inverses = jnp.linalg.inv(systems)

        def prox(x_start, v, p):
            rhs = curvature[:, None] * v - p - quadratic.gradients_at_zero
            x = jnp.einsum("nij,nj->ni", inverses, rhs)
            zeros = jnp.zeros(x.shape[0], jnp.int32)
            return x, zeros, jnp.ones(x.shape[0], bool)
    else:
        def prox(x_start, v, p):
            tol = tolerance
            if tol is None:
                tol = 1e-10 if x_start.dtype == jnp.float64 else 1e-5
            solve = newton_prox(potentials.fn, tolerance=tol, max_iterations=max_iterations)
            return jax.vmap(solve)(x_start, v, p, curvature, potentials.data, potentials.prior_weights)

    def kernel(rng_key, state: ADMMState):
        x, p = state
        w = jax.random.normal(rng_key, x.shape, dtype=x.dtype)
        v = _neighbour_means(adjacency, degrees, x) - noise_sd * w
        x_new, iterations, converged = prox(x, v, p)
        p_new = p + rho * (degrees[:, None] * x_new - adjacency @ x_new)
        info = ADMMInfo(
            primal_residual=_edge_norms(adjacency, degrees, x_new),
            dual_residual=0.5 * rho * _edge_sum_norms(adjacency, degrees, x_new - x),
            inner_iterations=iterations,
            converged=converged,
        )
        return ADMMState(x_new, p_new), info

    return kernel


_SOLVERS = ("auto", "quadratic", "newton")


class DADMMS(DecentralisedKernel):
    """Distributed ADMM-based sampler (D-ADMMS, Tzikas et al. 2024) as a NumPyro
    :class:`~numpyro.infer.mcmc.MCMCKernel`.

    One agent per client of the model's :class:`~numpyro_fed.federated_plate`; agent ``i``
    knows only its client's potential plus its share of the prior and talks only to its
    neighbours in ``topology``. One MCMC sample is one iteration of all agents, reported as
    the iterate of agent ``agent`` (0 by default): ``MCMC.get_samples()[site]`` has shape
    ``(num_samples, *site_shape)``, as for any NumPyro sampler, so
    :class:`~numpyro.infer.Predictive`, ``MCMC.print_summary()`` and
    :func:`~numpyro_fed.to_inference_data` work on it unchanged. :meth:`agent_draws` gives any
    agent's draws (or all of them) and :meth:`network_average` the average of the agents'
    iterates, a diagnostic of consensus that is narrower than the posterior. As in the paper,
    independent chains (``num_chains``, best with ``chain_method="vectorized"``) are
    independent runs of the network, and the law of the iterates across chains approaches
    D-ADMMS's limit as the iterations go on; ``num_warmup`` iterations are discarded.

    D-ADMMS is biased: the limit is not the posterior, and its spread depends on ``rho``
    and on how concentrated the posterior is (see the guide, "What a sample is": on a
    Gaussian posterior with 250 rows the iterates' sd is about 0.7 of the posterior's at
    ``rho = 5``).

    :param model: a NumPyro model with a :class:`~numpyro_fed.federated_plate`.
    :param topology: ``"ring"`` (default), ``"complete"``, ``"star"``, ``"none"``, an
        adjacency matrix or a networkx graph, one node per client (see
        :func:`~numpyro_fed.infer.topology.make_topology`).
    :param float rho: ADMM penalty (> 0); the paper uses 5.
    :param str solver: proximal solver: ``"auto"`` (closed form if every local potential
        is detected to be quadratic, else Newton), ``"quadratic"`` (closed form; an error if
        a potential is not quadratic) or ``"newton"``.
    :param float tolerance: Newton's step tolerance (default ``1e-10`` in float64, ``1e-5``
        in float32).
    :param int max_inner_iterations: Newton's iteration cap per proximal step.
    :param prior_weights: shares of the prior per agent (default ``1/N`` each, Eq. (27)).
    :param float init_scale: the agents start at ``N(0, init_scale^2 I)`` on the
        unconstrained space (the paper: ``N(0, I)``), unless ``init_params`` is given to
        ``MCMC.run`` (by site, shaped as the site or with a leading agent axis).
    :param float noise_scale: multiplies the proximal noise (1: D-ADMMS; 0: C-ADMM, see
        :class:`ADMM`).
    :param dict partition: as for :func:`~numpyro_fed.split_potential`.
    :param int agent: the agent whose iterates are the MCMC samples (default 0).

    Diagnostics per agent and iteration (``extra_fields``, and ``sample_stats`` of
    :func:`~numpyro_fed.to_inference_data`): ``primal_residual``, ``dual_residual``,
    ``inner_iterations``, ``converged``. :meth:`check_run` warns about proximal steps that
    did not converge.

    **Example**

    >>> import jax, numpyro, numpyro.distributions as dist
    >>> from numpyro.infer import MCMC
    >>> import numpyro_fed as nf
    >>> def model(y):
    ...     mu = numpyro.sample("mu", dist.Normal(0, 10))
    ...     with nf.federated_plate("data", y.shape[0], clients=5):
    ...         numpyro.sample("y", dist.Normal(mu, 1), obs=y)
    >>> y = 1.0 + jax.random.normal(jax.random.PRNGKey(0), (100,))
    >>> mcmc = MCMC(nf.DADMMS(model, topology="ring", rho=5.0), num_warmup=0, num_samples=30,
    ...             num_chains=50, chain_method="vectorized", progress_bar=False)
    >>> mcmc.run(jax.random.PRNGKey(1), y)
    >>> mcmc.get_samples()["mu"].shape  # agent 0's draws: 50 chains x 30 iterations
    (1500,)
    >>> nf.DADMMS.agent_draws(mcmc)["mu"].shape, nf.DADMMS.agent_draws(mcmc, 3)["mu"].shape
    ((1500, 5), (1500,))
    >>> nf.DADMMS.network_average(mcmc)["mu"].shape
    (1500,)
    >>> final = mcmc.get_samples(group_by_chain=True)["mu"][:, -1]  # agent 0, last iteration
    >>> bool(abs(final.mean() - y.mean()) < 0.1)
    True
    >>> from numpyro.infer import Predictive
    >>> Predictive(model, mcmc.get_samples())(jax.random.PRNGKey(2), y)["y"].shape
    (1500, 100)
    """

    info_names = ADMMInfo._fields
    divergence_advice = ("the proximal steps have no step size to lower: look for a potential that is not "
                         "finite at the iterates (e.g. an improper or non-convex model), or raise rho")

    def __init__(
        self,
        model,
        *,
        topology="ring",
        rho: float = 5.0,
        solver: str = "auto",
        tolerance: float | None = None,
        max_inner_iterations: int = 50,
        prior_weights=None,
        init_scale: float = 1.0,
        noise_scale: float = 1.0,
        partition=None,
        agent: int = 0,
    ):
        super().__init__(model, topology=topology, prior_weights=prior_weights, init_scale=init_scale,
                         partition=partition, agent=agent)
        self.rho = check_positive(rho, "rho")
        if solver not in _SOLVERS:
            raise ValueError(f"solver must be one of {_SOLVERS}, got {solver!r}")
        self.solver = solver
        self.tolerance = None if tolerance is None else check_positive(tolerance, "tolerance")
        self.max_inner_iterations = check_int(max_inner_iterations, "max_inner_iterations", minimum=1)
        self.noise_scale = check_real(noise_scale, "noise_scale")
        if self.noise_scale < 0:
            raise ValueError(f"noise_scale must be >= 0, got {noise_scale}")
        self.solver_used = None

    def _build(self, potentials, topology, x0):
        if potentials.num_agents == 1 and self.noise_scale > 0:
            # D-ADMMS's noise enters through the neighbour terms only: a lone agent would run
            # noise-free ADMM, an optimiser, and report the MAP as draws.
            raise ValueError(
                "DADMMS needs at least 2 clients (agents): its noise enters through the terms "
                "that tie an agent to its neighbours, so one agent alone converges to the MAP "
                "and its draws have no spread. Split the data over several clients, or use "
                "FedZigZag (exact with one client) or NUTS"
            )
        quadratic = None
        if self.solver in ("auto", "quadratic"):
            quadratic = quadratic_potentials(potentials, x0)
            if quadratic is None and self.solver == "quadratic":
                raise ValueError(
                    "solver='quadratic': the agents' potentials are not quadratic (their Hessian "
                    "is not constant); use solver='newton' or 'auto'"
                )
        self.solver_used = "quadratic" if quadratic is not None else "newton"
        kernel = build_kernel(
            potentials, topology.adjacency, self.rho, noise_scale=self.noise_scale, quadratic=quadratic,
            tolerance=self.tolerance, max_iterations=self.max_inner_iterations,
        )
        return init, kernel

    def check_run(self, mcmc, *, strict: bool = False):
        """Warns (or raises ``RuntimeError`` with ``strict``) when proximal steps stopped at
        ``max_inner_iterations`` before the tolerance. :func:`~numpyro_fed.to_inference_data`
        calls it.

        Non-finite iterates (a diverged run) are reported the same way.

        :return: ``(num_unconverged, num_steps)``: proximal steps over agents, iterations
            and chains.
        """
        if not self._check_finite(mcmc, strict):
            self.check_spread(mcmc, strict=strict)
        converged = mcmc.get_extra_fields().get("info.converged")
        if converged is None:
            return 0, 0
        converged = np.asarray(converged)
        failed = int((~converged).sum())
        if failed:
            message = (
                f"{type(self).__name__}: {failed} of {converged.size} proximal steps stopped at "
                f"max_inner_iterations={self.max_inner_iterations} before the tolerance; "
                "raise max_inner_iterations or tolerance"
            )
            if strict:
                raise RuntimeError(message)
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        return failed, int(converged.size)

    def get_diagnostics_str(self, state):
        return f"primal residual {float(jnp.max(state.info.primal_residual)):.3g}"


class ADMM(DADMMS):
    """Consensus ADMM (C-ADMM; D-ADMMS without noise, ``w_i = 0`` in Algorithm 1): the
    optimisation baseline of the paper. On a connected graph every agent's iterate
    converges to the MAP (the minimiser of the potential on the unconstrained space).
    Same arguments as :class:`DADMMS` except ``noise_scale``.

    >>> import jax, numpyro, numpyro.distributions as dist
    >>> from numpyro.infer import MCMC
    >>> import numpyro_fed as nf
    >>> def model(y):
    ...     mu = numpyro.sample("mu", dist.Normal(0, 10))
    ...     with nf.federated_plate("data", y.shape[0], clients=4):
    ...         numpyro.sample("y", dist.Normal(mu, 1), obs=y)
    >>> y = jax.numpy.arange(8.0)
    >>> mcmc = MCMC(nf.ADMM(model, topology="complete", rho=1.0), num_warmup=0, num_samples=100,
    ...             progress_bar=False)
    >>> mcmc.run(jax.random.PRNGKey(0), y)
    >>> bool(abs(nf.ADMM.agent_draws(mcmc)["mu"][-1] - y.sum() / (8 + 0.01)).max() < 1e-6)
    True
    """

    samples_posterior = False  # an optimiser: its iterates converge to the MAP

    def __init__(self, model, **kwargs):
        if "noise_scale" in kwargs:
            raise TypeError("ADMM has no noise_scale: it is D-ADMMS with noise_scale=0")
        super().__init__(model, noise_scale=0.0, **kwargs)
