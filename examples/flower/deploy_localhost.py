"""Runs the app of this folder on one machine: a Flower SuperLink and N SuperNodes on
localhost, each node loading its own shard (a ``.npz`` file named in its node config), then
``flwr run`` and, when the run ends, stops them all.

    python deploy_localhost.py                     # deployment: SuperLink + 3 SuperNodes, TLS + node auth
    python deploy_localhost.py --simulation        # the same app in Flower's simulation
    python deploy_localhost.py --methods dppvi-dpsgd --num-rounds 3 --out results/
    python deploy_localhost.py --insecure          # no TLS, no node authentication (a demonstration only)
    python deploy_localhost.py --x64               # in float64 (the nodes compute in the server's precision)

By default the set-up is the one a silo would run: TLS on every connection (a certificate
authority and the SuperLink's certificate made here, in a temporary folder) and SuperNode
authentication (the SuperLink started with ``--enable-supernode-auth``; each node's EC key
pair made here and its public key registered with ``flwr supernode register`` before the node
starts; a node whose key is not registered is refused). Everything listens on 127.0.0.1
only (free ports); Flower's telemetry and update check are off. It prints the commands it
runs: they are the ones to run by hand, each in its own terminal, on the machines of a real
deployment (where the certificates come from the silos' own authority).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
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
    from fedapp.data import synthetic_shard

    paths = []
    for m in range(num_nodes):
        X, y = synthetic_shard(m)
        path = os.path.join(folder, f"shard{m}.npz")
        np.savez(path, X=X, y=y)
        paths.append(path)
    return paths


def make_credentials(folder: str, num_nodes: int) -> dict:
    """The files of a secure deployment on localhost, in ``folder``: a certificate authority
    (``ca.crt``), the SuperLink's certificate and key for ``localhost`` / ``127.0.0.1``
    (``superlink.crt``, ``superlink.key``), and each SuperNode's EC key pair in OpenSSH
    format (``supernode<m>`` and ``supernode<m>.pub``), as Flower's own example makes them.
    Returns their paths."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def certificate(subject, issuer, public_key, signing_key, extensions):
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=7))
        )
        for extension, critical in extensions:
            builder = builder.add_extension(extension, critical=critical)
        return builder.sign(signing_key, hashes.SHA256())

    def write(name, data):
        path = os.path.join(folder, name)
        with open(path, "wb") as f:
            f.write(data)
        os.chmod(path, 0o600)
        return path

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "numpyro_fed localhost CA")])
    ca = certificate(ca_name, ca_name, ca_key.public_key(), ca_key, [(x509.BasicConstraints(True, None), True)])
    link_key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    link = certificate(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]),
        ca_name,
        link_key.public_key(),
        ca_key,
        [(x509.SubjectAlternativeName(names), False), (x509.BasicConstraints(False, None), True)],
    )
    pem = serialization.Encoding.PEM
    paths = {
        "ca": write("ca.crt", ca.public_bytes(pem)),
        "certfile": write("superlink.crt", link.public_bytes(pem)),
        "keyfile": write(
            "superlink.key",
            link_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
        ),
        "nodes": [],
    }
    for m in range(num_nodes):  # the nodes' identities (P-384, as `ssh-keygen -t ecdsa -b 384`)
        key = ec.generate_private_key(ec.SECP384R1())
        private = write(
            f"supernode{m}", key.private_bytes(pem, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption())
        )
        public = write(
            f"supernode{m}.pub",
            key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH),
        )
        paths["nodes"].append((private, public))
    return paths


def wait_healthy(port: int, process: subprocess.Popen, timeout: float, what: str, ca: str | None = None) -> None:
    """Waits for the SuperLink's ``/health`` (over TLS, checked against ``ca``, if given)."""
    import ssl

    scheme, context = ("https", ssl.create_default_context(cafile=ca)) if ca else ("http", None)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode}")
        try:
            with urllib.request.urlopen(f"{scheme}://127.0.0.1:{port}/health", timeout=1.0, context=context) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{what} did not come up within {timeout} s")


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulation", action="store_true", help="Flower's simulation instead of SuperNodes")
    parser.add_argument("--insecure", action="store_true", help="no TLS and no node authentication (a demonstration)")
    parser.add_argument("--num-nodes", type=int, default=3)
    parser.add_argument("--methods", default="dppvi", help="comma-separated methods of fedapp/task.py")
    parser.add_argument("--num-rounds", type=int, default=None, help="default: the app's (pyproject.toml)")
    parser.add_argument("--out", default=None, help="where the server writes the results (default: a temporary folder)")
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the run's temporary folder (certificates, node keys, logs); by default it is removed at the end",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before everything is stopped")
    parser.add_argument(
        "--strangers",
        type=int,
        default=0,
        help="also start this many SuperNodes whose keys are not registered (the SuperLink must refuse them)",
    )
    parser.add_argument(
        "--x64",
        action="store_true",
        help="compute in float64 (JAX_ENABLE_X64=1 for the server app; the nodes follow the server's precision)",
    )
    parser.add_argument("--app", default=HERE, help="the Flower app to run (default: this folder's)")
    parser.add_argument("--node-config", default="", help="more node config for every SuperNode (e.g. jax-cache-dir)")
    return parser.parse_args(argv)


