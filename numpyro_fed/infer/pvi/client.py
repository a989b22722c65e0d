"""PVI's client side: the local ELBO, its optimization (plain or DP-SGD), and the message a
client sends the server (:func:`client_update`).

A client ``m`` maximizes its local ELBO (3.5)

    E_q[log p(x_m | theta)] - KL(q || p_{\\m}),   p_{\\m} = q / t_m   (the cavity, 3.6)

with an optax optimizer over ``(loc, log_scale)`` for a fixed number of steps, starting from
the current ``q``, and sends the change ``Delta = eta_new - eta_q``. The KL is written with the
unnormalized cavity (``E_q[log q] - eta_cav . E_q[T(theta)]``), so it stays defined when noise
has made a factor, hence the cavity, improper. Private variants (``dp``): ``"dpsgd"``
(Section 4.1, clipped per-example gradients plus Gaussian noise in the local optimization),
``"local_avg"`` (Algorithm 2: ``K`` shards, their clipped changes summed, noised, averaged)
and ``"virtual"`` (Algorithm 3: ``K`` virtual clients with their own factors and cavities).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

import jax
import jax.numpy as jnp
import optax
from jax import lax

from numpyro_fed.infer.pvi.gaussian import (
    GaussianNatural,
    as_full,
    flatten,
    is_full,
    loc_cov_factor,
    loc_scale,
    natural,
    proper_cavity,
    tree_add,
    tree_sub,
    unflatten,
    whiten,
)

__all__ = [
    "LocalConfig",
    "antithetic_normal",
    "LocalParams",
    "clip_by_norm",
    "client_update",
    "local_elbo",
    "optimize_local",
    "newton_start",
    "optimize_local_full",
    "per_example_grads",
]


class LocalParams(NamedTuple):
    """The local optimization's parameters of ``q``: ``N(loc, exp(log_scale)^2)``.

    :ivar loc: ``(d,)``.
    :ivar log_scale: ``(d,)``.
    """

    loc: jax.Array
    log_scale: jax.Array


def _params_of(eta: GaussianNatural) -> LocalParams:
    loc, scale = loc_scale(eta)
    return LocalParams(loc, jnp.log(scale))


def _natural_of(params: LocalParams) -> GaussianNatural:
    return natural(params.loc, jnp.exp(params.log_scale))


def _prior_side(params: LocalParams, cavity: GaussianNatural):
    """``-KL(q || cavity)`` up to a constant: entropy plus the cavity's expected log-density."""
    scale = jnp.exp(params.log_scale)
    second_moment = jnp.square(params.loc) + jnp.square(scale)
    return jnp.sum(params.log_scale) + jnp.sum(cavity.eta1 * params.loc + cavity.eta2 * second_moment)


def _expected_row_log_lik(row_log_lik, params: LocalParams, eps, rows):
    """``(R,)`` Monte Carlo estimates of ``E_q[log p(x_i | theta)]`` with draws ``eps (S, d)``."""
    thetas = params.loc + jnp.exp(params.log_scale) * eps
    return jnp.mean(jax.vmap(row_log_lik, in_axes=(0, None))(thetas, rows), axis=0)


def local_elbo(row_log_lik, params: LocalParams, cavity: GaussianNatural, eps, rows, weights):
    """Local ELBO (3.5) up to a constant: ``sum_i w_i E_q[log p(x_i)] - KL(q || cavity)``.

    ``row_log_lik(theta_flat, rows) -> (R,)``; ``weights (R,)`` mask padding and rescale
    minibatches or tempered shards.
    """
    data = jnp.sum(weights * _expected_row_log_lik(row_log_lik, params, eps, rows))
    return data + _prior_side(params, cavity)


def clip_by_norm(vectors, clip_norm):
    """Scales each row of ``vectors (..., p)`` to norm at most ``clip_norm``.

    :return: ``(clipped, was_clipped)``.
    """
    norms = jnp.linalg.norm(vectors, axis=-1, keepdims=True)
    factor = jnp.minimum(1.0, clip_norm / jnp.maximum(norms, jnp.finfo(vectors.dtype).tiny))
    return vectors * factor, norms[..., 0] > clip_norm


