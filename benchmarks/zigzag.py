"""Benchmark of the federated Zig-Zag sampler (FedZigZag) against NumPyro's NUTS and pdmp-jax.

Target: Bayesian logistic regression, N = 1000 synthetic rows (standard normal covariates,
true weights drawn from N(0, I), prior N(0, I)), float64. For d in {6, 20}, M clients (even
split) and control variates off/on, it measures

* the sampler as users run it: ``MCMC(FedZigZag(...))`` (events/s, proposals/s, min-ESS/s,
  ESS per gradient evaluation, events per effective sample, wall time);
* the bare functional core, ``jax.jit(build_kernel(...))`` run for one long duration
  (events/s without any per-sample work), and the same core called once per sample inside a
  plain ``lax.scan`` (the cost of stopping every ``sample_interval``), to separate the
  sampler's speed from NumPyro's loop;
* NumPyro NUTS on the same pooled posterior, in the same process;
* pdmp-jax's Zig-Zag (automatic grid bounds) on the single-client target (M=1, d=6).

Timing excludes compilation. NumPyro compiles a new sampling loop on every ``MCMC.run`` (its
loop body closes over a fresh ``transform``), and ``FedZigZag.init`` re-jits its kernel, so
"compile once, time the second run" cannot be done through ``MCMC``. Every timed section
therefore runs after a short warm-up run and subtracts the time JAX itself reports spending on
tracing, lowering and XLA compilation inside the section (``jax.monitoring`` time spans,
overlaps merged). Raw wall times are kept in the JSON.

Run ``python benchmarks/zigzag.py`` (about 10-15 minutes on a 2-core CPU) or ``--quick``
(d=6, M in {1, 8}, about 2 minutes). Results: a table on stdout and
``benchmarks/results/zigzag.json``. See ``benchmarks/README.md`` for the columns.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

import numpyro

numpyro.enable_x64()

import jax  # noqa: E402

# Run CPU computations inline: with asynchronous dispatch, compilations that NumPyro triggers
# after launching its sampling loop would overlap the loop, and subtracting them (see Stopwatch)
# would remove real sampling time. Must be set before the CPU client is created.
jax.config.update("jax_cpu_enable_async_dispatch", False)
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import numpyro.distributions as dist  # noqa: E402
from numpyro.diagnostics import effective_sample_size  # noqa: E402
from numpyro.infer import MCMC, NUTS  # noqa: E402
from numpyro.infer.initialization import init_to_uniform, init_to_value  # noqa: E402

import numpyro_fed as nf  # noqa: E402
from numpyro_fed.infer.zigzag import (  # noqa: E402
    build_kernel,
    control_variate_reference,
    precondition,
    proposers_from_potential,
)

NUM_ROWS = 1000
RESULTS = Path(__file__).resolve().parent / "results" / "zigzag.json"
PRECONDITIONER = None  # --preconditioner
CV_ON = True  # what "control variates on" passes: True (first order) or "second_order" (--cv-order 2)

# Figures of the throw-away prototype quoted in /work/shared/NOTES.md (section FedZigZag).
NOTES_EVENTS_PER_ESS = {  # d = 6
    (1, False): 5.0,
    (8, False): 41.0,
    (64, False): 275.0,
    (1, True): 1000 / 191,
    (8, True): 1000 / 188,
    (64, True): 1000 / 142,
}
NOTES_EVENTS_PER_S = {6: "11-18k", 20: "6-12k"}
NOTES_NUTS_ESS_PER_S = {6: 750.0}
NOTES_ESS_PER_S = {(6, 8, True): 3400.0}
TARGET_EVENTS_PER_S = 20_000  # d=6, M=8
# sample_interval of the run with MCMC's defaults, in smallest (Laplace) posterior sds: the
# largest factor of the sweep, whose per-sample cost suits a per-sample progress bar
DEFAULTS_INTERVAL_FACTOR = 4.0


# -- models and data ----------------------------------------------------------------------


def logistic_federated(X, y=None, clients=1):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with nf.federated_plate("data", X.shape[0], clients=clients):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def logistic_pooled(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def pooled_potential(X, y):
    """The pooled posterior's potential written out by hand (for pdmp-jax and for sizing
    ``sample_interval`` before any sampler has run): logistic likelihood, N(0, I) prior."""

    def potential(w):
        logits = X @ w
        return jnp.sum(jnp.logaddexp(0.0, logits) - y * logits) + 0.5 * w @ w

    return potential


def make_data(d, seed=0):
    key_x, key_w, key_y = jax.random.split(jax.random.PRNGKey(1000 * seed + d), 3)
    X = jax.random.normal(key_x, (NUM_ROWS, d), jnp.float64)
    w_true = jax.random.normal(key_w, (d,), jnp.float64)
    y = jax.random.bernoulli(key_y, jax.nn.sigmoid(X @ w_true)).astype(jnp.float64)
    return X, y, w_true


# -- timing that excludes compilation -----------------------------------------------------

_COMPILE_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
}
_SPANS: list[tuple[float, float]] = []


def _on_span(event, start, end, **kwargs):
    if event in _COMPILE_EVENTS:
        _SPANS.append((start, end))


jax.monitoring.register_event_time_span_listener(_on_span)


class Stopwatch:
    """Wall time of a block minus the time JAX spent tracing, lowering and compiling in it
    (the union of the spans it reports, so nested traces are not counted twice)."""

    def __enter__(self):
        self._first = len(_SPANS)
        self.start = time.time()
        return self

    def __exit__(self, *exc):
        self.end = time.time()
        spans = sorted(_SPANS[self._first :])
        compile_time, cur_start, cur_end = 0.0, None, None
        for s, e in spans:
            s, e = max(s, self.start), min(e, self.end)
            if e <= s:
                continue
            if cur_end is None or s > cur_end:
                if cur_end is not None:
                    compile_time += cur_end - cur_start
                cur_start, cur_end = s, e
            else:
                cur_end = max(cur_end, e)
        if cur_end is not None:
            compile_time += cur_end - cur_start
        self.wall = self.end - self.start
        self.compile = compile_time
        self.net = max(self.wall - compile_time, 1e-9)
        return False


def min_ess(draws):
    """Minimum over coordinates of NumPyro's single-chain ESS; draws (S, d)."""
    return float(np.min(effective_sample_size(np.asarray(draws)[None])))


