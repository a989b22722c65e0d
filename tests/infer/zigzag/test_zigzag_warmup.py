"""FedZigZag's warmup adapts the sample interval to the posterior's scale, then samples exactly."""

import warnings

import numpy as np
import pytest

import jax

import numpyro
import numpyro.distributions as dist
from numpyro.diagnostics import effective_sample_size
from numpyro.infer import MCMC, NUTS

import numpyro_fed as nf
from numpyro_fed.infer.zigzag.warmup import DEFAULT_INTERVAL, INTERVAL_SDS
from numpyro_fed.metrics import marginal_w1

NOISE_SD = np.array([1.0, 3.0])  # the coordinates' posterior sds differ by 3x
PRIOR_SD = 100.0


def gaussian_mean(y, clients=4):
    mu = numpyro.sample("mu", dist.Normal(0, PRIOR_SD).expand([2]).to_event(1))
    with nf.federated_plate("data", y.shape[0], clients=clients):
        numpyro.sample("y", dist.Normal(mu, NOISE_SD).to_event(1), obs=y)


def _gaussian(n, seed=0):
    """Rows, and the closed-form posterior's mean and sds."""
    y = 0.5 + NOISE_SD * jax.random.normal(jax.random.PRNGKey(seed), (n, 2))
    precision = n / NOISE_SD**2 + PRIOR_SD**-2
    return y, np.asarray(y.sum(0)) / NOISE_SD**2 / precision, 1 / np.sqrt(precision)


def _intervals(mcmc_kernel, *args, num_warmup, num_samples, seed=1, **kwargs):
    """``(warmup intervals, sampling intervals, mcmc)`` of one chain."""
    mcmc = MCMC(mcmc_kernel, num_warmup=num_warmup, num_samples=num_samples, progress_bar=False)
    mcmc.warmup(jax.random.PRNGKey(seed), *args, collect_warmup=True, extra_fields=("adapt.interval",), **kwargs)
    warm = np.asarray(mcmc.get_extra_fields()["adapt.interval"])
    mcmc.run(
        jax.random.PRNGKey(seed + 1),
        *args,
        extra_fields=("adapt.interval", "info.elapsed", "info.num_violations", "info.hit_event_cap"),
        **kwargs,
    )
    return warm, np.asarray(mcmc.get_extra_fields()["adapt.interval"]), mcmc


def test_adapted_interval_follows_the_smallest_posterior_sd():
    # 16x the rows: the posterior sd, hence the adapted interval, shrinks 4x. The estimate is
    # the path's sd over the warmup after its first 1/8: about 350 draws of about one sd each,
    # so about 150 effective draws of x^2 (sd's relative error sqrt(1 / (2 * 150)) ~ 6%);
    # 25% is 4 of those errors.
    found = {}
    for n in (100, 1600):
        y, _, sd = _gaussian(n)
        # the process in x (the default's Laplace preconditioner would make every sd about 1)
        warm, post, _ = _intervals(nf.FedZigZag(gaussian_mean, preconditioner=None), y, num_warmup=400, num_samples=5)
        found[n] = post[0]
        assert abs(post[0] / (INTERVAL_SDS * sd.min()) - 1) < 0.25, (n, post[0], sd)
        assert warm[0] != warm[-1]  # it did adapt
    assert abs(found[100] / found[1600] / 4 - 1) < 0.35
    # by default the process runs in the Laplace approximation's whitened coordinates, where
    # every sd is about 1: the interval is about INTERVAL_SDS whatever the rows
    y, _, sd = _gaussian(1600)
    _, post, _ = _intervals(nf.FedZigZag(gaussian_mean), y, num_warmup=400, num_samples=5)
    assert abs(post[0] / INTERVAL_SDS - 1) < 0.25, post[0]


