"""Cross-silo deployment with Flower (``pip install 'numpyro_fed[flower]'``).

Each silo runs a Flower SuperNode next to its rows; a SuperLink coordinates; the app is
packaged and started with ``flwr run``. What the user writes is a model, a loader (each
node's rows, from its node config) and a method:

.. code-block:: python

    import numpyro_fed as nf
    from numpyro_fed import flower

    def load(node_config):  # runs on the node; rows never leave it
        data = np.load(node_config["data-path"])
        return data["X"], data["y"]

    server_app, client_app = flower.apps(nf.DPPVI(model, dp="dpsgd", target_epsilon=2.0),
                                         load, num_rounds=10, on_result=save)

The ``ServerApp`` runs the method's own server code on a :class:`FlowerFederation`, whose
calls to the clients are Flower Messages; the ``ClientApp`` rebuilds the same client program
from the app's own code (no code and no row crosses the wire), keeps what it needs between
messages in Flower's ``context.state`` and answers. The result is the method's
:class:`~numpyro_fed.infer.RunResult` (privacy guarantee and message ledger included), for
``nf.to_inference_data``. FedZigZag and the decentralized samplers are refused (see
:func:`check_method`).

* :func:`apps`: the ``ServerApp`` and the ``ClientApp`` of one or several methods;
  :func:`server_app` and :func:`client_app` build each alone.
* :func:`run`: one method's run on a ``Grid`` (inside your own ``ServerApp``).
* :func:`simulate`: Flower's simulation in this process, returning the runs' results.
* :class:`FlowerFederation`: the backend.

The names are imported on first use: a node's ``ClientApp`` process (Flower starts one per
message) imports :func:`client_app`'s module, which needs neither NumPyro nor the server's
code.

Flower's telemetry and update check are switched off by this module unless the environment
sets ``FLWR_TELEMETRY_ENABLED`` / ``FLWR_DISABLE_UPDATE_CHECK`` itself; so is the
``RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO`` notice of the Ray that Flower's simulation starts (set
to ``0``, the behaviour Ray announces as its future default: a worker that asks for no GPU is
left the devices its environment names).
"""

from __future__ import annotations

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
# read by ray.init, which Flower's simulation calls after loading the ClientApp
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")

from numpyro_fed._lazy import lazy_names  # noqa: E402

__all__ = ["FlowerFederation", "apps", "check_method", "client_app", "run", "server_app", "simulate"]

_WHERE = {
    "FlowerFederation": "numpyro_fed.flower.federation",
    "apps": "numpyro_fed.flower.serverapp",
    "check_method": "numpyro_fed.flower.serverapp",
    "client_app": "numpyro_fed.flower.clientapp",
    "run": "numpyro_fed.flower.serverapp",
    "server_app": "numpyro_fed.flower.serverapp",
    "simulate": "numpyro_fed.flower.serverapp",
}

__getattr__, __dir__ = lazy_names(__name__, _WHERE)
