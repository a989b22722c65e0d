"""FedZigZag on a posterior with two separated modes: the set-up's search from two starts puts
the chain in the mode that holds the mass, and warns when the other holds a share of it."""

import warnings

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import numpyro
import numpyro.distributions as dist
from numpyro.diagnostics import effective_sample_size
from numpyro.infer import MCMC

import numpyro_fed as nf
from numpyro_fed.infer.zigzag.mode import ModeSearch, pick_mode


def squared(y, prior_loc):
    """``y ~ Normal(mu^2, 0.5)``: modes near ``mu = +-2``, about 90 posterior sds apart; the
    prior ``Normal(prior_loc, 1)`` decides their weights."""
    mu = numpyro.sample("mu", dist.Normal(prior_loc, 1.0))
    with nf.federated_plate("data", y.shape[0], clients=4):
        numpyro.sample("y", dist.Normal(mu**2, 0.5), obs=y)


def quadrature(y, prior_loc):
    """The posterior's mass on ``mu < 0`` and its mean and sd, on a fine grid."""
    grid = np.linspace(-4, 4, 400_001)
    y = np.asarray(y, np.float64)
    log_p = -0.5 * (grid - prior_loc) ** 2 - 0.5 * (((y[:, None] - grid**2) / 0.5) ** 2).sum(0)
    p = np.exp(log_p - log_p.max())
    p /= p.sum()
    mean = (p * grid).sum()
    return p[grid < 0].sum(), mean, np.sqrt((p * (grid - mean) ** 2).sum())


def run(prior_loc, seed):
    y = 4.0 + 0.5 * jax.random.normal(jax.random.PRNGKey(3), (8,))
    sampler = nf.FedZigZag(squared)
    mcmc = MCMC(sampler, num_warmup=200, num_samples=400, progress_bar=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mcmc.run(jax.random.PRNGKey(seed), y, prior_loc)
    messages = [str(w.message) for w in caught if "modes" in str(w.message)]
    return y, sampler, np.asarray(mcmc.get_samples()["mu"]), messages


def test_chain_starts_in_the_mode_with_the_mass():
    """The prior (mean 3) puts 12 nats between the modes: all but 1e-5 of the mass is at
    ``mu = +2``. Seed 1's ``init_to_uniform`` start is negative: from there alone the search
    ends at ``-2`` and the chain, which cannot cross 90 sds, stays there (posterior mean -2)."""
    y, sampler, mu, messages = run(3.0, seed=1)
    assert float(sampler.federated_potential.init_params["mu"]) < 0  # the start the case is about
    negative_mass, mean, sd = quadrature(y, 3.0)
    assert negative_mass < 1e-4
    # the second search (from the prior's median) found the mode with the mass
    assert sampler.mode_search.is_mode and float(sampler.mode_search.point[0]) > 0
    assert sampler.other_mode is not None and float(sampler.other_mode.point[0]) < 0
    assert sampler.other_mode.share < 1e-4 and sampler.other_mode.distance > 50
    assert not messages  # a negligible mode is no warning
    ess = float(effective_sample_size(mu[None]))
    assert abs(mu.mean() - mean) < 5 * sd / np.sqrt(ess)
    assert 0.7 < mu.std() / sd < 1.4


def test_second_mode_with_mass_warns():
    """With the prior's mean at 0.3 the mode at ``-2`` holds about a fifth of the mass: the
    warning names the share, as the quadrature gives it (the Laplace approximations are good
    here: each mode is Gaussian to a few per cent)."""
    y, sampler, mu, messages = run(0.3, seed=1)
    negative_mass, _, _ = quadrature(y, 0.3)
    assert 0.1 < negative_mass < 0.4
    assert len(messages) == 1 and "at least two modes" in messages[0]
    assert abs(sampler.other_mode.share - negative_mass) < 0.05
    assert f"{sampler.other_mode.share:.1%}" in messages[0]
    assert float(sampler.mode_search.point[0]) > 0 and mu.mean() > 1.9  # the chain is in the larger


def test_pick_mode_keeps_the_first_of_one_mode():
    """Two searches ending at the same mode (within 3 Laplace sds) are one mode: the first is
    kept, so a posterior with one mode runs as it did from a single search; a search that found
    no mode is passed over."""

    def search(x, value, is_mode=True):
        sd = jnp.ones(1) if is_mode else jnp.full(1, jnp.inf)
        return ModeSearch(jnp.array([x]), is_mode, 0.0, 0.0, 1, value, -value if is_mode else -jnp.inf, sd)

    first, second = search(0.0, 1.0), search(0.5, 0.9)
    assert pick_mode(first, second) == (first, None)
    assert pick_mode(search(9.0, 0.0, is_mode=False), second) == (second, None)
    assert pick_mode(first, search(9.0, 0.0, is_mode=False)) == (first, None)
    mode, other = pick_mode(first, search(10.0, 1.0 + np.log(3.0)))
    assert mode is first and other.share == pytest.approx(0.25) and other.distance == 10.0