def test_chain_after_adaptive_warmup_matches_the_closed_form():
    y, mean, sd = _gaussian(200)
    warm, post, mcmc = _intervals(nf.FedZigZag(gaussian_mean), y, num_warmup=300, num_samples=3000)
    assert np.all(post == post[0]), "the interval must be fixed after the warmup"
    draws = np.asarray(mcmc.get_samples()["mu"])
    ess = effective_sample_size(draws[None])
    # 4.5 Monte Carlo standard errors (means) and 4.5 sds of the sd estimate (2 coordinates)
    assert np.all(np.abs(draws.mean(0) - mean) < 4.5 * sd / np.sqrt(ess)), (draws.mean(0) - mean) / sd
    assert np.all(np.abs(draws.std(0) / sd - 1) < 4.5 / np.sqrt(2 * ess))
    fields = mcmc.get_extra_fields()
    assert int(fields["info.num_violations"].sum()) == 0 and not bool(fields["info.hit_event_cap"].any())


def logistic(X, y=None, clients=4):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with nf.federated_plate("data", X.shape[0], clients=clients):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def test_logistic_regression_with_defaults_agrees_with_nuts():
    k_x, k_y = jax.random.split(jax.random.PRNGKey(3))
    X = jax.random.normal(k_x, (2000, 3))
    y = jax.random.bernoulli(k_y, jax.nn.sigmoid(X @ np.array([1.0, -0.5, 0.3]))).astype(X.dtype)
    owner = np.repeat(np.arange(4), [200, 300, 500, 1000])  # unequal clients
    nuts = MCMC(NUTS(logistic), num_warmup=300, num_samples=3000, progress_bar=False)
    nuts.run(jax.random.PRNGKey(0), X, y, clients=owner)
    reference = np.asarray(nuts.get_samples()["w"])
    mcmc = MCMC(nf.FedZigZag(logistic), num_warmup=300, num_samples=3000, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(1), X, y, clients=owner)
    draws = np.asarray(mcmc.get_samples()["w"])
    ess = effective_sample_size(draws[None])
    ref_sd = reference.std(0)
    # W1 between two samples of a near-Gaussian marginal is O(sd / sqrt(ess)); 5x fails on a
    # bias of 0.3 sd (as in tests/test_zigzag.py)
    assert np.all(marginal_w1(draws, reference) < 5 * ref_sd / np.sqrt(ess))
    assert np.all(np.abs(draws.std(0) / ref_sd - 1) < 5 / np.sqrt(2 * ess))


def test_a_given_interval_is_used_as_it_is():
    y, _, _ = _gaussian(100)
    kernel = nf.FedZigZag(gaussian_mean, sample_interval=0.37)
    warm, post, mcmc = _intervals(kernel, y, num_warmup=50, num_samples=20)
    assert kernel.sample_interval == 0.37
    assert np.all(warm == np.float64(0.37)) and np.all(post == np.float64(0.37))
    assert np.allclose(mcmc.get_extra_fields()["info.elapsed"], 0.37)


def test_without_warmup_the_interval_is_the_fixed_default():
    y, _, _ = _gaussian(100)
    mcmc = MCMC(nf.FedZigZag(gaussian_mean), num_warmup=0, num_samples=5, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), y, extra_fields=("adapt.interval", "info.elapsed"))
    assert np.all(np.asarray(mcmc.get_extra_fields()["adapt.interval"]) == DEFAULT_INTERVAL)
    assert np.allclose(mcmc.get_extra_fields()["info.elapsed"], DEFAULT_INTERVAL)


def test_vectorized_chains_adapt_their_own_interval_through_a_federation():
    from numpyro_fed.federation import InProcess

    y, _, sd = _gaussian(400)
    kernel = nf.FedZigZag(gaussian_mean, federation=InProcess(), thinning="clients", preconditioner=None)
    mcmc = MCMC(kernel, num_warmup=200, num_samples=5, num_chains=2, chain_method="vectorized", progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), y, extra_fields=("adapt.interval",))
    intervals = np.asarray(mcmc.get_extra_fields(group_by_chain=True)["adapt.interval"])[:, -1]
    assert intervals[0] != intervals[1]
    # 200 warmup draws: about 100 effective draws of x^2 per chain (sd's error ~7%); 30%
    assert np.all(np.abs(intervals / (INTERVAL_SDS * sd.min()) - 1) < 0.3), intervals / sd.min()