def environment(work: str, x64: bool = False) -> dict:
    env = dict(os.environ, FLWR_HOME=os.path.join(work, "flwr-home"), FLWR_TELEMETRY_ENABLED="0")
    env["FLWR_DISABLE_UPDATE_CHECK"] = "1"
    if x64:  # the server app's processes inherit it; the nodes compute in the precision it sends
        env["JAX_ENABLE_X64"] = "1"
    # the package and the app's modules from this checkout (a silo would pip install them)
    root = os.path.dirname(os.path.dirname(HERE))
    env["PYTHONPATH"] = os.pathsep.join([root, HERE] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    # the SuperLink and SuperNodes start Flower's other commands (flower-superexec) by name:
    # those next to this Python, even when its environment is not activated
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    os.makedirs(env["FLWR_HOME"])
    return env


def main(argv=None) -> dict:
    args = parse(argv)
    secure = not args.insecure
    work = tempfile.mkdtemp(prefix="numpyro_fed_flower_")
    out = os.path.abspath(args.out or os.path.join(work, "results"))
    env = environment(work, args.x64)
    if args.strangers and (not secure or args.simulation):
        raise ValueError("--strangers needs a deployment with node authentication (not --insecure, --simulation)")
    credentials = make_credentials(work, args.num_nodes + args.strangers) if secure else None
    link_port = free_port()
    connection = f'root-certificates = "{credentials["ca"]}"' if secure else "insecure = true"
    with open(os.path.join(env["FLWR_HOME"], "config.toml"), "w") as f:
        f.write(f'[superlink]\ndefault = "localhost"\n\n[superlink.localhost]\naddress = "127.0.0.1:{link_port}"\n')
        f.write(connection + "\n")
    processes = []

    def start(argv_, log_name):
        print("$", shlex.join(argv_), flush=True)
        log = open(os.path.join(work, log_name), "w")
        process = subprocess.Popen(argv_, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        processes.append(process)
        return process

    def flwr(*words, timeout=120.0):
        argv_ = [command("flwr"), *words]
        print("$", shlex.join(argv_), flush=True)
        done = subprocess.run(argv_, env=env, timeout=timeout, capture_output=True, text=True)
        if done.returncode != 0:
            output = done.stdout[-2000:] + done.stderr[-2000:]
            raise RuntimeError(f"{shlex.join(argv_)} exited {done.returncode}: {output}")
        return done

    started = time.monotonic()
    try:
        # The app's dependencies are this environment's: no `uv sync` of the app at run time.
        link = [command("flower-superlink"), "--disable-runtime-dependency-installation"]
        link += ["--host", "127.0.0.1", "--port", str(link_port)]
        if secure:
            link += ["--ssl-ca-certfile", credentials["ca"], "--ssl-certfile", credentials["certfile"]]
            link += ["--ssl-keyfile", credentials["keyfile"]]
            link += [] if args.simulation else ["--enable-supernode-auth"]
        else:
            link.append("--insecure")
        if args.simulation:
            link.append("--simulation")
        superlink = start(link, "superlink.log")
        wait_healthy(link_port, superlink, 120.0, "the SuperLink", ca=credentials["ca"] if secure else None)
        if not args.simulation:
            # first the nodes with unregistered keys: the run (num-clients=N) fails if one is admitted
            for m in range(args.num_nodes, args.num_nodes + args.strangers):
                node = [command("flower-supernode"), "--superlink", f"127.0.0.1:{link_port}", "--host", "127.0.0.1"]
                node += ["--port", str(free_port()), "--node-config", f"partition-id={m}"]
                node += ["--root-certificates", credentials["ca"], "--auth-supernode-private-key"]
                start(node + [credentials["nodes"][m][0]], f"stranger{m}.log")
            for m, path in enumerate(write_shards(work, args.num_nodes)):
                config = f"partition-id={m} num-partitions={args.num_nodes} data-path={json.dumps(path)}"
                node = [command("flower-supernode"), "--superlink", f"127.0.0.1:{link_port}"]
                node += ["--host", "127.0.0.1", "--port", str(free_port())]
                node += ["--node-config", f"{config} {args.node_config}".strip()]
                if secure:  # the node's public key is registered before it connects
                    private, public = credentials["nodes"][m]
                    flwr("supernode", "register", public, "localhost")
                    node += ["--root-certificates", credentials["ca"], "--auth-supernode-private-key", private]
                else:
                    node.append("--insecure")
                start(node, f"supernode{m}.log")
        return run_app(args, env, out, work, started, flwr)
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
        if args.keep:
            print(f"the run's folder (certificates, node keys, logs) is kept: {work}", flush=True)
        else:  # the node keys and the CA's key are not left behind
            shutil.rmtree(work, ignore_errors=True)


def run_app(args, env, out, work, started, flwr) -> dict:
    """``flwr run`` of this app on the SuperLink, then each method's summary the server wrote."""
    run_config = f"methods={json.dumps(args.methods)} num-clients={args.num_nodes} result-dir={json.dumps(out)}"
    if args.num_rounds is not None:
        run_config += f" num-rounds={args.num_rounds}"
    words = ["run", os.path.abspath(args.app), "localhost", "--stream", "--run-config", run_config]
    if args.simulation:
        words += ["--federation-config", f"num-supernodes={args.num_nodes}"]
    left = args.timeout - (time.monotonic() - started)
    try:
        completed = flwr(*words, timeout=max(left, 1.0))
        print(completed.stdout[-4000:], completed.stderr[-4000:], sep="\n", flush=True)
    except RuntimeError as error:
        print(error, flush=True)
    results = {}
    for name in args.methods.split(","):
        path = os.path.join(out, f"{name.strip()}.json")
        if not os.path.exists(path):
            logs = "".join(
                open(os.path.join(work, n)).read()[-3000:] for n in sorted(os.listdir(work)) if n.endswith(".log")
            )
            raise RuntimeError(f"the run wrote no {path}; logs:\n{logs}")
        with open(path) as f:
            results[name.strip()] = json.load(f)
    kept = args.keep or args.out is not None
    print(f"finished in {time.monotonic() - started:.0f} s" + (f"; results in {out}" if kept else ""))
    return results


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
