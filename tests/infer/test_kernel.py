"""The samplers' shared face: a run's problems reach the user at the end of ``MCMC.run``."""

import warnings

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC

import numpyro_fed as nf


def regression(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 10.0).expand([X.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfCauchy(2.0))
    with nf.federated_plate("data", X.shape[0], clients=2):
        numpyro.sample("y", dist.Normal(X @ w, sigma), obs=y)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    X = np.column_stack([np.ones(40), rng.normal(size=40)])
    return X, X @ np.array([1.0, -0.5]) + 0.3 * rng.normal(size=40)


def run_caught(mcmc, *args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mcmc.run(jax.random.PRNGKey(0), *args)
    return [w for w in caught if issubclass(w.category, RuntimeWarning) and "FedZigZag" in str(w.message)]


def test_a_run_too_short_to_summarize_warns_at_the_end_of_mcmc_run_on_the_users_line(data):
    """20 draws cannot give 50 effective ones: the user hears it from ``mcmc.run`` itself, on
    their own line, before any ``to_inference_data``."""
    mcmc = MCMC(nf.FedZigZag(regression), num_warmup=20, num_samples=20, progress_bar=False)
    caught = run_caught(mcmc, *data)
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert "effective" in str(caught[0].message)
    assert caught[0].filename == __file__
    # to_inference_data checks again (a user who converts hears it there too)
    with pytest.warns(RuntimeWarning, match="FedZigZag"):
        nf.to_inference_data(mcmc)


def test_the_check_runs_after_the_sampling_run_not_after_mcmc_warmup(data):
    mcmc = MCMC(nf.FedZigZag(regression), num_warmup=20, num_samples=20, progress_bar=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mcmc.warmup(jax.random.PRNGKey(0), *data)
    assert not [w for w in caught if "FedZigZag" in str(w.message)]
    assert len(run_caught(mcmc, *data)) == 1


def test_a_good_run_is_silent_and_numpyros_own_kernels_are_untouched(data):
    mcmc = MCMC(nf.FedZigZag(regression), num_warmup=300, num_samples=1000, progress_bar=False)
    assert run_caught(mcmc, *data) == []
    X, y = (jnp.asarray(a) for a in data)
    nuts = MCMC(numpyro.infer.NUTS(regression), num_warmup=50, num_samples=50, progress_bar=False)
    nuts.run(jax.random.PRNGKey(0), X, y)
    assert "_set_collection_params" not in vars(nuts)
