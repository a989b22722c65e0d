"""The benchmark's ``LocalPosteriorSVGD`` (benchmarks/dsvgd.py, the adult-drift section's
``local_posterior_*`` rows): each scheduled client runs SVGD towards its local posterior
``p_0 exp(-L_k)`` from the downloaded particles, not DSVGD's tilted target."""

import importlib.util
import os
import warnings

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import numpyro
import numpyro.distributions as dist

import numpyro_fed as nf
from numpyro_fed.infer import stein

BENCHMARK = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir, "benchmarks", "dsvgd.py")
PRIOR_SD = 3.0
# client 0 holds the first four rows, client 1 the last four: local posteriors far apart
Y = jnp.array([-2.5, -1.5, -2.0, -2.2, 3.0, 2.5, 3.5, 3.2])
OPTIONS = dict(num_particles=10, num_local_steps=200, num_distill_steps=50, kde_bandwidth=0.55, progress_bar=False)


def model(y):
    mu = numpyro.sample("mu", dist.Normal(0, PRIOR_SD))
    with nf.federated_plate("data", y.shape[0], clients=2):
        numpyro.sample("y", dist.Normal(mu, 1), obs=y)


def local_posterior_mean(rows):
    """The mean of ``N(0, PRIOR_SD^2)`` times client's likelihood of ``rows`` (unit noise)."""
    return float(np.sum(rows)) / (1 / PRIOR_SD**2 + len(rows))


@pytest.fixture(scope="module")
def local_posterior_svgd():
    spec = importlib.util.spec_from_file_location("benchmark_dsvgd", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.LocalPosteriorSVGD


def run(cls, **options):
    method = cls(model, **{**OPTIONS, **options})
    with warnings.catch_warnings():  # the local posterior is not the global one: Stein's checks warn
        warnings.simplefilter("ignore", RuntimeWarning)
        return method, method.run(jax.random.PRNGKey(0), 2, Y)


def test_each_round_runs_svgd_towards_the_clients_local_posterior(local_posterior_svgd):
    method, result = run(local_posterior_svgd)
    _, plain = run(nf.DSVGD)
    assert result.metrics["client"].tolist() == [0, 1]
    particles = np.asarray(result.metrics["particles"])[:, :, 0]
    # round 2 (client 1): svgd_run from the round-1 particles towards p_0 exp(-L_1), with the
    # model's own gradients (the median heuristic makes 200 steps sensitive to rounding)
    gradients, block = method.gradients, method.federated_potential.client_block(1)
    expected = stein.svgd_run(
        jnp.asarray(result.metrics["particles"][0]),
        lambda x: (
            jax.vmap(lambda x_n: -gradients.prior_grad(x_n))(x)
            - jax.vmap(gradients.client_grad, in_axes=(0, None))(x, block)
        ),
        OPTIONS["num_local_steps"],
        stein.adagrad_momentum(0.05),
    )
    np.testing.assert_allclose(particles[1], np.asarray(expected)[:, 0], rtol=1e-9, atol=1e-9)
    # after each round the particles' mean is the scheduled client's local posterior mean
    assert abs(particles[0].mean() - local_posterior_mean(Y[:4])) < 0.05
    assert abs(particles[1].mean() - local_posterior_mean(Y[4:])) < 0.05
    # DSVGD's second round aims at the global posterior instead (mean 0.49): a different result
    assert abs(np.asarray(plain.metrics["particles"])[1, :, 0].mean() - local_posterior_mean(Y[4:])) > 1.0


def test_minibatches_reach_the_local_posterior_too(local_posterior_svgd):
    particles = np.asarray(run(local_posterior_svgd, batch_size=2)[1].metrics["particles"])[:, :, 0]
    assert abs(particles[0].mean() - local_posterior_mean(Y[:4])) < 0.3
    assert abs(particles[1].mean() - local_posterior_mean(Y[4:])) < 0.3
