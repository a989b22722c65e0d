"""The ServerApp: runs the methods named in the run config (``methods``) on the nodes and
writes each run's posterior draws and a summary (privacy guarantee, message ledger, round
times) to ``result-dir``."""

import json
import os

import numpy as np

import jax

from fedapp.task import METHODS
from numpyro_fed import flower


def save(name, result, context):
    """Writes ``<result-dir>/<name>.npz`` (posterior draws by site) and ``<name>.json``."""
    folder = str(context.run_config.get("result-dir", ""))
    draws = result.method.get_samples(jax.random.PRNGKey(1), result, 1000)
    summary = {
        "method": name,
        "x64": bool(jax.config.jax_enable_x64),
        "rounds": int(len(result.metrics["wall_time"])),
        "round_seconds": np.diff(np.concatenate([[0.0], result.metrics["wall_time"]])).tolist(),
        "posterior_mean": {k: np.asarray(v).mean(axis=0).tolist() for k, v in draws.items()},
        "privacy": None
        if result.privacy is None
        else {
            "epsilon": result.privacy.epsilon,
            "delta": result.privacy.delta,
            "client_private_randomness": bool(result.privacy.client_private_randomness),
            "statement": str(result.privacy),
        },
        "bytes_to_clients": int(result.ledger["bytes_to_client"].sum()),
        "bytes_from_clients": int(result.ledger["bytes_from_client"].sum()),
    }
    print(json.dumps(summary))
    if folder:
        os.makedirs(folder, exist_ok=True)
        np.savez(os.path.join(folder, f"{name}.npz"), **{k: np.asarray(v) for k, v in draws.items()})
        with open(os.path.join(folder, f"{name}.json"), "w") as f:
            json.dump(summary, f, indent=1)


app = flower.server_app(METHODS, num_rounds=6, on_result=save)  # the run config's num-rounds overrides it
