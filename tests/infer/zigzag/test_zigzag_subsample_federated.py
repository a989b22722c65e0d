"""FedZigZag(subsample_size=...) through a federation with second-order control variates: each
client computes its rows' remainder weights, its gradient and its Hessian at the reference
once and keeps them as its client state; every round is one stateful call from that state.

Checked against NumPyro's NUTS on the pooled data (means and sds within their Monte Carlo
errors), against the in-process run (the server's thinning: the same posterior, and gradient
rows per effective sample within 1.5x of it), against first order through the federation
(many times the rows), and for equality where the arithmetic is the same (deployment against
simulation; Ray against in process).

Tolerances: a mean estimated from ``ESS`` effective draws has standard error ``sd /
sqrt(ESS)``; two independent estimates differ by at most ``Z * sd * sqrt(1 / ESS_a + 1 /
ESS_b)`` with ``Z = 4.5`` (about 7e-6 per coordinate); an sd's relative error is about ``1 /
sqrt(2 ESS)``, with ``Z`` of those plus 2% for the ESS estimate's own error.
"""

import numpy as np
import pytest

import jax

import numpyro
import numpyro.distributions as dist
from numpyro.diagnostics import effective_sample_size
from numpyro.infer import MCMC, NUTS

import numpyro_fed as nf
from numpyro_fed.federation import InProcess

Z = 4.5
FIELDS = ("info.grad_evals_by_proposer", "info.num_events", "info.num_violations", "info.rounds")


