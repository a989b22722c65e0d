"""Deployment: the clients' rows stay where the clients live. What
:func:`~numpyro_fed.split_potential` needs from loaders instead of rows: zero-filled stand-ins
of the pooled arguments built from what the clients report (:func:`stand_in_arguments`), the
plates owned as the loaders returned their rows and declared their groups
(:class:`Deployment`), the declaration itself (:class:`GroupIndex`) and the picklable loader
that builds a client's block on its worker (:class:`DeployedBlockLoader`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import numpy as np

import jax

__all__ = ["DeployedBlockLoader", "GroupIndex", "TransformedLoader", "stand_in_arguments"]


class GroupIndex:
    """A model argument that says, for each of a client's rows, which of the client's own
    groups it belongs to, in the client's own numbering ``0..num_groups-1``: what a
    deployment loader returns in place of a group index (radon's county of each house,
    the school of each school's estimate) so that the model's client-local latent
    variables (``a`` in ``federated_plate("counties", 85, ...)``) can be laid out without
    the server seeing a row.

    The server learns ``num_groups`` of each client (never the indices), gives client ``m``
    the next ``num_groups`` rows of the group plate (clients in order: client 0 the first
    ones) and, on the client's worker, the block is built with the indices shifted into that
    range; the model receives plain integer arrays, as in simulation. The group plate's size
    in the model must be the clients' ``num_groups`` summed.

    :param str plate: the name of the federated plate of groups (the one holding the
        client-local latent variables).
    :param index: ``(rows,)`` integer array (rows first, as every row argument): each row's
        group, ``0 <= index < num_groups``.
    :param int num_groups: the groups this client owns (at least 1; groups without rows
        count too).

    **Example**

    .. doctest::

        >>> import numpy as np, numpyro, numpyro.distributions as dist
        >>> import numpyro_fed as nf
        >>> def model(group, y):
        ...     mu = numpyro.sample("mu", dist.Normal(0, 5))
        ...     with nf.federated_plate("groups", 3, clients=2):
        ...         a = numpyro.sample("a", dist.Normal(mu, 1))
        ...     with nf.federated_plate("data", y.shape[0], clients=2):
        ...         numpyro.sample("y", dist.Normal(a[group], 1), obs=y)
        >>> def load(m):  # runs where client m lives: client 0 has 2 groups, client 1 one
        ...     group = [np.array([0, 1, 1]), np.array([0, 0])][m]
        ...     y = [np.array([0.5, 1.0, 1.5]), np.array([2.0, 2.5])][m]
        ...     return nf.GroupIndex("groups", group, num_groups=2 - m), y
        >>> fp = nf.split_potential(model, loader=load, num_clients=2)
        >>> fp.plates["groups"].owner.tolist()  # client 1's group is row 2 of the plate
        [0, 0, 1]
    """

    def __init__(self, plate: str, index, num_groups: int):
        if not isinstance(plate, str):
            raise TypeError(f"GroupIndex: plate must be the name of a federated plate (a str), not {plate!r}")
        if isinstance(num_groups, bool) or not isinstance(num_groups, (int, np.integer)) or num_groups < 1:
            raise ValueError(f"GroupIndex('{plate}'): num_groups must be an int >= 1, not {num_groups!r}")
        array = np.asarray(index)
        if not np.issubdtype(array.dtype, np.integer) or array.ndim < 1:
            raise ValueError(
                f"GroupIndex('{plate}'): index must be an integer array with the rows on its leading axis, "
                f"got dtype {array.dtype} and shape {array.shape}"
            )
        outside = (array < 0) | (array >= num_groups)
        if outside.any():
            raise ValueError(
                f"GroupIndex('{plate}'): index holds {int(array[outside].ravel()[0])}, outside this client's "
                f"groups 0..{int(num_groups) - 1} (num_groups={int(num_groups)}): number the client's own groups "
                "from 0"
            )
        self.plate, self.index, self.num_groups = plate, index, int(num_groups)

    def __repr__(self):
        return f"GroupIndex({self.plate!r}, shape={np.shape(self.index)}, num_groups={self.num_groups})"


def _flatten_group_index(g):
    return (g.index,), (g.plate, g.num_groups)


def _unflatten_group_index(aux, children):
    g = object.__new__(GroupIndex)  # the children may be shapes or placeholders: no checks
    g.plate, g.num_groups = aux
    (g.index,) = children
    return g


jax.tree_util.register_pytree_node(GroupIndex, _flatten_group_index, _unflatten_group_index)


def _is_group_index(x) -> bool:
    return isinstance(x, GroupIndex)


def split_group_indices(arguments, is_leaf=None):
    """``(plain, groups)``: ``arguments`` with every :class:`GroupIndex` replaced by its index,
    and ``{leaf position: (plate, num_groups)}`` of those leaves (a ``GroupIndex`` holds one
    leaf, so the positions are those of ``plain``'s leaves)."""
    leaf = lambda x: _is_group_index(x) or (is_leaf is not None and is_leaf(x))  # noqa: E731
    leaves, treedef = jax.tree_util.tree_flatten(arguments, is_leaf=leaf)
    groups = {i: (x.plate, x.num_groups) for i, x in enumerate(leaves) if _is_group_index(x)}
    plain = [x.index if _is_group_index(x) else x for x in leaves]
    return jax.tree_util.tree_unflatten(treedef, plain), groups


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


def _group_counts(declared):
    """``(group_leaves, group_counts)`` from every client's ``{position: (plate, num_groups)}``:
    ``{position: plate}`` (the same for every client) and ``{plate: (M,) counts}``."""
    group_leaves = {i: plate for i, (plate, _) in declared[0].items()}
    counts = {plate: np.zeros(len(declared), np.int64) for plate in group_leaves.values()}
    for m, groups in enumerate(declared):
        mine = {i: plate for i, (plate, _) in groups.items()}
        if mine != group_leaves:
            raise ValueError(
                f"client {m}'s loader declares group indices {_positions(mine)}, client 0's "
                f"{_positions(group_leaves)}: every client returns a GroupIndex for the same arguments"
            )
        for plate in counts:
            sizes = {n for p, n in groups.values() if p == plate}
            if len(sizes) > 1:
                raise ValueError(
                    f"client {m}'s loader declares different numbers of groups {sorted(sizes)} for plate '{plate}'"
                )
            counts[plate][m] = sizes.pop()
    return group_leaves, counts


def _positions(group_leaves):
    return {f"argument leaf {i}": plate for i, plate in sorted(group_leaves.items())}


def stand_in_arguments(descriptions, loader):
    """Zero-filled stand-ins of the pooled arguments, built from what the clients reported
    (shapes, dtypes, row counts, scalar settings, numbers of groups), and the deployment's
    bookkeeping. A group index's stand-in puts each client's rows in its first group (so a
    model that also passes it as a plate's ``clients=``, one group per client, sees the
    clients as they are)."""
    is_leaf = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    declared = []
    described = []
    for m, d in enumerate(descriptions):
        plain, groups = split_group_indices(as_arguments(d, m), is_leaf=is_leaf)
        described.append(plain)
        declared.append(groups)
    group_leaves, group_counts = _group_counts(declared)
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
            if i in group_leaves:  # each row in its client's first group: a valid index, and it owns the row
                first = np.cumsum(group_counts[group_leaves[i]]) - group_counts[group_leaves[i]]
                rows_first = np.repeat(first, counts).reshape((-1,) + (1,) * (len(leaf.shape) - 1))
                stand_in.append(np.broadcast_to(rows_first, (sum(counts),) + tuple(leaf.shape[1:])).astype(leaf.dtype))
            else:
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
    deployment = Deployment(loader, np.asarray(counts, dtype=np.int64), group_leaves, group_counts)
    return args, kwargs, deployment


class Deployment:
    """What split_potential needs to know in deployment mode: the loader, the row counts and,
    per group plate, the clients' numbers of groups and the arguments that index them."""

    def __init__(self, loader, counts, group_leaves=None, group_counts=None):
        self.loader = loader
        self.counts = counts
        self.group_leaves = dict(group_leaves or {})  # leaf position -> group plate
        self.group_counts = dict(group_counts or {})  # group plate -> (M,) numbers of groups

    def fix_plates(self, plates, latent_sites, enumerated):
        """The data plate's rows are owned as the loaders returned them: client m the m-th
        contiguous block of ``counts[m]`` rows of the stand-in; the rows of a group plate
        likewise, as the loaders declared their groups (:class:`GroupIndex`)."""
        data = [p for p in plates.values() if p.holds_data]
        row_local = sorted(n for n, s in latent_sites.items() if s.plate is not None and plates[s.plate].holds_data)
        if len(data) != 1 or row_local or enumerated:
            raise ValueError(
                "split_potential(loader=...) (deployment) supports models with global latent "
                "variables and one federated data plate, and client-local latents in federated plates "
                "of groups (declared by the loaders with nf.GroupIndex); "
                f"this model has federated data plates {sorted(p.name for p in data)}"
                + (f", latent sites with one value per data row {row_local}" if row_local else "")
                + (", enumerated discrete latents" if enumerated else "")
                + ". Use model_args (simulation) for it."
            )
        unknown = sorted(set(self.group_counts) - {p.name for p in plates.values() if not p.holds_data})
        if unknown:
            raise ValueError(
                f"the loaders return a GroupIndex for plate(s) {unknown}, but the model's federated "
                f"plates of client-local latents are {sorted(p.name for p in plates.values() if not p.holds_data)}"
            )
        fixed = {}
        for plate in plates.values():
            declared = int(plate.owner.max()) + 1
            if declared != len(self.counts):
                raise ValueError(
                    f"federated plate '{plate.name}' declares {declared} clients, but there are "
                    f"{len(self.counts)} loaders (num_clients)"
                )
            if plate.holds_data:
                counts = self.counts
                if (counts == 0).any():
                    raise ValueError(f"client(s) {np.flatnonzero(counts == 0).tolist()} loaded no rows")
                fixed[plate.name] = replace(
                    plate, owner=np.repeat(np.arange(len(counts)), counts), max_rows=int(counts.max())
                )
            else:
                fixed[plate.name] = self._group_plate(plate, latent_sites)
        return fixed

    def _group_plate(self, plate, latent_sites):
        """A group plate owned as the loaders declared: client m the next ``num_groups`` rows."""
        if plate.name not in self.group_counts:
            sites = sorted(n for n, s in latent_sites.items() if s.plate == plate.name)
            raise ValueError(
                f"federated plate '{plate.name}' holds client-local latent site(s) {sites}: in "
                "deployment the server learns which of its rows are whose from the loaders. Each "
                f"loader returns nf.GroupIndex('{plate.name}', index, num_groups) in place of the "
                "argument that indexes the plate (each row's group in the client's own numbering "
                "0..num_groups-1)"
            )
        counts = self.group_counts[plate.name]
        if int(counts.sum()) != plate.size:
            raise ValueError(
                f"federated plate '{plate.name}' has size {plate.size} in the model, but the loaders "
                f"declare {int(counts.sum())} groups in all ({' + '.join(map(str, counts.tolist()))} "
                "by client): the plate's size must be the clients' num_groups summed"
            )
        return replace(plate, owner=np.repeat(np.arange(len(counts)), counts))

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
            group_leaves=self.group_leaves,
            group_counts=self.group_counts,
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
    largest client's count by repeating the client's own rows, and masked), each
    :class:`GroupIndex` shifted into the client's range of its plate (as simulation's block
    holds the plate's own row numbers). Picklable; it holds the user's loader, the layout and
    the row and group counts, never rows."""

    def __init__(
        self,
        loader,
        treedef,
        row_leaves,
        counts,
        plate,
        *,
        index_dtype,
        client_dtype,
        group_leaves=None,
        group_counts=None,
    ):
        self.loader = loader
        self.treedef = treedef
        self.row_leaves = tuple(row_leaves)
        self.counts = np.asarray(counts)
        self.plate = plate
        self.index_dtype = index_dtype
        self.client_dtype = client_dtype
        self.group_leaves = dict(group_leaves or {})
        self.group_counts = {k: np.asarray(v) for k, v in (group_counts or {}).items()}

    def global_arguments(self, m, loaded):
        """The loader's arguments with every group index shifted into client ``m``'s range
        of its plate (client ``m``'s groups follow those of clients ``0..m-1``)."""
        leaves, treedef = jax.tree_util.tree_flatten(as_arguments(loaded, m), is_leaf=_is_group_index)
        found = {i: leaf for i, leaf in enumerate(leaves) if _is_group_index(leaf)}
        if {i: g.plate for i, g in found.items()} != self.group_leaves:
            raise ValueError(
                f"client {m}: the loader declares group indices {_positions({i: g.plate for i, g in found.items()})}; "
                f"at set-up it declared {_positions(self.group_leaves)}"
            )
        for i, g in found.items():
            reported = int(self.group_counts[g.plate][m])
            if g.num_groups != reported:
                raise ValueError(
                    f"client {m}: the loader declares {g.num_groups} groups of plate '{g.plate}'; at set-up "
                    f"it reported {reported}"
                )
            offset = int(self.group_counts[g.plate][:m].sum())
            leaves[i] = np.asarray(g.index) + np.asarray(offset, np.asarray(g.index).dtype)
        return jax.tree_util.tree_unflatten(treedef, leaves)

    def __call__(self, m):
        m = int(m)
        args = self.global_arguments(m, self.loader(m))
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
        groups = {k: v.tolist() for k, v in self.group_counts.items()}
        return (
            f"DeployedBlockLoader(num_clients={len(self.counts)}, rows={self.counts.tolist()}"
            + (f", groups={groups}" if groups else "")
            + ")"
        )
