"""DPPVI: reported privacy against dp-accounting, calibration, clipping, noise scale,
virtual clients vs parameter perturbation, argument errors, InferenceData."""

import re
import warnings

import dp_accounting
import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant

import jax
import jax.numpy as jnp
import optax

import numpyro
import numpyro.distributions as dist

import numpyro_fed as nf
from numpyro_fed.infer import pvi
from numpyro_fed.infer.pvi import DPPVI
from numpyro_fed.privacy import calibrate_noise_multiplier, gaussian_event

REPLACE = dp_accounting.NeighboringRelation.REPLACE_ONE
NUM_ROWS, NUM_CLIENTS = 120, 3


def params(result):
    """``q``'s ``loc`` and ``scale`` by site after a run."""
    return result.method.get_params(result.state)


def model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with nf.federated_plate("data", X.shape[0], clients=NUM_CLIENTS):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


@pytest.fixture(scope="module")
def data():
    X = jax.random.normal(jax.random.PRNGKey(0), (NUM_ROWS, 2))
    y = (X @ jnp.array([1.5, -1.0]) + jax.random.logistic(jax.random.PRNGKey(1), (NUM_ROWS,)) > 0) * 1.0
    return X, y


FAST = dict(optim=optax.adam(0.1), num_local_steps=5, num_mc_samples=2, progress_bar=False)


def _direct_epsilon(accountant, event, delta=1e-5):
    accountant.compose(event)
    return accountant.get_epsilon(delta)


@pytest.fixture(scope="module")
def dpsgd_run(data):
    method = DPPVI(model, dp="dpsgd", noise_multiplier=3.0, sampling="poisson", sampling_rate=0.1, **FAST)
    return method, method.run(jax.random.PRNGKey(2), 4, *data)


def test_dpsgd_poisson_epsilon_equals_direct_accounting(dpsgd_run):
    _, result = dpsgd_run
    event = dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(0.1, dp_event.GaussianDpEvent(3.0)), 4 * FAST["num_local_steps"]
    )
    # A 1e-6 share of delta covers the cap on Poisson batch sizes.
    assert result.privacy.epsilon == _direct_epsilon(PLDAccountant(REPLACE), event, delta=1e-5 * (1 - 1e-6))
    assert result.privacy.delta == 1e-5
    assert "PLD" in result.privacy.method


def test_poisson_cap_changes_nothing_when_the_batch_fits(data):
    fp = nf.split_potential(model, data)
    rows = [r[0] for r in fp.client_data["rows"]]
    valid = fp.client_data["valid"]["data"][0]
    d = fp.num_latent
    start = pvi.gaussian.natural(jnp.zeros(d), jnp.ones(d))
    config = pvi.client.LocalConfig(
        optim=optax.adam(0.1),
        num_steps=3,
        num_mc_samples=2,
        sampling="poisson",
        sampling_rate=0.1,
        dpsgd=True,
        clip_norm=1.0,
    )
    row_log_lik = lambda t, r: fp.row_log_likelihood_fn(fp.unravel(t), r)
    full, _ = pvi.client.optimize_local(
        jax.random.PRNGKey(0), row_log_lik, start, start, rows, valid, config, noise_multiplier=1.0
    )
    capped, _ = pvi.client.optimize_local(
        jax.random.PRNGKey(0), row_log_lik, start, start, rows, valid, config, noise_multiplier=1.0, batch_cap=20
    )
    np.testing.assert_allclose(capped.eta1, full.eta1, rtol=1e-10)
    # The cap the class picks keeps the overflow probability within its share of delta.
    from scipy.stats import binom

    method = DPPVI(model, dp="dpsgd", noise_multiplier=1.0, sampling="poisson", sampling_rate=0.05, **FAST)
    guarantee = method.privacy(np.ones(2), 10, np.array([3900, 3000]))
    cap = method.batch_cap(guarantee, 10, np.array([3900, 3000]), 3900)
    epsilon = guarantee.epsilon
    assert 195 < cap < 1000
    assert 50 * binom.sf(cap, 3900, 0.05) * (1 + np.exp(epsilon)) <= 1e-6 * 1e-5


SIZES = np.array([40, 40, 30])


def test_dpsgd_without_replacement_epsilon_equals_direct_accounting():
    method = DPPVI(model, dp="dpsgd", noise_multiplier=3.0, sampling="without_replacement", sampling_rate=0.1, **FAST)
    guarantee = method.privacy(np.full(3, 3.0), 2, SIZES)
    # dp-accounting's RDP noise is relative to the substitution sensitivity 2C; the run's
    # epsilon is the largest client's: the one with the largest sampling fraction.
    epsilons = [
        _direct_epsilon(
            RdpAccountant(neighboring_relation=REPLACE),
            dp_event.SelfComposedDpEvent(
                dp_event.SampledWithoutReplacementDpEvent(int(n), round(0.1 * n), dp_event.GaussianDpEvent(1.5)),
                2 * FAST["num_local_steps"],
            ),
        )
        for n in SIZES
    ]
    assert guarantee.epsilon == max(epsilons)
    assert "RDP" in guarantee.method


