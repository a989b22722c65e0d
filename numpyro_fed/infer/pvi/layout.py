"""PVI's layout of a client's rows: its block (:class:`ClientData`), built where the client
lives by :class:`BlockLayout`, with its shards (:func:`shard_layout`)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

import jax
import jax.numpy as jnp

__all__ = ["BlockLayout", "ClientData", "shard_layout"]


class ClientData(NamedTuple):
    """Every client's rows and settings, stacked and padded: client ``m``'s slice (leading
    axis) is its block, all it holds.

    :ivar rows: list of arrays ``(M, R, ...)``: the model arguments cut per client.
    :ivar valid: ``(M, R)`` mask of real (non-padding) rows.
    :ivar shard_index: ``(M, K, R_k)`` row positions of each client's shards.
    :ivar shard_valid: ``(M, K, R_k)`` mask of real rows in each shard.
    :ivar noise_multiplier: ``(M,)`` each client's noise standard deviation over its clip
        norm (the client adds its own noise); zeros without privacy.
    :ivar clip_first: ``(M,)`` automatic DP-SGD clip norms of a state's first round, or
        ``None``.
    :ivar clip_later: ``(M,)`` those of later rounds, or ``None``.
    """

    rows: list
    valid: jax.Array
    shard_index: jax.Array
    shard_valid: jax.Array
    noise_multiplier: jax.Array | None = None
    clip_first: jax.Array | None = None
    clip_later: jax.Array | None = None


class BlockLayout:
    """``block -> ClientData``: a client's block as
    :meth:`FederatedPotential.client_program <numpyro_fed.FederatedPotential.client_program>`
    gives it (its rows, validity mask and index ``block["client"]``) in PVI's layout, with
    that client's shards, noise multiplier and clip norms. The ``transform`` of the clients'
    program: it runs where the client lives (on its worker in deployment, so the driver
    never builds a block). Picklable; it holds per-client settings (shard positions, noise
    multipliers, clip norms: numbers derived from row counts), never rows.

    :param str plate: the federated data plate.
    :param shard_index: ``(M, K, R_k)`` (see :func:`shard_layout`).
    :param shard_valid: ``(M, K, R_k)``.
    :param noise_multiplier: ``(M,)``.
    :param clip_first: ``(M,)`` or ``None`` (see :class:`ClientData`).
    :param clip_later: ``(M,)`` or ``None``.

    >>> import numpy as np
    >>> layout = BlockLayout("data", np.zeros((2, 1, 3), np.int32), np.ones((2, 1, 3), bool),
    ...                      np.array([0.5, 1.0]))
    >>> block = {"client": 1, "rows": [np.arange(3.0)], "valid": {"data": np.array([True, True, False])}}
    >>> data = layout(block)  # client 1's block, with client 1's settings
    >>> float(data.noise_multiplier), data.valid.tolist(), data.clip_first
    (1.0, [True, True, False], None)
    """

    def __init__(self, plate, shard_index, shard_valid, noise_multiplier, clip_first=None, clip_later=None):
        self.plate = plate
        as_numpy = lambda a: None if a is None else np.asarray(a)  # noqa: E731
        self.shard_index, self.shard_valid = as_numpy(shard_index), as_numpy(shard_valid)
        self.noise_multiplier = as_numpy(noise_multiplier)
        self.clip_first, self.clip_later = as_numpy(clip_first), as_numpy(clip_later)

    def __call__(self, block) -> "ClientData":
        m = int(block["client"])
        pick = lambda a: None if a is None else a[m]  # noqa: E731
        return ClientData(
            rows=list(block["rows"]),
            valid=block["valid"][self.plate],
            shard_index=pick(self.shard_index),
            shard_valid=pick(self.shard_valid),
            noise_multiplier=pick(self.noise_multiplier),
            clip_first=pick(self.clip_first),
            clip_later=pick(self.clip_later),
        )

    def __repr__(self):
        return f"BlockLayout(plate={self.plate!r}, num_clients={len(self.noise_multiplier)})"


def shard_layout(client_sizes, num_shards: int, seed=0):
    """Random shards of each client's valid rows (positions ``0 .. n_m - 1`` of its block).

    :return: ``(index, valid)``, each ``(M, K, R_k)``; padding repeats a row of the shard
        and is masked.
    """
    rng = np.random.default_rng(seed)
    client_sizes = [int(n) for n in client_sizes]
    if min(client_sizes) < num_shards:
        raise ValueError(f"num_shards={num_shards} exceeds the rows of the smallest client ({min(client_sizes)})")
    rows_per_shard = -(-max(client_sizes) // num_shards)
    index = np.zeros((len(client_sizes), num_shards, rows_per_shard), np.int32)
    valid = np.zeros_like(index, dtype=bool)
    for m, n in enumerate(client_sizes):
        for k, part in enumerate(np.array_split(rng.permutation(n), num_shards)):
            index[m, k] = np.resize(part, rows_per_shard)
            valid[m, k, : part.size] = True
    return jnp.asarray(index), jnp.asarray(valid)