def logistic(X, y=None, clients=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with nf.federated_plate("data", X.shape[0], clients=clients):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def raw_logistic_data(n, seed=0, dtype=np.float64):
    """An intercept and two raw covariates with scales 1 and 10, clients of about 10%, 20%,
    30% and 40% of the rows."""
    rng = np.random.default_rng(seed)
    X = np.column_stack([np.ones(n), rng.normal(size=n), 10.0 * rng.normal(size=n)])
    y = (rng.uniform(size=n) < 1 / (1 + np.exp(-X @ np.array([0.5, -1.0, 0.1])))).astype(float)
    owner = rng.choice(4, size=n, p=[0.1, 0.2, 0.3, 0.4])
    owner[:4] = np.arange(4)
    return X.astype(dtype), y.astype(dtype), owner


def run(args, *, num_samples, num_warmup=200, seed=0, **options):
    kernel = nf.FedZigZag(logistic, subsample_size=2, **options)
    mcmc = MCMC(kernel, num_warmup=num_warmup, num_samples=num_samples, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(seed), *args, extra_fields=FIELDS)
    return kernel, mcmc


def run_nuts(args, num_samples=2000):
    mcmc = MCMC(NUTS(logistic), num_warmup=500, num_samples=num_samples, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(11), *args)
    return np.asarray(mcmc.get_samples()["w"], np.float64)


def ess(draws):
    return np.asarray(effective_sample_size(np.asarray(draws, np.float64)[None]))


def rows_per_effective_sample(kernel, mcmc):
    """Gradient rows the clients evaluated (sampling phase) over the smallest ESS."""
    fields = {name: np.asarray(value)[None] for name, value in mcmc.get_extra_fields().items()}
    rows = int(np.sum(kernel.sample_stats(fields)["grad_row_evals"][0]))
    return rows / ess(mcmc.get_samples()["w"]).min()


def assert_agree(draws, reference):
    """Means and sds of two independent sets of draws agree within their Monte Carlo errors."""
    draws, reference = np.asarray(draws, np.float64), np.asarray(reference, np.float64)
    ess_a, ess_b = ess(draws), ess(reference)
    assert ess_a.min() > 100, ess_a
    sd = reference.std(0)
    np.testing.assert_array_less(np.abs(draws.mean(0) - reference.mean(0)), Z * sd * np.sqrt(1 / ess_a + 1 / ess_b))
    rel = Z * np.sqrt(1 / (2 * ess_a) + 1 / (2 * ess_b)) + 0.02
    np.testing.assert_array_less(np.abs(draws.std(0) / sd - 1), rel)


def test_deployment_gives_the_simulated_draws_with_one_set_up_call_and_one_round_per_switch():
    """Each client loading its own rows (``loader=``) gives the simulation's draws; the clients'
    weights are computed in one stateful set-up call each (no first-order curvature call), and
    every switch costs one round."""
    X, y, owner = raw_logistic_data(200, seed=3)
    order = np.argsort(owner, kind="stable")
    sizes = np.bincount(owner)
    blocks = np.split(order, np.cumsum(sizes)[:-1])

    def load(m):
        return (X[blocks[m]], y[blocks[m]])

    clients = np.repeat(np.arange(4), sizes)

    def deployed(X, y=None):
        return logistic(X, y, clients=clients)

    kernel = nf.FedZigZag(deployed, subsample_size=2, federation=InProcess(), thinning="clients")
    simulated = MCMC(kernel, num_warmup=20, num_samples=60, progress_bar=False)
    simulated.run(jax.random.PRNGKey(0), X[order], y[order], extra_fields=FIELDS)
    dep_kernel = nf.FedZigZag(
        deployed, subsample_size=2, federation=InProcess(loader=load, num_clients=4), thinning="clients"
    )
    deployment = MCMC(dep_kernel, num_warmup=20, num_samples=60, progress_bar=False)
    deployment.run(jax.random.PRNGKey(0))
    assert dep_kernel.federated_potential.deployed
    np.testing.assert_array_equal(np.asarray(deployment.get_samples()["w"]), np.asarray(simulated.get_samples()["w"]))
    ledger = kernel.message_ledger(simulated)
    np.testing.assert_array_equal(ledger["row_remainders/messages_from_client"], [1, 1, 1, 1])
    assert "row_curvature/messages_from_client" not in ledger
    assert kernel.subsample_setup_seconds["row_remainders"] > 0
    fields = simulated.get_extra_fields()
    assert int(fields["info.num_violations"].sum()) == 0
    events, rounds = int(fields["info.num_events"].sum()), int(fields["info.rounds"].sum())
    assert events > 50 and events <= rounds <= 1.05 * events + 5, (events, rounds)


def test_first_order_through_the_federation_is_still_there():
    """``control_variates="first_order"`` keeps the uniform batches (the first-order
    curvature call, no client state)."""
    X, y, owner = raw_logistic_data(120, seed=4)
    kernel, mcmc = run(
        (X, y, owner),
        num_samples=10,
        num_warmup=5,
        federation=InProcess(),
        thinning="clients",
        control_variates="first_order",
    )
    ledger = kernel.message_ledger(mcmc)
    np.testing.assert_array_equal(ledger["row_curvature/messages_from_client"], [1, 1, 1, 1])
    assert "row_remainders/messages_from_client" not in ledger


@pytest.mark.slow
@pytest.mark.parametrize("x64", [True, False], ids=["float64", "float32"])
def test_agrees_with_nuts_and_costs_the_rows_of_the_in_process_run(x64):
    """Through the federation (the clients' thinning) and in process (the server's), second
    order: both the posterior of NUTS on the pooled data, and the federated run's gradient rows
    per effective sample within 1.5x of the in-process run's."""
    numpyro.enable_x64(x64)
    try:
        dtype = np.float64 if x64 else np.float32
        X, y, owner = raw_logistic_data(800, seed=1, dtype=dtype)
        fed_kernel, fed = run((X, y, owner), num_samples=2000, federation=InProcess(), thinning="clients")
        local_kernel, local = run((X, y, owner), num_samples=2000)
        for mcmc in (fed, local):
            w = np.asarray(mcmc.get_samples()["w"])
            assert w.dtype == dtype and np.isfinite(w).all()
            assert int(mcmc.get_extra_fields()["info.num_violations"].sum()) == 0
        reference = run_nuts((X.astype(np.float64), y.astype(np.float64), owner))
        assert_agree(fed.get_samples()["w"], reference)
        assert_agree(local.get_samples()["w"], reference)
        ratio = rows_per_effective_sample(fed_kernel, fed) / rows_per_effective_sample(local_kernel, local)
        assert ratio < 1.5, ratio
    finally:
        numpyro.enable_x64(True)


@pytest.mark.slow
def test_second_order_costs_far_fewer_rows_than_first_order_through_the_federation():
    """The same federated run with first-order control variates (uniform batches) evaluates
    many times the gradient rows per effective sample."""
    X, y, owner = raw_logistic_data(800, seed=2)
    second_kernel, second = run((X, y, owner), num_samples=1000, federation=InProcess(), thinning="clients")
    first_kernel, first = run(
        (X, y, owner), num_samples=1000, federation=InProcess(), thinning="clients", control_variates="first_order"
    )
    ratio = rows_per_effective_sample(first_kernel, first) / rows_per_effective_sample(second_kernel, second)
    # 9.3 measured here (the gap grows with the rows: about 2,400 at N = 1e4, benchmarks/zigzag_federated.py)
    assert ratio > 5, ratio


@pytest.mark.slow
def test_on_ray_gives_the_in_process_draws(ray_session):
    """Ray workers, each holding its rows and keeping its state, give the in-process draws
    (the same arithmetic, the same key)."""
    X, y, owner = raw_logistic_data(200, seed=6)
    _, local = run((X, y, owner), num_samples=100, num_warmup=20, federation=InProcess(), thinning="clients")
    ray_federation = nf.RayFederation(timeout=120.0)
    try:
        kernel, remote = run((X, y, owner), num_samples=100, num_warmup=20, federation=ray_federation)
        ledger = kernel.message_ledger(remote)
    finally:
        ray_federation.close()
    np.testing.assert_array_equal(ledger["row_remainders/messages_from_client"], [1, 1, 1, 1])
    np.testing.assert_allclose(np.asarray(remote.get_samples()["w"]), np.asarray(local.get_samples()["w"]), rtol=1e-10)
