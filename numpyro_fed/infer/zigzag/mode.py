"""The search for the posterior's mode: the control variates' reference point and the
center of a Laplace preconditioner."""

from __future__ import annotations

import contextlib
import math
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.scipy.optimize import minimize

from numpyro_fed.infer import modes
from numpyro_fed.infer.modes import compare_modes

__all__ = [
    "ModeSearch",
    "OtherMode",
    "describe_no_mode",
    "describe_other_mode",
    "find_mode",
    "levenberg_marquardt",
    "pick_mode",
]


class ModeSearch(NamedTuple):
    """What the search for the control variates' reference point found
    (:attr:`~numpyro_fed.FedZigZag.mode_search`).

    :ivar point: the last iterate ``(d,)`` (flat, unconstrained).
    :ivar is_mode: the Hessian there is positive definite and a Newton step from it moves no
        coordinate by more than ``newton_tolerance`` (0.05) of its Laplace posterior sd.
    :ivar newton_step: ``max_i |(H^{-1} g)_i| / sqrt((H^{-1})_ii)``, the largest Newton step
        in Laplace posterior sds (``inf`` when the Hessian is not positive definite).
    :ivar max_grad: ``max |grad U|`` at ``point``.
    :ivar attempts: BFGS runs made (each from where the previous one stopped).
    :ivar value: the potential at ``point``.
    :ivar laplace_log_mass: ``-value - log det(H) / 2`` there, the log of the posterior mass
        the Laplace approximation gives the mode, up to a constant shared by every mode
        (``-inf`` without a positive definite Hessian).
    :ivar laplace_sd: ``(d,)`` the Laplace posterior sds there (``inf`` without a positive
        definite Hessian).
    """

    point: jax.Array
    is_mode: bool
    newton_step: float
    max_grad: float
    attempts: int
    value: float = math.nan
    laplace_log_mass: float = -math.inf
    laplace_sd: Any = None