def test_float32_adapts_silently():
    # NumPyro's default float32 (the tests enable float64), every warning an error
    def model(y):
        mu = numpyro.sample("mu", dist.Normal(0, 10))
        with nf.federated_plate("data", y.shape[0], clients=4):
            numpyro.sample("y", dist.Normal(mu, 1), obs=y)

    with jax.enable_x64(False), warnings.catch_warnings():
        warnings.simplefilter("error")
        y = 1.0 + jax.random.normal(jax.random.PRNGKey(0), (2500,))
        mcmc = MCMC(nf.FedZigZag(model, preconditioner=None), num_warmup=300, num_samples=1000, progress_bar=False)
        mcmc.run(jax.random.PRNGKey(1), y, extra_fields=("adapt.interval",))
        mu = np.asarray(mcmc.get_samples()["mu"])
        interval = float(mcmc.get_extra_fields()["adapt.interval"][-1])
    sd = 1 / np.sqrt(2500 + 0.01)
    exact = float(np.asarray(y, np.float64).sum()) / (2500 + 0.01)
    assert mu.dtype == np.float32
    assert abs(interval / (INTERVAL_SDS * sd) - 1) < 0.3
    # 1000 draws three sds apart: ESS above 500, so 4.5 standard errors is 0.2 sd
    assert abs(mu.mean() - exact) < 0.2 * sd
    assert abs(mu.std() / sd - 1) < 4.5 / np.sqrt(2 * 500)


def regression(x, y):
    w = numpyro.sample("w", dist.Normal(0, 100).expand([2]).to_event(1))
    with nf.federated_plate("data", y.shape[0], clients=4):
        numpyro.sample("y", dist.Normal(w[0] + w[1] * x, 1.0), obs=y)


@pytest.mark.long
def test_slowly_mixing_posterior_gets_a_longer_interval_from_the_warmups_autocorrelation():
    # intercept and slope with a raw covariate around 3: posterior correlation -0.95, run in x
    # (no preconditioner), where the process crosses the ridge slowly. Three sds of the
    # smallest coordinate per draw gave 141-177 effective draws of 1000 (two keys); the warmup's
    # autocorrelation lengthens the interval about 2.3x and gives 370-420
    n = 200
    k_x, k_y = jax.random.split(jax.random.PRNGKey(0))
    x = 3.0 + jax.random.normal(k_x, (n,))
    y = 1.0 + 0.5 * x + jax.random.normal(k_y, (n,))
    design = np.stack([np.ones(n), np.asarray(x)], 1)
    cov = np.linalg.inv(design.T @ design + np.eye(2) / 100**2)
    mean, sd = cov @ design.T @ np.asarray(y), np.sqrt(np.diag(cov))
    _, post, mcmc = _intervals(nf.FedZigZag(regression, preconditioner=None), x, y, num_warmup=500, num_samples=1000)
    assert post[0] > 1.5 * INTERVAL_SDS * sd.min()
    draws = np.asarray(mcmc.get_samples()["w"])
    ess = np.asarray(effective_sample_size(draws[None]))
    assert ess.min() >= 250, ess
    assert np.all(np.abs(draws.mean(0) - mean) < 4.5 * sd / np.sqrt(ess))
    assert np.all(np.abs(draws.std(0) / sd - 1) < 4.5 / np.sqrt(2 * ess))


def test_autocorrelation_time_of_ar1_draws():
    # the estimator the interval's floor uses, on AR(1) series (tau = (1 + phi) / (1 - phi)):
    # within 40% of the truth for 0.5 and 0.9 over 2000 draws (about 100 effective draws at
    # 0.9), 1 for independent draws
    from numpyro_fed.infer.zigzag.warmup import accumulate_lags, autocorrelation_time, init_warmup

    rng = np.random.default_rng(0)
    n, d = 2000, 3
    for phi in (0.0, 0.5, 0.9):
        x = np.zeros((n, d))
        x[0] = rng.normal(size=d) / np.sqrt(1 - phi**2)
        for t in range(1, n):
            x[t] = phi * x[t - 1] + rng.normal(size=d)
        adapt = init_warmup(None, False, jax.numpy.zeros(d))
        add = jax.jit(lambda a, xt, t: accumulate_lags(a, xt, t, 0))
        for t in range(n):
            adapt = add(adapt, jax.numpy.asarray(5.0 + x[t]), t)
        tau = np.asarray(autocorrelation_time(adapt))
        assert np.all(np.abs(tau / ((1 + phi) / (1 - phi)) - 1) < 0.4), (phi, tau)
