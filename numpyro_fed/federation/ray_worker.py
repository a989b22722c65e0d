"""A client's Ray worker: the actor :class:`~numpyro_fed.federation.RayFederation` starts
for each client, holding that client's block, its compiled functions and its client state.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
import time
from collections import defaultdict

import numpy as np

import jax
import jax.numpy as jnp

from numpyro_fed.federation.state_store import StateStore, passthrough_jit

__all__ = ["ClientWorker", "import_ray", "state_folder", "thread_limits"]


def thread_limits(threads: int = 1) -> dict:
    """Environment variables that limit a JAX process to ``threads`` compute threads (OpenMP,
    MKL, OpenBLAS; with ``threads=1`` also XLA's multi-threaded Eigen kernels, which XLA can
    only switch off, not size): what each client actor gets, so that several clients on one
    machine do not oversubscribe its cores."""
    n = str(threads)
    limits = {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "OPENBLAS_NUM_THREADS": n, "TF_NUM_INTRAOP_THREADS": n}
    if threads == 1:
        limits["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false"
    return limits


def import_ray():
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("RayFederation needs Ray: pip install 'numpyro_fed[ray]'") from exc
    return ray


def _same_arrays(new, old) -> bool:
    """``new`` is ``old``'s structure holding ``old``'s very arrays (a call that returned its
    state unchanged, see :func:`~numpyro_fed.federation.state_store.passthrough_jit`)."""
    new_leaves, new_def = jax.tree_util.tree_flatten(new)
    old_leaves, old_def = jax.tree_util.tree_flatten(old)
    return new_def == old_def and all(a is b for a, b in zip(new_leaves, old_leaves))


# -- the actor --------------------------------------------------------------------------------


def state_folder(state_dir, federation_id):
    """Where a federation's workers save their client state: ``state_dir`` (default: the
    worker's temporary folder) / ``numpyro_fed_state`` / the federation's id."""
    base = tempfile.gettempdir() if state_dir is None else state_dir
    return os.path.join(base, "numpyro_fed_state", federation_id)


class ClientWorker:
    """Client ``m``'s worker: its block, its functions compiled on first use, and its client
    state (the last two versions, saved to its disk after each stateful call that changes
    it: the arrays a call left unchanged are neither copied nor written again)."""

    def __init__(self, client, x64, state_dir=None, federation_id=None):
        jax.config.update("jax_enable_x64", bool(x64))
        self.client = int(client)
        self.program = None
        self.block = None
        self.compiled = {}
        self.states = {}  # version -> this client's state
        # after a restart: (the newest version saved, its state). A stateful call saves only
        # when it changes the state, so every later version a run reached holds the same state
        self.restored = None
        self.store = (
            None
            if federation_id is None
            else StateStore(os.path.join(state_folder(state_dir, federation_id), f"client{self.client}"))
        )
        self.busy = defaultdict(lambda: [0, 0.0])  # name -> [calls, seconds computing]

    def describe(self, loader):
        """Runs the user's loader here; reports shapes, dtypes and scalar settings only."""
        from numpyro_fed.federation.base import describe_arguments

        return describe_arguments(loader(self.client))

    def load(self, program):
        """Takes the program; loads (deployment) and checks the block; reports its shapes
        and dtypes only."""
        from numpyro_fed.federation.base import block_spec, check_block

        self.program, self.block, self.compiled = program, None, {}
        if not self.states:
            self._restore_state()
        if program.blocks is not None:
            block = program.blocks[0]  # the driver sent this client's block only
        else:
            block = program.loader(self.client)
        check_block(block, self.client, program.spec)
        self.block = jax.tree_util.tree_map(jnp.asarray, block)
        spec = block_spec(block)
        return jax.tree_util.tree_map(lambda s: (tuple(s.shape), np.dtype(s.dtype).str), spec)

    def ping(self):
        return self.client

    def _compiled(self, table, name, in_axes):
        key = (table, name, repr(in_axes))
        fn = self.compiled.get(key)
        if fn is None:
            raw = getattr(self.program, table)[name]
            if table == "stateful":
                fn = passthrough_jit(raw)
            elif in_axes is None:
                fn = jax.jit(raw)
            else:
                fn = jax.jit(jax.vmap(raw, in_axes=(None,) + tuple(in_axes)))
            self.compiled[key] = fn
        return fn

    def call(self, name, args, in_axes, version=None):
        """``functions[name](block, *args)``, ``vmap``-ed over ``in_axes`` if not ``None``.
        With ``version``: ``stateful[name](block, state, *args)`` from the state of that
        version; keeps the new state as version ``version + 1`` (and the one it started
        from, so that the same call again gives the same reply) and returns ``(reply,
        version + 1)``."""
        if version is not None:
            return self._call_stateful(name, args, int(version))
        fn = self._compiled("functions", name, in_axes)
        start = time.perf_counter()
        reply = jax.tree_util.tree_map(np.asarray, fn(self.block, *args))
        busy = self.busy[name]
        busy[0] += 1
        busy[1] += time.perf_counter() - start
        return reply

    def _call_stateful(self, name, args, version):
        state = self.states.get(version)
        if state is None and self.restored is not None and version > self.restored[0]:
            # saved last at version `restored`: the calls after it left the state as it was
            state = self.restored[1]
        if state is None:
            held = sorted(self.states)
            raise LookupError(
                f"client {self.client} holds no client state of version {version} (it holds "
                f"{'versions ' + str(held) if held else 'none'}): its worker restarted without its saved "
                f"state ({self.store.folder if self.store else 'not saved'}), or the state is from another run "
                "or federation"
            )
        fn = self._compiled("stateful", name, None)
        start = time.perf_counter()
        new_state, reply = fn(self.block, state, *args)
        reply = jax.tree_util.tree_map(np.asarray, reply)
        self.states = {version: state, version + 1: new_state}
        if not _same_arrays(new_state, state):  # a call that only reads its state saves nothing
            self._save_state()
        busy = self.busy[name]
        busy[0] += 1
        busy[1] += time.perf_counter() - start
        return reply, version + 1

    def set_state(self, initial):
        """Version 0 of this client's state (the versions a run reached stay until the next
        stateful call moves past them)."""
        self.states[0] = jax.tree_util.tree_map(jnp.asarray, initial)
        self._save_state()
        return self.client

    def _save_state(self):
        self.restored = None
        if self.store is not None:
            self.store.save(self.states)

    def _restore_state(self):
        if self.store is not None:
            self.states = jax.tree_util.tree_map(jnp.asarray, self.store.load())
            newest = max(self.states, default=None)
            self.restored = None if newest is None else (newest, self.states[newest])

    def clear_state(self):
        """Forgets this client's state and removes its saved copy."""
        self.states, self.restored = {}, None
        if self.store is not None:
            self.store.clear()
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(self.store.folder))
        return self.client

    def call_packed(self, payload):
        """:meth:`call` with its arguments and reply pickled into one ``bytes`` each: Ray
        serializes every argument and return value on its own (msgpack and pickle framing
        each time), which costs more than a small call's arrays; one buffer each way costs
        one."""
        name, args, in_axes, version = pickle.loads(payload)
        return pickle.dumps(self.call(name, args, in_axes, version), protocol=pickle.HIGHEST_PROTOCOL)

    def compute_time(self):
        """``{name: (calls, seconds)}``: the calls this client answered and the time it spent
        in their functions (not in Ray)."""
        return {name: (calls, seconds) for name, (calls, seconds) in self.busy.items()}

    def sleep(self, seconds):
        """For tests and benchmarks: keep the worker busy."""
        time.sleep(seconds)
        return self.client
