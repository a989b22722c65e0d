"""What to pick: every algorithm at its defaults on the same posteriors, against NUTS on the pooled data.

Cases (``--cases``), each with M = 8 clients, float64:

* ``logistic``: Bayesian logistic regression, an intercept ``b ~ N(0, 5)`` and ``d`` weights
  ``w ~ N(0, 2)`` on raw covariates whose scales run from 1 to 100 (geometric), N rows split
  evenly over the clients; N in ``--sizes`` (default 1e5 and 1e6) and d in ``--dims`` (6, 20);
* ``hierarchical``: a radon-like varying-intercept model: ``mu_a``, ``sigma_a ~ HalfCauchy``,
  a floor effect ``b``, ``sigma_y ~ HalfCauchy``, and one intercept per group, 3 groups per
  client, the groups' intercepts client-local latent variables (a ``federated_plate`` over the
  groups owned by their clients, as the data plate is); 24 groups, 5 to 40 rows each;
* ``biased``: the logistic model on 96 rows (8 clients of 12 rows, a rare outcome): every
  sub-posterior is skewed, so consensus Monte Carlo's Gaussian combination is biased (the case
  of ``test_small_skewed_clients_warn_with_the_statistic``).

Algorithms (``--algorithms``), at their defaults and the run lengths a NumPyro user would pick
(those of the zoo's ``RUN_LENGTHS``):

* ``FedZigZag``: ``MCMC(nf.FedZigZag(model), num_warmup=500, num_samples=1000)``;
* ``FedZigZag-sub``: the same with ``subsample_size=--subsample-size`` (default 1);
* ``DPPVI``: ``nf.DPPVI(model).run(key, 10)`` (non-private), 2000 draws of ``q``;
* ``DSVGD``: ``nf.DSVGD(model).run(key, max(10, 2 M))``, its particles' 2000 draws;
* ``DADMMS``: ``MCMC(nf.DADMMS(model), num_warmup=50, num_samples=50, num_chains=100,
  chain_method="vectorized")`` (the paper's protocol: independent runs of the network);
* ``ConsensusMC``: ``nf.ConsensusMC(model).run(key, ...)`` (NUTS on every sub-posterior, 500
  warm-up steps and 1000 draws, Scott et al.'s combination, each client's expected Hessian
  as its weight).

The reference is NumPyro NUTS on the pooled data (``numpyro.plate``-equivalent: the same model
run by ``MCMC(NUTS(model, regularize_mass_matrix=False), num_warmup=500, num_samples=1500)``;
without the shrinkage of its adapted variances towards 1e-3, which on the raw covariates'
coefficients, whose posterior variances are 1e-8 and less, makes its trees about ten times
deeper), run by this script (once per
case; kept in the JSON and reused by later partial runs unless ``--fresh-reference``).

Columns: the worst |mean error| over the global coordinates (constrained) in reference sds; the
worst sd ratio as ``max(r, 1/r)``; the rounds and bytes from the run's message ledger
(``nf.message_ledger``: to and from the clients, and between agents); the wall time of the run
as a user sees it (construction, compilation, the clients' start on Ray, the run and the
draws); and, for the samplers (FedZigZag, DADMMS, ConsensusMC, NUTS), the smallest effective
sample size over the global coordinates per second of that wall time. Warnings the run raised
are kept in the JSON (their first line in the table's notes).

Every (case, algorithm) runs in its own child process, bounded by ``--timeout`` seconds: a run
that does not finish is killed and recorded as a time-out; one that raises is recorded with its
error. With ``--backend ray`` the script starts one local Ray with ``--workers`` CPUs (its
worker slots; each client is one actor reserving no CPU, as ``nf.RayFederation`` places them),
the children join it (``nf.RayFederation(address=...)``), and it is shut down at the end.

Run ``python benchmarks/what_to_pick.py --backend ray --workers 4 --cases logistic --sizes 1e5
--dims 6`` (a part), or without options for the whole grid (hours on a loaded 2-core machine).
Results: ``benchmarks/results/what_to_pick.json`` (merged with earlier runs' cells) and the
markdown table on stdout; ``--report`` reprints the table from the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results" / "what_to_pick.json"
NUM_CLIENTS = 8
ALGORITHMS = ("FedZigZag", "FedZigZag-sub", "DPPVI", "DSVGD", "DADMMS", "ConsensusMC")
SAMPLERS = ("NUTS", "FedZigZag", "FedZigZag-sub", "DADMMS", "ConsensusMC")
CASES = ("logistic", "hierarchical", "biased")
#: warnings left out of the table's notes (ArviZ's guess at DADMMS's 100 chains of 50 draws)
NOISE = ("UserWarning: Found chain dimension",)

# -- the models and their data (module level: the clients' functions pickle by reference) -----
GROUPS_PER_CLIENT = 3
NUM_GROUPS = GROUPS_PER_CLIENT * NUM_CLIENTS


def logistic(X, y=None):
    import numpyro
    import numpyro.distributions as dist

    import numpyro_fed as nf

    b = numpyro.sample("b", dist.Normal(0.0, 5.0))
    w = numpyro.sample("w", dist.Normal(0.0, 2.0).expand([X.shape[1]]).to_event(1))
    with nf.federated_plate("data", X.shape[0], clients=NUM_CLIENTS):
        numpyro.sample("y", dist.Bernoulli(logits=b + X @ w), obs=y)


def logistic_data(num_rows, dim, seed=0):
    """Raw covariates with scales 1 to 100, true weights of about one unit of the logit per
    covariate's sd, an intercept of -0.5."""
    rng = np.random.default_rng(seed)
    scales = np.geomspace(1.0, 100.0, dim)
    X = rng.normal(size=(num_rows, dim)) * scales
    coef = rng.normal(size=dim) / (scales * np.sqrt(dim))
    y = (rng.logistic(size=num_rows) < -0.5 + X @ coef).astype(np.float64)
    return X, y


