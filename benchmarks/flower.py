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
SuperNodes on localhost running the example app's DPPVI (synchronous, non-private, float32)
for ``--rounds`` rounds; each round's seconds as the server measured them.

Timings on a shared machine are noisy: the load average is recorded. Results: a table on
stdout and ``benchmarks/results/flower.json``.

    python benchmarks/flower.py                      # simulation (a few minutes)
    python benchmarks/flower.py --deployment --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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


def deployment(rounds: int) -> list[dict]:
    sys.path.insert(0, str(HERE.parent / "examples" / "flower"))
    import deploy_localhost

    start = time.perf_counter()
    summary = deploy_localhost.main(["--num-rounds", str(rounds), "--methods", "dppvi"])["dppvi"]
    seconds = summary["round_seconds"]
    return [
        {
            "what": "example app's DPPVI (synchronous, 3 nodes x 200 rows, float32): first round",
            "backend": "Flower deployment (localhost)",
            "median": seconds[0] * 1e3,
            "p10": seconds[0] * 1e3,
            "p90": seconds[0] * 1e3,
        },
        {
            "what": "example app's DPPVI: later rounds",
            "backend": "Flower deployment (localhost)",
            **_stats(np.asarray(seconds[1:]) * 1e3),
            "wall_s": time.perf_counter() - start,
        },
    ]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--deployment", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
    load_before = os.getloadavg()
    rows = deployment(args.rounds) if args.deployment else simulation(args.clients, args.rounds, args.repeats)
    load_after = os.getloadavg()
    print(f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f}")
    print("| what | backend | ms per round (p10-p90) | x bare | ledger equal |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['what']} | {row['backend']} | {row['median']:.4g} ({row['p10']:.4g}-{row['p90']:.4g}) | "
            f"{row.get('x_bare', ''):{'.3g' if 'x_bare' in row else ''}} | {row.get('ledger_equal', '')} |"
        )
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    name = "flower_deployment.json" if args.deployment else "flower.json"
    with open(out / name, "w") as f:
        json.dump(
            {
                "rows": rows,
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
