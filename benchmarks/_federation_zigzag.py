"""FedZigZag rows of ``benchmarks/federation.py``: switches per second, ESS per second, round
trips per switch and bytes per round, in process and on Ray, next to Ray's bare round trip.

Target: Bayesian logistic regression, ``ROWS`` synthetic rows per client, ``DIM`` coefficients,
prior N(0, I), float64, ``ctx.num_clients`` clients, control variates on (the default).
Backends:

* ``federation=None``: the default: ``InProcess()`` with the server thinning the
  superposition of the clients' proposals (``thinning="auto"``);
* ``InProcess(), thinning="clients"``: Algorithm 2 as messages, simulated in this process
  (``vmap`` over clients);
* ``RayFederation``: the same messages, one actor per client.

Each configuration runs through ``MCMC`` with the same kernel (``SHORT`` draws to compile, then
``SHORT`` and ``LONG`` draws); the rows report the difference of the last two runs (the marginal
cost of ``LONG - SHORT`` draws), which leaves out tracing, compilation and the workers' start.
ESS is NumPyro's over the long run's draws (minimum over coefficients). Round trips are the Ray
ledger's; a switch is an accepted event.

On Ray the row also gives, for the same draws, the clients' compute per round (the slowest
client's time in its function, from ``RayFederation.compute_time``), Ray's bare round trip
measured again just before and after (``bare_ms``, their mean) and the ratio of the round to
their sum (``x_bare_plus_compute``; the issue's target: at most 2).
"""

from __future__ import annotations

import time

import numpy as np

import jax

import numpyro
import numpyro.distributions as dist
from numpyro.diagnostics import effective_sample_size
from numpyro.infer import MCMC

import numpyro_fed as nf
from numpyro_fed.federation import InProcess

FAMILY = "zigzag"
DIM = 6
ROWS = 250  # per client
SAMPLE_INTERVAL = 0.5
SHORT, LONG = 20, 420


def logistic(X, y=None, clients=4):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    with nf.federated_plate("data", X.shape[0], clients=clients):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def make_data(num_clients, seed=0):
    rng = np.random.default_rng(seed)
    n = ROWS * num_clients
    X = rng.normal(size=(n, DIM))
    y = (rng.uniform(size=n) < 1 / (1 + np.exp(-X @ rng.normal(size=DIM)))).astype(float)
    return X, y


def measure(federation, X, y, num_clients, *, thinning="auto", seed=0):
    kernel = nf.FedZigZag(logistic, sample_interval=SAMPLE_INTERVAL, federation=federation, thinning=thinning)
    out = {}
    on_ray = not kernel.federation.in_process
    for draws in (SHORT, SHORT, LONG):  # the first run compiles what the others reuse
        busy_before = _busy(federation) if on_ray and federation.started else 0.0
        mcmc = MCMC(kernel, num_warmup=50, num_samples=draws, progress_bar=False)
        trips_before = federation.ledger.round_trips if federation is not None and federation.started else 0
        start = time.perf_counter()
        if federation is not None:
            with federation.guard():
                mcmc.run(jax.random.PRNGKey(seed), X, y, clients=num_clients)
        else:
            mcmc.run(jax.random.PRNGKey(seed), X, y, clients=num_clients)
        jax.block_until_ready(mcmc.get_samples())
        wall = time.perf_counter() - start
        fields = mcmc.get_extra_fields()
        out[draws] = dict(
            wall=wall,
            switches=int(fields["info.num_events"].sum()),
            rounds=int(fields["info.rounds"].sum()),
            round_trips=(federation.ledger.round_trips - trips_before) if federation is not None else 0,
            samples=np.asarray(mcmc.get_samples(group_by_chain=True)["w"]),
        )
        if on_ray:  # seconds each client spent in its function during this run
            out[draws]["busy"] = _busy(federation) - busy_before
    long, short = out[LONG], out[SHORT]
    wall = long["wall"] - short["wall"]
    switches = long["switches"] - short["switches"]
    rounds = long["rounds"] - short["rounds"]
    ess = float(np.min(effective_sample_size(long["samples"])))
    row = dict(
        wall_s=wall,
        switches_per_s=switches / wall,
        ess_per_s=ess * (LONG - SHORT) / LONG / wall,
        min_ess=ess,
        draws=LONG - SHORT,
        switches=switches,
    )
    if kernel.thinning == "clients":
        trips = long["round_trips"] - short["round_trips"] if on_ray else rounds
        row.update(
            rounds=rounds,
            rounds_per_switch=rounds / max(switches, 1),
            round_trips_per_switch=trips / max(switches, 1),
            ms_per_round=1e3 * wall / max(rounds, 1),
            rounds_per_s=rounds / wall,
            bytes_per_round=num_clients * (kernel.message_sizes["to_client"] + kernel.message_sizes["from_client"]),
        )
    if on_ray:
        busy = long["busy"] - short["busy"]
        row["client_compute_ms_per_round"] = float(1e3 * busy.max() / max(trips, 1))
    return row


def _busy(federation):
    """Per client, seconds spent in its ``propose`` function so far."""
    return np.array([t.get("propose", (0, 0.0))[1] for t in federation.compute_time()])


def rows(ctx):
    M = ctx.num_clients
    X, y = make_data(M)
    out = []
    what = f"FedZigZag, logistic d={DIM}, {M} x {ROWS} rows, 1 chain"
    out.append(
        dict(
            what=what + " (federation=None: server thins, no messages)", backend="in-process", **measure(None, X, y, M)
        )
    )
    out.append(
        dict(
            what=what + " (Algorithm 2 messages)",
            backend="in-process",
            **measure(InProcess(), X, y, M, thinning="clients"),
        )
    )
    federation = ctx.ray()
    try:
        before = ctx.bare()
        row = measure(federation, X, y, M)
        bare = (before + ctx.bare()) / 2
        row.update(
            bare_ms=bare,
            ms_per_round_over_bare=row["ms_per_round"] / bare,
            x_bare_plus_compute=row["ms_per_round"] / (bare + row["client_compute_ms_per_round"]),
        )
        out.append(dict(what=what + " (Algorithm 2 messages)", backend="ray", **row))
    finally:
        federation.close()
    return out
