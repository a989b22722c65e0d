"""PVI core: per-row likelihoods, the Gaussian prior, clipping, and the exact conjugate fixed point."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp
import optax

import numpyro
import numpyro.distributions as dist

import numpyro_fed as nf
from numpyro_fed.infer import pvi
from numpyro_fed.infer.pvi import DPPVI
from numpyro_fed.infer.pvi.loss import LOSS_STREAM

import models


def params(result):
    """``q``'s ``loc`` and ``scale`` by site after a run."""
    return result.method.get_params(result.state)


def _regression_data(n=37, p=3, seed=0):
    X = jax.random.normal(jax.random.PRNGKey(seed), (n, p))
    return X, (X[:, 0] > 0) * 1.0


@pytest.mark.parametrize("model", [models.logistic_regression, models.linear_regression])
def test_row_log_likelihood_sums_to_client_potentials(model):
    X, y = _regression_data()
    y = y if model is models.logistic_regression else X[:, 1] + 0.1
    fp = nf.split_potential(model, (X, y))
    z = fp.init_params
    rows = jax.vmap(fp.row_log_likelihood_fn, in_axes=(None, 0))(z, fp.client_data["rows"])
    assert rows.shape == fp.client_data["valid"]["data"].shape
    per_client = jnp.sum(rows * fp.client_data["valid"]["data"], axis=1)
    np.testing.assert_allclose(-per_client, fp.client_potentials(z), rtol=1e-12)
    # One row alone is that row's term.
    one = fp.row_log_likelihood_fn(z, [r[0, 2:3] for r in fp.client_data["rows"]])
    np.testing.assert_allclose(one, rows[0, 2:3], rtol=1e-12)


def test_row_log_likelihood_refuses_client_local_latents():
    X, _ = _regression_data(n=models.NUM_ROWS)
    group = np.arange(models.NUM_ROWS) % models.NUM_CLIENTS
    fp = nf.split_potential(models.hierarchical, (X, group, X[:, 0]))
    with pytest.raises(ValueError, match="global"):
        fp.row_log_likelihood_fn(fp.init_params, [r[0] for r in fp.client_data["rows"]])


def test_gaussian_prior_reads_normal_priors():
    X, y = _regression_data()
    fp = nf.split_potential(models.logistic_regression, (X, y))
    eta = pvi.gaussian.gaussian_prior(lambda x: fp.prior_potential_fn(fp.unravel(x)), fp.num_latent)
    loc, scale = pvi.gaussian.loc_scale(eta)
    np.testing.assert_allclose(loc, 0.0, atol=1e-12)
    np.testing.assert_allclose(scale, 1.0, rtol=1e-12)


def test_gaussian_prior_refuses_non_gaussian_prior():
    X, _ = _regression_data()
    fp = nf.split_potential(models.poisson_glm, (X, jnp.ones(X.shape[0])))
    with pytest.raises(ValueError, match="Gaussian prior"):
        pvi.gaussian.gaussian_prior(lambda x: fp.prior_potential_fn(fp.unravel(x)), fp.num_latent)


@pytest.mark.parametrize("clip_norm", [1e-3, 0.5, 3.0])
def test_clip_by_norm_bounds_every_row(clip_norm):
    vectors = jax.random.normal(jax.random.PRNGKey(1), (500, 7)) * jnp.logspace(-3, 2, 500)[:, None]
    clipped, was_clipped = pvi.client.clip_by_norm(vectors, clip_norm)
    norms = jnp.linalg.norm(vectors, axis=1)
    new_norms = jnp.linalg.norm(clipped, axis=1)
    assert jnp.all(new_norms <= clip_norm * (1 + 1e-12))
    # Rows within the bound are untouched, the others keep their direction.
    np.testing.assert_array_equal(was_clipped, norms > clip_norm)
    np.testing.assert_allclose(clipped[~was_clipped], vectors[~was_clipped])
    cosine = jnp.sum(clipped * vectors, axis=1) / (new_norms * norms)
    np.testing.assert_allclose(cosine, 1.0, rtol=1e-12)


def test_per_example_grads_match_single_row_gradients():
    X, y = _regression_data(n=9)
    fp = nf.split_potential(models.logistic_regression, (X, y))
    rows = [r[0] for r in fp.client_data["rows"]]
    d = fp.num_latent

    def row_log_lik(theta, rows):
        return fp.row_log_likelihood_fn(fp.unravel(theta), rows)

    params = pvi.client.LocalParams(jnp.arange(d) * 0.3, jnp.full(d, -0.5))
    eps = jax.random.normal(jax.random.PRNGKey(2), (5, d))
    grads = pvi.client.per_example_grads(row_log_lik, params, eps, rows)
    for i in range(rows[0].shape[0]):

        def term(p):
            thetas = p.loc + jnp.exp(p.log_scale) * eps
            return jnp.mean(jax.vmap(lambda t: row_log_lik(t, [r[i : i + 1] for r in rows])[0])(thetas))

        g = jax.jit(jax.grad(term))(params)
        np.testing.assert_allclose(grads[i], jnp.concatenate([g.loc, g.log_scale]), rtol=1e-10)


