"""Benchmark of the federation seam: in-process against Ray, next to Ray's bare round trip.

Measured in one process, on one local Ray with ``--clients`` actors (default 4), float64:

* **bare Ray round trip**: ``ray.get`` of one ``.remote`` per actor of a minimal actor (a
  vector of ``--dim`` floats out, one number back): the floor of any round on Ray;
* **map call**: ``federation.map`` of a client function (``block @ w`` summed: a vector out, a
  number back) compiled with ``jax.jit``, on :class:`~numpyro_fed.InProcess` and on
  :class:`~numpyro_fed.RayFederation`; and the same under a ``vmap`` over ``--chains``
  chains (one round trip carries every chain on Ray).

Each row: median milliseconds per call over ``--repeats`` calls after a warm-up (10th-90th
percentile), calls per second, bytes per call from the ledger, and the ratio to the bare
round trip. Timings on a shared machine are noisy: the load average is recorded.

**Hook for the algorithms.** Every module ``benchmarks/_federation_<family>.py`` found next to
this script is imported; it defines ``FAMILY`` (a name) and ``rows(ctx) -> list[dict]`` (each
dict a row of the table: at least ``what``, ``backend`` and ``ms_per_round``; ``bytes_per_round``,
``rounds_per_s``, ``wall_s`` and anything else the family measures are printed too). ``ctx``
is a :class:`Context`: the number of clients, the repeats, a :meth:`Context.ray` factory for a
:class:`~numpyro_fed.RayFederation` on the running Ray, :meth:`Context.time_calls`, and the bare
round trip measured here (``ctx.bare_ms``). ``--families`` picks families (``none`` for the
seam only).

Run ``python benchmarks/federation.py`` (about a minute). Results: a table on stdout and
``benchmarks/results/federation.json``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import numpyro

numpyro.enable_x64()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import numpyro_fed as nf  # noqa: E402
from numpyro_fed.federation import ClientProgram, InProcess  # noqa: E402
from numpyro_fed.federation.ray_worker import thread_limits  # noqa: E402

HERE = Path(__file__).resolve().parent


def timed(fn, repeats, warmup=3):
    """Milliseconds per call of ``fn()`` (which must block until done): all repeats."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1e3)
    return np.asarray(out)


def summary(ms):
    return dict(
        ms_per_round=float(np.median(ms)),
        ms_p10=float(np.percentile(ms, 10)),
        ms_p90=float(np.percentile(ms, 90)),
        rounds_per_s=float(1e3 / np.median(ms)),
    )


@dataclass
class Context:
    """What a family's ``rows(ctx)`` gets (see the module docstring)."""

    num_clients: int
    repeats: int
    chains: int
    bare_ms: float = float("nan")
    timeout: float = 60.0
    extra: dict = field(default_factory=dict)

    def ray(self, **kwargs):
        """A :class:`~numpyro_fed.RayFederation` on the running local Ray (start it with a
        program; close it when done)."""
        kwargs.setdefault("timeout", self.timeout)
        return nf.RayFederation(**kwargs)

    def bare(self, repeats=None) -> float:
        """Ray's bare round trip (median ms), measured again now: a family measures it next
        to its own Ray rows, since the load of a shared machine drifts within a run."""
        import ray

        actors, v = self.extra["echo"], self.extra["echo_arg"]
        return float(np.median(timed(lambda: ray.get([a.dot.remote(v) for a in actors]), repeats or self.repeats)))

    def time_calls(self, fn, repeats=None, warmup=3):
        """Median (and 10th-90th percentile) milliseconds per call of a blocking ``fn()``."""
        return summary(timed(fn, repeats or self.repeats, warmup))


class _Echo:
    """The bare actor: a vector in, a number out."""

    def dot(self, v):
        return float(np.sum(v))


def client_sum(block, w):
    return jnp.sum(block @ w)


