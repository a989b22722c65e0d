"""The SVGD core: one step ``step(rng_key, state) -> (state, info)`` and loops of them.

The target enters as a score function ``score_fn(particles, rng_key) -> (N, d)``
(``grad log p`` at every particle; the key lets a score be a minibatch estimate). The
optimizer is an optax ``GradientTransformation`` fed ``-phi``: SVGD's direction as the
gradient of a quantity to decrease.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from numpyro_fed.infer.stein.curvature import curvature_whitening
from numpyro_fed.infer.stein.kernels import svgd_direction
from numpyro_fed.infer.stein.whitening import whitening

__all__ = ["SVGDInfo", "SVGDState", "build_kernel", "init", "staged_svgd", "svgd_run"]


class SVGDState(NamedTuple):
    """:ivar particles: ``(N, d)``; :ivar opt_state: the optimizer's state."""

    particles: jax.Array
    opt_state: Any


class SVGDInfo(NamedTuple):
    """:ivar direction_norm: root mean square of SVGD's direction ``phi`` over the particles
    (0 at a fixed point)."""

    direction_norm: jax.Array


def init(particles, optim) -> SVGDState:
    """The state of an SVGD run from ``particles`` (``(N, d)``) with a fresh optimizer state."""
    particles = jnp.asarray(particles)
    return SVGDState(particles, optim.init(particles))


def build_kernel(score_fn: Callable, optim, bandwidth=None) -> Callable:
    """One SVGD step as a pure function ``step(rng_key, state) -> (state, info)``.

    :param score_fn: ``((N, d), rng_key) -> (N, d)``, the target's ``grad log p`` at every
        particle (``rng_key`` is the step's key, passed through unchanged: it may be ``None``
        for a deterministic score).
    :param optim: an optax ``GradientTransformation``; it gets ``-phi``.
    :param bandwidth: RBF bandwidth ``h``, a function ``particles -> h`` or ``None`` (median
        heuristic at every step).

    >>> import jax, jax.numpy as jnp, optax
    >>> step = build_kernel(lambda x, key: -x, optax.sgd(0.5), bandwidth=2.0)
    >>> state, info = step(None, init(jnp.array([[-1.0], [1.0]]), optax.sgd(0.5)))
    >>> [f"{v:.4f}" for v in state.particles[:, 0].tolist()]
    ['-0.8515', '0.8515']
    """

    def step(rng_key, state: SVGDState):
        phi = svgd_direction(state.particles, score_fn(state.particles, rng_key), bandwidth)
        updates, opt_state = optim.update(-phi, state.opt_state, state.particles)
        info = SVGDInfo(jnp.sqrt(jnp.mean(jnp.sum(phi * phi, axis=-1))))
        return SVGDState(state.particles + updates, opt_state), info

    return step


def svgd_run(particles, score_fn: Callable, num_steps: int, optim, bandwidth=None, rng_key=None):
    """``num_steps`` SVGD steps from ``particles`` (a fresh optimizer state), by ``lax.scan``.

    Without ``rng_key``, ``score_fn(x)`` takes the particles only; with one,
    ``score_fn(x, key_t)`` gets a fresh key per step (``num_steps`` keys split from it), e.g.
    for minibatch gradients. Returns the final particles.

    >>> import jax, jax.numpy as jnp
    >>> from numpyro_fed.infer.stein import adagrad_momentum
    >>> x0 = jax.random.normal(jax.random.PRNGKey(0), (50, 1)) + 3.0
    >>> x = svgd_run(x0, lambda x: -x, 500, adagrad_momentum(0.1))  # towards N(0, 1)
    >>> abs(float(x.mean())) < 0.05, abs(float(x.std()) - 1.0) < 0.1
    (True, True)
    """
    state = init(particles, optim)
    if rng_key is None:
        step = build_kernel(lambda x, _: score_fn(x), optim, bandwidth)
        state, _ = lax.scan(lambda s, _: (step(None, s)[0], None), state, None, length=num_steps)
    else:
        step = build_kernel(score_fn, optim, bandwidth)
        state, _ = lax.scan(lambda s, k: (step(k, s)[0], None), state, jax.random.split(rng_key, num_steps))
    return state.particles


def staged_svgd(
    particles,
    score_fn: Callable,
    num_steps: int,
    optim,
    bandwidth=None,
    rng_key=None,
    stages: int = 1,
    curvature: bool = False,
):
    """:func:`svgd_run` in ``stages`` stages of equal length (and one for the remainder).

    Each stage runs in the coordinates that whiten the particles it starts from
    (:func:`~numpyro_fed.infer.stein.whitening.whitening`; the target is the same, only SVGD's
    kernel and the optimizer's steps follow the particles' current scale) with a fresh
    optimizer state. One stage: plain :func:`svgd_run`. ``score_fn`` and ``rng_key`` as
    there. ``curvature``: each stage runs instead in the coordinates of
    :func:`~numpyro_fed.infer.stein.curvature.curvature_whitening` (the target's curvature at
    the particles' mean made isotropic, the particles scaled to unit sd per coordinate), which
    follow the target's correlations whatever the number of particles.

    >>> import jax, jax.numpy as jnp
    >>> from numpyro_fed.infer.stein import adagrad_momentum
    >>> x0 = 1000.0 + jax.random.normal(jax.random.PRNGKey(0), (50, 1))
    >>> x = staged_svgd(x0, lambda x: -(x - 1000.0) / 4.0, 400, adagrad_momentum(0.1), stages=4)
    >>> abs(float(x.std()) / 2.0 - 1.0) < 0.2  # 100 steps per stage in its own units
    True
    """
    if stages <= 1 or num_steps < stages:
        return svgd_run(particles, score_fn, num_steps, optim, bandwidth, rng_key)

    def stage(x, size, stage_key):
        if curvature:
            w = curvature_whitening(x, score_fn if stage_key is None else (lambda y: score_fn(y, stage_key)))
        else:
            w = whitening(x)
        if stage_key is None:

            def stage_score(u):
                return w.score_to_z(score_fn(w.from_z(u)))
        else:

            def stage_score(u, k):
                return w.score_to_z(score_fn(w.from_z(u), k))

        return w.from_z(svgd_run(w.to_z(x), stage_score, size, optim, bandwidth, stage_key))

    length, remainder = divmod(num_steps, stages)
    keys = None if rng_key is None else jax.random.split(rng_key, stages + 1)
    if keys is None:
        x, _ = lax.scan(lambda x, _: (stage(x, length, None), None), particles, None, length=stages)
    else:
        x, _ = lax.scan(lambda x, k: (stage(x, length, k), None), particles, keys[:stages])
    if remainder:
        x = stage(x, remainder, None if keys is None else keys[stages])
    return x
