"""Deterministic sites inside a federated plate come back as NumPyro returns them (e.g. a
non-centred group effect ``theta = mu + tau * theta_tilde``), in plate order whatever the
clients' split, when they do not use the clients' rows; those that do (a residual ``y - theta``)
stay with the clients."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC
from numpyro.infer.util import constrain_fn

import numpyro_fed as nf

Y = np.array([28.0, 8, -3, 7, -1, 1, 18, 12])
SIGMA = np.array([15.0, 10, 16, 11, 9, 11, 10, 18])
OWNER = np.array([2, 0, 1, 0, 3, 1, 2, 3])  # schools out of order on the clients


def schools(sigma, y):
    mu = numpyro.sample("mu", dist.Normal(0, 5))
    tau = numpyro.sample("tau", dist.HalfCauchy(5))
    with nf.federated_plate("schools", 8, clients=OWNER):
        theta_tilde = numpyro.sample("theta_tilde", dist.Normal(0, 1))
        theta = numpyro.deterministic("theta", mu + tau * theta_tilde)
        numpyro.deterministic("resid", y - theta)
        numpyro.sample("y", dist.Normal(theta, sigma), obs=y)


def test_data_free_deterministic_sites_in_the_plate_are_numpyros_and_row_dependent_ones_are_not_returned():
    fp = nf.split_potential(schools, (SIGMA, Y))
    z = {
        "mu": jnp.asarray(1.5),
        "tau": jnp.asarray(0.7),  # unconstrained: tau = exp(0.7)
        "theta_tilde": jnp.linspace(-1.0, 1.2, 8),
    }
    ours = fp.postprocess_fn(z)
    reference = constrain_fn(schools, (SIGMA, Y), {}, z, return_deterministic=True)
    np.testing.assert_allclose(ours["theta"], reference["theta"], rtol=1e-12)
    np.testing.assert_allclose(ours["theta_tilde"], reference["theta_tilde"], rtol=1e-12)
    assert "resid" in reference and "resid" not in ours  # it uses y: it stays with the clients


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_fedzigzag_draws_carry_the_group_effects_as_nuts_does():
    mcmc = MCMC(nf.FedZigZag(schools), num_warmup=100, num_samples=200, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), SIGMA, Y)
    draws = mcmc.get_samples()
    assert draws["theta"].shape == (200, 8)
    expected = draws["mu"][:, None] + draws["tau"][:, None] * draws["theta_tilde"]
    np.testing.assert_allclose(draws["theta"], expected, rtol=1e-10)
    assert "resid" not in draws


# Eight schools as the literature writes it for a federation: each school's effect in a plate of
# groups, its rows in a data plate of their own (the zoo's eight schools), the schools out of
# order on the clients.
def schools_by_group(school, sigma, y):
    mu = numpyro.sample("mu", dist.Normal(0, 5))
    tau = numpyro.sample("tau", dist.HalfCauchy(5))
    with nf.federated_plate("schools", 8, clients=OWNER):
        theta_tilde = numpyro.sample("theta_tilde", dist.Normal(0, 1))
        theta = numpyro.deterministic("theta", mu + tau * theta_tilde)
        numpyro.deterministic("leak", theta + y.mean())  # uses every row: never returned
    with nf.federated_plate("data", 8, clients=OWNER):
        numpyro.sample("y", dist.Normal(theta[school], sigma), obs=y)


GROUP_ARGS = (np.arange(8), SIGMA, Y)


def test_deterministic_sites_in_a_plate_of_groups_are_numpyros_and_those_using_rows_are_not_returned():
    fp = nf.split_potential(schools_by_group, GROUP_ARGS)
    z = {"mu": jnp.asarray(1.5), "tau": jnp.asarray(0.7), "theta_tilde": jnp.linspace(-1.0, 1.2, 8)}
    ours = fp.postprocess_fn(z)
    reference = constrain_fn(schools_by_group, GROUP_ARGS, {}, z, return_deterministic=True)
    np.testing.assert_allclose(ours["theta"], reference["theta"], rtol=1e-12)
    assert "leak" in reference and "leak" not in ours
    assert fp.site_dims["theta"] == ["schools"] and fp.site_dims["y"] == ["data"]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_every_algorithm_returns_the_group_effects_with_the_plate_as_their_dim():
    """DSVGD and DPPVI (a run's draws and its ArviZ posterior, whose dims were ``theta_dim_0``)
    and FedZigZag and DADMMS (``mcmc.get_samples()``) return ``theta`` as NumPyro's NUTS does."""
    key = jax.random.PRNGKey(0)
    for method in (nf.DSVGD(schools_by_group, progress_bar=False), nf.DPPVI(schools_by_group, progress_bar=False)):
        result = method.run(key, 4, *GROUP_ARGS)
        draws = method.get_samples(key, result, 50)
        np.testing.assert_allclose(
            draws["theta"], draws["mu"][:, None] + draws["tau"][:, None] * draws["theta_tilde"], rtol=1e-10
        )
        posterior = nf.to_inference_data(result).posterior
        assert posterior["theta"].dims == posterior["theta_tilde"].dims == ("chain", "draw", "schools")
        assert "leak" not in draws
    for kernel, options in ((nf.FedZigZag, {}), (nf.DADMMS, {"num_chains": 2, "chain_method": "vectorized"})):
        mcmc = MCMC(kernel(schools_by_group), num_warmup=20, num_samples=20, progress_bar=False, **options)
        mcmc.run(key, *GROUP_ARGS)
        draws = mcmc.get_samples()
        assert draws["theta"].shape == (20 * options.get("num_chains", 1), 8)
        np.testing.assert_allclose(
            draws["theta"], draws["mu"][:, None] + draws["tau"][:, None] * draws["theta_tilde"], rtol=1e-10
        )
