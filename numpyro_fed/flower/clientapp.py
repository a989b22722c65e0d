"""The node's side of a Flower app: :func:`client_app`.

A deployed SuperNode starts a new ``ClientApp`` process for every message, so what this
module imports is paid per message: Flower, JAX and NumPy, and the node's handler
(:mod:`._node`); neither NumPyro nor the server's code. A node rebuilds the client program
(and imports the app's methods, hence NumPyro) at its first message of a run only; later
messages run the functions the node exported and stored then (:mod:`._exported`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

__all__ = ["client_app", "import_flwr"]


def import_flwr():
    """``flwr`` with its app, server and client modules, or an ``ImportError`` saying how to
    install it."""
    try:
        import flwr
        import flwr.app
        import flwr.clientapp
        import flwr.serverapp
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("numpyro_fed.flower needs Flower: pip install 'numpyro_fed[flower]'") from exc
    telemetry = sys.modules.get("flwr.supercore.telemetry")
    if telemetry is not None and os.environ.get("FLWR_TELEMETRY_ENABLED") == "0":
        telemetry.FLWR_TELEMETRY_ENABLED = "0"  # flwr read the variable before we set it
    return flwr


def client_app(methods, load: Callable, *, mods=None):
    """A Flower ``ClientApp`` for ``methods`` (as :func:`~numpyro_fed.flower.server_app`'s)
    whose nodes load their rows with ``load(node_config) -> model arguments`` (a tuple of
    positional arguments or a dict of keyword arguments, rows first, as a federation's
    ``loader``). ``mods``: Flower mods of the app.

    ``methods`` may also be named as ``"module:attribute"`` (e.g. ``"fedapp.task:METHODS"``):
    the node then imports them, and with them NumPyro and the model, only when it rebuilds
    the client program (its first message of a run), not for every message; ``load`` should
    then live in a module that does not import them either.

    >>> from numpyro_fed import flower
    >>> app = flower.client_app("fedapp.task:METHODS", lambda node_config: ())
    >>> type(app).__name__
    'ClientApp'
    """
    from numpyro_fed.flower._node import NodeHandler, Profile

    flwr = import_flwr()
    if not callable(load):
        raise TypeError(f"load must be a function node_config -> model arguments, got {type(load).__name__}")
    if isinstance(methods, str):
        if methods.count(":") != 1 or not all(methods.split(":")):
            raise ValueError(f"methods named by a string must read 'module:attribute', not {methods!r}")
    else:
        from numpyro_fed.flower.serverapp import as_methods

        methods = as_methods(methods)
    handler = NodeHandler(methods, load)
    app = flwr.clientapp.ClientApp(mods=list(mods or []))

    def reply(msg, context, fn):
        profile = Profile.current = Profile(fn.__name__)
        try:
            config, arrays = fn(msg, context)
        except Exception as exc:  # the node's own message reaches the server
            return flwr.app.Message(
                flwr.app.Error(code=0, reason=f"numpyro_fed node error: {type(exc).__name__}: {exc}"), reply_to=msg
            )
        finally:
            Profile.current = None
            content = msg.content["numpyro_fed"] if "numpyro_fed" in msg.content else {}
            profile.write(content.get("call") if hasattr(content, "get") else None)
        content = flwr.app.RecordDict()
        if config is not None:
            content["numpyro_fed"] = flwr.app.ConfigRecord(config)
        if arrays is not None:
            content["reply"] = flwr.app.ArrayRecord(arrays)
        return flwr.app.Message(content, reply_to=msg)

    for action in ("describe", "start", "call", "state"):  # the message types of FlowerFederation

        def answer(msg, context, fn=getattr(handler, action)):
            return reply(msg, context, fn)

        app.query(f"numpyro_fed_{action}")(answer)
    return app
