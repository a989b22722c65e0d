"""Every algorithm's core on two (or more) JAX installations, in one session.

The driver runs this same script as a worker under each given interpreter (one virtual
environment per JAX version), alternating between them round after round, so that the load
of a shared machine falls on every version alike. A worker times, on small fixed problems
(logistic regression, 400 rows, 4 weights, 4 clients, float64):

* ``FedZigZag`` and ``DADMMS``: ``MCMC.run`` from the post-warm-up state (the sampling loop
  only, already compiled by a first run);
* ``DSVGD`` and ``DPPVI``: ``run`` of a few rounds, after a first run that compiles.

Each worker reports the first (compiling) call and the median of ``--reps`` warm calls. The
driver prints, per algorithm and installation, the median over rounds of the workers'
medians, its spread (min-max over rounds) and the ratio to the first installation, and writes
everything to ``benchmarks/results/jax_versions.json``.

    python benchmarks/jax_versions.py --python /work/venv312-jax010/bin/python \\
        --python /work/venv312/bin/python --rounds 3 --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "jax_versions.json"
ALGORITHMS = ("FedZigZag", "DADMMS", "DSVGD", "DPPVI")

__all__ = ["main"]


# -- worker -----------------------------------------------------------------------------------


def _problem(num_rows=400, dim=4, num_clients=4, seed=0):
    import numpy as np

    import jax.numpy as jnp

    import numpyro
    import numpyro.distributions as dist

    import numpyro_fed as nf

    rng = np.random.default_rng(seed)
    X = rng.normal(size=(num_rows, dim))
    w_true = rng.normal(size=dim)
    y = (rng.uniform(size=num_rows) < 1 / (1 + np.exp(-X @ w_true))).astype(np.float64)

    def model(X, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        with nf.federated_plate("data", X.shape[0], clients=num_clients):
            numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)

    return model, (jnp.asarray(X), jnp.asarray(y))


def _cpu_seconds():
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


CPU_TIMES: list[float] = []  # the process CPU time of every timed call, in order


def _time(fn):
    """Wall time of ``fn()`` (its result ready); its CPU time (all threads) goes to
    ``CPU_TIMES``: less disturbed than wall time by other processes on a shared machine."""
    import jax

    start, cpu = time.perf_counter(), _cpu_seconds()
    jax.block_until_ready(fn())
    CPU_TIMES.append(_cpu_seconds() - cpu)
    return time.perf_counter() - start


def _bench_mcmc(kernel, args, *, num_warmup, num_samples, reps):
    import jax

    from numpyro.infer import MCMC

    mcmc = MCMC(kernel, num_warmup=num_warmup, num_samples=num_samples, progress_bar=False)
    first = _time(lambda: (mcmc.run(jax.random.PRNGKey(0), *args), mcmc.get_samples())[1])
    mcmc.post_warmup_state = mcmc.last_state
    # the sampling loop alone: compiled once here, then timed warm
    compile_sampling = _time(lambda: (mcmc.run(jax.random.PRNGKey(1), *args), mcmc.get_samples())[1])
    warm = []
    for i in range(reps):
        mcmc.post_warmup_state = mcmc.last_state
        warm.append(_time(lambda: (mcmc.run(jax.random.PRNGKey(2 + i), *args), mcmc.get_samples())[1]))
    return {"first": first + compile_sampling, "warm": warm, "warm_cpu": CPU_TIMES[-reps:]}


def _bench_run(method, args, *, num_rounds, reps):
    import jax

    first = _time(lambda: method.run(jax.random.PRNGKey(0), num_rounds, *args).state)
    warm = [_time(lambda: method.run(jax.random.PRNGKey(1 + i), num_rounds, *args).state) for i in range(reps)]
    return {"first": first, "warm": warm, "warm_cpu": CPU_TIMES[-reps:]}


def worker(reps: int, only=None) -> dict:
    import warnings

    import jax

    import numpyro

    numpyro.enable_x64()
    import numpyro_fed as nf

    warnings.simplefilter("ignore")
    model, args = _problem()
    cases = {
        "FedZigZag": lambda: _bench_mcmc(nf.FedZigZag(model), args, num_warmup=200, num_samples=1000, reps=reps),
        "DADMMS": lambda: _bench_mcmc(nf.DADMMS(model), args, num_warmup=100, num_samples=500, reps=reps),
        "DSVGD": lambda: _bench_run(
            nf.DSVGD(model, num_particles=10, num_local_steps=50, num_distill_steps=50, progress_bar=False),
            args,
            num_rounds=2,
            reps=reps,
        ),
        "DPPVI": lambda: _bench_run(
            nf.DPPVI(model, num_local_steps=100, progress_bar=False), args, num_rounds=2, reps=reps
        ),
    }
    results = {name: case() for name, case in cases.items() if not only or name in only}
    import jaxlib

    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "python": sys.version.split()[0], "results": results}


# -- driver -----------------------------------------------------------------------------------


def _run_worker(python, reps, only):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [python, str(Path(__file__).resolve()), "--worker", "--reps", str(reps)]
    if only:
        cmd += ["--only", *only]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{python} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarise(runs: dict[str, list[dict]]) -> dict:
    """Per installation and algorithm: the median over rounds of each round's warm median,
    its min and max over rounds, and the median first (compiling) call."""
    table = {}
    for label, rounds in runs.items():
        table[label] = {}
        for name in rounds[0]["results"]:
            medians = [statistics.median(r["results"][name]["warm"]) for r in rounds]
            firsts = [r["results"][name]["first"] for r in rounds]
            cpu = [statistics.median(r["results"][name]["warm_cpu"]) for r in rounds]
            table[label][name] = {
                "warm_median": statistics.median(medians),
                "warm_min": min(medians),
                "warm_max": max(medians),
                "first_median": statistics.median(firsts),
                "warm_cpu_median": statistics.median(cpu),
                "warm_cpu_min": min(cpu),
                "warm_cpu_max": max(cpu),
            }
    return table


def print_table(table: dict) -> None:
    labels = list(table)
    base = labels[0]
    print(
        f"{'algorithm':<10} {'jax':<10} {'warm wall s (min-max)':<24} {'ratio':>6} "
        f"{'warm CPU s (min-max)':<24} {'ratio':>6} {'first call s':>12} {'ratio':>6}"
    )
    for name in table[base]:
        for label in labels:
            row, ref = table[label][name], table[base][name]
            wall = f"{row['warm_median']:.2f} ({row['warm_min']:.2f}-{row['warm_max']:.2f})"
            cpu = f"{row['warm_cpu_median']:.2f} ({row['warm_cpu_min']:.2f}-{row['warm_cpu_max']:.2f})"
            print(
                f"{name:<10} {label:<10} {wall:<24} {row['warm_median'] / ref['warm_median']:>6.2f} "
                f"{cpu:<24} {row['warm_cpu_median'] / ref['warm_cpu_median']:>6.2f} "
                f"{row['first_median']:>12.2f} {row['first_median'] / ref['first_median']:>6.2f}"
            )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--python",
        action="append",
        default=None,
        help="an interpreter with its own JAX (repeat; the first is the reference)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds over the interpreters")
    parser.add_argument("--reps", type=int, default=5, help="warm calls per algorithm and worker")
    parser.add_argument("--only", nargs="+", choices=ALGORITHMS, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.reps, args.only)))
        return
    pythons = args.python or [sys.executable]
    runs: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        for python in pythons:
            result = _run_worker(python, args.reps, args.only)
            label = f"{result['jax']}"
            runs.setdefault(label, []).append(result)
            print(f"round {r + 1}/{args.rounds}: jax {label} done", file=sys.stderr, flush=True)
    table = summarise(runs)
    print_table(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"summary": table, "runs": runs, "rounds": args.rounds, "reps": args.reps, "pythons": pythons}, indent=1
        )
    )
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
