"""D-ADMMS in the posterior's units: ``rho="auto"``.

D-ADMMS's proximal noise has sd ``sqrt(2) / (2 rho)`` in the units of the parameters, whatever
the posterior's width, so at a fixed ``rho`` the iterates' spread depends on the units of the
covariates and on how much data there is. On a Gaussian posterior of precision ``H`` the
algorithm is a linear recursion whose stationary law depends on ``rho`` only through
``rho / H``: run in the coordinates ``y`` where the posterior's precision is the identity,
``x = center + T y`` with ``T^T H T = I``, the spread is a function of ``rho``, the graph and
each agent's share of the curvature alone, and one ``rho`` (:func:`calibrated_rho`, from the
discrete Lyapunov equation of the recursion) makes the reporting agent's stationary sd equal
the posterior's.

The set-up (:func:`laplace_scaling`) finds ``center`` (the MAP) and ``H`` (the sum of the
agents' Hessians there) by a damped Newton method in which each round every agent sends its
potential's value, gradient and Hessian at the current point (``1 + d + d^2`` floats, a
named set-up call counted in the federation's ledger in deployment); the sums, the Newton
step and the whitening are computed in float64.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import numpy as np
import scipy.linalg

import jax
import jax.numpy as jnp

from numpyro_fed.infer.admm.agents import AgentPotentials
from numpyro_fed.infer.stein.curvature import max_condition_number

__all__ = [
    "MAX_CURVATURE_DRIFT",
    "LaplaceScaling",
    "auto_settings",
    "calibrated_noise",
    "calibrated_rho",
    "curvature_drift",
    "laplace_scaling",
    "stationary_covariance",
    "stationary_sd_ratio",
    "stein_spread",
    "surrogate_scaling",
    "tempered_settings",
    "whitened_potentials",
]


class LaplaceScaling(NamedTuple):
    """The posterior's location and scale seen by the agents at set-up.

    :ivar center: ``(d,)`` the MAP (float64).
    :ivar transform: ``(d, d)`` ``T = L^-T`` with ``H = L L^T`` (Cholesky), so ``T^T H T = I``
        (``x = center + T y``).
    :ivar inverse: ``(d, d)`` ``T^-1`` (``y = T^-1 (x - center)``).
    :ivar shares: ``(N,)`` each agent's share of the curvature, ``tr(T^T H_i T) / d`` (they
        sum to one).
    :ivar int rounds: set-up rounds (each agent sent one message per round).
    :ivar bool mode: ``True`` when ``center`` is the MAP; ``False`` for the surrogate of a
        posterior without a mode (see :func:`laplace_scaling`'s ``surrogate``).
    :ivar hessians: ``(N, d, d)`` each agent's Hessian in the whitened coordinates,
        ``T^T H_i T`` (they sum to the identity; ``shares`` are their mean diagonals).
    """

    center: np.ndarray
    transform: np.ndarray
    inverse: np.ndarray
    shares: np.ndarray
    rounds: int
    mode: bool = True
    hessians: np.ndarray | None = None


def _value_grad_hess(fn, block, prior_weight, x):
    """One agent's ``(f_i(x), grad, Hessian)``: what it sends in a set-up round."""
    value, grad = jax.value_and_grad(fn)(x, block, prior_weight)
    return value, grad, jax.hessian(fn)(x, block, prior_weight)


def _agent_totals(potentials: AgentPotentials, dtype):
    """``totals(x) -> (value, grad, hessians, hessian)``: one set-up round, every agent's
    potential's value, gradient and Hessian at ``x`` (its own rows; in deployment on its own
    worker, the call named ``"laplace"``), summed in float64 (``hessians``: each agent's)."""
    ask = partial(_value_grad_hess, potentials.fn)
    if potentials.deployed:
        call = lambda x: potentials.per_agent("laplace", ask, x)  # noqa: E731
    else:
        jitted = jax.jit(jax.vmap(ask, in_axes=(0, 0, None)))
        call = lambda x: jitted(potentials.data, potentials.prior_weights, x)  # noqa: E731

    def totals(x):
        values, grads, hessians = (np.asarray(jax.device_get(a), dtype=np.float64) for a in call(jnp.asarray(x, dtype)))
        with np.errstate(all="ignore"):  # a trial point off the support: the search checks finiteness
            return values.sum(), grads.sum(0), hessians, hessians.sum(0)

    return totals


def laplace_scaling(
    potentials: AgentPotentials, x0, *, max_rounds: int = 200, surrogate: bool = False, report: dict | None = None
) -> LaplaceScaling | None:
    """The MAP and the Hessian there by a damped Newton method over the agents' sums (see the
    module's docstring), or ``None`` when there is none (a potential not finite at ``x0``, a
    posterior without a mode, e.g. a centred funnel, or a Hessian that is not positive
    definite at the end).

    With ``surrogate``, a search that finds no mode returns instead the scaling at the point
    where it left the first stretch of its path on which the summed Hessian was positive
    definite with a condition number below
    :func:`~numpyro_fed.infer.stein.curvature.max_condition_number` (``mode=False``), or
    ``None`` if it never met one: on a centred hierarchy the search runs down the funnel, and
    that point is where it crossed the posterior's bulk (condition number 888 on radon).

    ``report``, a dict, receives what the search measured: ``start`` and ``end`` (its first
    and last points, float64), ``value_start`` and ``value_end`` (the potential there),
    ``rounds`` and ``converged``; a search without a mode shows there where it ran away.

    >>> pots = AgentPotentials(lambda x, b, w: 0.5 * jnp.sum((x - b) ** 2) * 4.0,
    ...                        jnp.array([0.0, 1.0]), jnp.array([0.5, 0.5]), 2, 1)
    >>> s = laplace_scaling(pots, jnp.zeros(1))
    >>> s.center.round(6).tolist(), s.transform.round(6).tolist(), s.shares.tolist()
    ([0.5], [[0.353553]], [0.5, 0.5])
    """
    dtype = jnp.asarray(x0).dtype
    totals = _agent_totals(potentials, dtype)
    eps = float(jnp.finfo(dtype).eps)
    x = np.asarray(x0, dtype=np.float64)
    value, grad, hessians, hessian = totals(x)
    start_value = float(value)
    rounds = 1
    converged = False
    first_pd, left_pd = None, False  # the last point of the path's first positive definite stretch
    max_condition = max_condition_number(dtype)
    while rounds < max_rounds and np.isfinite(value) and np.all(np.isfinite(hessian)):
        hessian = (hessian + hessian.T) / 2
        eigenvalues, vectors = np.linalg.eigh(hessian)
        if not left_pd:
            # positive definite and well conditioned: deep in a funnel the Hessian can be positive
            # definite again with a condition number past 1e16 (the centred eight schools)
            if eigenvalues.min() > eigenvalues.max() / max_condition:
                first_pd = (x, hessians, hessian)
            elif first_pd is not None:
                left_pd = True
        floor = max(abs(eigenvalues).max(), 1e-300) * 1e-10
        # Newton on the positive part; a saddle's negative directions move downhill by |lambda|
        step = -vectors @ ((vectors.T @ grad) / np.maximum(np.abs(eigenvalues), floor))
        decrement = float(-(grad @ step))
        if decrement <= max(1e3 * eps, 1e-10) * (1.0 + abs(value)) and eigenvalues.min() > 0:
            # one more full step: Newton converges quadratically there, so the MAP (and every
            # quantity built on it) is then exact to round-off, whatever the starting point
            x = x + step
            value, grad, hessians, hessian = totals(x)
            rounds += 1
            converged = bool(np.isfinite(value) and np.all(np.isfinite(hessian)))
            break
        t = 1.0
        while rounds < max_rounds:
            trial = totals(x + t * step)
            rounds += 1
            if np.isfinite(trial[0]) and trial[0] <= value - 1e-4 * t * decrement + 8 * eps * abs(value):
                break
            t /= 4.0
        else:
            break
        x = x + t * step
        value, grad, hessians, hessian = trial
    if report is not None:
        report.update(
            start=np.asarray(x0, dtype=np.float64),
            end=x,
            value_start=start_value,
            value_end=float(value),
            rounds=rounds,
            converged=converged,
        )
    mode = True
    if not converged:
        if not surrogate or first_pd is None:
            return None
        (x, hessians, hessian), mode = first_pd, False
    # Cholesky, not an eigendecomposition: rescaling the coordinates by a positive diagonal D
    # rescales the factor by D exactly, so the whitened problem, its noise draws and hence the
    # draws are the same in any units of the covariates
    try:
        factor = np.linalg.cholesky((hessian + hessian.T) / 2)
    except np.linalg.LinAlgError:
        return None
    inverse = factor.T
    transform = scipy.linalg.solve_triangular(factor, np.eye(x.size), lower=True).T
    if not (np.all(np.isfinite(transform)) and np.all(np.isfinite(inverse))):
        return None
    whitened = np.einsum("ji,njk,kl->nil", transform, (hessians + np.swapaxes(hessians, 1, 2)) / 2, transform)
    shares = np.clip(np.trace(whitened, axis1=1, axis2=2) / x.size, 0.0, None)
    return LaplaceScaling(x, transform, inverse, shares / shares.sum(), rounds, mode, whitened)


def surrogate_scaling(potentials: AgentPotentials, x0, *, starts: int = 8, seed: int = 0, max_rounds: int = 200):
    """A scaling for a posterior without a mode: :func:`laplace_scaling` with ``surrogate``
    from up to ``starts`` points drawn uniformly in ``(-2, 2)`` on the unconstrained space
    (NumPyro's ``init_to_uniform``; ``x0`` gives the shape and dtype), until one search crosses
    a positive definite stretch. Returns ``(scaling or None, rounds)``, ``rounds`` the set-up
    rounds of every search (each agent sent one message per round). On the centred radon
    model (85 county intercepts) 3 of 7 starts crossed one, at a log county scale of -1.64 to
    -0.75 (the posterior's: -1.14, sd 0.14)."""
    rng = np.random.default_rng(seed)
    rounds = 0
    for _ in range(starts):
        start = jnp.asarray(rng.uniform(-2.0, 2.0, np.shape(x0)), jnp.asarray(x0).dtype)
        report = {}
        scaling = laplace_scaling(potentials, start, max_rounds=max_rounds, surrogate=True, report=report)
        rounds += report.get("rounds", 1)
        if scaling is not None:
            return scaling._replace(rounds=rounds), rounds
    return None, rounds


#: :func:`curvature_drift` above which ``rho="auto"`` runs :func:`tempered_settings` at a
#: mode (a curvature that changes by a factor ``e^2``, about 7, over the Laplace
#: approximation's typical draws). Measured: 0.03-0.30 on the real-model tier's other models
#: with a mode, 0-0.34 on the synthetic zoo's; 1.1 on mtcars (32 rows, 12 coordinates), whose
#: sds the mixing settings keep within [0.77, 1.2] of NUTS's and the tempered ones widened
#: to 1.43 over 8 clients (slower mixing: min ESS 23 of 2000); infinite on the non-centred
#: eight schools (the Hessian is not positive definite at most draws), whose school effects
#: kept about half their sd untempered (docs/guide/dadmms.md, "Far from Gaussian").
MAX_CURVATURE_DRIFT = 2.0


def curvature_drift(potentials: AgentPotentials, scaling: LaplaceScaling, *, points: int = 8, seed: int = 0):
    """How far the posterior's curvature moves over its Laplace approximation: at ``points``
    draws ``y ~ N(0, I)`` of it (whitened; a fixed ``seed``, so every engine measures the
    same), the largest ``|log|`` eigenvalue of the summed Hessian in the whitened coordinates
    (the identity at the mode, and everywhere on a Gaussian posterior); the median over the
    draws, ``inf`` where more than half of them have a Hessian that is not positive definite
    or not finite. Returns ``(drift, rounds)``: one set-up round per draw, every agent sending
    its potential's value, gradient and Hessian as in :func:`laplace_scaling`.

    >>> pots = AgentPotentials(lambda x, b, w: 0.5 * jnp.sum((x - b) ** 2) * 4.0,
    ...                        jnp.array([0.0, 1.0]), jnp.array([0.5, 0.5]), 2, 1)
    >>> drift, rounds = curvature_drift(pots, laplace_scaling(pots, jnp.zeros(1)))
    >>> round(drift, 12), rounds
    (0.0, 8)
    """
    totals = _agent_totals(potentials, potentials.prior_weights.dtype)
    draws = np.random.default_rng(seed).normal(size=(points, scaling.center.size))
    drifts = []
    for y in draws:
        hessian = totals(scaling.center + scaling.transform @ y)[3]
        whitened = scaling.transform.T @ ((hessian + hessian.T) / 2) @ scaling.transform
        if not np.all(np.isfinite(whitened)):
            drifts.append(np.inf)
            continue
        eigenvalues = np.linalg.eigvalsh(whitened)
        drifts.append(float(np.max(np.abs(np.log(eigenvalues)))) if eigenvalues.min() > 0 else np.inf)
    return float(np.median(drifts)), points


def tempered_settings(adjacency, shares, agent: int = 0, *, max_ratio: float = 1.15):
    """``(rho, noise_scale)`` at which the network's degree-weighted average moves as a
    Langevin step at temperature one, for a posterior without a mode (see the guide, "Models
    without a mode").

    Summing the agents' proximal optimality conditions (the duals sum to zero), the average
    ``sum_i deg_i x_i / D`` (``D = sum_i deg_i``) moves by ``-h sum_i grad f_i`` with ``h = 1 /
    (2 rho D)`` plus noise of variance ``noise^2 sum_i deg_i^2 / (2 rho^2 D^2)``: a Langevin step
    on ``exp(-U / T)`` with ``T = noise^2 sum_i deg_i^2 / (2 rho D)``. Below ``T = 1`` a
    centred hierarchy's tempered density is improper (with ``J`` groups, its scale's
    marginal behaves as ``sigma^(J - (J - 1) / T)`` near 0: proper only for ``T > (J - 1) / J``),
    and the iterates run down its funnel. The noise is set for ``T = 1`` and ``rho`` is the
    least of ``2^k``, ``k = -2 .. 6``, at which the reporting agent's stationary sd on
    :func:`stationary_sd_ratio`'s model is at most ``max_ratio`` times the posterior's (the
    agents' disagreement adds to the average's spread and shrinks as ``rho`` grows, at the cost
    of a smaller step ``h``).

    >>> ring = np.array([[0, 1, 0, 1], [1, 0, 1, 0], [0, 1, 0, 1], [1, 0, 1, 0]], float)
    >>> rho, noise = tempered_settings(ring, np.full(4, 0.25))
    >>> rho, round(noise, 4), round(noise * stationary_sd_ratio(ring, np.full(4, 0.25), rho), 3)
    (2.0, 1.4142, 1.132)
    """
    adjacency = np.asarray(adjacency, dtype=np.float64)
    degrees = adjacency.sum(1)
    total, squares = degrees.sum(), (degrees**2).sum()
    for k in range(-2, 7):
        rho = 2.0**k
        noise = float(np.sqrt(2.0 * rho * total / squares))
        if noise * stationary_sd_ratio(adjacency, shares, rho, agent) <= max_ratio:
            break
    return rho, noise


def whitened_potentials(potentials: AgentPotentials, scaling: LaplaceScaling) -> AgentPotentials:
    """The agents' potentials in the whitened coordinates: ``f_i(center + T y)``."""
    dtype = potentials.prior_weights.dtype
    center = jnp.asarray(scaling.center, dtype)
    transform = jnp.asarray(scaling.transform, dtype)
    return potentials._replace(fn=partial(_whitened, potentials.fn, center, transform))


def _whitened(fn, center, transform, y, block, prior_weight):
    return fn(center + transform @ y, block, prior_weight)


def stationary_sd_ratio(adjacency, shares, rho: float, agent: int = 0) -> float:
    """Agent ``agent``'s stationary sd of D-ADMMS on the scalar Gaussian posterior ``N(0, 1)``
    whose potential agent ``i`` holds the share ``shares[i]`` of (the linear recursion of
    Algorithm 1 and its discrete Lyapunov equation).

    >>> ring = np.array([[0, 1, 0, 1], [1, 0, 1, 0], [0, 1, 0, 1], [1, 0, 1, 0]], float)
    >>> round(stationary_sd_ratio(ring, np.full(4, 0.25), 5.0), 3)
    0.473
    """
    hessians = np.asarray(shares, dtype=np.float64)[:, None, None]  # d = 1
    return float(np.sqrt(stationary_covariance(adjacency, hessians, rho, agent)[0, 0]))


def calibrated_rho(adjacency, shares, agent: int = 0, *, target: float = 1.0) -> float:
    """The ``rho`` at which agent ``agent``'s stationary sd is ``target`` times the posterior's
    on :func:`stationary_sd_ratio`'s model (bisection on ``log rho``; the sd falls as ``rho``
    grows).

    >>> ring = np.array([[0, 1, 0, 1], [1, 0, 1, 0], [0, 1, 0, 1], [1, 0, 1, 0]], float)
    >>> rho = calibrated_rho(ring, np.full(4, 0.25))
    >>> round(stationary_sd_ratio(ring, np.full(4, 0.25), rho), 4)
    1.0
    """
    low, high = np.log(1e-3), np.log(1e3)
    for _ in range(50):
        middle = (low + high) / 2
        if stationary_sd_ratio(adjacency, shares, float(np.exp(middle)), agent) > target:
            low = middle
        else:
            high = middle
    return float(np.exp((low + high) / 2))


#: The largest recursion (``(2 N - 1) d`` states) whose stationary covariance
#: :func:`calibrated_noise` computes; beyond it the noise keeps the scalar calibration.
#: Each of its 12-14 Lyapunov solves costs about 0.2 s at 280 states here (d = 40 over 4
#: agents: 2.5 s in all), 0.75 s at 595 (9 s).
MAX_CALIBRATED_STATES = 300


def _recursion(adjacency, hessians, rho: float):
    """``(a, b)`` of D-ADMMS's linear recursion on the Gaussian posterior whose agents hold the
    whitened Hessians ``hessians`` (``(N, d, d)``): the state ``(x_1..x_N, duals)`` moves as
    ``s' = a s + b w``, ``w`` the agents' standard normal noise (``N d``) at ``noise_scale=1``.
    :func:`stationary_sd_ratio`'s model with a matrix ``A_i`` for the scalar share ``h_i``."""
    adjacency = np.asarray(adjacency, dtype=np.float64)
    hessians = np.asarray(hessians, dtype=np.float64)
    n, d = hessians.shape[:2]
    eye = np.eye(d)
    degrees = adjacency.sum(1)
    laplacian = np.kron(np.diag(degrees) - adjacency, eye)
    c = 2.0 * rho * degrees
    sigma = np.sqrt(2.0) / (2.0 * rho)
    inverse = scipy.linalg.block_diag(*[np.linalg.inv(hessians[i] + c[i] * eye) for i in range(n)])
    edge_mean = np.kron(np.diag(c / (2.0 * np.maximum(degrees, 1.0))) @ (np.diag(degrees) + adjacency), eye)
    # the duals start at zero and keep sum_i p_i = 0: iterate them in a basis of that subspace
    # (the constant direction has eigenvalue 1 and no noise)
    basis = np.kron(scipy.linalg.null_space(np.ones((1, n))), eye)
    k1, k2, e = inverse @ edge_mean, inverse @ basis, -inverse @ np.kron(np.diag(c * sigma), eye)
    coupling = rho * basis.T @ laplacian
    a = np.block([[k1, -k2], [coupling @ k1, np.eye(basis.shape[1]) - coupling @ k2]])
    return a, np.vstack([e, coupling @ e])


def stationary_covariance(adjacency, hessians, rho: float, agent: int = 0, noise_covariance=None):
    """Agent ``agent``'s ``(d, d)`` stationary covariance of D-ADMMS on the Gaussian posterior
    ``N(0, I)`` whose agent ``i`` holds the whitened Hessian ``hessians[i]`` (summing to
    ``I``), with each agent's noise of covariance ``noise_covariance`` (``(d, d)``; default
    ``I``: ``noise_scale=1``) before the factor ``sqrt(2) / (2 rho)``.

    Agents whose Hessians are proportional (``A_i = h_i I``) give the scalar model
    (:func:`stationary_sd_ratio`, its case ``d = 1``) in every direction, and no correlation:

    >>> ring = np.array([[0, 1, 0, 1], [1, 0, 1, 0], [0, 1, 0, 1], [1, 0, 1, 0]], float)
    >>> h = np.array([0.1, 0.2, 0.3, 0.4])
    >>> cov = stationary_covariance(ring, h[:, None, None] * np.eye(2), 5.0)
    >>> np.sqrt(np.diag(cov)).round(6).tolist(), abs(float(cov[0, 1])) < 1e-12
    ([0.473549, 0.473549], True)
    """
    a, b = _recursion(adjacency, hessians, rho)
    n, d = np.shape(hessians)[:2]
    noise = np.eye(d) if noise_covariance is None else np.asarray(noise_covariance, dtype=np.float64)
    cov = scipy.linalg.solve_discrete_lyapunov(a, b @ np.kron(np.eye(n), noise) @ b.T)
    return cov[agent * d : (agent + 1) * d, agent * d : (agent + 1) * d]


def calibrated_noise(adjacency, hessians, rho: float, agent: int = 0, *, tolerance: float = 1e-6, max_iterations=100):
    """The ``(d, d)`` covariance ``Q`` of the agents' noise (before ``sqrt(2) / (2 rho)``) at
    which agent ``agent``'s stationary covariance is the posterior's, ``I``, in the whitened
    coordinates, whatever the agents' Hessians (:func:`stationary_covariance`); ``None`` where
    there is none (not positive definite) or the recursion is larger than
    :data:`MAX_CALIBRATED_STATES`.

    With proportional Hessians a scalar noise does it (:func:`auto_settings`); otherwise the
    directions in which agent ``agent`` holds more or less than its share of the curvature get
    more or less spread (a contiguous split of covariates: one coefficient's sd at 0.66 of the
    posterior's with the scalar noise). The map ``Q -> covariance`` is linear; ``Q`` is found
    by Richardson's iteration from the scalar solution, exact in the proportional case.

    >>> ring = np.array([[0, 1, 0, 1], [1, 0, 1, 0], [0, 1, 0, 1], [1, 0, 1, 0]], float)
    >>> hessians = np.stack([np.diag([0.7, 0.1]), np.diag([0.1, 0.3]), np.diag([0.1, 0.3]), np.diag([0.1, 0.3])])
    >>> q = calibrated_noise(ring, hessians, 0.25)
    >>> np.allclose(stationary_covariance(ring, hessians, 0.25, 0, q), np.eye(2), atol=1e-6)
    True
    """
    hessians = np.asarray(hessians, dtype=np.float64)
    n, d = hessians.shape[:2]
    if (2 * n - 1) * d > MAX_CALIBRATED_STATES:
        return None
    a, b = _recursion(adjacency, hessians, rho)
    if np.max(np.abs(np.linalg.eigvals(a))) >= 1.0:
        return None
    eye = np.eye(d)
    block = slice(agent * d, (agent + 1) * d)

    def covariance(q):
        return scipy.linalg.solve_discrete_lyapunov(a, b @ np.kron(np.eye(n), q) @ b.T)[block, block]

    scale = 1.0 / np.mean(np.diag(covariance(eye)))  # the scalar noise's variance
    q = scale * eye
    for _ in range(max_iterations):
        error = eye - covariance(q)
        if np.max(np.abs(error)) < tolerance:
            break
        q = q + scale * (error + error.T) / 2
    else:
        return None
    try:
        np.linalg.cholesky(q)
    except np.linalg.LinAlgError:
        return None
    return q


def auto_settings(adjacency, shares, agent: int = 0, *, noise_scale: float | None = None, mixing: float = 0.8):
    """``(rho, noise_scale)`` in the posterior's units (see :func:`stationary_sd_ratio`'s model).

    With ``noise_scale`` given (1: the paper's noise), the ``rho`` at which the reporting
    agent's stationary sd is the posterior's (:func:`calibrated_rho`). Otherwise ``rho`` is
    chosen for mixing, so that the slowest mode of the recursion (the network's consensus,
    which the proximal step moves by ``h / (h + 2 rho deg)``) contracts by ``mixing`` per
    iteration for an agent of mean share and degree, and the noise is scaled so that the
    stationary sd is the posterior's (the recursion is linear, so its sd is proportional to
    the noise): at the paper's noise, the calibrated ``rho`` leaves that mode at about 0.96
    per iteration on a ring of 4 (an autocorrelation time near 45 iterations).

    >>> ring = np.array([[0, 1, 0, 1], [1, 0, 1, 0], [0, 1, 0, 1], [1, 0, 1, 0]], float)
    >>> rho, noise = auto_settings(ring, np.full(4, 0.25))
    >>> round(rho, 3), round(stationary_sd_ratio(ring, np.full(4, 0.25), rho) * noise, 4)
    (0.25, 1.0)
    """
    if noise_scale:
        return calibrated_rho(adjacency, shares, agent, target=1.0 / noise_scale), float(noise_scale)
    adjacency = np.asarray(adjacency, dtype=np.float64)
    degree = float(np.mean(adjacency.sum(1)))
    share = float(np.mean(shares))
    rho = share * mixing / (1.0 - mixing) / (2.0 * degree)
    if noise_scale is not None:  # 0: no noise (C-ADMM), in the posterior's units
        return rho, 0.0
    return rho, 1.0 / stationary_sd_ratio(adjacency, shares, rho, agent)


def stein_spread(x, grads):
    """Per coordinate, the draws' variance over the posterior's and the offset of their mean
    in posterior sds, by Stein's identity (``x``, ``grads``: ``(T, d)`` draws and the
    potential's gradients there, float64).

    Under a Gaussian posterior of precision ``P`` and mean ``mu``, ``grad U(x) = P (x - mu)``, so
    over draws of covariance ``C`` and mean ``m``, ``A = mean((x - m) grad U^T) = C P`` and
    ``mean(grad U) = P (m - mu)``: the posterior's covariance is ``A^-1 C`` and the offset
    ``A^-1 C mean(grad U)``, whatever the correlations (coordinate by coordinate, ``A_ii`` alone
    mixes the other coordinates' errors in). Where ``A`` is singular or the estimated
    posterior variance is not positive (draws far from a non-Gaussian posterior), the
    coordinate's own ``A_ii`` and its offset are used; ``nan`` where even that is not positive.

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(4000, 2)) @ np.array([[1.0, 0.9], [0.0, 0.3]]) * 0.5  # half the sd
    >>> precision = np.linalg.inv(np.array([[1.0, 0.9], [0.9, 0.9]]))
    >>> ratio, offset = stein_spread(x, x @ precision)
    >>> np.sqrt(ratio).round(1).tolist(), np.abs(offset).round(1).tolist()
    ([0.5, 0.5], [0.0, 0.0])
    """
    deviation = x - x.mean(0)
    mean_grad = grads.mean(0)
    diagonal = np.mean(deviation * grads, axis=0)
    with np.errstate(all="ignore"):
        ratio = np.where(diagonal > 0, diagonal, np.nan)
        offset = mean_grad * x.std(0) / np.sqrt(ratio)
        cross = deviation.T @ grads / x.shape[0]
        covariance = deviation.T @ deviation / x.shape[0]
        try:
            posterior = np.linalg.solve(cross, covariance)
        except np.linalg.LinAlgError:
            return ratio, offset
        posterior = (posterior + posterior.T) / 2
        variance = np.diag(posterior)
        ok = np.isfinite(variance) & (variance > 0) & np.all(np.isfinite(posterior), axis=1)
        full_ratio = np.diag(covariance) / variance
        full_offset = (posterior @ mean_grad) / np.sqrt(variance)
    return np.where(ok, full_ratio, ratio), np.where(ok, full_offset, offset)