@pytest.mark.parametrize("dp", ["local_avg", "virtual"])
def test_update_perturbation_epsilon_equals_direct_accounting(dp):
    method = DPPVI(model, dp=dp, noise_multiplier=4.0, num_shards=2, clip_norm=5.0, **FAST)
    guarantee = method.privacy(np.full(3, 4.0), 3, SIZES)
    event = dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(4.0), 3)
    assert guarantee.epsilon == _direct_epsilon(PLDAccountant(REPLACE), event)


def test_calibrated_run_spends_at_most_the_target(data):
    method = DPPVI(model, target_epsilon=1.0, delta=1e-5, dp="dpsgd", sampling="poisson", sampling_rate=0.2, **FAST)
    result = method.run(jax.random.PRNGKey(3), 2, *data)
    assert 0.99 <= result.privacy.epsilon <= 1.0
    assert np.all(result.metrics["noise_multiplier"][-1] > 0)


def test_calibration_of_update_perturbation():
    method = DPPVI(
        model,
        target_epsilon=0.5,
        delta=1e-6,
        dp="virtual",
        num_shards=2,
        schedule="synchronous",
        trusted_aggregator=True,
        **FAST,
    )
    sigmas = method.noise_multipliers(7, SIZES)
    assert 0.495 <= method.privacy(sigmas, 7, SIZES).epsilon <= 0.5
    assert method.privacy(sigmas * 0.99, 7, SIZES).epsilon > 0.5


RUN_SIZES = np.full(NUM_CLIENTS, NUM_ROWS // NUM_CLIENTS)  # the client sizes of `data`


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(dp="dpsgd", noise_multiplier=3.0, sampling="poisson", sampling_rate=0.1),
        dict(dp="dpsgd", noise_multiplier=8.0, sampling="without_replacement", sampling_rate=0.1),
        dict(dp="virtual", noise_multiplier=16.0, num_shards=2, schedule="synchronous", trusted_aggregator=True),
    ],
)
def test_calibrated_number_of_rounds_spends_at_most_the_target(data, kwargs):
    """Given sigma and a target epsilon, num_rounds=None runs the most rounds that fit: the
    reported epsilon is at most the target, and one more round would exceed it."""
    method = DPPVI(model, target_epsilon=1.0, delta=1e-5, **dict(FAST, **kwargs))
    result = method.run(jax.random.PRNGKey(4), None, *data)
    rounds = result.metrics["loc"].shape[0]
    assert rounds == method.max_rounds(RUN_SIZES) >= 2
    assert result.privacy.epsilon <= 1.0
    sigmas = np.full(NUM_CLIENTS, kwargs["noise_multiplier"])
    assert method.privacy(sigmas, rounds + 1, RUN_SIZES).epsilon > 1.0
    # close to the target: within one round's share of the budget
    assert result.privacy.epsilon >= 1.0 * (rounds - 1) / rounds
    # the guarantee of the run is the independent accounting of that many rounds
    assert result.privacy.epsilon == method.privacy(sigmas, rounds, RUN_SIZES).epsilon


def test_fixed_noise_and_budget_refuses_too_many_rounds(data):
    method = DPPVI(model, dp="virtual", noise_multiplier=16.0, target_epsilon=1.0, **FAST)
    too_many = method.max_rounds(RUN_SIZES) + 1
    with pytest.raises(ValueError, match="spend"):
        method.run(jax.random.PRNGKey(0), too_many, *data)
    with pytest.raises(ValueError, match="already spends more"):
        DPPVI(model, dp="virtual", noise_multiplier=2.0, target_epsilon=1.0, **FAST).max_rounds(RUN_SIZES)
    with pytest.raises(ValueError, match="num_rounds=None"):
        DPPVI(model, dp="virtual", target_epsilon=1.0, **FAST).run(jax.random.PRNGKey(0), None, *data)


def test_dpsgd_noise_has_the_stated_scale():
    # With no data and q equal to the cavity, one SGD step of size 1 moves the
    # parameters by exactly the noise: sigma * C / rate per coordinate.
    d, sigma, clip, rate = 3, 2.0, 0.7, 0.25
    start = pvi.gaussian.natural(jnp.zeros(d), jnp.ones(d))
    rows = [jnp.zeros((4, 1))]
    config = pvi.client.LocalConfig(
        optim=optax.sgd(1.0),
        num_steps=1,
        num_mc_samples=1,
        sampling="poisson",
        sampling_rate=rate,
        dpsgd=True,
        clip_norm=clip,
    )

    def moved(key):
        new, _ = pvi.client.optimize_local(
            key,
            lambda t, r: jnp.zeros(r[0].shape[0]),
            start,
            start,
            rows,
            jnp.zeros(4, bool),
            config,
            noise_multiplier=sigma,
        )
        loc, scale = pvi.gaussian.loc_scale(new)
        return jnp.concatenate([loc, jnp.log(scale)])

    steps = jax.vmap(moved)(jax.random.split(jax.random.PRNGKey(4), 4000))
    np.testing.assert_allclose(jnp.mean(steps, 0), 0.0, atol=4 * sigma * clip / rate / np.sqrt(4000))
    np.testing.assert_allclose(jnp.std(steps, 0), sigma * clip / rate, rtol=0.05)


