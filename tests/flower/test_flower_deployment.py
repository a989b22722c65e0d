"""The Flower app of examples/flower on one machine (slow: a process per message on each
node): a SuperLink and 3 SuperNodes on localhost, each node loading its own shard from the
file its node config names, give the in-process run's answer; and ``flwr run`` runs the same
app in Flower's simulation.

Both run as a silo would: TLS on every connection (a certificate authority and the
SuperLink's certificate made by the script for this run) and, deployed, SuperNode
authentication (``--enable-supernode-auth``, each node's public key registered with ``flwr
supernode register``). A fourth SuperNode with a key nobody registered starts first: were
it admitted, the run (which wants exactly 3 nodes) would stop with an error naming 4.
Everything listens on 127.0.0.1 and is stopped by the script when the run ends or times
out."""

import glob
import json
import os
import shutil
import sys
import tempfile

import numpy as np
import pytest

import jax

pytest.importorskip("flwr", reason="Flower is not installed (pip install 'numpyro_fed[flower]')")

EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples", "flower")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    pytest.mark.skipif(
        shutil.which("flower-superlink", path=os.path.dirname(sys.executable)) is None
        and shutil.which("flower-superlink") is None,
        reason="the flower-superlink command is not installed",
    ),
]


@pytest.fixture(scope="module")
def example():
    sys.path.insert(0, os.path.abspath(EXAMPLE))
    import deploy_localhost
    from fedapp import task

    yield deploy_localhost, task
    sys.path.remove(os.path.abspath(EXAMPLE))


def in_process_means(task, name, rounds):
    """The posterior means the app's server writes, from the in-process deployed run (in
    float32, as the app's processes run)."""
    import copy

    import numpyro_fed as nf

    with jax.enable_x64(False):
        method = copy.copy(task.METHODS[name])  # the app's method, never run, on this federation
        method.federation = nf.InProcess(loader=lambda m: task.load({"partition-id": m}), num_clients=task.NUM_NODES)
        result = method.run(jax.random.PRNGKey(0), rounds)
        draws = result.method.get_samples(jax.random.PRNGKey(1), result, 1000)
        return {k: np.asarray(v).mean(axis=0) for k, v in draws.items()}, result


def test_localhost_deployment_gives_the_in_process_answer(example, tmp_path):
    deploy, task = example
    argv = ["--num-rounds", "2", "--methods", "dppvi", "--out", str(tmp_path), "--timeout", "900", "--strangers", "1"]
    runs_before = set(glob.glob(os.path.join(tempfile.gettempdir(), "numpyro_fed_flower_*")))
    results = deploy.main(argv)
    # the run's folder (the CA's and the nodes' private keys, logs) is not left behind
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "numpyro_fed_flower_*"))) <= runs_before
    summary = results["dppvi"]
    assert summary["rounds"] == 2
    # the shards the nodes loaded are the app's synthetic ones
    means, result = in_process_means(task, "dppvi", 2)
    # Each node computes its client alone, in its own process; the in-process run computes the
    # three clients in one vmap. XLA may fuse the two differently, so float32 sums can differ in
    # the last bits: equal to float32 round-off carried through the full-rank local fit (CI
    # measured 9e-8 on means of order 0.1 before the fit whitened its coordinates and started
    # from variational Newton steps, 5.8e-7 since: a few dozen ulps).
    np.testing.assert_allclose(np.asarray(summary["posterior_mean"]["w"], np.float32), means["w"], rtol=2e-5, atol=1e-6)
    assert summary["bytes_to_clients"] == int(result.ledger["bytes_to_client"].sum())
    assert summary["bytes_from_clients"] == int(result.ledger["bytes_from_client"].sum())
    with open(tmp_path / "dppvi.json") as f:
        assert json.load(f) == summary


def test_flwr_run_simulates_the_app(example, tmp_path):
    deploy, task = example
    results = deploy.main(
        ["--simulation", "--num-rounds", "2", "--methods", "dppvi-dpsgd", "--out", str(tmp_path), "--timeout", "600"]
    )
    summary = results["dppvi-dpsgd"]
    assert summary["rounds"] == 2
    # A private run whose clients are separate parties draws its batches and noise from seeds
    # the nodes drew themselves: the server, which chose the key, cannot replay them, so the
    # in-process run with the same key (its clients draw their own seeds too) gives another
    # answer, under the same accountant's guarantee, which says so.
    means, result = in_process_means(task, "dppvi-dpsgd", 2)
    assert result.privacy.client_private_randomness
    assert summary["privacy"]["client_private_randomness"] is True
    assert "the server cannot replay them" in summary["privacy"]["statement"]
    assert summary["privacy"]["epsilon"] == result.privacy.epsilon
    deployed = np.asarray(summary["posterior_mean"]["w"], np.float32)
    assert np.all(np.isfinite(deployed)) and not np.array_equal(deployed, means["w"])