def _gaussian_mean_model(y, clients):
    def model(y):
        mu = numpyro.sample("mu", dist.Normal(jnp.array([0.5, -1.0]), jnp.array([2.0, 1.0])).to_event(1))
        with nf.federated_plate("data", y.shape[0], clients=clients):
            numpyro.sample("y", dist.Normal(mu, jnp.array([1.0, 3.0])).to_event(1), obs=y)

    return model


@pytest.mark.parametrize("schedule", ["sequential", "synchronous"])
def test_conjugate_gaussian_reaches_exact_posterior(schedule):
    n = 31
    y = jax.random.normal(jax.random.PRNGKey(0), (n, 2)) * jnp.array([1.0, 3.0]) + jnp.array([1.0, 2.0])
    model = _gaussian_mean_model(y, np.arange(n) % 3)
    prior_precision = 1 / jnp.array([2.0, 1.0]) ** 2
    noise_precision = 1 / jnp.array([1.0, 3.0]) ** 2
    precision = prior_precision + n * noise_precision
    mean = (prior_precision * jnp.array([0.5, -1.0]) + noise_precision * y.sum(0)) / precision
    sd = precision**-0.5

    optim = optax.adam(optax.exponential_decay(5e-2, 300, 0.05))
    method = DPPVI(
        model,
        schedule=schedule,
        optim=optim,
        num_local_steps=300,
        num_mc_samples=64,
        covariance="diagonal",  # the mean-field fixed point, factor by factor
        progress_bar=False,
    )
    result = method.run(jax.random.PRNGKey(1), 6, y)
    loc, scale = params(result)["loc"]["mu"], params(result)["scale"]["mu"]
    # The prior alone is far off: these tolerances are a small fraction of the gap.
    assert jnp.all(jnp.abs(loc - mean) < 0.05 * sd)
    np.testing.assert_allclose(scale, sd, rtol=0.02)
    # The fixed point: q = prior x client factors, each factor that client's likelihood.
    state = result.state
    np.testing.assert_allclose(state.q.eta2, state.prior.eta2 + state.factors.eta2.sum(0), rtol=1e-10)
    client_precision = -2 * state.factors.eta2
    counts = np.bincount(np.arange(n) % 3)
    np.testing.assert_allclose(client_precision, counts[:, None] * noise_precision, rtol=0.1)
    assert not np.any(result.metrics["rejected"])


# -- GaussianPVI: one scheduled client per round (moved here from the DSVGD family) ----------------

PRIOR_SD, NOISE_SD = 3.0, 3.0
Y = jnp.array([2.5, -1.0, 4.0, 0.5, 3.0, 1.5])
POST_PRECISION = 1 / PRIOR_SD**2 + Y.size / NOISE_SD**2
POST_MEAN = float(Y.sum() / NOISE_SD**2 / POST_PRECISION)  # 1.5
POST_VAR = 1 / POST_PRECISION  # 9/7


def gaussian_mean(y):
    mu = numpyro.sample("mu", dist.Normal(0, PRIOR_SD))
    with nf.federated_plate("data", y.shape[0], clients=3):
        numpyro.sample("y", dist.Normal(mu, NOISE_SD), obs=y)


def test_gaussian_pvi_is_exact_on_the_conjugate_model():
    """A Gaussian posterior is in PVI's family: after two visits per client, q is the
    posterior up to the local optimizer's Monte Carlo noise."""
    import math

    from scipy import stats

    method = pvi.GaussianPVI(gaussian_mean, num_local_steps=500, num_mc_samples=20, progress_bar=False)
    result = method.run(jax.random.PRNGKey(0), 6, Y)
    assert result.metrics["client"].tolist() == [0, 1, 2, 0, 1, 2]
    loc, scale = result.metrics["loc"][-1, 0], result.metrics["scale"][-1, 0]
    # 5% of the posterior sd: well above the optimizer's noise, well below the prior's miss.
    assert abs(loc - POST_MEAN) < 0.05 * math.sqrt(POST_VAR)
    assert abs(scale - math.sqrt(POST_VAR)) < 0.05 * math.sqrt(POST_VAR)
    assert abs(result.metrics["loc"][0, 0] - POST_MEAN) > 0.2  # one client alone is not there
    draws = method.get_samples(jax.random.PRNGKey(1), result, 20_000)["mu"]
    assert abs(float(draws.mean()) - loc) < 4 * scale / math.sqrt(20_000)
    x = jnp.array([[POST_MEAN]])
    assert float(method.log_density(result, x)[0]) == pytest.approx(stats.norm(loc, scale).logpdf(POST_MEAN), rel=1e-5)


