"""DSVGD's start at the posterior's mode with the larger Laplace mass, where the init strategy's
draws sit at another: a one-parameter posterior whose density is known on a grid."""

import warnings

import numpy as np
import pytest
from scipy import stats

import jax
import jax.numpy as jnp

import numpyro
import numpyro.distributions as dist

import numpyro_fed as nf
from numpyro_fed.infer.stein import methods

PRIOR = (-4.0, 0.5)  # theta ~ Normal(-4, 0.5): the prior's draws sit at the minor mode
WEIGHTS = (0.2, 0.8)  # a row is Normal(theta + 4, 1) with probability 0.2, Normal(theta, 1) otherwise
Y = np.random.default_rng(0).normal(0.0, 1.0, 60)
CLIENTS = np.repeat(np.arange(3), 20)


def model(y):
    theta = numpyro.sample("theta", dist.Normal(*PRIOR))
    with nf.federated_plate("data", y.shape[0], clients=CLIENTS):
        components = dist.Normal(jnp.stack([theta + 4.0, theta]), 1.0)
        numpyro.sample("y", dist.MixtureSameFamily(dist.Categorical(probs=jnp.array(WEIGHTS)), components), obs=y)


def grid_posterior():
    """The posterior's log density on a grid, by scipy: ``(grid, log p)``."""
    grid = np.linspace(-7.0, 3.0, 20001)
    rows = Y[:, None]
    likelihood = WEIGHTS[0] * stats.norm.pdf(rows, grid + 4.0, 1.0) + WEIGHTS[1] * stats.norm.pdf(rows, grid, 1.0)
    return grid, stats.norm.logpdf(grid, *PRIOR) + np.log(likelihood).sum(axis=0)


def moments(grid, log_p, where):
    """Mean and sd of the posterior restricted to ``where``, and the mass it holds there."""
    p = np.exp(log_p - log_p.max())
    mass = p[where].sum() / p.sum()
    q = p * where / (p * where).sum()
    mean = (grid * q).sum()
    return mean, np.sqrt(((grid - mean) ** 2 * q).sum()), mass


def test_the_particles_start_at_the_mode_with_more_mass():
    grid, log_p = grid_posterior()
    _, major_sd, major_mass = moments(grid, log_p, grid > -2.0)
    peaks = grid[1:-1][(log_p[1:-1] > log_p[:-2]) & (log_p[1:-1] > log_p[2:])]  # the local maxima
    assert len(peaks) == 2
    minor_mode, major_mode = peaks
    assert major_mass > 1 - 1e-12  # the minor mode is real (a local maximum) but holds no mass
    method = nf.DSVGD(model, progress_bar=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the other mode holds far less than 1%: no warning
        state = method.init(jax.random.PRNGKey(0), Y)
    x = np.asarray(method.particles(state))[:, 0]
    assert abs(x.mean() - major_mode) < 0.01 * major_sd  # the particles' mean at the mode
    assert 0.3 < x.std() < 0.7  # the prior's draws' spread (sd 0.5), not the posterior's
    other = method.other_mode
    assert other is not None and abs(float(other.point[0]) - minor_mode) < 0.01 and other.share < 1e-6


@pytest.mark.long
def test_dsvgd_agrees_where_its_first_client_alone_would_pick_the_minor_mode(monkeypatch):
    grid, log_p = grid_posterior()
    mean, sd, _ = moments(grid, log_p, np.ones_like(grid, dtype=bool))

    def run():
        method = nf.DSVGD(model, progress_bar=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = method.run(jax.random.PRNGKey(0), 6, Y)
        warned = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        return np.asarray(method.get_samples(None, result)["theta"]), result, warned

    draws, result, warned = run()
    assert not warned
    # 20 particles: 3 standard errors of a mean are 0.67 sd, of an sd a factor 1.5
    assert abs(draws.mean() - mean) < 0.67 * sd and 1 / 1.5 < draws.std() / sd < 1.5
    # the search asked the clients (counted): their Hessians and, at the two ends, their values
    assert np.all(result.ledger["hessian/messages_to_client"] > 0)
    assert np.all(result.ledger["value_and_grad/messages_to_client"] == 2)
    # from the prior's draws as they were (the start before this search), the run ends at the
    # minor mode, 20 posterior sds away (and its Stein check warns)
    monkeypatch.setattr(methods.DSVGD, "_start_particles", lambda self, particles: particles)
    draws, _, warned = run()
    assert abs(draws.mean() - mean) > 10 * sd and warned
