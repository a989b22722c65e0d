"""Distributed Stein variational gradient descent (Kassab & Simeone, DSVGD).

The target is the generalised global posterior (DSVGD Eq. (2))

    q_opt(theta) ∝ p_0(theta) exp(-(1/alpha) sum_k L_k(theta)),

with ``p_0`` the model's prior and ``L_k`` client ``k``'s term of a
:class:`~numpyro_fed.FederatedPotential` (its negative log-likelihood), on the unconstrained
latent space. The server holds ``N`` global particles; client ``k`` holds ``N`` local
particles whose KDE encodes its approximate likelihood ``t_k``. In each round a scheduled
client

1. downloads the global particles and runs ``L`` SVGD steps (Eq. (13)) towards its tilted
   distribution, whose score is (Eq. (14))
   ``grad log q^(i-1) - grad log t_k^(i-1) - (1/alpha) grad L_k``, with ``q^(i-1)`` the KDE of
   the downloaded particles (the prior itself before the first round) and ``t_k^(i-1)`` the
   KDE of its local particles (``t_k = 1`` until the client is first scheduled);
2. uploads the result;
3. runs ``L'`` SVGD steps on its local particles (distillation, Eq. (17)) towards
   ``t_k^(i) = t_k^(i-1) q^(i) / q^(i-1)``.

Two kernels with two bandwidths are involved: the RBF kernel ``k(x, y) = exp(-|x - y|^2 / h)``
of the SVGD steps, and the Gaussian kernel ``K`` of the KDEs. The paper fixes ``K``'s standard
deviation (0.55) and uses the median heuristic ``h = med^2 / log N``; both then depend on the
units of the parameters (``kde_bandwidth=0.55`` runs it so). By default
(``kde_bandwidth="auto"``) each round works in the coordinates that whiten the global
particles it starts from, with KDEs that keep their particles' mean and variance, SVGD loops
that re-whiten in stages and ``h = 2 med^2``: an affine change of units changes nothing.
Following Algorithm 1, the prior enters only through ``q^(0)``: the clients' local targets do
not add it again.

Also here: :class:`UDSVGD` (Algorithm 4: each client keeps every global iterate it produced
instead of distilling), :class:`PDSVGD` (Algorithm 5: several clients per round, the server
distils their local particles), and the baselines the paper compares with under the same
interface: centralised :class:`SVGD` on the pooled potential, :class:`FedAvg` (a point
estimate), :class:`DistributedSGLD` (Ahn et al. 2014) and :class:`GaussianPVI` (partitioned
variational inference with a mean-field Gaussian, an adapter over
:mod:`numpyro_fed.infer.pvi`).

With ``batch_size``, the likelihood gradients of every step come from a fresh minibatch of
the client's rows (without replacement, scaled by ``n_k / batch_size``), as in the paper's
experiments; the core builders take such an estimator as ``stochastic_client_grad``. A run
whose particles turn non-finite stops with a :class:`FloatingPointError` naming the step size.

The functional core (:func:`svgd_direction`, :func:`kde_grad_log_density`,
:func:`build_svgd_kernel`, :func:`build_dsvgd_round`, ...) knows nothing of NumPyro: it works
on flat ``(N, d)`` particle arrays and gradient functions. The classes build those from a
model with :func:`~numpyro_fed.split_potential` and run one jitted round per communication
round.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from numpyro.distributions.transforms import biject_to
from numpyro.handlers import seed, trace
from numpyro.infer.initialization import init_to_uniform

from numpyro_fed import metrics as _metrics
from numpyro_fed._checks import check_int, check_positive
from numpyro_fed.arviz import federation_attrs, register_converter
from numpyro_fed.potential import split_potential

__all__ = [
    "DSVGD",
    "DSVGDRunResult",
    "DSVGDState",
    "DistributedSGLD",
    "FedAvg",
    "Whitening",
    "GaussianPVI",
    "Optimizer",
    "PDSVGD",
    "SVGD",
    "UDSVGD",
    "UDSVGDState",
    "adagrad_momentum",
    "build_dsvgd_round",
    "build_pdsvgd_round",
    "build_svgd_kernel",
    "build_udsvgd_round",
    "classification_metrics",
    "kde_grad_log_density",
    "kde_log_density",
    "kl_metric_1d",
    "median_bandwidth",
    "shrunk_kde",
    "whitening",
    "wide_median_bandwidth",
    "rbf_kernel",
    "regression_metrics",
    "sgd",
    "svgd_direction",
    "svgd_run",
]


# -- kernels ----------------------------------------------------------------------------------


def _squared_distances(x, y):
    """``(n, m)`` matrix of squared Euclidean distances between the rows of ``x`` and ``y``."""
    diff = x[:, None, :] - y[None, :, :]
    return jnp.sum(diff * diff, axis=-1)


def wide_median_bandwidth(particles) -> jax.Array:
    """``h = 2 med^2``: the SVGD bandwidth of ``kde_bandwidth="auto"`` (whitened coordinates).

    Wider than the median heuristic by ``2 log N``. For ``N`` particles of a standard normal
    in ``d`` dimensions, ``med^2`` is about ``2 d`` and the median heuristic's kernel is so
    narrow that SVGD's particles settle with too little variance (0.38 instead of 1 for
    ``N = 20``, ``d = 5``); with ``2 med^2`` they settle at about 0.9. DSVGD feeds each
    round's particles to the next one, so that shortfall would compound round after round.

    >>> import jax.numpy as jnp
    >>> float(wide_median_bandwidth(jnp.array([[0.0], [1.0], [3.0]])))  # med = 2
    8.0
    """
    n = particles.shape[0]
    if n < 2:
        return jnp.ones((), particles.dtype)
    rows, cols = np.triu_indices(n, k=1)
    h = 2.0 * jnp.median(_squared_distances(particles, particles)[rows, cols])
    return jnp.where(h > 0, h, jnp.ones_like(h))


def median_bandwidth(particles) -> jax.Array:
    """The median heuristic of SVGD: ``h = med^2 / log N``.

    ``med`` is the median of the distances between distinct pairs of the ``N`` particles
    (rows of ``particles``). With one particle, or when all particles coincide, ``h = 1``
    (the kernel then only matters through ``k(x, x) = 1``).

    >>> import jax.numpy as jnp
    >>> round(float(median_bandwidth(jnp.array([[0.0], [1.0], [3.0]]))), 6)  # med = 2: 4 / log 3
    3.640957
    """
    n = particles.shape[0]
    if n < 2:
        return jnp.ones((), particles.dtype)
    rows, cols = np.triu_indices(n, k=1)
    distances = jnp.sqrt(_squared_distances(particles, particles)[rows, cols])
    h = jnp.median(distances) ** 2 / math.log(n)
    return jnp.where(h > 0, h, jnp.ones_like(h))


def rbf_kernel(x, y, bandwidth) -> jax.Array:
    """The RBF kernel matrix ``k(x_i, y_j) = exp(-|x_i - y_j|^2 / h)`` of rows of ``x``, ``y``.

    >>> import jax.numpy as jnp
    >>> [[round(v, 4) for v in row] for row in rbf_kernel(jnp.zeros((1, 2)), jnp.ones((1, 2)), 2.0).tolist()]
    [[0.3679]]
    """
    return jnp.exp(-_squared_distances(x, y) / bandwidth)


def svgd_direction(particles, scores, bandwidth=None) -> jax.Array:
    """The SVGD update direction of every particle (the sum in Eq. (8), divided by ``N``).

    ``phi(x_n) = (1/N) sum_j [k(x_j, x_n) grad log p(x_j) + grad_{x_j} k(x_j, x_n)]`` with the
    RBF kernel of bandwidth ``h`` (``None``: :func:`median_bandwidth` of ``particles``).

    :param particles: ``(N, d)``.
    :param scores: ``(N, d)``, ``grad log p`` at each particle.
    :param bandwidth: ``h > 0``, ``None`` or a function ``particles -> h``.
    :return: ``(N, d)``.

    >>> import jax.numpy as jnp
    >>> x = jnp.array([[-1.0], [1.0]])
    >>> [f"{v:.4f}" for v in svgd_direction(x, -x, 2.0)[:, 0].tolist()]  # N(0, 1): drift, repulsion
    ['0.2970', '-0.2970']
    """
    n = particles.shape[0]
    if bandwidth is None:
        h = median_bandwidth(particles)
    elif callable(bandwidth):
        h = bandwidth(particles)
    else:
        h = bandwidth
    k = rbf_kernel(particles, particles, h)  # symmetric
    column_sums = jnp.sum(k, axis=0)
    repulsion = (2.0 / h) * (particles * column_sums[:, None] - k @ particles)
    return (k @ scores + repulsion) / n


def kde_log_density(theta, centres, bandwidth) -> jax.Array:
    """Log density of the Gaussian KDE ``(1/N) sum_n N(theta | centres_n, diag(bandwidth^2))``.

    :param theta: ``(M, d)`` query points.
    :param centres: ``(N, d)`` particles.
    :param bandwidth: standard deviation of the Gaussian kernel: a scalar, or ``(d,)`` (one per
        coordinate).
    :return: ``(M,)``.

    >>> import jax.numpy as jnp
    >>> [round(v, 4) for v in kde_log_density(jnp.zeros((1, 1)), jnp.zeros((1, 1)), 1.0).tolist()]
    [-0.9189]
    """
    d = theta.shape[-1]
    bandwidth = jnp.broadcast_to(jnp.asarray(bandwidth, theta.dtype), (d,))
    logits = -_squared_distances(theta / bandwidth, centres / bandwidth) / 2.0
    return (
        jax.nn.logsumexp(logits, axis=1)
        - math.log(centres.shape[0])
        - 0.5 * jnp.sum(jnp.log(2.0 * jnp.pi * bandwidth**2))
    )


def kde_grad_log_density(theta, centres, bandwidth) -> jax.Array:
    """Gradient of :func:`kde_log_density` at each query point, ``(M, d)``.

    ``sum_n w_n(theta) (centres_n - theta) / bandwidth^2`` with softmax weights: finite even
    far from every centre. ``bandwidth``: a scalar or ``(d,)``.

    >>> import jax.numpy as jnp
    >>> kde_grad_log_density(jnp.array([[1.0]]), jnp.array([[0.0]]), 0.5).tolist()
    [[-4.0]]
    """
    bandwidth = jnp.asarray(bandwidth, theta.dtype)
    logits = -_squared_distances(theta / bandwidth, centres / bandwidth) / 2.0
    weights = jax.nn.softmax(logits, axis=1)
    return (weights @ centres - theta) / bandwidth**2


#: The kernel of ``kde_bandwidth="auto"``, in standard deviations of the particles (per
#: coordinate, in whitened coordinates); with the shrinkage of :func:`shrunk_kde` the KDE is
#: then close to a Gaussian with the particles' moments. Smaller factors keep more of the
#: particles' shape but make the ratios of KDEs in DSVGD's targets noisier: Silverman's rule
#: (0.59 for 20 particles in 5 dimensions) left the spread of a logistic regression's
#: particles 1.3-1.7 times the posterior's, 0.85 within 5% (docs/guide/dsvgd.md).
AUTO_KDE_FACTOR = 0.85

#: SVGD stages per loop of a round with ``kde_bandwidth="auto"`` (see :func:`_staged_svgd`).
AUTO_STAGES = 4


def _dtype_eps(dtype):
    return float(jnp.finfo(dtype).eps)


def shrunk_kde(centres, factor):
    """A Gaussian KDE that keeps the mean and the per-coordinate variance of its particles.

    Returns ``(centres', bandwidth)`` for :func:`kde_grad_log_density`: the kernel's standard
    deviation is ``factor`` times the particles' own, per coordinate, and the particles are
    first shrunk towards their mean by ``sqrt(1 - factor^2)`` (West 1993), so that the KDE is
    not wider than the particles (a plain KDE adds the kernel's variance to theirs).
    Coordinates in which the particles coincide get a kernel of width ``factor``.

    >>> import jax.numpy as jnp
    >>> c, h = shrunk_kde(jnp.array([[-1.0], [1.0]]), 0.6)
    >>> [round(v, 4) for v in c[:, 0].tolist()], round(float(h[0]), 4)  # variance 0.8^2 + 0.6^2 = 1
    ([-0.8, 0.8], 0.6)
    """
    mean = jnp.mean(centres, axis=0)
    sd = jnp.std(centres, axis=0)
    tiny = 10.0 * _dtype_eps(centres.dtype) * (1.0 + jnp.abs(mean))
    sd = jnp.where(sd > tiny, sd, 1.0)
    shrink = math.sqrt(1.0 - factor**2)
    return mean + shrink * (centres - mean), factor * sd


class Whitening(NamedTuple):
    """An affine change of coordinates ``z = chol^{-1} (x - mean)`` of the latent space.

    :ivar mean: ``(d,)``.
    :ivar chol: ``(d, d)`` lower-triangular, ``chol chol^T`` the covariance it whitens.
    """

    mean: jax.Array
    chol: jax.Array

    def to_z(self, x):
        """``(..., d)`` points to whitened coordinates."""
        flat = jnp.reshape(x - self.mean, (-1, x.shape[-1]))
        z = jax.scipy.linalg.solve_triangular(self.chol, flat.T, lower=True).T
        return jnp.reshape(z, x.shape)

    def from_z(self, z):
        """Whitened coordinates back to ``(..., d)`` points."""
        return self.mean + z @ self.chol.T

    def score_to_z(self, g):
        """A gradient (score) with respect to ``x`` as one with respect to ``z``: ``chol^T g``."""
        return g @ self.chol


def whitening(particles, full: bool | None = None) -> Whitening:
    """The :class:`Whitening` that gives ``particles`` (``(N, d)``) mean 0 and identity
    covariance.

    ``full``: whiten with the full covariance (Cholesky factor; a ridge of ``sqrt(eps)``
    times its diagonal keeps it positive definite) or, if ``False``, with the per-coordinate
    standard deviations only. ``None`` (default): full when ``N > 2 d`` (enough particles to
    estimate ``d (d + 1) / 2`` covariances), per coordinate otherwise. Coordinates in which
    the particles coincide (e.g. ``N = 1``) keep a scale of 1.

    Under a change of units ``x' = a * x + b`` (``a`` a positive vector) the whitened
    coordinates of ``x'`` are those of ``x``, exactly.

    >>> import jax.numpy as jnp
    >>> w = whitening(jnp.array([[0.0, 10.0], [2.0, 30.0], [4.0, 20.0]]), full=False)
    >>> [[round(v, 4) for v in row] for row in w.to_z(jnp.array([[2.0, 20.0]])).tolist()]
    [[0.0, 0.0]]
    """
    n, d = particles.shape
    full = (n > 2 * d) if full is None else bool(full)
    mean = jnp.mean(particles, axis=0)
    centred = particles - mean
    var = jnp.mean(centred * centred, axis=0)
    tiny = (10.0 * _dtype_eps(particles.dtype) * (1.0 + jnp.abs(mean))) ** 2
    degenerate = ~(var > tiny)
    var = jnp.where(degenerate, 1.0, var)
    if not full:
        return Whitening(mean, jnp.diag(jnp.sqrt(var)))
    cov = centred.T @ centred / n
    cov = jnp.where(degenerate[:, None] | degenerate[None, :], 0.0, cov)
    cov = cov + jnp.diag(jnp.where(degenerate, 1.0, math.sqrt(_dtype_eps(particles.dtype)) * var))
    return Whitening(mean, jnp.linalg.cholesky(cov))


# -- optimisers -------------------------------------------------------------------------------


class Optimizer(NamedTuple):
    """A pair of pure functions in the convention of optax's ``GradientTransformation``.

    ``init(params) -> state``; ``update(grads, state, params=None) -> (updates, state)`` with
    ``params + updates`` the step that *decreases* the objective whose gradient is ``grads``.
    Any optax optimiser has the same two methods and can be passed instead.
    """

    init: Callable
    update: Callable


class AdagradMomentumState(NamedTuple):
    """:ivar count: steps taken; :ivar accumulator: running average of squared gradients."""

    count: jax.Array
    accumulator: Any


def adagrad_momentum(learning_rate: float = 0.05, momentum: float = 0.9, eps: float = 1e-6) -> Optimizer:
    """AdaGrad with momentum, the step-size rule of SVGD's and DSVGD's experiments.

    The accumulator starts at ``g_1^2`` and then moves as ``a <- momentum a + (1 - momentum)
    g^2``; the step is ``-learning_rate g / (eps + sqrt(a))``. The paper's Table 3 uses
    ``learning_rate`` 0.05 (binary classification) or 0.001 (regression, multi-class), ``eps``
    ``1e-9`` or ``1e-6`` and ``momentum`` 0.9.

    >>> import jax.numpy as jnp
    >>> opt = adagrad_momentum(0.1)
    >>> updates, state = opt.update(jnp.array([2.0]), opt.init(jnp.zeros(1)))
    >>> [round(v, 4) for v in updates.tolist()]  # the first step has length learning_rate
    [-0.1]
    """
    learning_rate = check_positive(learning_rate, "learning_rate")
    momentum = float(momentum)
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    eps = check_positive(eps, "eps")

    def init(params):
        return AdagradMomentumState(jnp.zeros((), jnp.int32), jax.tree.map(jnp.zeros_like, params))

    def update(grads, state, params=None):
        first = state.count == 0
        accumulator = jax.tree.map(
            lambda a, g: jnp.where(first, a + g * g, momentum * a + (1.0 - momentum) * g * g),
            state.accumulator, grads,
        )
        updates = jax.tree.map(lambda g, a: -learning_rate * g / (eps + jnp.sqrt(a)), grads, accumulator)
        return updates, AdagradMomentumState(state.count + 1, accumulator)

    return Optimizer(init, update)


def sgd(learning_rate: float) -> Optimizer:
    """Plain gradient steps ``-learning_rate * g`` (no state).

    >>> import jax.numpy as jnp
    >>> sgd(0.5).update(jnp.array([2.0]), None)[0].tolist()
    [-1.0]
    """
    learning_rate = check_positive(learning_rate, "learning_rate")
    return Optimizer(
        lambda params: None,
        lambda grads, state, params=None: (jax.tree.map(lambda g: -learning_rate * g, grads), state),
    )


def _check_optimizer(optimizer, name):
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise TypeError(f"{name} must have init and update methods (an Optimizer or an optax optimiser)")
    return optimizer


# -- SVGD core --------------------------------------------------------------------------------


class SVGDState(NamedTuple):
    """:ivar particles: ``(N, d)``; :ivar opt_state: the optimiser's state."""

    particles: jax.Array
    opt_state: Any


def build_svgd_kernel(score_fn: Callable, optimizer: Optimizer, bandwidth=None) -> Callable:
    """One SVGD step as a pure function ``kernel(state) -> state``.

    :param score_fn: ``(N, d) -> (N, d)``, the target's ``grad log p`` at every particle.
    :param optimizer: maps the SVGD direction to a step (the direction is passed as the
        gradient of a quantity to *decrease*, i.e. with its sign flipped).
    :param bandwidth: RBF bandwidth ``h``; ``None``: median heuristic at every step.
    """

    def kernel(state: SVGDState) -> SVGDState:
        phi = svgd_direction(state.particles, score_fn(state.particles), bandwidth)
        updates, opt_state = optimizer.update(-phi, state.opt_state, state.particles)
        return SVGDState(state.particles + updates, opt_state)

    return kernel


def svgd_run(particles, score_fn: Callable, num_steps: int, optimizer: Optimizer, bandwidth=None):
    """``num_steps`` SVGD steps from ``particles`` (a fresh optimiser state), by ``lax.scan``.

    >>> import jax, jax.numpy as jnp
    >>> x0 = jax.random.normal(jax.random.PRNGKey(0), (50, 1)) + 3.0
    >>> x = svgd_run(x0, lambda x: -x, 500, adagrad_momentum(0.1))  # towards N(0, 1)
    >>> abs(float(x.mean())) < 0.05, abs(float(x.std()) - 1.0) < 0.1
    (True, True)
    """
    return _svgd_scan(particles, score_fn, num_steps, optimizer, bandwidth)


def _svgd_scan(particles, score_fn, num_steps, optimizer, bandwidth, key=None):
    """:func:`svgd_run`; with a ``key``, ``score_fn(x, key_t)`` gets a fresh key per step
    (minibatch gradients)."""
    state = SVGDState(particles, optimizer.init(particles))
    if key is None:
        kernel = build_svgd_kernel(score_fn, optimizer, bandwidth)
        state, _ = lax.scan(lambda s, _: (kernel(s), None), state, None, length=num_steps)
        return state.particles

    def step(s, k):
        return build_svgd_kernel(lambda x: score_fn(x, k), optimizer, bandwidth)(s), None

    state, _ = lax.scan(step, state, jax.random.split(key, num_steps))
    return state.particles


def _staged_svgd(particles, score_fn, num_steps, optimizer, bandwidth, key=None, stages: int = 1):
    """:func:`_svgd_scan` in ``stages`` stages of equal length (and one for the remainder);
    each stage runs in the coordinates that whiten the particles it starts from (the target is
    the same; only SVGD's kernel and the optimiser's steps follow the particles' current
    scale) with a fresh optimiser state. One stage: plain :func:`_svgd_scan`."""
    if stages <= 1 or num_steps < stages:
        return _svgd_scan(particles, score_fn, num_steps, optimizer, bandwidth, key)

    def stage(x, size, stage_key):
        w = whitening(x)
        if stage_key is None:
            def stage_score(u):
                return w.score_to_z(score_fn(w.from_z(u)))
        else:
            def stage_score(u, k):
                return w.score_to_z(score_fn(w.from_z(u), k))
        return w.from_z(_svgd_scan(w.to_z(x), stage_score, size, optimizer, bandwidth, stage_key))

    length, remainder = divmod(num_steps, stages)
    keys = None if key is None else jax.random.split(key, stages + 1)
    if keys is None:
        x, _ = lax.scan(lambda x, _: (stage(x, length, None), None), particles, None, length=stages)
    else:
        x, _ = lax.scan(lambda x, k: (stage(x, length, k), None), particles, keys[:stages])
    if remainder:
        x = stage(x, remainder, None if keys is None else keys[stages])
    return x


# -- DSVGD core -------------------------------------------------------------------------------


class DSVGDState(NamedTuple):
    """State of DSVGD (Algorithm 1) and P-DSVGD (Algorithm 5).

    :ivar global_particles: ``(N, d)``, the server's particles (``phi`` in P-DSVGD).
    :ivar local_particles: ``(K, N, d)``, each client's local particles (in a deployment each
        client holds only its own row).
    :ivar visited: ``(K,)`` bool, whether each client has been scheduled.
    :ivar round: rounds done.

    The local particles of client ``k`` encode ``p_0 t_k`` (their KDE over the prior), a
    proper density. Before its first round they are the initial prior draws, but the rounds
    use ``t_k^(0) = 1`` (Algorithm 1, line 1) exactly for a client not yet visited, and
    ``q^(0) = p_0`` exactly while no client has been visited: a KDE of a few prior draws is a
    poor stand-in for the prior in many dimensions.
    """

    global_particles: jax.Array
    local_particles: jax.Array
    visited: jax.Array
    round: jax.Array


def dsvgd_init(particles, num_clients: int) -> DSVGDState:
    """The state of Algorithm 1, line 1: local particles are copies of the prior draws."""
    particles = jnp.asarray(particles)
    return DSVGDState(
        global_particles=particles,
        local_particles=jnp.broadcast_to(particles, (num_clients,) + particles.shape),
        visited=jnp.zeros(num_clients, bool),
        round=jnp.zeros((), jnp.int32),
    )


def _client_update(global_particles, local_particles, block, *, prior_score, client_grad,
                   kde_score, temperature, local_steps, distill_steps, optimizer,
                   distill_optimizer, svgd_bandwidth, key=None, visited=True, first=False,
                   stages=1):
    """Lines 4-7 of Algorithm 1 at one client: returns (new global, new local) particles.

    The local particles encode ``p_0 t_k`` (a proper density), so that
    ``grad log t_k = grad log KDE(local) - grad log p_0``. Where Algorithm 1 knows the
    densities exactly, they are used instead of KDEs: ``t_k^(0) = 1`` for a client not yet
    ``visited``, and ``q^(0) = p_0`` while no client has been visited (``first``). ``client_grad(x, block, key)``
    is the batched gradient of ``L_k`` (``key``: a fresh key per step, ``None`` without one);
    ``kde_score(x, centres)`` the gradient of the log KDE of ``centres`` at ``x``.
    """

    def score_previous(x):  # grad log q^(i-1)
        return jnp.where(first, prior_score(x), kde_score(x, global_particles))

    def score_local(x):  # grad log p_0 t_k^(i-1)
        return jnp.where(visited, kde_score(x, local_particles), prior_score(x))

    def tilted_score(x, step_key=None):  # Eq. (14)
        return (score_previous(x) - score_local(x) + prior_score(x)
                - client_grad(x, block, step_key) / temperature)

    new_global = _staged_svgd(global_particles, tilted_score, local_steps, optimizer, svgd_bandwidth, key,
                              stages)

    def factor_score(x):  # grad log p_0 t_k^(i), t_k^(i) = t_k^(i-1) q^(i) / q^(i-1)  (Eq. (17))
        return kde_score(x, new_global) + score_local(x) - score_previous(x)

    # With stages (kde_bandwidth="auto"), a client's first distillation starts from the
    # uploaded particles: its initial local particles (prior draws) stand for no density
    # (t_k^(0) = 1 exactly) and may lie many whitened units from the target, further than
    # the distillation's steps travel. (The paper's variant starts from them.)
    start = local_particles if stages <= 1 else jnp.where(visited, local_particles, new_global)
    new_local = _staged_svgd(start, factor_score, distill_steps, distill_optimizer, svgd_bandwidth,
                             stages=stages)
    return new_global, new_local


def _batched_grad(client_grad, stochastic_client_grad):
    """``(x (N, d), block, key) -> (N, d)``: the minibatch estimate when a key is given and
    ``stochastic_client_grad`` exists, the full-batch ``client_grad`` at every particle
    otherwise."""
    full = jax.vmap(client_grad, in_axes=(0, None))
    if stochastic_client_grad is None:
        return lambda x, block, key=None: full(x, block)
    return lambda x, block, key=None: full(x, block) if key is None else stochastic_client_grad(x, block, key)


def _check_key(key, stochastic_client_grad):
    if stochastic_client_grad is not None and key is None:
        raise ValueError("a round with stochastic_client_grad needs a key: round(state, client, block, key)")


def check_kde_bandwidth(kde_bandwidth):
    """``"auto"`` or a positive float (checked)."""
    if isinstance(kde_bandwidth, str):
        if kde_bandwidth != "auto":
            raise ValueError(f"kde_bandwidth must be 'auto' or a positive number, got {kde_bandwidth!r}")
        return kde_bandwidth
    return check_positive(kde_bandwidth, "kde_bandwidth")


def _kde_scorer(kde_bandwidth) -> Callable:
    """``(x, centres) -> grad log KDE(centres)(x)``: with ``"auto"``, the moment-keeping KDE
    (:func:`shrunk_kde`) with a kernel of :data:`AUTO_KDE_FACTOR` standard deviations;
    otherwise a plain KDE of standard deviation ``kde_bandwidth``."""
    if kde_bandwidth == "auto":
        def score(x, centres):
            shrunk, bandwidth = shrunk_kde(centres, AUTO_KDE_FACTOR)
            return kde_grad_log_density(x, shrunk, bandwidth)

        return score
    return lambda x, centres: kde_grad_log_density(x, centres, kde_bandwidth)


class _Frame(NamedTuple):
    """The coordinates a round runs in, with the scores expressed in them."""

    to_z: Callable
    from_z: Callable
    prior_score: Callable
    client_grad: Callable


def _round_frame(kde_bandwidth, global_particles, prior_score, client_grad) -> _Frame:
    """With ``kde_bandwidth="auto"`` a round runs in the coordinates that whiten the global
    particles it starts from (:func:`whitening`); with a fixed bandwidth, in the model's own."""
    if kde_bandwidth != "auto":
        identity = lambda x: x
        return _Frame(identity, identity, prior_score, client_grad)
    w = whitening(global_particles)
    return _Frame(
        w.to_z, w.from_z,
        lambda z: w.score_to_z(prior_score(w.from_z(z))),
        lambda z, block, key=None: w.score_to_z(client_grad(w.from_z(z), block, key)),
    )


def build_dsvgd_round(
    prior_grad: Callable,
    client_grad: Callable,
    *,
    local_steps: int,
    distill_steps: int,
    optimizer: Optimizer,
    distill_optimizer: Optimizer | None = None,
    kde_bandwidth: float | str = "auto",
    svgd_bandwidth=None,
    temperature: float = 1.0,
    stochastic_client_grad: Callable | None = None,
) -> Callable:
    """One round of DSVGD (Algorithm 1) as ``round(state, client, block, key=None) -> state``.

    :param prior_grad: ``(d,) -> (d,)``, gradient of the prior potential ``-log p_0``.
    :param client_grad: ``((d,), block) -> (d,)``, gradient of client ``k``'s loss ``L_k``
        given its data ``block``.
    :param int local_steps: ``L``, SVGD steps towards the tilted distribution.
    :param int distill_steps: ``L'``, distillation steps.
    :param optimizer: step rule of the ``L`` steps (fresh state every round).
    :param distill_optimizer: step rule of the ``L'`` steps (default: ``optimizer``).
    :param kde_bandwidth: ``"auto"``: the round's densities are defined in the coordinates
        that whiten the global particles it starts from (:func:`whitening`), with
        moment-keeping KDEs (:func:`shrunk_kde`, kernel :data:`AUTO_KDE_FACTOR` standard
        deviations); each SVGD loop runs in :data:`AUTO_STAGES` stages that re-whiten its own
        particles (:func:`_staged_svgd`); a client's first distillation starts from the
        uploaded particles. Nothing then depends on the units of the parameters. A float:
        the paper's algorithm as published, a KDE kernel of that standard deviation in the
        model's own coordinates (the paper uses 0.55).
    :param svgd_bandwidth: ``h`` of the SVGD kernel (in whitened coordinates with
        ``kde_bandwidth="auto"``); ``None``: :func:`wide_median_bandwidth` with
        ``kde_bandwidth="auto"``, the median heuristic otherwise.
    :param float temperature: ``alpha``.
    :param stochastic_client_grad: ``((N, d), block, key) -> (N, d)``, an unbiased estimate
        of ``grad L_k`` at every particle from a minibatch drawn with ``key`` (the same
        minibatch for all particles); used instead of ``client_grad`` in the ``L`` steps,
        with a fresh key per step split from the round's ``key``.

    ``client`` is the scheduled client's index (may be traced) and ``block`` its data;
    ``key`` is needed with ``stochastic_client_grad`` only.
    """
    distill_optimizer = optimizer if distill_optimizer is None else distill_optimizer
    kde_bandwidth = check_kde_bandwidth(kde_bandwidth)
    if kde_bandwidth == "auto" and svgd_bandwidth is None:
        svgd_bandwidth = wide_median_bandwidth
    stages = AUTO_STAGES if kde_bandwidth == "auto" else 1
    prior_score = jax.vmap(lambda x: -prior_grad(x))
    batched_client_grad = _batched_grad(client_grad, stochastic_client_grad)

    def round_fn(state: DSVGDState, client, block, key=None) -> DSVGDState:
        _check_key(key, stochastic_client_grad)
        frame = _round_frame(kde_bandwidth, state.global_particles, prior_score, batched_client_grad)
        new_global, new_local = _client_update(
            frame.to_z(state.global_particles), frame.to_z(state.local_particles[client]), block,
            prior_score=frame.prior_score, client_grad=frame.client_grad,
            kde_score=_kde_scorer(kde_bandwidth),
            temperature=temperature, local_steps=local_steps,
            distill_steps=distill_steps, optimizer=optimizer,
            distill_optimizer=distill_optimizer, svgd_bandwidth=svgd_bandwidth, key=key,
            visited=state.visited[client], first=~jnp.any(state.visited), stages=stages,
        )
        return DSVGDState(
            global_particles=frame.from_z(new_global),
            local_particles=state.local_particles.at[client].set(frame.from_z(new_local)),
            visited=state.visited.at[client].set(True),
            round=state.round + 1,
        )

    return round_fn


def build_pdsvgd_round(
    prior_grad: Callable,
    client_grad: Callable,
    *,
    local_steps: int,
    distill_steps: int,
    server_steps: int,
    optimizer: Optimizer,
    distill_optimizer: Optimizer | None = None,
    server_optimizer: Optimizer | None = None,
    kde_bandwidth: float | str = "auto",
    svgd_bandwidth=None,
    temperature: float = 1.0,
    stochastic_client_grad: Callable | None = None,
) -> Callable:
    """One round of P-DSVGD (Algorithm 5) as ``round(state, clients, blocks, key=None) -> state``.

    The scheduled ``clients`` (an ``(C,)`` array of distinct indices; ``blocks`` their data,
    stacked) each run the two loops of DSVGD from the server particles, in parallel
    (``vmap``), and upload their local particles; the server then runs ``server_steps`` SVGD
    steps (Eq. (29)) on its particles towards ``q^(i) = p_0 prod_k t_k^(i)`` (Eq. (28)), over
    the clients scheduled so far. ``stochastic_client_grad`` and ``kde_bandwidth`` as in
    :func:`build_dsvgd_round` (with ``"auto"``, one whitening of the server's particles serves
    the whole round).
    """
    distill_optimizer = optimizer if distill_optimizer is None else distill_optimizer
    server_optimizer = optimizer if server_optimizer is None else server_optimizer
    kde_bandwidth = check_kde_bandwidth(kde_bandwidth)
    if kde_bandwidth == "auto" and svgd_bandwidth is None:
        svgd_bandwidth = wide_median_bandwidth
    stages = AUTO_STAGES if kde_bandwidth == "auto" else 1
    prior_score = jax.vmap(lambda x: -prior_grad(x))
    batched_client_grad = _batched_grad(client_grad, stochastic_client_grad)

    def round_fn(state: DSVGDState, clients, blocks, key=None) -> DSVGDState:
        _check_key(key, stochastic_client_grad)
        frame = _round_frame(kde_bandwidth, state.global_particles, prior_score, batched_client_grad)
        kde_score = _kde_scorer(kde_bandwidth)
        global_z = frame.to_z(state.global_particles)

        def one_client(local, block, key, visited, first):
            return _client_update(
                global_z, local, block,
                prior_score=frame.prior_score, client_grad=frame.client_grad,
                kde_score=kde_score, temperature=temperature, local_steps=local_steps,
                distill_steps=distill_steps, optimizer=optimizer,
                distill_optimizer=distill_optimizer, svgd_bandwidth=svgd_bandwidth, key=key,
                visited=visited, first=first, stages=stages,
            )[1]

        first = ~jnp.any(state.visited)
        locals_z = frame.to_z(state.local_particles[clients])
        if key is None:
            new_locals = jax.vmap(lambda local, block, seen: one_client(local, block, None, seen, first))(
                locals_z, blocks, state.visited[clients])
        else:
            new_locals = jax.vmap(one_client, in_axes=(0, 0, 0, 0, None))(
                locals_z, blocks, jax.random.split(key, clients.shape[0]), state.visited[clients], first)
        local_particles = state.local_particles.at[clients].set(frame.from_z(new_locals))
        visited = state.visited.at[clients].set(True)
        all_locals_z = frame.to_z(local_particles)

        def server_score(x):  # Eq. (28): grad log p_0 + sum_k grad log t_k^(i), t_k = 1 if unvisited
            prior = frame.prior_score(x)
            factors = jax.vmap(kde_score, in_axes=(None, 0))(x, all_locals_z) - prior  # locals encode p_0 t_k
            factors = jnp.where(visited[:, None, None], factors, 0.0)
            return prior + jnp.sum(factors, axis=0)

        new_global = _staged_svgd(global_z, server_score, server_steps, server_optimizer, svgd_bandwidth,
                                  stages=stages)
        return DSVGDState(frame.from_z(new_global), local_particles, visited, state.round + 1)

    return round_fn


class UDSVGDState(NamedTuple):
    """State of U-DSVGD (Algorithm 4).

    :ivar global_particles: ``(N, d)``.
    :ivar history: ``(I + 1, N, d)``, the global iterates ``theta^(0..I)`` (row ``j`` filled
        once round ``j`` is done). Client ``k``'s buffer is the rows ``j - 1, j`` of the rounds
        ``j`` it was scheduled in; :attr:`scheduled` says which.
    :ivar scheduled: ``(I,)`` int, the client of each round (``-1``: not yet run).
    :ivar round: rounds done.
    """

    global_particles: jax.Array
    history: jax.Array
    scheduled: jax.Array
    round: jax.Array


def udsvgd_init(particles, num_rounds: int) -> UDSVGDState:
    particles = jnp.asarray(particles)
    history = jnp.zeros((num_rounds + 1,) + particles.shape, particles.dtype).at[0].set(particles)
    return UDSVGDState(particles, history, jnp.full(num_rounds, -1, jnp.int32), jnp.zeros((), jnp.int32))


def build_udsvgd_round(
    prior_grad: Callable,
    client_grad: Callable,
    *,
    local_steps: int,
    optimizer: Optimizer,
    kde_bandwidth: float | str = "auto",
    svgd_bandwidth=None,
    temperature: float = 1.0,
    stochastic_client_grad: Callable | None = None,
) -> Callable:
    """One round of U-DSVGD (Algorithm 4) as ``round(state, client, block, key=None) -> state``.

    ``grad log t_k^(i-1)`` is the recursion (15) over the client's buffer:
    ``sum_{j in I_k} grad log q^(j) - grad log q^(j-1)``, with ``q^(0) = p_0``.
    ``stochastic_client_grad`` and ``kde_bandwidth`` as in :func:`build_dsvgd_round`.
    """
    kde_bandwidth = check_kde_bandwidth(kde_bandwidth)
    if kde_bandwidth == "auto" and svgd_bandwidth is None:
        svgd_bandwidth = wide_median_bandwidth
    stages = AUTO_STAGES if kde_bandwidth == "auto" else 1
    prior_score = jax.vmap(lambda x: -prior_grad(x))
    batched_client_grad = _batched_grad(client_grad, stochastic_client_grad)

    def round_fn(state: UDSVGDState, client, block, key=None) -> UDSVGDState:
        _check_key(key, stochastic_client_grad)
        num_rounds = state.scheduled.shape[0]
        mine = (state.scheduled == client) & (jnp.arange(num_rounds) < state.round)
        frame = _round_frame(kde_bandwidth, state.global_particles, prior_score, batched_client_grad)
        kde_score = _kde_scorer(kde_bandwidth)
        history = frame.to_z(state.history)

        def iterate_scores(x):  # grad log q^(j) for j = 0..I, q^(0) the prior
            kde = jax.vmap(kde_score, in_axes=(None, 0))(x, history)
            return kde.at[0].set(frame.prior_score(x))

        def tilted_score(x, step_key=None):
            scores = iterate_scores(x)
            factor = jnp.sum(jnp.where(mine[:, None, None], scores[1:] - scores[:-1], 0.0), axis=0)
            previous = scores[state.round]
            return previous - factor - frame.client_grad(x, block, step_key) / temperature

        new_global = frame.from_z(_staged_svgd(frame.to_z(state.global_particles), tilted_score,
                                               local_steps, optimizer, svgd_bandwidth, key, stages))
        return UDSVGDState(
            new_global,
            state.history.at[state.round + 1].set(new_global),
            state.scheduled.at[state.round].set(jnp.asarray(client, state.scheduled.dtype)),
            state.round + 1,
        )

    return round_fn


# -- baselines core ---------------------------------------------------------------------------


def _sgld_run(key, particles, grad_potential, num_steps, step_size_fn, first_step):
    """``num_steps`` Langevin steps ``x <- x - (eps/2) grad U + N(0, eps)``, eps from a schedule;
    ``grad_potential(x, key)`` gets a fresh key per step (minibatches)."""

    def step(x, inputs):
        t, k = inputs
        eps = step_size_fn(first_step + t)
        noise_key, batch_key = jax.random.split(k)
        noise = jax.random.normal(noise_key, x.shape, x.dtype)
        return x - 0.5 * eps * grad_potential(x, batch_key) + jnp.sqrt(eps) * noise, None

    keys = jax.random.split(key, num_steps)
    x, _ = lax.scan(step, particles, (jnp.arange(num_steps), keys))
    return x


def _descend(params, grad_fn, num_steps, optimizer, key):
    """``num_steps`` optimiser steps on ``grad_fn(x, key_t)``, a fresh key per step."""

    def step(carry, k):
        x, opt_state = carry
        updates, opt_state = optimizer.update(grad_fn(x, k), opt_state, x)
        return (x + updates, opt_state), None

    (x, _), _ = lax.scan(step, (params, optimizer.init(params)), jax.random.split(key, num_steps))
    return x


# -- schedules --------------------------------------------------------------------------------


def _check_schedule(schedule):
    """A method's ``schedule`` argument, its name checked (sequences are checked by
    :func:`_make_schedule`, which knows the number of rounds and clients)."""
    if isinstance(schedule, str) and schedule not in ("round_robin", "random"):
        raise ValueError(f"schedule must be 'round_robin', 'random' or a sequence of client "
                         f"indices, got {schedule!r}")
    return schedule


def _data_plate(fp, needed_by: str) -> str:
    """The name of the model's one federated data plate; ``needed_by`` names what needs it."""
    plates = [p.name for p in fp.plates.values() if p.holds_data]
    if len(plates) != 1:
        raise ValueError(f"{needed_by} needs a model with one federated data plate, found {plates}")
    return plates[0]


def _make_schedule(schedule, num_rounds: int, num_clients: int, rng_key, per_round: int | None):
    """``(num_rounds,)`` (or ``(num_rounds, per_round)``) client indices for each round."""
    if isinstance(schedule, str):
        if schedule == "round_robin":
            if per_round is None:
                return np.arange(num_rounds) % num_clients
            start = np.arange(num_rounds)[:, None] * per_round + np.arange(per_round)[None, :]
            return start % num_clients
        if schedule == "random":
            if per_round is None:
                return np.asarray(jax.random.randint(rng_key, (num_rounds,), 0, num_clients))
            keys = jax.random.split(rng_key, num_rounds)
            perms = jax.vmap(lambda k: jax.random.permutation(k, num_clients)[:per_round])(keys)
            return np.asarray(perms)
        raise ValueError(f"schedule must be 'round_robin', 'random' or a sequence of client indices, got {schedule!r}")
    array = np.asarray(schedule)
    if array.dtype == bool or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"schedule must hold integer client indices, got dtype {array.dtype}")
    expected_ndim = 1 if per_round is None else 2
    if array.ndim != expected_ndim:
        shape = "(num_rounds,)" if per_round is None else "(num_rounds, clients_per_round)"
        raise ValueError(f"schedule must have shape {shape}, got {array.shape}")
    if array.shape[0] < num_rounds:
        raise ValueError(f"schedule gives {array.shape[0]} rounds, but num_rounds={num_rounds}")
    bad = array[(array < 0) | (array >= num_clients)]
    if bad.size:
        raise ValueError(
            f"schedule names unknown client(s) {sorted(set(bad.tolist()))}: clients are 0..{num_clients - 1}"
        )
    if per_round is not None:
        for i, row in enumerate(array[:num_rounds]):
            if len(set(row.tolist())) != row.size:
                raise ValueError(f"schedule round {i} names a client twice: {row.tolist()}")
    return array[:num_rounds]


# -- metrics ----------------------------------------------------------------------------------


def kl_metric_1d(site: str, log_target: Callable, grid, bandwidth: float = 0.55) -> Callable:
    """A per-round metric: ``KL(target || KDE of the particles)`` for a scalar site.

    The particles' density is their Gaussian KDE with standard deviation ``bandwidth`` (the
    paper's ``q``), both densities are renormalised on ``grid`` (see
    :func:`numpyro_fed.metrics.kl_1d`).

    :param str site: a scalar latent site.
    :param log_target: ``grid -> log target density`` (unnormalised is fine).
    :param grid: increasing 1-D grid covering the target's mass.
    """
    grid = np.asarray(grid, dtype=float)
    bandwidth = check_positive(bandwidth, "bandwidth")
    target = np.asarray(log_target(grid), dtype=float)

    def metric(draws):
        values = np.asarray(draws[site], dtype=float).reshape(-1)
        with np.errstate(divide="ignore"):
            log_q = np.log(_metrics.kde_1d(values, grid, bandwidth))
        return _metrics.kl_1d(target, log_q, grid)

    return metric


def classification_metrics(probability_fn: Callable, X_test, y_test, *, num_bins: int = 10,
                           reliability: bool = False) -> Callable:
    """Per-round metrics for a binary classifier: accuracy, log predictive density, MCE.

    :param probability_fn: ``(draws, X) -> (S, n)`` probability of class 1 under each draw
        (``draws`` a dict of constrained values with a leading axis of ``S`` draws), or
        ``(S, n, C)`` class probabilities.
    :param X_test: held-out inputs, passed to ``probability_fn`` unchanged.
    :param y_test: held-out integer labels ``(n,)``.
    :param int num_bins: bins of the reliability diagram and of the maximum calibration error.
    :param bool reliability: also record each round's reliability diagram
        (``reliability_confidence``, ``reliability_accuracy``, ``reliability_counts``).

    The prediction is the average of the draws' probabilities (Appendix A.3).
    """
    y = np.asarray(y_test).astype(np.int64)
    num_bins = check_int(num_bins, "num_bins", minimum=1)

    def metric(draws):
        probs = np.asarray(probability_fn(draws, X_test), dtype=float)
        probs = np.clip(probs, 1e-12, 1 - 1e-12) if probs.ndim == 2 else np.clip(probs, 1e-12, 1.0)
        mean = probs.mean(axis=0)
        if probs.ndim == 2:
            log_lik = np.where(y[None, :] == 1, np.log(probs), np.log1p(-probs))
        else:
            mean = mean / mean.sum(axis=1, keepdims=True)
            log_lik = np.log(np.take_along_axis(probs, y[None, :, None], axis=2)[..., 0])
        out = {
            "accuracy": _metrics.accuracy(mean, y),
            "log_predictive_density": _metrics.log_predictive_density(log_lik),
            "maximum_calibration_error": _metrics.maximum_calibration_error(mean, y, num_bins),
        }
        if reliability:
            diagram = _metrics.reliability_diagram(mean, y, num_bins)
            out["reliability_confidence"] = diagram.confidence
            out["reliability_accuracy"] = diagram.accuracy
            out["reliability_counts"] = diagram.counts
        return out

    return metric


def regression_metrics(predict_fn: Callable, X_test, y_test, *, y_scale: float = 1.0) -> Callable:
    """Per-round metrics for regression: RMSE of the predictive mean and log predictive density.

    :param predict_fn: ``(draws, X) -> (mean, scale)``, each ``(S, n)``: the Gaussian
        predictive of each draw (``scale`` may be ``None``: no log density then).
    :param y_test: held-out targets ``(n,)``.
    :param float y_scale: multiplies the RMSE (e.g. the training ``y`` standard deviation to
        report it in original units); the log density is on the scale of ``y_test``.
    """
    y = np.asarray(y_test, dtype=float)
    y_scale = check_positive(y_scale, "y_scale")

    def metric(draws):
        mean, scale = predict_fn(draws, X_test)
        mean = np.asarray(mean, dtype=float)
        out = {"rmse": y_scale * _metrics.rmse(mean.mean(axis=0), y)}
        if scale is not None:
            scale = np.broadcast_to(np.asarray(scale, dtype=float), mean.shape)
            log_lik = -0.5 * ((y - mean) / scale) ** 2 - np.log(scale) - 0.5 * math.log(2 * math.pi)
            out["log_predictive_density"] = _metrics.log_predictive_density(log_lik)
        return out

    return metric


# -- NumPyro-facing classes -------------------------------------------------------------------


class DSVGDRunResult(NamedTuple):
    """What :meth:`DSVGD.run` (and the other methods here) return.

    :ivar particles: ``(N, d)`` final global particles, flat and unconstrained (see
        :meth:`DSVGD.get_samples` for constrained values by site).
    :ivar state: the final state of the method (e.g. :class:`DSVGDState`).
    :ivar dict metrics: per-round metrics, each an array with a leading axis of
        ``num_rounds``: ``client`` (the scheduled client(s)), ``wall_time`` (seconds since
        the start, after each round) and the user's metrics.
    :ivar history: ``(num_rounds + 1, N, d)`` global particles before the first round and
        after each round.
    """

    particles: jax.Array
    state: Any
    metrics: dict
    history: jax.Array


class _ParticleMethod:
    """Shared face of the methods here: model -> split potential -> rounds -> results."""

    _per_round: int | None = None  # clients per round (P-DSVGD), None: one

    _step_size_name = "learning_rate"  # what to lower when the particles diverge

    def __init__(self, model, *, num_particles: int, metrics: Mapping[str, Callable] | None,
                 partition, init_strategy, progress_bar: bool, temperature: float,
                 batch_size: int | None = None):
        if not callable(model):
            raise TypeError(f"model must be a callable NumPyro model, got {type(model).__name__}")
        self.model = model
        self.num_particles = check_int(num_particles, "num_particles", minimum=1)
        self.batch_size = None if batch_size is None else check_int(batch_size, "batch_size", minimum=1)
        self.temperature = check_positive(temperature, "temperature")
        metrics = dict(metrics or {})
        for name, fn in metrics.items():
            if not callable(fn):
                raise TypeError(f"metric '{name}' must be a callable draws -> value")
        self.metrics = metrics
        self.partition = partition
        self.init_strategy = init_strategy
        self.progress_bar = bool(progress_bar)
        self.federated_potential = None

    # -- model plumbing ------------------------------------------------------------------
    def _setup(self, args, kwargs):
        fp = split_potential(self.model, args, kwargs, partition=self.partition,
                             init_strategy=self.init_strategy)
        local = np.asarray(fp.coordinate_owner) >= 0
        if local.any():
            sites = [name for name, owner in fp.coordinate_owner_tree.items() if (np.asarray(owner) >= 0).any()]
            raise ValueError(
                f"{type(self).__name__} infers global latent variables only; site(s) {sites} are "
                "client-local (inside a federated plate)"
            )
        self.federated_potential = fp
        unravel = fp.unravel

        def prior_grad(x):
            return jax.grad(lambda y: fp.prior_potential_fn(unravel(y)))(x)

        def client_grad(x, block):
            return jax.grad(lambda y: fp.client_potential_fn(unravel(y), block))(x)

        self._prior_grad, self._client_grad = prior_grad, client_grad
        self._stochastic_grad = None if self.batch_size is None else self._minibatch_grad(fp, self.batch_size)
        self._postprocess = jax.jit(jax.vmap(lambda x: fp.postprocess_fn(unravel(x))))
        return fp

    @staticmethod
    def _minibatch_grad(fp, batch_size: int) -> Callable:
        """``(x (N, d), block, key) -> (N, d)``: ``grad L_k`` at every particle estimated from
        ``batch_size`` of the client's rows drawn without replacement (the same rows for every
        particle), scaled by ``n_k / batch_size``. A client with fewer rows uses them all."""
        plate, unravel = _data_plate(fp, "batch_size"), fp.unravel

        def loss(y, rows, weights, scale):
            return -scale * jnp.sum(weights * fp.row_log_likelihood_fn(unravel(y), rows))

        grad = jax.vmap(jax.grad(loss), in_axes=(0, None, None, None))

        def stochastic_grad(x, block, key):
            valid = block["valid"][plate]
            count = min(batch_size, valid.shape[0])
            priority = jnp.where(valid, jax.random.uniform(key, valid.shape), -1.0)
            positions = lax.top_k(priority, count)[1]
            weights = valid[positions].astype(x.dtype)
            scale = jnp.sum(valid).astype(x.dtype) / jnp.maximum(jnp.sum(weights), 1.0)
            rows = jax.tree.map(lambda r: r[positions], block["rows"])
            return grad(x, rows, weights, scale)

        return stochastic_grad

    def _client_grad_fn(self) -> Callable:
        """``(x (N, d), block, key) -> (N, d)``: minibatch or full-batch ``grad L_k``."""
        return _batched_grad(self._client_grad, self._stochastic_grad)

    def _prior_particles(self, rng_key, args, kwargs, num):
        """``num`` draws of the global latents from the prior, flat and unconstrained."""
        fp = self.federated_potential
        names = list(fp.init_params)

        # One compiled program, the data arrays as its arguments (not constants; other
        # arguments, e.g. sizes, stay static): run op by op, the model's likelihood would be
        # evaluated, and each operation compiled, for nothing.
        leaves, treedef = jax.tree_util.tree_flatten((tuple(args), dict(kwargs)))
        dynamic = [i for i, leaf in enumerate(leaves) if isinstance(leaf, (jax.Array, np.ndarray))]

        def one(key, arrays):
            full = list(leaves)
            for i, array in zip(dynamic, arrays):
                full[i] = array
            model_args, model_kwargs = jax.tree_util.tree_unflatten(treedef, full)
            tr = trace(seed(self.model, key)).get_trace(*model_args, **model_kwargs)
            z = {name: biject_to(tr[name]["fn"].support).inv(tr[name]["value"]) for name in names}
            return fp.ravel(z)

        draw = jax.jit(jax.vmap(one, in_axes=(0, None)))
        return draw(jax.random.split(rng_key, num), [leaves[i] for i in dynamic])

    def _block(self, client):
        return jax.tree.map(lambda a: a[client], self.federated_potential.client_data)

    def _check_particles(self, particles, name):
        d = self.federated_potential.num_latent
        particles = jnp.asarray(particles)
        if particles.shape != (self.num_particles, d):
            raise ValueError(f"{name} must have shape (num_particles, d) = ({self.num_particles}, {d}), "
                             f"got {particles.shape}")
        return particles

    # -- public ------------------------------------------------------------------------------
    def constrained(self, particles) -> dict:
        """Constrained values by site of ``(S, d)`` flat unconstrained particles."""
        return self._postprocess(jnp.asarray(particles))

    def get_samples(self, rng_key, result: DSVGDRunResult, num_samples: int | None = None, *,
                    smooth: bool = False) -> dict:
        """Constrained posterior draws by site.

        :param rng_key: key for the draws.
        :param result: what :meth:`run` returned.
        :param num_samples: draws to return; ``None``: the particles themselves.
        :param bool smooth: draw from the KDE of the particles (each draw is a random particle
            plus Gaussian noise of the KDE bandwidth, on the unconstrained space) rather than
            from the particles themselves. With ``kde_bandwidth="auto"``, the moment-keeping
            KDE of :func:`shrunk_kde` per coordinate.
        """
        particles = jnp.asarray(result.particles)
        if num_samples is None:
            if smooth:
                raise ValueError("smooth=True needs num_samples")
            return self.constrained(particles)
        num_samples = check_int(num_samples, "num_samples", minimum=1)
        pick_key, noise_key = jax.random.split(rng_key)
        index = jax.random.randint(pick_key, (num_samples,), 0, particles.shape[0])
        draws = particles[index]
        if smooth:
            bandwidth = getattr(self, "kde_bandwidth", None)
            if bandwidth is None:
                raise ValueError(f"{type(self).__name__} has no KDE: smooth=True does not apply")
            if bandwidth == "auto":
                shrunk, bandwidth = shrunk_kde(particles, AUTO_KDE_FACTOR)
                draws = shrunk[index]
            draws = draws + bandwidth * jax.random.normal(noise_key, draws.shape, draws.dtype)
        return self.constrained(draws)

    def _evaluate_metrics(self, particles):
        if not self.metrics:
            return {}
        draws = {k: np.asarray(v) for k, v in self.constrained(particles).items()}
        out = {}
        for name, fn in self.metrics.items():
            value = fn(draws)
            if isinstance(value, Mapping):
                out.update({f"{name}.{k}" if len(self.metrics) > 1 else k: v for k, v in value.items()})
            else:
                out[name] = value
        return out

    def _loop(self, num_rounds, state, step, particles_of, schedule):
        import time

        from tqdm.auto import tqdm

        history = [particles_of(state)]
        records: dict[str, list] = {"client": [], "wall_time": []}
        start = time.perf_counter()
        rounds = range(num_rounds)
        bar = tqdm(rounds, desc=type(self).__name__, disable=not self.progress_bar)
        for i in bar:
            state = step(state, i)
            particles = particles_of(state)
            finite = bool(jnp.all(jnp.isfinite(particles)))  # also waits for the round
            records["wall_time"].append(time.perf_counter() - start)
            if not finite:
                bar.close()
                raise FloatingPointError(
                    f"{type(self).__name__} diverged: non-finite particles after round {i + 1} "
                    f"of {num_rounds}; lower {self._step_size_name}"
                )
            records["client"].append(np.asarray(schedule[i]) if schedule is not None else -1)
            history.append(particles)
            values = self._evaluate_metrics(particles)
            for name, value in values.items():
                records.setdefault(name, []).append(value)
            if self.progress_bar and values:
                scalars = {k: float(v) for k, v in values.items() if np.ndim(v) == 0}
                bar.set_postfix({k: f"{v:.4g}" for k, v in list(scalars.items())[:3]})
        metrics = {name: np.asarray(values) for name, values in records.items()}
        return DSVGDRunResult(particles_of(state), state, metrics, jnp.stack(history))


class DSVGD(_ParticleMethod):
    """Distributed Stein variational gradient descent (Kassab & Simeone, Algorithm 1).

    :param model: a NumPyro model with a :class:`~numpyro_fed.federated_plate`; its latent
        variables must be global (outside the federated plates).
    :param int num_particles: ``N`` (>= 1), global and local particles alike.
    :param int local_steps: ``L``, SVGD steps of a scheduled client towards its tilted
        distribution.
    :param int distill_steps: ``L'``, distillation steps on the client's local particles.
    :param float learning_rate: of the default optimiser, :func:`adagrad_momentum` (the
        paper's Table 3: 0.05 for logistic regression, 0.001 for BNNs).
    :param optimizer: step rule of the ``L`` steps (an :class:`Optimizer` or any optax
        optimiser), overriding ``learning_rate``; its state is reset every round.
    :param distill_optimizer: step rule of the ``L'`` steps (default: as ``optimizer``).
    :param kde_bandwidth: ``"auto"`` (default): every round runs in the coordinates that
        whiten the global particles it starts from (their mean and covariance, or per-coordinate
        standard deviations when ``N <= 2 d``); its KDEs keep the mean and variance of their
        particles (kernel: 0.85 of their standard deviation); its SVGD loops re-whiten their
        particles in four stages. The run does not depend on the units of the parameters
        (exactly, up to rounding, for a change of units ``a x + b`` per coordinate). A float:
        the paper's algorithm as published, a Gaussian KDE kernel of that standard deviation in
        the model's unconstrained coordinates (the paper: 0.55); its results depend on the
        units.
    :param svgd_bandwidth: bandwidth ``h`` of the SVGD kernel ``exp(-|x - y|^2 / h)`` (in the
        whitened coordinates with ``kde_bandwidth="auto"``); ``None`` (default): ``2 med^2``
        (:func:`wide_median_bandwidth`) with ``kde_bandwidth="auto"``, the median heuristic
        ``med^2 / log N`` with a fixed ``kde_bandwidth``.
    :param float temperature: ``alpha`` of the free energy (1: Bayes' posterior).
    :param schedule: ``"round_robin"`` (default), ``"random"`` (a uniformly random client per
        round, from the run's key) or a sequence of client indices, one per round.
    :param dict metrics: ``{name: fn}`` evaluated on the global particles after every round;
        ``fn(draws)`` receives a dict of constrained values by site (leading axis ``N``) and
        returns a number, an array or a dict of them (see :func:`kl_metric_1d`,
        :func:`classification_metrics`, :func:`regression_metrics`).
    :param dict partition: as for :func:`~numpyro_fed.split_potential`.
    :param init_strategy: NumPyro init strategy used to build the potential (the particles
        themselves start as prior draws, Algorithm 1 line 1).
    :param bool progress_bar: a progress bar over rounds.
    :param int batch_size: rows of the client's data per SVGD step (drawn afresh at every
        step, without replacement, the gradient scaled by ``n_k / batch_size``), as in the
        paper's experiments (Table 2: 100 for the regression BNNs); ``None`` (default): all
        of them. Needs a model with one federated data plate.

    **Checks.** Non-finite particles stop the run with a :class:`FloatingPointError`. Once
    every client has been scheduled, each round also checks the global particles against
    Stein's identity for the target ``p``, which holds for any ``p``:
    ``E_p[d log p / d x_j] = 0`` and ``E_p[(d log p / d x_j) (x_j - m_j)] = -1``. With the
    full-batch score (one gradient per client and particle), ``result.metrics`` records per
    round and coordinate ``stein_mean`` (the mean score times the particles' sd: 0 expected;
    for a Gaussian target, the offset of the mean in posterior sds times the sd ratio) and
    ``stein_scale`` (minus the mean of score times deviation: 1 expected; for a Gaussian target,
    the ratio of the particles' variance to the posterior's). After the last round, a mean
    more than 3 posterior sds off by that measure (``|stein_mean| / sqrt(stein_scale) > 3``),
    ``stein_scale`` outside ``[1/4, 4]``, or (in a run from prior draws) a spread or a
    distance from the prior draws of more than 1000 of their sds, is reported by a
    :class:`RuntimeWarning` that names what to change.

    **Example**

    >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> import numpyro_fed as nf
    >>> def model(y):
    ...     mu = numpyro.sample("mu", dist.Normal(0, 3))
    ...     with nf.federated_plate("data", y.shape[0], clients=2):
    ...         numpyro.sample("y", dist.Normal(mu, 3), obs=y)
    >>> y = jnp.array([0.5, 1.5, 2.0, 4.0])
    >>> dsvgd = nf.DSVGD(model, num_particles=20, local_steps=100, distill_steps=100,
    ...                  progress_bar=False)
    >>> result = dsvgd.run(jax.random.PRNGKey(0), 4, y)
    >>> draws = dsvgd.get_samples(jax.random.PRNGKey(1), result, 1000)
    >>> draws["mu"].shape, result.metrics["client"].tolist()
    ((1000,), [0, 1, 0, 1])
    >>> abs(float(draws["mu"].mean()) - 8.0 / (4 + 1)) < 0.3  # exact posterior mean 1.6
    True
    """

    _from_prior = True  # set by run(): whether the run started from prior draws

    def __init__(
        self,
        model,
        *,
        num_particles: int = 20,
        local_steps: int = 200,
        distill_steps: int = 200,
        learning_rate: float = 0.05,
        optimizer=None,
        distill_optimizer=None,
        kde_bandwidth: float | str = "auto",
        svgd_bandwidth: float | None = None,
        temperature: float = 1.0,
        schedule="round_robin",
        metrics: Mapping[str, Callable] | None = None,
        partition=None,
        init_strategy=init_to_uniform,
        progress_bar: bool = True,
        batch_size: int | None = None,
    ):
        super().__init__(model, num_particles=num_particles, metrics=metrics, partition=partition,
                         init_strategy=init_strategy, progress_bar=progress_bar,
                         temperature=temperature, batch_size=batch_size)
        self.local_steps = check_int(local_steps, "local_steps", minimum=1)
        self.distill_steps = check_int(distill_steps, "distill_steps", minimum=0)
        self.optimizer = (adagrad_momentum(learning_rate) if optimizer is None
                          else _check_optimizer(optimizer, "optimizer"))
        self.distill_optimizer = (self.optimizer if distill_optimizer is None
                                  else _check_optimizer(distill_optimizer, "distill_optimizer"))
        self.kde_bandwidth = check_kde_bandwidth(kde_bandwidth)
        self.svgd_bandwidth = None if svgd_bandwidth is None else check_positive(svgd_bandwidth, "svgd_bandwidth")
        self.schedule = _check_schedule(schedule)

    def init(self, rng_key, *args, init_particles=None, **kwargs) -> DSVGDState:
        """The initial state (Algorithm 1, line 1): global and local particles from the prior.

        ``init_particles`` (``(N, d)``, flat unconstrained) replaces the prior draws.
        """
        fp = self._setup(args, kwargs)
        if init_particles is None:
            particles = self._prior_particles(rng_key, args, kwargs, self.num_particles)
        else:
            particles = self._check_particles(init_particles, "init_particles")
        return dsvgd_init(particles, fp.num_clients)

    def _round_fn(self):
        return build_dsvgd_round(
            self._prior_grad, self._client_grad, local_steps=self.local_steps,
            distill_steps=self.distill_steps, optimizer=self.optimizer,
            distill_optimizer=self.distill_optimizer, kde_bandwidth=self.kde_bandwidth,
            svgd_bandwidth=self.svgd_bandwidth, temperature=self.temperature,
            stochastic_client_grad=self._stochastic_grad,
        )

    def _run_rounds(self, num_rounds, state, schedule_key) -> DSVGDRunResult:
        """The driver shared by the DSVGD variants: schedule, one jitted round per round."""
        fp = self.federated_potential
        schedule = _make_schedule(self.schedule, num_rounds, fp.num_clients, schedule_key, self._per_round)
        round_fn = jax.jit(self._round_fn())
        data = fp.client_data
        keys = (None if self._stochastic_grad is None
                else jax.random.split(jax.random.fold_in(schedule_key, 1), num_rounds))

        def step(state, i):
            client = jnp.asarray(schedule[i])
            block = jax.tree.map(lambda a: a[client], data)
            return round_fn(state, client, block) if keys is None else round_fn(state, client, block, keys[i])

        result = self._loop(num_rounds, state, step, lambda s: s.global_particles, schedule)
        return self._check_runaway(result, schedule)

    def _stein_statistics(self):
        """``history (R, N, d) -> (stein_mean, stein_scale)``, each ``(R, d)``: Stein's identity
        for the target with the full-batch score, in the particles' own units."""
        fp = self.federated_potential
        prior_score = jax.vmap(lambda x: -self._prior_grad(x))
        client_grad = jax.vmap(self._client_grad, in_axes=(0, None))
        temperature = self.temperature

        def one(x):
            grads = jax.vmap(client_grad, in_axes=(None, 0))(x, fp.client_data)
            score = prior_score(x) - jnp.sum(grads, axis=0) / temperature
            mean = jnp.mean(x, axis=0)
            sd = jnp.std(x, axis=0)
            return jnp.mean(score, axis=0) * sd, -jnp.mean(score * (x - mean), axis=0)

        return jax.jit(lambda history: lax.map(one, history))

    def _check_runaway(self, result: DSVGDRunResult, schedule) -> DSVGDRunResult:
        """Records the Stein statistics per round; warns if the last round's particles are
        absurd (see the class docstring)."""
        import warnings

        history = result.history
        if history.shape[1] < 2:
            return result
        stein_mean, stein_scale = (np.asarray(v) for v in self._stein_statistics()(history[1:]))
        result.metrics["stein_mean"], result.metrics["stein_scale"] = stein_mean, stein_scale
        start, end = np.asarray(history[0], dtype=float), np.asarray(history[-1], dtype=float)
        # Compared with the prior draws only: particles given by the user may be as narrow as
        # they like.
        start_sd = start.std(axis=0) if self._from_prior else np.zeros(start.shape[1])
        spread = np.where(start_sd > 0, end.std(axis=0) / np.where(start_sd > 0, start_sd, 1.0), 0.0)
        distance = np.where(start_sd > 0, np.abs(end.mean(axis=0) - start.mean(axis=0))
                            / np.where(start_sd > 0, start_sd, 1.0), 0.0)
        problems = []
        if np.max(spread) > 1e3:
            problems.append(f"their spread grew {np.max(spread):.3g}-fold from the prior draws "
                            f"(coordinate {int(np.argmax(spread))})")
        if np.max(distance) > 1e3:
            problems.append(f"their mean moved {np.max(distance):.3g} prior sds "
                            f"(coordinate {int(np.argmax(distance))})")
        all_visited = len(np.unique(np.asarray(schedule))) == self.federated_potential.num_clients
        if all_visited:
            m, v = stein_mean[-1], stein_scale[-1]
            # For a Gaussian target, stein_mean / sqrt(stein_scale) is the mean's offset in
            # posterior sds and stein_scale the variance ratio.
            offset = np.where(v > 0, np.abs(m) / np.sqrt(np.where(v > 0, v, 1.0)), np.inf)
            if np.max(offset) > 3:
                j = int(np.argmax(offset))
                problems.append(f"the target's score at the particles does not average 0 "
                                f"(stein_mean {m[j]:.3g}, stein_scale {v[j]:.3g} in coordinate {j}: "
                                f"for a Gaussian posterior, a mean {offset[j]:.3g} posterior sds off)")
            if np.max(v) > 4 or np.min(v) < 0.25:
                j = int(np.argmax(np.abs(np.log(np.maximum(v, 1e-300)))))
                problems.append(f"their spread does not match the target's score (stein_scale "
                                f"{v[j]:.3g} in coordinate {j}, 1 expected; for a Gaussian posterior, "
                                f"the particles' variance over the posterior's)")
        if problems:
            remedy = ("use kde_bandwidth='auto' (the default), which adapts to the particles' scale, "
                      if self.kde_bandwidth != "auto" else "")
            warnings.warn(
                f"{type(self).__name__}'s particles ran away or did not converge after "
                f"{history.shape[0] - 1} rounds: " + "; ".join(problems) + ". Change the settings: "
                + remedy + "lower learning_rate, use more num_particles, local_steps or rounds",
                RuntimeWarning, stacklevel=4,
            )
        return result

    def run(self, rng_key, num_rounds: int, *args, init_state=None, init_particles=None, **kwargs) -> DSVGDRunResult:
        """Runs ``num_rounds`` communication rounds.

        :param rng_key: key for the initial particles and a random schedule.
        :param int num_rounds: ``I``.
        :param args: the model's positional arguments (the clients' data).
        :param init_state: a :class:`DSVGDState` to continue from (e.g. ``result.state``).
        :param init_particles: ``(N, d)`` flat unconstrained initial particles instead of
            prior draws.
        :param kwargs: the model's keyword arguments.
        """
        num_rounds = check_int(num_rounds, "num_rounds", minimum=1)
        init_key, schedule_key = jax.random.split(rng_key)
        if init_state is None:
            state = self.init(init_key, *args, init_particles=init_particles, **kwargs)
        else:
            fp = self._setup(args, kwargs)
            self._check_particles(init_state.global_particles, "init_state.global_particles")
            if init_state.local_particles.shape[0] != fp.num_clients:
                raise ValueError(f"init_state has {init_state.local_particles.shape[0]} clients, "
                                 f"the model {fp.num_clients}")
            state = init_state
        self._from_prior = init_state is None and init_particles is None
        return self._run_rounds(num_rounds, state, schedule_key)


class PDSVGD(DSVGD):
    """Parallel DSVGD (Appendix A.5, Algorithm 5): several clients per round.

    The scheduled clients run DSVGD's two loops from the server's particles in parallel and
    upload their *local* particles; the server distils ``q^(i) = p_0 prod_k t_k^(i)`` into its
    ``N`` particles with ``server_steps`` SVGD steps.

    :param clients_per_round: number of clients per round (an int ``>= 1``) or a fraction of
        them in ``(0, 1]`` (the paper's ``C``; rounded up).
    :param int server_steps: ``L_s`` (default: ``local_steps``).
    :param server_optimizer: step rule of the server's steps (default: ``optimizer``).
    :param schedule: ``"round_robin"``, ``"random"`` (a fresh random subset of distinct
        clients per round) or an ``(I, C)`` array of client indices.

    Other parameters as :class:`DSVGD`.
    """

    def __init__(self, model, *, clients_per_round=1, server_steps: int | None = None,
                 server_optimizer=None, schedule="random", **kwargs):
        super().__init__(model, schedule=schedule, **kwargs)
        if isinstance(clients_per_round, bool) or not isinstance(clients_per_round, (int, float, np.integer, np.floating)):
            raise TypeError(f"clients_per_round must be an int or a fraction, got {clients_per_round!r}")
        if isinstance(clients_per_round, (float, np.floating)) and not float(clients_per_round).is_integer():
            if not 0.0 < clients_per_round <= 1.0:
                raise ValueError(f"clients_per_round as a fraction must be in (0, 1], got {clients_per_round}")
        elif clients_per_round < 1:
            raise ValueError(f"clients_per_round must be >= 1 (or a fraction in (0, 1]), got {clients_per_round}")
        self.clients_per_round = clients_per_round
        self.server_steps = self.local_steps if server_steps is None else check_int(server_steps, "server_steps", minimum=1)
        self.server_optimizer = (self.optimizer if server_optimizer is None
                                 else _check_optimizer(server_optimizer, "server_optimizer"))

    def _setup(self, args, kwargs):
        fp = super()._setup(args, kwargs)
        c = self.clients_per_round
        if isinstance(c, (float, np.floating)) and not float(c).is_integer():
            count = math.ceil(c * fp.num_clients)
        else:
            count = int(c)
        if count > fp.num_clients:
            raise ValueError(f"clients_per_round={count} exceeds the number of clients {fp.num_clients}")
        self._per_round = count
        return fp

    def _round_fn(self):
        return build_pdsvgd_round(
            self._prior_grad, self._client_grad, local_steps=self.local_steps,
            distill_steps=self.distill_steps, server_steps=self.server_steps,
            optimizer=self.optimizer, distill_optimizer=self.distill_optimizer,
            server_optimizer=self.server_optimizer, kde_bandwidth=self.kde_bandwidth,
            svgd_bandwidth=self.svgd_bandwidth, temperature=self.temperature,
            stochastic_client_grad=self._stochastic_grad,
        )


class UDSVGD(DSVGD):
    """U-DSVGD (Section 5.1, Algorithm 4): DSVGD without distillation.

    Each client remembers the global iterates before and after each round it was scheduled
    in, and computes ``grad log t_k`` by the recursion (15) over them, so its memory grows
    with the rounds. Parameters as :class:`DSVGD` (``distill_steps`` is ignored).
    """

    def init(self, rng_key, *args, num_rounds: int, init_particles=None, **kwargs) -> UDSVGDState:
        self._setup(args, kwargs)
        if init_particles is None:
            particles = self._prior_particles(rng_key, args, kwargs, self.num_particles)
        else:
            particles = self._check_particles(init_particles, "init_particles")
        return udsvgd_init(particles, check_int(num_rounds, "num_rounds", minimum=1))

    def _round_fn(self):
        return build_udsvgd_round(
            self._prior_grad, self._client_grad, local_steps=self.local_steps,
            optimizer=self.optimizer, kde_bandwidth=self.kde_bandwidth,
            svgd_bandwidth=self.svgd_bandwidth, temperature=self.temperature,
            stochastic_client_grad=self._stochastic_grad,
        )

    def run(self, rng_key, num_rounds: int, *args, init_particles=None, **kwargs) -> DSVGDRunResult:
        """As :meth:`DSVGD.run` (no ``init_state``: the buffers are sized by ``num_rounds``)."""
        num_rounds = check_int(num_rounds, "num_rounds", minimum=1)
        init_key, schedule_key = jax.random.split(rng_key)
        state = self.init(init_key, *args, num_rounds=num_rounds, init_particles=init_particles, **kwargs)
        self._from_prior = init_particles is None
        return self._run_rounds(num_rounds, state, schedule_key)


# -- baselines --------------------------------------------------------------------------------


class SVGD(_ParticleMethod):
    """Centralised SVGD on the pooled potential (the paper's reference), as a round method.

    Runs ``num_rounds * steps_per_round`` SVGD steps towards ``p_0 exp(-(1/alpha) sum_k L_k)``
    with the same number of particles; a "round" is ``steps_per_round`` steps, so curves line
    up with DSVGD's ``I x L`` iterations. The optimiser's state is kept across rounds.

    :param int steps_per_round: SVGD steps per recorded round (e.g. DSVGD's ``local_steps``).
    :param int batch_size: rows of the pooled data per step, ``ceil(batch_size / K)`` from each
        client (``None``: all).

    Other parameters as :class:`DSVGD`.
    """

    def __init__(self, model, *, num_particles: int = 20, steps_per_round: int = 200,
                 learning_rate: float = 0.05, optimizer=None, svgd_bandwidth=None,
                 temperature: float = 1.0, metrics=None, partition=None,
                 init_strategy=init_to_uniform, progress_bar: bool = True,
                 batch_size: int | None = None):
        super().__init__(model, num_particles=num_particles, metrics=metrics, partition=partition,
                         init_strategy=init_strategy, progress_bar=progress_bar,
                         temperature=temperature, batch_size=batch_size)
        self.steps_per_round = check_int(steps_per_round, "steps_per_round", minimum=1)
        self.optimizer = (adagrad_momentum(learning_rate) if optimizer is None
                          else _check_optimizer(optimizer, "optimizer"))
        self.svgd_bandwidth = None if svgd_bandwidth is None else check_positive(svgd_bandwidth, "svgd_bandwidth")

    def run(self, rng_key, num_rounds: int, *args, init_particles=None, **kwargs) -> DSVGDRunResult:
        num_rounds = check_int(num_rounds, "num_rounds", minimum=1)
        fp = self._setup(args, kwargs)
        if init_particles is None:
            particles = self._prior_particles(rng_key, args, kwargs, self.num_particles)
        else:
            particles = self._check_particles(init_particles, "init_particles")
        prior_score = jax.vmap(lambda x: -self._prior_grad(x))
        if self.batch_size is None:
            one_client = _batched_grad(self._client_grad, None)
        else:
            per_client = math.ceil(self.batch_size / fp.num_clients)
            one_client = _batched_grad(self._client_grad, self._minibatch_grad(fp, per_client))
        num_clients, temperature, steps = fp.num_clients, self.temperature, self.steps_per_round

        def score(x, data, key):
            keys = jax.random.split(key, num_clients)
            grads = jax.vmap(one_client, in_axes=(None, 0, 0))(x, data, keys)
            return prior_score(x) - jnp.sum(grads, axis=0) / temperature

        @jax.jit
        def round_fn(state, data, key):
            def step(s, k):
                return build_svgd_kernel(lambda x: score(x, data, k), self.optimizer, self.svgd_bandwidth)(s), None
            return lax.scan(step, state, jax.random.split(key, steps))[0]

        state = SVGDState(particles, self.optimizer.init(particles))
        data = fp.client_data
        keys = jax.random.split(jax.random.fold_in(rng_key, 1), num_rounds)
        return self._loop(num_rounds, state, lambda s, i: round_fn(s, data, keys[i]), lambda s: s.particles, None)


class FedAvg(_ParticleMethod):
    """Federated averaging with one client per round, as in the paper's comparisons.

    A point estimate: the server holds one parameter vector; the scheduled client runs
    ``local_steps`` gradient steps on its objective ``L_k(theta) + (1/K) (-log p_0(theta))``
    (its loss plus its share of the prior, so that the clients' objectives add up to the
    negative log posterior) and uploads the result. :meth:`get_samples` repeats the point.

    :param int local_steps: ``L``.
    :param float learning_rate: of the default optimiser, :func:`adagrad_momentum`.
    :param optimizer: any :class:`Optimizer` or optax optimiser.
    :param schedule: as :class:`DSVGD`.
    :param int batch_size: as :class:`DSVGD`.
    """

    def __init__(self, model, *, local_steps: int = 200, learning_rate: float = 0.05,
                 optimizer=None, schedule="round_robin", metrics=None, partition=None,
                 init_strategy=init_to_uniform, progress_bar: bool = True,
                 batch_size: int | None = None):
        super().__init__(model, num_particles=1, metrics=metrics, partition=partition,
                         init_strategy=init_strategy, progress_bar=progress_bar, temperature=1.0,
                         batch_size=batch_size)
        self.local_steps = check_int(local_steps, "local_steps", minimum=1)
        self.optimizer = (adagrad_momentum(learning_rate) if optimizer is None
                          else _check_optimizer(optimizer, "optimizer"))
        self.schedule = _check_schedule(schedule)

    def run(self, rng_key, num_rounds: int, *args, init_params=None, **kwargs) -> DSVGDRunResult:
        """``init_params``: ``(d,)`` flat unconstrained start (default: a prior draw)."""
        num_rounds = check_int(num_rounds, "num_rounds", minimum=1)
        init_key, schedule_key = jax.random.split(rng_key)
        fp = self._setup(args, kwargs)
        if init_params is None:
            point = self._prior_particles(init_key, args, kwargs, 1)
        else:
            point = self._check_particles(jnp.reshape(jnp.asarray(init_params), (1, -1)), "init_params")
        schedule = _make_schedule(self.schedule, num_rounds, fp.num_clients, schedule_key, None)
        share = 1.0 / fp.num_clients
        prior_grad, client_grad, optimizer = jax.vmap(self._prior_grad), self._client_grad_fn(), self.optimizer

        @jax.jit
        def round_fn(x, block, key):
            def objective_grad(p, k):
                return client_grad(p, block, k) + share * prior_grad(p)
            return _descend(x, objective_grad, self.local_steps, optimizer, key)

        data = fp.client_data
        keys = jax.random.split(jax.random.fold_in(schedule_key, 1), num_rounds)

        def step(x, i):
            return round_fn(x, jax.tree.map(lambda a: a[int(schedule[i])], data), keys[i])

        return self._loop(num_rounds, point, step, lambda s: s, schedule)


class DistributedSGLD(_ParticleMethod):
    """Distributed SGLD (Ahn et al. 2014) with one scheduled client per round.

    The server holds ``N`` chains; the scheduled client ``k`` moves every chain with
    ``local_steps`` Langevin steps on its data, the gradient of its loss scaled up to the
    whole data set: ``grad U ≈ grad(-log p_0) + (n / n_k) (1/alpha) grad L_k``. Step sizes
    follow the paper's annealing ``a0 (0.5 + t)^(-0.55)`` with ``t`` the global step count.

    :param int num_particles: number of chains.
    :param int local_steps: Langevin steps per round.
    :param float a0: step-size scale (the paper's Table 4: 0.01, 0.0005 for large data; its
        authors' code also divides each step by the number of chains). The largest stable
        step shrinks with the data size: Langevin steps need ``eps`` below about
        ``2 / (largest curvature of U)``.
    :param schedule: as :class:`DSVGD`.
    :param int batch_size: as :class:`DSVGD`.

    Non-finite chains stop the run with a :class:`FloatingPointError` naming ``a0``.
    """

    _step_size_name = "a0"

    def __init__(self, model, *, num_particles: int = 20, local_steps: int = 200, a0: float = 0.01,
                 temperature: float = 1.0, schedule="round_robin", metrics=None, partition=None,
                 init_strategy=init_to_uniform, progress_bar: bool = True,
                 batch_size: int | None = None):
        super().__init__(model, num_particles=num_particles, metrics=metrics, partition=partition,
                         init_strategy=init_strategy, progress_bar=progress_bar,
                         temperature=temperature, batch_size=batch_size)
        self.local_steps = check_int(local_steps, "local_steps", minimum=1)
        self.a0 = check_positive(a0, "a0")
        self.schedule = _check_schedule(schedule)

    def run(self, rng_key, num_rounds: int, *args, init_particles=None, **kwargs) -> DSVGDRunResult:
        num_rounds = check_int(num_rounds, "num_rounds", minimum=1)
        init_key, schedule_key, noise_key = jax.random.split(rng_key, 3)
        fp = self._setup(args, kwargs)
        if init_particles is None:
            particles = self._prior_particles(init_key, args, kwargs, self.num_particles)
        else:
            particles = self._check_particles(init_particles, "init_particles")
        schedule = _make_schedule(self.schedule, num_rounds, fp.num_clients, schedule_key, None)
        sizes = jnp.asarray(fp.client_sizes, particles.dtype)
        scales = jnp.sum(sizes) / sizes / self.temperature
        prior_grad, client_grad = jax.vmap(self._prior_grad), self._client_grad_fn()
        a0, steps = self.a0, self.local_steps
        stochastic = self._stochastic_grad is not None

        @jax.jit
        def round_fn(x, key, client, block, first_step):
            def grad_potential(p, k):
                return prior_grad(p) + scales[client] * client_grad(p, block, k if stochastic else None)
            return _sgld_run(key, x, grad_potential, steps, lambda t: a0 * (0.5 + t) ** -0.55, first_step)

        data = fp.client_data
        keys = jax.random.split(noise_key, num_rounds)

        def step(x, i):
            client = jnp.asarray(schedule[i])
            return round_fn(x, keys[i], client, jax.tree.map(lambda a: a[client], data), i * steps)

        return self._loop(num_rounds, particles, step, lambda s: s, schedule)


class GaussianPVI(_ParticleMethod):
    """Partitioned variational inference with a mean-field Gaussian (the paper's PVI
    baseline) under the interface of :class:`DSVGD`: one scheduled client per round.

    A thin adapter over :mod:`numpyro_fed.infer.pvi` (non-private, as
    :class:`~numpyro_fed.DPPVI` with ``dp=None``): ``q = p_0 prod_k t_k`` with Gaussian
    factors on the flat unconstrained space; the scheduled client maximises its local ELBO
    against the cavity ``q / t_k`` with ``optim`` for ``local_steps`` steps, and the server
    adds ``damping`` times the change to ``q`` and to the client's factor. The model's prior
    must be a Gaussian with independent coordinates on the unconstrained space (e.g.
    ``Normal`` priors): a ``ValueError`` says so otherwise.

    The "particles" of each round, which the metrics see and :meth:`get_samples` draws from,
    are ``num_particles`` draws of ``q`` made with the same standard normal noise every
    round (common random numbers). ``result.metrics`` also holds ``loc`` and ``scale`` of
    ``q`` after each round (``(num_rounds, d)``); :meth:`log_density` evaluates ``q``.

    :param int num_particles: draws of ``q`` reported per round.
    :param int local_steps: steps of the local optimisation.
    :param optim: an optax optimiser (default ``adam(1e-2)``).
    :param int num_mc_samples: Monte Carlo draws of ``q`` per step.
    :param float damping: in ``(0, 1]``.
    :param schedule: as :class:`DSVGD`.
    """

    _step_size_name = "the optimiser's learning rate or damping"

    def __init__(self, model, *, num_particles: int = 20, local_steps: int = 200, optim=None,
                 num_mc_samples: int = 10, damping: float = 1.0, schedule="round_robin",
                 metrics=None, partition=None, init_strategy=init_to_uniform,
                 progress_bar: bool = True):
        super().__init__(model, num_particles=num_particles, metrics=metrics, partition=partition,
                         init_strategy=init_strategy, progress_bar=progress_bar, temperature=1.0)
        import optax

        self.local_steps = check_int(local_steps, "local_steps", minimum=1)
        self.optim = optax.adam(1e-2) if optim is None else optim
        self.num_mc_samples = check_int(num_mc_samples, "num_mc_samples", minimum=1)
        self.damping = check_positive(damping, "damping")
        if self.damping > 1.0:
            raise ValueError(f"damping must lie in (0, 1], got {self.damping}")
        self.schedule = _check_schedule(schedule)

    def run(self, rng_key, num_rounds: int, *args, **kwargs) -> DSVGDRunResult:
        """Runs ``num_rounds`` rounds; ``result.state`` is the final
        :class:`~numpyro_fed.infer.pvi.PVIState`."""
        from numpyro_fed.infer import pvi

        num_rounds = check_int(num_rounds, "num_rounds", minimum=1)
        draw_key, schedule_key, run_key = jax.random.split(rng_key, 3)
        fp = self._setup(args, kwargs)
        plate = _data_plate(fp, "GaussianPVI")
        unravel, d = fp.unravel, fp.num_latent
        prior = pvi.gaussian_prior(lambda x: fp.prior_potential_fn(unravel(x)), d)
        schedule = _make_schedule(self.schedule, num_rounds, fp.num_clients, schedule_key, None)
        sizes = np.asarray(fp.client_sizes)
        shard_index, shard_valid = pvi.shard_layout(sizes, 1)
        data = pvi.ClientData(rows=fp.client_data["rows"], valid=fp.client_data["valid"][plate],
                              shard_index=shard_index, shard_valid=shard_valid)
        config = pvi.LocalConfig(optim=self.optim, num_steps=self.local_steps,
                                 num_mc_samples=self.num_mc_samples, sampling="full",
                                 sampling_rate=1.0, dpsgd=False, clip_norm=1.0)

        def row_log_lik(theta, rows):
            return fp.row_log_likelihood_fn(unravel(theta), rows)

        one = lambda tree, m: jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, m, 1), tree)
        visit = pvi.build_round(row_log_lik, one(data, 0), config, dp=None,
                                schedule="sequential", damping=self.damping)

        @jax.jit
        def round_fn(state, key, m, data):  # PVI's round over the one scheduled client
            mine = state._replace(factors=one(state.factors, m), virtual=one(state.virtual, m))
            new, _ = visit(key, mine, one(data, m))
            put = lambda all_, new_: jax.tree.map(lambda a, b: lax.dynamic_update_slice_in_dim(a, b, m, 0),
                                                  all_, new_)
            return new._replace(factors=put(state.factors, new.factors),
                                virtual=put(state.virtual, new.virtual))

        eps = jax.random.normal(draw_key, (self.num_particles, d))
        keys = jax.random.split(run_key, num_rounds)

        def draws(state):
            loc, scale = pvi.loc_scale(state.q)
            return loc + scale * eps

        locs, scales = [], []

        def step(state, i):
            state = round_fn(state, keys[i], jnp.asarray(schedule[i]), data)
            loc, scale = pvi.loc_scale(state.q)
            locs.append(np.asarray(loc))
            scales.append(np.asarray(scale))
            return state

        result = self._loop(num_rounds, pvi.init(prior, fp.num_clients), step, draws, schedule)
        result.metrics.update(loc=np.stack(locs), scale=np.stack(scales))
        return result

    def log_density(self, result: DSVGDRunResult, particles) -> jax.Array:
        """``log q`` of the final Gaussian at ``(M, d)`` flat unconstrained points."""
        from numpyro_fed.infer import pvi

        loc, scale = pvi.loc_scale(result.state.q)
        z = (jnp.asarray(particles) - loc) / scale
        return jnp.sum(-0.5 * z**2 - jnp.log(scale) - 0.5 * math.log(2 * math.pi), axis=-1)

    def get_samples(self, rng_key, result: DSVGDRunResult, num_samples: int | None = None) -> dict:
        """Constrained draws of the final ``q`` (``None``: the reported particles)."""
        from numpyro_fed.infer import pvi

        if num_samples is None:
            return self.constrained(result.particles)
        num_samples = check_int(num_samples, "num_samples", minimum=1)
        loc, scale = pvi.loc_scale(result.state.q)
        return self.constrained(loc + scale * jax.random.normal(rng_key, (num_samples, loc.shape[0]), loc.dtype))


