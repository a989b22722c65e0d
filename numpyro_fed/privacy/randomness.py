"""Client-private randomness: the keys a client draws its DP noise and subsampling from are
ones the server cannot know.

A server that chose the key a client's noise is drawn from can draw the same noise again and
remove it from what the client sent: against that server the run is not private. So, whenever
the clients are separate parties (any engine, and any deployment in which each client loads
its own rows: :func:`clients_are_separate`), each client draws a seed from its operating
system's entropy (``secrets``) where it builds its block (:class:`PrivateSeed`), and every
call that takes a key folds that seed into the key the server sent
(:func:`private_program`). The server's key still makes the runs of one client differ from
round to round; the seed makes them unknown to the server. In-process simulation, where one
party holds every row anyway, stays reproducible.

One mechanism for every algorithm: :func:`private_program` wraps a client program's calls by
name, given where each call's key is among its arguments.
"""

from __future__ import annotations

import secrets
from functools import partial

import numpy as np

import jax
import jax.numpy as jnp

__all__ = [
    "PrivateSeed",
    "clients_are_separate",
    "draw_seeds",
    "private_program",
    "resolve_private_randomness",
]


def clients_are_separate(federation) -> bool:
    """Whether ``federation``'s clients are parties apart from the server: an engine (its
    clients elsewhere, :attr:`~numpyro_fed.federation.Federation.in_process` false) or a
    deployment (each client loads its own rows, ``loader=``), in this process or not."""
    return (not federation.in_process) or bool(federation.deployed)


def resolve_private_randomness(requested, federation, private: bool) -> bool:
    """Whether a run's clients draw their randomness privately: as ``requested`` when it is a
    bool, else (``None``, the default) when the run is ``private`` (it has a DP guarantee)
    and its clients are separate parties (:func:`clients_are_separate`)."""
    if requested is not None:
        if not isinstance(requested, (bool, np.bool_)):
            raise TypeError(f"private_randomness must be True, False or None, got {requested!r}")
        return bool(requested)
    return bool(private) and clients_are_separate(federation)


def draw_seeds(count: int) -> np.ndarray:
    """``(count,)`` uint32 seeds from the operating system's entropy."""
    return np.array([secrets.randbits(32) for _ in range(int(count))], dtype=np.uint32)


class PrivateSeed:
    """Runs where a client lives, as its program's ``transform``: the client's block (after
    ``transform``, the algorithm's own layout, if given) and a seed drawn there from the
    operating system's entropy, which the server never sees."""

    def __init__(self, transform=None):
        self.transform = transform

    def __call__(self, block):
        rows = block if self.transform is None else self.transform(block)
        return {"rows": rows, "seed": draw_seeds(1)[0]}

    def __repr__(self):
        return f"PrivateSeed({self.transform!r})" if self.transform is not None else "PrivateSeed()"


def _is_key(key) -> bool:
    dtype = jnp.result_type(key)
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) or (dtype == jnp.uint32 and np.shape(key)[-1:] == (2,))


def _fold(key_index, name, block, args):
    args = list(args)
    key = args[key_index]
    if not _is_key(key):
        raise RuntimeError(
            f"private randomness: argument {key_index} of the clients' call '{name}' is not its key "
            f"(dtype {jnp.result_type(key)}, shape {np.shape(key)}): the call's arguments changed order"
        )
    args[key_index] = jax.random.fold_in(key, block["seed"])
    return args


def _keyed_call(fn, key_index, name, block, *args):
    return fn(block["rows"], *_fold(key_index, name, block, args))


def _keyed_stateful_call(fn, key_index, name, block, state, *args):
    return fn(block["rows"], state, *_fold(key_index, name, block, args))


def _plain_call(fn, block, *args):
    return fn(block["rows"], *args)


def private_program(functions: dict, stateful: dict | None = None, *, keys: dict) -> tuple[dict, dict]:
    """``(functions, stateful)`` that run on blocks made by :class:`PrivateSeed`: each call
    named in ``keys`` (``name -> i``, its key the ``i``-th argument after the block, and after
    the client's state for a stateful call) has the client's seed folded into that key; every
    call receives the client's own block. Picklable when the functions are."""
    stateful = dict(stateful or {})
    unknown = sorted(set(keys) - set(functions) - set(stateful))
    if unknown:
        raise ValueError(f"private_program: {unknown} are not calls of the program")
    wrapped = {
        name: partial(_keyed_call, fn, keys[name], name) if name in keys else partial(_plain_call, fn)
        for name, fn in functions.items()
    }
    wrapped_stateful = {
        name: partial(_keyed_stateful_call, fn, keys[name], name) if name in keys else partial(_plain_call, fn)
        for name, fn in stateful.items()
    }
    return wrapped, wrapped_stateful