def test_gaussian_pvi_client_order_and_errors():
    method = pvi.GaussianPVI(gaussian_mean, num_local_steps=5, client_order=[2, 2, 0], progress_bar=False)
    assert method.run(jax.random.PRNGKey(0), 3, Y).metrics["client"].tolist() == [2, 2, 0]
    with pytest.raises(ValueError, match="client_order gives 3 rounds"):
        method.run(jax.random.PRNGKey(0), 4, Y)
    with pytest.raises(ValueError, match=r"unknown client\(s\) \[5\]"):
        pvi.GaussianPVI(gaussian_mean, client_order=[0, 5], progress_bar=False).run(jax.random.PRNGKey(0), 1, Y)
    with pytest.raises(ValueError, match="client_order must be"):
        pvi.GaussianPVI(gaussian_mean, client_order="cyclic")

    def non_gaussian(y):
        sigma = numpyro.sample("sigma", dist.Gamma(2.0, 1.0))
        with nf.federated_plate("data", y.shape[0], clients=3):
            numpyro.sample("y", dist.Normal(0.0, sigma), obs=y)

    # a non-Gaussian prior is no longer refused: the server refines it as a factor of its own
    result = pvi.GaussianPVI(non_gaussian, progress_bar=False).run(jax.random.PRNGKey(0), 1, Y)
    assert result.state.prior_factor is not None and np.isfinite(result.metrics["loss"]).all()


def _exact_negative_elbo(loc, scale):
    """``KL(q || prior) - sum_i E_q[log N(y_i | mu, NOISE_SD^2)]`` in closed form."""
    kl = np.log(PRIOR_SD / scale) + (scale**2 + loc**2) / (2 * PRIOR_SD**2) - 0.5
    expected = -0.5 * np.log(2 * np.pi * NOISE_SD**2) - ((np.asarray(Y) - loc) ** 2 + scale**2) / (2 * NOISE_SD**2)
    return kl - expected.sum()


def test_dppvi_loss_is_the_negative_elbo_and_update_continues_run():
    """metrics['loss'] is the negative ELBO: unbiased for its closed form, which at the
    exact posterior (PVI's conjugate fixed point) is minus the log evidence; init/update give
    the rounds of run."""
    from scipy import stats

    method = DPPVI(
        gaussian_mean,
        optim=optax.adam(optax.exponential_decay(5e-2, 300, 0.05)),
        num_local_steps=300,
        num_mc_samples=64,
        progress_bar=False,
    )
    result = method.run(jax.random.PRNGKey(1), 3, Y)
    assert result.metrics["loss"].shape == (3,)
    loc, scale = result.metrics["loc"][-1, 0], result.metrics["scale"][-1, 0]
    exact = _exact_negative_elbo(loc, scale)
    estimates = np.array(
        [float(method.evaluate(result.state, rng_key=k)) for k in jax.random.split(jax.random.PRNGKey(5), 40)]
    )
    assert abs(estimates.mean() - exact) < 4 * estimates.std() / np.sqrt(40)
    evidence = stats.multivariate_normal(np.zeros(Y.size), NOISE_SD**2 * np.eye(Y.size) + PRIOR_SD**2).logpdf(
        np.asarray(Y)
    )
    assert exact == pytest.approx(-evidence, abs=1e-3)  # q is the posterior: the ELBO is the evidence
    # evaluate on other data: the same q against the rows doubled costs more
    assert float(method.evaluate(result.state, jnp.concatenate([Y, Y]))) > estimates.max()
    # the same rounds, one at a time
    key_init, key_run = jax.random.split(jax.random.PRNGKey(1))
    state = method.init(key_init, Y, num_rounds=3)
    infos = []
    for key in jax.random.split(key_run, 3):
        state, info = method.update(key, state)
        infos.append(float(info.loss))
    np.testing.assert_array_equal(state.q.eta1, result.state.q.eta1)
    # a round's info.loss is of q as it starts (the clients' terms come with their updates):
    # the first is the prior's, above the posterior's; metrics["loss"] is of q after each round,
    # the last one asked of the clients after the rounds
    assert infos[0] > result.metrics["loss"].max()
    np.testing.assert_array_equal(infos[1:], result.metrics["loss"][:-1])
    last = method.evaluate(result.state, rng_key=jax.random.fold_in(key_run, LOSS_STREAM))
    assert float(last) == result.metrics["loss"][-1]
    assert repr(method).startswith("DPPVI(gaussian_mean, dp=None, schedule='sequential'")
