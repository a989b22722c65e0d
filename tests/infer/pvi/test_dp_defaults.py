"""DP-SGD given only a budget: the settings rule from public sizes (rate, clip norm, damping),
the fitted prediction of its error against measured errors, and the refusal."""

import warnings

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import numpyro
import numpyro.distributions as dist

import numpyro_fed as nf
from numpyro_fed.infer.pvi import DPPVI, dp_defaults

COEF5 = jnp.array([1.0, -1.0, 0.5, 0.25, -0.5])


def _logistic(clients, rows_per_client, dtype=jnp.float32):
    """5-coefficient logistic regression, N(0, 1) prior, standard normal covariates."""
    n = clients * rows_per_client
    X = jax.random.normal(jax.random.PRNGKey(0), (n, 5), dtype)
    y = (jax.random.uniform(jax.random.PRNGKey(1), (n,)) < jax.nn.sigmoid(X @ COEF5.astype(dtype))).astype(dtype)

    def model(X, y=None):
        w = numpyro.sample("w", dist.Normal(0, 1).expand([5]).to_event(1))
        with nf.federated_plate("data", X.shape[0], clients=clients):
            numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    return model, X, y


def test_the_rule_reads_public_sizes_only():
    """The rule's settings for 5 x 4,000 rows at (1, 1e-5): 1,024 expected rows per step
    (rate 0.256; the former 64 rows left the subsampling noise alone at 1.1 posterior sds),
    damping 0.5 (damping 1 let a noisy factor blow a scale up in the next round), clip norm
    8 sqrt(d / rows seen). A user's damping is kept."""
    method = DPPVI(lambda: None, dp="dpsgd", target_epsilon=1.0, delta=1e-5)
    assert method.damping == dp_defaults.AUTO_DAMPING == 0.5
    sizes = np.full(5, 4000)
    sigmas = method.noise_multipliers(2, sizes)
    assert method.sampling == "poisson" and method.sampling_rate == pytest.approx(1024 / 4000)
    # sigma / rate = c sqrt(T): the noise per expected row does not depend on the rate
    c = method.single_noise_multiplier()
    assert sigmas[0] / method.sampling_rate == pytest.approx(c * np.sqrt(200), rel=0.05)
    np.testing.assert_allclose(method.auto_clip_norms(2, sizes, 5)[1], 8 * np.sqrt(5 / 20000))
    assert DPPVI(lambda: None, dp="dpsgd", target_epsilon=1.0, damping=1.0).damping == 1.0
    assert DPPVI(lambda: None, dp="dpsgd", target_epsilon=1.0, sampling_rate=0.1).damping == 0.5  # the rule's clip
    assert DPPVI(lambda: None, dp="dpsgd", target_epsilon=1.0, clip_norm=2.0).damping == 1.0  # the user's clip
    assert DPPVI(lambda: None).damping == 1.0


def test_predicted_error_is_the_fitted_formula():
    """predicted_dp_error: the fitted privacy and subsampling terms of
    :mod:`~numpyro_fed.infer.pvi.dp_defaults` (root sum of squares)."""
    method = DPPVI(lambda: None, dp="dpsgd", target_epsilon=1.0, delta=1e-5)
    sizes = np.full(5, 4000)
    sigmas = method.noise_multipliers(2, sizes)
    rate, window = method.sampling_rate, 50.0
    noise = dp_defaults.FIT_NOISE * 8 * sigmas[0] / rate * 5**1.5 * np.sqrt(5 / 20000) / np.sqrt(window)
    subsampling = dp_defaults.FIT_SUBSAMPLING * np.sqrt((1 - rate) / (rate * window))
    assert method.predicted_dp_error(sigmas, 2, sizes, 5) == pytest.approx(np.hypot(noise, subsampling))
    # the floor: every step of the run averaged
    floor = method.dp_error_floor(sizes, 5)
    c = method.single_noise_multiplier()
    assert floor == pytest.approx(dp_defaults.FIT_NOISE * 8 * c * 5**1.5 * np.sqrt(5 / 20000))
    assert floor < method.predicted_dp_error(sigmas, 2, sizes, 5)


def test_a_run_the_noise_would_dominate_is_refused_naming_the_floor():
    """4 clients x 250 rows at (1, 1e-5): refused before any round, with the floor no
    setting removes and what to change."""
    model, X, y = _logistic(4, 250)
    method = DPPVI(model, dp="dpsgd", target_epsilon=1.0, delta=1e-5, progress_bar=False)
    with pytest.raises(ValueError, match=r"mostly noise\. No choice of rate, steps or rounds brings it below about"):
        method.run(jax.random.PRNGKey(0), 2, X, y)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_budget_only_settings_track_their_prediction_without_blowing_up(seed):
    """5 clients x 4,000 rows, 5 coefficients, (1, 1e-5): the rule's settings, run anyway
    (the prediction is above 1 posterior sd, so given only the budget the run refuses).
    Against the non-private mean-field answer (full batches, the optimum DP-SGD aims at):
    the largest error of the means lies within a factor 2 of predicted_dp_error (measured
    over the grid of the guide: 0.6-1.3 times it), and no scale of q blows up. Before
    (64-row batches, damping 1), seed 1 ended with one sd 368 times too wide and a held-out
    log predictive density 0.08 nats/row below NUTS's."""
    model, X, y = _logistic(5, 4000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        exact = DPPVI(model, covariance="diagonal", progress_bar=False).run(jax.random.PRNGKey(9), 3, X, y)
        with pytest.raises(ValueError, match="mostly noise"):
            DPPVI(model, dp="dpsgd", target_epsilon=1.0, progress_bar=False).run(jax.random.PRNGKey(seed), 2, X, y)
        rate = dp_defaults.auto_sampling_rate(4000, None, None)
        forced = DPPVI(model, dp="dpsgd", target_epsilon=1.0, sampling_rate=rate, progress_bar=False)
        result = forced.run(jax.random.PRNGKey(seed), 2, X, y)
    mean, sd = np.asarray(exact.metrics["loc"][-1]), np.asarray(exact.metrics["scale"][-1])
    loc, scale = np.asarray(result.metrics["loc"][-1]), np.asarray(result.metrics["scale"][-1])
    predicted = float(result.metrics["predicted_dp_error"][-1])
    error = np.max(np.abs(loc - mean) / sd)
    assert predicted / 2 < error < 2 * predicted
    assert np.all((scale / sd > 0.1) & (scale / sd < 5.0))