# -- NUTS ---------------------------------------------------------------------------------


def bench_nuts(X, y, *, num_warmup, num_samples, seed=0):
    # compile/warm-up run (short), then the timed warm-up (adaptation) and sampling phases
    MCMC(NUTS(logistic_pooled), num_warmup=50, num_samples=50, progress_bar=False).run(
        jax.random.PRNGKey(seed + 100), X, y
    )
    mcmc = MCMC(NUTS(logistic_pooled), num_warmup=num_warmup, num_samples=num_samples, progress_bar=False)
    with Stopwatch() as warm_sw:
        mcmc.warmup(jax.random.PRNGKey(seed), X, y, extra_fields=("num_steps",))
        jax.block_until_ready(mcmc.last_state)
    with Stopwatch() as sw:
        mcmc.run(jax.random.PRNGKey(seed + 1), X, y, extra_fields=("num_steps", "diverging"))
        jax.block_until_ready(mcmc.get_samples())
    draws = np.asarray(mcmc.get_samples()["w"])
    extra = mcmc.get_extra_fields()
    ess = min_ess(draws)
    steps = int(np.sum(extra["num_steps"]))
    total = warm_sw.net + sw.net
    return {
        "num_warmup": num_warmup,
        "num_samples": num_samples,
        "ess": ess,
        "wall_s": total,
        "warmup_s": warm_sw.net,
        "sampling_s": sw.net,
        "raw_wall_s": warm_sw.wall + sw.wall,
        "compile_s": warm_sw.compile + sw.compile,
        "ess_per_s": ess / total,
        "ess_per_s_sampling": ess / sw.net,
        "grad_evals": steps,
        "ess_per_kgrad": 1000 * ess / steps,
        "divergences": int(np.sum(extra["diverging"])),
        "posterior_mean": draws.mean(0).tolist(),
        "posterior_sd": draws.std(0).tolist(),
    }


def laplace_sds(X, y):
    """Marginal sds of the Laplace approximation of the pooled posterior (Newton's method on
    :func:`pooled_potential`): sizes ``sample_interval`` before any sampler has run."""
    potential = pooled_potential(X, y)
    w = jnp.zeros(X.shape[1])
    for _ in range(30):
        w = w - jnp.linalg.solve(jax.hessian(potential)(w), jax.grad(potential)(w))
    return np.sqrt(np.diag(np.linalg.inv(np.asarray(jax.hessian(potential)(w)))))


def bench_defaults(X, y, h, *, Ms=(1, 8), rounds=2, num_warmup=1000, num_samples=5000, seed=0):
    """NUTS and FedZigZag (control variates at their default) as a user runs them: ``MCMC``'s
    defaults (progress bar on), wall time of ``mcmc.run`` *including* compilation. ``rounds``
    rounds in this process: the first pays every compilation; later ones find what JAX cached
    (NUTS's loop is cached; FedZigZag re-jits its kernel in every ``init``). Run before anything
    else, so that round 1 is a first run. The progress bars are captured, not printed."""
    import contextlib
    import io

    rows = []
    for r in range(rounds):
        for name, M in [("NUTS", None)] + [("FedZigZag", M) for M in Ms]:
            if M is None:
                mcmc = MCMC(NUTS(logistic_pooled), num_warmup=num_warmup, num_samples=num_samples)
                args, kwargs = (X, y), {}
            else:
                mcmc = MCMC(
                    nf.FedZigZag(logistic_federated, sample_interval=h), num_warmup=num_warmup, num_samples=num_samples
                )
                args, kwargs = (X, y), {"clients": M}
            with contextlib.redirect_stderr(io.StringIO()), Stopwatch() as sw:
                mcmc.run(jax.random.PRNGKey(seed + r), *args, **kwargs)
                draws = np.asarray(mcmc.get_samples()["w"])
            ess = min_ess(draws)
            rows.append(
                {
                    "round": r + 1,
                    "sampler": name,
                    "M": M,
                    "sample_interval": None if M is None else h,
                    "num_warmup": num_warmup,
                    "num_samples": num_samples,
                    "ess": ess,
                    "wall_s": sw.wall,
                    "compile_s": sw.compile,
                    "ess_per_s": ess / sw.wall,
                }
            )
            print(
                f"[defaults, round {r + 1}] {name}{'' if M is None else f' M={M}'}: ESS {ess:.0f} in "
                f"{sw.wall:.2f} s (compilation {sw.compile:.2f} s) -> {ess / sw.wall:.0f} ESS/s",
                flush=True,
            )
    return rows


# -- FedZigZag ----------------------------------------------------------------------------

_FIELDS = (
    "info.num_events",
    "info.num_proposals",
    "info.num_violations",
    "info.grad_evals_by_proposer",
    "info.hit_event_cap",
)


def _make_kernel(h, cv, init_params, cv_init_at_mean, bounds="grid"):
    # FedZigZag finds the control variates' reference point by BFGS from the init strategy's
    # point (init_to_uniform by default); --cv-init-at-mean starts that search at init_params.
    strategy = init_to_value(values=init_params) if cv_init_at_mean else init_to_uniform
    # user-supplied bounds take first-order control variates only (second order is refused)
    control_variates = (CV_ON if isinstance(bounds, str) else True) if cv else False
    return nf.FedZigZag(
        logistic_federated,
        sample_interval=h,
        control_variates=control_variates,
        init_strategy=strategy,
        preconditioner=PRECONDITIONER,
        bounds=bounds,
    )


