"""Partitioned variational inference (PVI, Ashman et al. 2022) and the private client
updates of DP-PVI (Heikkilä et al. 2023, Algorithms 1-3).

The approximation is a mean-field Gaussian over the flat unconstrained latent vector,

    q(theta) = p(theta) prod_m t_m(theta),

held as natural parameters ``eta = (precision * mean, -precision / 2)``: those of the prior
(a Gaussian on the unconstrained space) and of one factor ``t_m`` per client, so that
``eta_q = eta_prior + sum_m eta_m``. A client ``m`` maximises its local ELBO (3.5)

    E_q[log p(x_m | theta)] - KL(q || p_{\\m}),   p_{\\m} = q / t_m   (the cavity, 3.6)

with an optax optimiser over ``(loc, log_scale)`` for a fixed number of steps, starting from
the current ``q``, and sends the change ``Delta = eta_new - eta_q``. The server adds
``damping * Delta`` to the client's factor and to ``q``. The KL is written with the
unnormalised cavity (``E_q[log q] - eta_cav . E_q[T(theta)]``), so it stays defined when noise
has made a factor, hence the cavity, improper.

Client updates (``dp``):

* ``None``: the plain local optimisation (full batch, or minibatches of rate ``q``);
* ``"dpsgd"`` (Section 4.1): DP-SGD in the local optimisation: per-example gradients of the
  expected log-likelihood (``vmap`` over rows) clipped to ``C``, summed over a Poisson,
  without-replacement or full batch, plus ``N(0, (sigma C)^2)`` noise;
* ``"local_avg"`` (Algorithm 2): ``K`` shards per client, each optimising the local ELBO with
  its likelihood raised to ``K`` (4.1); the changes are clipped to ``C``, summed, noised and
  averaged (4.7);
* ``"virtual"`` (Algorithm 3): ``K`` virtual clients per client, each with its own factor and
  cavity (4.8-4.9); the changes are clipped, summed and noised (4.11); the noise is shared
  equally by the virtual factors so that they keep summing to the client's factor.

With a trusted aggregator (synchronous schedule), each client's noise standard deviation is
divided by ``sqrt(M)``: the sum the aggregator releases carries the full noise (Theorems 11,
14).

Schedules: ``"sequential"`` (clients in turn, the server updating after each) and
``"synchronous"`` (all clients from the same ``q``, vmapped). One *round* visits every
client once. Where a server update would leave a coordinate of ``q`` with a non-positive
precision, that coordinate keeps its previous value in ``q`` and in the factors (counted in
``RoundInfo.rejected``); this only post-processes released values.

This module is the functional core (pure functions of arrays); :class:`~numpyro_fed.DPPVI`
is the face.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

import optax

__all__ = [
    "ClientData",
    "GaussianNatural",
    "LocalConfig",
    "PVIState",
    "RoundInfo",
    "build_round",
    "clip_by_norm",
    "client_update",
    "gaussian_prior",
    "init",
    "local_elbo",
    "loc_scale",
    "natural",
    "optimise_local",
    "per_example_grads",
    "shard_layout",
]

DP_VARIANTS = (None, "dpsgd", "local_avg", "virtual")
SCHEDULES = ("sequential", "synchronous")
SAMPLING = ("poisson", "without_replacement", "full")


class GaussianNatural(NamedTuple):
    """Natural parameters of a diagonal Gaussian (or of a Gaussian factor).

    :ivar eta1: ``precision * mean``.
    :ivar eta2: ``-precision / 2``.
    """

    eta1: jax.Array
    eta2: jax.Array


class PVIState(NamedTuple):
    """The server's and clients' natural parameters.

    :ivar GaussianNatural q: the global approximation, ``(d,)`` each.
    :ivar GaussianNatural prior: the prior, ``(d,)``.
    :ivar GaussianNatural factors: the client factors ``t_m``, ``(M, d)``.
    :ivar GaussianNatural virtual: the virtual factors ``t_{m,k}``, ``(M, K, d)`` (zeros,
        ``K = 1``, unless ``dp="virtual"``); each client's sum to its factor.
    """

    q: GaussianNatural
    prior: GaussianNatural
    factors: GaussianNatural
    virtual: GaussianNatural


class RoundInfo(NamedTuple):
    """Diagnostics of one round.

    :ivar rejected: ``(M,)`` (sequential: per client update) or ``()`` (synchronous):
        coordinates of an update not applied because they would make ``q`` improper.
    :ivar clipped: ``(M,)`` fraction of clipped terms (per-example gradients or shard
        changes) in each client's update; zero without clipping.
    :ivar residual: ``(M,)`` each client's local-optimisation residual (see
        :func:`optimise_local`; the largest over its shards).
    """

    rejected: jax.Array
    clipped: jax.Array
    residual: jax.Array | None = None


class ClientData(NamedTuple):
    """Every client's rows, stacked and padded (a client's slice is its only data).

    :ivar rows: list of arrays ``(M, R, ...)``: the model arguments cut per client.
    :ivar valid: ``(M, R)`` mask of real (non-padding) rows.
    :ivar shard_index: ``(M, K, R_k)`` row positions of each client's shards.
    :ivar shard_valid: ``(M, K, R_k)`` mask of real rows in each shard.
    """

    rows: list
    valid: jax.Array
    shard_index: jax.Array
    shard_valid: jax.Array


# -- Gaussians ----------------------------------------------------------------------------------


def natural(loc, scale) -> GaussianNatural:
    """Natural parameters of ``N(loc, scale^2)``."""
    precision = 1.0 / jnp.square(scale)
    return GaussianNatural(precision * loc, -0.5 * precision)


def loc_scale(eta: GaussianNatural):
    """``(loc, scale)`` of a proper Gaussian given by its natural parameters."""
    precision = -2.0 * eta.eta2
    return eta.eta1 / precision, 1.0 / jnp.sqrt(precision)


def _tree_add(a, b, scale=1.0):
    return jax.tree_util.tree_map(lambda x, y: x + scale * y, a, b)


def _tree_sub(a, b):
    return jax.tree_util.tree_map(lambda x, y: x - y, a, b)


def _flat(eta: GaussianNatural):
    return jnp.concatenate([eta.eta1, eta.eta2], axis=-1)


def _unflat(vector) -> GaussianNatural:
    d = vector.shape[-1] // 2
    return GaussianNatural(vector[..., :d], vector[..., d:])



def gaussian_prior(prior_potential: Callable, d: int, *, dtype=None, rtol: float | None = None) -> GaussianNatural:
    """The natural parameters of ``exp(-prior_potential)`` if it is a diagonal Gaussian on
    the flat unconstrained space; a ValueError otherwise.

    The potential's gradient must be ``g0 + h * z`` with ``h > 0``: ``h`` is read off at
    ``z = 1`` and the identity is checked at two random points.

    >>> eta = gaussian_prior(lambda z: 0.5 * jnp.sum((z - 1.0) ** 2 / 4.0), 2)
    >>> [float(v) for v in loc_scale(eta)[0]], [float(v) for v in loc_scale(eta)[1]]
    ([1.0, 1.0], [2.0, 2.0])
    """
    dtype = dtype or jnp.zeros(()).dtype
    if rtol is None:
        rtol = 1e-6 if dtype == jnp.float64 else 1e-3
    grad = jax.jit(jax.grad(prior_potential))
    g0 = grad(jnp.zeros(d, dtype))
    h = grad(jnp.ones(d, dtype)) - g0
    probes = jax.random.normal(jax.random.PRNGKey(0), (2, d), dtype) * 2.0
    for z in probes:
        if not jnp.allclose(grad(z), g0 + h * z, rtol=rtol, atol=rtol * (1.0 + jnp.max(jnp.abs(g0)))):
            raise ValueError(
                "PVI needs a Gaussian prior with independent coordinates on the unconstrained "
                "latent space (e.g. Normal priors on real-valued sites); this model's prior "
                "potential is not quadratic and separable"
            )
    if not bool(jnp.all(h > 0)):
        raise ValueError("the model's prior is not a proper Gaussian (non-positive precision)")
    return GaussianNatural(-g0, -0.5 * h)


def init(prior: GaussianNatural, num_clients: int, num_virtual: int = 1) -> PVIState:
    """All factors at zero: ``q`` is the prior."""
    d = prior.eta1.shape[-1]
    zeros = jnp.zeros((num_clients, d), prior.eta1.dtype)
    zeros_virtual = jnp.zeros((num_clients, num_virtual, d), prior.eta1.dtype)
    return PVIState(
        q=prior,
        prior=prior,
        factors=GaussianNatural(zeros, zeros),
        virtual=GaussianNatural(zeros_virtual, zeros_virtual),
    )


def shard_layout(client_sizes, num_shards: int, seed=0):
    """Random shards of each client's valid rows (positions ``0 .. n_m - 1`` of its block).

    :return: ``(index, valid)``, each ``(M, K, R_k)``; padding repeats a row of the shard
        and is masked.
    """
    rng = np.random.default_rng(seed)
    client_sizes = [int(n) for n in client_sizes]
    if min(client_sizes) < num_shards:
        raise ValueError(
            f"num_shards={num_shards} exceeds the rows of the smallest client ({min(client_sizes)})"
        )
    rows_per_shard = -(-max(client_sizes) // num_shards)
    index = np.zeros((len(client_sizes), num_shards, rows_per_shard), np.int32)
    valid = np.zeros_like(index, dtype=bool)
    for m, n in enumerate(client_sizes):
        for k, part in enumerate(np.array_split(rng.permutation(n), num_shards)):
            index[m, k] = np.resize(part, rows_per_shard)
            valid[m, k, : part.size] = True
    return jnp.asarray(index), jnp.asarray(valid)


# -- local objective ----------------------------------------------------------------------------


class _Params(NamedTuple):
    loc: jax.Array
    log_scale: jax.Array


def _params_of(eta: GaussianNatural) -> _Params:
    loc, scale = loc_scale(eta)
    return _Params(loc, jnp.log(scale))


def _natural_of(params: _Params) -> GaussianNatural:
    return natural(params.loc, jnp.exp(params.log_scale))


def _prior_side(params: _Params, cavity: GaussianNatural):
    """``-KL(q || cavity)`` up to a constant: entropy plus the cavity's expected log-density."""
    scale = jnp.exp(params.log_scale)
    second_moment = jnp.square(params.loc) + jnp.square(scale)
    return jnp.sum(params.log_scale) + jnp.sum(cavity.eta1 * params.loc + cavity.eta2 * second_moment)