def find_mode(
    fn,
    x0,
    *,
    num_steps: int = 200,
    max_attempts: int = 5,
    max_newton_steps: int = 20,
    max_damped_steps: int = 50,
    newton_tolerance: float = 0.05,
    hessian=None,
    counted_evaluations=None,
) -> ModeSearch:
    """The MAP of the aggregated potential, or the report that there is none.

    The test of convergence is statistical, hence independent of the float type and of the
    units: ``x`` is a mode when the Hessian is positive definite and the Newton step to the
    stationary point is at most ``newton_tolerance`` Laplace posterior sds in every
    coordinate (a reference point that close gives the control variates all their benefit).
    Where BFGS stops short of that with a positive definite Hessian, up to
    ``max_newton_steps`` damped Newton steps follow (with a million rows in float32 the
    potential's value no longer resolves the last sds, its gradient does). Where BFGS does not
    reach a point with a positive definite Hessian at all (in float32, from a start far out in
    a badly scaled posterior, its line search fails), up to ``max_damped_steps``
    Levenberg-Marquardt steps (:func:`levenberg_marquardt`) take over; they run again where
    Newton's steps stop short of the mode (a log-linear model started where its rates
    overflow), and their end is kept where it is lower.
    BFGS's own gradient tolerance follows the dtype: ``sqrt(eps)`` times the gradient's scale
    at the start, a precision every float type reaches. A funnel (a hierarchical scale with
    client-local effects) has no mode: BFGS walks down its neck, where the Hessian is
    singular or the Newton step is many sds long, and ``is_mode`` is ``False``.

    >>> import jax.numpy as jnp
    >>> search = find_mode(lambda x: jnp.sum((x - 1.0) ** 2), jnp.zeros(2))
    >>> search.is_mode, jnp.round(search.point, 4).tolist()
    (True, [1.0, 1.0])

    With a federation ``fn`` is ``prior + sum(federation.map("value_and_grad", x))`` and
    ``hessian`` the one that asks the clients for theirs
    (:class:`~numpyro_fed.infer.zigzag.setup.ClientTerms`): every evaluation is one call,
    counted by the federation: the BFGS's evaluations (reported through
    ``counted_evaluations``), the values and gradients of the checks, one Hessian per Newton
    check.

    :param hessian: ``x -> (d, d)`` (default ``jax.hessian(fn)``).
    :param counted_evaluations: a context manager yielding ``count(evaluations)``, under which
        each BFGS run is traced and run; the search reports the run's evaluations of ``fn``
        through it (:meth:`ClientTerms.counted_evaluations
        <numpyro_fed.infer.zigzag.setup.ClientTerms.counted_evaluations>`: a loop of calls is
        counted once at its end, not by a callback at every call, which would make the
        compiled loop slower to build).
    """
    if counted_evaluations is None:
        counted_evaluations = partial(contextlib.nullcontext, lambda evaluations: None)
    dtype = x0.dtype
    eps = float(jnp.finfo(dtype).eps)
    hessian = jax.hessian(fn) if hessian is None else hessian

    @jax.jit
    def newton(x):  # one compiled call (through a federation: one value, one Hessian call)
        value, g = jax.value_and_grad(fn)(x)
        approx = modes.laplace(value, hessian(x))
        positive = jnp.all(jnp.isfinite(approx.chol))
        step = jax.scipy.linalg.cho_solve((approx.chol, True), g)
        # below the float resolution of x a step cannot be taken: it does not count
        floor = 8 * eps * (1.0 + jnp.abs(x))
        size = jnp.max(jnp.maximum(jnp.abs(step) - floor, 0.0) / approx.sd)
        return value, positive, g, step, size, approx.log_mass, approx.sd

    def newton_step(x):
        """``(size, gradient, direction, value, laplace)`` at ``x``: the Newton step's size in
        Laplace sds (``inf`` without a positive definite Hessian, then no direction), and the
        Laplace approximation's ``(log mass, sds)``."""
        value, positive, g, step, size, log_mass, sd = newton(x)
        if not bool(positive):
            return math.inf, g, None, float(value), (-math.inf, jnp.full_like(x, jnp.inf))
        size = float(size)
        return (size if math.isfinite(size) else math.inf), g, step, float(value), (float(log_mass), sd)

    x, attempts = x0, 0
    step, g, direction, fx, laplace = newton_step(x)
    scale = 1.0 + float(jnp.max(jnp.abs(g)))
    gtol = math.sqrt(eps) * scale if math.isfinite(scale) else 1.0

    @jax.jit
    def run(x):
        result = minimize(fn, x, method="BFGS", options={"maxiter": num_steps, "gtol": gtol})
        return result.x, result.nfev

    while step > newton_tolerance and attempts < max_attempts:
        attempts += 1
        with counted_evaluations() as count:
            candidate, evaluations = run(x)
            count(int(evaluations))
        if not bool(jnp.all(jnp.isfinite(candidate))):
            break
        found = newton_step(candidate)
        if not found[3] <= fx:
            break
        moved = float(jnp.max(jnp.abs(candidate - x)))
        x, (step, g, direction, fx, laplace) = candidate, found
        if moved == 0.0:
            break
    for damped_first in (direction is None, True):
        if step > newton_tolerance and damped_first:
            # BFGS did not reach a point with a positive definite Hessian (from a start far out
            # in a badly scaled posterior, raw covariates or a noise scale far too small, its
            # first steps overflow or its line search fails in float32), or neither it nor
            # Newton's steps below reached the mode (a log-linear model started where its rates
            # overflow: each Newton step lowers every linear predictor by about one, and the
            # Newton step in sds does not shrink on the way). Levenberg-Marquardt's damped
            # Newton steps, kept where they lower the potential, get there (each step one
            # value, gradient and Hessian call); a point they reach is kept where it is lower.
            candidate = levenberg_marquardt(fn, hessian, x, max_steps=max_damped_steps)
            found = newton_step(candidate)
            if found[3] <= fx:
                x, (step, g, direction, fx, laplace) = candidate, found
        # Newton's steps where BFGS stopped short: with many rows in float32 the potential's
        # value is too coarse for BFGS's line search near the mode, while the gradient and the
        # Hessian still point to it; a step is kept when the next Newton step is shorter (in
        # posterior sds), halved up to 4 times otherwise
        newton_steps = 0
        while step > newton_tolerance and direction is not None and newton_steps < max_newton_steps:
            newton_steps += 1
            for fraction in (1.0, 0.5, 0.25, 0.125, 0.0625):
                candidate = x - fraction * direction
                new_step, new_g, new_direction, new_value, new_laplace = newton_step(candidate)
                if new_step < step:
                    break
            else:
                break
            x, step, g, direction, fx, laplace = candidate, new_step, new_g, new_direction, new_value, new_laplace
    log_mass, sd = laplace
    return ModeSearch(x, step <= newton_tolerance, step, float(jnp.max(jnp.abs(g))), attempts, fx, log_mass, sd)


class OtherMode(NamedTuple):
    """A mode other than the one a chain starts at, found by the search from a second start
    (:attr:`~numpyro_fed.FedZigZag.other_mode`).

    :ivar point: the mode ``(d,)`` (flat, unconstrained).
    :ivar value: the potential there.
    :ivar share: the share of the two modes' posterior mass that the Laplace approximations
        give this one.
    :ivar distance: ``max_i |x_i - y_i| / sd_i`` between the two modes, in the Laplace
        posterior sds of either (the larger).
    """

    point: jax.Array
    value: float
    share: float
    distance: float


