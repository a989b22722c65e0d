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
from numpyro_fed.infer.pvi import DPPVI, GaussianPVI, core
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
    default run agrees with NUTS within 0.15 posterior sds on every mean (half the issue's
    criterion) and 15 % on every sd, without warnings. Measured over keys 1-3 in both
    precisions: every mean within 0.03 sd, sds within 5 % (sigma's 9 %). NUTS's own Monte
    Carlo error is about 0.06 sd. Before the prior factor was fitted on its own coordinates,
    sigma's mean was 0.2 (float64) to 0.35 (float32) sd high: the masked fit's noise."""
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
    assert np.max(np.abs(mean - ref_mean) / ref_sd) < 0.15
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


def _gamma_log_remainder(z):
    """``Gamma(2, 0.1)``'s log-density of ``nu`` on ``log nu`` (log-Jacobian included), the
    prior factor's "likelihood" of a Student-t's degrees of freedom."""
    return 2.0 * z[2] - 0.1 * jnp.exp(z[2])


def _vi_optimum_under_gamma_remainder(cavity_loc, cavity_sd):
    """The Gaussian ``N(m, s^2)`` maximizing ``E[r] - KL(q || N(cavity_loc, cavity_sd^2))``
    for ``r(x) = 2 x - 0.1 exp(x)``, from its stationarity conditions in closed form
    (``E[exp(x)] = exp(m + s^2 / 2)``): ``1/s^2 = 1/cavity_sd^2 + 0.1 E[exp(x)]`` and
    ``m = cavity_loc + cavity_sd^2 (2 - 0.1 E[exp(x)])``."""
    from scipy.optimize import fsolve

    def equations(v):
        m, log_s = v
        moment = np.exp(m + np.exp(2 * log_s) / 2)
        return [m - cavity_loc - cavity_sd**2 * (2 - 0.1 * moment), np.exp(-2 * log_s) - cavity_sd**-2 - 0.1 * moment]

    m, log_s = fsolve(equations, [cavity_loc, np.log(cavity_sd)], xtol=1e-12)
    return m, np.exp(log_s)


def test_the_prior_factor_is_fitted_on_its_own_coordinates():
    """The server's refinement of a prior factor that depends on one coordinate (a Student-t's
    ``log nu`` under a ``Gamma(2, 0.1)`` prior) in a full-rank ``q`` whose other coordinates
    are an intercept at 19 and a slope correlated with it at -0.999 (raw covariates): the new
    ``q``'s marginal of ``log nu`` is the Gaussian-VI optimum against the cavity's marginal
    (``q_R / t_0``), computed in closed form, within 0.05 of its sd in mean and 5 % in sd over
    six keys (the default local fit's Monte Carlo error: at most 0.009 sd and 1.6 % over
    twelve keys), and every
    other natural parameter is unchanged. A fit over all coordinates whose change is masked to
    ``log nu`` afterwards (this function before) kept its noisy covariances with the
    intercept in ``eta1 = P mu``: here its mean was up to 11 sds off over the same twelve keys,
    and from a state near PVI's fixed point it moved ``q``'s ``log nu`` by up to 9 of its sds
    in one round of a Student-t regression (the next test)."""
    from numpyro_fed.infer.pvi.dp_defaults import local_config
    from numpyro_fed.infer.pvi.gaussian import GaussianNatural, loc_scale, tree_sub
    from numpyro_fed.infer.pvi.prior import build_prior_update, marginal

    sd = np.array([4.5, 0.026, 0.5])
    corr = np.array([[1.0, -0.999, 0.3], [-0.999, 1.0, -0.3], [0.3, -0.3, 1.0]])
    cov = corr * np.outer(sd, sd)
    precision = np.linalg.inv(cov)
    loc = np.array([18.8, 0.31, 2.3])
    q = GaussianNatural(jnp.asarray(precision @ loc), jnp.asarray(-0.5 * precision))
    prior_factor = GaussianNatural(jnp.array([0.0, 0.0, 3.5]), jnp.diag(jnp.array([0.0, 0.0, -0.55])))
    state = core.init(GaussianNatural(jnp.zeros(3), jnp.zeros((3, 3))), 1, q=q, prior_factor=prior_factor)
    method = DPPVI(lambda: None, progress_bar=False)
    refined = np.array([False, False, True])
    update = jax.jit(build_prior_update(_gamma_log_remainder, refined, local_config(method, newton_start=20)))
    cavity = tree_sub(marginal(q, np.array([2])), GaussianNatural(prior_factor.eta1[2:], prior_factor.eta2[2:, 2:]))
    cavity_loc, cavity_sd = (float(v[0]) for v in loc_scale(cavity))
    want_loc, want_sd = _vi_optimum_under_gamma_remainder(cavity_loc, cavity_sd)
    for seed in range(6):
        new, residual = update(state, jax.random.PRNGKey(seed))
        got_loc, got_sd = (float(v[0]) for v in loc_scale(marginal(new.q, np.array([2]))))
        assert abs(got_loc - want_loc) < 0.05 * want_sd, (got_loc, want_loc, want_sd)
        assert abs(got_sd / want_sd - 1) < 0.05, (got_sd, want_sd)
        change = tree_sub(new.q, q)
        np.testing.assert_array_equal(np.asarray(change.eta1)[:2], 0.0)
        np.testing.assert_array_equal(np.asarray(change.eta2)[:2, :], 0.0)
        np.testing.assert_array_equal(np.asarray(tree_sub(new.prior_factor, prior_factor).eta1)[:2], 0.0)
        assert float(residual) < 0.1


def student_t_regression(x, y):
    """A robust regression on a raw covariate (heights near 170): the degrees of freedom
    under the ``Gamma(2, 0.1)`` prior Stan's wiki suggests, a ``LogNormal`` noise scale."""
    a = numpyro.sample("a", dist.Normal(0.0, 50.0))
    b = numpyro.sample("b", dist.Normal(0.0, 5.0))
    sigma = numpyro.sample("sigma", dist.LogNormal(0.0, 1.0))
    nu = numpyro.sample("nu", dist.Gamma(2.0, 0.1))
    with nf.federated_plate("data", y.shape[0], clients=4):
        numpyro.sample("y", dist.StudentT(nu, a + b * x, sigma), obs=y)


