"""Rows of ``benchmarks/federation.py`` for the variational family: DP-PVI and DSVGD,
in-process against Ray.

For each algorithm, one run of a logistic regression (``ROWS`` rows per client, ``DIM``
features, float64) on :class:`~numpyro_fed.InProcess` and on a
:class:`~numpyro_fed.RayFederation` with ``ctx.num_clients`` actors: warm-up rounds until
every client has been called once (compilation, on each worker at its first call), then
``TIMED`` rounds. A row reports the median milliseconds per timed round, rounds per second,
bytes per round from the run's message ledger (both directions, all clients), split into the
algorithm's messages (``message_bytes_per_round``; what a client keeps between its rounds
stays with it and never crosses) and the diagnostics (``diagnostic_bytes_per_round``: the
loss, Stein's checks), the run's wall time including the start of the clients
(``wall_s``), and on Ray the ratio of a round to Ray's bare round trip (``x_bare``) and to the
in-process round (``x_in_process``). The ledgers of both runs are checked equal.

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
ROWS, DIM, TIMED = 500, 5, 6  # rows per client, features, rounds timed


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


def _methods(model, num_clients):
    """name -> (make(federation), warm-up rounds): the rounds until every client has been
    called once (on Ray each worker compiles its function at its first call)."""
    return {
        "DPPVI synchronous, non-private (M updates of q per round)": (
            lambda fed: nf.DPPVI(model, schedule="synchronous", num_local_steps=50, federation=fed, progress_bar=False),
            1,
        ),
        "DPPVI sequential, non-private (M updates of q per round)": (
            lambda fed: nf.DPPVI(model, num_local_steps=50, federation=fed, progress_bar=False),
            1,
        ),
        "DPPVI sequential, DP-SGD (M updates of q per round)": (
            lambda fed: nf.DPPVI(
                model,
                dp="dpsgd",
                noise_multiplier=1.0,
                sampling="poisson",
                sampling_rate=0.1,
                clip_norm=2.0,
                num_local_steps=50,
                federation=fed,
                progress_bar=False,
            ),
            1,
        ),
        "DSVGD (one scheduled client per round)": (
            lambda fed: nf.DSVGD(
                model, num_particles=20, num_local_steps=50, num_distill_steps=50, federation=fed, progress_bar=False
            ),
            num_clients,
        ),
    }


def _row(what, backend, result, wall_s, warm):
    per_round = np.diff(result.metrics["wall_time"])[warm - 1 :] * 1e3  # after the warm-up rounds
    ledger = result.ledger
    rounds = len(result.metrics["wall_time"])
    total = sum(int(np.sum(ledger[k])) for k in ("bytes_to_client", "bytes_from_client"))
    update = sum(int(np.sum(ledger[f"update/bytes_{d}"])) for d in ("to_client", "from_client"))
    return dict(
        what=what,
        backend=backend,
        ms_per_round=float(np.median(per_round)),
        ms_p10=float(np.percentile(per_round, 10)),
        ms_p90=float(np.percentile(per_round, 90)),
        rounds_per_s=float(1e3 / np.median(per_round)),
        bytes_per_round=total // rounds,
        message_bytes_per_round=update // rounds,
        diagnostic_bytes_per_round=(total - update) // rounds,
        wall_s=round(wall_s, 2),
    )


def rows(ctx):
    out = []
    model = _model(ctx.num_clients)
    X, y = _data(ctx.num_clients)
    key = jax.random.PRNGKey(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # short runs: convergence warnings
        for what, (make, warm) in _methods(model, ctx.num_clients).items():
            rounds = warm + TIMED
            start = time.perf_counter()
            local = make(None).run(key, rounds, X, y)
            local_row = _row(what, "in-process", local, time.perf_counter() - start, warm)
            out.append(local_row)
            federation = ctx.ray()
            try:
                start = time.perf_counter()
                on_ray = make(federation).run(key, rounds, X, y)
                wall = time.perf_counter() - start
            finally:
                federation.close()
            row = _row(what, "ray", on_ray, wall, warm)
            row["x_bare"] = round(row["ms_per_round"] / ctx.bare_ms, 2) if ctx.bare_ms == ctx.bare_ms else None
            row["x_in_process"] = round(row["ms_per_round"] / local_row["ms_per_round"], 2)
            row["ledgers_equal"] = all(np.array_equal(on_ray.ledger[k], v) for k, v in local.ledger.items())
            out.append(row)
    return out
