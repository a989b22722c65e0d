"""FedZigZag at scale: NUTS, FedZigZag with full rates and FedZigZag with subsampling as the
number of rows N grows.

Target: Bayesian logistic regression (standard normal covariates, true weights drawn from
N(0, I / d), prior N(0, I)), d in {6, 20}, M = 8 clients (even split), N in {1e3, 1e4, 1e5,
1e6}, in NumPyro's default float32 (``--x64`` for float64). For each (d, N), in this process:

* **NUTS** (NumPyro, the pooled data): ``MCMC(NUTS(model))``;
* **FedZigZag** (full rates: every proposal costs every client a pass over its rows):
  ``MCMC(nf.FedZigZag(model))`` with its defaults (the sample interval adapts in warmup);
* **FedZigZag, subsampled**: ``MCMC(nf.FedZigZag(model, subsample_size=1))`` (each client
  estimates its rate from one random row around the control variates' reference), when the
  installed FedZigZag has ``subsample_size``;
* **pdmp-jax ZigZag** (the single-client Zig-Zag of the ``pdmp-jax`` package, on the pooled
  data, its default grid bounds with adaptive horizon), when ``pdmp_jax`` is importable: it
  has no warmup, so ``EVENTS_PER_DRAW`` skeleton events per warmup draw are run and discarded
  from a start at zero, then as many per draw, from which the draws are read at equal times.

Each sampler runs ``MCMC.warmup`` then ``MCMC.run`` (``--warmup`` and ``--samples`` draws, one
chain) and reports the smallest ESS over the coordinates (NumPyro's estimator) per second, with
compilation included (the wall time of both calls, as a user sees it on a first run) and
excluded (minus the time JAX reports spending on tracing, lowering and compiling inside them),
the effective samples per CPU-second of this process (compilation included: less sensitive to
the load of a shared machine than wall time), the gradient-row evaluations per effective sample
(one row's gradient is one unit: NUTS's leapfrog steps times N; FedZigZag's clients' gradient
evaluations times their rows, warmup included for both), and the peak memory: the largest growth
of the process's resident set during the run over its size before (polled every 5 ms). Ratios
are against NUTS in the same (d, N).

A configuration whose projected time (from the same sampler at the previous N, scaled by its
cost per row) exceeds ``--budget`` seconds is skipped with a printed reason; FedZigZag with full
rates at N = 1e6 is skipped unless ``--budget`` allows it. Nothing hangs: every sampler has a
bounded number of draws and FedZigZag its ``max_proposals`` per draw.

``--sweep`` runs the sample-interval sweep instead: FedZigZag (full rates, d = 6, M = 8) with
fixed ``sample_interval = c x`` the smallest marginal posterior sd (from NUTS) for c in
``--factors``, against the adaptive default, at each N in ``--sizes`` (default 1e3, 1e4, 1e5).

Run ``python benchmarks/zigzag_scale.py`` (the full table, about 30-60 minutes on a 2-core
CPU), ``--quick`` (d = 6, N in {1e3, 1e4, 1e5}, fewer draws: a few minutes),
``--sizes 1000 100000 --dims 6`` for a subset. Results: tables on stdout and
``benchmarks/results/zigzag_scale.json`` (``--out``; a run replaces the rows it measured and
keeps the others); ``--plot docs/assets/zigzag_scale.png`` draws the stored rows. See
``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import json
import math
import os
import platform
import sys
import threading
import time
from pathlib import Path

import numpy as np

import numpyro

if "--x64" in sys.argv:
    numpyro.enable_x64()

import jax  # noqa: E402

# see benchmarks/zigzag.py: compilations must not overlap the timed loops
jax.config.update("jax_cpu_enable_async_dispatch", False)
import jax.numpy as jnp  # noqa: E402

import numpyro.distributions as dist  # noqa: E402
from numpyro.diagnostics import effective_sample_size  # noqa: E402
from numpyro.infer import MCMC, NUTS  # noqa: E402

import numpyro_fed as nf  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "zigzag_scale.json"
NUM_CLIENTS = 8
SIZES = (1_000, 10_000, 100_000, 1_000_000)
SWEEP_SIZES = (1_000, 10_000, 100_000)
FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
#: per sampler, the largest N it runs at unless --budget allows more (FedZigZag with full rates
#: at 1e6: about 1,000 passes over 1e6 rows per 100 effective samples)
DEFAULT_MAX_N = {"FedZigZag": 100_000, "pdmp-jax ZigZag": 100_000}
HAS_SUBSAMPLING = "subsample_size" in inspect.signature(nf.FedZigZag.__init__).parameters
HAS_PDMP_JAX = importlib.util.find_spec("pdmp_jax") is not None
#: pdmp-jax: skeleton events per draw (the Zig-Zag switches about 2-3 times per unit of time
#: per coordinate at d = 6; its draws are then read at equal times along the skeleton)
EVENTS_PER_DRAW = 15


# -- models and data ----------------------------------------------------------------------


def logistic_federated(X, y=None, clients=NUM_CLIENTS, **_):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with nf.federated_plate("data", X.shape[0], clients=clients):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def logistic_pooled(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def make_data(n, d, seed=0):
    """Covariates N(0, I), weights N(0, I / d) (logits of sd about 1 whatever d), labels
    Bernoulli: the posterior contracts like 1 / sqrt(n) without separating."""
    key_x, key_w, key_y = jax.random.split(jax.random.PRNGKey(1000 * seed + d), 3)
    dtype = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
    X = jax.random.normal(key_x, (n, d), dtype)
    w_true = jax.random.normal(key_w, (d,), dtype) / math.sqrt(d)
    y = jax.random.bernoulli(key_y, jax.nn.sigmoid(X @ w_true)).astype(dtype)
    return X, y


# -- timing that excludes compilation, memory ---------------------------------------------

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


def _rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Stopwatch:
    """Wall time of a block, the time JAX spent tracing, lowering and compiling in it (the
    union of its reported spans) and the largest growth of the resident set during it.

    ``memory=False``: no resident-set polling (the poll is a thread that takes the GIL every
    5 ms; a timing compared with one measured without it, a bare Ray round trip, turns it off
    so that both run alike)."""

    def __init__(self, memory: bool = True):
        self._memory = memory

    def __enter__(self):
        self._first = len(_SPANS)
        self._base = _rss()
        self.peak = self._base
        self._stop = threading.Event()

        def poll():
            while not self._stop.wait(0.005):
                self.peak = max(self.peak, _rss())

        if self._memory:
            self._thread = threading.Thread(target=poll, daemon=True)
            self._thread.start()
        self.start = time.time()
        self._cpu = time.process_time()
        return self

    def __exit__(self, *exc):
        self.end = time.time()
        self.cpu = time.process_time() - self._cpu
        self._stop.set()
        if self._memory:
            self._thread.join()
        self.peak = max(self.peak, _rss())
        self.memory = self.peak - self._base
        merged, cur = 0.0, None
        for s, e in sorted(_SPANS[self._first :]):
            s, e = max(s, self.start), min(e, self.end)
            if e <= s:
                continue
            if cur is None or s > cur[1]:
                if cur is not None:
                    merged += cur[1] - cur[0]
                cur = [s, e]
            else:
                cur[1] = max(cur[1], e)
        if cur is not None:
            merged += cur[1] - cur[0]
        self.wall = self.end - self.start
        self.compile = merged
        self.net = max(self.wall - merged, 1e-9)
        return False


def min_ess(draws):
    return float(np.min(effective_sample_size(np.asarray(draws, np.float64)[None])))


# -- the samplers -------------------------------------------------------------------------


def run_nuts(X, y, *, num_warmup, num_samples, seed):
    mcmc = MCMC(NUTS(logistic_pooled), num_warmup=num_warmup, num_samples=num_samples, progress_bar=False)
    with Stopwatch() as sw:
        mcmc.warmup(jax.random.PRNGKey(seed), X, y, collect_warmup=True, extra_fields=("num_steps",))
        warm_steps = int(np.sum(mcmc.get_extra_fields()["num_steps"]))
        mcmc.run(jax.random.PRNGKey(seed + 1), X, y, extra_fields=("num_steps",))
        draws = np.asarray(mcmc.get_samples()["w"])
    steps = warm_steps + int(np.sum(mcmc.get_extra_fields()["num_steps"]))
    return draws, sw, {"gradient_rows": steps * X.shape[0], "leapfrog_steps": steps}


def fedzigzag_rows(kernel, fields):
    """Gradient-row evaluations of a FedZigZag run: its ``grad_row_evals`` statistic when it
    reports one (a subsampled run evaluates a few rows per proposal), else the clients'
    gradient evaluations times their rows (the server's prior proposer, if any, holds none)."""
    stats = kernel.sample_stats({name: np.asarray(value)[None] for name, value in fields.items()})
    if "grad_row_evals" in stats:
        return int(np.sum(np.asarray(stats["grad_row_evals"][0], np.int64)))
    sizes = np.asarray(kernel.federated_potential.client_sizes, np.int64)
    evals = np.asarray(fields["info.grad_evals_by_proposer"], np.int64).sum(0)
    return int(np.sum(evals[: len(sizes)] * sizes))


def run_fedzigzag(X, y, *, num_warmup, num_samples, seed, sample_interval=None, **options):
    fields = tuple(f"info.{name}" for name in nf.FedZigZag.info_names) + ("adapt.interval",)
    kernel = nf.FedZigZag(logistic_federated, sample_interval=sample_interval, **options)
    mcmc = MCMC(kernel, num_warmup=num_warmup, num_samples=num_samples, progress_bar=False)
    with Stopwatch() as sw:
        mcmc.warmup(jax.random.PRNGKey(seed), X, y, collect_warmup=True, extra_fields=fields)
        warm = mcmc.get_extra_fields()
        mcmc.run(jax.random.PRNGKey(seed + 1), X, y, extra_fields=fields)
        draws = np.asarray(mcmc.get_samples()["w"])
    post = mcmc.get_extra_fields()
    rows = fedzigzag_rows(kernel, warm) + fedzigzag_rows(kernel, post)
    return (
        draws,
        sw,
        {
            "gradient_rows": rows,
            "events": int(np.sum(warm["info.num_events"]) + np.sum(post["info.num_events"])),
            "proposals": int(np.sum(warm["info.num_proposals"]) + np.sum(post["info.num_proposals"])),
            "violations": int(np.sum(warm["info.num_violations"]) + np.sum(post["info.num_violations"])),
            "sample_interval": float(np.asarray(post["adapt.interval"])[-1]),
        },
    )


def run_pdmp_jax(X, y, *, num_warmup, num_samples, seed, grid_size=10):
    """pdmp-jax's ZigZag on the pooled potential: no warmup of its own, so the skeleton of
    ``EVENTS_PER_DRAW * num_warmup`` events from zero is discarded and the next
    ``EVENTS_PER_DRAW * num_samples`` events give ``num_samples`` draws at equal times.

    Gradient rows are counted from its output: each skeleton event evaluates the bound on its
    grid (``grid_size`` gradients, once more per hit horizon or bound error) and the rate at
    each proposal (accepted, rejected or in error), and once more at the switch; a gradient
    differentiated along the time grid (``jvp``) counts as one: a lower bound of its work."""
    from pdmp_jax import ZigZag

    d = X.shape[1]

    def grad_u(w):
        logits = X @ w
        return X.T @ (jax.nn.sigmoid(logits) - y) + w

    sampler = ZigZag(d, grad_u, grid_size=grid_size)
    zero = jnp.zeros(d, X.dtype)
    velocity = jnp.ones(d, X.dtype)

    def grads(out):
        proposals = 1 + np.asarray(out.rejected) + np.asarray(out.error_bound)
        bounds = 1 + np.asarray(out.hitting_horizon) + np.asarray(out.error_bound)
        return int(np.sum(grid_size * bounds + proposals + 1))

    with Stopwatch() as sw:
        warm = sampler.sample_skeleton(EVENTS_PER_DRAW * num_warmup, zero, velocity, seed, verbose=False)
        x0, v0 = warm.x[-1], warm.v[-1]
        out = sampler.sample_skeleton(EVENTS_PER_DRAW * num_samples, x0, v0, seed + 1, verbose=False)
        draws = np.asarray(sampler.sample_from_skeleton(num_samples, out))
    return (
        draws,
        sw,
        {
            "gradient_rows": (grads(warm) + grads(out)) * X.shape[0],
            "events": int(out.t.shape[0] - 1 + warm.t.shape[0] - 1),
        },
    )


SAMPLERS = {
    "NUTS": run_nuts,
    "FedZigZag": run_fedzigzag,
    "FedZigZag(subsample_size=1)": lambda X, y, **kw: run_fedzigzag(X, y, subsample_size=1, **kw),
    # the estimate of the first release of subsampling, kept for comparison (not run by default)
    "FedZigZag(subsample_size=1, first order)": lambda X, y, **kw: run_fedzigzag(
        X, y, subsample_size=1, control_variates="first_order", **kw
    ),
    "pdmp-jax ZigZag": run_pdmp_jax,
}
#: run when --samplers is not given (if available)
DEFAULT_SAMPLERS = ("NUTS", "FedZigZag", "FedZigZag(subsample_size=1)", "pdmp-jax ZigZag")


def measure(name, X, y, *, num_warmup, num_samples, seed, **options):
    draws, sw, counts = SAMPLERS[name](X, y, num_warmup=num_warmup, num_samples=num_samples, seed=seed, **options)
    ess = min_ess(draws)
    finite = bool(np.all(np.isfinite(draws)))
    return {
        "sampler": name,
        "N": int(X.shape[0]),
        "d": int(X.shape[1]),
        "num_warmup": num_warmup,
        "num_samples": num_samples,
        "ess": ess,
        "finite": finite,
        "wall_s": sw.wall,
        "compile_s": sw.compile,
        "net_s": sw.net,
        "ess_per_s": ess / sw.net,
        "ess_per_s_with_compile": ess / sw.wall,
        "cpu_s": sw.cpu,
        "ess_per_cpu_s_with_compile": ess / sw.cpu,
        "rows_per_ess": counts["gradient_rows"] / max(ess, 1e-9),
        "peak_memory_mb": sw.memory / 2**20,
        "posterior_mean": draws.mean(0).tolist(),
        "posterior_sd": draws.std(0).tolist(),
        **counts,
    }


# -- the scale table ----------------------------------------------------------------------


def scale_table(sizes, dims, samplers, *, num_warmup, num_samples, budget, seed):
    rows = []
    for d in dims:
        previous = {}  # sampler -> (N, compilation time, the rest) of its last run
        for n in sizes:
            X, y = make_data(n, d, seed)
            for name in samplers:
                reason = None
                limit = DEFAULT_MAX_N.get(name)
                if name in previous:
                    last_n, last_compile, last_net = previous[name]
                    # compilation does not grow with N; the sampling of NUTS and of full-rate
                    # FedZigZag costs about N per draw, the subsampled one's far less
                    projected = last_compile + last_net * (n / last_n if "subsample" not in name else 1.0)
                    if projected > budget:
                        reason = f"projected {projected:.0f} s from N={last_n} exceeds --budget {budget:.0f} s"
                if limit is not None and n > limit and reason is None and budget < 10_000:
                    reason = (
                        f"N={n} is above {limit} for {name} (every proposal is a pass over all "
                        "rows: about 10x the time of the previous N); --budget 10000 runs it"
                    )
                if reason:
                    print(f"[skip] d={d} N={n} {name}: {reason}", flush=True)
                    rows.append({"sampler": name, "N": n, "d": d, "skipped": reason})
                    continue
                row = measure(name, X, y, num_warmup=num_warmup, num_samples=num_samples, seed=seed)
                previous[name] = (n, row["compile_s"], row["net_s"])
                rows.append(row)
                print(
                    f"[d={d} N={n}] {name}: min-ESS {row['ess']:.0f}, {row['ess_per_s']:.1f} ESS/s "
                    f"({row['ess_per_s_with_compile']:.1f} with compilation), "
                    f"{row['rows_per_ess']:.3g} gradient rows per ESS, {row['peak_memory_mb']:.0f} MB",
                    flush=True,
                )
            del X, y
    return rows


def print_scale(rows):
    print()
    print(
        "| d | N | sampler | min-ESS | ESS/s | ESS/s with compilation | vs NUTS | ESS per CPU-s | vs NUTS "
        "| gradient rows / ESS | vs NUTS | peak memory (MB) | wall (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    nuts = {(r["d"], r["N"]): r for r in rows if r["sampler"] == "NUTS" and "skipped" not in r}
    for r in rows:
        if "skipped" in r:
            print(f"| {r['d']} | {r['N']:,} | {r['sampler']} | skipped: {r['skipped']} | | | | | | | | | |")
            continue
        ref = nuts.get((r["d"], r["N"]))
        speed = f"{r['ess_per_s'] / ref['ess_per_s']:.2f}" if ref else "-"
        cost = f"{r['rows_per_ess'] / ref['rows_per_ess']:.3g}" if ref else "-"
        cpu = r.get("ess_per_cpu_s_with_compile", float("nan"))
        cpu_ratio = f"{cpu / ref.get('ess_per_cpu_s_with_compile', float('nan')):.2f}" if ref else "-"
        print(
            f"| {r['d']} | {r['N']:,} | {r['sampler']} | {r['ess']:.0f} | {r['ess_per_s']:.1f} | "
            f"{r['ess_per_s_with_compile']:.1f} | {speed} | {cpu:.1f} | {cpu_ratio} | "
            f"{r['rows_per_ess']:.3g} | {cost} | "
            f"{r['peak_memory_mb']:.0f} | {r['wall_s']:.1f} |"
        )
    print()
    for d in sorted({r["d"] for r in rows}):
        for name in sorted({r["sampler"] for r in rows}):
            by_n = {r["N"]: r for r in rows if r["d"] == d and r["sampler"] == name and "skipped" not in r}
            if 10_000 in by_n and 1_000_000 in by_n:
                growth = by_n[1_000_000]["rows_per_ess"] / by_n[10_000]["rows_per_ess"]
                print(f"d={d} {name}: gradient rows per ESS grow {growth:.3g}x from N=1e4 to N=1e6")


STYLE = {
    "NUTS": ("black", "o"),
    "FedZigZag": ("tab:blue", "s"),
    "FedZigZag(subsample_size=1)": ("tab:red", "^"),
    "FedZigZag(subsample_size=1, first order)": ("tab:orange", "v"),
    "pdmp-jax ZigZag": ("tab:green", "D"),
}


def plot_scale(rows, path=None):
    """The scale table (``measure``'s rows) as a figure: min-ESS per second against N (log-log)
    for each d, compilation excluded (solid) and included (dotted), and the gradient rows per
    effective sample. Saved to ``path`` if given; returns the figure."""
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "skipped" not in r]
    dims = sorted({r["d"] for r in rows})
    samplers = [s for s in STYLE if any(r["sampler"] == s for r in rows)]
    fig, axes = plt.subplots(1, len(dims) + 1, figsize=(5.2 * (len(dims) + 1) + 3.0, 4.2))
    for ax, d in zip(axes, dims):
        for name in samplers:
            these = sorted((r for r in rows if r["d"] == d and r["sampler"] == name), key=lambda r: r["N"])
            if not these:
                continue
            color, marker = STYLE[name]
            n = [r["N"] for r in these]
            ax.loglog(n, [r["ess_per_s"] for r in these], color=color, marker=marker, label=name)
            ax.loglog(
                n, [r["ess_per_s_with_compile"] for r in these], color=color, marker=marker, linestyle=":", alpha=0.6
            )
        ax.set_title(f"logistic regression, d = {d}, M = {NUM_CLIENTS}")
        ax.set_xlabel("rows N")
        ax.set_ylabel("min-ESS per second")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(
        title="solid: compilation excluded\ndotted: included", fontsize=7, title_fontsize=7, loc="lower left"
    )
    ax = axes[-1]
    for name in samplers:
        color, marker = STYLE[name]
        for d, style in zip(dims, ("-", "--", "-.")):
            these = sorted(
                (
                    r
                    for r in rows
                    if r["d"] == d and r["sampler"] == name and np.isfinite(r.get("rows_per_ess", np.nan))
                ),
                key=lambda r: r["N"],
            )
            if these:
                ax.loglog(
                    [r["N"] for r in these],
                    [r["rows_per_ess"] for r in these],
                    color=color,
                    marker=marker,
                    linestyle=style,
                    label=f"{name}, d = {d}",
                )
    ax.set_title("cost per effective sample")
    ax.set_xlabel("rows N")
    ax.set_ylabel("gradient-row evaluations per effective sample")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
        print(f"wrote {path}")
    return fig


# -- the sample-interval sweep ------------------------------------------------------------


def sweep(sizes, factors, *, d, num_warmup, num_samples, seed):
    rows = []
    for n in sizes:
        X, y = make_data(n, d, seed)
        nuts = measure("NUTS", X, y, num_warmup=num_warmup, num_samples=num_samples, seed=seed)
        sd_min = float(np.min(nuts["posterior_sd"]))
        print(f"[sweep N={n}] NUTS: smallest posterior sd {sd_min:.4g}", flush=True)
        runs = [("adaptive", None)] + [(c, c * sd_min) for c in factors]
        for label, h in runs:
            row = measure(
                "FedZigZag", X, y, num_warmup=num_warmup, num_samples=num_samples, seed=seed, sample_interval=h
            )
            row.update({"factor": label, "sd_min": sd_min})
            rows.append(row)
            print(
                f"[sweep N={n}] interval {label}: h = {row['sample_interval']:.4g} "
                f"({row['sample_interval'] / sd_min:.2f} sd), min-ESS {row['ess']:.0f}, "
                f"{row['ess_per_s']:.1f} ESS/s ({row['ess_per_s_with_compile']:.1f} with compilation), "
                f"{row['rows_per_ess']:.3g} gradient rows per ESS",
                flush=True,
            )
    return rows


def print_sweep(rows):
    print()
    sizes = sorted({r["N"] for r in rows})
    print("| N | " + " | ".join(f"{r['factor']}" for r in rows if r["N"] == sizes[0]) + " | adaptive / best fixed |")
    print("|---|" + "---|" * (sum(r["N"] == sizes[0] for r in rows) + 1))
    for n in sizes:
        these = [r for r in rows if r["N"] == n]
        fixed = [r for r in these if r["factor"] != "adaptive"]
        adaptive = next(r for r in these if r["factor"] == "adaptive")
        cells = [
            f"{r['ess_per_s']:.1f}"
            + (f" (h={r['sample_interval'] / r['sd_min']:.2f} sd)" if r["factor"] == "adaptive" else "")
            for r in these
        ]
        ratio = "-"
        if fixed:
            best = max(fixed, key=lambda r: r["ess_per_s"])
            ratio = f"{adaptive['ess_per_s'] / best['ess_per_s']:.2f} (best: {best['factor']} sd)"
        print(f"| {n:,} | " + " | ".join(cells) + f" | {ratio} |")
    print(
        "\n(ESS/s, compilation excluded; columns: the adaptive default, then sample_interval = c x "
        "the smallest posterior sd)\n"
    )
    print("| N | " + " | ".join(f"{r['factor']}" for r in rows if r["N"] == sizes[0]) + " |")
    print("|---|" + "---|" * sum(r["N"] == sizes[0] for r in rows))
    for n in sizes:
        print(f"| {n:,} | " + " | ".join(f"{r['rows_per_ess']:.3g}" for r in rows if r["N"] == n) + " |")
    print("\n(gradient-row evaluations per effective sample, warmup included: counts, not times)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="N values (default 1e3..1e6)")
    parser.add_argument("--dims", type=int, nargs="+", default=None, help="d values (default 6 20)")
    parser.add_argument(
        "--samplers",
        nargs="+",
        default=None,
        choices=tuple(SAMPLERS),
        help="default: all (the subsampled one if FedZigZag has subsample_size, pdmp-jax's if pdmp_jax is importable)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="d=6, N in {1e3, 1e4, 1e5}, 500 warmup and 1000 draws (a few minutes)"
    )
    parser.add_argument("--warmup", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--budget", type=float, default=600.0, help="skip a run projected to take longer (seconds)")
    parser.add_argument("--sweep", action="store_true", help="the sample_interval sweep (d=6, M=8)")
    parser.add_argument(
        "--factors",
        type=float,
        nargs="*",
        default=FACTORS,
        help="fixed intervals in smallest posterior sds (none: the adaptive run only)",
    )
    parser.add_argument("--x64", action="store_true", help="float64 (default: NumPyro's float32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="PNG",
        help="draw the scale table stored in --out to this file, run nothing",
    )
    args = parser.parse_args(argv)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        plot_scale(json.loads(args.out.read_text())["scale"], args.plot)
        return
    num_warmup, num_samples = (500, 1000) if args.quick else (args.warmup, args.samples)
    dims = args.dims or ((6,) if args.quick or args.sweep else (6, 20))
    meta = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "argv": sys.argv[1:],
        "jax": jax.__version__,
        "numpyro": numpyro.__version__,
        "python": platform.python_version(),
        "loadavg": os.getloadavg(),
        "x64": bool(args.x64),
        "subsampling_available": HAS_SUBSAMPLING,
    }
    print(
        f"JAX {jax.__version__}, NumPyro {numpyro.__version__}, load average {os.getloadavg()[0]:.1f} "
        f"(a shared machine: times vary), {'float64' if args.x64 else 'float32'}",
        flush=True,
    )
    if args.sweep:
        sizes = args.sizes or ((1_000, 10_000) if args.quick else SWEEP_SIZES)
        rows = sweep(sizes, args.factors, d=dims[0], num_warmup=num_warmup, num_samples=num_samples, seed=args.seed)
        print_sweep(rows)
        out = {"sweep_meta": meta, "sweep": rows}
    else:
        sizes = args.sizes or ((1_000, 10_000, 100_000) if args.quick else SIZES)
        samplers = args.samplers or [
            s
            for s in DEFAULT_SAMPLERS
            if (HAS_SUBSAMPLING or "subsample" not in s) and (HAS_PDMP_JAX or s != "pdmp-jax ZigZag")
        ]
        if not HAS_SUBSAMPLING:
            print("[skip] FedZigZag(subsample_size=1): this FedZigZag has no subsample_size", flush=True)
        if not HAS_PDMP_JAX:
            print("[skip] pdmp-jax ZigZag: pdmp_jax is not importable (see benchmarks/README.md)", flush=True)
        rows = scale_table(
            sizes, dims, samplers, num_warmup=num_warmup, num_samples=num_samples, budget=args.budget, seed=args.seed
        )
        print_scale(rows)
        out = {"scale_meta": meta, "scale": rows}
    meta["loadavg_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    for row in out.get("scale", []):
        row["run"] = meta["started"]  # which entry of scale_meta measured it
    if "scale" in out and "scale" in previous:
        # a scale run replaces the rows it measured (same sampler, d and N) and keeps the others
        fresh = {(r["sampler"], r["d"], r["N"]) for r in out["scale"]}
        out["scale"] = [r for r in previous["scale"] if (r["sampler"], r["d"], r["N"]) not in fresh] + out["scale"]
        before = previous.get("scale_meta", [])
        out["scale_meta"] = (before if isinstance(before, list) else [before]) + [meta]
    elif "scale" in out:
        out["scale_meta"] = [meta]
    previous.update(out)  # a sweep and a scale table share the file
    args.out.write_text(json.dumps(previous, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
