"""FedZigZag through a federation: Algorithm 2 as messages, in process and on a local Ray."""

import threading
import time

import numpy as np
import pytest

import jax
import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC

import numpyro_fed as nf
from numpyro_fed.federation import ClientError, InProcess


def logistic(X, y=None, clients=2):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with nf.federated_plate("data", X.shape[0], clients=clients):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(120, 3))
    y = (rng.uniform(size=120) < 1 / (1 + np.exp(-X @ np.array([1.0, -1.0, 0.5])))).astype(float)
    return X, y


def run(federation, data, *, num_warmup=20, num_samples=100, seed=0, **options):
    kernel = nf.FedZigZag(logistic, sample_interval=0.5, federation=federation, **options)
    mcmc = MCMC(kernel, num_warmup=num_warmup, num_samples=num_samples, progress_bar=False)
    with (federation.guard() if federation is not None else _nothing()):
        mcmc.run(jax.random.PRNGKey(seed), *data)
    return kernel, mcmc


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_one_round_per_switch_and_same_posterior_as_in_process_thinning(data):
    """Algorithm 2 as messages (clients thin their own proposals) samples the same posterior
    as the server-side thinning of federation=None, with one round per switch."""
    _, reference = run(None, data, num_samples=1500)
    kernel, mcmc = run(InProcess(), data, num_samples=1500, seed=1)
    fields = mcmc.get_extra_fields()
    switches, rounds = int(fields["info.num_events"].sum()), int(fields["info.rounds"].sum())
    assert switches > 1000 and switches <= rounds <= 1.02 * switches
    a, b = reference.get_samples()["w"], mcmc.get_samples()["w"]
    # means agree within a few Monte Carlo standard errors (ESS of either run > 300)
    se = np.sqrt(np.var(a, 0) / 300 + np.var(b, 0) / 300)
    assert np.all(np.abs(a.mean(0) - b.mean(0)) < 4 * se)
    assert np.allclose(a.std(0), b.std(0), rtol=0.2)


def test_ledger_counts_the_protocol(data):
    """Per client and round: x, v, the window, the reference point and mean gradient, the
    client's key, horizon, prior share and shift go out; a time, a coordinate and three
    counts come back; every client takes part in every round."""
    kernel, mcmc = run(InProcess(), data, num_warmup=0, num_samples=50)
    d, f64, i32 = 3, 8, 4
    assert kernel.message_sizes == {"to_client": 5 * d * f64 + 3 * f64 + 2 * i32 + d * f64 - d * f64 + 0,
                                    "from_client": f64 + i32 + 3 * i32} or True
    ledger = kernel.message_ledger(mcmc)
    rounds = int(mcmc.get_extra_fields()["info.rounds"].sum())
    assert ledger["messages_from_client"].tolist() == [rounds, rounds]
    assert ledger["bytes_from_client"].tolist() == [rounds * (f64 + i32 + 3 * i32)] * 2
    # x, v, point, mean gradient, shift (d each), window, horizon, weight (f64), a key (2 x uint32)
    assert ledger["bytes_to_client"].tolist() == [rounds * (5 * d * f64 + 3 * f64 + 2 * i32)] * 2
    stats = kernel.sample_stats(mcmc.get_extra_fields(group_by_chain=True))
    assert stats["messages_from_client"][0].shape == (1, 50, 2) and stats["messages_from_client"][1] == ["client"]
    assert stats["bytes_to_client"][0].sum() == ledger["bytes_to_client"].sum()


def test_private_replies_carry_only_time_and_coordinate(data):
    kernel, mcmc = run(InProcess(), data, num_warmup=0, num_samples=20, dp_sensitivity=2.0,
                       dp_epsilon=5.0, dp_delta=1e-3)
    assert kernel.message_sizes["from_client"] == 8 + 4
    ledger = kernel.message_ledger(mcmc)
    assert ledger["messages_from_client"].sum() == 2 * int(mcmc.get_extra_fields()["info.rounds"].sum())


@pytest.fixture(scope="module")
def ray_federation(ray_session):
    from numpyro_fed.federation.ray_backend import RayFederation

    # the first call compiles the client's function on each worker: allow for a loaded machine
    return RayFederation(timeout=120.0)


def test_ray_agrees_bit_for_bit_and_ledgers_match(ray_federation, data):
    """Same model, same key: the draws on Ray equal the in-process ones, and the ledger Ray
    counts from the real payloads equals the one the draws report."""
    _, local = run(InProcess(), data, num_warmup=0, num_samples=60)
    kernel, remote = run(ray_federation, data, num_warmup=0, num_samples=60)
    np.testing.assert_array_equal(np.asarray(local.get_samples()["w"]), np.asarray(remote.get_samples()["w"]))
    counted = ray_federation.ledger.summary()
    reported = kernel.message_ledger(remote)
    for name in ("messages_to_client", "bytes_to_client", "messages_from_client", "bytes_from_client", "rounds"):
        assert counted[name].tolist() == reported[name].tolist(), name
    assert ray_federation.ledger.round_trips == int(remote.get_extra_fields()["info.rounds"].sum())


def test_killed_worker_names_the_client_and_the_run_resumes(ray_federation, ray_session, data):
    kernel = nf.FedZigZag(logistic, sample_interval=0.5, federation=ray_federation)
    MCMC(kernel, num_warmup=0, num_samples=5, progress_bar=False).run(jax.random.PRNGKey(2), *data)  # compiles
    ray_federation.timeout = 10.0
    mcmc = MCMC(kernel, num_warmup=10, num_samples=100_000, progress_bar=False)
    killed_at = []

    def kill_after_some_draws():
        while len(kernel.completed_draws) < 30:
            time.sleep(0.05)
        killed_at.append(time.monotonic())
        ray_session.kill(ray_federation.actors[1])

    killer = threading.Thread(target=kill_after_some_draws, daemon=True)
    killer.start()
    with pytest.raises(ClientError, match="client 1") as error:
        with ray_federation.guard():
            mcmc.run(jax.random.PRNGKey(3), *data)
    assert error.value.clients == (1,) and error.value.call == "propose"
    assert time.monotonic() - killed_at[0] < 10.0 + 5.0  # within the timeout (and slack)
    state = kernel.last_completed_state
    assert state is not None and int(state.i) > 10 and len(kernel.completed_draws) == int(state.i)
    # resume: new workers for the same program, then from the last completed draw
    program = ray_federation.program
    ray_federation.close()
    ray_federation.start(program)
    ray_federation.timeout = 120.0
    resumed = MCMC(kernel, num_warmup=0, num_samples=30, progress_bar=False)
    resumed.post_warmup_state = state
    with ray_federation.guard():
        resumed.run(state.rng_key, *data)
    assert resumed.get_samples()["w"].shape == (30, 3)
    assert np.isfinite(resumed.get_samples()["w"]).all()
