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


def in_process_means(task, name, rounds, x64=False):
    """The posterior means the app's server writes, from the in-process run (in float64 or
    float32, as the app's processes ran)."""
    import copy

    import numpyro_fed as nf

    with jax.enable_x64(x64):
        method = copy.copy(task.METHODS[name])  # the app's method, never run, on this federation
        method.federation = nf.InProcess(loader=lambda m: task.load({"partition-id": m}), num_clients=task.NUM_NODES)
        result = method.run(jax.random.PRNGKey(0), rounds)
        draws = result.method.get_samples(jax.random.PRNGKey(1), result, 1000)
        return {k: np.asarray(v).mean(axis=0) for k, v in draws.items()}, result


def test_localhost_deployment_gives_the_in_process_answer(example, tmp_path):
    deploy, task = example
    argv = ["--num-rounds", "2", "--methods", "dppvi", "--out", str(tmp_path), "--timeout", "900", "--strangers", "1"]
    argv += ["--x64"]
    runs_before = set(glob.glob(os.path.join(tempfile.gettempdir(), "numpyro_fed_flower_*")))
    results = deploy.main(argv)
    # the run's folder (the CA's and the nodes' private keys, logs) is not left behind
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "numpyro_fed_flower_*"))) <= runs_before
    summary = results["dppvi"]
    assert summary["rounds"] == 2 and summary["x64"] is True  # the server and the nodes in float64
    # the shards the nodes loaded are the app's synthetic ones
    means, result = in_process_means(task, "dppvi", 2, x64=True)
    # Each node computes its client alone, in its own process; the in-process run computes the
    # three clients in one vmap. XLA may fuse the two differently, so sums can differ in the
    # last bits, which the local fit's solves carry on. In float32 that came to 4.7e-6 on a
    # mean of 0.11 (about 600 ulps; the same on two machines with one set of package versions,
    # 5.8e-7 with the set before), so the comparison runs in float64: measured 1.4e-17 (1 ulp).
    np.testing.assert_allclose(summary["posterior_mean"]["w"], means["w"], rtol=1e-12, atol=1e-15)
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
