"""nf.to_inference_data returns what ArviZ's from_numpyro returns (ArviZ 1.x: xarray.DataTree;
ArviZ 0.2x on Python < 3.12: InferenceData), and the ArviZ functions a user calls work on
every algorithm's result."""

import subprocess
import sys
import warnings

import numpy as np
import pytest

import jax

from numpyro.infer import MCMC, NUTS

import numpyro_fed as nf

from models import NUM_CLIENTS, NUM_ROWS, hierarchical, logistic_regression, make_data, owners_in_three_forms

az = pytest.importorskip("arviz")
matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
ARVIZ_1 = int(az.__version__.split(".")[0]) >= 1


@pytest.fixture(scope="module")
def hierarchical_run():
    clients, owner = owners_in_three_forms()["array"]
    X, y = make_data("linear_regression")
    args = (X, jax.numpy.asarray(owner), y)
    mcmc = MCMC(NUTS(hierarchical), num_warmup=100, num_samples=100, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), *args, clients=clients)
    return mcmc, nf.split_potential(hierarchical, args, {"clients": clients}), owner


def test_import_does_not_import_arviz():
    # ArviZ costs about a second at import; NumPyro does not import it either
    code = "import sys, numpyro_fed; print('arviz' in sys.modules, 'xarray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False"]


def test_returns_what_arviz_from_numpyro_returns(hierarchical_run):
    mcmc, potential, _ = hierarchical_run
    idata = nf.to_inference_data(mcmc, potential=potential)
    assert type(idata) is type(az.from_numpyro(mcmc))
    if ARVIZ_1:
        import xarray as xr

        assert isinstance(idata, xr.DataTree)


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
    assert "observed_data" not in private and "constant_data" not in private
    assert "log_likelihood" not in private
    pooled = nf.to_inference_data(mcmc, observed_data=True, log_likelihood=True)
    assert "observed_data" in pooled and "log_likelihood" in pooled
    assert pooled.log_likelihood["y"].shape[-1] == NUM_ROWS
    assert pooled.log_likelihood["y"].dims == ("chain", "draw", "data")


def test_unknown_result_type():
    with pytest.raises(TypeError, match="no converter for dict"):
        nf.to_inference_data({})


def test_log_likelihood_of_a_result_without_its_data_asks_for_model_args():
    result = nf.DSVGD(
        logistic_regression, num_particles=5, num_local_steps=2, num_distill_steps=2, progress_bar=False
    ).run(jax.random.PRNGKey(0), 1, *DATA)
    with pytest.raises(TypeError, match="model_args"):
        nf.to_inference_data(result, log_likelihood=True)


def test_from_dicts_builds_what_arviz_builds():
    from numpyro_fed.arviz import from_dicts

    idata = from_dicts(
        {"w": np.zeros((2, 10, 3))},
        dims={"w": ["feature"]},
        sample_stats={"loss": (np.arange(5.0), ["round"])},
        coords={"round": np.arange(1, 6)},
        attrs={"algorithm": "X", "sizes": (1, 2)},
    )
    assert type(idata) is type(
        az.from_dict({"posterior": {"w": np.zeros((2, 10, 3))}})
        if ARVIZ_1
        else az.from_dict(posterior={"w": np.zeros((2, 10, 3))})
    )
    assert idata.posterior["w"].dims == ("chain", "draw", "feature")
    assert idata.sample_stats["loss"].dims == ("round",)
    assert list(idata.sample_stats["round"].values) == [1, 2, 3, 4, 5]
    assert idata.attrs["sizes"] == [1, 2] and idata.sample_stats.attrs["algorithm"] == "X"


def _dadmms_hierarchical(num_samples, num_chains):
    """``(mcmc, X, owner, clients)``: a short vectorized DADMMS run of the hierarchical model."""
    clients, owner = owners_in_three_forms()["array"]
    X, y = make_data("linear_regression")
    mcmc = MCMC(
        nf.DADMMS(hierarchical),
        num_warmup=5,
        num_samples=num_samples,
        num_chains=num_chains,
        chain_method="vectorized",
        progress_bar=False,
    )
    mcmc.run(jax.random.PRNGKey(0), X, jax.numpy.asarray(owner), y, clients=clients)
    return mcmc, X, owner, clients


def test_decentralised_draws_have_plate_dims_in_every_group():
    # DADMMS: posterior = the reporting agent's draws (dims after plates, as for NUTS), the
    # agents and their network average beside it with the same dims.
    from numpyro.infer import Predictive

    mcmc, X, owner, clients = _dadmms_hierarchical(num_samples=5, num_chains=2)
    idata = nf.to_inference_data(mcmc)
    assert idata.posterior["u"].dims == ("chain", "draw", "clients")
    assert idata.agents["u"].dims == ("chain", "draw", "agent", "clients")
    assert idata.network_average["u"].dims == ("chain", "draw", "clients")
    assert idata.agents.sizes["agent"] == NUM_CLIENTS
    assert "observed_data" not in idata and "log_likelihood" not in idata
    # what Predictive gets from get_samples() is what the posterior group holds
    samples = mcmc.get_samples()
    np.testing.assert_allclose(idata.posterior["u"].values.reshape(10, NUM_CLIENTS), samples["u"])
    draws = Predictive(hierarchical, samples)(jax.random.PRNGKey(1), X, jax.numpy.asarray(owner), clients=clients)
    assert draws["y"].shape == (10, X.shape[0])