def per_example_grads(row_log_lik, params: LocalParams, eps, rows):
    """``(R, 2d)`` gradients of each row's expected log-likelihood wrt ``(loc, log_scale)``,
    vectorised over rows (each row seen alone, as DP-SGD needs)."""

    def one_row(p, row):
        value = _expected_row_log_lik(row_log_lik, p, eps, [r[None] for r in row])
        return value[0]

    grads = jax.vmap(jax.grad(one_row), in_axes=(None, 0))(params, rows)
    return jnp.concatenate([grads.loc, grads.log_scale], axis=-1)


def antithetic_normal(rng_key, num_pairs: int, d: int, dtype):
    """``(2 num_pairs, d)`` standard normal draws in antithetic pairs ``(e, -e)``: the Monte
    Carlo gradients of a full-rank local ELBO wrt ``q``'s mean then carry no noise from the
    likelihood's quadratic part (``H L e`` cancels in each pair), the part that dominates once
    a client's term is near Gaussian (a noise scale fitted to 300 rows a client moved ``q``
    0.2 to 0.6 posterior sds between rounds with ten independent draws); the gradients wrt
    its covariance keep the ``num_pairs`` independent draws' error."""
    half = jax.random.normal(rng_key, (num_pairs, d), dtype)
    return jnp.concatenate([half, -half])


class LocalConfig(NamedTuple):
    """Static settings of the local optimization (see :func:`optimize_local`).

    The last three fields have defaults that keep the plain optimization (``optim`` on
    ``(loc, log_scale)``, last iterate, DP-SGD clipping the gradients wrt
    ``(loc, log_scale)``):

    :ivar bool standardize: the optimizer sees the location in units of the starting
        ``q``'s scale, ``loc = loc_0 + scale_0 * u`` (and ``log_scale - log scale_0``): its
        steps are then relative to the current width of ``q``, whatever the parameters'
        units. A change of variables only: DP-SGD clips the same per-example gradients.
    :ivar float average_from: the result is the average of the iterates (in the optimizer's
        coordinates) from step ``floor(average_from * num_steps)`` on (Polyak-Ruppert
        averaging, which removes most of the Monte Carlo jitter of the last iterate);
        ``1.0``: the last iterate.
    :ivar bool clip_scaled: DP-SGD clips each row's gradient wrt ``(loc / scale,
        log_scale)`` at the current iterate (the location part multiplied by the current
        ``scale``): the clip norm is then in units of ``q``'s width, and a row's clipped
        gradient at the optimum has a size that depends on the number of rows, not on the
        parameters' units (see :class:`~numpyro_fed.DPPVI`'s automatic settings).
    :ivar int newton_start: the optimization starts from the Gaussian reached by this many
        safeguarded variational Newton steps from ``q`` against the tilted distribution
        ``cavity x likelihood`` (:func:`newton_start`, each with ``num_mc_samples`` draws;
        a mean-field ``q``: its mean and the diagonal of its precision, :func:`mean_field_of`,
        up to ``NEWTON_MAX_DIM`` coordinates; never with DP-SGD, whose released gradients are
        the only use of the rows); ``0``: from ``q``. From a wide ``q`` the steps of a
        first-order optimizer cannot reach a posterior hundreds of times narrower (a raw
        covariate at 40: every mean-field fit stopped short and was refused).
    """

    optim: Any
    num_steps: int
    num_mc_samples: int
    sampling: str  # "poisson" | "without_replacement" | "full"
    sampling_rate: float
    dpsgd: bool
    clip_norm: float
    standardize: bool = False
    average_from: float = 1.0
    clip_scaled: bool = False
    newton_start: int = 0


