"""Runs the app of this folder on one machine: a Flower SuperLink and N SuperNodes on
localhost, each node loading its own shard (a ``.npz`` file named in its node config), then
``flwr run`` and, when the run ends, stops them all.

    python deploy_localhost.py                     # deployment: SuperLink + 3 SuperNodes
    python deploy_localhost.py --simulation        # the same app in Flower's simulation
    python deploy_localhost.py --methods dppvi-dpsgd --num-rounds 3 --out results/

Everything listens on 127.0.0.1 only (free ports), without TLS (``--insecure``: a
demonstration on one machine; see docs/guide/flower.md for TLS and node authentication).
Flower's telemetry and update check are off. It prints the commands it runs: they are the
ones to run by hand, each in its own terminal, on the machines of a real deployment.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(name: str) -> str:
    """The Flower command ``name`` installed next to this Python."""
    path = os.path.join(os.path.dirname(sys.executable), name)
    return path if os.path.exists(path) else name


def write_shards(folder: str, num_nodes: int) -> list[str]:
    """Node ``m``'s rows in ``shard<m>.npz``: what each silo holds (here the app's
    synthetic data)."""
    import numpy as np

    sys.path.insert(0, HERE)
    from fedapp.task import synthetic_shard

    paths = []
    for m in range(num_nodes):
        X, y = synthetic_shard(m)
        path = os.path.join(folder, f"shard{m}.npz")
        np.savez(path, X=X, y=y)
        paths.append(path)
    return paths


def wait_healthy(port: int, process: subprocess.Popen, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1.0) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{what} did not come up within {timeout} s")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulation", action="store_true", help="Flower's simulation instead of SuperNodes")
    parser.add_argument("--num-nodes", type=int, default=3)
    parser.add_argument("--methods", default="dppvi", help="comma-separated methods of fedapp/task.py")
    parser.add_argument("--num-rounds", type=int, default=2)
    parser.add_argument("--out", default=None, help="where the server writes the results (default: a temporary folder)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before everything is stopped")
    args = parser.parse_args(argv)

    work = tempfile.mkdtemp(prefix="numpyro_fed_flower_")
    out = os.path.abspath(args.out or os.path.join(work, "results"))
    env = dict(
        os.environ,
        FLWR_HOME=os.path.join(work, "flwr-home"),
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_UPDATE_CHECK="1",
        RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO="0",
    )
    # the package and the app's modules from this checkout (a silo would pip install them)
    root = os.path.dirname(os.path.dirname(HERE))
    env["PYTHONPATH"] = os.pathsep.join([root, HERE] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    # the SuperLink and SuperNodes start Flower's other commands (flower-superexec) by name:
    # those next to this Python, even when its environment is not activated
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    os.makedirs(env["FLWR_HOME"])
    link_port = free_port()
    with open(os.path.join(env["FLWR_HOME"], "config.toml"), "w") as f:
        f.write(
            f'[superlink]\ndefault = "localhost"\n\n[superlink.localhost]\n'
            f'address = "127.0.0.1:{link_port}"\ninsecure = true\n'
        )
    processes = []

    def start(argv_, log_name):
        print("$", shlex.join(argv_), flush=True)
        log = open(os.path.join(work, log_name), "w")
        process = subprocess.Popen(argv_, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        processes.append(process)
        return process

    started = time.monotonic()
    try:
        # The app's dependencies are this environment's: no `uv sync` of the app at run time.
        link = [
            command("flower-superlink"),
            "--insecure",
            "--disable-runtime-dependency-installation",
            "--host",
            "127.0.0.1",
            "--port",
            str(link_port),
        ]
        if args.simulation:
            link.append("--simulation")
        superlink = start(link, "superlink.log")
        wait_healthy(link_port, superlink, 120.0, "the SuperLink")
        if not args.simulation:
            for m, path in enumerate(write_shards(work, args.num_nodes)):
                config = f"partition-id={m} num-partitions={args.num_nodes} data-path={json.dumps(path)}"
                start(
                    [
                        command("flower-supernode"),
                        "--insecure",
                        "--superlink",
                        f"127.0.0.1:{link_port}",
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(free_port()),
                        "--node-config",
                        config,
                    ],
                    f"supernode{m}.log",
                )
        run_config = (
            f"num-rounds={args.num_rounds} methods={json.dumps(args.methods)} "
            f"num-clients={args.num_nodes} result-dir={json.dumps(out)}"
        )
        run = [command("flwr"), "run", HERE, "localhost", "--stream", "--run-config", run_config]
        if args.simulation:
            run += ["--federation-config", f"num-supernodes={args.num_nodes}"]
        print("$", shlex.join(run), flush=True)
        left = args.timeout - (time.monotonic() - started)
        completed = subprocess.run(run, env=env, timeout=max(left, 1.0), capture_output=True, text=True)
        print(completed.stdout[-4000:], completed.stderr[-4000:], sep="\n", flush=True)
        results = {}
        for name in args.methods.split(","):
            path = os.path.join(out, f"{name.strip()}.json")
            if not os.path.exists(path):
                logs = "".join(
                    open(os.path.join(work, n)).read()[-3000:] for n in sorted(os.listdir(work)) if n.endswith(".log")
                )
                raise RuntimeError(f"the run wrote no {path} (flwr run exited {completed.returncode}); logs:\n{logs}")
            with open(path) as f:
                results[name.strip()] = json.load(f)
        print(f"finished in {time.monotonic() - started:.0f} s; results in {out}")
        return results
    finally:
        for process in reversed(processes):  # the nodes, then the SuperLink (and what they started)
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=15)


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
