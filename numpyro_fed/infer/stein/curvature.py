"""The target's local curvature as a change of coordinates, and a Laplace start for particles
that begin far from their target.

Both are affine-invariant: a change of units, or a rotation, of the parameters gives the same
particles up to rounding. They make DSVGD's default converge on posteriors whose scales and
correlations the particles do not know in advance (raw covariates, an intercept far from 0,
correlated coefficients).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from numpyro_fed.infer.stein.kde import dtype_eps
from numpyro_fed.infer.stein.whitening import whitening

__all__ = [
    "CONVERGED_DECREMENT",
    "NEWTON_ITERATIONS",
    "Affine",
    "Frame",
    "curvature_whitening",
    "laplace_start",
    "max_condition_number",
    "newton_mode",
    "newton_modes",
    "positive_curvature",
    "round_frame",
]

#: damped Newton iterations of :func:`newton_mode` (each: one Hessian, a line search of
#: :data:`_TRIALS` halvings evaluated at once).
NEWTON_ITERATIONS = 40
#: a Newton decrement ``g^T A^-1 g`` (the squared Newton step in the target's sds) at or below
#: which :func:`newton_mode`'s search has converged
CONVERGED_DECREMENT = 1e-4
_TRIALS = 12


class Affine(NamedTuple):
    """``x = mean + z @ matrix.T``: a change of coordinates with the interface of
    :class:`~numpyro_fed.infer.stein.whitening.Whitening`.

    :ivar mean: ``(d,)``; :ivar matrix: ``(d, d)``; :ivar inverse: its inverse.
    """

    mean: jax.Array
    matrix: jax.Array
    inverse: jax.Array

    def to_z(self, x):
        return (x - self.mean) @ self.inverse.T

    def from_z(self, z):
        return self.mean + z @ self.matrix.T

    def score_to_z(self, g):
        return g @ self.matrix


def _point_score(score_fn: Callable) -> Callable:
    return lambda v: score_fn(v[None])[0]


def positive_curvature(score_fn: Callable, at, relative_floor, hessian_fn: Callable | None = None):
    """Eigenvectors and eigenvalues of ``-sym(d score / dx)`` at ``at`` (``hessian_fn(at)``
    where given: the negative Hessian of ``log p``, ``(d,) -> (d, d)``), the eigenvalues made
    positive (absolute values, at least ``relative_floor`` times the largest): a saddle-free
    stand-in for the negative Hessian of ``log p``. Identity where it is not finite."""
    d = at.shape[-1]
    jac = -hessian_fn(at) if hessian_fn is not None else jax.jacfwd(_point_score(score_fn))(at)
    a = -(jac + jac.T) / 2.0
    finite = jnp.all(jnp.isfinite(a))
    a = jnp.where(finite, a, jnp.eye(d, dtype=at.dtype))
    values, vectors = jnp.linalg.eigh(a)
    values = jnp.abs(values)
    top = jnp.max(values)
    values = jnp.where(top > 0, jnp.maximum(values, relative_floor * top), 1.0)
    return vectors, values


def curvature_whitening(particles, score_fn: Callable) -> Affine:
    """Coordinates in which the target's curvature at the particles' mean is isotropic and the
    particles have unit standard deviation per coordinate.

    First the particles are whitened (:func:`~numpyro_fed.infer.stein.whitening.whitening`);
    there the negative Hessian of ``log p`` at their mean (``score_fn``: ``(N, d) -> (N, d)``,
    its gradient), made positive definite, is ``V diag(a) V^T``; the coordinates are rotated
    and stretched by ``V diag(sqrt(a)) V^T`` and scaled per coordinate by the particles' sd.
    The directions in which the target is correlated thus become the axes, whatever the
    number of particles: with fewer than ``2 d`` particles the particles' own covariance
    cannot be estimated.

    >>> import jax, jax.numpy as jnp
    >>> cov = jnp.array([[1.0, 0.99], [0.99, 1.0]])
    >>> x = jax.random.multivariate_normal(jax.random.PRNGKey(0), jnp.zeros(2), cov, (3,))
    >>> w = curvature_whitening(x, lambda x: -x @ jnp.linalg.inv(cov))
    >>> m = w.inverse @ cov @ w.inverse.T  # the target's covariance in the new coordinates
    >>> bool(abs(m[0, 1]) < 1e-4 * m[0, 0])
    True
    """
    w = whitening(particles)
    u = w.to_z(particles)
    d = particles.shape[-1]

    def score_u(v):
        return w.score_to_z(score_fn(w.from_z(v)))

    vectors, values = positive_curvature(score_u, jnp.mean(u, axis=0), 1e-8)
    root = (vectors * jnp.sqrt(values)) @ vectors.T  # A^(1/2)
    inverse_root = (vectors / jnp.sqrt(values)) @ vectors.T
    v = u @ root
    sd = jnp.std(v, axis=0)
    sd = jnp.where(sd > 10.0 * dtype_eps(particles.dtype) * (1.0 + jnp.max(sd)), sd, 1.0)
    chol_inverse = jax.scipy.linalg.solve_triangular(w.chol, jnp.eye(d, dtype=particles.dtype), lower=True)
    matrix = w.chol @ inverse_root * sd[None, :]
    inverse = (root @ chol_inverse) / sd[:, None]
    ok = jnp.all(jnp.isfinite(matrix)) & jnp.all(jnp.isfinite(inverse))
    return Affine(w.mean, jnp.where(ok, matrix, w.chol), jnp.where(ok, inverse, chol_inverse))


def newton_modes(
    score_fn: Callable,
    starts,
    num_iterations: int = NEWTON_ITERATIONS,
    hessian_fn: Callable | None = None,
    tolerance: float = 0.0,
):
    """Modes of the target (roots of ``score_fn``, ``(N, d) -> (N, d)``) by damped Newton
    from each of ``starts`` (``(S, d)``): ``(ends (S, d), decrements (S,))``, each end's Newton
    decrement ``g^T A^-1 g`` (the squared Newton step in the target's sds; ``inf`` where not
    finite). ``hessian_fn``: ``(d,) -> (d, d)``, the negative Hessian of ``log p`` (default:
    ``score_fn``'s Jacobian); given one, the starts are searched one after the other (a
    :class:`~numpyro_fed.federation.Federation`'s calls in ``score_fn`` and ``hessian_fn`` may not
    run under a ``vmap``), otherwise at once. A search stops after ``num_iterations`` steps, or
    where the decrement is at most ``tolerance`` (through a federation every step is three
    round trips).

    Saddle-free steps ``Delta = A^-1 g`` (``A`` the negative Hessian with its eigenvalues made
    positive: an ascent direction of ``log p``), no longer than a trust radius (4 units at
    first, doubled after a full step, halved otherwise), of the longest length among ``1,
    1/2, 1/4, ...`` (evaluated at once) at which ``log p`` still increases along them
    (``score . Delta > 0``): a line search on slopes, which needs no values of ``log p``.
    The radius bounds steps where the curvature vanishes (a logistic regression whose
    logits saturate).

    >>> import jax.numpy as jnp
    >>> ends, decrements = newton_modes(lambda x: -(x - 9.5) / 0.04**2 - (x - 9.5) ** 3, jnp.array([[0.0]]))
    >>> round(float(ends[0, 0]), 4), bool(decrements[0] < 1e-12)
    (9.5, True)
    """
    dtype = starts.dtype
    ts = 0.5 ** jnp.arange(_TRIALS, dtype=dtype)

    def step(carry):
        i, x, radius, _ = carry
        g = _point_score(score_fn)(x)
        vectors, values = positive_curvature(score_fn, x, 1e-10, hessian_fn)
        decrement = jnp.sum((g @ vectors) ** 2 / values)
        delta = ((g @ vectors) / values) @ vectors.T
        length = jnp.linalg.norm(delta)
        delta = delta * jnp.minimum(1.0, radius / jnp.where(length > 0, length, 1.0))
        candidates = x + ts[:, None] * delta
        slopes = score_fn(candidates) @ delta  # d/dt log p(x + t delta) at each trial t
        ok = (slopes > 0) & jnp.all(jnp.isfinite(candidates), axis=-1) & jnp.isfinite(slopes)
        pick = jnp.where(jnp.any(ok), jnp.argmax(ok), _TRIALS - 1)  # the longest step still going up
        new = candidates[pick]
        good = jnp.all(jnp.isfinite(new)) & jnp.all(jnp.isfinite(delta)) & (decrement > tolerance)
        radius = jnp.where(good & (pick == 0), 2.0 * radius, radius / 2.0)
        return i + 1, jnp.where(good, new, x), radius, jnp.where(jnp.isfinite(decrement), decrement, jnp.inf)

    def going(carry):
        i, _, _, decrement = carry
        return (i < num_iterations) & (decrement > tolerance)

    def run(start):
        inf = jnp.asarray(jnp.inf, dtype)
        _, x, _, _ = jax.lax.while_loop(going, step, (0, start, jnp.asarray(4.0, dtype), inf))
        g = _point_score(score_fn)(x)
        vectors, values = positive_curvature(score_fn, x, 1e-10, hessian_fn)
        decrement = jnp.sum((g @ vectors) ** 2 / values)
        return x, jnp.where(jnp.isfinite(decrement) & jnp.all(jnp.isfinite(x)), decrement, jnp.inf)

    return jax.lax.map(run, starts) if hessian_fn is not None else jax.vmap(run)(starts)


def max_condition_number(dtype) -> float:
    """The largest condition number of a Hessian taken for a mode's (or, in DADMMS's set-up, a
    point of the bulk's): ``min(1e6, 0.01 / eps)`` of ``dtype``. Deep in a funnel a Hessian can
    be positive definite again with a condition number past 1e16 (the centred eight schools).

    >>> import jax.numpy as jnp
    >>> max_condition_number(jnp.float64), round(max_condition_number(jnp.float32))
    (1000000.0, 83886)
    """
    return min(1e6, 1e-2 / float(jnp.finfo(dtype).eps))


def _chosen_end(ends, decrements):
    """``(end, decrement)`` of :func:`newton_modes`' searches: the first start's where it
    converged, else the one with the smallest decrement."""
    i = jnp.where(decrements[0] <= CONVERGED_DECREMENT, 0, jnp.argmin(decrements))
    return ends[i], decrements[i]


def newton_mode(score_fn: Callable, starts, num_iterations: int = NEWTON_ITERATIONS):
    """A mode of the target (a root of ``score_fn``, ``(N, d) -> (N, d)``) by
    :func:`newton_modes` from each of ``starts`` (``(S, d)``): the first start's end point
    where its search converged (Newton decrement at most :data:`CONVERGED_DECREMENT`), else
    the end point with the smallest decrement. Where the target has two modes the first
    start's is kept: a caller that knows where to look puts that start first.

    >>> import jax.numpy as jnp
    >>> mode = newton_mode(lambda x: -(x - 9.5) / 0.04**2 - (x - 9.5) ** 3, jnp.array([[0.0]]))
    >>> round(float(mode[0]), 4)
    9.5
    """
    return _chosen_end(*newton_modes(score_fn, starts, num_iterations))[0]


def laplace_start(particles, score_fn: Callable, require_mode: bool = False):
    """The particles (``(N, d)``) moved to the target's Laplace approximation: their
    standardized positions mapped to ``N(mode, A^-1)``, ``mode`` found by :func:`newton_mode`
    from their mean and from the origin of the (unconstrained) space, where e.g. a logistic
    regression's logits are 0, and ``A`` the target's negative Hessian there (eigenvalues made positive;
    in no direction wider than the particles were). The particles are returned unchanged if
    the search fails (non-finite), and with ``require_mode`` also if neither search converged
    (Newton decrement above :data:`CONVERGED_DECREMENT`) or if ``A`` at the chosen end, in the
    particles' whitened units and floored at theirs, has a condition number above
    :func:`max_condition_number`: a centred hierarchy's joint target (a client's group effects and their
    scale) has no mode, and its search runs down the funnel (radon's county scale to ``log
    sigma_a`` -11.9 in one client's first round).

    Where the particles start many of the target's sds from it, or many times wider, SVGD's
    bounded steps cannot travel the distance; from the Laplace approximation SVGD corrects the
    shape.

    >>> import jax, jax.numpy as jnp
    >>> x = jax.random.uniform(jax.random.PRNGKey(0), (50, 1), minval=-2.0, maxval=2.0)
    >>> y = laplace_start(x, lambda x: -(x - 9.5) / 0.04**2)
    >>> round(float(y.mean()), 3), round(float(y.std()), 3)
    (9.5, 0.04)
    """
    w = whitening(particles)
    u = w.to_z(particles)

    def score_u(v):
        return w.score_to_z(score_fn(w.from_z(v)))

    starts = jnp.stack([jnp.mean(u, axis=0), w.to_z(jnp.zeros_like(w.mean))])
    mode, decrement = _chosen_end(*newton_modes(score_u, starts))  # newton_mode's choice
    vectors, values = positive_curvature(score_u, mode, 1e-10)
    values = jnp.maximum(values, 1.0)  # never wider than the particles were
    standard = whitening(u).to_z(u)
    moved = w.from_z(mode + standard @ ((vectors / jnp.sqrt(values)) @ vectors.T))
    keep = jnp.all(jnp.isfinite(moved))
    if require_mode:  # a mode whose curvature is well conditioned, not a point deep in a funnel
        condition = jnp.max(values) / jnp.min(values)
        keep = keep & (decrement <= CONVERGED_DECREMENT) & (condition <= max_condition_number(u.dtype))
    return jnp.where(keep, moved, particles)


class Frame(NamedTuple):
    """The coordinates a round runs in, with the target's scores expressed in them.

    :ivar to_z: points to the round's coordinates.
    :ivar from_z: back to the model's (flat, unconstrained) coordinates.
    :ivar prior_score: ``(N, d) -> (N, d)``, ``grad log p_0`` in the round's coordinates.
    :ivar client_grad: ``((N, d), block, key) -> (N, d)``, ``grad L_k`` in them.
    :ivar score_to_z: a score (gradient) in the model's coordinates as one in the round's.
    """

    to_z: Callable
    from_z: Callable
    prior_score: Callable
    client_grad: Callable
    score_to_z: Callable


def round_frame(kde_bandwidth, global_particles, prior_score, client_grad, local_score=None) -> Frame:
    """With ``kde_bandwidth="auto"`` a round runs in the coordinates that whiten the global
    particles it starts from (:func:`~numpyro_fed.infer.stein.whitening.whitening`); with a
    fixed bandwidth, in the model's own.
    Given ``local_score`` (``(N, d) -> (N, d)``, the score of the client's own posterior
    ``p_0 exp(-L_k)``), ``"auto"`` uses its curvature too
    (:func:`curvature_whitening`): the round's KDEs, one
    kernel width per coordinate, then follow the posterior's correlations.

    >>> import jax.numpy as jnp
    >>> frame = round_frame(0.55, jnp.zeros((2, 1)), lambda x: -x, lambda x, block, key=None: x)
    >>> frame.to_z(jnp.ones((1, 1))).tolist()
    [[1.0]]
    """
    if kde_bandwidth != "auto":

        def identity(x):
            return x

        return Frame(identity, identity, prior_score, client_grad, identity)
    w = whitening(global_particles) if local_score is None else curvature_whitening(global_particles, local_score)
    return Frame(
        w.to_z,
        w.from_z,
        lambda z: w.score_to_z(prior_score(w.from_z(z))),
        lambda z, block, key=None: w.score_to_z(client_grad(w.from_z(z), block, key)),
        w.score_to_z,
    )
