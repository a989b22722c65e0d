"""Consensus Monte Carlo's core: what a client runs on its sub-posterior, the diagnostics it
reports, and the server's combinations. Pure JAX functions; the face
(:class:`~numpyro_fed.infer.consensus.ConsensusMC`) runs them through the federation.

Client ``m``'s sub-posterior on the unconstrained space is

    p_m(theta, z_m) ∝ p_0(theta)^{w_m} exp(-U_m(theta, z_m)),   sum_m w_m = 1,

``p_0`` the prior term of :func:`~numpyro_fed.split_potential` (the global sites and their
log-Jacobians), ``U_m`` client ``m``'s term (its rows and the prior of its own latents
``z_m``) and ``w_m = 1/M`` by default (Scott et al. 2016). The product of the ``theta``
marginals of the sub-posteriors is the posterior of ``theta`` exactly when the client-local
latents are absent; with them, ``theta``'s product is the posterior too, because each
``z_m`` enters only client ``m``'s factor (integrate it out there). Both combinations are
exact when every sub-posterior is Gaussian:

* :func:`consensus_combine` (Scott et al. 2016): draw ``s`` of the posterior is the
  precision-weighted average of draw ``s`` of every client;
* :func:`parametric_combine` (Neiswanger, Wang & Xing 2014): the product of the clients'
  Gaussian approximations, which needs no draws on the wire.

The weights are the clients' precisions. Sample covariances of a few hundred effective draws
make noisy weights, and a weight's error multiplies the distance between the clients' means
(about one sub-posterior sd, ``sqrt(M)`` posterior sds): 0.14 posterior sd per coordinate at
400 effective draws per client, d = 7, three times the error of the clients' means. So each
client computes (:func:`gaussian_refinement`) its precision as the expected Hessian of its
potential over its draws, with no Monte Carlo noise to speak of where the sub-posterior is
nearly Gaussian, and its mean with the first-order control variate ``theta - (H^{-1} grad
U)_theta`` (exact for a Gaussian, unbiased for any sub-posterior since ``E[grad U] = 0``); it
falls back on its sample moments where the Hessian does not describe its draws.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from numpyro_fed.infer.stein.curvature import CONVERGED_DECREMENT, newton_modes, positive_curvature

__all__ = [
    "SubposteriorSummary",
    "consensus_combine",
    "effective_sample_size",
    "gaussian_refinement",
    "laplace_frame",
    "make_client_run",
    "parametric_combine",
    "split_rhat",
    "standardized_moments",
]


class SubposteriorSummary(NamedTuple):
    """What a client sends (its reply), every field about the global coordinates ``theta``.

    :ivar draws: ``(num_chains * num_samples, d_g)``, its draws (``combine="consensus"``),
        shifted to the refined mean (:func:`gaussian_refinement`); ``None`` when only moments
        cross (``"parametric"``).
    :ivar mean: ``(d_g,)`` the refined mean (``"parametric"``; else ``None``: the server takes
        it from the draws).
    :ivar cov: ``(d_g, d_g)`` sample covariance (``"parametric"``; else ``None``).
    :ivar precision: ``(d_g, d_g)`` the combination's weight (:func:`gaussian_refinement`).
    :ivar refined: ``(d_g,)`` 1 where the mean is the control-variate estimate, 0 where it is
        the sample mean; all 0 when the precision is the inverse sample covariance.
    :ivar hessian_weight: 1 if the precision is the expected Hessian's, 0 if the inverse sample
        covariance (the Hessian did not describe the draws).
    :ivar divergences: the number of divergent transitions after warmup (0 for a kernel
        that has none).
    :ivar rhat: ``(d_g,)`` split R-hat (:func:`split_rhat`).
    :ivar ess: ``(d_g,)`` effective sample size (:func:`effective_sample_size`).
    :ivar skewness: ``(d_g,)`` of the draws (0 for a Gaussian).
    :ivar kurtosis: ``(d_g,)`` excess kurtosis of the draws (0 for a Gaussian).
    :ivar local_rhat: the largest split R-hat over the client's own latent coordinates
        (1 without them): they stay with the client, their convergence does not.
    """

    draws: jax.Array | None
    mean: jax.Array | None
    cov: jax.Array | None
    precision: jax.Array
    refined: jax.Array
    hessian_weight: jax.Array
    divergences: jax.Array
    rhat: jax.Array
    ess: jax.Array
    skewness: jax.Array
    kurtosis: jax.Array
    local_rhat: jax.Array


# -- diagnostics (JAX versions of numpyro.diagnostics', traceable on the client) -----------
def split_rhat(x) -> jax.Array:
    """Split R-hat of draws ``x`` shaped ``(chains, draws, d)``, as
    :func:`numpyro.diagnostics.split_gelman_rubin` (each chain cut in two halves)."""
    n = x.shape[1] // 2
    halves = jnp.concatenate([x[:, :n], x[:, -n:]], axis=0)
    mean_var = jnp.mean(jnp.var(halves, axis=1, ddof=1), axis=0)
    var_plus = mean_var * (n - 1) / n + jnp.var(jnp.mean(halves, axis=1), axis=0, ddof=1)
    return jnp.sqrt(var_plus / mean_var)


def _autocovariance(x):
    """Autocovariance along axis 1 of ``(chains, draws, d)`` (FFT, as NumPyro's)."""
    n = x.shape[1]
    size = 1 << (2 * n - 1).bit_length()  # a power of two >= 2n: no circular wrap-around
    centred = x - jnp.mean(x, axis=1, keepdims=True)
    freq = jnp.fft.rfft(centred, n=size, axis=1)
    acov = jnp.fft.irfft(freq * jnp.conjugate(freq), n=size, axis=1)[:, :n]
    return acov / n


def effective_sample_size(x) -> jax.Array:
    """Effective sample size of draws ``x`` shaped ``(chains, draws, d)``: Geyer's initial
    monotone sequence estimator on the chains' pooled autocorrelation, as
    :func:`numpyro.diagnostics.effective_sample_size`."""
    chains, n = x.shape[:2]
    gamma = _autocovariance(x)
    mean_var = jnp.mean(jnp.var(x, axis=1, ddof=1), axis=0)
    var_plus = mean_var * (n - 1) / n
    if chains > 1:
        var_plus = var_plus + jnp.var(jnp.mean(x, axis=1), axis=0, ddof=1)
    else:
        mean_var = var_plus  # one chain: the biased variance, as NumPyro's
    rho = 1.0 - (mean_var - jnp.mean(gamma, axis=0)) / var_plus
    rho = rho.at[0].set(1.0)
    pairs = rho[: (n // 2) * 2 : 2] + rho[1 : (n // 2) * 2 : 2]  # Geyer's Gamma_k
    # initial positive then monotone sequence: once a pair sum is clipped to 0 it stays 0
    pairs = jnp.concatenate([pairs[:1], lax.cummin(jnp.clip(pairs[1:], 0.0, None), axis=0)])
    tau = -1.0 + 2.0 * jnp.sum(pairs, axis=0)
    return chains * n / tau


def standardized_moments(draws):
    """``(skewness, excess kurtosis)`` per coordinate of ``(S, d)`` draws."""
    centred = draws - jnp.mean(draws, axis=0)
    var = jnp.mean(centred**2, axis=0)
    var = jnp.where(var > 0, var, 1.0)
    return jnp.mean(centred**3, axis=0) / var**1.5, jnp.mean(centred**4, axis=0) / var**2 - 3.0


#: draws at which a client evaluates its potential's Hessian (evenly spaced over its draws)
HESSIAN_DRAWS = 64
#: the expected Hessian is the weight only if it describes the draws: the eigenvalues of the
#: sample covariance times it (whitened) within these bounds (1 for a Gaussian)
PRECISION_AGREEMENT = (1.0 / 3.0, 3.0)


def _mcse_sq(x) -> jax.Array:
    """Squared Monte Carlo standard error of the mean of ``(chains, draws, d)`` (0 where the
    draws are constant)."""
    var = jnp.var(x.reshape((-1, x.shape[-1])), axis=0)
    ess = effective_sample_size(x)
    return jnp.where(var > 1e-30 * (1 + jnp.mean(x.reshape((-1, x.shape[-1])), axis=0) ** 2), var / ess, 0.0)


def gaussian_refinement(chains, grads, hessians, d_g: int):
    """A client's weight and mean for the combination, from its draws ``chains`` (``(chains,
    draws, D)`` in its joint coordinates ``(theta, z_m)``, ``theta`` the first ``d_g``), its
    potential's gradients there (same shape) and its Hessians at some of them (``(K, D, D)``).

    The precision of ``theta`` is ``((E[H]^{-1})_{theta theta})^{-1}``, the expected Hessian's
    marginal (exact for a Gaussian); the mean, per coordinate, the mean of the control variate
    ``theta - (E[H]^{-1} grad U)_theta`` (exact for a Gaussian; unbiased for any sub-posterior,
    ``E[grad U] = 0``) where its Monte Carlo error is below the sample mean's, else the sample
    mean. Where the expected Hessian is not positive definite or does not describe the draws
    (the whitened eigenvalues of the sample covariance times it outside
    :data:`PRECISION_AGREEMENT`), the inverse sample covariance and the sample mean.

    :return: ``(mean (d_g,), sample_cov (d_g, d_g), precision (d_g, d_g), refined (d_g,),
        trusted ())``, ``trusted`` whether the precision is the expected Hessian's.
    """
    pooled = chains.reshape((-1, chains.shape[-1]))
    theta = chains[..., :d_g]
    sample_mean = jnp.mean(pooled[:, :d_g], axis=0)
    sample_cov = jnp.atleast_2d(jnp.cov(pooled[:, :d_g], rowvar=False))
    expected = jnp.mean(hessians, axis=0)
    expected = 0.5 * (expected + expected.T)
    joint_cov = _inverse_spd(expected)  # NaN where it is not positive definite
    precision = _inverse_spd(joint_cov[:d_g, :d_g])
    chol = jnp.linalg.cholesky(sample_cov)
    whitened = chol.T @ precision @ chol
    eigenvalues = jnp.linalg.eigvalsh(0.5 * (whitened + whitened.T))
    low, high = PRECISION_AGREEMENT
    trusted = jnp.all(jnp.isfinite(precision)) & jnp.all((eigenvalues > low) & (eigenvalues < high))
    controlled = theta - jnp.einsum("ij,csj->csi", jnp.nan_to_num(joint_cov[:d_g]), grads)
    better = _mcse_sq(controlled) <= _mcse_sq(theta)
    refined = trusted & better
    mean = jnp.where(refined, jnp.mean(controlled.reshape((-1, d_g)), axis=0), sample_mean)
    precision = jnp.where(trusted, precision, _inverse_spd(sample_cov))
    return mean, sample_cov, precision, refined.astype(sample_cov.dtype), trusted.astype(sample_cov.dtype)


def _summaries(chains, grads, hessians, d_g, divergences, send_draws: bool) -> SubposteriorSummary:
    theta_chains, z_chains = chains[..., :d_g], chains[..., d_g:]
    pooled = theta_chains.reshape((-1, d_g))
    skew, kurt = standardized_moments(pooled)
    if z_chains.shape[-1]:
        local_rhat = jnp.max(jnp.nan_to_num(split_rhat(z_chains), nan=1.0))
    else:
        local_rhat = jnp.ones((), theta_chains.dtype)
    mean, cov, precision, refined, trusted = gaussian_refinement(chains, grads, hessians, d_g)
    draws = pooled - jnp.mean(pooled, axis=0) + mean  # the draws' shape, the refined mean
    return SubposteriorSummary(
        draws if send_draws else None,
        None if send_draws else mean,
        None if send_draws else cov,
        precision,
        refined,
        trusted,
        jnp.sum(divergences).astype(jnp.int32),
        split_rhat(theta_chains),
        effective_sample_size(theta_chains),
        skew,
        kurt,
        local_rhat,
    )


# -- the client's run -------------------------------------------------------------------------
def laplace_frame(potential: Callable, start):
    """The affine frame ``y = center + matrix @ u`` in which a potential's Laplace
    approximation is a standard normal: ``center`` its mode, found by damped Newton steps from
    ``start`` (:func:`~numpyro_fed.infer.stein.curvature.newton_modes`), ``matrix = V
    diag(lambda)^(-1/2)`` from the eigenvectors and eigenvalues of its Hessian there, made
    positive by :func:`~numpyro_fed.infer.stein.curvature.positive_curvature`. Where the
    search does not converge (a funnel has no mode) the frame is the identity at ``start``:
    the kernel then runs in the model's coordinates.

    An MCMC kernel that adapts a diagonal mass matrix cannot follow correlated coordinates, and
    NumPyro's shrinks every adapted variance towards 1e-3: on a coefficient of a raw covariate
    whose posterior variance is 1e-8 its trees run hundreds of steps deep. In the frame every
    direction of the approximation has unit scale.

    >>> import jax.numpy as jnp
    >>> potential = lambda y: 0.5 * jnp.sum(((y - 3.0) / jnp.array([1e-4, 10.0])) ** 2)
    >>> center, matrix = laplace_frame(potential, jnp.zeros(2))
    >>> sds = jnp.sqrt(jnp.diag(matrix @ matrix.T))  # the approximation's covariance
    >>> [round(float(c), 6) for c in center], [round(float(v), 6) for v in sds]
    ([3.0, 3.0], [0.0001, 10.0])
    """
    score = jax.vmap(lambda y: -jax.grad(potential)(y))
    ends, decrements = newton_modes(score, start[None])
    center, converged = ends[0], decrements[0] <= CONVERGED_DECREMENT
    vectors, values = positive_curvature(score, center, 1e-10, jax.hessian(potential))
    matrix = vectors / jnp.sqrt(values)
    ok = converged & jnp.all(jnp.isfinite(matrix)) & jnp.all(jnp.isfinite(center))
    eye = jnp.eye(start.shape[-1], dtype=start.dtype)
    return jnp.where(ok, center, start), jnp.where(ok, matrix, eye)


def make_client_run(
    prior_potential: Callable,
    client_potential: Callable,
    *,
    num_latent: int,
    global_index,
    kernel_factory: Callable,
    num_warmup: int,
    num_samples: int,
    num_chains: int,
    send_draws: bool,
    precondition: bool = True,
) -> Callable:
    """Client ``m``'s function: ``(block, rng_key, start, prior_weight, positions, valid) ->
    (local_draws, SubposteriorSummary)``, the run of ``kernel_factory(potential_fn)`` (a NumPyro
    kernel on a potential function, NUTS by default) on its sub-posterior in the joint
    coordinates ``y = (theta, z_m)``: ``num_chains`` chains from ``start`` (``(d_g + d_l,)``),
    ``num_warmup`` adaptation steps then ``num_samples`` draws, the chains ``vmap``-ped.

    ``positions`` (``(d_l,)``, padded with ``num_latent``) are where the client's own latent
    coordinates sit in the flat latent vector and ``valid`` which of them are its (a padding
    coordinate is a standard normal of its own: a proper factor NUTS samples and the reply
    drops). ``local_draws``, ``(num_chains * num_samples, d_l)``, stay with the client.
    With ``precondition`` the kernel runs in the :func:`laplace_frame` of the sub-posterior
    (its chains start at the mode) and its draws are mapped back.
    ``prior_potential`` and ``client_potential`` are those of
    :meth:`FederatedPotential.flat() <numpyro_fed.FederatedPotential.flat>`."""
    global_index = jnp.asarray(global_index)
    d_g = int(global_index.shape[0])

    def run(block, rng_key, start, prior_weight, positions, valid):
        def potential(y):
            theta, z = y[:d_g], y[d_g:]
            x = jnp.zeros(num_latent, y.dtype).at[global_index].set(theta).at[positions].set(z, mode="drop")
            padding = 0.5 * jnp.sum(jnp.where(valid, 0.0, z) ** 2)
            return prior_weight * prior_potential(x) + client_potential(x, block) + padding

        if precondition:
            center, matrix = laplace_frame(potential, start)
        else:
            center, matrix = start, jnp.eye(start.shape[-1], dtype=start.dtype)

        def chain(key):
            kernel = kernel_factory(lambda u: potential(center + matrix @ u))
            k_init, k_run = jax.random.split(key)
            state = kernel.init(k_init, num_warmup, jnp.zeros_like(start), (), {})
            field = getattr(kernel, "sample_field", "z")

            def step(state, _):
                state = kernel.sample(state, (), {})
                return state, (getattr(state, field), jnp.asarray(getattr(state, "diverging", False)))

            # one scan over warmup and sampling (the kernel adapts while its step count is below
            # num_warmup): NUTS's step is compiled once, not twice
            _, (ys, diverging) = lax.scan(step, state, None, length=num_warmup + num_samples)
            return ys[num_warmup:], diverging[num_warmup:]

        us, diverging = jax.vmap(chain)(jax.random.split(rng_key, num_chains))
        ys = center + us @ matrix.T
        # one draw at a time (lax.map): a batch of draws times the client's rows can be large
        pooled = ys.reshape((-1, ys.shape[-1]))
        grads = lax.map(jax.grad(potential), pooled, batch_size=16).reshape(ys.shape)
        every = max(1, pooled.shape[0] // HESSIAN_DRAWS)
        hessians = lax.map(jax.hessian(potential), pooled[::every][:HESSIAN_DRAWS])
        summary = _summaries(ys, grads, hessians, d_g, diverging, send_draws)
        return ys[..., d_g:].reshape((num_chains * num_samples, -1)), summary

    return run


# -- the server's combinations ---------------------------------------------------------------
def _inverse_spd(cov):
    eye = jnp.eye(cov.shape[-1], dtype=cov.dtype)
    return jax.scipy.linalg.cho_solve((jnp.linalg.cholesky(cov), True), eye)


def consensus_combine(draws, precisions=None):
    """Scott et al. (2016)'s consensus draws of ``(M, S, d)`` clients' draws: ``theta_s =
    (sum_m W_m)^{-1} sum_m W_m theta_{m,s}``, ``W_m`` client ``m``'s precision (``(M, d, d)``;
    by default the inverse of its sample covariance). Returns ``(S, d)``."""
    if precisions is None:
        covs = jax.vmap(lambda x: jnp.atleast_2d(jnp.cov(x, rowvar=False)))(draws)
        precisions = jax.vmap(_inverse_spd)(covs)
    weights = precisions
    total = jnp.sum(weights, axis=0)
    weighted = jnp.einsum("mij,msj->si", weights, draws)
    return jax.scipy.linalg.cho_solve((jnp.linalg.cholesky(total), True), weighted.T).T


def parametric_combine(means, covs=None, precisions=None):
    """Neiswanger et al. (2014)'s parametric combination: the product of the Gaussians
    ``N(means[m], covs[m])`` (or of precisions ``precisions[m]``), returned as ``(mean (d,),
    cov (d, d))``."""
    if precisions is None:
        precisions = jax.vmap(_inverse_spd)(covs)
    cov = _inverse_spd(jnp.sum(precisions, axis=0))
    return cov @ jnp.einsum("mij,mj->i", precisions, means), cov