def _run_fzz(X, y, M, cv, h, num_samples, init_params, seed, cv_init_at_mean=False, bounds="grid"):
    """One timed ``MCMC(FedZigZag).run``; ``kernel.setup_s`` is the time (compilation
    excluded) of the ``init`` inside that run: split, BFGS for the control variates, set-up."""
    kernel = _make_kernel(h, cv, init_params, cv_init_at_mean, bounds)
    init = kernel.init

    def timed_init(*args, **kwargs):
        with Stopwatch() as setup_sw:
            state = jax.block_until_ready(init(*args, **kwargs))
        kernel.setup_s = setup_sw.net
        return state

    kernel.init = timed_init
    mcmc = MCMC(kernel, num_warmup=0, num_samples=num_samples, progress_bar=False)
    with Stopwatch() as sw:
        mcmc.run(jax.random.PRNGKey(seed), X, y, clients=M, init_params=init_params, extra_fields=_FIELDS)
        jax.block_until_ready(mcmc.get_samples())
    return kernel, mcmc, sw


def _summarise(mcmc, sw, M, h, burn_frac):
    draws = np.asarray(mcmc.get_samples()["w"])
    extra = {k: np.asarray(v) for k, v in mcmc.get_extra_fields().items()}
    S = draws.shape[0]
    burn = int(burn_frac * S)
    ess = min_ess(draws[burn:])
    grads = extra["info.grad_evals_by_proposer"]  # (S, P): clients 0..M-1, then the prior's proposer
    return {
        "num_samples": S,
        "burn_in": burn,
        "process_time": S * h,
        "ess": ess,
        "events": int(extra["info.num_events"].sum()),
        "events_post": int(extra["info.num_events"][burn:].sum()),
        "proposals": int(extra["info.num_proposals"].sum()),
        "violations": int(extra["info.num_violations"].sum()),
        "hit_event_cap": bool(extra["info.hit_event_cap"].any()),
        "grad_evals_post": int(grads[burn:].sum()),
        # client gradients each touch N/M rows; the prior proposer's touch none
        "full_data_grad_equiv_post": float(grads[burn:, :M].sum() / M),
        "wall_s": sw.net,
        "raw_wall_s": sw.wall,
        "compile_s": sw.compile,
    }


def bench_fzz(
    X,
    y,
    M,
    cv,
    h,
    *,
    init_params,
    target_ess,
    min_samples,
    pilot_samples,
    max_seconds,
    burn_frac=0.1,
    seed=0,
    core_events=30_000,
    scan_samples=2000,
    cv_init_at_mean=False,
):
    # 1. warm-up / pilot run: compiles what can be cached and sizes the timed run
    pilot_kernel, pilot_mcmc, pilot_sw = _run_fzz(X, y, M, cv, h, pilot_samples, init_params, seed + 1, cv_init_at_mean)
    pilot = _summarise(pilot_mcmc, pilot_sw, M, h, burn_frac)
    setup_s = pilot_kernel.setup_s
    per_sample = max(pilot_sw.net - setup_s, 1e-3) / pilot_samples
    ess_rate = max(pilot["ess"], 1.0) / (pilot["process_time"] * (1 - burn_frac))  # per unit process time
    wanted = math.ceil(1.5 * target_ess / ess_rate / h / (1 - burn_frac))
    # the pilot's per-sample cost can be several times too low (it starts at the posterior mean)
    affordable = int(max(max_seconds - setup_s, 1.0) / (2 * per_sample))
    num_samples = int(max(min_samples, min(wanted, affordable)))
    # 3. the timed run
    kernel, mcmc, sw = _run_fzz(X, y, M, cv, h, num_samples, init_params, seed, cv_init_at_mean)
    out = _summarise(mcmc, sw, M, h, burn_frac)
    potential = kernel.federated_potential
    if kernel.reference_point is not None:  # is the control variates' reference point the MAP?
        grad = potential.ravel(potential.grad(potential.unravel(kernel.reference_point)))
        out["reference_grad_norm"] = float(jnp.linalg.norm(grad))
    else:
        out["reference_grad_norm"] = None
    setup_s = kernel.setup_s  # the timed run's own set-up (its BFGS can take longer or shorter)
    loop_s = max(sw.net - setup_s, 1e-9)
    out.update(
        {
            "d": int(X.shape[1]),
            "M": M,
            "control_variates": cv,
            "sample_interval": h,
            "setup_s": setup_s,
            "loop_s": loop_s,
            "events_per_s": out["events"] / loop_s,
            "proposals_per_s": out["proposals"] / loop_s,
            "ess_per_s": out["ess"] / sw.net,
            "sampling_s": loop_s * (num_samples - out["burn_in"]) / num_samples,
            "ess_per_s_sampling": out["ess"] / (loop_s * (num_samples - out["burn_in"]) / num_samples),
            "ess_per_kgrad": 1000 * out["ess"] / max(out["grad_evals_post"], 1),
            "ess_per_kgrad_full_data": 1000 * out["ess"] / max(out["full_data_grad_equiv_post"], 1e-9),
            "events_per_ess": out["events_post"] / max(out["ess"], 1e-9),
            "mcmc_us_per_sample": 1e6 * loop_s / num_samples,
            "sized_from_pilot": {
                "pilot_samples": pilot_samples,
                "pilot_ess": pilot["ess"],
                "wanted": wanted,
                "affordable": affordable,
            },
        }
    )
    # 4. the bare core: one long duration, no per-sample work
    proposers, _ = proposers_from_potential(potential, prior=kernel.prior)
    point = kernel.reference_point
    if kernel.preconditioning is not None:  # the core moves in u = scale^-1 (x - center)
        proposers = precondition(proposers, kernel.preconditioning)
        point = kernel.preconditioning.to_u(point)
    reference = control_variate_reference(proposers, point, order=2 if CV_ON == "second_order" else 1) if cv else None
    core = jax.jit(
        build_kernel(
            proposers,
            reference=reference,
            excess_rates=jnp.zeros(proposers.num),
            grid_size=kernel.grid_size,
            max_proposals=10_000_000,
        )
    )
    state = mcmc.last_state.core
    key = jax.random.PRNGKey(seed + 2)
    events_per_time = max(out["events"] / out["process_time"], 1e-3)
    duration = core_events / events_per_time
    jax.block_until_ready(core(key, state, 0.1 * duration))  # compile
    with Stopwatch() as core_sw:
        _, info = core(key, state, duration)
        jax.block_until_ready(info)
    K, P = kernel.grid_size, proposers.num
    iterations = (int(info.grad_evals_by_proposer.sum()) - int(info.num_proposals)) / (K * P)
    out.update(
        {
            "core_events_per_s": int(info.num_events) / core_sw.net,
            "core_proposals_per_s": int(info.num_proposals) / core_sw.net,
            "core_us_per_iteration": 1e6 * core_sw.net / max(iterations, 1),
            "core_events": int(info.num_events),
            "core_wall_s": core_sw.net,
            "core_violations": int(info.num_violations),
        }
    )
    # 5. the core called once per sample in a compiled scan (no NumPyro)
    n_scan = int(min(scan_samples, num_samples))

    def scan_run(s):
        def body(carry, _):
            key, s = carry
            key, k_sample = jax.random.split(key)
            s, info = core(k_sample, s, h)
            return (key, s), (info.num_events, info.num_proposals)

        return lax.scan(body, (key, s), None, length=n_scan)

    scan_jit = jax.jit(scan_run)
    jax.block_until_ready(scan_jit(state))  # compile
    with Stopwatch() as scan_sw:
        _, (ev, pr) = scan_jit(state)
        jax.block_until_ready(ev)
    out.update(
        {
            "scan_samples": n_scan,
            "scan_us_per_sample": 1e6 * scan_sw.net / n_scan,
            "scan_events_per_s": int(ev.sum()) / scan_sw.net,
        }
    )
    return out


