"""One accessor, one shape: nf.message_ledger of a sampler's MCMC run and of a variational run."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from numpyro.infer import MCMC, NUTS

import numpyro_fed as nf

from models import NUM_CLIENTS, logistic_regression, make_data

TOTALS = {"messages_to_client", "bytes_to_client", "messages_from_client", "bytes_from_client", "rounds"}


@pytest.fixture(scope="module")
def data():
    return make_data("logistic_regression")


def test_a_variational_run_and_a_decentralized_run_have_ledgers_of_one_shape(data):
    model = logistic_regression
    result = nf.DPPVI(model, progress_bar=False).run(jax.random.PRNGKey(1), 10, *data)
    pvi = nf.message_ledger(result)
    assert TOTALS <= set(pvi) and all(np.shape(v) == (NUM_CLIENTS,) for v in pvi.values())
    assert (pvi["messages_to_client"] > 0).all() and (pvi["bytes_from_client"] > 0).all()

    mcmc = MCMC(nf.DADMMS(model, topology="ring"), num_warmup=5, num_samples=10, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(2), *data)
    admm = nf.message_ledger(mcmc)
    same = mcmc.sampler.message_ledger(mcmc)
    assert set(admm) == set(same) and all(np.array_equal(admm[k], v) for k, v in same.items())
    assert {"messages_to_peer", "bytes_to_peer"} <= set(admm) and all(
        np.shape(v) == (NUM_CLIENTS,) for v in admm.values()
    )
    # a ring: every agent sends to its two neighbours once to start and once per iteration
    assert admm["messages_to_peer"].tolist() == [2 * 16] * NUM_CLIENTS


def test_what_has_no_ledger_is_refused_by_name(data):
    mcmc = MCMC(NUTS(logistic_regression), num_warmup=5, num_samples=5, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), *data)
    with pytest.raises(TypeError, match="not one of numpyro_fed's samplers"):
        nf.message_ledger(mcmc)
    with pytest.raises(TypeError, match="MCMC run or a RunResult"):
        nf.message_ledger(jnp.zeros(3))