def _draw_batch(rng_key, valid, count, config: LocalConfig, batch_cap: int):
    """Row positions and weights of one step's batch (``batch_cap`` rows at most).

    :return: ``(positions (B,), in_batch (B,), scale)``: ``scale`` turns the batch sum into an
        estimate of the full sum.
    """
    num_rows = valid.shape[0]
    if config.sampling == "full":
        return jnp.arange(num_rows), valid, 1.0
    if config.sampling == "poisson":
        take = valid & jax.random.bernoulli(rng_key, config.sampling_rate, (num_rows,))
        if batch_cap >= num_rows:
            return jnp.arange(num_rows), take, 1.0 / config.sampling_rate
        # The sampled rows first, at most batch_cap of them: per-example work scales with
        # the batch, not the client. The caller picks batch_cap so that a larger draw is
        # negligible (and accounted for in delta).
        positions = jnp.argsort(~take, stable=True)[:batch_cap]
        return positions, take[positions], 1.0 / config.sampling_rate
    # without replacement: a uniformly random subset of the valid rows
    batch_size = jnp.maximum(1, jnp.round(config.sampling_rate * count)).astype(jnp.int32)
    keys = jnp.where(valid, jax.random.uniform(rng_key, (num_rows,)), 2.0)
    positions = jnp.argsort(keys)[:batch_cap]
    in_batch = jnp.arange(batch_cap) < batch_size
    return positions, in_batch, count / batch_size


def _averaging_window(config: LocalConfig) -> int:
    """The first step of the averaging window ``[first, num_steps)``."""
    first = min(int(np.floor(config.average_from * config.num_steps)), config.num_steps - 1)
    return max(first, 0)


