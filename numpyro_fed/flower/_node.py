"""The node's side of Flower: what the ``ClientApp`` of :func:`numpyro_fed.flower.client_app`
does with each message.

* ``describe``: runs the app's loader on the node config; replies shapes, dtypes, row counts
  and scalar settings, and the node's ``partition-id``.
* ``start``: rebuilds the client program from the recipe (:mod:`.recipe`), loads the
  node's block and replies its shapes; keeps the recipe in ``context.state`` so that later
  messages (a new process per message in a deployed SuperNode) rebuild the same program.
* ``call``: runs one function of the program on the block; replies its arrays.

A process keeps the programs, blocks and compiled functions it built (Flower's simulation
reuses its worker processes); a deployed SuperNode starts a process per message, where JAX's
persistent compilation cache (``jax-cache-dir`` in the node config) saves the compiling.
"""

from __future__ import annotations

import json
import os
import time
from collections import OrderedDict

import numpy as np

import jax

from numpyro_fed.flower._exported import ExportStore, rows_digest, signature

__all__ = ["NodeHandler", "Profile", "process_age"]

_STATE_KEY = "numpyro_fed_recipe"
_CLIENT_STATE = "numpyro_fed_client_state"  # which versions this node keeps, of which run
_VERSION = "numpyro_fed_client_state_v{}"  # the arrays of one version
_CACHE_SIZE = 4  # recipes whose programs a process keeps (a run, its resumption, a few methods)


class _Cache:
    """Per process: recipe digest -> program, block per client, compiled functions."""

    def __init__(self):
        self.entries = OrderedDict()

    def get(self, digest):
        entry = self.entries.get(digest)
        if entry is not None:
            self.entries.move_to_end(digest)
        return entry

    def put(self, digest, entry):
        self.entries[digest] = entry
        self.entries.move_to_end(digest)
        while len(self.entries) > _CACHE_SIZE:
            self.entries.popitem(last=False)


_CACHE = _Cache()

#: ``NUMPYRO_FED_NODE_PROFILE``: a file to which each message appends a JSON line of where its
#: seconds went (benchmarks/flower.py --deployment reads them)
_PROFILE_ENV = "NUMPYRO_FED_NODE_PROFILE"