def test_many_short_chains_convert_without_arviz_axis_warning():
    # DADMMS's documented runs have more chains than draws (100 of 50); the converter names
    # the axes itself, so ArviZ's "chain dimension longer than draw dimension" guess (0.2x:
    # "More chains than draws") must not reach the user (it printed once per site and group).
    mcmc, *_ = _dadmms_hierarchical(num_samples=3, num_chains=6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        idata = nf.to_inference_data(mcmc)
    assert idata.posterior.sizes["chain"] == 6 and idata.posterior.sizes["draw"] == 3
    assert not [w for w in caught if "chain dimension" in str(w.message) or "More chains" in str(w.message)]


def test_conversion_works_again_with_new_client_arrays():
    # ArviZ's own dims inference (jax.eval_shape of a model trace) failed the second time it
    # met a federated plate whose client assignment was a new (equal) array.
    X, y = make_data("linear_regression")
    for _ in range(2):
        clients, owner = owners_in_three_forms()["array"]
        mcmc = MCMC(NUTS(hierarchical), num_warmup=5, num_samples=5, progress_bar=False)
        mcmc.run(jax.random.PRNGKey(0), X, jax.numpy.asarray(owner), y, clients=clients)
        assert nf.to_inference_data(mcmc).posterior["u"].dims == ("chain", "draw", "clients")


# -- the ArviZ functions a user calls, on every algorithm's result ----------------------------

DATA = make_data("logistic_regression")


def _mcmc(kernel, **kwargs):
    mcmc = MCMC(kernel, progress_bar=False, **kwargs)
    mcmc.run(jax.random.PRNGKey(0), *DATA)
    return mcmc


# Small runs: the tests check the conversion, not the algorithms (their own tests check their
# accuracy). PSIS-LOO needs at least about 30 draws (its Pareto tail has 5 or more).
RUNS = {
    "NUTS": lambda: _mcmc(
        NUTS(logistic_regression), num_warmup=100, num_samples=100, num_chains=2, chain_method="sequential"
    ),
    "FedZigZag": lambda: _mcmc(nf.FedZigZag(logistic_regression), num_warmup=50, num_samples=100),
    "DADMMS": lambda: _mcmc(
        nf.DADMMS(logistic_regression), num_warmup=20, num_samples=25, num_chains=4, chain_method="vectorized"
    ),
    "DSVGD": lambda: nf.DSVGD(
        logistic_regression, num_particles=40, num_local_steps=20, num_distill_steps=20, progress_bar=False
    ).run(jax.random.PRNGKey(0), NUM_CLIENTS, *DATA),
    "DPPVI": lambda: nf.DPPVI(logistic_regression, num_local_steps=50, progress_bar=False).run(
        jax.random.PRNGKey(0), 3, *DATA
    ),
}


@pytest.fixture(scope="module", params=list(RUNS))
def converted(request):
    """(name, idata without client data, idata with log-likelihoods and observed data)."""
    with warnings.catch_warnings():
        # short runs: the algorithms warn about few effective draws or rounds; not tested here
        warnings.simplefilter("ignore", RuntimeWarning)
        result = RUNS[request.param]()
        idata = nf.to_inference_data(result)
        # the same call for every result: a variational result does not keep the data
        pooled = nf.to_inference_data(result, log_likelihood=True, observed_data=True, model_args=DATA)
    return request.param, idata, pooled


def test_az_summary_describes_every_site(converted):
    name, idata, _ = converted
    summary = az.summary(idata)
    assert list(summary.index) == ["w[0]", "w[1]", "w[2]"], name
    draws = idata.posterior["w"].values.reshape(-1, 3)
    np.testing.assert_allclose(summary["mean"].astype(float), draws.mean(0), atol=1e-3)


def test_az_plot_trace_and_plot_forest_run(converted):
    import matplotlib.pyplot as plt

    name, idata, _ = converted
    try:
        az.plot_trace(idata)
        az.plot_forest(idata)
    finally:
        plt.close("all")


def test_log_likelihood_is_pointwise_and_az_loo_uses_it(converted):
    name, idata, pooled = converted
    assert "log_likelihood" not in idata and "observed_data" not in idata
    np.testing.assert_array_equal(pooled.observed_data["y"].values, np.asarray(DATA[1]))
    # each row's Bernoulli log-likelihood at each draw, computed here from the draws
    w = pooled.posterior["w"].values
    logits = np.einsum("cdk,nk->cdn", w, np.asarray(DATA[0]))
    expected = np.asarray(DATA[1]) * logits - np.logaddexp(0.0, logits)
    np.testing.assert_allclose(pooled.log_likelihood["y"].values, expected, rtol=1e-6, atol=1e-9)
    assert pooled.log_likelihood["y"].dims == ("chain", "draw", "data")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Pareto k of short runs
        loo = az.loo(pooled)
    elpd = float(loo["elpd_loo"] if not ARVIZ_1 else loo.elpd)
    assert np.isfinite(elpd) and elpd < 0
    assert int(loo["n_data_points"] if not ARVIZ_1 else loo.n_data_points) == NUM_ROWS