@pytest.mark.parametrize("dp, trusted", [("local_avg", False), ("virtual", False), ("virtual", True)])
def test_update_noise_has_the_stated_scale(dp, trusted):
    d, sigma, clip, shards, clients = 2, 3.0, 0.5, 4, 9
    q = pvi.gaussian.natural(jnp.zeros(d), jnp.ones(d))
    zero = pvi.GaussianNatural(jnp.zeros(d), jnp.zeros(d))
    virtual = pvi.GaussianNatural(jnp.zeros((shards, d)), jnp.zeros((shards, d)))
    rows = [jnp.zeros((8, 1))]
    index = jnp.arange(8).reshape(shards, 2)
    config = pvi.client.LocalConfig(
        optim=optax.sgd(0.1),
        num_steps=2,
        num_mc_samples=1,
        sampling="full",
        sampling_rate=1.0,
        dpsgd=False,
        clip_norm=clip,
    )
    divisor = np.sqrt(clients) if trusted else 1.0

    def delta(key):
        out, _, _ = pvi.client.client_update(
            key,
            lambda t, r: jnp.zeros(r[0].shape[0]),
            q,
            zero,
            virtual,
            rows,
            jnp.zeros(8, bool),
            index,
            jnp.zeros((shards, 2), bool),
            config,
            dp=dp,
            noise_multiplier=sigma,
            noise_divisor=divisor,
        )
        return jnp.concatenate([out.eta1, out.eta2])

    deltas = jax.vmap(delta)(jax.random.split(jax.random.PRNGKey(5), 4000))
    expected = sigma * clip / divisor / (shards if dp == "local_avg" else 1)
    np.testing.assert_allclose(jnp.std(deltas, 0), expected, rtol=0.05)


@pytest.mark.parametrize("dp", ["local_avg", "virtual"])
def test_clipped_updates_have_norm_at_most_C(data, dp):
    fp = nf.split_potential(model, data)
    rows = [r[0] for r in fp.client_data["rows"]]
    valid = fp.client_data["valid"]["data"][0]
    shards = 4
    index, shard_valid = pvi.core.shard_layout([int(valid.sum())], shards, seed=0)
    d = fp.num_latent
    q = pvi.gaussian.natural(jnp.zeros(d), jnp.ones(d))
    zero = pvi.GaussianNatural(jnp.zeros(d), jnp.zeros(d))
    virtual = pvi.GaussianNatural(jnp.zeros((shards, d)), jnp.zeros((shards, d)))
    clip = 0.3  # far below the unclipped changes (several units): clipping is active
    config = pvi.client.LocalConfig(
        optim=optax.adam(0.1),
        num_steps=20,
        num_mc_samples=2,
        sampling="full",
        sampling_rate=1.0,
        dpsgd=False,
        clip_norm=clip,
    )
    delta, virtual_delta, clipped = pvi.client.client_update(
        jax.random.PRNGKey(6),
        lambda t, r: fp.row_log_likelihood_fn(fp.unravel(t), r),
        q,
        zero,
        virtual,
        rows,
        valid,
        index[0],
        shard_valid[0],
        config,
        dp=dp,
        noise_multiplier=0.0,
    )
    assert clipped == 1.0
    delta = jnp.concatenate([delta.eta1, delta.eta2])
    if dp == "local_avg":
        assert jnp.linalg.norm(delta) <= clip * (1 + 1e-12)
    else:
        per_shard = jnp.concatenate([virtual_delta.eta1, virtual_delta.eta2], axis=1)
        assert jnp.all(jnp.linalg.norm(per_shard, axis=1) <= clip * (1 + 1e-12))
        np.testing.assert_allclose(per_shard.sum(0), delta, rtol=1e-12)


def test_dpsgd_clipped_gradients_have_norm_at_most_C(data):
    fp = nf.split_potential(model, data)
    rows = [r[0] for r in fp.client_data["rows"]]
    d = fp.num_latent
    params = pvi.client.LocalParams(jnp.full(d, 3.0), jnp.zeros(d))
    eps = jax.random.normal(jax.random.PRNGKey(7), (3, d))
    grads = pvi.client.per_example_grads(lambda t, r: fp.row_log_likelihood_fn(fp.unravel(t), r), params, eps, rows)
    clipped, was_clipped = pvi.client.clip_by_norm(grads, 0.1)
    assert jnp.any(was_clipped) and jnp.all(jnp.linalg.norm(clipped, axis=1) <= 0.1 * (1 + 1e-12))


