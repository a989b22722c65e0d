"""ConsensusMC on the engines: the same run (same key) on InProcess, in deployment (each client
loads its rows), on Ray (one worker per client) and in Flower's simulation (one round: each node
runs its sub-posterior's NUTS and answers once) gives the same answer: bit for bit where the
arithmetic is the same, and on this model to round-off against the in-process run (whose NUTS
trajectories can carry round-off into a different chain on other models: the same answer in
distribution only)."""

import sys

import numpy as np
import pytest

import jax

import numpyro
import numpyro.distributions as dist

import numpyro_fed as nf
from numpyro_fed.federation import InProcess

M, ROWS = 3, 60
KEY = 3


def model(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    sigma = numpyro.sample("sigma", dist.HalfCauchy(1.0))
    with nf.federated_plate("data", y.shape[0], clients=M):
        numpyro.sample("y", dist.Normal(mu, sigma), obs=y)


Y = 1.0 + 2.0 * np.random.default_rng(0).normal(size=M * ROWS)


def load(node_config):
    """Node m's rows (its partition-id)."""
    m = int(node_config["partition-id"])
    return (Y[m * ROWS : (m + 1) * ROWS],)


def load_client(m):
    return load({"partition-id": m})


def make(combine="consensus", **kwargs):
    return nf.ConsensusMC(model, combine=combine, num_warmup=150, num_samples=300, progress_bar=False, **kwargs)


@pytest.fixture(scope="module")
def in_process():
    method = make()
    return method, method.run(jax.random.PRNGKey(KEY), Y)


def assert_same_answer(result, reference, rtol):
    """The combined posterior's moments, and every client's diagnostics."""
    np.testing.assert_allclose(result.state.mean, reference.state.mean, rtol=rtol)
    np.testing.assert_allclose(result.state.cov, reference.state.cov, rtol=rtol)
    np.testing.assert_allclose(result.metrics["client_mean"], reference.metrics["client_mean"], rtol=rtol)
    # higher moments and an ESS (a sum of autocorrelations up to a data-dependent lag) move more
    # with round-off: measured 8e-5 on a skewness (its Monte Carlo error: 0.1), 3e-4 relative on an ESS
    np.testing.assert_allclose(result.metrics["skewness"], reference.metrics["skewness"], atol=10 * rtol)
    np.testing.assert_allclose(result.metrics["ess"], reference.metrics["ess"], rtol=100 * rtol)
    np.testing.assert_array_equal(result.metrics["divergences"], reference.metrics["divergences"])


def test_deployment_in_process_is_the_simulation(in_process):
    method, reference = in_process
    deployed = make(federation=InProcess(loader=load_client, num_clients=M))
    result = deployed.run(jax.random.PRNGKey(KEY))
    assert deployed.federated_potential.deployed
    assert_same_answer(result, reference, 0.0)
    np.testing.assert_array_equal(result.state.draws, reference.state.draws)


# Each worker compiles its client's function alone (in process the clients are vmapped), so
# the arithmetic rounds differently and 450 NUTS steps carry it on: measured 3e-6 relative on
# the combined mean. Ray and Flower, each client compiled alone, give the same bits.
ENGINE_RTOL = 1e-4
_REMOTE = {}


def test_ray_gives_the_in_process_run(in_process, ray_federation):
    method, reference = in_process
    remote = make(federation=ray_federation)
    # the one call is each client's whole run: ConsensusMC's timeout bounds it, not the
    # federation's (meant for one round; here far below the seconds the workers take)
    timeout, ray_federation.timeout = ray_federation.timeout, 1.0
    try:
        result = _REMOTE["ray"] = remote.run(jax.random.PRNGKey(KEY), Y)
    finally:
        ray_federation.timeout = timeout
    assert ray_federation.program.timeouts == {"subposterior": 3600.0}
    assert all(client["subposterior"][1] > 1.0 for client in ray_federation.compute_time())  # each took longer
    assert_same_answer(result, reference, ENGINE_RTOL)
    ledger = nf.message_ledger(result)
    np.testing.assert_array_equal(ledger["bytes_from_client"], nf.message_ledger(reference)["bytes_from_client"])
    draws = remote.get_samples(jax.random.PRNGKey(1), result, 100)
    assert draws["sigma"].shape == (100,) and (np.asarray(draws["sigma"]) > 0).all()


def test_flower_simulation_gives_the_in_process_run(in_process, ray_session):
    flower = pytest.importorskip("numpyro_fed.flower")
    pytest.importorskip("flwr", reason="Flower is not installed (pip install 'numpyro_fed[flower]')")
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers may not have tests/ on their path
    method, reference = in_process
    methods = {"consensus": make(), "parametric": make("parametric")}
    server, client = flower.apps(methods, load, num_rounds=1, seed=KEY)
    results = flower.simulate(server, client, M)
    assert_same_answer(results["consensus"], reference, ENGINE_RTOL)
    if "ray" in _REMOTE:
        assert_same_answer(results["consensus"], _REMOTE["ray"], 0.0)
    parametric = results["parametric"]
    assert parametric.state.draws is None  # only moments crossed
    assert (nf.message_ledger(parametric)["bytes_from_client"] < 200).all()
    tree = nf.to_inference_data(parametric, num_samples=50)
    assert tree.attrs["federation"] == "FlowerFederation" and tree.sample_stats["rhat"].dims == ("client", "coordinate")


def random_intercepts(X, group, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 2.0).expand([X.shape[1]]).to_event(1))
    with nf.federated_plate("clients", M, clients=M):
        u = numpyro.sample("u", dist.Normal(0.0, 1.0))
    with nf.federated_plate("data", X.shape[0], clients=M):
        numpyro.sample("y", dist.Normal(X @ w + u[group], 1.0), obs=y)


def test_client_local_latents_stay_on_the_ray_workers(ray_federation):
    """Each worker samples (w, u_m) and keeps u_m's draws (its client state, never sent); w's
    posterior is the closed form (linear-Gaussian): means within 0.25 sd (1000 draws per
    client), sds within 12%."""
    rng = np.random.default_rng(6)
    X = rng.normal(size=(M * 50, 2))
    group = np.repeat(np.arange(M), 50)
    y = X @ np.array([0.5, -0.3]) + np.array([-1.0, 0.5, 1.0])[group] + rng.normal(size=M * 50)
    method = nf.ConsensusMC(
        random_intercepts, num_warmup=300, num_samples=1000, progress_bar=False, federation=ray_federation
    )
    result = method.run(jax.random.PRNGKey(0), X, group, y)
    assert jax.tree.leaves(result.state.local.values) == [] and result.state.local.version.tolist() == [1] * M
    design = np.concatenate([X, np.eye(M)[group]], axis=1)
    cov = np.linalg.inv(np.diag([0.25] * 2 + [1.0] * M) + design.T @ design)
    mean, sd = (cov @ design.T @ y)[:2], np.sqrt(np.diag(cov))[:2]
    w = np.asarray(method.get_samples(jax.random.PRNGKey(1), result)["w"])
    assert np.all(np.abs(w.mean(0) - mean) / sd < 0.25), (w.mean(0) - mean) / sd
    np.testing.assert_allclose(w.std(0), sd, rtol=0.12)
    assert (nf.message_ledger(result)["subposterior/bytes_from_client"] < 1000 * 2 * 8 + 1000).all()
