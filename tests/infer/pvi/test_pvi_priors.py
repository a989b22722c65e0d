"""DPPVI on the priors statisticians write (a HalfCauchy scale, flat priors, a Dirichlet) and
with a full-rank q, against NumPyro NUTS on the pooled data and closed forms."""

import warnings

import numpy as np
import pytest

import jax
import jax.numpy as jnp
import optax

import numpyro
import numpyro.distributions as dist
from numpyro.distributions import constraints
from numpyro.infer import MCMC, NUTS

import numpyro_fed as nf
from numpyro_fed.infer.pvi import DPPVI, GaussianPVI
from numpyro_fed.infer.pvi.gaussian import gaussian_prior
from numpyro_fed.infer.pvi.prior import split_prior

NUM_ROWS, NUM_CLIENTS = 200, 4


def raw_regression(X, y=None):
    """Flat priors on the coefficients and the intercept, a HalfCauchy noise scale."""
    a = numpyro.sample("a", dist.ImproperUniform(constraints.real, (), ()))
    b = numpyro.sample("b", dist.ImproperUniform(constraints.real, (), (X.shape[1],)))
    sigma = numpyro.sample("sigma", dist.HalfCauchy(5.0))
    with nf.federated_plate("data", X.shape[0], clients=NUM_CLIENTS):
        numpyro.sample("y", dist.Normal(a + X @ b, sigma), obs=y)