def test_virtual_with_one_shard_is_parameter_perturbation(data):
    # One shard per client: virtual clients and local averaging both reduce to naive
    # parameter perturbation (clip the change of q, add noise), with the same randomness.
    runs = {}
    for dp in ("virtual", "local_avg"):
        method = DPPVI(model, dp=dp, noise_multiplier=0.5, num_shards=1, clip_norm=2.0, damping=0.5, **FAST)
        runs[dp] = method.run(jax.random.PRNGKey(8), 2, *data)
    np.testing.assert_allclose(runs["virtual"].state.q.eta1, runs["local_avg"].state.q.eta1, rtol=1e-12)
    np.testing.assert_allclose(runs["virtual"].state.q.eta2, runs["local_avg"].state.q.eta2, rtol=1e-12)
    # ... and it is perturbed: non-private PVI with the same settings lands elsewhere.
    plain = DPPVI(model, damping=0.5, **FAST).run(jax.random.PRNGKey(8), 2, *data)
    assert not np.allclose(plain.state.q.eta1, runs["virtual"].state.q.eta1, rtol=1e-3)
    # The virtual factors, which each client keeps, still sum to its factor as the server
    # knows it from the changes it sent.
    state = runs["virtual"].state
    virtual = pvi.client_factors(state)
    assert virtual.eta1.shape == (state.factors.eta1.shape[0], 1, state.factors.eta1.shape[1])
    np.testing.assert_allclose(virtual.eta1.sum(1), state.factors.eta1, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(virtual.eta2.sum(1), state.factors.eta2, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("noise_multiplier", [0.0, 0.7])
def test_one_virtual_client_equals_naive_parameter_perturbation_by_hand(data, noise_multiplier):
    """A virtual-client update with one shard against naive parameter perturbation written
    out: optimise the local ELBO on all the client's rows against the cavity, clip the change
    of the natural parameters to C, add N(0, (sigma C)^2)."""
    fp = nf.split_potential(model, data)
    rows = [r[1] for r in fp.client_data["rows"]]
    valid = fp.client_data["valid"]["data"][1]
    d = fp.num_latent
    row_log_lik = lambda t, r: fp.row_log_likelihood_fn(fp.unravel(t), r)
    q = pvi.gaussian.natural(jnp.array([0.3, -0.2]), jnp.array([0.8, 0.9]))
    factor = pvi.GaussianNatural(jnp.array([0.1, 0.2]), jnp.array([-0.05, -0.1]))
    index, shard_valid = pvi.core.shard_layout([int(valid.sum())], 1, seed=0)
    clip = 0.4
    config = pvi.client.LocalConfig(
        optim=optax.adam(0.1),
        num_steps=20,
        num_mc_samples=2,
        sampling="full",
        sampling_rate=1.0,
        dpsgd=False,
        clip_norm=clip,
    )
    key = jax.random.PRNGKey(11)
    delta, _, _ = pvi.client.client_update(
        key,
        row_log_lik,
        q,
        factor,
        jax.tree_util.tree_map(lambda x: x[None], factor),
        rows,
        valid,
        index[0],
        shard_valid[0],
        config,
        dp="virtual",
        noise_multiplier=noise_multiplier,
    )
    # by hand
    key_opt, key_noise = jax.random.split(key)
    cavity = pvi.GaussianNatural(q.eta1 - factor.eta1, q.eta2 - factor.eta2)
    new_q, _ = pvi.client.optimize_local(jax.random.split(key_opt, 1)[0], row_log_lik, q, cavity, rows, valid, config)
    change = jnp.concatenate([new_q.eta1 - q.eta1, new_q.eta2 - q.eta2])
    assert jnp.linalg.norm(change) > clip  # clipping is active
    change = change * clip / jnp.linalg.norm(change)
    change = change + noise_multiplier * clip * jax.random.normal(key_noise, (2 * d,))
    np.testing.assert_allclose(jnp.concatenate([delta.eta1, delta.eta2]), change, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dp="dpsgd", target_epsilon=0.0), "target_epsilon"),
        (dict(dp="dpsgd", target_epsilon=-1.0), "target_epsilon"),
        (dict(dp="dpsgd", target_epsilon=1.0, delta=0.0), "delta"),
        (dict(dp="dpsgd", target_epsilon=1.0, delta=1.0), "delta"),
        (dict(dp="dpsgd", target_epsilon=1.0, clip_norm=0.0), "clip_norm"),
        (dict(dp="dpsgd", target_epsilon=1.0, clip_norm=-2.0), "clip_norm"),
        (dict(dp="dpsgd", target_epsilon=1.0, sampling="poisson", sampling_rate=0.0), "sampling_rate"),
        (dict(dp="dpsgd", target_epsilon=1.0, sampling="poisson", sampling_rate=1.5), "sampling_rate"),
        (dict(dp="dpsgd", target_epsilon=1.0, sampling="poisson"), "sampling_rate"),
        (dict(dp="dpsgd", noise_multiplier=-1.0), "noise_multiplier"),
        (dict(dp="dpsgd"), "noise_multiplier, target_epsilon or both"),
        (dict(dp="dpsgd", target_epsilon=1.0, noise_multiplier=0.0), "no privacy"),
        (dict(dp="virtual", target_epsilon=1.0, trusted_aggregator=True), "synchronous"),
        (dict(dp="dpsgd", target_epsilon=1.0, schedule="synchronous", trusted_aggregator=True), "trusted_aggregator"),
        (dict(dp="gaussian"), "dp must be"),
        (dict(damping=0.0), "damping"),
        (dict(damping=1.5), "damping"),
        (dict(schedule="random"), "schedule"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DPPVI(model, **kwargs)


def test_too_many_shards(data):
    with pytest.raises(ValueError, match="num_shards"):
        DPPVI(model, dp="virtual", noise_multiplier=1.0, num_shards=1000, **FAST).run(jax.random.PRNGKey(0), 1, *data)


def test_samples_and_inference_data(dpsgd_run):
    method, result = dpsgd_run
    draws = method.get_samples(jax.random.PRNGKey(10), result, 4000)
    assert draws["w"].shape == (4000, 2)
    np.testing.assert_allclose(
        draws["w"].mean(0), params(result)["loc"]["w"], atol=5 * params(result)["scale"]["w"].max() / 60
    )
    np.testing.assert_allclose(draws["w"].std(0), params(result)["scale"]["w"], rtol=0.05)
    idata = nf.to_inference_data(result, num_samples=50, rng_key=jax.random.PRNGKey(0))
    assert idata.posterior["w"].shape[:2] == (1, 50)
    assert idata.attrs["privacy_epsilon"] == result.privacy.epsilon
    assert idata.attrs["algorithm"] == "DPPVI" and idata.attrs["num_clients"] == NUM_CLIENTS
    assert idata.sample_stats["clipped"].dims == ("round", "client")


@pytest.mark.parametrize("prior", ["same", "split"])
def test_bcm_is_exact_on_a_conjugate_model(prior):
    from numpyro_fed.infer.pvi import BCM

    def gaussian(y):
        mu = numpyro.sample("mu", dist.Normal(0.5, 2.0))
        with nf.federated_plate("data", y.shape[0], clients=3):
            numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    y = jnp.linspace(-1.0, 3.0, 12)
    precision = 1 / 4 + 12
    mean = (0.5 / 4 + y.sum()) / precision
    bcm = BCM(
        gaussian,
        prior=prior,
        dp=None,
        optim=optax.adam(optax.exponential_decay(5e-2, 400, 0.05)),
        num_local_steps=400,
        num_mc_samples=64,
        progress_bar=False,
    )
    result = bcm.run(jax.random.PRNGKey(0), 1, y)
    assert abs(params(result)["loc"]["mu"] - mean) < 0.05 * precision**-0.5
    np.testing.assert_allclose(params(result)["scale"]["mu"], precision**-0.5, rtol=0.03)


def test_global_vi_accounts_the_pooled_rows(data):
    from numpyro_fed.infer.pvi import GlobalVI

    method = GlobalVI(model, noise_multiplier=2.0, sampling="without_replacement", sampling_rate=0.05, **FAST)
    result = method.run(jax.random.PRNGKey(1), 1, *data)
    event = dp_event.SelfComposedDpEvent(
        dp_event.SampledWithoutReplacementDpEvent(NUM_ROWS, 6, dp_event.GaussianDpEvent(1.0)),
        FAST["num_local_steps"],
    )
    assert result.privacy.epsilon == _direct_epsilon(RdpAccountant(neighboring_relation=REPLACE), event)
    assert result.metrics["communications"].tolist() == [NUM_CLIENTS * FAST["num_local_steps"]]


def test_zero_noise_clips_without_privacy(data):
    method = DPPVI(model, dp="local_avg", noise_multiplier=0.0, num_shards=2, clip_norm=0.5, **FAST)
    result = method.run(jax.random.PRNGKey(11), 1, *data)
    assert result.privacy is None
    assert np.all(result.metrics["clipped"] > 0)


# -- defaults: non-private convergence (issue 12, item 6) ------------------------------------------

REG_N, REG_D, REG_M, REG_NOISE = 400, 3, 4, 1.0


def _regression(n, d, clients, noise, coef):
    """A linear regression with known noise and a N(0, 1) prior: the posterior is Gaussian,
    ``precision = I + X'X / noise^2``; mean-field VI's optimum has the exact mean and sds
    ``diag(precision)^(-1/2)``."""
    X = jax.random.normal(jax.random.PRNGKey(0), (n, d))
    y = X @ jnp.asarray(coef) + noise * jax.random.normal(jax.random.PRNGKey(1), (n,))

    def model(X, y=None):
        w = numpyro.sample("w", dist.Normal(0, 1).expand([d]).to_event(1))
        with nf.federated_plate("data", X.shape[0], clients=clients):
            numpyro.sample("y", dist.Normal(X @ w, noise), obs=y)

    Xn, yn = np.asarray(X, float), np.asarray(y, float)
    precision = np.eye(d) + Xn.T @ Xn / noise**2
    mean = np.linalg.solve(precision, Xn.T @ yn / noise**2)
    return model, X, y, mean, 1 / np.sqrt(np.diag(precision))


def test_defaults_reach_the_exact_posterior_of_a_conjugate_regression():
    """Non-private DPPVI with every default ends at the exact posterior up to Monte Carlo
    error. Over 10 seeds the defaults' errors were unbiased with a per-coordinate sd of
    0.022-0.027 posterior sds for the means and 0.014-0.043 for the log sds: the bounds are
    about 3 of those sds. The former default (a constant Adam rate of 0.01 on (loc,
    log_scale), last iterate) ended 0.1-0.4 posterior sds off."""
    model, X, y, mean, _ = _regression(REG_N, REG_D, REG_M, REG_NOISE, [1.0, -2.0, 0.5])
    Xn = np.asarray(X, float)
    # the default q is full-rank (d = 3): the exact marginal sds
    sd = np.sqrt(np.diag(np.linalg.inv(np.eye(REG_D) + Xn.T @ Xn / REG_NOISE**2)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a converged default run does not warn
        result = DPPVI(model, progress_bar=False).run(jax.random.PRNGKey(1), 5, X, y)
    loc, scale = np.asarray(params(result)["loc"]["w"]), np.asarray(params(result)["scale"]["w"])
    assert np.max(np.abs(loc - mean) / sd) < 0.08
    assert np.max(np.abs(np.log(scale / sd))) < 0.12
    assert np.all(result.metrics["residual"][-1] < 0.1)


def test_a_local_optimisation_that_stops_short_warns():
    model, X, y, _, _ = _regression(REG_N, REG_D, REG_M, REG_NOISE, [1.0, -2.0, 0.5])
    with pytest.warns(RuntimeWarning, match="not converged.*num_local_steps"):
        # the user's optimizer: the default one starts from Newton's answer, exact on this
        # conjugate model
        result = DPPVI(model, num_local_steps=20, covariance="diagonal", optim=optax.adam(0.1), progress_bar=False).run(
            jax.random.PRNGKey(1), 1, X, y
        )
    assert result.metrics["residual"][-1].max() > 1.0


def test_default_optimiser_is_invariant_to_the_units():
    """Rescaling the data and the prior by 1000 rescales the answer by 1000: the default
    optimiser's steps are in units of q's scale."""
    model, X, y, mean, sd = _regression(200, 2, 2, 1.0, [1.0, -1.0])
    fit = DPPVI(model, progress_bar=False).run(jax.random.PRNGKey(3), 3, X, y)

    def scaled(X, y=None):
        w = numpyro.sample("w", dist.Normal(0, 1000.0).expand([2]).to_event(1))
        with nf.federated_plate("data", X.shape[0], clients=2):
            numpyro.sample("y", dist.Normal(X @ w / 1000.0, 1.0), obs=y)

    big = DPPVI(scaled, progress_bar=False).run(jax.random.PRNGKey(3), 3, X, y)
    # equal up to round-off, which Adam's normalised steps carry along (a units error is O(1)):
    # the local fit's gradients near the variational Newton start are round-off sized
    np.testing.assert_allclose(
        params(big)["loc"]["w"] / 1000.0, params(fit)["loc"]["w"], rtol=1e-4, atol=1e-4 * sd.max()
    )
    np.testing.assert_allclose(params(big)["scale"]["w"] / 1000.0, params(fit)["scale"]["w"], rtol=1e-4)


# -- defaults: DP-SGD given only a budget (issue 12, item 5) ----------------------------------------


def _logistic(n, clients):
    X = jax.random.normal(jax.random.PRNGKey(0), (n, 3))
    y = (jax.random.uniform(jax.random.PRNGKey(1), (n,)) < jax.nn.sigmoid(X @ jnp.array([1.0, -1.0, 0.5]))) * 1.0

    def model(X, y=None):
        w = numpyro.sample("w", dist.Normal(0, 1).expand([3]).to_event(1))
        with nf.federated_plate("data", X.shape[0], clients=clients):
            numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    return model, X, y


def test_budget_only_dpsgd_refuses_when_the_noise_would_dominate():
    """Logistic regression, 4 clients of 250 rows, (1, 1e-5)-DP: the former default (full
    batches, sigma = 105) ran and answered several posterior sds off and 3-6 times too wide.
    Now the automatic settings predict the noise's error and refuse with advice."""
    model, X, y = _logistic(1000, 4)
    method = DPPVI(model, dp="dpsgd", target_epsilon=1.0, delta=1e-5, progress_bar=False)
    with pytest.raises(ValueError, match="mostly noise.*Raise target_epsilon.*more rows"):
        method.run(jax.random.PRNGKey(0), 2, X, y)


def test_user_settings_warn_when_the_noise_would_dominate(data):
    method = DPPVI(model, dp="dpsgd", target_epsilon=1.0, sampling="full", clip_norm=1.0, **FAST)
    with pytest.warns(RuntimeWarning, match="mostly noise"):
        result = method.run(jax.random.PRNGKey(0), 2, *data)
    assert result.metrics["predicted_dp_error"][-1] > 1.0


def test_automatic_dpsgd_settings_follow_the_rule():
    """The rule of the docstring, from sizes and budget only."""
    method = DPPVI(model, dp="dpsgd", target_epsilon=4.0, delta=1e-5, progress_bar=False)
    sizes = np.array([40000, 40000])
    sigmas = method.noise_multipliers(2, sizes)
    single = calibrate_noise_multiplier(lambda s: gaussian_event(s, 1), 4.0, 1e-5 * (1 - 1e-6))
    # rate: 1,024 rows per step, raised so that sigma is about 2 or more
    assert method.sampling == "poisson"
    np.testing.assert_allclose(method.sampling_rate, max(1024 / 40000, 2.0 / (single * np.sqrt(200))))
    assert 1.8 < sigmas[0] < 2.5
    # clip norms: 8 sqrt(d / rows seen); the first sequential round sees the clients in turn
    clips = method.auto_clip_norms(2, sizes, 3)
    np.testing.assert_allclose(clips, 8 * np.sqrt(3 / np.array([[40000, 80000], [80000, 80000]])))


@pytest.mark.slow
def test_budget_only_dpsgd_is_useful_where_the_data_allow():
    """Linear regression, 2 clients of 40,000 rows, (4, 1e-5)-DP, only the budget given:
    the automatic settings answer within a posterior sd of the exact mean with sds within
    a factor 1.5, and the reported guarantee is the accountant's for the chosen settings.
    Measured with the former rule (64-row batches, damping 1) over 4 seeds in float64: largest
    errors 0.20-0.59 sd, sd ratios 0.87-1.13 (float32: 0.07-1.15). The former default (full
    batches) calibrated sigma = 31 and its means were more than 1 posterior sd off."""
    model, X, y, mean, sd = _regression(80000, 2, 2, 1.0, [0.5, -1.0])
    method = DPPVI(model, dp="dpsgd", target_epsilon=4.0, delta=1e-5, progress_bar=False)
    with pytest.warns(RuntimeWarning, match="approximate"):  # predicted 0.82, mostly the minibatches
        result = method.run(jax.random.PRNGKey(0), 2, X, y)
    loc, scale = np.asarray(params(result)["loc"]["w"]), np.asarray(params(result)["scale"]["w"])
    assert np.all(np.abs(loc - mean) / sd < 1.0)
    assert np.all((scale / sd > 1 / 1.5) & (scale / sd < 1.5))
    assert result.metrics["predicted_dp_error"][-1] < 1.0
    event = dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(
            method.sampling_rate, dp_event.GaussianDpEvent(result.metrics["noise_multiplier"][-1][0])
        ),
        2 * method.num_local_steps,
    )
    direct = _direct_epsilon(PLDAccountant(REPLACE), event, delta=1e-5 * (1 - 1e-6))
    assert result.privacy.epsilon == direct <= 4.0


def test_a_negligible_noise_multiplier_is_refused_before_accounting():
    """A noise multiplier of 1e-3 once made the PLD accountant try to allocate tens of GiB:
    it is refused at construction, naming the argument and the smallest accepted value."""
    with pytest.raises(ValueError, match=r"noise_multiplier=0.001 .*noise_multiplier >= 0.3"):
        DPPVI(model, dp="dpsgd", noise_multiplier=1e-3)


def _correlated_regression():
    """d = 20, condition number 1e3, 40 rows: ``(model, X, y, mean, sd)`` with the exact
    posterior's mean and marginal sds."""
    rng = np.random.default_rng(20)
    d, n = 20, 40
    q, _ = np.linalg.qr(rng.normal(size=(d, d)))
    precision = q @ np.diag(np.logspace(0, 3, d)) @ q.T
    chol = np.linalg.cholesky(precision - np.eye(d) / 100.0)
    h, _ = np.linalg.qr(rng.normal(size=(n, d)))
    X = h @ chol.T
    y = X @ rng.normal(size=d) + rng.normal(size=n)

    def correlated(X, y):
        w = numpyro.sample("w", dist.Normal(0.0, 10.0).expand([X.shape[1]]).to_event(1))
        with nf.federated_plate("data", X.shape[0], clients=4):
            numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)

    post_precision = np.eye(d) / 100.0 + X.T @ X
    mean = np.linalg.solve(post_precision, X.T @ y)
    return correlated, jnp.asarray(X), jnp.asarray(y), mean, np.sqrt(np.diag(np.linalg.inv(post_precision)))


def test_a_mean_field_run_still_moving_between_rounds_warns():
    """With a mean-field q, a strongly correlated posterior is reached like coordinate
    ascent: after 10 rounds q's means were still 2.7 posterior sds from the mean-field
    optimum while every local fit had converged. The run says so (metrics['last_move'], q's
    move per round over the last 3 rounds, in its own scales), and that its sds are too
    small for the correlations (the clients' curvature at q's draws)."""
    model, X, y, _, _ = _correlated_regression()
    with pytest.warns(RuntimeWarning) as record:
        result = DPPVI(model, covariance="diagonal", progress_bar=False).run(jax.random.PRNGKey(0), 10, X, y)
    messages = " ".join(str(w.message) for w in record)
    assert re.search(r"not converged over the rounds.*run more rounds", messages)
    assert re.search(r"mean-field \(covariance='diagonal'\).*correlated.*use covariance='full'", messages)
    assert result.metrics["last_move"].max() > 0.1
    assert np.all(result.ledger["curvature/rounds"] == 1)  # a diagnostic through the seam, counted


def test_full_rank_default_reaches_a_correlated_posterior():
    """The default q (full-rank for d <= 100 without privacy) on the same posterior: the exact
    means and marginal sds (a Gaussian posterior is in the family) within Monte Carlo error,
    no warning."""
    model, X, y, mean, sd = _correlated_regression()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = DPPVI(model, progress_bar=False).run(jax.random.PRNGKey(0), 6, X, y)
    loc, scale = np.asarray(params(result)["loc"]["w"]), np.asarray(params(result)["scale"]["w"])
    assert np.max(np.abs(loc - mean) / sd) < 0.1
    assert np.max(np.abs(np.log(scale / sd))) < 0.1


def test_update_perturbation_warns_when_its_noise_or_clipping_dominates():
    """dp="local_avg" with only a budget and one shard (the paper's parameters, K = 1): on a
    logistic regression of 3 clients of 3,000 rows at (4, 1e-5)-DP, the noise of each
    client's update (sigma * C = 6.8 per natural parameter) is many times the posterior's
    precision-scaled width, and every change is clipped: the means ended hundreds of
    posterior sds off with no warning before. Now the run reports the noise's expected error
    per round (from q's scale) and warns about the noise and the clipping."""
    model_, X, y = _logistic(9000, 3)
    method = DPPVI(model_, dp="local_avg", target_epsilon=4.0, num_local_steps=20, progress_bar=False)
    with pytest.warns(RuntimeWarning) as record:
        result = method.run(jax.random.PRNGKey(0), 3, X, y)
    messages = " | ".join(str(w.message) for w in record)
    assert "mostly noise" in messages and "raise num_shards" in messages.lower()
    assert "were clipped" in messages
    error = np.asarray(result.metrics["predicted_dp_error"])
    assert np.all(np.isfinite(error)) and error[-1] > 1.0
    # the warning is right: q's means are more than a posterior sd of the non-private answer away
    with warnings.catch_warnings():  # a reference within a fraction of a sd suffices here
        warnings.simplefilter("ignore", RuntimeWarning)
        exact = DPPVI(model_, progress_bar=False).run(jax.random.PRNGKey(0), 3, X, y)
    loc, scale = np.asarray(exact.metrics["loc"][-1]), np.asarray(exact.metrics["scale"][-1])
    assert np.max(np.abs(np.asarray(result.metrics["loc"][-1]) - loc) / scale) > 1.0


def test_mean_field_fits_start_from_newton_on_a_raw_covariate():
    """A mean-field ``q`` on a regression with a raw covariate (mean 40, sd 10; ``Normal(0,
    10)`` priors, so ``q`` starts 4000 times wider than the slope's posterior): the default
    local fit starts from variational Newton steps, so no update is refused and after the
    first round ``q``'s sds are the mean-field optimum's, ``1 / sqrt(diag P)`` with ``P`` the
    posterior precision (closed form: the noise sd is known), within 10 % (measured over keys
    0-2: 0.95-1.03 of it, the local fits' Monte Carlo error). The means of a mean-field ``q``
    converge over many rounds on this correlated posterior (correlation -0.97), and the run
    says so and that the sds are too small. A first-order fit from the prior stopped short on
    every client (the slope's scale must shrink by a factor of 4000 in 100 Adam steps of at
    most 0.1) and every update was refused."""
    rng = np.random.default_rng(0)
    x = rng.normal(40.0, 10.0, 400)
    y = 3.0 + 0.5 * x + rng.normal(0.0, 2.0, 400)

    def model(x, y):
        a = numpyro.sample("a", dist.Normal(0.0, 10.0))
        b = numpyro.sample("b", dist.Normal(0.0, 10.0))
        with nf.federated_plate("data", y.shape[0], clients=4):
            numpyro.sample("y", dist.Normal(a + b * x, 2.0), obs=y)

    design = np.stack([np.ones_like(x), x], axis=1)
    precision = np.eye(2) / 100.0 + design.T @ design / 4.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = DPPVI(model, covariance="diagonal", progress_bar=False).run(jax.random.PRNGKey(0), 3, x, y)
    assert np.all(np.asarray(result.metrics["rejected"]) == 0)
    np.testing.assert_allclose(result.metrics["scale"][0], 1.0 / np.sqrt(np.diag(precision)), rtol=0.1)
    messages = " ".join(str(w.message) for w in caught)
    assert "covariance='full'" in messages and "had not converged" in messages
