"""Rows of ``benchmarks/federation.py`` for the variational family: DP-PVI and DSVGD,
in-process against Ray.

For each algorithm, one run of ``ROUNDS`` rounds of a logistic regression (``ROWS`` rows
per client, ``DIM`` features, float64) on :class:`~numpyro_fed.InProcess` and on a
:class:`~numpyro_fed.RayFederation` with ``ctx.num_clients`` actors. A row reports the median
milliseconds per round (rounds 2 on: the first compiles), rounds per second, bytes per round
from the run's message ledger (both directions, all clients; the part that is client state the
server stores for the clients in ``state_bytes_per_round``), the run's wall time including the
start of the clients (``wall_s``), and on Ray the ratio of a round to Ray's bare round trip
(``x_bare``) and to the in-process round (``x_in_process``). On Ray, the first round also
includes the workers' compilation. The ledgers of both runs are checked equal.

Run through ``python benchmarks/federation.py --families variational``.
"""

from __future__ import annotations

import time
import warnings

import numpy as np

import jax
import jax.numpy as jnp

import numpyro
import numpyro.distributions as dist

import numpyro_fed as nf

FAMILY = "variational"
ROWS, DIM, ROUNDS = 500, 5, 6


def _data(num_clients):
    rng = np.random.default_rng(0)
    n = ROWS * num_clients
    X = rng.normal(size=(n, DIM))
    y = (X @ rng.normal(size=DIM) + rng.logistic(size=n) > 0).astype(float)
    return jnp.asarray(X), jnp.asarray(y)


def _model(num_clients):
    def model(X, y=None):
        w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
        with nf.federated_plate("data", X.shape[0], clients=num_clients):
            numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    return model


def _methods(model):
    return {
        "DPPVI synchronous, non-private (M updates of q per round)":
            lambda fed: nf.DPPVI(model, schedule="synchronous", num_local_steps=50, federation=fed,
                                 progress_bar=False),
        "DPPVI sequential, non-private (M updates of q per round)":
            lambda fed: nf.DPPVI(model, num_local_steps=50, federation=fed, progress_bar=False),
        "DPPVI sequential, DP-SGD (M updates of q per round)":
            lambda fed: nf.DPPVI(model, dp="dpsgd", noise_multiplier=1.0, sampling="poisson", sampling_rate=0.1,
                                 clip_norm=2.0, num_local_steps=50, federation=fed, progress_bar=False),
        "DSVGD (one scheduled client per round)":
            lambda fed: nf.DSVGD(model, num_particles=20, num_local_steps=50, num_distill_steps=50,
                                 federation=fed, progress_bar=False),
    }


def _row(what, backend, result, wall_s):
    per_round = np.diff(result.metrics["wall_time"])[1:] * 1e3  # rounds 2.. (round 1 compiles)
    ledger = result.ledger
    total = sum(int(np.sum(ledger[k])) for k in ("bytes_to_client", "bytes_from_client"))
    state = sum(int(np.sum(v)) for k, v in ledger.items() if "/state_bytes_" in k)
    return dict(what=what, backend=backend, ms_per_round=float(np.median(per_round)),
                ms_p10=float(np.percentile(per_round, 10)), ms_p90=float(np.percentile(per_round, 90)),
                rounds_per_s=float(1e3 / np.median(per_round)), bytes_per_round=total // ROUNDS,
                state_bytes_per_round=state // ROUNDS, wall_s=round(wall_s, 2))


def rows(ctx):
    out = []
    model = _model(ctx.num_clients)
    X, y = _data(ctx.num_clients)
    key = jax.random.PRNGKey(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # short runs: convergence warnings
        for what, make in _methods(model).items():
            start = time.perf_counter()
            local = make(None).run(key, ROUNDS, X, y)
            local_row = _row(what, "in-process", local, time.perf_counter() - start)
            out.append(local_row)
            federation = ctx.ray()
            try:
                start = time.perf_counter()
                on_ray = make(federation).run(key, ROUNDS, X, y)
                wall = time.perf_counter() - start
            finally:
                federation.close()
            row = _row(what, "ray", on_ray, wall)
            row["x_bare"] = round(row["ms_per_round"] / ctx.bare_ms, 2) if ctx.bare_ms == ctx.bare_ms else None
            row["x_in_process"] = round(row["ms_per_round"] / local_row["ms_per_round"], 2)
            row["ledgers_equal"] = all(np.array_equal(on_ray.ledger[k], v) for k, v in local.ledger.items())
            out.append(row)
    return out