def sweep_interval(X, y, M, sd_min, factors, *, init_params, process_sds, seed=0, cv_init_at_mean=False):
    """ESS/s of MCMC(FedZigZag) with control variates at h = factor * sd_min, for one M, over
    a fixed process time (``process_sds`` posterior sds); returns rows and the best factor."""
    rows = []
    for c in factors:
        h = c * sd_min
        S = int(math.ceil(process_sds * sd_min / h))
        _run_fzz(X, y, M, True, h, 200, init_params, seed + 1, cv_init_at_mean)  # warm
        _, mcmc, sw = _run_fzz(X, y, M, True, h, S, init_params, seed, cv_init_at_mean)
        s = _summarise(mcmc, sw, M, h, 0.1)
        rows.append(
            {
                "factor": c,
                "sample_interval": h,
                "num_samples": S,
                "ess": s["ess"],
                "wall_s": sw.net,
                "ess_per_s": s["ess"] / sw.net,
            }
        )
    best = max(rows, key=lambda r: r["ess_per_s"])
    return rows, best["factor"]


# -- pdmp-jax -----------------------------------------------------------------------------


def bench_pdmp_jax(X, y, x_start, *, num_events, grid_sizes=(10, 2), num_draws=2000):
    try:
        from importlib.metadata import version

        import pdmp_jax

        pdmp_version = version("pdmp-jax")
    except Exception as error:  # not installed, or fails to import with this JAX
        return {"error": f"{type(error).__name__}: {error}"}
    d = X.shape[1]
    grad_U = jax.grad(pooled_potential(X, y))
    runs = []
    for K in grid_sizes:
        try:
            sampler = pdmp_jax.ZigZag(d, grad_U, grid_size=K)  # defaults: tmax=2, adaptive, signed vectorized bound
            x0 = jnp.asarray(x_start, jnp.float64)
            v0 = jnp.ones(d, jnp.float64)
            skeleton = jax.jit(lambda x, v: sampler.sample_skeleton(num_events, x, v, 0, verbose=False))
            jax.block_until_ready(skeleton(x0, v0))  # compile + first run
            with Stopwatch() as sw:
                out = skeleton(x0, v0)
                jax.block_until_ready(out)
            draws = np.asarray(sampler.sample_from_skeleton(num_draws, out))
            ess = min_ess(draws[num_draws // 10 :])
            rejected = int(out.rejected.sum())
            runs.append(
                {
                    "grid_size": K,
                    "events": num_events,
                    "wall_s": sw.net,
                    "compile_s": sw.compile,
                    "events_per_s": num_events / sw.net,
                    "proposals_per_s": (num_events + rejected) / sw.net,
                    "bound_violations": int(out.error_bound.sum()),
                    "rejections": rejected,
                    "horizon_hits": int(out.hitting_horizon.sum()),
                    "process_time": float(out.t[-1] - out.t[0]),
                    "ess": ess,
                    "events_per_ess": 0.9 * num_events / ess,
                    "ess_per_s": 0.9 * ess / sw.net,
                }
            )
        except Exception as error:
            runs.append({"grid_size": K, "error": f"{type(error).__name__}: {error}"})
    return {"version": pdmp_version, "runs": runs}


def bench_hessian_bound(X, y, M, h, init_params, *, num_samples, seed=0):
    """FedZigZag with user-supplied bounds instead of the grid: the logistic potential's
    Hessian bound ``0.25 sum_n |x_n| |x_n|^T`` per client (Appendix F) and the prior's
    identity, control variates on. Its bound needs no evaluation of any client (no full-data
    pass per line), but it is loose, so most proposals are rejected."""
    d = X.shape[1]
    blocks = np.abs(np.asarray(X)).reshape(M, -1, d)
    bounds = nf.HessianBound(clients=0.25 * np.einsum("mni,mnk->mik", blocks, blocks), prior=np.eye(d))
    _run_fzz(X, y, M, True, h, 200, init_params, seed + 1, bounds=bounds)  # compiles what can be cached
    kernel, mcmc, sw = _run_fzz(X, y, M, True, h, num_samples, init_params, seed, bounds=bounds)
    out = _summarise(mcmc, sw, M, h, 0.1)
    out.update(
        {
            "M": M,
            "sample_interval": h,
            "setup_s": kernel.setup_s,
            # as in the main table: switches per second of the sampling loop, ESS per second of the run
            "events_per_s": out["events"] / max(sw.net - kernel.setup_s, 1e-9),
            "proposals_per_event": out["proposals"] / max(out["events"], 1),
            "events_per_ess": out["events_post"] / max(out["ess"], 1e-9),
            "passes_per_ess": out["full_data_grad_equiv_post"] / max(out["ess"], 1e-9),
            "ess_per_s": out["ess"] / out["wall_s"],
        }
    )
    print(
        f"[d={d} M={M} HessianBound, CV on] ESS {out['ess']:.0f}, {out['events_per_s']:.0f} ev/s, "
        f"{out['proposals_per_event']:.1f} proposals per switch, {out['events_per_ess']:.1f} ev/ESS, "
        f"{out['ess_per_s']:.0f} ESS/s",
        flush=True,
    )
    return out


# -- where a core iteration's time goes -----------------------------------------------------


def bench_gradients(X, y, M, *, repeats=2000):
    """Per-call cost, inside one compiled loop, of a full-data gradient and of what one grid
    point of the automatic bound costs (every proposer's gradient and Hessian-vector product)."""
    potential = nf.split_potential(logistic_federated, (X, y), {"clients": M})
    proposers, _ = proposers_from_potential(potential)
    d = X.shape[1]
    grad = jax.grad(
        lambda x: (
            potential.prior_potential_fn(potential.unravel(x))
            + jnp.sum(jax.vmap(potential.client_potential_fn, (None, 0))(potential.unravel(x), potential.client_data))
        )
    )
    v = jnp.ones(d)

    def loop(fn):
        def run(x):
            return lax.fori_loop(0, repeats, lambda i, x: x + 1e-9 * fn(x).sum(), x)

        return jax.jit(run)

    out = {}
    for name, fn in [
        ("full_grad_us", lambda x: grad(x)),
        ("grid_point_all_proposers_us", lambda x: sum(proposers.term_grads_and_slopes(x, v))),
    ]:
        f = loop(fn)
        x0 = jnp.zeros(d)
        jax.block_until_ready(f(x0))
        with Stopwatch() as sw:
            jax.block_until_ready(f(x0))
        out[name] = 1e6 * sw.net / repeats
    return out


# -- driver -------------------------------------------------------------------------------


def fmt(x, digits=3):
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if x == 0:
        return "0"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--preconditioner",
        choices=("none", "laplace", "diagonal"),
        default="none",
        help="FedZigZag's preconditioner (default none: the paper's sampler)",
    )
    parser.add_argument(
        "--cv-order",
        type=int,
        choices=(1, 2),
        default=1,
        help="order of the control variates in the 'CV on' rows: 1 (default, the "
        "paper's) or 2 (control_variates='second_order': the clients' Hessians "
        "at the reference point too)",
    )
    parser.add_argument("--quick", action="store_true", help="d=6, M in {1, 8} only (~2 minutes)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON output path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--report", type=Path, default=None, metavar="JSON", help="only print the tables of an earlier run's JSON"
    )
    parser.add_argument(
        "--dims", type=int, nargs="+", default=None, choices=(6, 20), help="run only these dimensions of the grid"
    )
    parser.add_argument(
        "--cv-init-at-mean",
        action="store_true",
        help="start FedZigZag's search for the control variates' reference point "
        "(BFGS) at NUTS's posterior mean instead of its init_to_uniform point",
    )
    parser.add_argument(
        "--interval-factor",
        type=float,
        default=None,
        help="sample_interval = factor * smallest posterior sd (default: 2 "
        "with --quick, else the best of a small sweep)",
    )
    parser.add_argument(
        "--no-defaults",
        action="store_true",
        help="skip the run of both samplers with MCMC's defaults (progress bar, compilation included; about a minute)",
    )
    args = parser.parse_args(argv)
    global PRECONDITIONER, CV_ON
    PRECONDITIONER = None if args.preconditioner == "none" else args.preconditioner
    CV_ON = "second_order" if args.cv_order == 2 else True
    if args.report is not None:
        results = json.loads(args.report.read_text())
        for key in ("nuts", "interval_sweep"):  # JSON turned the int keys d into strings
            results[key] = {int(k): v for k, v in results[key].items()}
        report(results)
        return

    if args.quick:
        grid = {6: [1, 8]}
        nuts_samples, nuts_warmup = 2000, 500
        target_ess, min_samples, pilot_samples, max_seconds = 600, 1000, 300, 10.0
        core_events, pdmp_events = 20_000, 10_000
    else:
        grid = {6: [1, 4, 8, 16, 64], 20: [1, 4, 16, 64]}
        nuts_samples, nuts_warmup = 2000, 500
        target_ess, min_samples, pilot_samples, max_seconds = 1000, 1000, 300, 30.0
        core_events, pdmp_events = 40_000, 20_000
    if args.dims:
        grid = {d: Ms for d, Ms in grid.items() if d in args.dims}

    started = time.time()
    info = {
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "numpyro": numpyro.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "load_average_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "quick": args.quick,
        "cv_init_at_mean": args.cv_init_at_mean,
        "preconditioner": args.preconditioner,
        "cv_order": args.cv_order,
        "N": NUM_ROWS,
        "seed": args.seed,
        "float64": bool(jax.config.jax_enable_x64),
    }
    print(
        f"FedZigZag benchmark: logistic regression N={NUM_ROWS}, float64, jax {jax.__version__}, "
        f"numpyro {numpyro.__version__}, {os.cpu_count()} CPUs, load {info['load_average_start']}",
        flush=True,
    )

    results = {
        "info": info,
        "nuts": {},
        "fedzigzag": [],
        "interval_sweep": {},
        "pdmp_jax": None,
        "gradients": None,
        "defaults": None,
        "hessian_bound": None,
    }
    if 6 in grid and not args.no_defaults:
        # first, so that its first round is a first run in this process
        X, y, _ = make_data(6, args.seed)
        h = DEFAULTS_INTERVAL_FACTOR * float(laplace_sds(X, y).min())
        print(f"\n[d=6] As users run them (MCMC defaults, compilation included), sample_interval {h:.3f}:", flush=True)
        results["defaults"] = bench_defaults(X, y, h, seed=args.seed)
    for d, Ms in grid.items():
        X, y, _ = make_data(d, args.seed)
        nuts = bench_nuts(X, y, num_warmup=nuts_warmup, num_samples=nuts_samples, seed=args.seed)
        results["nuts"][d] = nuts
        sd_min = min(nuts["posterior_sd"])
        init_params = {"w": jnp.asarray(nuts["posterior_mean"])}
        print(
            f"\n[d={d}] NUTS: min ESS {nuts['ess']:.0f}, warm-up {nuts['warmup_s']:.2f} s + sampling "
            f"{nuts['sampling_s']:.2f} s -> {nuts['ess_per_s']:.0f} ESS/s ({nuts['ess_per_s_sampling']:.0f} "
            f"sampling only); smallest posterior sd {sd_min:.4f}",
            flush=True,
        )
        if args.interval_factor is not None:
            factor = args.interval_factor
        elif args.quick:
            factor = 2.0  # the full run's sweep is flat from 1 sd on (see README)
        else:
            sweep_M = 8 if 8 in Ms else 4
            rows, factor = sweep_interval(
                X,
                y,
                sweep_M,
                sd_min,
                (0.5, 1.0, 2.0, 4.0),
                init_params=init_params,
                process_sds=3000,
                seed=args.seed,
                cv_init_at_mean=args.cv_init_at_mean,
            )
            results["interval_sweep"][d] = {"M": sweep_M, "control_variates": True, "rows": rows, "best_factor": factor}
            print(
                f"[d={d}] sample_interval sweep (M={sweep_M}, control variates): "
                + ", ".join(f"{r['factor']:g} sd -> {r['ess_per_s']:.0f} ESS/s" for r in rows)
                + f"; using {factor:g} sd",
                flush=True,
            )
        h = float(factor * sd_min)
        for M in Ms:
            for cv in (False, True):
                row = bench_fzz(
                    X,
                    y,
                    M,
                    cv,
                    h,
                    init_params=init_params,
                    target_ess=target_ess,
                    min_samples=min_samples,
                    pilot_samples=pilot_samples,
                    max_seconds=max_seconds,
                    seed=args.seed,
                    core_events=core_events,
                    cv_init_at_mean=args.cv_init_at_mean,
                )
                row["interval_factor"] = factor
                row["nuts_ess_per_s"] = nuts["ess_per_s"]
                row["ratio_to_nuts"] = row["ess_per_s"] / nuts["ess_per_s"]
                row["nuts_ess_per_s_sampling"] = nuts["ess_per_s_sampling"]
                row["ratio_to_nuts_sampling"] = row["ess_per_s_sampling"] / nuts["ess_per_s_sampling"]
                results["fedzigzag"].append(row)
                print(
                    f"[d={d} M={M:>2} cv={'on ' if cv else 'off'}] {row['num_samples']} samples, "
                    f"ESS {row['ess']:.0f}, {row['ess_per_s']:.0f} ESS/s, "
                    f"{row['events_per_s']:.0f} ev/s (core {row['core_events_per_s']:.0f}), "
                    f"{row['events_per_ess']:.1f} ev/ESS, wall {row['wall_s']:.1f} s "
                    f"[elapsed {time.time() - started:.0f} s]",
                    flush=True,
                )
        if d == 6:
            results["pdmp_jax"] = bench_pdmp_jax(X, y, nuts["posterior_mean"], num_events=pdmp_events)
            results["gradients"] = {"d": 6, "M": 8, **bench_gradients(X, y, 8)}
            results["hessian_bound"] = bench_hessian_bound(X, y, 8, h, init_params, num_samples=2000, seed=args.seed)

    info["elapsed_s"] = time.time() - started
    info["load_average_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    report(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1, default=float))
    print(f"\nwrote {args.out} ({info['elapsed_s']:.0f} s)")


def report(results):
    rows = results["fedzigzag"]
    info = results.get("info", {})
    second = info.get("cv_order", 1) == 2
    print(
        f"\n(preconditioner: {info.get('preconditioner', 'none')}; control variates in the 'on' rows: "
        f"{'second order' if second else 'first order'})"
    )
    print("\n== FedZigZag (MCMC(FedZigZag), times exclude compilation) vs NUTS on the pooled posterior ==")
    header = [
        "d",
        "M",
        "CV",
        "h",
        "samples",
        "ev/s",
        "prop/s",
        "minESS",
        "ESS/s",
        "NUTS",
        "ratio",
        "ESS/s samp",
        "NUTS",
        "ratio",
        "ESS/kgrad",
        "(full-data)",
        "NUTS",
        "ev/ESS",
        "NOTES",
        "wall s",
        "viol",
        "|gradU(x*)|",
    ]
    table = []
    for r in rows:
        nuts = results["nuts"][r["d"]]
        notes = NOTES_EVENTS_PER_ESS.get((r["M"], r["control_variates"])) if r["d"] == 6 else None
        table.append(
            [
                r["d"],
                r["M"],
                ("2nd" if second else "on") if r["control_variates"] else "off",
                fmt(r["sample_interval"], 2),
                r["num_samples"],
                fmt(r["events_per_s"]),
                fmt(r["proposals_per_s"]),
                fmt(r["ess"]),
                fmt(r["ess_per_s"]),
                fmt(nuts["ess_per_s"]),
                fmt(r["ratio_to_nuts"], 2),
                fmt(r["ess_per_s_sampling"]),
                fmt(nuts["ess_per_s_sampling"]),
                fmt(r["ratio_to_nuts_sampling"], 2),
                fmt(r["ess_per_kgrad"]),
                fmt(r["ess_per_kgrad_full_data"]),
                fmt(nuts["ess_per_kgrad"]),
                fmt(r["events_per_ess"]),
                fmt(notes, 2),
                fmt(r["wall_s"]),
                r["violations"],
                "-" if r.get("reference_grad_norm") is None else f"{r['reference_grad_norm']:.1e}",
            ]
        )
    print_table(header, table)

    print("\n== Where the time goes (per-sample cost and raw speed) ==")
    header = [
        "d",
        "M",
        "CV",
        "core ev/s",
        "core prop/s",
        "us/iter",
        "scan ev/s",
        "scan us/sample",
        "MCMC ev/s",
        "MCMC us/sample",
        "events/sample",
        "setup s",
        "compile s",
        "NOTES ev/s",
    ]
    table = []
    for r in rows:
        table.append(
            [
                r["d"],
                r["M"],
                ("2nd" if second else "on") if r["control_variates"] else "off",
                fmt(r["core_events_per_s"]),
                fmt(r["core_proposals_per_s"]),
                fmt(r["core_us_per_iteration"]),
                fmt(r["scan_events_per_s"]),
                fmt(r["scan_us_per_sample"]),
                fmt(r["events_per_s"]),
                fmt(r["mcmc_us_per_sample"]),
                fmt(r["events"] / r["num_samples"]),
                fmt(r["setup_s"], 2),
                fmt(r["compile_s"], 2),
                NOTES_EVENTS_PER_S.get(r["d"], "-"),
            ]
        )
    print_table(header, table)
    if results.get("gradients"):
        g = results["gradients"]
        print(
            f"Gradient cost inside a compiled loop (d={g['d']}, M={g['M']}): full-data gradient "
            f"{g['full_grad_us']:.1f} us; one grid point of the bound (all proposers' gradients and "
            f"Hessian-vector products) {g['grid_point_all_proposers_us']:.1f} us."
        )

    work = gradient_work(results)
    if work:
        print("\n== Gradient work per effective sample and the ceiling it sets (d=6, CV on) ==")
        print(
            "A pass = every client's gradient and Hessian-vector product at one point (a grid point "
            "of the bound); a client's proposal counts 1/M of a pass. ceiling = 1e6 / (work per ESS x "
            "measured cost of one pass or gradient): ESS/s with no other cost at all."
        )
        header = [
            "sampler",
            "M",
            "passes/ESS",
            "us/pass",
            "ceiling ESS/s",
            "1 pass/switch",
            "ceiling ESS/s",
            "measured ESS/s samp",
        ]
        print_table(
            header,
            [
                [
                    w["sampler"],
                    w["M"],
                    fmt(w["passes_per_ess"]),
                    fmt(w["us_per_pass"]),
                    fmt(w["ceiling"]),
                    fmt(w.get("one_pass_per_event_per_ess")),
                    fmt(w.get("one_pass_ceiling")),
                    fmt(w["measured"]),
                ]
                for w in work
            ],
        )
        hb = results.get("hessian_bound")
        if hb:
            print(
                f"User-supplied Hessian bounds instead (d=6, M={hb['M']}, control variates): no pass per "
                f"line, but {hb['proposals_per_event']:.1f} proposals per switch, each one client's "
                f"gradient: {hb['passes_per_ess']:.1f} passes per ESS ({hb['events_per_ess']:.1f} switches "
                f"per ESS), {hb['events_per_s']:,.0f} switches/s and {hb['ess_per_s']:,.0f} ESS/s inside MCMC."
            )

    if results.get("defaults"):
        print("\n== As users run them: MCMC defaults (progress bar on), wall time INCLUDING compilation, d=6 ==")
        header = ["round", "sampler", "M", "h", "warmup", "samples", "minESS", "wall s", "compile s", "ESS/s"]
        print_table(
            header,
            [
                [
                    r["round"],
                    r["sampler"],
                    r["M"] or "-",
                    fmt(r["sample_interval"], 2),
                    r["num_warmup"],
                    r["num_samples"],
                    fmt(r["ess"]),
                    fmt(r["wall_s"], 2),
                    fmt(r["compile_s"], 2),
                    fmt(r["ess_per_s"]),
                ]
                for r in results["defaults"]
            ],
        )
        print(
            "Round 1 is the first run in the process (every compilation paid); NUTS's loop is cached "
            "in round 2, FedZigZag re-jits its kernel in every init. NOTES.md's NUTS figure (about "
            "750 ESS/s) is of the round-1 kind."
        )

    for d, sweep in results["interval_sweep"].items():
        print(
            f"\nsample_interval sweep, d={d}, M={sweep['M']}, control variates on (MCMC ESS/s): "
            + ", ".join(
                f"h={r['sample_interval']:.3g} ({r['factor']:g} sd): {r['ess_per_s']:.0f}" for r in sweep["rows"]
            )
            + f" -> {sweep['best_factor']:g} sd"
        )

    print("\n== pdmp-jax Zig-Zag on the same single-client target (M=1, d=6) ==")
    pdmp = results["pdmp_jax"]
    ours = [r for r in rows if r["d"] == 6 and r["M"] == 1]
    for r in ours:
        print(
            f"  FedZigZag core (M=1, CV {'on' if r['control_variates'] else 'off'}, K=2): "
            f"{r['core_events_per_s']:,.0f} events/s, {r['core_proposals_per_s']:,.0f} proposals/s"
        )
    if pdmp is None:
        print("  not run (it runs with d=6 in the grid)")
    elif "error" in pdmp:
        print(f"  pdmp-jax unavailable: {pdmp['error']}")
    else:
        for run in pdmp["runs"]:
            if "error" in run:
                print(f"  pdmp-jax {pdmp['version']} grid_size={run['grid_size']}: FAILED: {run['error']}")
            else:
                print(
                    f"  pdmp-jax {pdmp['version']} grid_size={run['grid_size']}: {run['events_per_s']:,.0f} "
                    f"events/s, {run['proposals_per_s']:,.0f} proposals/s, {run['events_per_ess']:.1f} ev/ESS, "
                    f"{run['bound_violations']} bound violations ({run['events']} events)"
                )

    print("\n== Targets from NOTES.md ==")
    for line in targets(results):
        print("  " + line)


def gradient_work(results):
    """Full-data passes per effective sample at d=6 (CV on, and NUTS), from the measured
    counts and the measured in-loop cost of one pass; [] without those measurements."""
    g, nuts = results.get("gradients"), results["nuts"].get(6)
    if not g or not nuts:
        return []
    nuts_grads = nuts["grad_evals"] / nuts["ess"]
    work = [
        {
            "sampler": "NUTS",
            "M": "-",
            "passes_per_ess": nuts_grads,
            "us_per_pass": g["full_grad_us"],
            "ceiling": 1e6 / (nuts_grads * g["full_grad_us"]),
            "measured": nuts["ess_per_s_sampling"],
        }
    ]
    for r in results["fedzigzag"]:
        if r["d"] != 6 or not r["control_variates"]:
            continue
        passes = r["full_data_grad_equiv_post"] / r["ess"]
        work.append(
            {
                "sampler": "FedZigZag",
                "M": r["M"],
                "passes_per_ess": passes,
                "us_per_pass": g["grid_point_all_proposers_us"],
                "ceiling": 1e6 / (passes * g["grid_point_all_proposers_us"]),
                "one_pass_per_event_per_ess": r["events_per_ess"],
                "one_pass_ceiling": 1e6 / (r["events_per_ess"] * g["grid_point_all_proposers_us"]),
                "measured": r["ess_per_s_sampling"],
            }
        )
    return work


def targets(results):
    rows = results["fedzigzag"]
    lines = []

    def find(d, M, cv):
        return next((r for r in rows if r["d"] == d and r["M"] == M and r["control_variates"] == cv), None)

    for cv in (True, False):
        r = find(6, 8, cv)
        if r:
            ok = r["core_events_per_s"] >= TARGET_EVENTS_PER_S
            lines.append(
                f"[{'MET' if ok else 'NOT MET'}] >= 20,000 events/s at d=6, M=8 (CV {'on' if cv else 'off'}): "
                f"bare core {r['core_events_per_s']:,.0f}, inside MCMC {r['events_per_s']:,.0f} "
                f"(prototype: 11-18k)"
            )
    nuts = results["nuts"].get(6)
    for M in (1, 4, 8):
        r = find(6, M, True)
        if r and nuts:
            ok = r["ess_per_s"] >= nuts["ess_per_s"]
            ok_s = r["ess_per_s_sampling"] >= nuts["ess_per_s_sampling"]
            extra = "; prototype at M=8: ~3,400 vs NUTS ~750" if M == 8 else ""
            lines.append(
                f"[{'MET' if ok else 'NOT MET'}] ESS/s >= NUTS at d=6, M={M}, CV on: end-to-end "
                f"{r['ess_per_s']:,.0f} vs NUTS {nuts['ess_per_s']:,.0f} (ratio {r['ratio_to_nuts']:.2f}); "
                f"sampling phase only {r['ess_per_s_sampling']:,.0f} vs {nuts['ess_per_s_sampling']:,.0f} "
                f"(ratio {r['ratio_to_nuts_sampling']:.2f}{', met' if ok_s else ', not met'}){extra}"
            )
    for d in (6, 20):
        r1, r64 = find(d, 1, True), find(d, 64, True)
        if r1 and r64:
            ratio = r64["events_per_ess"] / r1["events_per_ess"]
            lines.append(
                f"[{'MET' if ratio <= 2 else 'NOT MET'}] CV on, events per ESS at M=64 within 2x of M=1 "
                f"(d={d}): {r64['events_per_ess']:.1f} vs {r1['events_per_ess']:.1f} (x{ratio:.2f}; "
                f"prototype d=6: 7.0 vs 5.2)"
            )
    bad = [r for r in rows if (r.get("reference_grad_norm") or 0.0) > 1e-3]
    if bad:
        lines.append(
            "WARNING: the control variates' reference point is not the MAP (|grad U(x*)| > 1e-3; "
            "BFGS in FedZigZag.init stopped early), so these CV rows measure that failure: "
            + ", ".join(f"d={r['d']} M={r['M']} (|grad U| {r['reference_grad_norm']:.3g})" for r in bad)
        )
    low = [r for r in rows if r["ess"] < 300]
    if low:
        lines.append(
            "low ESS (< 300, estimates rough): "
            + ", ".join(
                f"d={r['d']} M={r['M']} CV {'on' if r['control_variates'] else 'off'} ({r['ess']:.0f})" for r in low
            )
        )
    viol = sum(r["violations"] + r["core_violations"] for r in rows)
    lines.append(f"bound violations over all FedZigZag runs: {viol}")
    return lines


def print_table(header, table):
    cells = [header] + [[str(c) for c in row] for row in table]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for k, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if k == 0:
            print("  ".join("-" * w for w in widths))


if __name__ == "__main__":
    main()