# -- ArviZ ------------------------------------------------------------------------------------


def _inference_data(method: _ParticleMethod, result: DSVGDRunResult, **kwargs):
    """``posterior``: the final particles (one chain, a draw per particle); ``sample_stats``:
    the per-round metrics with a ``round`` dimension; ``attrs``: the algorithm and federation."""
    from numpyro_fed.arviz import from_dicts

    draws = {k: np.asarray(v)[None] for k, v in method.constrained(result.particles).items()}
    sample_stats = {}
    for name, value in result.metrics.items():
        value = np.asarray(value)
        sample_stats[name] = (value, ["round"] + [f"{name}_dim_{j}" for j in range(value.ndim - 1)])
    attrs = {"algorithm": type(method).__name__, "num_particles": int(result.particles.shape[0])}
    for name in ("kde_bandwidth", "local_steps", "distill_steps", "temperature"):
        if hasattr(method, name):
            attrs[name] = getattr(method, name)
    if method.federated_potential is not None:
        attrs.update(federation_attrs(method.federated_potential))
    coords = {"round": np.arange(1, len(result.history))}
    return from_dicts(draws, sample_stats=sample_stats, coords=coords, attrs=attrs, **kwargs)


@register_converter(_ParticleMethod)
def _from_particle_method(method, result: DSVGDRunResult, **kwargs):
    if not isinstance(result, DSVGDRunResult):
        raise TypeError(f"to_inference_data({type(method).__name__}, result): result must be what "
                        f"run() returned, got {type(result).__name__}")
    return _inference_data(method, result, **kwargs)