def optimize_local(
    rng_key,
    row_log_lik,
    start: GaussianNatural,
    cavity: GaussianNatural,
    rows,
    valid,
    config: LocalConfig,
    *,
    likelihood_weight=1.0,
    noise_multiplier=0.0,
    batch_cap: int | None = None,
    with_residual: bool = False,
    clip_norm=None,
):
    """Maximizes the local ELBO from ``start`` for ``config.num_steps`` steps.

    With ``config.dpsgd`` the data term's gradient is DP-SGD's: per-example gradients clipped
    to ``clip_norm``, summed over the batch, plus ``N(0, (noise_multiplier * clip_norm)^2)``,
    then rescaled to the full data (``clip_norm``, possibly traced, overrides
    ``config.clip_norm``). The KL term is data-free and differentiated exactly.
    ``config.standardize`` and ``config.average_from`` only post-process the released
    noisy gradients and iterates.

    :return: ``(natural parameters of the new q, fraction of clipped gradients)``; with
        ``with_residual``, also the *residual*: the Newton-step estimate of the distance left
        to the optimum, from the local ELBO's gradient averaged over the averaging window
        (the last step without averaging): the largest over the coordinates of
        ``|mean gradient wrt loc| * scale`` and ``|mean gradient wrt log_scale| / 2``
        (near the optimum the curvatures are ``1 / scale^2`` and 2), in units of the new
        ``q``'s scale. A converged optimization has a residual of the order of its Monte
        Carlo error (a few hundredths with the default settings); a large one means that
        it stopped short.
    """
    if is_full(start):
        new_q, residual = optimize_local_full(
            rng_key,
            row_log_lik,
            start,
            cavity,
            rows,
            valid,
            config,
            likelihood_weight=likelihood_weight,
            batch_cap=batch_cap,
        )
        clipped = jnp.zeros((), start.eta1.dtype)
        return (new_q, clipped, residual) if with_residual else (new_q, clipped)
    valid = jnp.asarray(valid)
    count = jnp.sum(valid)
    d = start.eta1.shape[-1]
    batch_cap = valid.shape[0] if batch_cap is None else batch_cap
    clip = config.clip_norm if clip_norm is None else clip_norm
    if config.newton_start and not config.dpsgd and d <= NEWTON_MAX_DIM:
        rng_key, start = _newton_started(rng_key, row_log_lik, start, cavity, rows, valid, config, likelihood_weight)
    origin = _params_of(start)
    if config.standardize:
        unit = jnp.exp(origin.log_scale)
        coords = LocalParams(jnp.zeros_like(origin.loc), jnp.zeros_like(origin.log_scale))

        def to_params(x):
            return LocalParams(origin.loc + unit * x.loc, origin.log_scale + x.log_scale)

        def to_coords_grad(g):  # chain rule: d/du = scale_0 * d/dloc
            return LocalParams(unit * g.loc, g.log_scale)

    else:
        coords = origin
        to_params = to_coords_grad = lambda x: x
    opt_state = config.optim.init(coords)
    first = _averaging_window(config)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, coords)

    def step(carry, inputs):
        x, opt_state, clipped, sums = carry
        key, t = inputs
        params = to_params(x)
        key_batch, key_eps, key_noise = jax.random.split(key, 3)
        positions, in_batch, scale = _draw_batch(key_batch, valid, count, config, batch_cap)
        batch_rows = [r[positions] for r in rows]
        eps = jax.random.normal(key_eps, (config.num_mc_samples, d), start.eta1.dtype)
        if config.dpsgd:
            grads = per_example_grads(row_log_lik, params, eps, batch_rows)
            if config.clip_scaled:
                width = jnp.concatenate([jnp.exp(params.log_scale), jnp.ones(d, grads.dtype)])
                grads = grads * width
            grads, was_clipped = clip_by_norm(grads, clip)
            weight = in_batch.astype(grads.dtype)
            total = weight @ grads
            noise = jax.random.normal(key_noise, total.shape, total.dtype)
            total = (total + noise_multiplier * clip * noise) * scale * likelihood_weight
            if config.clip_scaled:
                total = total / width
            ascent = tree_add(LocalParams(total[:d], total[d:]), jax.grad(_prior_side)(params, cavity))
            frac = (jnp.sum(was_clipped * weight) / jnp.maximum(jnp.sum(weight), 1.0)).astype(origin.loc.dtype)
        else:
            weights = in_batch * scale * likelihood_weight
            ascent = jax.grad(local_elbo, argnums=1)(row_log_lik, params, cavity, eps, batch_rows, weights)
            frac = jnp.zeros((), origin.loc.dtype)
        descent = jax.tree_util.tree_map(jnp.negative, to_coords_grad(ascent))
        updates, opt_state = config.optim.update(descent, opt_state, x)
        x = optax.apply_updates(x, updates)
        # running sums, over the averaging window, of the iterates and of the gradients
        in_window = (t >= first).astype(origin.loc.dtype)
        sums = (tree_add(sums[0], x, in_window), tree_add(sums[1], ascent, in_window))
        return (x, opt_state, clipped + frac, sums), None

    keys = jax.random.split(rng_key, config.num_steps)
    steps = jnp.arange(config.num_steps)
    grad_zeros = LocalParams(jnp.zeros_like(origin.loc), jnp.zeros_like(origin.log_scale))
    init = (coords, opt_state, jnp.zeros((), origin.loc.dtype), (zeros, grad_zeros))
    (x, _, clipped, (sum_x, sum_g)), _ = lax.scan(step, init, (keys, steps))
    count_window = config.num_steps - first
    if count_window > 1:
        x = jax.tree_util.tree_map(lambda a: a / count_window, sum_x)
    params = to_params(x)
    new_q = _natural_of(params)
    if not with_residual:
        return new_q, clipped / config.num_steps
    mean_grad = jax.tree_util.tree_map(lambda a: a / count_window, sum_g)
    residual = jnp.maximum(
        jnp.max(jnp.abs(mean_grad.loc) * jnp.exp(params.log_scale)), jnp.max(jnp.abs(mean_grad.log_scale)) / 2
    )
    return new_q, clipped / config.num_steps, residual


def _lower(raw):
    """The lower-triangular factor whose strict lower triangle is ``raw``'s and whose diagonal
    is ``exp`` of ``raw``'s."""
    return jnp.tril(raw, -1) + jnp.diag(jnp.exp(jnp.diagonal(raw)))


#: step sizes the safeguarded variational Newton iteration tries (it keeps the best)
NEWTON_STEP_SIZES = (1.0, 0.5, 0.25, 0.1)
#: a mean-field local fit starts from variational Newton steps up to this many coordinates
#: (each step averages ``d x d`` Hessians over the draws)
NEWTON_MAX_DIM = 200


