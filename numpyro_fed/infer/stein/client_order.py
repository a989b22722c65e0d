"""Which client(s) each round schedules: ``client_order`` of the SVGD family's methods."""

from __future__ import annotations

import numpy as np

import jax

__all__ = ["check_client_order", "make_client_order"]

_NAMES = ("round_robin", "random")


def check_client_order(client_order):
    """A method's ``client_order`` argument, its name checked (sequences are checked by
    :func:`make_client_order`, which knows the number of rounds and clients).

    >>> check_client_order("random")
    'random'
    """
    if isinstance(client_order, str) and client_order not in _NAMES:
        raise ValueError(
            f"client_order must be 'round_robin', 'random' or a sequence of client indices, got {client_order!r}"
        )
    return client_order


def make_client_order(
    client_order, num_rounds: int, num_clients: int, rng_key, per_round: int | None = None
) -> np.ndarray:
    """``(num_rounds,)`` (or ``(num_rounds, per_round)``) client indices, one row per round.

    ``"round_robin"``: clients ``0, 1, ..., K - 1, 0, ...``; ``"random"``: uniformly random
    clients from ``rng_key`` (distinct within a round when ``per_round`` is given); a sequence:
    checked (integer indices of existing clients, at least ``num_rounds`` rows, no client
    twice in a round) and cut to ``num_rounds``.

    >>> make_client_order("round_robin", 5, 2, None).tolist()
    [0, 1, 0, 1, 0]
    >>> make_client_order("round_robin", 2, 3, None, per_round=2).tolist()
    [[0, 1], [2, 0]]
    """
    if isinstance(client_order, str):
        check_client_order(client_order)
        if client_order == "round_robin":
            if per_round is None:
                return np.arange(num_rounds) % num_clients
            start = np.arange(num_rounds)[:, None] * per_round + np.arange(per_round)[None, :]
            return start % num_clients
        if per_round is None:
            return np.asarray(jax.random.randint(rng_key, (num_rounds,), 0, num_clients))
        keys = jax.random.split(rng_key, num_rounds)
        return np.asarray(jax.vmap(lambda k: jax.random.permutation(k, num_clients)[:per_round])(keys))
    array = np.asarray(client_order)
    if array.dtype == bool or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"client_order must hold integer client indices, got dtype {array.dtype}")
    expected_ndim = 1 if per_round is None else 2
    if array.ndim != expected_ndim:
        shape = "(num_rounds,)" if per_round is None else "(num_rounds, clients_per_round)"
        raise ValueError(f"client_order must have shape {shape}, got {array.shape}")
    if array.shape[0] < num_rounds:
        raise ValueError(f"client_order gives {array.shape[0]} rounds, but num_rounds={num_rounds}")
    bad = array[(array < 0) | (array >= num_clients)]
    if bad.size:
        raise ValueError(
            f"client_order names unknown client(s) {sorted(set(bad.tolist()))}: clients are 0..{num_clients - 1}"
        )
    if per_round is not None:
        for i, row in enumerate(array[:num_rounds]):
            if len(set(row.tolist())) != row.size:
                raise ValueError(f"client_order round {i} names a client twice: {row.tolist()}")
    return array[:num_rounds]