def test_student_t_degrees_of_freedom_agree_with_nuts():
    """The Student-t regression in float32 (NumPyro's default) at DPPVI's defaults agrees with
    NUTS on the pooled data (float64, 2000 draws) within 0.3 sds on every mean and
    ``[1/1.5, 1.5]`` on every sd (``nu`` and ``sigma`` on the log scale, where ``q`` is
    Gaussian), and warns of nothing. ``log nu``'s posterior (mean 2.3, sd 0.56, skewness 0.5)
    is the hard part: the likelihood hardly depends on it once ``nu`` is large. Measured:
    0.11 sd low and sd ratio 0.87 on ``log nu``, the others within 0.04 sd and 5 %. Before the
    prior factor was fitted on its own coordinates the same run warned from round 5 on (its
    local fits non-finite, ``log nu`` at -42), and in float64 ``q``'s ``log nu`` wandered
    between 1.2 and 5.9 over the rounds."""
    rng = np.random.default_rng(11)
    x = rng.normal(170.0, 10.0, 240)
    y = 20.0 + 0.3 * x + 3.0 * rng.standard_t(4, 240)
    names = ["a", "b", "sigma", "nu"]
    mcmc = MCMC(NUTS(student_t_regression), num_warmup=500, num_samples=2000, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(3), jnp.asarray(x), jnp.asarray(y))

    def logged(draws):
        return {k: np.log(np.asarray(draws[k], np.float64)) if k in ("sigma", "nu") else draws[k] for k in names}

    ref_mean, ref_sd = moments(logged(mcmc.get_samples()), names)
    jax.config.update("jax_enable_x64", False)
    try:
        method = DPPVI(student_t_regression, progress_bar=False)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            result = method.run(jax.random.PRNGKey(0), 10, jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32))
        assert result.state.q.eta1.dtype == jnp.float32
        mean, sd = moments(logged(method.get_samples(jax.random.PRNGKey(1), result, 8000)), names)
    finally:
        jax.config.update("jax_enable_x64", True)
    assert np.max(np.abs(mean - ref_mean) / ref_sd) < 0.3, (mean - ref_mean) / ref_sd
    assert np.all((sd / ref_sd > 1 / 1.5) & (sd / ref_sd < 1.5)), sd / ref_sd


def test_flat_priors_alone_have_nothing_to_refine():
    """Flat priors and nothing else to refine (a location with an ``ImproperUniform`` prior, a
    known noise sd): the prior is not exact (``q`` starts proper, not at the prior), no
    coordinate belongs to the prior factor, and the run reaches the closed-form posterior,
    ``N(mean(y), 1.5^2 / n)``, within 0.05 of its sd (a conjugate model: the Newton start is
    exact, so only the local fits' Monte Carlo error remains)."""

    def model(y):
        mu = numpyro.sample("mu", dist.ImproperUniform(constraints.real, (), ()))
        with nf.federated_plate("data", y.shape[0], clients=3):
            numpyro.sample("y", dist.Normal(mu, 1.5), obs=y)

    y = jnp.asarray(np.random.default_rng(5).normal(4.0, 1.5, size=90))
    method = DPPVI(model, progress_bar=False)
    result = method.run(jax.random.PRNGKey(0), 3, y)
    assert result.state.prior_factor is not None and not np.any(np.asarray(result.metrics["prior_residual"]))
    sd = 1.5 / np.sqrt(90)
    assert abs(float(result.metrics["loc"][-1, 0]) - float(jnp.mean(y))) < 0.05 * sd
    assert abs(float(result.metrics["scale"][-1, 0]) / sd - 1) < 0.05