def raw_data(seed=0):
    """Raw covariates with scales 1, 10 and 100 (not centred), an intercept at 9.5."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(NUM_ROWS, 3)) * np.array([1.0, 10.0, 100.0]) + np.array([0.0, 20.0, 300.0])
    y = 9.5 + X @ np.array([0.5, -0.2, 0.01]) + rng.normal(size=NUM_ROWS) * 1.5
    return X, y


def nuts_moments(model, args, names):
    mcmc = MCMC(NUTS(model), num_warmup=500, num_samples=2000, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), *args)
    return moments(mcmc.get_samples(), names)


def moments(draws, names):
    flat = np.concatenate([np.asarray(draws[n], np.float64).reshape(len(draws[n]), -1) for n in names], axis=1)
    return flat.mean(0), flat.std(0)


@pytest.fixture(scope="module")
def raw_reference():
    """NUTS on the pooled data, float64: 2000 draws (ESS several hundred per coordinate: a
    mean's Monte Carlo error below 0.06 posterior sds, an sd's below 5 %)."""
    X, y = raw_data()
    return nuts_moments(raw_regression, (jnp.asarray(X), jnp.asarray(y)), ["a", "b", "sigma"])


def test_halfcauchy_and_flat_priors_agree_with_nuts(precision, raw_reference):
    """The prior factor (HalfCauchy) and the zero-precision flat factors, raw covariates: the
    default run agrees with NUTS within 0.3 posterior sds on every mean (the issue's
    criterion) and 15 % on every sd, without warnings. Measured: the coefficients within 0.05
    sd in both precisions; sigma's mean 0.2 (float64) to 0.29 (float32, three seeds 0.23-0.35
    of its sd on the log scale's round-to-round jitter) sd high: a Gaussian q on log sigma,
    whose lognormal mean NUTS's skewed posterior does not share exactly, plus the Monte Carlo
    jitter of the last round's local fits. NUTS's own Monte Carlo error is about 0.06 sd."""
    X, y = raw_data()
    dtype = jnp.float32 if precision == "float32" else jnp.float64
    method = DPPVI(raw_regression, progress_bar=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        result = method.run(jax.random.PRNGKey(1), 6, jnp.asarray(X, dtype), jnp.asarray(y, dtype))
    assert result.state.q.eta1.dtype == dtype
    assert result.state.prior_factor is not None
    mean, sd = moments(method.get_samples(jax.random.PRNGKey(2), result, 8000), ["a", "b", "sigma"])
    ref_mean, ref_sd = raw_reference
    assert np.max(np.abs(mean - ref_mean) / ref_sd) < 0.3
    np.testing.assert_allclose(sd / ref_sd, 1.0, atol=0.15)


def location_scale(y):
    mu = numpyro.sample("mu", dist.ImproperUniform(constraints.real, (), ()))
    sigma = numpyro.sample("sigma", dist.HalfCauchy(1.0))
    with nf.federated_plate("data", y.shape[0], clients=2):
        numpyro.sample("y", dist.Normal(mu, sigma), obs=y)


def test_gaussian_pvi_takes_the_same_priors():
    """GaussianPVI (one client per round, mean-field) refines the prior factor too: a flat
    location and a HalfCauchy scale (their posterior nearly independent, so mean-field is
    right) agree with NUTS within 0.3 posterior sds on the means and 20 % on the sds."""
    y = jnp.asarray(np.random.default_rng(3).normal(2.0, 1.5, size=40))
    ref_mean, ref_sd = nuts_moments(location_scale, (y,), ["mu", "sigma"])
    method = GaussianPVI(location_scale, num_local_steps=400, optim=optax.adam(5e-2), progress_bar=False)
    result = method.run(jax.random.PRNGKey(1), 8, y)
    assert result.state.prior_factor is not None
    mean, sd = moments(method.get_samples(jax.random.PRNGKey(2), result, 8000), ["mu", "sigma"])
    assert np.max(np.abs(mean - ref_mean) / ref_sd) < 0.3
    np.testing.assert_allclose(sd / ref_sd, 1.0, atol=0.2)


def test_the_prior_split_reads_each_kind_of_prior():
    """Normal priors: the exact path, identical to the Gaussian prior it had; a HalfCauchy
    scale and a Dirichlet: refined by the prior factor; flat priors: zero precision, not
    refined, with a proper unit-scale start at the initial point."""

    def model():
        numpyro.sample("w", dist.Normal(1.0, 2.0).expand([2]).to_event(1))
        numpyro.sample("s", dist.HalfCauchy(1.0))
        numpyro.sample("p", dist.Dirichlet(jnp.ones(3)))
        numpyro.sample("f", dist.ImproperUniform(constraints.real, (), ()))
        numpyro.sample("l", dist.LogNormal(0.0, 1.0))  # Gaussian on the log scale

    def data_model(y):
        model()
        with nf.federated_plate("data", y.shape[0], clients=2):
            numpyro.sample("y", dist.Normal(0.0, 1.0), obs=y)

    fp = nf.split_potential(data_model, (jnp.zeros(4),))
    z0 = fp.ravel(fp.init_params)
    split = split_prior(fp.flat().prior_potential, z0)
    refined = fp.unravel(jnp.asarray(split.refined, float))
    assert not split.exact
    assert refined["w"].tolist() == [0.0, 0.0] and float(refined["l"]) == 0.0 and float(refined["f"]) == 0.0
    assert float(refined["s"]) == 1.0 and refined["p"].tolist() == [1.0, 1.0]
    precision = fp.unravel(-2 * split.base.eta2)
    np.testing.assert_allclose(precision["w"], 0.25)
    assert float(precision["f"]) == 0.0 and float(precision["s"]) == 0.0
    start_loc = fp.unravel(split.start.eta1 / (-2 * split.start.eta2))
    np.testing.assert_allclose(start_loc["f"], fp.init_params["f"])

    def gaussian_model(y):
        numpyro.sample("w", dist.Normal(1.0, 2.0).expand([2]).to_event(1))
        with nf.federated_plate("data", y.shape[0], clients=2):
            numpyro.sample("y", dist.Normal(0.0, 1.0), obs=y)

    fp = nf.split_potential(gaussian_model, (jnp.zeros(4),))
    split = split_prior(fp.flat().prior_potential, fp.ravel(fp.init_params))
    exact = gaussian_prior(fp.flat().prior_potential, fp.num_latent)
    assert split.exact
    for got, want in zip(split.base, exact):
        np.testing.assert_array_equal(got, want)


def _gaussian_prior_regression(X, y=None):
    a = numpyro.sample("a", dist.Normal(0.0, 100.0))
    b = numpyro.sample("b", dist.Normal(0.0, 10.0).expand([X.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.LogNormal(0.0, 2.0))  # Gaussian on the log scale
    with nf.federated_plate("data", X.shape[0], clients=NUM_CLIENTS):
        numpyro.sample("y", dist.Normal(a + X @ b, sigma), obs=y)


def test_private_runs_are_charged_for_the_clients_updates_only():
    """DP-SGD with a fixed noise multiplier: the run with a HalfCauchy and flat priors (the
    server refines a prior factor every round) spends exactly the epsilon of the same run
    with a Gaussian prior (no prior factor): the prior factor's updates read no rows and
    are not charged, which the guarantee says."""
    X, y = raw_data()
    X, y = jnp.asarray(X / X.std(0)), jnp.asarray((y - y.mean()) / y.std())
    settings = dict(dp="dpsgd", noise_multiplier=1.0, num_local_steps=5, sampling_rate=0.2, clip_norm=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # few rows: the noise dominates
        refined = DPPVI(raw_regression, progress_bar=False, **settings).run(jax.random.PRNGKey(0), 3, X, y)
        exact = DPPVI(_gaussian_prior_regression, progress_bar=False, **settings).run(jax.random.PRNGKey(0), 3, X, y)
    assert refined.state.prior_factor is not None and exact.state.prior_factor is None
    assert refined.privacy.epsilon == exact.privacy.epsilon
    assert "prior factor" in refined.privacy.method and "not charged" in refined.privacy.method
    assert "prior factor" not in exact.privacy.method
    # the prior factor crosses nothing: the same messages, per client, as without it
    for key in ("update/messages_to_client", "update/messages_from_client"):
        np.testing.assert_array_equal(refined.ledger[key], exact.ledger[key])


def test_full_rank_is_refused_with_privacy():
    with pytest.raises(ValueError, match="covariance='full' needs dp=None"):
        DPPVI(raw_regression, dp="dpsgd", covariance="full", noise_multiplier=1.0)
    with pytest.raises(ValueError, match="covariance must be one of"):
        DPPVI(raw_regression, covariance="dense")


def poisson_offset(X, log_exposure, y=None):
    a = numpyro.sample("a", dist.Normal(0.0, 5.0))
    b = numpyro.sample("b", dist.Normal(0.0, 2.5).expand([X.shape[1]]).to_event(1))
    with nf.federated_plate("data", X.shape[0], clients=NUM_CLIENTS):
        numpyro.sample("y", dist.Poisson(jnp.exp(log_exposure + a + X @ b)), obs=y)


def poisson_data(seed=0, n=400):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 3))
    X[:, 1] = 0.8 * X[:, 0] + 0.6 * X[:, 1]
    exposure = rng.uniform(0.5, 20.0, size=n)
    y = rng.poisson(exposure * np.exp(-1.0 + X @ np.array([0.3, -0.2, 0.1]))).astype(float)
    return jnp.asarray(X), jnp.asarray(np.log(exposure)), jnp.asarray(y)


@pytest.mark.slow
def test_poisson_offset_full_rank_agrees_and_mean_field_warns():
    """A Poisson regression with an offset, correlated covariates: the intercept's posterior
    is correlated with every coefficient through the offset's scale. Mean-field sds were 0.56
    to 0.70 of NUTS's; the default (full-rank) q agrees within 0.2 sd and 15 %, and a
    mean-field run warns that its sds are too small."""
    args = poisson_data()
    ref_mean, ref_sd = nuts_moments(poisson_offset, args, ["a", "b"])
    method = DPPVI(poisson_offset, progress_bar=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        result = method.run(jax.random.PRNGKey(1), 3, *args)
    mean, sd = moments(method.get_samples(jax.random.PRNGKey(2), result, 8000), ["a", "b"])
    assert np.max(np.abs(mean - ref_mean) / ref_sd) < 0.2
    np.testing.assert_allclose(sd / ref_sd, 1.0, atol=0.15)
    with pytest.warns(RuntimeWarning, match=r"mean-field.*use covariance='full'"):
        DPPVI(poisson_offset, covariance="diagonal", progress_bar=False).run(jax.random.PRNGKey(1), 3, *args)