def mean_field_of(eta: GaussianNatural) -> GaussianNatural:
    """The mean-field Gaussian with ``eta``'s mean and the diagonal of its precision: the
    mean-field VI optimum where ``eta`` is the full-rank one of a Gaussian target (the
    start of a mean-field local fit from :func:`newton_start`).

    >>> full = GaussianNatural(jnp.array([1.0, 0.0]), -0.5 * jnp.array([[2.0, 1.0], [1.0, 2.0]]))
    >>> mf = mean_field_of(full)
    >>> [float(v) for v in -2 * mf.eta2], [round(float(v), 4) for v in loc_scale(mf)[0]]
    ([2.0, 2.0], [0.6667, -0.3333])
    """
    loc, _ = loc_cov_factor(eta)
    diagonal = -2.0 * jnp.diagonal(eta.eta2)
    return GaussianNatural(diagonal * loc, -0.5 * diagonal)


def _newton_started(rng_key, row_log_lik, start, cavity, rows, valid, config: LocalConfig, likelihood_weight):
    """``(rng_key, start)``: a local fit's start after ``config.newton_start`` steps of
    :func:`newton_start` from ``start`` (made full-rank for them; a mean-field ``start`` gets
    back :func:`mean_field_of` their end)."""
    rng_key, key_start = jax.random.split(rng_key)
    full = newton_start(
        key_start,
        row_log_lik,
        as_full(start),
        as_full(cavity),
        rows,
        jnp.asarray(valid).astype(start.eta1.dtype),
        config.newton_start,
        config.num_mc_samples,
        likelihood_weight=likelihood_weight,
    )
    return rng_key, full if is_full(start) else mean_field_of(full)


