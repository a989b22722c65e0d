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
