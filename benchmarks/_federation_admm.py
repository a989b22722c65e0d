"""D-ADMMS rows of ``benchmarks/federation.py``: iterations per second, bytes per iteration and
wall time, in process and on Ray (one actor per agent), next to Ray's bare round trip.

Target: the paper's linear regression (Section 6.2: x in R^2, 50 rows per agent, closed-form
proximal steps), ``ctx.num_clients`` agents on a ring, ``ctx.chains`` chains vectorized,
float64. Backends:

* ``federation=None``: every agent in this process (``vmap``), the default;
* ``RayFederation``: one actor per agent; each actor runs its own loop of iterations and sends
  its iterate to its two neighbours' actors directly; the driver collects the draws.

Each backend runs through ``MCMC`` with the same kernel (``SHORT`` iterations to compile and
start the actors, then ``SHORT`` and ``LONG``); a row reports the difference of the last two
runs (the marginal cost of ``LONG - SHORT`` iterations: tracing, compilation and the actors'
start are left out). Bytes per iteration are the ledger's: every agent's iterate (2 floats per
chain) to each neighbour, as counted from the payloads on Ray. ``wall_s`` is the ``LONG`` run's
``MCMC.run``.
"""

from __future__ import annotations

import time

import numpy as np

import jax

from numpyro.infer import MCMC

import numpyro_fed as nf
from numpyro_fed.datasets import dadmms_linear

FAMILY = "admm"
ROWS = 50  # per agent
SHORT, LONG = 20, 520


def _model(problem):
    import numpyro
    import numpyro.distributions as dist

    def model(X, y=None):
        x = numpyro.sample("x", dist.Normal(0, np.sqrt(problem.prior_variance)).expand([X.shape[1]]).to_event(1))
        with nf.federated_plate("data", X.shape[0], clients=problem.owner):
            numpyro.sample("y", dist.Normal(X @ x, problem.noise_std), obs=y)

    return model


def measure(federation, problem, chains):
    kernel = nf.DADMMS(_model(problem), topology="ring", rho=5.0, federation=federation)
    seconds, peer_bytes, peer_rounds = {}, {}, {}
    for label, n in (("compile", SHORT), ("short", SHORT), ("long", LONG)):
        mcmc = MCMC(
            kernel, num_warmup=0, num_samples=n, num_chains=chains, chain_method="vectorized", progress_bar=False
        )
        start = time.perf_counter()
        if federation is None:
            mcmc.run(jax.random.PRNGKey(0), problem.X, problem.y)
            jax.block_until_ready(mcmc.get_samples())
        else:
            with federation.guard():
                mcmc.run(jax.random.PRNGKey(0), problem.X, problem.y)
                jax.block_until_ready(mcmc.get_samples())
        seconds[label] = time.perf_counter() - start
        if federation is not None:
            ledger = federation.ledger
            peer_bytes[label] = int(ledger.count("DADMMS/iterate", "to_peer", "bytes").sum())
            peer_rounds[label] = int(ledger.rounds("DADMMS/iterate").max())
    sent = np.asarray(mcmc.get_extra_fields(group_by_chain=True)["sent.bytes"])  # (chain, draw, agent)
    per_iteration = float(np.diff(sent, axis=1)[:, -1].sum())  # all agents, all chains
    marginal = seconds["long"] - seconds["short"]
    out = dict(
        ms_per_round=marginal / (LONG - SHORT) * 1e3,
        rounds_per_s=(LONG - SHORT) / marginal,
        bytes_per_round=per_iteration,
        wall_s=seconds["long"],
    )
    if federation is not None:
        rounds = peer_rounds["long"] - peer_rounds["short"]
        out["ledger_bytes_per_round"] = (peer_bytes["long"] - peer_bytes["short"]) / max(rounds, 1)
        out["iterations_run_ahead"] = rounds - LONG  # iterations the agents ran beyond the draws kept
    return out


def rows(ctx):
    problem = dadmms_linear(0, num_agents=ctx.num_clients, n_per_agent=ROWS)
    out = []
    local = measure(None, problem, ctx.chains)
    out.append(
        dict(what=f"DADMMS iteration, {ctx.num_clients}-agent ring, {ctx.chains} chains", backend="in-process", **local)
    )
    federation = ctx.ray()
    try:
        remote = measure(federation, problem, ctx.chains)
    finally:
        federation.close()
    remote["ray_over_in_process"] = remote["ms_per_round"] / local["ms_per_round"]
    out.append(
        dict(what=f"DADMMS iteration, {ctx.num_clients}-agent ring, {ctx.chains} chains", backend="ray", **remote)
    )
    return out