def newton_start(
    rng_key, row_log_lik, start, cavity, rows, weights, num_steps: int, num_draws: int, *, likelihood_weight=1.0
):
    """A full-rank Gaussian near the optimum of the local ELBO against ``cavity``, reached by
    ``num_steps`` safeguarded *variational* Newton steps from ``start``: each step takes the
    gradient and Hessian of ``log cavity + sum_i w_i log p(x_i | theta)`` averaged over
    ``num_draws`` draws of the current Gaussian (the fixed point of Gaussian VI: precision
    ``-E_q[Hessian]``, mean where ``E_q[gradient]`` vanishes), moves the precision and the mean
    that way by the best of ``NEWTON_STEP_SIZES`` by the local ELBO at common draws (or not at
    all), the Hessian's eigenvalues by their absolute values (the tilted distribution need not
    be log-concave). A starting point for the local optimization only.

    Expectations over ``q``, not the value at one point (a Laplace approximation): with fewer
    rows than coefficients and a free noise scale the tilted distribution is a funnel whose
    density grows without bound towards a zero noise scale, and its mode is no start for a
    Gaussian fit; the average over ``q``'s draws is affine-invariant, as Newton's method, so
    that covariates on raw scales need no step size of their own."""
    d, dtype = start.eta1.shape[-1], start.eta1.dtype
    eye = jnp.eye(d, dtype=dtype)

    def log_lik(theta):
        return jnp.sum(weights * row_log_lik(theta, rows)) * likelihood_weight

    def elbo(loc, precision, eps):
        chol = jnp.linalg.cholesky(precision)
        thetas = loc + jax.scipy.linalg.solve_triangular(chol, eps.T, lower=True, trans=1).T
        cov = jax.scipy.linalg.cho_solve((chol, True), eye)
        value = jnp.mean(jax.vmap(log_lik)(thetas)) - jnp.sum(jnp.log(jnp.diagonal(chol)))
        value = value + cavity.eta1 @ loc + jnp.sum(cavity.eta2 * (cov + jnp.outer(loc, loc)))
        return jnp.where(jnp.isfinite(value), value, -jnp.inf), thetas

    def absolute(hessian):
        values, vectors = jnp.linalg.eigh(-0.5 * (hessian + hessian.T))
        floor = jnp.finfo(dtype).eps * jnp.max(jnp.abs(values)) * d
        return (vectors * jnp.maximum(jnp.abs(values), floor)) @ vectors.T

    def newton(carry, key):
        loc, precision = carry
        eps = antithetic_normal(key, num_draws, d, dtype)
        current, thetas = elbo(loc, precision, eps)
        grad = jnp.mean(jax.vmap(jax.grad(log_lik))(thetas), axis=0) + cavity.eta1 + 2.0 * cavity.eta2 @ loc
        hessian = jnp.mean(jax.vmap(jax.hessian(log_lik))(thetas), axis=0) + 2.0 * cavity.eta2
        # the same step at q's mean alone (Laplace's): where q is much wider than the tilted
        # distribution its draws saturate the likelihood (a logistic regression's logits of
        # hundreds on raw covariates), the average Hessian vanishes and no averaged step
        # improves the ELBO; the mean's curvature still points to the tilted distribution
        point_grad = jax.grad(log_lik)(loc) + cavity.eta1 + 2.0 * cavity.eta2 @ loc
        point_hessian = jax.hessian(log_lik)(loc) + 2.0 * cavity.eta2
        targets, grads = jnp.stack([absolute(hessian), absolute(point_hessian)]), jnp.stack([grad, point_grad])

        def candidate(size, target, grad):
            new_precision = (1.0 - size) * precision + size * target
            new_precision = 0.5 * (new_precision + new_precision.T)
            return loc + size * jnp.linalg.solve(new_precision, grad), new_precision

        sizes = jnp.tile(jnp.asarray(NEWTON_STEP_SIZES, dtype), 2)
        which = jnp.repeat(jnp.arange(2), len(NEWTON_STEP_SIZES))
        locs, precisions = jax.vmap(candidate)(sizes, targets[which], grads[which])
        values = jax.vmap(lambda m, p: elbo(m, p, eps)[0])(locs, precisions)
        values = jnp.where(jnp.isfinite(values), values, -jnp.inf)
        best = jnp.argmax(values)
        better = values[best] > current
        return (jnp.where(better, locs[best], loc), jnp.where(better, precisions[best], precision)), None

    precision0 = -2.0 * start.eta2
    loc0 = jnp.linalg.solve(precision0, start.eta1)
    (loc, precision), _ = lax.scan(newton, (loc0, precision0), jax.random.split(rng_key, num_steps))
    candidate = GaussianNatural(precision @ loc, -0.5 * precision)
    ok = jnp.all(jnp.isfinite(jnp.linalg.cholesky(precision))) & jnp.all(jnp.isfinite(loc))
    return jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), candidate, start)


def optimize_local_full(
    rng_key, row_log_lik, start, cavity, rows, valid, config: LocalConfig, *, likelihood_weight=1.0, batch_cap=None
):
    """:func:`optimize_local` for a full-rank ``q`` (``start`` and ``cavity`` with ``(d, d)``
    ``eta2``; no DP-SGD), in the coordinates ``u`` in which ``start`` is a standard normal
    (``theta = loc_s + L_s u``, ``L_s`` the Cholesky factor of its covariance: whatever the
    parameters' units, the fit's matrices are near the identity, in float32 too) against the
    cavity made proper there (:func:`proper_cavity`). The parameters are ``q``'s mean and the
    Cholesky factor ``L`` of its covariance (log of its diagonal); with ``config.newton_start``
    the fit starts from :func:`newton_start`'s Gaussian; ``config.standardize``: in units of
    that start, ``loc = loc_0 + L_0 x`` and ``L = L_0 L_x``; ``config.average_from`` as there.

    :return: ``(natural parameters of the new q, residual)``: the residual as
        :func:`optimize_local`'s, from the mean gradient wrt ``x`` (in units of ``q``'s
        width) and wrt the log-diagonal of ``L_x``.
    """
    loc_s, chol_s = loc_cov_factor(start)
    d, dtype = start.eta1.shape[-1], start.eta1.dtype
    eye = jnp.eye(d, dtype=dtype)
    cavity_u = proper_cavity(whiten(cavity, loc_s, chol_s))

    def row_log_lik_u(u, rows):
        return row_log_lik(loc_s + chol_s @ u, rows)

    start_u = GaussianNatural(jnp.zeros(d, dtype), -0.5 * eye)
    loc_u, chol_u, residual = _fit_full(
        rng_key, row_log_lik_u, start_u, cavity_u, rows, valid, config, likelihood_weight, batch_cap
    )
    loc, chol = loc_s + chol_s @ loc_u, chol_s @ chol_u
    inv_chol = jax.scipy.linalg.solve_triangular(chol, eye, lower=True)
    precision = inv_chol.T @ inv_chol
    precision = 0.5 * (precision + precision.T)
    return GaussianNatural(precision @ loc, -0.5 * precision), residual