def seam_rows(ctx, dim, rows_per_client):
    import ray

    out = []
    echo = ray.remote(_Echo)
    actors = [
        echo.options(num_cpus=0, runtime_env={"env_vars": thread_limits(1)}).remote() for _ in range(ctx.num_clients)
    ]
    v = np.ones(dim)
    ray.get([a.dot.remote(v) for a in actors])
    bare = summary(timed(lambda: ray.get([a.dot.remote(v) for a in actors]), ctx.repeats))
    ctx.bare_ms = bare["ms_per_round"]
    out.append(
        dict(
            what="bare Ray round trip (ray.get of one .remote per actor)",
            backend="ray",
            bytes_per_round=ctx.num_clients * (dim * 8 + 8),
            **bare,
        )
    )
    ctx.extra.update(echo=actors, echo_arg=v)  # for ctx.bare(); ended with Ray

    rng = np.random.default_rng(0)
    blocks = [rng.normal(size=(rows_per_client, dim)) for _ in range(ctx.num_clients)]
    program = ClientProgram({"sum": client_sum}, blocks=blocks)
    w = jnp.ones(dim)
    ws = jnp.ones((ctx.chains, dim))
    results = {}
    for backend in ("in-process", "ray"):
        fed = InProcess().start(program) if backend == "in-process" else ctx.ray().start(program)
        try:
            single = jax.jit(lambda w: fed.map("sum", w))
            chains = jax.jit(jax.vmap(lambda w: fed.map("sum", w)))
            for what, fn, arg, n in (
                ("map call", single, w, 1),
                (f"map call, vmap over {ctx.chains} chains", chains, ws, ctx.chains),
            ):
                with fed.guard():
                    fn(arg).block_until_ready()
                    ms = timed(lambda: fn(arg).block_until_ready(), ctx.repeats)
                results[(backend, what)] = ms
                row = dict(what=what, backend=backend, **summary(ms))
                # bytes per call: w out and a number back per client and chain (the ledger's
                # count on Ray; the same sizes in process)
                row["bytes_per_round"] = ctx.num_clients * n * (dim * 8 + 8)
                if backend == "ray":
                    ledger = fed.ledger
                    calls = ledger.rounds("sum").sum() // max(ctx.num_clients, 1)
                    row["ledger_bytes_per_chain_call"] = int(
                        (
                            ledger.count("sum", "to_client", "bytes").sum()
                            + ledger.count("sum", "from_client", "bytes").sum()
                        )
                        // max(calls, 1)
                    )
                out.append(row)
        finally:
            fed.close()
    for what in ("map call", f"map call, vmap over {ctx.chains} chains"):
        ray_ms = np.median(results[("ray", what)])
        local_ms = np.median(results[("in-process", what)])
        for row in out:
            if row["what"] == what and row["backend"] == "ray":
                row["ray_over_in_process"] = float(ray_ms / local_ms)
    return out


def family_modules(selected):
    mods = []
    for path in sorted(HERE.glob("_federation_*.py")):
        family = path.stem[len("_federation_") :]
        if selected is not None and family not in selected:
            continue
        mods.append(importlib.import_module(path.stem))
    return mods


def print_table(rows, bare_ms):
    for r in rows:
        if "ms_per_round" in r and np.isfinite(bare_ms):
            r.setdefault("ratio_to_bare", r["ms_per_round"] / bare_ms)
    keys = [
        "family",
        "what",
        "backend",
        "ms_per_round",
        "ms_p10",
        "ms_p90",
        "rounds_per_s",
        "bytes_per_round",
        "wall_s",
        "ratio_to_bare",
        "ray_over_in_process",
    ]
    extra = sorted({k for r in rows for k in r} - set(keys))
    keys = [k for k in keys if any(k in r for r in rows)] + extra
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        cells = []
        for k in keys:
            v = r.get(k, "")
            cells.append(f"{v:.3g}" if isinstance(v, float) else str(v))
        print("| " + " | ".join(cells) + " |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--dim", type=int, default=10)
    parser.add_argument("--rows", type=int, default=100, help="rows per client")
    parser.add_argument("--chains", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument(
        "--families",
        default=None,
        help="comma-separated families of benchmarks/_federation_<family>.py; 'none': the seam only",
    )
    parser.add_argument("--out", default=str(HERE / "results" / "federation.json"))
    args = parser.parse_args(argv)

    import ray

    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    ray.init(num_cpus=args.clients + 1, include_dashboard=False, log_to_driver=False)
    ctx = Context(num_clients=args.clients, repeats=args.repeats, chains=args.chains)
    started = time.time()
    try:
        rows = [dict(family="seam", **r) for r in seam_rows(ctx, args.dim, args.rows)]
        selected = None if args.families is None else set(args.families.split(",")) - {"none"}
        for module in family_modules(selected):
            for r in module.rows(ctx):
                rows.append(dict(family=module.FAMILY, **r))
    finally:
        ray.shutdown()
    print_table(rows, ctx.bare_ms)
    result = dict(
        rows=rows,
        bare_ms=ctx.bare_ms,
        clients=args.clients,
        dim=args.dim,
        rows_per_client=args.rows,
        chains=args.chains,
        repeats=args.repeats,
        seconds=time.time() - started,
        load_average=os.getloadavg()[0],
        python=platform.python_version(),
        jax=jax.__version__,
        ray=ray.__version__,
        cpus=os.cpu_count(),
        command=" ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"\nwritten {out} (load average {result['load_average']:.1f}, {result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
