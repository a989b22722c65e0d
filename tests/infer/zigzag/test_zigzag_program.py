"""FedZigZag's clients' program across runs: a federation keeps the program it was started on
only while it is the one for the clients' rows (a second run on other rows of the same counts
must not sample the first run's posterior)."""

import numpy as np
import pytest

import jax

import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC

import numpyro_fed as nf
from numpyro_fed.federation import InProcess

from helpers import save_client_rows


def logistic(X, y=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with nf.federated_plate("data", X.shape[0], clients=2):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def rows(seed, weights):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(80, 2))
    y = (rng.uniform(size=80) < 1 / (1 + np.exp(-X @ np.asarray(weights)))).astype(float)
    return X, y


def draws(kernel, *data, seed=0):
    mcmc = MCMC(kernel, num_warmup=10, num_samples=20, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(seed), *data)
    return np.asarray(mcmc.get_samples()["w"])


@pytest.mark.parametrize("thinning", [pytest.param("clients", marks=pytest.mark.slow), "server"])
def test_a_deployment_whose_rows_changed_samples_the_new_rows(tmp_path, thinning):
    """Deployment: the clients' files are rewritten between two runs of one sampler on one
    federation (the same row counts); the second run gives the draws of a new sampler on the
    new rows, not those of the first run's rows."""
    first, second = rows(0, [2.0, -2.0]), rows(1, [-2.0, 2.0])
    load = save_client_rows(tmp_path, [0, 40, 80], *first)
    kernel = nf.FedZigZag(
        logistic, sample_interval=0.5, thinning=thinning, federation=InProcess(loader=load, num_clients=2)
    )
    old = draws(kernel)
    save_client_rows(tmp_path, [0, 40, 80], *second)  # the same files, other rows
    again = draws(kernel)
    fresh = nf.FedZigZag(
        logistic, sample_interval=0.5, thinning=thinning, federation=InProcess(loader=load, num_clients=2)
    )
    expected = draws(fresh)
    assert np.sign(old.mean(0)).tolist() == [1.0, -1.0] and np.sign(expected.mean(0)).tolist() == [-1.0, 1.0]
    np.testing.assert_array_equal(again, expected)


@pytest.mark.parametrize("thinning", [pytest.param("clients", marks=pytest.mark.slow), "auto"])
def test_a_simulation_on_other_rows_of_the_same_shapes_samples_them(thinning):
    """Simulation: one sampler and one federation, two datasets of the same shapes: each run
    gives the draws of a new sampler on its rows."""
    first, second = rows(0, [2.0, -2.0]), rows(1, [-2.0, 2.0])
    kernel = nf.FedZigZag(logistic, sample_interval=0.5, thinning=thinning, federation=InProcess())
    draws(kernel, *first)
    again = draws(kernel, *second)
    expected = draws(nf.FedZigZag(logistic, sample_interval=0.5, thinning=thinning, federation=InProcess()), *second)
    assert np.sign(expected.mean(0)).tolist() == [-1.0, 1.0]
    np.testing.assert_array_equal(again, expected)
