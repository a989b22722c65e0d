"""Distributed ADMM-based sampler (D-ADMMS, Tzikas et al. 2024, Algorithm 1).

``N`` agents on an undirected graph sample from ``exp(-sum_i f_i(x))`` where agent ``i``
alone knows ``f_i`` (its client's potential plus its share of the prior). Each agent holds
an iterate ``x_i`` and a dual variable ``p_i`` (zero at the start). Per iteration, all agents
at once:

1. draw ``w_i ~ N(0, I)`` and solve the noisy proximal step

   .. math::

       x_i^{k+1} = \\arg\\min_x f_i(x) + p_i^\\top x + \\rho \\sum_{j \\in N_i}
       \\Bigl\\lVert x - \\frac{x_i^k + x_j^k}{2} + \\frac{\\sqrt 2}{2 \\rho} w_i \\Bigr\\rVert^2;

2. send ``x_i^{k+1}`` to their neighbors ``N_i``;
3. update ``p_i <- p_i + rho sum_{j in N_i} (x_i^{k+1} - x_j^{k+1})``.

Without the noise (``noise_scale=0``) this is consensus ADMM (C-ADMM), which converges to
the MAP on a connected graph. One noise draw per agent per iteration is shared by all of its
neighbor terms (Eq. (6)); an agent without neighbors has no noise and simply minimizes its
own ``f_i + p_i^T x``.

The proximal step is solved in closed form when every ``f_i`` is quadratic (a Gaussian
likelihood and prior, e.g. linear regression), and otherwise by a damped Newton method in a
``lax.while_loop`` (warm-started at ``x_i^k``, with a tolerance and an iteration cap; the
inner iterations and non-convergence are reported per agent and iteration).

This module is the functional core: :func:`init` and :func:`build_program`, what each agent
runs (an :class:`~numpyro_fed.federation.decentralized.AgentProgram`, from the agents'
functions of :func:`build_agent`), and the solvers. A federation's network runs the program
(:meth:`Federation.agent_network <numpyro_fed.federation.Federation.agent_network>`: every
agent ``vmap``-ped in this process, or one Ray actor per agent) and
:class:`~numpyro_fed.DADMMS` is the NumPyro face.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.scipy.linalg import cho_solve

from numpyro_fed._checks import check_int, check_positive, check_real
from numpyro_fed.federation.decentralized import AgentProgram
from numpyro_fed.infer.admm.agents import AgentPotentials, attach_block

__all__ = [
    "ADMMAgent",
    "ADMMInfo",
    "ADMMState",
    "AgentQuadratics",
    "QuadraticPotentials",
    "build_agent",
    "build_program",
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
        the neighbors after the step.
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


class AgentQuadratics(NamedTuple):
    """Deployment: every agent's potential is quadratic (each agent checked its own, see
    :func:`quadratic_potentials`) and each agent factors its own quadratic at ``x`` where it
    lives; its Hessian and gradient never leave it.

    :ivar x: ``(d,)`` the point where the agents take their Hessians and gradients.
    """

    x: jax.Array


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
    if potentials.deployed:
        # each agent checks its own potential where it lives and answers yes or no (a set-up
        # call): its Hessian and gradient stay there (see AgentQuadratics)
        directions = jax.random.normal(rng_key, (3, x.shape[0]), dtype=x.dtype)
        answers = potentials.per_agent("quadratic", partial(_is_quadratic, potentials.fn, rtol=rtol), x, directions)
        return AgentQuadratics(x) if bool(jnp.all(answers)) else None
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


def _is_quadratic(fn, block, prior_weight, x, directions, *, rtol):
    """One agent's answer to :func:`quadratic_potentials` (with its own gradients' scale in
    the tolerance)."""
    grad, hess = jax.grad(fn), jax.hessian(fn)
    g_x, h_x = grad(x, block, prior_weight), hess(x, block, prior_weight)
    ok = jnp.all(jnp.isfinite(g_x)) & jnp.all(jnp.isfinite(h_x))
    for scale, u in zip((0.1, 1.0, 10.0), directions):
        y = x + scale * (1.0 + jnp.abs(x)) * u
        g_y = grad(y, block, prior_weight)
        predicted = g_x + h_x @ (y - x)
        tol = rtol * (1.0 + jnp.max(jnp.abs(g_y)) + jnp.max(jnp.abs(g_x)))
        ok = ok & jnp.all(jnp.abs(g_y - predicted) <= tol)
    return ok


def _attach_quadratic(fn, block, local):
    """Deployment: an agent's closed-form factors ``((H + c I)^-1, g)`` from the block it
    loaded, where it lives (``local``: its prior share, curvature ``c`` and the point ``x``)."""
    _, prior_weight, curvature, x = local
    h_x = jax.hessian(fn)(x, block, prior_weight)
    g_x = jax.grad(fn)(x, block, prior_weight)
    h_x = (h_x + h_x.T) / 2
    system = h_x + curvature * jnp.eye(h_x.shape[0], dtype=h_x.dtype)
    return jnp.linalg.inv(system), g_x - h_x @ x


def newton_prox(fn: Callable, *, tolerance: float, max_iterations: int, cg_iterations: int = 4):
    """A Newton solver of the proximal problem

        min_x phi(x) = fn(x, *args) + p^T x + (c / 2) ||x - v||^2

    returning ``solve(x_start, v, p, c, *args) -> (x, iterations, converged)``.

    The Hessian of ``phi`` is computed and factored once, at ``x_start``: it is ``d``
    Hessian-vector products, the dominant cost (on an 89-coordinate hierarchical model, about
    100 gradients' worth), so each iteration instead solves its Newton system with
    ``cg_iterations`` steps of conjugate gradients on the Hessian at the current point
    (Hessian-vector products), preconditioned by that factor: on a quadratic ``phi`` the first
    step is the exact Newton step, and elsewhere the steps stay close to Newton's while the
    Hessian changes little over the solve (the proximal term keeps the solve short). Where the
    Hessian at ``x_start`` is not positive definite it is shifted by the least of a ladder of
    multiples of the identity whose Cholesky factor exists (up to Gershgorin's bound on its
    least eigenvalue, plus ``c``); conjugate gradients stop at a direction of non-positive
    curvature (Steihaug), keeping the last descent direction. Steps are shortened to the
    longest of ``2^-k``, ``k`` in ``(0, 1, 2, 3, 5, 7, 10, 14, 20, 30)``, that meets the Armijo
    condition; the solve stops when the step is below ``tolerance * (1 + max|x|)``
    (converged) or after ``max_iterations`` steps.
    """
    grad = jax.grad(fn)
    hess = jax.hessian(fn)

    def solve(x_start, v, p, c, *args):
        dim = x_start.shape[0]
        eps = jnp.finfo(x_start.dtype).eps
        slack = 8 * eps
        eye = jnp.eye(dim, dtype=x_start.dtype)

        def phi(x):
            return fn(x, *args) + p @ x + 0.5 * c * jnp.sum((x - v) ** 2)

        def gradient(x):
            return grad(x, *args) + p + c * (x - v)

        def hvp(x, u):
            return jax.jvp(lambda y: grad(y, *args), (x,), (u,))[1] + c * u

        h = hess(x_start, *args) + c * eye
        h = (h + h.T) / 2
        # Where phi is not convex (a centred hierarchy's funnel) h can be indefinite: shift it
        # by the least multiple of the identity on a ladder up to Gershgorin's bound on its
        # least eigenvalue (plus c) whose Cholesky factor exists, so that the preconditioner
        # is positive definite and every step descends.
        diagonal = jnp.diag(h)
        radius = jnp.sum(jnp.abs(h), axis=1) - jnp.abs(diagonal)
        bound = jnp.maximum(0.0, jnp.max(radius - diagonal) + c)
        factor = jnp.linalg.cholesky(h + bound * eye)
        for fraction in (1e-2, 1e-4, 0.0):
            trial = jnp.linalg.cholesky(h + fraction * bound * eye)
            factor = jnp.where(jnp.all(jnp.isfinite(trial)), trial, factor)

        def precondition(r):
            return cho_solve((factor, True), r)

        def newton_step(x):
            g = gradient(x)
            r = -g
            z = precondition(r)
            rz = r @ z
            # preconditioned conjugate gradients on the Hessian at x, from 0 (Steihaug)
            s, d, stopped = jnp.zeros_like(x), z, jnp.zeros((), bool)
            for _ in range(cg_iterations):
                hd = hvp(x, d)
                curvature = d @ hd
                stop = stopped | ~(curvature > 0) | ~(rz > 0)
                alpha = jnp.where(stop, 0.0, rz / jnp.where(stop, 1.0, curvature))
                s = s + alpha * d
                r = r - alpha * hd
                z = precondition(r)
                rz_new = r @ z
                d = z + jnp.where(stop, 0.0, rz_new / jnp.where(rz > 0, rz, 1.0)) * d
                rz, stopped = rz_new, stop
            # a first direction of negative curvature leaves s = 0: the preconditioned gradient
            step = jnp.where(jnp.any(s != 0), s, precondition(-g))
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


class ADMMAgent(NamedTuple):
    """One agent's side of a D-ADMMS iteration, apart from the network that carries the
    messages (:func:`build_program` makes it what each agent runs).

    :ivar primal: ``(noise, x_i, p_i, neighbor_sum, degree, local) -> (x_i', iterations,
        converged)``: step 1, the noisy proximal step from the agent's standard normal draw
        ``w_i``, its iterate and dual, the sum of its neighbors' iterates ``sum_{j in N_i}
        x_j^k`` and its own ``local`` data.
    :ivar dual: ``(p_i, x_i', neighbor_sum', degree) -> p_i'``: step 3, from the sum of the
        neighbors' new iterates (step 2 is the network's).
    :ivar local: what each agent alone holds, stacked with a leading agent axis: its data
        block and prior share (Newton) or its quadratic's factors (closed form).
    :ivar attach: deployment (see
        :attr:`~numpyro_fed.federation.decentralized.AgentProgram.attach`), else ``None``.
    """

    primal: Callable
    dual: Callable
    local: Any
    attach: Callable | None = None


def build_agent(
    potentials: AgentPotentials,
    degrees,
    rho: float,
    *,
    noise_scale: float = 1.0,
    quadratic: QuadraticPotentials | None = None,
    tolerance: float | None = None,
    max_iterations: int = 50,
    noise_shape=None,
) -> ADMMAgent:
    """The agents' functions of D-ADMMS (Algorithm 1): see :class:`ADMMAgent` and
    :func:`build_program` for the arguments (``degrees``: ``(N,)`` number of neighbors of
    each agent, which fixes its proximal curvature ``2 rho degree``).

    **Example**: agent 0 of two, alone on a worker, with ``f_0(x) = x^2 / 2`` and no noise;
    its neighbor sent ``x_1 = 1``:

    >>> import jax, jax.numpy as jnp
    >>> from numpyro_fed.infer.admm import AgentPotentials
    >>> pots = AgentPotentials(lambda x, b, w: 0.5 * jnp.sum((x - b) ** 2),
    ...                        jnp.array([0.0, 1.0]), jnp.array([0.5, 0.5]), 2, 1)
    >>> agent = build_agent(pots, jnp.array([1.0, 1.0]), 1.0, noise_scale=0.0)
    >>> mine = jax.tree.map(lambda a: a[0], agent.local)  # what agent 0 alone holds
    >>> x0, _, converged = agent.primal(jnp.zeros(1), jnp.zeros(1), jnp.zeros(1),
    ...                                 jnp.ones(1), 1.0, mine)
    >>> round(float(x0[0]), 4), bool(converged)  # argmin x^2/2 + (x - 1/2)^2
    (0.3333, True)
    >>> round(float(agent.dual(jnp.zeros(1), x0, jnp.ones(1), 1.0)[0]), 4)  # rho (x_0 - x_1)
    -0.6667
    """
    rho = check_positive(rho, "rho")
    noise_scale = check_real(noise_scale, "noise_scale")
    if noise_scale < 0:
        raise ValueError(f"noise_scale must be >= 0, got {noise_scale}")
    max_iterations = check_int(max_iterations, "max_iterations", minimum=1)
    dtype = potentials.prior_weights.dtype
    degrees = jnp.asarray(degrees, dtype=dtype)
    noise_sd = noise_scale * math.sqrt(2.0) / (2.0 * rho)
    shape = None if noise_shape is None else jnp.asarray(noise_shape, dtype)

    attach = None
    if isinstance(quadratic, AgentQuadratics):
        # deployment: each agent factors its own quadratic where it lives
        curvature = 2.0 * rho * degrees
        x = jnp.asarray(quadratic.x, dtype)
        n = degrees.shape[0]
        local = (None, potentials.prior_weights, curvature, jnp.broadcast_to(x, (n,) + x.shape))
        attach = partial(_attach_quadratic, potentials.fn)

        def prox(x_start, v, p, c, local):
            inverse, gradient_at_zero = local
            return inverse @ (c * v - p - gradient_at_zero), jnp.zeros((), jnp.int32), jnp.ones((), bool)
    elif quadratic is not None:
        dim = quadratic.hessians.shape[-1]
        # the proximal term is (c_i / 2) ||x - v_i||^2 with c_i = 2 rho deg_i: (H_i + c_i I)^-1
        # depends on the agent alone and is factored once
        curvature = 2.0 * rho * degrees
        systems = quadratic.hessians + curvature[:, None, None] * jnp.eye(dim, dtype=quadratic.hessians.dtype)
        local = (jnp.linalg.inv(systems), quadratic.gradients_at_zero)

        def prox(x_start, v, p, c, local):
            inverse, gradient_at_zero = local
            return inverse @ (c * v - p - gradient_at_zero), jnp.zeros((), jnp.int32), jnp.ones((), bool)
    else:
        local = (potentials.data, potentials.prior_weights)
        attach = attach_block if potentials.deployed else None
        fn = potentials.fn  # the function only: a closure over `potentials` would hold every block

        def prox(x_start, v, p, c, local):
            tol = tolerance
            if tol is None:
                tol = 1e-10 if x_start.dtype == jnp.float64 else 1e-5
            solve = newton_prox(fn, tolerance=tol, max_iterations=max_iterations)
            return solve(x_start, v, p, c, *local)

    def primal(noise, x, p, neighbor_sum, degree, local):
        # mean over the neighbors of the edge averages (x_i + x_j) / 2 (none: no proximal term)
        edge_mean = jnp.where(degree > 0, (degree * x + neighbor_sum) / (2.0 * jnp.maximum(degree, 1.0)), 0.0)
        if shape is not None:  # the noise's shape in the posterior's whitened units (rho="auto")
            noise = noise @ shape.T
        return prox(x, edge_mean - noise_sd * noise, p, 2.0 * rho * degree, local)

    def dual(p, x_new, neighbor_sum_new, degree):
        return p + rho * (degree * x_new - neighbor_sum_new)

    return ADMMAgent(primal, dual, local, attach)


def build_program(
    potentials: AgentPotentials,
    degrees,
    rho: float,
    *,
    noise_scale: float = 1.0,
    quadratic: QuadraticPotentials | None = None,
    tolerance: float | None = None,
    max_iterations: int = 50,
    noise_shape=None,
) -> AgentProgram:
    """D-ADMMS (Algorithm 1) as an :class:`~numpyro_fed.federation.decentralized.AgentProgram`:
    what each agent runs, on any network (in this process or one Ray actor per agent).

    Agent ``i``'s own state is :class:`ADMMState` ``(x_i, p_i)`` (one row of it); its message
    is its iterate ``x_i`` (``d`` floats), sent to each neighbor once per iteration, and its
    inbox holds its neighbors' latest iterates. ``send`` draws ``w_i`` from the agent's own key
    (one draw per agent and iteration, Eq. (6)) and solves the noisy proximal step (step 1 of
    Algorithm 1; the message is ``x_i^{k+1}``, step 2), ``receive`` updates the dual from the
    neighbors' new iterates (step 3) and reports :class:`ADMMInfo`.

    :param AgentPotentials potentials: the agents' local potentials.
    :param degrees: ``(N,)`` each agent's number of neighbors (see
        :func:`~numpyro_fed.infer.admm.topology.make_topology`), which fixes its proximal
        curvature ``2 rho degree``.
    :param float rho: penalty parameter (> 0).
    :param float noise_scale: multiplies the proximal noise; 1 is D-ADMMS, 0 is C-ADMM.
    :param QuadraticPotentials quadratic: solve the proximal step in closed form with these
        (see :func:`quadratic_potentials`); ``None``: Newton's method.
    :param float tolerance: Newton's step tolerance (default ``1e-10`` in float64,
        ``1e-5`` in float32).
    :param int max_iterations: Newton's iteration cap per proximal step.
    :param noise_shape: ``(d, d)``: each agent's noise is ``noise_shape @ w`` (``w`` standard
        normal) times ``noise_scale``; ``None`` (default): isotropic, the paper's.

    **Example** (two agents, Gaussian potentials ``f_i(x) = (x - i)^2 / 2``, C-ADMM finds
    the minimizer of the sum), run in this process by
    :class:`~numpyro_fed.federation.InProcess`'s network:

    >>> import jax, jax.numpy as jnp
    >>> from numpyro_fed.federation import InProcess
    >>> from numpyro_fed.infer.admm import AgentPotentials
    >>> pots = AgentPotentials(lambda x, b, w: 0.5 * jnp.sum((x - b) ** 2),
    ...                        jnp.array([0.0, 1.0]), jnp.array([0.5, 0.5]), 2, 1)
    >>> adjacency = jnp.array([[0.0, 1.0], [1.0, 0.0]])
    >>> program = build_program(pots, adjacency.sum(1), 1.0, noise_scale=0.0)
    >>> network = InProcess().agent_network(program, adjacency)
    >>> step = jax.jit(network.step)
    >>> state = network.start(init(jnp.zeros((2, 1))))
    >>> for t in range(60):
    ...     state, info = step(jax.random.PRNGKey(0), t, state)
    >>> state.own.x.ravel().round(6).tolist()
    [0.5, 0.5]
    """
    agent = build_agent(
        potentials,
        degrees,
        rho,
        noise_scale=noise_scale,
        quadratic=quadratic,
        tolerance=tolerance,
        max_iterations=max_iterations,
        noise_shape=noise_shape,
    )
    # the functions only: `agent.local` holds every agent's data, and each agent gets its own
    primal, dual = agent.primal, agent.dual
    rho = float(rho)

    def message(own):
        return own.x

    def send(local, key, own, inbox, mask):
        degree = jnp.sum(mask, dtype=own.x.dtype)
        noise = jax.random.normal(key, own.x.shape, dtype=own.x.dtype)
        x_new, iterations, converged = primal(noise, own.x, own.p, jnp.sum(inbox, axis=0), degree, local)
        return (x_new, own, iterations, converged), x_new

    def receive(local, pending, inbox, previous_inbox, mask):
        x_new, own, iterations, converged = pending
        weight = mask.astype(x_new.dtype)
        degree = jnp.sum(weight)
        p_new = dual(own.p, x_new, jnp.sum(inbox, axis=0), degree)
        # the edge averages z_ij = (x_i + x_j) / 2 move by (m_i + m_j) / 2, m the iterates' moves
        moves = (x_new - own.x)[None] + (inbox - previous_inbox)
        info = ADMMInfo(
            primal_residual=jnp.sqrt(jnp.sum(weight * jnp.sum((x_new[None] - inbox) ** 2, axis=1))),
            dual_residual=0.5 * rho * jnp.sqrt(jnp.sum(weight * jnp.sum(moves**2, axis=1))),
            inner_iterations=iterations,
            converged=converged,
        )
        return ADMMState(x_new, p_new), info

    return AgentProgram(message, send, receive, agent.local, agent.attach)