def biased_data(seed=4):
    """The consensus test's rows: 96 of them, covariates on scales 1 and 20, a rare outcome."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(96, 2)) * np.array([1.0, 20.0])
    y = (rng.logistic(size=96) < -0.5 + X @ np.array([1.0, -0.05])).astype(np.float64)
    return X, y


def _group_rows(seed=0):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(5, 41, size=NUM_GROUPS)
    group = np.repeat(np.arange(NUM_GROUPS), sizes)
    return group


GROUP = _group_rows()
GROUP_OWNER = np.repeat(np.arange(NUM_CLIENTS), GROUPS_PER_CLIENT)  # groups 0-2 on client 0, ...
ROW_OWNER = GROUP_OWNER[GROUP]


def hierarchical(floor, group, y=None):
    import numpyro
    import numpyro.distributions as dist

    import numpyro_fed as nf

    mu_a = numpyro.sample("mu_a", dist.Normal(0.0, 10.0))
    sigma_a = numpyro.sample("sigma_a", dist.HalfCauchy(2.5))
    b = numpyro.sample("b", dist.Normal(0.0, 10.0))
    sigma_y = numpyro.sample("sigma_y", dist.HalfCauchy(2.5))
    with nf.federated_plate("groups", NUM_GROUPS, clients=GROUP_OWNER):
        a = numpyro.sample("a", dist.Normal(mu_a, sigma_a))
    with nf.federated_plate("data", group.shape[0], clients=ROW_OWNER):
        numpyro.sample("y", dist.Normal(a[group] + b * floor, sigma_y), obs=y)


def hierarchical_data(seed=1):
    rng = np.random.default_rng(seed)
    floor = rng.integers(0, 2, size=GROUP.size).astype(np.float64)
    intercept = 1.3 + 0.4 * rng.normal(size=NUM_GROUPS)
    y = intercept[GROUP] - 0.7 * floor + 0.8 * rng.normal(size=GROUP.size)
    return floor, GROUP, y


def case_spec(key):
    """``(model, args, global sites)`` of a case key (``logistic-N<n>-d<d>``, ``hierarchical``,
    ``biased``)."""
    if key.startswith("logistic-"):
        _, n, d = key.split("-")
        return logistic, logistic_data(int(float(n[1:])), int(d[1:])), ["b", "w"]
    if key == "hierarchical":
        return hierarchical, hierarchical_data(), ["mu_a", "sigma_a", "b", "sigma_y"]
    if key == "biased":
        return logistic, biased_data(), ["b", "w"]
    raise ValueError(f"unknown case {key!r}")


def case_keys(args):
    keys = []
    for case in args.cases:
        if case == "logistic":
            keys += [f"logistic-N{float(n):.0e}-d{d}".replace("+0", "") for n in args.sizes for d in args.dims]
        else:
            keys.append(case)
    return keys


# -- one cell, in a child process ------------------------------------------------------------
def _flat(draws, sites):
    """``(chains, draws, d)`` of the global sites' constrained values (each site's draws
    ``(chains, draws, *shape)``)."""
    cols = [np.asarray(draws[name], np.float64) for name in sites]
    return np.concatenate([x.reshape(x.shape[0], x.shape[1], -1) for x in cols], axis=-1)


def _run_cell(algorithm, case, federation, seed, subsample_size):
    """The draws ``(chains, draws, d)`` of the global sites and the ledger of one run."""
    import jax

    from numpyro.infer import MCMC, NUTS

    import numpyro_fed as nf

    model, data, sites = case_spec(case)
    key = jax.random.PRNGKey(seed)
    run_key, draw_key = jax.random.split(key)
    ledger = None
    if algorithm == "NUTS":
        # NumPyro shrinks each adapted variance towards 1e-3 (regularize_mass_matrix); the
        # coefficients of raw covariates on scales to 100 have posterior variances of 1e-8 and
        # less (on 12,500 rows the last one's is 3.9e-8 and its adapted inverse mass 2.4e-5,
        # 625 times too wide; the ratio grows with N), and the trees run about ten times
        # deeper: the same sampler without the shrinkage
        mcmc = MCMC(NUTS(model, regularize_mass_matrix=False), num_warmup=500, num_samples=1500, progress_bar=False)
        mcmc.run(key, *data)
        samples = mcmc.get_samples(group_by_chain=True)
        return _flat(samples, sites), ledger, sites
    if algorithm in ("FedZigZag", "FedZigZag-sub", "DADMMS"):
        if algorithm == "DADMMS":
            kernel = nf.DADMMS(model, federation=federation)
            lengths = dict(num_warmup=50, num_samples=50, num_chains=100, chain_method="vectorized")
        else:
            extra = {"subsample_size": subsample_size} if algorithm == "FedZigZag-sub" else {}
            kernel = nf.FedZigZag(model, federation=federation, **extra)
            lengths = dict(num_warmup=500, num_samples=1000)
        mcmc = MCMC(kernel, progress_bar=False, **lengths)
        with kernel.federation.guard():
            mcmc.run(key, *data)
        posterior = nf.to_inference_data(mcmc).posterior
        samples = {name: np.asarray(posterior[name].values) for name in sites}
        return _flat(samples, sites), nf.message_ledger(mcmc), sites
    if algorithm == "ConsensusMC":
        method = nf.ConsensusMC(model, federation=federation, progress_bar=False)
        result = method.run(run_key, *data)
        draws = method.get_samples(draw_key, result)  # all consensus draws, in order
    elif algorithm == "DPPVI":
        method = nf.DPPVI(model, federation=federation, progress_bar=False)
        result = method.run(run_key, 10, *data)
        draws = method.get_samples(draw_key, result, 2000)
    elif algorithm == "DSVGD":
        method = nf.DSVGD(model, federation=federation, progress_bar=False)
        result = method.run(run_key, max(10, 2 * NUM_CLIENTS), *data)
        draws = method.get_samples(draw_key, result, 2000)
    else:
        raise ValueError(f"unknown algorithm {algorithm!r}")
    samples = {name: np.asarray(draws[name])[None] for name in sites}
    return _flat(samples, sites), nf.message_ledger(result), sites


def worker(args):
    """Runs one cell and writes its record to ``args.worker_out``."""
    import numpyro

    numpyro.enable_x64()
    from numpyro.diagnostics import effective_sample_size

    import numpyro_fed as nf

    record = dict(
        case=args.worker_case, algorithm=args.worker_algorithm, backend=args.backend, load_start=os.getloadavg()
    )
    federation = None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            start = time.perf_counter()
            if args.backend == "ray" and args.worker_algorithm != "NUTS":
                federation = nf.RayFederation(
                    address=args.ray_address,
                    timeout=float(args.timeout),
                    env_vars={"PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)])},
                )
            draws, ledger, sites = _run_cell(
                args.worker_algorithm, args.worker_case, federation, args.seed, args.subsample_size
            )
            record["wall_s"] = time.perf_counter() - start
        record["warnings"] = sorted({f"{w.category.__name__}: {w.message}" for w in caught})
        record["mean"] = draws.reshape(-1, draws.shape[-1]).mean(0).tolist()
        record["sd"] = draws.reshape(-1, draws.shape[-1]).std(0).tolist()
        record["ess"] = np.asarray(effective_sample_size(draws)).tolist()
        record["draws_shape"] = list(draws.shape)
        if ledger is not None:
            rounds = np.asarray(ledger.get("rounds", np.nan))
            record["rounds"] = float(rounds.max()) if rounds.size else None
            record["bytes"] = float(
                sum(np.sum(ledger.get(k, 0)) for k in ("bytes_to_client", "bytes_from_client", "bytes_to_peer"))
            )
            record["messages"] = float(
                sum(
                    np.sum(ledger.get(k, 0)) for k in ("messages_to_client", "messages_from_client", "messages_to_peer")
                )
            )
        # draws that are not all finite are the cell's finding (e.g. every local fit failed),
        # not a result to score: recorded as such, with the run's warnings
        record["status"] = "ok" if np.isfinite(draws).all() else "non-finite"
    except Exception as error:  # recorded as the cell's finding
        record["status"] = "error"
        record["error"] = f"{type(error).__name__}: {error}"[:2000]
        record["traceback"] = traceback.format_exc()[-4000:]
    finally:
        if federation is not None:
            federation.close()
    record["load_end"] = os.getloadavg()
    Path(args.worker_out).write_text(json.dumps(record))


# -- the driver -------------------------------------------------------------------------------
def run_child(case, algorithm, args, ray_address, timeout):
    out = RESULTS.parent / f".cell-{os.getpid()}.json"
    out.unlink(missing_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--backend", args.backend, "--seed", str(args.seed)]
    command += ["--worker-case", case, "--worker-algorithm", algorithm, "--worker-out", str(out)]
    command += ["--subsample-size", str(args.subsample_size), "--timeout", str(timeout)]
    if ray_address:
        command += ["--ray-address", ray_address]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    start, load = time.perf_counter(), os.getloadavg()
    child = subprocess.Popen(command, env=env, start_new_session=True, stdout=subprocess.DEVNULL)
    try:
        child.wait(timeout=timeout)
    except BaseException as stop:  # a time-out, or this driver stopped: the child goes too
        os.killpg(child.pid, signal.SIGKILL)  # the child and its own processes only
        child.wait()
        if not isinstance(stop, subprocess.TimeoutExpired):
            raise
        return dict(case=case, algorithm=algorithm, backend=args.backend, status="timeout",
                    wall_s=time.perf_counter() - start, load_start=load, load_end=os.getloadavg(),
                    error=f"killed after {timeout:.0f} s")  # fmt: skip
    if not out.exists():
        error = f"the child exited with code {child.returncode} and wrote nothing"
        return dict(case=case, algorithm=algorithm, backend=args.backend, status="error", error=error, load_start=load)
    record = json.loads(out.read_text())
    out.unlink()
    return record


def score(record, reference):
    """Adds the columns measured against the reference."""
    if record.get("status") != "ok" or reference is None or reference.get("status") != "ok":
        return record
    ref_mean, ref_sd = np.asarray(reference["mean"]), np.asarray(reference["sd"])
    z = np.abs(np.asarray(record["mean"]) - ref_mean) / ref_sd
    ratio = np.asarray(record["sd"]) / ref_sd
    record["worst_mean_error_sd"] = float(z.max())
    record["worst_sd_ratio"] = float(np.max(np.maximum(ratio, 1 / ratio)))
    if record["algorithm"] in SAMPLERS:
        record["min_ess_per_s"] = float(np.min(record["ess"]) / record["wall_s"])
    return record


def _fmt(x, spec):
    return "" if x is None else format(x, spec)


def table(results, keys=None):
    """The markdown table, every cell scored against its case's NUTS run as it stands in
    ``results`` (a reference run after the cells scores them too)."""
    for cells in results.values():
        for record in cells.values():
            score(record, cells.get("NUTS"))
    lines = [
        "| case | algorithm | status | worst \\|mean err\\| (ref sd) | worst sd ratio | rounds | bytes | wall s | "
        "min-ESS/s | load (start-end) | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in keys or results:
        if key not in results:
            continue
        cells = results[key]
        for algorithm in ("NUTS", *ALGORITHMS):
            r = cells.get(algorithm)
            if r is None:
                continue
            notes = "; ".join(w.split(". ")[0][:160] for w in r.get("warnings", []) if not w.startswith(NOISE))
            if r.get("status") != "ok":
                notes = r.get("error", "")[:200].replace("\n", " ").replace("|", "/")
            load = "-".join(f"{v[0]:.1f}" for v in (r.get("load_start"), r.get("load_end")) if v)
            lines.append(
                f"| {key} | {algorithm} | {r.get('status')} | {_fmt(r.get('worst_mean_error_sd'), '.3f')} | "
                f"{_fmt(r.get('worst_sd_ratio'), '.2f')} | {_fmt(r.get('rounds'), ',.0f')} | "
                f"{_fmt(r.get('bytes'), ',.0f')} | {_fmt(r.get('wall_s'), '.1f')} | "
                f"{_fmt(r.get('min_ess_per_s'), '.1f')} | {load} | {notes.replace('|', '/')} |"
            )
    return "\n".join(lines)


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["ray", "inprocess"], default="ray")
    parser.add_argument("--workers", type=int, default=4, help="the local Ray's CPUs (4-8)")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument(
        "--algorithms", nargs="+", choices=(*ALGORITHMS, "none"), default=list(ALGORITHMS), help="none: NUTS only"
    )
    parser.add_argument("--sizes", nargs="+", default=["1e5", "1e6"], help="logistic: N")
    parser.add_argument("--dims", nargs="+", type=int, default=[6, 20], help="logistic: d")
    parser.add_argument("--subsample-size", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run (then killed)")
    parser.add_argument("--reference-timeout", type=float, default=1800.0, help="seconds for NUTS's run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fresh-reference", action="store_true", help="rerun NUTS even if the JSON has it")
    parser.add_argument("--report", action="store_true", help="reprint the table from the JSON")
    parser.add_argument("--worker-case", help=argparse.SUPPRESS)
    parser.add_argument("--worker-algorithm", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    parser.add_argument("--ray-address", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    if args.worker_case:
        return worker(args)
    saved = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results, meta = saved.get("results", {}), saved.get("runs", [])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-up (Ray's shutdown) when stopped
    if args.report:
        print(table(results))
        return results
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    ray_address, ray = None, None
    if args.backend == "ray":
        import ray

        ray.init(num_cpus=args.workers, include_dashboard=False, log_to_driver=False)
        ray_address = ray.get_runtime_context().gcs_address
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    run_info = dict(argv=sys.argv[1:], start=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                    load_start=os.getloadavg(), python=platform.python_version(), commit=commit.strip(),
                    workers=args.workers if args.backend == "ray" else None)  # fmt: skip
    keys = case_keys(args)
    try:
        for key in keys:
            cells = results.setdefault(key, {})
            if args.fresh_reference or cells.get("NUTS", {}).get("status") != "ok":
                cells["NUTS"] = run_child(key, "NUTS", args, None, args.reference_timeout)
                cells["NUTS"]["backend"] = "pooled, in a child process"
                print(f"{key} NUTS: {cells['NUTS'].get('status')} {cells['NUTS'].get('wall_s', 0):.1f} s", flush=True)
            for algorithm in (a for a in args.algorithms if a != "none"):
                cells[algorithm] = score(run_child(key, algorithm, args, ray_address, args.timeout), cells["NUTS"])
                r = cells[algorithm]
                print(
                    f"{key} {algorithm}: {r.get('status')} {r.get('wall_s', 0):.1f} s "
                    f"err {r.get('worst_mean_error_sd')} sd-ratio {r.get('worst_sd_ratio')} {r.get('error', '')[:300]}",
                    flush=True,
                )
                RESULTS.write_text(json.dumps(dict(results=results, runs=meta + [run_info]), indent=1))
    finally:
        if ray is not None:
            ray.shutdown()
    run_info["load_end"] = os.getloadavg()
    text = table(results, keys)  # scores every cell against its case's reference
    RESULTS.write_text(json.dumps(dict(results=results, runs=meta + [run_info]), indent=1))
    print(f"\n{run_info}\n")
    print(text)
    return results


if __name__ == "__main__":
    main()
