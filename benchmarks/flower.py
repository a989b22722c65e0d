"""Benchmark of Flower rounds: DP-PVI and DSVGD in process and on Flower, next to Flower's bare
round trip (``numpyro_fed.flower``).

**Simulation** (default): the rows of ``benchmarks/_federation_variational.py`` (a logistic
regression, ``--clients`` clients of 500 rows, 5 features, float64; the same methods and
settings as its Ray rows) in process and through Flower's simulation (``--clients`` nodes,
one Flower worker process serving them, the ServerApp in this process). Warm-up rounds until
every client has been called once (the node compiles at its first call), then ``--rounds``
timed rounds: the median milliseconds per round (10th-90th percentile). The **bare round
trip**: a Flower Message with one small array to every node and its reply (the ``ClientApp``
echoes it), ``--repeats`` times, the floor of any Flower round. The ledgers of the in-process
and Flower runs are checked equal.

**Deployment** (``--deployment``): ``examples/flower/deploy_localhost.py``, a SuperLink and 3
SuperNodes on localhost (TLS and SuperNode authentication unless ``--insecure``), one
``flwr run`` of an app that first times ``--bare-rounds`` of Flower's bare round (a trivial
``ClientApp``: a small array to every node and back, nothing of numpyro_fed imported), then
runs the example app's DPPVI (synchronous, non-private, float32) for ``--rounds`` rounds, then
the bare rounds again: each round's seconds as the server measured them, DPPVI's as a multiple
of the bare round's median. The nodes record where each message's seconds went (Flower's
start-up and the imports before the handler, rebuilding the program, loading the rows,
compiling and running: ``NUMPYRO_FED_NODE_PROFILE``), printed as medians by message.

Timings on a shared machine are noisy: the load average is recorded. Results: a table on
stdout and ``benchmarks/results/flower.json``.

    python benchmarks/flower.py                      # simulation (a few minutes)
    python benchmarks/flower.py --deployment --rounds 4 --bare-rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
import warnings
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _stats(ms):
    ms = np.asarray(ms, dtype=float)
    return {"median": float(np.median(ms)), "p10": float(np.percentile(ms, 10)), "p90": float(np.percentile(ms, 90))}


def simulation(num_clients: int, rounds: int, repeats: int) -> list[dict]:
    import jax

    import numpyro

    numpyro.enable_x64()
    import _federation_variational as variational
    from flwr.app import ArrayRecord, Message, RecordDict
    from flwr.serverapp import ServerApp

    from numpyro_fed import flower

    X, y = (np.asarray(a) for a in variational._data(num_clients))
    model = variational._model(num_clients)
    methods = variational._methods(model, num_clients)
    size = X.shape[0] // num_clients

    def load(node_config):
        m = int(node_config["partition-id"])
        return X[m * size : (m + 1) * size], y[m * size : (m + 1) * size]

    key = jax.random.PRNGKey(0)
    rows, local = [], {}
    for what, (make, warm) in methods.items():
        result = make(None).run(key, warm + rounds, jax.numpy.asarray(X), jax.numpy.asarray(y))
        local[what] = result
        rows.append(
            {"what": what, "backend": "in process", **_stats(np.diff(result.metrics["wall_time"])[warm - 1 :] * 1e3)}
        )

    client = flower.client_app({what: make(None) for what, (make, _) in methods.items()}, load)

    @client.query("echo")
    def echo(msg, context):
        return Message(RecordDict({"reply": ArrayRecord([np.zeros(1)])}), reply_to=msg)

    server = ServerApp()
    seen = {}

    @server.main()
    def main(grid, context):
        while len(list(grid.get_node_ids())) < num_clients:
            time.sleep(0.1)
        nodes = list(grid.get_node_ids())
        trips = []
        for _ in range(repeats + 3):
            start = time.perf_counter()
            messages = [
                Message(RecordDict({"x": ArrayRecord([np.zeros(10)])}), dst_node_id=n, message_type="query.echo")
                for n in nodes
            ]
            replies = list(grid.send_and_receive(messages, timeout=60.0))
            assert len(replies) == len(nodes)
            trips.append((time.perf_counter() - start) * 1e3)
        seen["bare"] = trips[3:]
        one = []
        for _ in range(repeats + 3):
            start = time.perf_counter()
            replies = list(
                grid.send_and_receive(
                    [
                        Message(
                            RecordDict({"x": ArrayRecord([np.zeros(10)])}),
                            dst_node_id=nodes[0],
                            message_type="query.echo",
                        )
                    ],
                    timeout=60.0,
                )
            )
            assert len(replies) == 1
            one.append((time.perf_counter() - start) * 1e3)
        seen["bare_one"] = one[3:]
        for what, (make, warm) in methods.items():
            start = time.perf_counter()
            seen[what] = (flower.run(make(None), grid, key, warm + rounds, name=what), time.perf_counter() - start)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flower.simulate(server, client, num_clients)
    bare = _stats(seen["bare"])
    rows.append(
        {
            "what": "bare Flower round trip (a Message to one node and back)",
            "backend": "Flower simulation",
            **_stats(seen["bare_one"]),
        }
    )
    rows.append(
        {
            "what": f"bare Flower round trip (a Message to each of the {num_clients} nodes and back)",
            "backend": "Flower simulation",
            **bare,
        }
    )
    for what, (make, warm) in methods.items():
        result, wall = seen[what]
        ref = local[what]
        same = set(result.ledger) == set(ref.ledger) and all(
            np.array_equal(result.ledger[k], ref.ledger[k]) for k in ref.ledger
        )
        stats = _stats(np.diff(result.metrics["wall_time"])[warm - 1 :] * 1e3)
        rows.append(
            {
                "what": what,
                "backend": "Flower simulation",
                **stats,
                "x_bare": stats["median"] / bare["median"],
                "ledger_equal": bool(same),
                "wall_s": wall,
                "bytes_per_round": int(
                    sum(np.sum(result.ledger[k]) for k in ("bytes_to_client", "bytes_from_client")) // (warm + rounds)
                ),
            }
        )
    return rows


_BARE_APP = '''"""The benchmark's Flower app: Flower's bare round (a trivial ClientApp: a small array to
every node and back, no numpyro_fed imported) before and after the example app's runs, on the
same SuperLink and SuperNodes in the same run."""

import json
import os
import time

import numpy as np
from flwr.app import ArrayRecord, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp

client = ClientApp()


@client.query("echo")
def echo(msg, context):
    return Message(RecordDict({"reply": ArrayRecord([np.zeros(1)])}), reply_to=msg)


def forward(msg, context):
    from fedapp.client_app import app  # numpyro_fed's ClientApp, imported for its messages only

    return app(msg, context)


for action in ("describe", "start", "call", "state"):
    client.query(f"numpyro_fed_{action}")(forward)

server = ServerApp()


def bare_rounds(grid, nodes, rounds):
    seconds = []
    for _ in range(rounds):
        start = time.perf_counter()
        messages = [
            Message(RecordDict({"x": ArrayRecord([np.zeros(10)])}), dst_node_id=n, message_type="query.echo")
            for n in nodes
        ]
        replies = list(grid.send_and_receive(messages, timeout=600.0))
        assert len(replies) == len(nodes) and not any(r.has_error() for r in replies)
        seconds.append(time.perf_counter() - start)
    return seconds


@server.main()
def main(grid, context):
    config = context.run_config
    want, rounds = int(config["num-clients"]), int(config["bare-rounds"])
    while len(list(grid.get_node_ids())) < want:
        time.sleep(0.2)
    nodes = sorted(grid.get_node_ids())
    before = bare_rounds(grid, nodes, rounds)
    from fedapp.server_app import app

    app(grid, context)
    after = bare_rounds(grid, nodes, rounds)
    with open(os.path.join(str(config["result-dir"]), "bare.json"), "w") as f:
        json.dump({"before": before, "after": after}, f)
'''


def _bench_app(folder: Path, bare_rounds: int) -> Path:
    """The example app's ``pyproject.toml`` with the components of :data:`_BARE_APP`."""
    app = folder / "app"
    (app / "flowerbench").mkdir(parents=True)
    (app / "flowerbench" / "__init__.py").write_text("")
    (app / "flowerbench" / "apps.py").write_text(_BARE_APP)
    text = (HERE.parent / "examples" / "flower" / "pyproject.toml").read_text()
    text = text.replace('"fedapp.server_app:app"', '"flowerbench.apps:server"')
    text = text.replace('"fedapp.client_app:app"', '"flowerbench.apps:client"')
    text = text.replace('packages = ["fedapp"]', 'packages = ["flowerbench"]')
    text = text.replace("[tool.flwr.app.config]\n", f"[tool.flwr.app.config]\nbare-rounds = {bare_rounds}\n")
    (app / "pyproject.toml").write_text(text)
    return app