def _expected_row_log_lik(row_log_lik, params: _Params, eps, rows):
    """``(R,)`` Monte Carlo estimates of ``E_q[log p(x_i | theta)]`` with draws ``eps (S, d)``."""
    thetas = params.loc + jnp.exp(params.log_scale) * eps
    return jnp.mean(jax.vmap(row_log_lik, in_axes=(0, None))(thetas, rows), axis=0)


def local_elbo(row_log_lik, params: _Params, cavity: GaussianNatural, eps, rows, weights):
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


def per_example_grads(row_log_lik, params: _Params, eps, rows):
    """``(R, 2d)`` gradients of each row's expected log-likelihood wrt ``(loc, log_scale)``,
    vectorised over rows (each row seen alone, as DP-SGD needs)."""

    def one_row(p, row):
        value = _expected_row_log_lik(row_log_lik, p, eps, [r[None] for r in row])
        return value[0]

    grads = jax.vmap(jax.grad(one_row), in_axes=(None, 0))(params, rows)
    return jnp.concatenate([grads.loc, grads.log_scale], axis=-1)


class LocalConfig(NamedTuple):
    """Static settings of the local optimisation (see :func:`optimise_local`).

    The last three fields have defaults that keep the plain optimisation (``optim`` on
    ``(loc, log_scale)``, last iterate, DP-SGD clipping the gradients wrt
    ``(loc, log_scale)``):

    :ivar bool standardise: the optimiser sees the location in units of the starting
        ``q``'s scale, ``loc = loc_0 + scale_0 * u`` (and ``log_scale - log scale_0``): its
        steps are then relative to the current width of ``q``, whatever the parameters'
        units. A change of variables only: DP-SGD clips the same per-example gradients.
    :ivar float average_from: the result is the average of the iterates (in the optimiser's
        coordinates) from step ``floor(average_from * num_steps)`` on (Polyak-Ruppert
        averaging, which removes most of the Monte Carlo jitter of the last iterate);
        ``1.0``: the last iterate.
    :ivar bool clip_scaled: DP-SGD clips each row's gradient wrt ``(loc / scale,
        log_scale)`` at the current iterate (the location part multiplied by the current
        ``scale``): the clip norm is then in units of ``q``'s width, and a row's clipped
        gradient at the optimum has a size that depends on the number of rows, not on the
        parameters' units (see :class:`~numpyro_fed.DPPVI`'s automatic settings).
    """

    optim: Any
    num_steps: int
    num_mc_samples: int
    sampling: str  # "poisson" | "without_replacement" | "full"
    sampling_rate: float
    dpsgd: bool
    clip_norm: float
    standardise: bool = False
    average_from: float = 1.0
    clip_scaled: bool = False


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


