"""What the user writes: a NumPyro model, how a node loads its rows, and the methods.

Each node loads its own rows from its node config: ``data-path`` (a ``.npz`` file with
``X`` and ``y``, as ``deploy_localhost.py``'s ``write_shards`` writes the shards below) in a
deployment, or, in Flower's simulation (whose nodes only have ``partition-id`` and
``num-partitions``), its shard of a synthetic data set drawn here.
"""

import numpy as np

import numpyro
import numpyro.distributions as dist

import numpyro_fed as nf

NUM_NODES = 3  # the SuperNodes of the federation (simulation: options.num-supernodes)
NUM_FEATURES = 3
ROWS_PER_NODE = 200
TRUE_WEIGHTS = np.array([1.0, -0.5, 0.25])


def model(X, y=None):
    """Bayesian logistic regression; the data rows are split across the nodes."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    # in deployment each node's rows are its own, however many it has; the plate only needs
    # the number of nodes
    with nf.federated_plate("data", X.shape[0], clients=NUM_NODES):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def synthetic_shard(partition_id, rows=ROWS_PER_NODE):
    """Node ``partition_id``'s rows of the synthetic data set."""
    rng = np.random.default_rng(1000 + int(partition_id))
    X = rng.normal(size=(rows, NUM_FEATURES))
    y = (X @ TRUE_WEIGHTS + rng.logistic(size=rows) > 0).astype(np.float64)
    return X, y


def load(node_config):
    """Runs on the node: its rows (they never leave it)."""
    path = node_config.get("data-path")
    if path:
        with np.load(path) as data:
            return data["X"], data["y"]
    return synthetic_shard(node_config["partition-id"])


# Synchronous schedules: every node works in the same round trip (a sequential round is one
# round trip per node, and a deployed round trip costs seconds).
METHODS = {
    "dppvi": nf.DPPVI(model, schedule="synchronous", num_local_steps=100, progress_bar=False),
    "dppvi-dpsgd": nf.DPPVI(
        model,
        dp="dpsgd",
        schedule="synchronous",
        noise_multiplier=1.0,
        sampling_rate=0.25,
        clip_norm=2.0,
        num_local_steps=50,
        progress_bar=False,
    ),
    "dsvgd": nf.DSVGD(model, num_particles=20, num_local_steps=100, num_distill_steps=100, progress_bar=False),
}