def process_age() -> float:
    """Seconds since this process started (Linux; ``nan`` elsewhere): in a deployed
    ``ClientApp`` process, what Flower's start-up and the app's imports took before the
    message reached its handler."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = float(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):  # pragma: no cover - not Linux
        return float("nan")


class Profile:
    """Where one message's seconds go on the node: ``phase(name)`` times a block; ``write``
    appends the record to the file ``NUMPYRO_FED_NODE_PROFILE`` names (nothing without it)."""

    current = None

    def __init__(self, action):
        self.record = {"action": action, "pid": os.getpid(), "process_age": process_age()}
        self.start = time.perf_counter()

    def phase(self, name):
        profile = self

        class _Timer:
            def __enter__(self):
                self.t = time.perf_counter()

            def __exit__(self, *exc):
                profile.record[name] = profile.record.get(name, 0.0) + time.perf_counter() - self.t

        return _Timer()

    def write(self, call=None):
        path = os.environ.get(_PROFILE_ENV)
        if not path:
            return
        self.record["call"] = call
        self.record["handler"] = time.perf_counter() - self.start
        with open(path, "a") as f:
            f.write(json.dumps(self.record) + "\n")


def _phase(name):
    profile = Profile.current
    if profile is None:
        return _NoTimer()
    return profile.phase(name)


class _NoTimer:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _partition_id(node_config) -> int:
    value = node_config.get("partition-id") if hasattr(node_config, "get") else None
    return -1 if value is None else int(value)


def _cache_dir(node_config) -> str:
    """The node's cache folder: the node config's ``jax-cache-dir`` (default
    ``~/.cache/numpyro_fed/jax``; ``""``: none)."""
    path = node_config.get("jax-cache-dir") if hasattr(node_config, "get") else None
    if path is None:
        path = os.path.join(os.path.expanduser("~"), ".cache", "numpyro_fed", "jax")
    return str(path)


def _configure_compilation_cache(node_config):
    """JAX's persistent compilation cache in the node's ``jax-cache-dir``, for every
    compilation however short: rebuilding the client program runs some fifty small operations
    eagerly, each compiled apart (rebuilding the example app's DPPVI program alone in a fresh
    process on this project's loaded 2-core machine took 1.7-3.1 s uncached or with a
    threshold of 0.2 s, 0.4-0.5 s with every compilation cached). With the store of
    :mod:`._exported` a node rebuilds the program only at its first message of a run."""
    path = _cache_dir(node_config)
    if not path:
        return
    if jax.config.jax_compilation_cache_dir != path:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


class _Lookup:
    """What a message found in the node's store (:mod:`._exported`): the stored function
    ``run`` (``None``: not stored) with its ``header``, and how to store what it did not find
    (the rows it loaded to check the block's digest, the keys)."""

    def __init__(self, store, rows=None, block_key=None, request=(), block=None):
        self.store, self.rows, self.block = store, rows, block
        self.block_key, self.request = block_key, request
        self.take(None)

    def take(self, found):
        """What the store answered for the function: ``(header, run)``, ``None`` (nothing
        stored) or ``False`` (not exportable)."""
        self.header, self.run = found if found else ({}, None)
        self.exportable = found is not False

    def function_key(self) -> str:
        """The stored function's key: its block's, then the request and the shapes of the
        block's and the arguments' arrays."""
        *request, leaves = self.request
        return f"{self.block_key}.{signature(*request, self.block, leaves)}"

    def save(self, fn, block, args, describe=None) -> bool:
        """Stores the block (if new) and ``fn(block, *args)`` exported (if it can be); then
        :attr:`run` is it (compiled here as later messages will find it in JAX's cache)."""
        if self.store is None or not self.exportable:
            return False
        with _phase("export"):
            leaves, tree = jax.tree_util.tree_flatten((block, *args))
            if self.block is None:
                self.block = self.store.save_block(self.block_key, jax.tree_util.tree_leaves(block))
            self.take(self.store.save_function(self.function_key(), fn, tree, leaves, describe))
        return self.run is not None

    def __call__(self, *leaves):
        return self.run(*self.block, *leaves)


class NodeHandler:
    """Handles the messages of :class:`~numpyro_fed.flower.FlowerFederation` on a node with
    the app's ``methods`` (name -> method, or ``"module:attribute"`` naming them, imported when
    first needed) and ``load`` (``node_config -> model arguments``)."""

    def __init__(self, methods, load):
        self._methods = methods if isinstance(methods, str) else dict(methods)
        self.load = load

    @property
    def methods(self) -> dict:
        if isinstance(self._methods, str):
            import importlib

            from numpyro_fed.flower.serverapp import as_methods

            module, attribute = self._methods.split(":")
            with _phase("import_methods"):
                self._methods = as_methods(getattr(importlib.import_module(module), attribute))
        return self._methods

    # -- messages --------------------------------------------------------------------------
    def describe(self, msg, context):
        from numpyro_fed.federation.base import describe_arguments
        from numpyro_fed.flower._wire import encode_description

        args = self.load(context.node_config)
        return {
            "partition_id": _partition_id(context.node_config),
            "description": encode_description(describe_arguments(args)),
        }, None

    def start(self, msg, context):
        from numpyro_fed.flower._wire import encode_description
        from numpyro_fed.flower.clientapp import import_flwr
        from numpyro_fed.flower.recipe import Recipe

        flwr = import_flwr()
        config = msg.content["numpyro_fed"]
        recipe = Recipe.from_config(config)
        client = int(config["client"])
        entry = self._entry(recipe, client, context.node_config)
        functions = json.loads(config["functions"])
        program = entry["program"]
        mine = sorted(program.functions) + sorted(f"stateful:{n}" for n in program.stateful)
        if mine != functions:
            raise RuntimeError(
                f"the node's program has functions {mine}, the server's {functions}: the server "
                "and the nodes must run the same app"
            )
        stored = {k: config[k] for k in recipe.to_config()}
        stored["client"] = client
        context.state[_STATE_KEY] = flwr.app.ConfigRecord(stored)
        from numpyro_fed.federation.base import block_spec

        return {"block": encode_description(block_spec(entry["blocks"][client]))}, None

    def call(self, msg, context):
        from numpyro_fed.flower._wire import decode_tree

        recipe, client, name, config = self._started(msg, context)
        leaves = msg.content["args"].to_numpy_ndarrays()
        axes = [int(a) for a in config["in_axes"]] if bool(config["batched"]) else None
        request = (str(config["structure"]), axes)
        found = self._lookup(msg, recipe, client, context.node_config, "functions", name, request, leaves)
        if found.run is None:
            entry = self._entry(recipe, client, context.node_config, rows=found.rows)
            args = decode_tree(str(config["structure"]), leaves)  # after the methods' modules are imported
            in_axes = None
            if axes is not None:
                in_axes = jax.tree_util.tree_unflatten(
                    jax.tree_util.tree_structure(args), [None if a < 0 else a for a in axes]
                )
            fn, block = self._compiled(entry, name, in_axes), entry["blocks"][client]
            if not found.save(fn, block, args):
                with _phase("compile_and_run"):
                    return None, [np.asarray(x) for x in jax.tree_util.tree_leaves(fn(block, *args))]
        with _phase("compile_and_run"):
            return None, found(*leaves)

    def state(self, msg, context):
        """``init_state`` (version 0 of this node's client state) or a call of a stateful
        function on the state of the version the server names. The state lives in Flower's
        ``context.state`` (the last two versions, so that a call is a pure function of the
        version and its arguments: a retried call, or a run resumed from its last completed
        round, finds the version it starts from); only the reply goes back."""
        from numpyro_fed.flower._wire import decode_tree, encode_tree
        from numpyro_fed.flower.clientapp import import_flwr

        flwr = import_flwr()
        recipe, client, name, config = self._started(msg, context)
        leaves = msg.content["args"].to_numpy_ndarrays()
        kept = context.state[_CLIENT_STATE] if _CLIENT_STATE in context.state else None
        versions = [] if kept is None or kept["run"] != recipe.digest else [int(v) for v in kept["versions"]]
        if name == "init_state":  # the state as sent: its structure and arrays
            keep, version, structure, value, reply = (
                sorted(set(versions) | {0}),
                0,
                str(config["structure"]),
                leaves,
                [],
            )
        else:
            version = int(config["version"])
            if version not in versions:
                raise LookupError(
                    f"client {client} holds no client state of version {version} (it holds "
                    f"{'versions ' + str(versions) if versions else 'none'}): its SuperNode lost it "
                    "(restarted), or the state is of another run"
                )
            structure = str(kept["structure"])
            state = context.state[_VERSION.format(version)].to_numpy_ndarrays()
            request = ("stateful", structure, str(config["structure"]))
            found = self._lookup(msg, recipe, client, context.node_config, "stateful", name, request, state + leaves)
            if found.run is None:
                entry = self._entry(recipe, client, context.node_config, rows=found.rows)
                args = (decode_tree(structure, state), *decode_tree(str(config["structure"]), leaves))
                fn, block = self._compiled(entry, name, None, table="stateful"), entry["blocks"][client]

                def describe(out):  # how the node reads the result's leaves: the new state, then the reply
                    value = jax.tree_util.tree_map(lambda _: np.zeros(()), out[0])
                    return {"structure": encode_tree(value)[0], "num_state": len(jax.tree_util.tree_leaves(out[0]))}

                if not found.save(fn, block, args, describe):
                    with _phase("compile_and_run"):
                        new, out = fn(block, *args)
                        structure, value = encode_tree(jax.tree_util.tree_map(np.asarray, new))
                        reply = [np.asarray(x) for x in jax.tree_util.tree_leaves(out)]
            if found.run is not None:
                with _phase("compile_and_run"):
                    out = found(*state, *leaves)
                n = int(found.header["num_state"])
                structure, value, reply = str(found.header["structure"]), out[:n], out[n:]
            keep, version = [version, version + 1], version + 1
        context.state[_VERSION.format(version)] = flwr.app.ArrayRecord([np.asarray(x) for x in value])
        previous = [] if kept is None else [int(v) for v in kept["versions"]]  # of this run or an earlier one
        for old in previous:
            if old not in keep and _VERSION.format(old) in context.state:
                del context.state[_VERSION.format(old)]
        context.state[_CLIENT_STATE] = flwr.app.ConfigRecord(
            {"run": recipe.digest, "structure": structure, "versions": [int(v) for v in keep]}
        )
        return {"version": version}, reply

    @staticmethod
    def _started(msg, context):
        """``(recipe, client, name, config)`` of a call to a started node."""
        from numpyro_fed.flower.recipe import Recipe

        if _STATE_KEY not in context.state:
            raise RuntimeError(
                "this node has not been started for the run (no recipe in its state): the "
                "server must send 'start' first"
            )
        stored = context.state[_STATE_KEY]
        config = msg.content["numpyro_fed"]
        return Recipe.from_config(stored), int(stored["client"]), str(config["call"]), config

    # -- the program -----------------------------------------------------------------------
    def _lookup(self, msg, recipe, client, node_config, table, name, request, leaves) -> _Lookup:
        """The node's stored function ``table[name]`` for this request (its arguments'
        structure and batching, ``leaves``' shapes) on this client's block of this Flower run
        (``flwr run``: the app's code cannot change within one), if it has one
        (:mod:`._exported`). Not in Flower's simulation, whose worker processes keep the
        program in memory, nor on a node without a cache folder."""
        entry = _CACHE.get(recipe.digest)
        store = ExportStore.for_node(_cache_dir(node_config))
        if (entry is not None and client in entry["blocks"]) or store is None:
            return _Lookup(None)
        recipe.use_precision()
        _configure_compilation_cache(node_config)
        with _phase("load_rows"):
            rows = self.load(node_config)
            run_id = getattr(getattr(msg, "metadata", None), "run_id", None)
            block_key = signature("block", run_id, recipe.digest, client, rows_digest(rows), recipe.x64)
        with _phase("load_exported"):
            lookup = _Lookup(store, rows, block_key, (table, name, request, leaves), store.load_block(block_key))
            if lookup.block is not None:  # else the key needs the block's shapes: known once it is built
                lookup.take(store.load_function(lookup.function_key()))
        return lookup

    def _entry(self, recipe, client, node_config, rows=None):
        from numpyro_fed.federation.base import check_block
        from numpyro_fed.flower.recipe import rebuild_program

        recipe.use_precision()
        digest = recipe.digest
        entry = _CACHE.get(digest)
        if entry is None:
            method = self.methods.get(recipe.name)
            if method is None:
                raise KeyError(
                    f"the server runs method '{recipe.name}', which this node's app does not have "
                    f"(it has {sorted(self.methods)}): the server and the nodes must run the same app"
                )
            _configure_compilation_cache(node_config)
            load, node_configs, preloaded = self.load, {}, {}

            def loader(m):  # client m's rows, with the config of the node that is client m here
                m = int(m)
                return preloaded.pop(m) if m in preloaded else load(node_configs[m])

            with _phase("rebuild_program"):
                program = rebuild_program(method, recipe, loader)
            entry = {
                "program": program,
                "blocks": {},
                "compiled": {},
                "node_configs": node_configs,
                "preloaded": preloaded,
            }
            _CACHE.put(digest, entry)
        if client not in entry["blocks"]:
            # a process may serve several nodes (Flower's simulation): the program is theirs in
            # common, the block is built from the rows of the node that asks
            entry["node_configs"][client] = node_config
            if rows is not None:  # already loaded (to look up the node's store)
                entry["preloaded"][client] = rows
            program = entry["program"]
            with _phase("load_block"):
                block = program.loader(client)
                check_block(block, client, program.spec)
                entry["blocks"][client] = jax.tree_util.tree_map(jax.numpy.asarray, block)
        return entry

    @staticmethod
    def _compiled(entry, name, in_axes, table="functions"):
        key = (table, name, repr(in_axes))
        fn = entry["compiled"].get(key)
        if fn is None:
            try:
                raw = getattr(entry["program"], table)[name]
            except KeyError:
                raise KeyError(f"the client program has no {table} function '{name}'") from None
            fn = jax.jit(raw) if in_axes is None else jax.jit(jax.vmap(raw, in_axes=(None,) + tuple(in_axes)))
            entry["compiled"][key] = fn
        return fn
