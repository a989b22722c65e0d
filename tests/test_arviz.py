import numpy as np
import pytest

import jax

from numpyro.infer import MCMC, NUTS

import numpyro_fed as nf

from models import NUM_CLIENTS, hierarchical, make_data, owners_in_three_forms


@pytest.fixture(scope="module")
def hierarchical_run():
    clients, owner = owners_in_three_forms()["array"]
    X, y = make_data("linear_regression")
    args = (X, jax.numpy.asarray(owner), y)
    mcmc = MCMC(NUTS(hierarchical), num_warmup=100, num_samples=100, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), *args, clients=clients)
    return mcmc, nf.split_potential(hierarchical, args, {"clients": clients}), owner


def test_posterior_dims_are_named_after_plates_and_attrs_record_the_federation(hierarchical_run):
    mcmc, potential, owner = hierarchical_run
    idata = nf.to_inference_data(mcmc, potential=potential)
    assert idata.posterior["u"].dims == ("chain", "draw", "clients")
    assert idata.posterior["w"].shape == (1, 100, 3)
    assert idata.attrs["algorithm"] == "NUTS"
    assert idata.attrs["num_clients"] == NUM_CLIENTS
    assert idata.attrs["client_sizes"] == [int((owner == m).sum()) for m in range(NUM_CLIENTS)]
    assert idata.posterior.attrs["num_clients"] == NUM_CLIENTS


def test_client_data_is_opt_in(hierarchical_run):
    mcmc, potential, _ = hierarchical_run
    private = nf.to_inference_data(mcmc, potential=potential)
    assert "observed_data" not in private.groups()
    assert "log_likelihood" not in private.groups()
    pooled = nf.to_inference_data(mcmc, observed_data=True, log_likelihood=True)
    assert "observed_data" in pooled.groups()
    assert pooled.log_likelihood["y"].shape[-1] == 37


def test_unknown_result_type():
    with pytest.raises(TypeError, match="no converter for dict"):
        nf.to_inference_data({})


def test_decentralised_draws_have_plate_dims_in_every_group():
    # DADMMS: posterior = the reporting agent's draws (dims after plates, as for NUTS), the
    # agents and their network average beside it with the same dims.
    from numpyro.infer import Predictive

    clients, owner = owners_in_three_forms()["array"]
    X, y = make_data("linear_regression")
    args = (X, jax.numpy.asarray(owner), y)
    mcmc = MCMC(nf.DADMMS(hierarchical), num_warmup=5, num_samples=5, num_chains=2,
                chain_method="vectorized", progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), *args, clients=clients)
    idata = nf.to_inference_data(mcmc)
    assert idata.posterior["u"].dims == ("chain", "draw", "clients")
    assert idata.agents["u"].dims == ("chain", "draw", "agent", "clients")
    assert idata.network_average["u"].dims == ("chain", "draw", "clients")
    assert idata.agents.sizes["agent"] == NUM_CLIENTS
    assert "observed_data" not in idata.groups() and "log_likelihood" not in idata.groups()
    # what Predictive gets from get_samples() is what the posterior group holds
    samples = mcmc.get_samples()
    np.testing.assert_allclose(idata.posterior["u"].values.reshape(10, NUM_CLIENTS), samples["u"])
    draws = Predictive(hierarchical, samples)(jax.random.PRNGKey(1), X, jax.numpy.asarray(owner), clients=clients)
    assert draws["y"].shape == (10, X.shape[0])


def test_conversion_works_again_with_new_client_arrays():
    # ArviZ's own dims inference (jax.eval_shape of a model trace) failed the second time it
    # met a federated plate whose client assignment was a new (equal) array.
    X, y = make_data("linear_regression")
    for _ in range(2):
        clients, owner = owners_in_three_forms()["array"]
        mcmc = MCMC(NUTS(hierarchical), num_warmup=5, num_samples=5, progress_bar=False)
        mcmc.run(jax.random.PRNGKey(0), X, jax.numpy.asarray(owner), y, clients=clients)
        assert nf.to_inference_data(mcmc).posterior["u"].dims == ("chain", "draw", "clients")
