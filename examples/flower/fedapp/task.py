"""What the user writes: a NumPyro model and the methods; how a node loads its rows is in
``fedapp.data`` (the ClientApp imports that module for every message, and this one only when
a node rebuilds its program: see ``client_app.py``).
"""

import numpyro
import numpyro.distributions as dist

import numpyro_fed as nf
from fedapp.data import NUM_NODES, load, synthetic_shard  # noqa: F401 (the app's loader, here too)


def model(X, y=None):
    """Bayesian logistic regression; the data rows are split across the nodes."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    # in deployment each node's rows are its own, however many it has; the plate only needs
    # the number of nodes
    with nf.federated_plate("data", X.shape[0], clients=NUM_NODES):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


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
