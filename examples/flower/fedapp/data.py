"""How a node loads its rows, from its node config: ``data-path`` (a ``.npz`` file with ``X``
and ``y``, as ``deploy_localhost.py``'s ``write_shards`` writes the shards below) in a
deployment, or, in Flower's simulation (whose nodes only have ``partition-id`` and
``num-partitions``), its shard of a synthetic data set drawn here. NumPy only: a deployed
SuperNode starts a new ClientApp process for every message, which imports this module.
"""

import numpy as np

NUM_NODES = 3  # the SuperNodes of the federation (simulation: options.num-supernodes)
NUM_FEATURES = 3
ROWS_PER_NODE = 200
TRUE_WEIGHTS = np.array([1.0, -0.5, 0.25])


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
