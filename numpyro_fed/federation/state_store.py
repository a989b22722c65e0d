"""A worker's client state between calls: its stateful functions compiled so that what they
leave unchanged is neither copied nor saved again, and its copy on disk, one file per array.

A stateful call returns the client's whole new state; most calls change little of it (a
sampler's round reads a client's row weights, computed once, and returns them as they were).
:func:`passthrough_jit` compiles such a function to return only the arrays it changed and
hands back the unchanged ones as the very objects it was given; :class:`StateStore` then
writes to disk only arrays it has not written before, so a call that changes nothing costs a
small index file, however large the state.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle

import numpy as np

import jax

__all__ = ["StateStore", "passthrough_jit"]


def passthrough_jit(fn):
    """``fn(block, state, *args) -> (new_state, reply)`` under ``jax.jit``, where every array of
    ``new_state`` that ``fn`` returns unchanged (the same traced value as in ``state``) is the
    array given in ``state``, not a copy.

    >>> import jax.numpy as jnp
    >>> call = passthrough_jit(lambda block, state, x: ({"kept": state["kept"], "n": state["n"] + x}, x))
    >>> state = {"kept": jnp.arange(3.0), "n": jnp.zeros(())}
    >>> new, reply = call(None, state, 1.0)
    >>> new["kept"] is state["kept"], float(new["n"])
    (True, 1.0)
    """
    forwarded = {}  # the arguments' signature -> (state's structure, per leaf: input index or None)
    traces = []  # every trace's finding: while there is one, every call reuses it

    def changed_only(block, state, *args):
        new_state, reply = fn(block, state, *args)
        given = {id(leaf): i for i, leaf in enumerate(jax.tree_util.tree_leaves(state))}
        leaves, treedef = jax.tree_util.tree_flatten(new_state)
        which = tuple(given.get(id(leaf)) for leaf in leaves)
        traces.append((treedef, which))
        return [leaf for leaf, i in zip(leaves, which) if i is None], reply

    compiled = jax.jit(changed_only)

    def call(block, state, *args):
        seen = len(traces)
        changed, reply = compiled(block, state, *args)
        traced = len(traces) > seen  # this call traced
        if traced or len(traces) > 1:  # jit traced once: its only trace holds, no signature needed
            signature = _signature(block, state, args)
            if traced:
                forwarded[signature] = traces[-1]
            elif signature not in forwarded:  # jit's cache met these arguments under another signature
                jax.eval_shape(changed_only, block, state, *args)
                forwarded[signature] = traces[-1]
            treedef, which = forwarded[signature]
        else:
            treedef, which = traces[0]
        given, changed = jax.tree_util.tree_leaves(state), iter(changed)
        leaves = [next(changed) if i is None else given[i] for i in which]
        return jax.tree_util.tree_unflatten(treedef, leaves), reply

    return call


def _signature(*trees):
    leaves, treedef = jax.tree_util.tree_flatten(trees)
    return treedef, tuple(_leaf_signature(leaf) for leaf in leaves)


def _leaf_signature(leaf):
    """What jit specializes on (shape and dtype, or a Python scalar's type), and the type."""
    if hasattr(leaf, "dtype"):
        return leaf.shape, leaf.dtype, type(leaf)
    return np.shape(leaf), type(leaf)


class StateStore:
    """A client's state versions in ``folder``: one ``.npy`` file per array, written once, and
    an index (the versions' structures naming their files) replaced atomically after the new
    arrays are written, so a worker that dies mid-save leaves the previous versions readable.
    Files no version names any more are removed after the index is replaced (those of an
    earlier worker in the same folder, by :meth:`clear`).
    """

    INDEX = "index.pkl"

    def __init__(self, folder):
        self.folder = folder
        self._written = {}  # id(array) -> (its file, the array: kept so that its id stays its own)
        self._names = itertools.count()

    def save(self, states: dict) -> None:
        """Writes ``{version: state}``: arrays already written (the same objects) are not
        written again."""
        os.makedirs(self.folder, exist_ok=True)
        written, pid = {}, os.getpid()
        for leaf in jax.tree_util.tree_leaves(states):
            if id(leaf) in written:
                continue
            known = self._written.get(id(leaf))
            if known is None or known[1] is not leaf:
                name = f"leaf-{pid}-{next(self._names)}.npy"
                np.save(os.path.join(self.folder, name), np.asarray(leaf), allow_pickle=False)
                known = (name, leaf)
            written[id(leaf)] = known
        index = {v: jax.tree_util.tree_map(lambda leaf: written[id(leaf)][0], s) for v, s in states.items()}
        partial = os.path.join(self.folder, f"{self.INDEX}.{pid}.tmp")
        with open(partial, "wb") as f:
            pickle.dump(index, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(partial, os.path.join(self.folder, self.INDEX))
        dropped = {name for name, _ in self._written.values()} - {name for name, _ in written.values()}
        self._written = written
        for name in dropped:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.folder, name))

    def load(self) -> dict:
        """The saved ``{version: state}`` (NumPy arrays), or ``{}`` if none was saved."""
        path = os.path.join(self.folder, self.INDEX)
        if not os.path.exists(path):
            return {}
        with open(path, "rb") as f:
            index = pickle.load(f)
        arrays = {}

        def read(name):
            if name not in arrays:
                arrays[name] = np.load(os.path.join(self.folder, name), allow_pickle=False)
            return arrays[name]

        return {v: jax.tree_util.tree_map(read, s) for v, s in index.items()}

    def clear(self) -> None:
        """Removes the saved versions and the folder."""
        self._written = {}
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self.folder):  # this worker's arrays and any earlier worker's
                if name.startswith("leaf-"):
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(os.path.join(self.folder, name))
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(self.folder, self.INDEX))
        with contextlib.suppress(OSError):
            os.rmdir(self.folder)
