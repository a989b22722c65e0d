"""Subsampled FedZigZag in process and through a federation: gradient rows per effective sample
and their ratio.

Target: ``zigzag_scale.py``'s logistic regression (covariates N(0, I), weights N(0, I / d),
prior N(0, I)), d = ``--dim`` (6), M = ``--clients`` (8) even clients, N in ``--sizes``
(1e5), float32 (``--x64``: float64). For each N, one chain of ``--warmup`` + ``--samples``
draws (one ``MCMC.run``, compilation included in the times):

* ``in process``: ``FedZigZag(model, subsample_size=1)``, the server thinning the superposition
  (second order, rows drawn by their weights);
* ``federated``: the same with every client thinning its own proposals, one round per switch:
  ``InProcess(), thinning="clients"`` (``--engine inprocess``, the default) or a
  ``RayFederation`` with one worker per client (``--engine ray``); each client computes its
  rows' weights and its gradient and Hessian at the reference once (``"row_remainders"``, its
  time in the ``set-up s`` column: the workers' compilation and computation, in parallel) and
  keeps them as its client state;
* ``federated, first order`` (``--first-order``): ``control_variates="first_order"`` through the
  same federation (uniform batches; many times the rows, so slow at large N).

Columns: the smallest ESS, gradient rows per effective sample (the clients' gradient
evaluations times the rows each evaluates, warmup included) and its ratio to the in-process
run, rounds per switch and per effective sample, wall time (compilation included) and JAX's
compilation time in it. On Ray, Ray's bare round trip (``M`` actors, a vector out, a number
back; median of 400) is measured after the runs and the wall time per effective sample is
compared with rounds per effective sample times that round trip; so is the time per round of
the draws after warm-up (no set-up, their compilation taken out), with the driver's CPU per
round and each worker's per call in them, and Ray's round whose actors spend that same CPU
per call (what the clients' work costs in a round before the driver does anything; the
federated runs do not poll the driver's memory, as the bare round trip does not, unless
``--memory-poll``: no effect measured in four runs, benchmarks/README.md). With ``--floor`` it also
measures the same actors answering a packed call after spending 0.5 and 1 ms of CPU on it
(``round_floor``): what a round costs when the clients compute, before any code of this
package runs; with ``--compiled-graph`` also through a Ray compiled graph (beta: shared-memory
channels instead of a task per call), which RayFederation does not use (benchmarks/README.md).

    python benchmarks/zigzag_federated.py --sizes 100000          # about 2-4 minutes here
    python benchmarks/zigzag_federated.py --sizes 1000000 --engine ray --clients 8   # a quiet machine
    python benchmarks/zigzag_federated.py --sizes 100000 --engine ray --warmup 100 --samples 300 --floor
    python benchmarks/zigzag_federated.py --sizes 100000 --engine ray --warmup 50 --samples 300 --floor --compiled-graph

Results: a table on stdout and ``benchmarks/results/zigzag_federated.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zigzag_scale as zs  # noqa: E402  (enables float64 on --x64 before JAX is used)

import jax  # noqa: E402

from numpyro.infer import MCMC  # noqa: E402

import numpyro_fed as nf  # noqa: E402
from numpyro_fed.federation import InProcess  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "zigzag_federated.json"
FIELDS = tuple(f"info.{name}" for name in nf.FedZigZag.info_names)


def make_federation(engine: str, clients: int):
    if engine == "ray":
        return nf.RayFederation(timeout=600.0)
    return InProcess()


def measure(name, X, y, clients, *, num_warmup, num_samples, seed, memory_poll=False, **options):
    def model(X, y=None):
        return zs.logistic_federated(X, y, clients=clients)

    kernel = nf.FedZigZag(model, subsample_size=1, **options)
    mcmc = MCMC(kernel, num_warmup=num_warmup, num_samples=num_samples, progress_bar=False)
    # no resident-set poll by default: the bare round trip these rounds are compared with runs
    # without its thread (which takes the GIL every 5 ms)
    with warnings.catch_warnings(), zs.Stopwatch(memory=memory_poll) as sw:
        warnings.simplefilter("ignore")
        mcmc.warmup(jax.random.PRNGKey(seed), X, y, collect_warmup=True, extra_fields=FIELDS)
        warm = mcmc.get_extra_fields()
        federation = options.get("federation")
        actors = list(federation.actors) if isinstance(federation, nf.RayFederation) else []
        cpu = _cpu_seconds(actors)
        with zs.Stopwatch(memory=False) as sampling:
            mcmc.run(jax.random.PRNGKey(seed + 1), X, y, extra_fields=FIELDS)
        cpu = [after - before for before, after in zip(cpu, _cpu_seconds(actors))]
        draws = np.asarray(mcmc.get_samples()["w"])
    post = mcmc.get_extra_fields()
    sampling_rounds = int(np.sum(post["info.rounds"]))
    timed = bool(actors) and sampling_rounds > 0
    ess = zs.min_ess(draws)
    rows = zs.fedzigzag_rows(kernel, warm) + zs.fedzigzag_rows(kernel, post)
    events = int(np.sum(warm["info.num_events"]) + np.sum(post["info.num_events"]))
    rounds = int(np.sum(warm["info.rounds"]) + np.sum(post["info.rounds"]))
    return {
        "run": name,
        "N": int(X.shape[0]),
        "d": int(X.shape[1]),
        "M": clients,
        "ess": ess,
        "rows_per_ess": rows / ess,
        "events": events,
        "rounds": rounds,
        "rounds_per_switch": rounds / max(events, 1),
        "rounds_per_ess": rounds / ess,
        "violations": int(np.sum(warm["info.num_violations"]) + np.sum(post["info.num_violations"])),
        "wall_s": sw.wall,
        "compile_s": sw.compile,
        "setup_s": float(sum(kernel.subsample_setup_seconds.values())),
        # the draws after warm-up alone: no set-up, their compilation taken out
        "sampling_ms_per_round": 1e3 * sampling.net / sampling_rounds if sampling_rounds else None,
        # on Ray, the CPU of those draws per round: the driver's, and each worker's per call
        "sampling_driver_cpu_ms": 1e3 * sampling.cpu / sampling_rounds if timed else None,
        "sampling_worker_cpu_ms": 1e3 * sum(cpu) / sampling_rounds / clients if timed else None,
        "posterior_mean": draws.mean(0).tolist(),
        "posterior_sd": draws.std(0).tolist(),
    }


def _cpu_seconds(actors) -> list:
    """Each Ray actor's CPU seconds (``time.process_time`` in it); none without actors (no
    Ray: ``ray.get`` would start one)."""
    if not actors:
        return []
    import ray

    return ray.get([a.__ray_call__.remote(lambda self: time.process_time()) for a in actors])


def round_floor(
    clients: int, busy_ms=(0.5, 1.0), repeats: int = 400, compiled_graph: bool = False, worker_cpu_ms=None
) -> dict:
    """What a Ray round costs before any of this package's code runs: ``clients`` actors
    answering a vector with a number (``"bare"``, Ray's bare round trip), then a small ``bytes`` payload with a
    ``bytes`` reply (as ``RayFederation`` packs a small call) after each actor spent ``c`` ms
    of CPU on it, for ``c`` in ``busy_ms``; with ``compiled_graph`` also the same calls (``c`` = 0
    and ``busy_ms``) through a Ray compiled graph, and the actors' summed CPU per second while
    it stands idle. Per variant: the median ms per round, and the CPU per round of the driver
    and per call of one actor (``time.process_time``). ``worker_cpu_ms``: also the round whose
    actors each spend that CPU per call in all (``"clients' CPU"``: their busy time is what the
    packed call without it does not already spend), a run's workers' measured CPU per call."""
    import pickle

    import ray

    @ray.remote
    class Echo:
        def dot(self, v):
            return float(np.sum(v))

        def packed(self, payload, busy_ms):
            start = time.process_time()
            value = pickle.loads(payload)
            while (time.process_time() - start) * 1e3 < busy_ms:
                pass
            return pickle.dumps(value[:2])

        def cpu(self):
            return time.process_time()

    actors = [Echo.remote() for _ in range(clients)]
    v = np.ones(6)
    payload = pickle.dumps(("propose",) + tuple(np.ones(6, np.float32) for _ in range(13)), protocol=5)
    ray.get([a.dot.remote(v) for a in actors])

    def measure(one_round):
        workers, driver = sum(ray.get([a.cpu.remote() for a in actors])), time.process_time()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            one_round()
            times.append(1e3 * (time.perf_counter() - start))
        workers = sum(ray.get([a.cpu.remote() for a in actors])) - workers
        return {
            "ms": float(np.median(times)),
            "driver_cpu_ms": 1e3 * (time.process_time() - driver) / repeats,
            "worker_cpu_ms": 1e3 * workers / repeats / clients,
        }

    out = {"bare": measure(lambda: ray.get([a.dot.remote(v) for a in actors]))}
    if worker_cpu_ms is not None:  # busy for what the packed call without busy time does not spend
        packed = measure(lambda: ray.get([a.packed.remote(payload, 0.0) for a in actors]))
        c = max(worker_cpu_ms - packed["worker_cpu_ms"], 0.0)
        out["clients' CPU"] = measure(lambda: ray.get([a.packed.remote(payload, c) for a in actors]))
    for c in busy_ms:
        out[f"busy {c} ms"] = measure(lambda c=c: ray.get([a.packed.remote(payload, c) for a in actors]))
    if compiled_graph:
        # Ray's compiled graphs (beta): the same packed calls over shared-memory channels instead
        # of a task submission per call; each actor's channel reader polls while it waits, so
        # its CPU while the graph stands idle is measured too
        from ray.dag import InputNode, MultiOutputNode

        for c in (0.0,) + tuple(busy_ms):
            with InputNode() as inp:
                graph = MultiOutputNode([a.packed.bind(inp, c) for a in actors]).experimental_compile()
            try:
                ray.get(graph.execute(payload))
                row = measure(lambda graph=graph: ray.get(graph.execute(payload)))
                before = sum(ray.get([a.cpu.remote() for a in actors]))
                time.sleep(1.0)
                row["idle_worker_cpu_s_per_s"] = sum(ray.get([a.cpu.remote() for a in actors])) - before
                out[f"compiled graph, busy {c} ms"] = row
            finally:
                graph.teardown()
    for a in actors:
        ray.kill(a)
    return out


def print_rows(rows, bare_ms=None):
    print(
        "\n| N | run | min ESS | rows / ESS | x in process | rounds / switch | rounds / ESS | wall s | "
        "compile s | set-up s | violations |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    base = {r["N"]: r for r in rows if r["run"] == "in process"}
    for r in rows:
        ratio = r["rows_per_ess"] / base[r["N"]]["rows_per_ess"] if r["N"] in base else float("nan")
        print(
            f"| {r['N']:,} | {r['run']} | {r['ess']:.0f} | {r['rows_per_ess']:.3g} | {ratio:.2f} | "
            f"{r['rounds_per_switch']:.3f} | {r['rounds_per_ess']:.3g} | {r['wall_s']:.1f} | {r['compile_s']:.1f} | "
            f"{r['setup_s']:.2f} | {r['violations']} |"
        )
    if bare_ms is not None:
        print(f"\nRay's bare round trip with these workers: {bare_ms:.2f} ms")
        for r in rows:
            if r["run"].startswith("federated") and r["rounds"]:
                floor = r["rounds_per_ess"] * bare_ms / 1e3
                print(
                    f"N = {r['N']:,}, {r['run']}: wall per ESS {r['wall_s'] / r['ess'] * 1e3:.2f} ms, rounds per ESS "
                    f"x bare round trip {floor * 1e3:.2f} ms (ratio {r['wall_s'] / r['ess'] / floor:.2f}, "
                    "compilation and set-up included)"
                )
                if r.get("sampling_ms_per_round"):
                    print(
                        f"  per round while drawing after warm-up (its compilation out): "
                        f"{r['sampling_ms_per_round']:.2f} ms, {r['sampling_ms_per_round'] / bare_ms:.2f} x bare"
                    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000])
    parser.add_argument("--dim", type=int, default=6)
    parser.add_argument("--clients", type=int, default=8, help="M (on Ray: one worker each)")
    parser.add_argument("--engine", choices=("inprocess", "ray"), default="inprocess")
    parser.add_argument("--first-order", action="store_true", help="also first order through the federation")
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--x64", action="store_true", help="float64 (default: NumPyro's float32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--floor", action="store_true", help="on Ray: also the round when each actor spends 0.5 and 1 ms of CPU"
    )
    parser.add_argument(
        "--compiled-graph",
        action="store_true",
        help="with --floor: also the same rounds through a Ray compiled graph (beta), and its actors' idle CPU",
    )
    parser.add_argument(
        "--memory-poll",
        action="store_true",
        help="poll the driver's resident set every 5 ms during the runs (as before 2 December 2026)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    print(
        f"JAX {jax.__version__}, load average {os.getloadavg()[0]:.1f} (a shared machine: times vary), "
        f"{'float64' if args.x64 else 'float32'}, d = {args.dim}, M = {args.clients}, engine {args.engine}",
        flush=True,
    )
    settings = dict(num_warmup=args.warmup, num_samples=args.samples, seed=args.seed, memory_poll=args.memory_poll)
    runs = [("in process", {}), ("federated", {"thinning": "clients"})]
    if args.first_order:
        runs.append(("federated, first order", {"thinning": "clients", "control_variates": "first_order"}))
    rows = []
    for n in args.sizes:
        X, y = zs.make_data(n, args.dim, args.seed)
        for name, options in runs:
            if name.startswith("federated"):
                federation = make_federation(args.engine, args.clients)
                options = dict(options, federation=federation)
            else:
                federation = None
            try:
                row = measure(name, X, y, args.clients, **settings, **options)
            finally:
                if federation is not None:
                    federation.close()
            rows.append(row)
            print(
                f"N = {n:,}, {name}: min ESS {row['ess']:.0f}, {row['rows_per_ess']:.3g} rows per ESS, "
                f"{row['rounds_per_switch']:.3f} rounds per switch, {row['wall_s']:.1f} s",
                flush=True,
            )
    matched = next((r for r in reversed(rows) if r["run"] == "federated" and r.get("sampling_worker_cpu_ms")), None)
    floor = (
        round_floor(
            args.clients,
            (0.5, 1.0) if args.floor else (),
            compiled_graph=args.floor and args.compiled_graph,
            worker_cpu_ms=matched["sampling_worker_cpu_ms"] if matched else None,
        )
        if args.engine == "ray"
        else None
    )
    bare = floor["bare"]["ms"] if floor else None
    print_rows(rows, bare)
    if matched is not None:
        same = floor["clients' CPU"]["ms"]
        print(
            f"  its CPU per round after warm-up: the driver {matched['sampling_driver_cpu_ms']:.2f} ms, each worker "
            f"{matched['sampling_worker_cpu_ms']:.2f} ms per call; Ray's round whose actors each spend that CPU: "
            f"{same:.2f} ms ({same / bare:.2f} x bare), the run's round "
            f"{matched['sampling_ms_per_round'] / same:.2f} x it"
        )
    if floor and args.floor:
        print(f"\nA Ray round before this package's code, {args.clients} actors (median ms; CPU per round / per call):")
        for name, r in floor.items():
            print(
                f"  {name:12s} {r['ms']:6.2f} ms ({r['ms'] / bare:.2f} x bare), driver {r['driver_cpu_ms']:.2f} ms, "
                f"each actor {r['worker_cpu_ms']:.2f} ms of CPU"
                + (
                    f"; idle, the actors together {r['idle_worker_cpu_s_per_s']:.2f} s of CPU per s"
                    if "idle_worker_cpu_s_per_s" in r
                    else ""
                )
            )
    meta = {"argv": sys.argv[1:], "loadavg": os.getloadavg(), "bare_round_trip_ms": bare, "round_floor": floor}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