def _fit_full(rng_key, row_log_lik, start, cavity, rows, valid, config: LocalConfig, likelihood_weight, batch_cap):
    """:func:`optimize_local_full`'s fit in its coordinates: ``(loc, L, residual)``."""
    if config.dpsgd:
        raise ValueError("a full-rank q has no DP-SGD local optimization (use a diagonal q)")
    valid = jnp.asarray(valid)
    count = jnp.sum(valid)
    d = start.eta1.shape[-1]
    batch_cap = valid.shape[0] if batch_cap is None else batch_cap
    if config.newton_start:
        rng_key, start = _newton_started(rng_key, row_log_lik, start, cavity, rows, valid, config, likelihood_weight)
    loc0, chol0 = loc_cov_factor(start)
    logdiag0 = jnp.log(jnp.diagonal(chol0))
    if config.standardize:
        coords = LocalParams(jnp.zeros_like(loc0), jnp.zeros_like(chol0))

        def moments(x):
            return (
                loc0 + chol0 @ x.loc,
                chol0 @ _lower(x.log_scale),
                jnp.sum(logdiag0) + jnp.sum(jnp.diagonal(x.log_scale)),
            )

    else:
        coords = LocalParams(loc0, jnp.tril(chol0, -1) + jnp.diag(logdiag0))

        def moments(x):
            return x.loc, _lower(x.log_scale), jnp.sum(jnp.diagonal(x.log_scale))

    def elbo(x, eps, batch_rows, weights):
        loc, chol, log_det_half = moments(x)
        thetas = loc + eps @ chol.T
        data = jnp.sum(weights * jnp.mean(jax.vmap(row_log_lik, in_axes=(0, None))(thetas, batch_rows), axis=0))
        second_moment = chol @ chol.T + jnp.outer(loc, loc)
        return data + log_det_half + cavity.eta1 @ loc + jnp.sum(cavity.eta2 * second_moment)

    opt_state = config.optim.init(coords)
    first = _averaging_window(config)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, coords)

    def step(carry, inputs):
        x, opt_state, sums = carry
        key, t = inputs
        key_batch, key_eps = jax.random.split(key)
        positions, in_batch, scale = _draw_batch(key_batch, valid, count, config, batch_cap)
        batch_rows = [r[positions] for r in rows]
        eps = antithetic_normal(key_eps, config.num_mc_samples, d, loc0.dtype)
        ascent = jax.grad(elbo)(x, eps, batch_rows, in_batch * scale * likelihood_weight)
        updates, opt_state = config.optim.update(jax.tree_util.tree_map(jnp.negative, ascent), opt_state, x)
        x = optax.apply_updates(x, updates)
        in_window = (t >= first).astype(loc0.dtype)
        sums = (tree_add(sums[0], x, in_window), tree_add(sums[1], ascent, in_window))
        return (x, opt_state, sums), None

    keys = jax.random.split(rng_key, config.num_steps)
    (x, _, (sum_x, sum_g)), _ = lax.scan(
        step, (coords, opt_state, (zeros, zeros)), (keys, jnp.arange(config.num_steps))
    )
    count_window = config.num_steps - first
    if count_window > 1:
        x = jax.tree_util.tree_map(lambda a: a / count_window, sum_x)
    loc, chol, _ = moments(x)
    mean_grad = jax.tree_util.tree_map(lambda a: a / count_window, sum_g)
    loc_grad = mean_grad.loc if config.standardize else mean_grad.loc * jnp.sqrt(jnp.sum(jnp.square(chol), axis=-1))
    residual = jnp.maximum(jnp.max(jnp.abs(loc_grad)), jnp.max(jnp.abs(jnp.diagonal(mean_grad.log_scale))) / 2)
    # an optimization that ended non-finite returns its start (said by an infinite residual)
    ok = jnp.all(jnp.isfinite(loc)) & jnp.all(jnp.isfinite(chol)) & jnp.all(jnp.diagonal(chol) > 0)
    return jnp.where(ok, loc, loc0), jnp.where(ok, chol, chol0), jnp.where(ok, residual, jnp.inf)