def _node_profile(path: Path) -> list[dict]:
    """The nodes' records of the run's calls (``numpyro_fed.flower._node.Profile``), medians by
    message kind."""
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = []
    for kind in sorted({(r["action"], r.get("call")) for r in records}, key=str):
        mine = [r for r in records if (r["action"], r.get("call")) == kind]
        phases = sorted({k for r in mine for k in r} - {"action", "call", "pid"})
        rows.append(
            {
                "message": f"{kind[0]}" + (f" ({kind[1]})" if kind[1] else ""),
                "count": len(mine),
                **{k: float(np.median([r.get(k, 0.0) for r in mine])) for k in phases},
            }
        )
    return rows


def deployment(rounds: int, bare: int, insecure: bool) -> tuple[list[dict], list[dict]]:
    """Flower's bare round and the example app's DPPVI on one SuperLink and 3 SuperNodes, in
    one run; and where each message's seconds went on the nodes."""
    import tempfile

    sys.path.insert(0, str(HERE.parent / "examples" / "flower"))
    import deploy_localhost

    folder = Path(tempfile.mkdtemp(prefix="numpyro_fed_bench_"))
    app = _bench_app(folder, bare)
    profile = folder / "node_profile.jsonl"
    os.environ["NUMPYRO_FED_NODE_PROFILE"] = str(profile)
    out = folder / "results"
    argv = ["--app", str(app), "--num-rounds", str(rounds), "--methods", "dppvi", "--out", str(out)]
    argv += ["--insecure"] if insecure else []
    argv += ["--node-config", f"jax-cache-dir={json.dumps(str(folder / 'jax-cache'))}"]
    start = time.perf_counter()
    summary = deploy_localhost.main(argv)["dppvi"]
    wall = time.perf_counter() - start
    with open(out / "bare.json") as f:
        bare_seconds = json.load(f)
    bare_all = np.asarray(bare_seconds["before"] + bare_seconds["after"]) * 1e3
    bare_stats = _stats(bare_all)
    seconds = np.asarray(summary["round_seconds"]) * 1e3
    later = _stats(seconds[1:])
    backend = "Flower deployment (localhost" + (")" if insecure else ", TLS + node auth)")
    rows = [
        {
            "what": f"bare Flower round: a Message to each of the 3 nodes and back ({len(bare_all)} rounds, "
            "half before, half after)",
            "backend": backend,
            **bare_stats,
        },
        {
            "what": "example app's DPPVI (synchronous, 3 nodes x 200 rows, float32): first round",
            "backend": backend,
            "median": seconds[0],
            "p10": seconds[0],
            "p90": seconds[0],
            "x_bare": seconds[0] / bare_stats["median"],
        },
        {
            "what": "example app's DPPVI: later rounds",
            "backend": backend,
            **later,
            "x_bare": later["median"] / bare_stats["median"],
            "wall_s": wall,
        },
    ]
    messages = _node_profile(profile)
    shutil.rmtree(folder, ignore_errors=True)  # the app copy, its JAX cache and the results
    return rows, messages


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--deployment", action="store_true")
    parser.add_argument("--bare-rounds", type=int, default=3, help="deployment: bare rounds before and after ours")
    parser.add_argument("--insecure", action="store_true", help="deployment without TLS and node authentication")
    args = parser.parse_args(argv)
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
    load_before = os.getloadavg()
    profile = []
    if args.deployment:
        rows, profile = deployment(args.rounds, args.bare_rounds, args.insecure)
    else:
        rows = simulation(args.clients, args.rounds, args.repeats)
    load_after = os.getloadavg()
    print(f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f}")
    print("| what | backend | ms per round (p10-p90) | x bare | ledger equal |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['what']} | {row['backend']} | {row['median']:.4g} ({row['p10']:.4g}-{row['p90']:.4g}) | "
            f"{row.get('x_bare', ''):{'.3g' if 'x_bare' in row else ''}} | {row.get('ledger_equal', '')} |"
        )
    if profile:
        print("\nPer message on the nodes (medians, seconds): process_age = Flower's start-up and the app's imports")
        for row in profile:
            print("  " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    name = "flower_deployment.json" if args.deployment else "flower.json"
    with open(out / name, "w") as f:
        json.dump(
            {
                "rows": rows,
                "node_profile": profile,
                "load_average": [load_before, load_after],
                "python": platform.python_version(),
                "argv": sys.argv[1:],
            },
            f,
            indent=1,
            default=float,
        )
    return rows


if __name__ == "__main__":
    main()