def pick_mode(first: ModeSearch, second: ModeSearch, *, separation: float = 3.0):
    """``(search, other)``: of two searches from different starts, the mode a chain should
    start at and the other mode (an :class:`OtherMode`), or ``None`` when there is one.

    Two modes closer than ``separation`` Laplace sds in every coordinate are one (the first is
    kept, so a posterior with one mode is treated as a single search treats it); of two
    separated modes the one with the larger Laplace mass is taken. A search that found no mode
    is passed over.

    >>> import jax.numpy as jnp
    >>> def search(x, value):  # two modes with unit Laplace sds, 6 nats apart
    ...     return ModeSearch(jnp.array([x]), True, 0.0, 0.0, 1, value, -value, jnp.ones(1))
    >>> mode, other = pick_mode(search(-3.0, 6.0), search(3.0, 0.0))
    >>> float(mode.point[0]), round(other.share, 4), other.distance
    (3.0, 0.0025, 6.0)
    >>> pick_mode(search(0.0, 0.0), search(0.01, 0.0))[1] is None
    True
    """
    if not second.is_mode:
        return first, None
    if not first.is_mode:
        return second, None
    found = compare_modes(
        (first.point, first.laplace_sd, first.laplace_log_mass),
        (second.point, second.laplace_sd, second.laplace_log_mass),
        separation=separation,
    )
    if found is None:
        return first, None
    best, other = (second, first) if found.take_second else (first, second)
    return best, OtherMode(other.point, other.value, found.share, found.distance)


def levenberg_marquardt(fn, hessian, x, *, max_steps: int = 50):
    """``x`` after up to ``max_steps`` Levenberg-Marquardt steps from ``x``: Newton's
    step on ``H + lam * diag(|H|)`` (Marquardt's scaling, so the damping does not depend on
    the units of each coordinate), taken when it lowers ``fn`` (then ``lam`` shrinks threefold)
    and refused otherwise (``lam`` grows tenfold, from ``1e-3``; it never falls below
    ``1e-9``). Stops early when a step taken moves no coordinate beyond its float resolution
    (converged) or ``lam`` passes ``1e10`` (no step lowers ``fn``).

    >>> import jax.numpy as jnp
    >>> fn = lambda x: jnp.exp(-2 * x[0]) * 1e6 + 2 * x[0] + (x[1] - 3 * x[0]) ** 2
    >>> x = levenberg_marquardt(fn, jax.hessian(fn), jnp.array([-2.0, 0.0]))
    >>> [round(float(v), 2) for v in x]  # the minimum: x0 = log(1e6) / 2, x1 = 3 x0
    [6.91, 20.72]
    """

    @jax.jit
    def curvature(x):
        value, g = jax.value_and_grad(fn)(x)
        h = hessian(x)
        return value, g, (h + h.T) / 2

    @jax.jit
    def damped(g, h, lam):
        # A Hessian that is not finite where the gradient is (autodiff of log(exp(eta)) far out
        # in a log-linear model: the rate's square underflows to 0 / 0) leaves the gradient's
        # signs: with the scaling |g| the damped step is sign(g) / lam, a step of 1 / lam in
        # every coordinate that the refusals shorten until it lowers fn
        finite = jnp.all(jnp.isfinite(h))
        scale = jnp.where(finite, jnp.abs(jnp.diag(h)), jnp.abs(g))
        h = jnp.where(finite, h, 0.0)
        chol = jnp.linalg.cholesky(h + lam * jnp.diag(jnp.maximum(scale, jnp.finfo(h.dtype).tiny)))
        return jnp.all(jnp.isfinite(chol)), jax.scipy.linalg.cho_solve((chol, True), g)

    value, g, h = curvature(x)
    fx, lam = float(value), 1e-3
    eps = float(jnp.finfo(x.dtype).eps)
    for _ in range(max_steps):
        if lam > 1e10 or not math.isfinite(fx):
            break
        positive, step = damped(g, h, lam)
        candidate = x - step
        if bool(positive) and bool(jnp.all(jnp.isfinite(candidate))):
            value, g_new, h_new = curvature(candidate)
            if float(value) < fx:
                x, fx, g, h, lam = candidate, float(value), g_new, h_new, max(lam / 3, 1e-9)
                if bool(jnp.all(jnp.abs(step) <= 8 * eps * (1.0 + jnp.abs(x)))):
                    break
                continue
        lam *= 10
    return x


def describe_no_mode(search: ModeSearch) -> str:
    """Why ``search`` found no mode, for messages."""
    reason = (
        "the Hessian is not positive definite"
        if not math.isfinite(search.newton_step)
        else f"a Newton step is still {search.newton_step:.3g} posterior sds long"
    )
    return f"after {search.attempts} BFGS runs max |grad U| = {search.max_grad:.3g} and {reason}"


def describe_other_mode(search: ModeSearch, other: OtherMode, names) -> str:
    """The warning that a chain starting at ``search``'s mode may miss ``other`` (``names``:
    the flat coordinates' names)."""
    far = int(jnp.argmax(jnp.abs(other.point - search.point) / search.laplace_sd))
    return (
        f"the posterior has at least two modes: searches from two starts found modes "
        f"{other.distance:.3g} Laplace sds apart ({names[far]} unconstrained "
        f"{float(search.point[far]):.4g} and {float(other.point[far]):.4g}, potentials "
        f"{search.value:.6g} and {other.value:.6g}); by their Laplace approximations the other "
        f"holds {other.share:.1%} of the mass. The chain starts at the larger, and a Zig-Zag "
        "process rarely crosses between separated modes, so its draws may miss the other: run "
        "chains from several init_strategy starts and compare them, or reparametrize (e.g. order "
        "a mixture's components)"
    )
