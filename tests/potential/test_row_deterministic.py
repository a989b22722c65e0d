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
