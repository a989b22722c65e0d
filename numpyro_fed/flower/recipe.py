"""How a node builds the server's client program from the app's own code.

The server runs ``method.run(rng_key, num_rounds)`` on a
:class:`~numpyro_fed.flower.FlowerFederation`; when the method starts its clients it sends
each node the *recipe* of that call: the method's name in the app, the key, the number of
rounds, the precision and what every node reported of its model arguments (shapes, dtypes,
row counts, scalar settings; never values). The node asks its own copy of the method for the
program of that run, :meth:`~numpyro_fed.infer.VariationalMethod.client_program` (the
artefact every variational method declares with ``plan_clients``), on a federation that
answers ``describe`` with those reports: the same functions the server built, and a loader
that builds this node's block from its own rows. No code crosses the wire.
"""

from __future__ import annotations

import copy
import hashlib
import json
import warnings

import numpy as np

import jax

__all__ = ["Recipe", "fresh_method", "rebuild_program"]

# per-run caches of a method's face, reset on a copy so that it splits the model anew
_RUN_CACHES = ("federated_potential", "_plan", "_setup_key", "_step", "_active_federation", "_client_spec")


def fresh_method(method, federation):
    """A shallow copy of ``method`` that runs on ``federation``, without the caches of an
    earlier run."""
    clone = copy.copy(method)
    for name in _RUN_CACHES:
        if name in vars(clone):
            setattr(clone, name, None)
    clone.federation = federation
    return clone


class Recipe:
    """The run whose client program a node builds: ``methods[name].run(rng_key, num_rounds)`` with the nodes'
    reports, in float64 or not."""

    def __init__(self, name: str, rng_key, num_rounds, x64: bool, descriptions: list[str], num_clients: int):
        self.name = str(name)
        self.rng_key = np.asarray(rng_key)
        self.num_rounds = None if num_rounds is None else int(num_rounds)
        self.x64 = bool(x64)
        self.descriptions = list(descriptions)
        self.num_clients = int(num_clients)

    def to_config(self) -> dict:
        """As a Flower ``ConfigRecord``'s values (and the key as an array)."""
        return {
            "method": self.name,
            "num_rounds": -1 if self.num_rounds is None else self.num_rounds,
            "x64": self.x64,
            "descriptions": json.dumps(self.descriptions),
            "num_clients": self.num_clients,
            "key_dtype": self.rng_key.dtype.str,
            "key": json.dumps(self.rng_key.tolist()),
        }

    @classmethod
    def from_config(cls, config) -> "Recipe":
        num_rounds = int(config["num_rounds"])
        key = np.asarray(json.loads(config["key"]), dtype=np.dtype(config["key_dtype"]))
        return cls(
            config["method"],
            key,
            None if num_rounds < 0 else num_rounds,
            bool(config["x64"]),
            json.loads(config["descriptions"]),
            int(config["num_clients"]),
        )

    def use_precision(self):
        """Makes this process compute in the run's precision (float64 or not), as the server."""
        if bool(jax.config.jax_enable_x64) != self.x64:
            jax.config.update("jax_enable_x64", self.x64)

    @property
    def digest(self) -> str:
        text = json.dumps(self.to_config(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _described(descriptions, loader, num_clients):
    """The node's stand-in for the server's federation (imported here, not with the module: a
    node's message that needs no rebuilding does not import the federation's code)."""
    from numpyro_fed.federation.base import Federation

    class _Described(Federation):
        """The node's stand-in for the server's federation: ``describe`` answers with the reports
        the server gathered (shapes, never rows), so that the method splits the model as the
        server did and builds the same client program; it is never started."""

        def __init__(self, descriptions, loader, num_clients):
            super().__init__(loader=loader, num_clients=num_clients)
            self._descriptions = descriptions

        def describe(self, loader, num_clients):
            if int(num_clients) != len(self._descriptions):
                raise ValueError(
                    f"the recipe describes {len(self._descriptions)} clients, the method asks for {num_clients}"
                )
            return list(self._descriptions)

        def start(self, program):
            raise RuntimeError("the node builds the client program; it starts no federation")

        @property
        def block_specs(self):  # pragma: no cover - never started
            raise RuntimeError("the node builds the client program; it starts no federation")

        def map(self, name, *broadcast, per_client=(), state=None):  # pragma: no cover - never started
            raise RuntimeError("the node builds the client program; it starts no federation")

        def one(self, name, client, *broadcast, own=(), state=None):  # pragma: no cover - never started
            raise RuntimeError("the node builds the client program; it starts no federation")

    return _Described(descriptions, loader, num_clients)


def rebuild_program(method, recipe: Recipe, loader):
    """The :class:`~numpyro_fed.federation.ClientProgram` that ``method.run(recipe's key,
    recipe's rounds)`` starts its clients on (:meth:`~numpyro_fed.infer.VariationalMethod.client_program`),
    built here with ``loader`` (``m -> this node's model arguments``) as the clients' loader."""
    from numpyro_fed.flower._wire import decode_description

    recipe.use_precision()
    descriptions = [decode_description(d) for d in recipe.descriptions]
    clone = fresh_method(method, _described(descriptions, loader, recipe.num_clients))
    clone.progress_bar = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the server warns about the run (e.g. its privacy); the node builds
        return clone.client_program(jax.numpy.asarray(recipe.rng_key), recipe.num_rounds)
