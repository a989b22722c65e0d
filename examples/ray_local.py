"""One algorithm of each family on a local Ray: every client a Ray actor holding only its rows.

A Bayesian logistic regression over three clients is sampled by NUTS on the pooled rows (the
reference), then on a local Ray (``nf.RayFederation()``: one long-lived actor per client) by

* ``FedZigZag``: the federated Zig-Zag sampler (a round per switch: each client answers with its
  own next switching time);
* ``DADMMS``: the decentralized ADMM sampler (agents on a ring send their iterates to their
  neighbors, actor to actor, never through the driver);
* ``DPPVI``: partitioned variational inference (each client sends the change of its factor);
* ``DSVGD``: distributed Stein variational gradient descent (particles to and from the
  scheduled client).

For each it prints how far its posterior mean of every coefficient is from NUTS's (in NUTS
posterior sds), the ratio of its sds to NUTS's, the wall time, and the message ledger Ray
counted (messages and bytes to and from each client, or to its neighbors).

Then the same DPPVI in **deployment**: each client's rows are in its own file, each actor loads
its own file (``nf.RayFederation(loader=..., num_clients=3)``), and the driver never holds a
row: it runs ``DPPVI.run`` without data arguments.

Run with ``python examples/ray_local.py``, or ``--quick`` (half the draws and rounds: 86 s on a
quiet 2-core machine, Ray's start included, most of it FedZigZag's rounds, each a round trip
to every client's actor).
``--federation inprocess`` runs the same with every client in this process.
"""

import argparse
import os
import tempfile
import time
import warnings

import numpy as np

import jax

import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC, NUTS

import numpyro_fed as nf

numpyro.enable_x64()
warnings.filterwarnings("ignore", category=FutureWarning)

NUM_CLIENTS = 3


def model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with nf.federated_plate("data", X.shape[0], clients=NUM_CLIENTS):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def make_data(num_rows, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(num_rows, 3))
    y = (rng.random(num_rows) < 1 / (1 + np.exp(-X @ np.array([1.0, -0.5, 0.25])))) * 1.0
    return X, y


class FileLoader:
    """Client ``m``'s rows from its own file (runs on client ``m``'s actor)."""

    def __init__(self, folder):
        self.folder = folder

    def __call__(self, m):
        rows = np.load(os.path.join(self.folder, f"client{m}.npz"))
        return rows["X"], rows["y"]


def compare(name, draws, seconds, ledger, reference):
    """One line per algorithm: the worst distance of the means in reference sds, the range of
    the sd ratios, the time, and the ledger's totals."""
    ref_mean, ref_sd = reference.mean(0), reference.std(0)
    z = np.abs(draws.mean(0) - ref_mean) / ref_sd
    ratio = draws.std(0) / ref_sd
    out = int(np.sum(ledger["bytes_to_client"]) + np.sum(ledger.get("bytes_to_peer", 0)))
    back = int(np.sum(ledger["bytes_from_client"]))
    print(
        f"{name:10s} max |mean - NUTS| = {z.max():.2f} sd   sd / NUTS sd in [{ratio.min():.2f}, "
        f"{ratio.max():.2f}]   {seconds:6.1f} s   sent {out:,} B, received {back:,} B"
    )
    return z.max(), ratio


def run_all(federation, X, y, key, scale):
    results = {}
    with federation.guard():
        t = time.perf_counter()
        mcmc = MCMC(
            nf.FedZigZag(model, federation=federation),
            num_warmup=100 * scale,
            num_samples=300 * scale,
            progress_bar=False,
        )
        mcmc.run(key, X, y)
        results["FedZigZag"] = (
            np.asarray(mcmc.get_samples()["w"]),
            time.perf_counter() - t,
            federation.ledger.summary(),
        )

        t = time.perf_counter()
        mcmc = MCMC(
            nf.DADMMS(model, topology="ring", federation=federation),
            num_warmup=100 * scale,
            num_samples=200 * scale,
            num_chains=4,
            chain_method="vectorized",
            progress_bar=False,
        )
        mcmc.run(key, X, y)
        results["DADMMS"] = (
            np.asarray(mcmc.get_samples()["w"]).reshape(-1, X.shape[1]),
            time.perf_counter() - t,
            federation.ledger.summary(),
        )

    t = time.perf_counter()
    pvi = nf.DPPVI(model, federation=federation, progress_bar=False)
    result = pvi.run(key, 10 * scale, X, y)
    draws = pvi.get_samples(jax.random.PRNGKey(1), result, 4000)["w"]
    results["DPPVI"] = (np.asarray(draws), time.perf_counter() - t, federation.ledger.summary())

    t = time.perf_counter()
    svgd = nf.DSVGD(model, federation=federation, progress_bar=False)
    result = svgd.run(key, 4 * NUM_CLIENTS * scale, X, y)
    results["DSVGD"] = (
        np.asarray(svgd.get_samples(key, result)["w"]),
        time.perf_counter() - t,
        federation.ledger.summary(),
    )
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--federation", choices=["ray", "inprocess"], default="ray")
    parser.add_argument("--num-rows", type=int, default=600)
    parser.add_argument("--quick", action="store_true", help="fewer draws and rounds (a smoke run)")
    args = parser.parse_args(argv)
    scale = 1 if args.quick else 2
    X, y = make_data(args.num_rows)
    key = jax.random.PRNGKey(0)

    t = time.perf_counter()
    nuts = MCMC(NUTS(model), num_warmup=500, num_samples=2000, progress_bar=False)
    nuts.run(key, X, y)
    reference = np.asarray(nuts.get_samples()["w"])
    print(
        f"NUTS on the pooled rows: posterior mean {np.round(reference.mean(0), 3).tolist()}, "
        f"sd {np.round(reference.std(0), 3).tolist()} ({time.perf_counter() - t:.1f} s)"
    )

    def federation(**kwargs):
        if args.federation == "ray":
            return nf.RayFederation(timeout=120.0, **kwargs)
        return nf.InProcess(**kwargs)

    with federation() as fed:
        results = run_all(fed, X, y, key, scale)
        print(f"\nOn {fed!r}, each algorithm's run (the first includes starting the workers):")
        worst = {name: compare(name, *values, reference)[0] for name, values in results.items()}

        # Deployment: each client's rows in its own file, loaded by its own worker.
        with tempfile.TemporaryDirectory() as folder:
            for m, rows in enumerate(np.array_split(np.arange(len(y)), NUM_CLIENTS)):
                np.savez(os.path.join(folder, f"client{m}.npz"), X=X[rows], y=y[rows])
            with federation(loader=FileLoader(folder), num_clients=NUM_CLIENTS) as deployed:
                t = time.perf_counter()
                pvi = nf.DPPVI(model, federation=deployed, progress_bar=False)
                result = pvi.run(key, 10 * scale)  # no data arguments: the clients load their rows
                draws = np.asarray(pvi.get_samples(jax.random.PRNGKey(1), result, 4000)["w"])
                print(f"\nDeployment on {deployed!r}: the driver ran DPPVI without data")
                worst["DPPVI (deployed)"] = compare(
                    "DPPVI dep.", draws, time.perf_counter() - t, deployed.ledger.summary(), reference
                )[0]
                same = np.array_equal(draws, results["DPPVI"][0])
                print(f"the same draws as DPPVI run on the pooled rows' split above: {same}")
    return worst


if __name__ == "__main__":
    main()
