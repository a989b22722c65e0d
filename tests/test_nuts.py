"""The federated model is still an ordinary NumPyro model, and its split gives the same posterior."""

import numpy as np

import jax
import jax.numpy as jnp

import numpyro
import numpyro.distributions as dist
from numpyro.diagnostics import effective_sample_size
from numpyro.infer import MCMC, NUTS, Predictive

import numpyro_fed as nf

from models import owners_in_three_forms

NOISE = 0.5
PRIOR_SD = 2.0


def federated_linear(X, y=None, clients=4):
    w = numpyro.sample("w", dist.Normal(0, PRIOR_SD).expand([X.shape[1]]).to_event(1))
    with nf.federated_plate("data", X.shape[0], clients=clients):
        numpyro.sample("y", dist.Normal(X @ w, NOISE), obs=y)


def plain_linear(X, y=None, clients=None):
    w = numpyro.sample("w", dist.Normal(0, PRIOR_SD).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, NOISE), obs=y)


def _data(n=60, d=3):
    k1, k2 = jax.random.split(jax.random.PRNGKey(3))
    X = jax.random.normal(k1, (n, d))
    return X, X @ jnp.array([1.0, -2.0, 0.5]) + NOISE * jax.random.normal(k2, (n,))


def _closed_form_posterior(X, y):
    precision = X.T @ X / NOISE**2 + jnp.eye(X.shape[1]) / PRIOR_SD**2
    cov = jnp.linalg.inv(precision)
    return cov @ X.T @ y / NOISE**2, cov


def _run(kernel, *args, init_params=None, num_chains=1, **kwargs):
    mcmc = MCMC(
        kernel, num_warmup=500, num_samples=2000, num_chains=num_chains, progress_bar=False, chain_method="sequential"
    )
    mcmc.run(jax.random.PRNGKey(11), *args, init_params=init_params, **kwargs)
    return mcmc


def test_federated_plate_is_a_plate_under_nuts_and_predictive():
    X, y = _data()
    clients, _ = owners_in_three_forms(num_rows=60)["list"]
    federated = _run(NUTS(federated_linear), X, y, clients=clients)
    plain = _run(NUTS(plain_linear), X, y)
    # Same key, same potential: the same chain.
    np.testing.assert_allclose(federated.get_samples()["w"], plain.get_samples()["w"], rtol=1e-10)

    predictive = Predictive(federated_linear, federated.get_samples())
    draws = predictive(jax.random.PRNGKey(0), X, clients=clients)["y"]
    assert draws.shape == (2000, 60)
    # posterior predictive mean reproduces the fitted mean X @ E[w]
    np.testing.assert_allclose(draws.mean(0), X @ federated.get_samples()["w"].mean(0), atol=0.06)


def test_nuts_on_the_split_potential_matches_the_closed_form_posterior():
    X, y = _data()
    clients, _ = owners_in_three_forms(num_rows=60)["array"]
    fp = nf.split_potential(federated_linear, (X, y), {"clients": clients})
    mean, cov = _closed_form_posterior(X, y)

    two_inits = jax.tree.map(lambda a: jnp.stack([a, a + 0.1]), fp.init_params)
    split_run = _run(NUTS(potential_fn=fp.potential), init_params=two_inits, num_chains=2)
    w = jax.vmap(fp.postprocess_fn)(split_run.get_samples())["w"]
    pooled = _run(NUTS(federated_linear), X, y, clients=clients, num_chains=2).get_samples(group_by_chain=True)["w"]

    for draws in (np.asarray(w).reshape(2, -1, 3), np.asarray(pooled)):
        ess = effective_sample_size(draws)
        mcse = np.sqrt(np.diag(cov)) / np.sqrt(ess)
        flat = draws.reshape(-1, 3)
        # 4 Monte Carlo standard errors: fails with probability < 1e-4 per coordinate
        assert np.all(np.abs(flat.mean(0) - mean) < 4 * mcse)
        # sd: relative standard error of a sample sd is about 1/sqrt(2 ess)
        sd_ratio = flat.std(0) / np.sqrt(np.diag(cov))
        assert np.all(np.abs(sd_ratio - 1) < 4 / np.sqrt(2 * ess))
