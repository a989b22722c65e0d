"""Deployment: the clients' rows stay where the clients live. What
:func:`~numpyro_fed.split_potential` needs from loaders instead of rows: zero-filled stand-ins
of the pooled arguments built from what the clients report (:func:`stand_in_arguments`), the
plates owned as the loaders returned their rows (:class:`Deployment`) and the picklable
loader that builds a client's block on its worker (:class:`DeployedBlockLoader`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import numpy as np

import jax

__all__ = ["DeployedBlockLoader", "TransformedLoader", "stand_in_arguments"]


def as_arguments(loaded, client):
    """A loader's output as the model's ``(args, kwargs)``."""
    if isinstance(loaded, Mapping):
        return (), dict(loaded)
    if isinstance(loaded, (tuple, list)):
        return tuple(loaded), {}
    raise TypeError(
        f"client {client}: the loader must return a tuple of positional model "
        f"arguments or a dict of keyword arguments, not {type(loaded).__name__}"
    )


def stand_in_arguments(descriptions, loader):
    """Zero-filled stand-ins of the pooled arguments, built from what the clients reported
    (shapes, dtypes, row counts, scalar settings), and the deployment's bookkeeping."""
    described = [as_arguments(d, m) for m, d in enumerate(descriptions)]
    is_leaf = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    flat = [jax.tree_util.tree_flatten(d, is_leaf=is_leaf) for d in described]
    treedef = flat[0][1]
    counts = []
    for m, (leaves, tdef) in enumerate(flat):
        if tdef != treedef:
            raise ValueError(f"client {m}'s loader returns arguments of structure {tdef}, client 0's {treedef}")
        rows = {leaf.shape[0] for leaf in leaves if is_leaf(leaf)}
        if len(rows) != 1:
            raise ValueError(
                f"client {m}'s array arguments have different numbers of rows {sorted(rows)}: in "
                "deployment every array argument holds the client's rows, rows first"
            )
        counts.append(rows.pop())
    stand_in = []
    for i, leaf in enumerate(flat[0][0]):
        others = [f[0][i] for f in flat]
        if is_leaf(leaf):
            for m, other in enumerate(others):
                if other.shape[1:] != leaf.shape[1:] or other.dtype != leaf.dtype:
                    raise ValueError(
                        f"model argument {i}: client {m} has rows of shape {other.shape[1:]} and dtype "
                        f"{other.dtype}, client 0 {leaf.shape[1:]} and {leaf.dtype}"
                    )
            stand_in.append(np.zeros((sum(counts),) + tuple(leaf.shape[1:]), leaf.dtype))
        else:
            for m, other in enumerate(others):
                if not np.array_equal(np.asarray(other), np.asarray(leaf)):
                    raise ValueError(
                        f"model argument {i} (a setting, not rows) differs between "
                        f"client 0 ({leaf!r}) and client {m} ({other!r})"
                    )
            stand_in.append(leaf)
    args, kwargs = jax.tree_util.tree_unflatten(treedef, stand_in)
    return args, kwargs, Deployment(loader, np.asarray(counts, dtype=np.int64))


class Deployment:
    """What split_potential needs to know in deployment mode: the loader and the row counts."""

    def __init__(self, loader, counts):
        self.loader = loader
        self.counts = counts

    def fix_plates(self, plates, latent_sites, enumerated):
        """The data plate's rows are owned as the loaders returned them: client m the m-th
        contiguous block of ``counts[m]`` rows of the stand-in."""
        data = [p for p in plates.values() if p.holds_data]
        local = sorted(name for name, site in latent_sites.items() if site.plate is not None)
        if len(plates) != 1 or len(data) != 1 or local or enumerated:
            raise ValueError(
                "split_potential(loader=...) (deployment) supports models with global latent "
                "variables and one federated data plate; this model has federated plates "
                f"{sorted(plates)}"
                + (f", client-local latent sites {local}" if local else "")
                + (", enumerated discrete latents" if enumerated else "")
                + ". Use model_args (simulation) for it."
            )
        plate = data[0]
        declared = int(plate.owner.max()) + 1
        if declared != len(self.counts):
            raise ValueError(
                f"federated plate '{plate.name}' declares {declared} clients, but there are "
                f"{len(self.counts)} loaders (num_clients)"
            )
        if (self.counts == 0).any():
            raise ValueError(f"client(s) {np.flatnonzero(self.counts == 0).tolist()} loaded no rows")
        owner = np.repeat(np.arange(len(self.counts)), self.counts)
        return {plate.name: replace(plate, owner=owner, max_rows=int(self.counts.max()))}

    def block_loader(self, treedef, row_leaves, stand_in_data):
        plate = next(iter(stand_in_data["index"]))
        return DeployedBlockLoader(
            self.loader,
            treedef,
            tuple(row_leaves),
            self.counts,
            plate,
            index_dtype=np.dtype(stand_in_data["index"][plate].dtype).str,
            client_dtype=np.dtype(stand_in_data["client"].dtype).str,
        )


class TransformedLoader:
    """``m -> transform(loader(m))``: an algorithm's layout of a block, built on the worker."""

    def __init__(self, loader, transform):
        self.loader = loader
        self.transform = transform

    def __call__(self, m):
        return self.transform(self.loader(m))


class DeployedBlockLoader:
    """Runs on client ``m``'s worker: ``loader(m)``, checked against what the client reported,
    cut into the block layout of :attr:`FederatedPotential.client_data` (rows padded to the
    largest client's count by repeating the client's own rows, and masked). Picklable; it
    holds the user's loader, the layout and the row counts, never rows."""

    def __init__(self, loader, treedef, row_leaves, counts, plate, *, index_dtype, client_dtype):
        self.loader = loader
        self.treedef = treedef
        self.row_leaves = tuple(row_leaves)
        self.counts = np.asarray(counts)
        self.plate = plate
        self.index_dtype = index_dtype
        self.client_dtype = client_dtype

    def __call__(self, m):
        m = int(m)
        args = as_arguments(self.loader(m), m)
        leaves, treedef = jax.tree_util.tree_flatten(args)
        if treedef != self.treedef:
            raise ValueError(f"client {m}: the loader's arguments have structure {treedef}, expected {self.treedef}")
        n = int(self.counts[m])
        for i in self.row_leaves:
            if np.shape(leaves[i])[0] != n:
                raise ValueError(
                    f"client {m}: model argument {i} has {np.shape(leaves[i])[0]} rows; the client reported {n}"
                )
        max_rows = int(self.counts.max())
        own = np.resize(np.arange(n), max_rows)
        offset = int(self.counts[:m].sum())
        return {
            "client": np.asarray(m, dtype=self.client_dtype),
            "rows": [np.asarray(leaves[i])[own] for i in self.row_leaves],
            "index": {self.plate: (offset + own).astype(self.index_dtype)},
            "valid": {self.plate: np.arange(max_rows) < n},
        }

    def __repr__(self):
        return f"DeployedBlockLoader(num_clients={len(self.counts)}, rows={self.counts.tolist()})"