# -- client updates -----------------------------------------------------------------------------


def client_update(
    rng_key,
    row_log_lik,
    q: GaussianNatural,
    factor: GaussianNatural,
    virtual: GaussianNatural,
    rows,
    valid,
    shard_index,
    shard_valid,
    config: LocalConfig,
    *,
    dp: str | None,
    noise_multiplier=0.0,
    noise_divisor=1.0,
    batch_cap: int | None = None,
    with_residual: bool = False,
    clip_norm=None,
):
    """One client's message for the server.

    :return: ``(delta, virtual_delta, clipped)``: the change of the client's factor
        (natural parameters, ``(d,)``), the changes of its virtual factors (``(K, d)``; zero
        unless ``dp="virtual"``; they sum to ``delta``) and the fraction of clipped terms;
        with ``with_residual``, also the local optimization's residual (see
        :func:`optimize_local`; the largest over the shards).
    """
    if dp in (None, "dpsgd"):
        cavity = tree_sub(q, factor)
        new_q, clipped, residual = optimize_local(
            rng_key,
            row_log_lik,
            q,
            cavity,
            rows,
            valid,
            config,
            noise_multiplier=noise_multiplier,
            batch_cap=batch_cap,
            with_residual=True,
            clip_norm=clip_norm,
        )
        delta = tree_sub(new_q, q)
        out = (delta, jax.tree_util.tree_map(jnp.zeros_like, virtual), clipped)
        return out + (residual,) if with_residual else out

    num_shards = shard_index.shape[0]
    key_opt, key_noise = jax.random.split(rng_key)
    shard_rows = [r[shard_index] for r in rows]  # (K, R_k, ...)
    keys = jax.random.split(key_opt, num_shards)
    if dp == "local_avg":
        cavity = tree_sub(q, factor)
        new_qs, _, residuals = jax.vmap(
            lambda k, r, v: optimize_local(
                k, row_log_lik, q, cavity, r, v, config, likelihood_weight=num_shards, with_residual=True
            ),
        )(keys, shard_rows, shard_valid)
    elif dp == "virtual":
        cavities = jax.tree_util.tree_map(lambda a, b: a[None] - b, q, virtual)
        new_qs, _, residuals = jax.vmap(
            lambda k, c, r, v: optimize_local(k, row_log_lik, q, c, r, v, config, with_residual=True),
        )(keys, cavities, shard_rows, shard_valid)
    else:
        raise ValueError(f"unknown dp variant {dp!r}")
    changes = flatten(new_qs) - flatten(q)[None]  # (K, 2d)
    changes, was_clipped = clip_by_norm(changes, config.clip_norm)
    noise = jax.random.normal(key_noise, changes.shape[-1:], changes.dtype)
    noise = noise_multiplier * config.clip_norm * noise / noise_divisor
    total = jnp.sum(changes, axis=0) + noise
    if dp == "local_avg":
        delta = unflatten(total / num_shards)
        virtual_delta = jax.tree_util.tree_map(jnp.zeros_like, virtual)
    else:
        delta = unflatten(total)
        virtual_delta = unflatten(changes + noise[None] / num_shards)
    out = (delta, virtual_delta, jnp.mean(was_clipped.astype(changes.dtype)))
    return out + (jnp.max(residuals),) if with_residual else out
