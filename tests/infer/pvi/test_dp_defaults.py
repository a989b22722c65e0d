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
    """4 clients x 250 rows at (1, 1e-5) (predicted 17 posterior sds; measured 3.8-5.8 on the
    guide's grid): refused before any round, with the floor no setting removes and what to
    change."""
    model, X, y = _logistic(4, 250)
    method = DPPVI(model, dp="dpsgd", target_epsilon=1.0, delta=1e-5, progress_bar=False)
    with pytest.raises(ValueError, match=r"mostly noise\. No choice of rate, steps or rounds brings it below about"):
        method.run(jax.random.PRNGKey(0), 2, X, y)


def test_refusal_only_where_the_fitted_prediction_is_far_above_a_posterior_sd():
    """The automatic settings refuse only above ``REFUSE_DP_ERROR`` where the prediction was
    checked (``d <= FIT_MAX_DIM``; on the grid every such run measured more than a posterior sd
    off: 4 x 250 rows predicted 17, measured 3.8-5.8); between 1 and it the run goes ahead and
    warns, and so does it beyond the grid's dimensions, where the prediction is extrapolated
    (UCI Adult, 109 coefficients: predicted 435, measured 17 at most). The user's settings
    warn above 1, however far. Before, every prediction above 1 was refused."""
    budget = dict(dp="dpsgd", target_epsilon=1.0, delta=1e-5)

    def plan(method, sizes, d):
        sigmas = method.noise_multipliers(2, sizes)
        return method.planned_dp_error(sigmas, 2, sizes, d, privacy=True)

    auto = DPPVI(lambda: None, **budget)
    with pytest.raises(ValueError, match="mostly noise"):
        plan(auto, np.full(4, 250), 5)  # predicted 17
    with pytest.warns(RuntimeWarning, match=r"4\.2 posterior .* going ahead, but q's means will be noisy"):
        assert 1.0 < plan(auto, np.full(5, 4000), 5) < dp_defaults.REFUSE_DP_ERROR
    d = dp_defaults.FIT_MAX_DIM + 1
    with pytest.warns(RuntimeWarning, match="going ahead, as the prediction is extrapolated") as caught:
        assert plan(auto, np.full(4, 250), d) > dp_defaults.REFUSE_DP_ERROR
    assert "No choice of rate" not in str(caught[0].message)  # nor is the floor stated, as far extrapolated
    with pytest.raises(ValueError, match="mostly noise"):
        plan(DPPVI(lambda: None, **budget), np.full(4, 250), d - 1)
    user = DPPVI(lambda: None, sampling="poisson", sampling_rate=0.1, clip_norm=1.0, **budget)
    with pytest.warns(RuntimeWarning, match="the answer would be mostly noise"):
        assert plan(user, np.full(4, 250), 5) > dp_defaults.MAX_DP_ERROR  # a lower bound (2.2)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_budget_only_settings_predict_as_nuts_does_and_track_their_prediction(seed):
    """5 clients x 4,000 rows, 5 coefficients, (1, 1e-5), only the budget given: the run goes
    ahead with a warning (predicted 4.2 posterior sds; it was refused before) and its held-out
    log predictive density (5,000 new rows) is within 0.002 nats/row of NUTS's on the pooled
    rows (measured 0.0005-0.0010). Against the non-private mean-field answer (full batches,
    the optimum DP-SGD aims at) the largest error of the means lies within a factor 2 of
    predicted_dp_error (measured over the grid of the guide: 0.2-2.5 times it), and no scale
    of q blows up. Before (64-row batches, damping 1), seed 1 ended with one sd 368 times too
    wide and a held-out log predictive density 0.08 nats/row below NUTS's."""
    from numpyro.infer import MCMC, NUTS

    model, X, y = _logistic(5, 4000)
    X_test = jax.random.normal(jax.random.PRNGKey(2), (5000, 5))
    y_test = (jax.random.uniform(jax.random.PRNGKey(3), (5000,)) < jax.nn.sigmoid(X_test @ COEF5)).astype(X.dtype)

    def pooled(X, y=None):
        w = numpyro.sample("w", dist.Normal(0, 1).expand([5]).to_event(1))
        with numpyro.plate("data", X.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    nuts = MCMC(NUTS(pooled), num_warmup=500, num_samples=2000, progress_bar=False)
    nuts.run(jax.random.PRNGKey(5), X, y)

    def lpd(draws):  # mean log predictive density of the held-out rows, nats/row
        logits = jnp.asarray(draws) @ X_test.T
        log_lik = jnp.where(y_test == 1, jax.nn.log_sigmoid(logits), jax.nn.log_sigmoid(-logits))
        return float(jnp.mean(jax.scipy.special.logsumexp(log_lik, axis=0) - np.log(log_lik.shape[0])))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        exact = DPPVI(model, covariance="diagonal", progress_bar=False).run(jax.random.PRNGKey(9), 3, X, y)
    method = DPPVI(model, dp="dpsgd", target_epsilon=1.0, progress_bar=False)
    with pytest.warns(RuntimeWarning, match="going ahead"):
        result = method.run(jax.random.PRNGKey(seed), 2, X, y)
    mean, sd = np.asarray(exact.metrics["loc"][-1]), np.asarray(exact.metrics["scale"][-1])
    loc, scale = np.asarray(result.metrics["loc"][-1]), np.asarray(result.metrics["scale"][-1])
    predicted = float(result.metrics["predicted_dp_error"][-1])
    error = np.max(np.abs(loc - mean) / sd)
    assert predicted / 2 < error < 2 * predicted
    assert np.all((scale / sd > 0.1) & (scale / sd < 5.0))
    q_draws = loc + scale * np.random.default_rng(seed).normal(size=(2000, 5))
    assert lpd(nuts.get_samples()["w"]) - lpd(q_draws) < 0.002