def optimise_local(
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
    """Maximises the local ELBO from ``start`` for ``config.num_steps`` steps.

    With ``config.dpsgd`` the data term's gradient is DP-SGD's: per-example gradients clipped
    to ``clip_norm``, summed over the batch, plus ``N(0, (noise_multiplier * clip_norm)^2)``,
    then rescaled to the full data (``clip_norm``, possibly traced, overrides
    ``config.clip_norm``). The KL term is data-free and differentiated exactly.
    ``config.standardise`` and ``config.average_from`` only post-process the released
    noisy gradients and iterates.

    :return: ``(natural parameters of the new q, fraction of clipped gradients)``; with
        ``with_residual``, also the *residual*: the Newton-step estimate of the distance left
        to the optimum, from the local ELBO's gradient averaged over the averaging window
        (the last step without averaging): the largest over the coordinates of
        ``|mean gradient wrt loc| * scale`` and ``|mean gradient wrt log_scale| / 2``
        (near the optimum the curvatures are ``1 / scale^2`` and 2), in units of the new
        ``q``'s scale. A converged optimisation has a residual of the order of its Monte
        Carlo error (a few hundredths with the default settings); a large one means that
        it stopped short.
    """
    valid = jnp.asarray(valid)
    count = jnp.sum(valid)
    d = start.eta1.shape[-1]
    batch_cap = valid.shape[0] if batch_cap is None else batch_cap
    clip = config.clip_norm if clip_norm is None else clip_norm
    origin = _params_of(start)
    if config.standardise:
        unit = jnp.exp(origin.log_scale)
        coords = _Params(jnp.zeros_like(origin.loc), jnp.zeros_like(origin.log_scale))

        def to_params(x):
            return _Params(origin.loc + unit * x.loc, origin.log_scale + x.log_scale)

        def to_coords_grad(g):  # chain rule: d/du = scale_0 * d/dloc
            return _Params(unit * g.loc, g.log_scale)

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
            ascent = _tree_add(_Params(total[:d], total[d:]), jax.grad(_prior_side)(params, cavity))
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
        sums = (_tree_add(sums[0], x, in_window), _tree_add(sums[1], ascent, in_window))
        return (x, opt_state, clipped + frac, sums), None

    keys = jax.random.split(rng_key, config.num_steps)
    steps = jnp.arange(config.num_steps)
    grad_zeros = _Params(jnp.zeros_like(origin.loc), jnp.zeros_like(origin.log_scale))
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
        with ``with_residual``, also the local optimisation's residual (see
        :func:`optimise_local`; the largest over the shards).
    """
    if dp in (None, "dpsgd"):
        cavity = _tree_sub(q, factor)
        new_q, clipped, residual = optimise_local(
            rng_key, row_log_lik, q, cavity, rows, valid, config,
            noise_multiplier=noise_multiplier, batch_cap=batch_cap, with_residual=True,
            clip_norm=clip_norm,
        )
        delta = _tree_sub(new_q, q)
        out = (delta, jax.tree_util.tree_map(jnp.zeros_like, virtual), clipped)
        return out + (residual,) if with_residual else out

    num_shards = shard_index.shape[0]
    key_opt, key_noise = jax.random.split(rng_key)
    shard_rows = [r[shard_index] for r in rows]  # (K, R_k, ...)
    keys = jax.random.split(key_opt, num_shards)
    if dp == "local_avg":
        cavity = _tree_sub(q, factor)
        new_qs, _, residuals = jax.vmap(
            lambda k, r, v: optimise_local(k, row_log_lik, q, cavity, r, v, config,
                                           likelihood_weight=num_shards, with_residual=True),
        )(keys, shard_rows, shard_valid)
    elif dp == "virtual":
        cavities = jax.tree_util.tree_map(lambda a, b: a[None] - b, q, virtual)
        new_qs, _, residuals = jax.vmap(
            lambda k, c, r, v: optimise_local(k, row_log_lik, q, c, r, v, config, with_residual=True),
        )(keys, cavities, shard_rows, shard_valid)
    else:
        raise ValueError(f"unknown dp variant {dp!r}")
    changes = _flat(new_qs) - _flat(q)[None]  # (K, 2d)
    changes, was_clipped = clip_by_norm(changes, config.clip_norm)
    noise = jax.random.normal(key_noise, changes.shape[-1:], changes.dtype)
    noise = noise_multiplier * config.clip_norm * noise / noise_divisor
    total = jnp.sum(changes, axis=0) + noise
    if dp == "local_avg":
        delta = _unflat(total / num_shards)
        virtual_delta = jax.tree_util.tree_map(jnp.zeros_like, virtual)
    else:
        delta = _unflat(total)
        virtual_delta = _unflat(changes + noise[None] / num_shards)
    out = (delta, virtual_delta, jnp.mean(was_clipped.astype(changes.dtype)))
    return out + (jnp.max(residuals),) if with_residual else out


# -- rounds -------------------------------------------------------------------------------------


def build_round(
    row_log_lik: Callable,
    data: ClientData,
    config: LocalConfig,
    *,
    dp: str | None = None,
    schedule: str = "sequential",
    damping: float = 1.0,
    noise_multiplier=0.0,
    trusted_aggregator: bool = False,
    batch_cap: int | None = None,
) -> Callable:
    """A pure ``round(rng_key, state, data, clip_norm=None) -> (state, RoundInfo)``
    visiting every client once. ``data`` is the :class:`ClientData` (passed, not captured,
    so that ``jit`` does not embed it as constants); it must keep the shapes of the one
    given here. ``clip_norm`` (``(M,)``, DP-SGD only) overrides ``config.clip_norm`` per
    client for this round.

    :param row_log_lik: ``(theta_flat, rows) -> (R,)`` log-likelihood of each row.
    :param noise_multiplier: scalar or ``(M,)``: the noise standard deviation over the clip
        norm (per client).
    """
    num_clients = data.valid.shape[0]
    sigmas = jnp.broadcast_to(jnp.asarray(noise_multiplier, dtype=jnp.zeros(()).dtype), (num_clients,))
    noise_divisor = float(np.sqrt(num_clients)) if trusted_aggregator else 1.0

    def update_of(data, key, q, m, factor, virtual, clip_norm):
        rows = [r[m] for r in data.rows]
        return client_update(
            key, row_log_lik, q, factor, virtual, rows, data.valid[m],
            data.shard_index[m], data.shard_valid[m], config, dp=dp,
            noise_multiplier=sigmas[m], noise_divisor=noise_divisor, batch_cap=batch_cap,
            with_residual=True, clip_norm=None if clip_norm is None else clip_norm[m],
        )

    def apply(state: PVIState, new_q, new_factors, new_virtual):
        # Per coordinate: one coordinate's noise must not discard a whole update.
        ok = (new_q.eta2 < 0) & jnp.isfinite(new_q.eta1) & jnp.isfinite(new_q.eta2)
        pick = lambda new, old: jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), new, old)
        return (
            state._replace(q=pick(new_q, state.q), factors=pick(new_factors, state.factors),
                           virtual=pick(new_virtual, state.virtual)),
            jnp.sum(~ok),
        )

    if schedule == "synchronous":

        def round_fn(rng_key, state: PVIState, data: ClientData, clip_norm=None):
            keys = jax.random.split(rng_key, num_clients)
            deltas, virtual_deltas, clipped, residual = jax.vmap(
                lambda k, m, f, v: update_of(data, k, state.q, m, f, v, clip_norm)
            )(keys, jnp.arange(num_clients), state.factors, state.virtual)
            new_factors = _tree_add(state.factors, deltas, damping)
            new_virtual = _tree_add(state.virtual, virtual_deltas, damping)
            total = jax.tree_util.tree_map(lambda x: jnp.sum(x, axis=0), deltas)
            new_q = _tree_add(state.q, total, damping)
            state, rejected = apply(state, new_q, new_factors, new_virtual)
            return state, RoundInfo(rejected=rejected, clipped=clipped, residual=residual)

    elif schedule == "sequential":

        def round_fn(rng_key, state: PVIState, data: ClientData, clip_norm=None):
            keys = jax.random.split(rng_key, num_clients)

            def visit(state, inputs):
                key, m = inputs
                factor = jax.tree_util.tree_map(lambda x: x[m], state.factors)
                virtual = jax.tree_util.tree_map(lambda x: x[m], state.virtual)
                delta, virtual_delta, clipped, residual = update_of(data, key, state.q, m, factor, virtual, clip_norm)
                new_factors = jax.tree_util.tree_map(
                    lambda all_, d: all_.at[m].add(damping * d), state.factors, delta
                )
                new_virtual = jax.tree_util.tree_map(
                    lambda all_, d: all_.at[m].add(damping * d), state.virtual, virtual_delta
                )
                new_q = _tree_add(state.q, delta, damping)
                state, rejected = apply(state, new_q, new_factors, new_virtual)
                return state, (rejected, clipped, residual)

            state, (rejected, clipped, residual) = lax.scan(visit, state, (keys, jnp.arange(num_clients)))
            return state, RoundInfo(rejected=rejected, clipped=clipped, residual=residual)

    else:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    return round_fn
