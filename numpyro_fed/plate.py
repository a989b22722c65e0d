"""``federated_plate``: a :class:`numpyro.plate` that also says which client owns each row.

Under every NumPyro handler (NUTS, :class:`~numpyro.infer.Predictive`, ``az.from_numpyro``)
a ``federated_plate`` is exactly ``numpyro.plate(name, size, dim=dim)``. The only extra
effect is an annotation on the sites inside it (``site["infer"]["federated_plates"]``),
which :func:`~numpyro_fed.split_potential` reads to split the model's potential by client.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

import numpyro
from numpyro.primitives import Messenger

__all__ = ["federated_plate", "normalize_clients"]

# The key under which sites record the federated plates that enclose them.
FEDERATED_KEY = "federated_plates"

# Plate sizes forced while :mod:`numpyro_fed.potential` traces a client's or the server's
# view of the model (there the data holds a client's padded rows, not all rows).
_SIZE_OVERRIDES: list[dict[str, int]] = []


@contextmanager
def override_plate_sizes(sizes: dict[str, int]):
    """Within this context, the plates named in ``sizes`` (federated or not) have those sizes:
    how :mod:`numpyro_fed.potential` traces one client's (its padded rows) or the server's view
    (one placeholder row) of a model written for all rows."""
    _SIZE_OVERRIDES.append(sizes)
    try:
        yield
    finally:
        _SIZE_OVERRIDES.pop()


def _overridden_size(name: str, size: int) -> int:
    for sizes in reversed(_SIZE_OVERRIDES):
        if name in sizes:
            return sizes[name]
    return size


class _federation(Messenger):
    """Annotates every sample site inside a federated plate with the plate's client spec, and
    checks, before the plate broadcasts the site, that the site's rows along the plate are as
    many as the plate has: a plate size that does not match the data is a ``ValueError`` naming
    both sizes, not a broadcasting error from deep inside JAX."""

    def __init__(self, name: str, clients: Any, dim: int, rows: int):
        self.name = name
        self.clients = clients
        self.dim = dim
        self.rows = rows
        super().__init__()

    def process_message(self, msg):
        if msg["type"] != "sample":
            return
        self._check_rows(msg)
        # Copy: a user may share one ``infer`` dict between several sites.
        infer = dict(msg.get("infer") or {})
        plates = dict(infer.get(FEDERATED_KEY, {}))
        plates[self.name] = self.clients
        infer[FEDERATED_KEY] = plates
        msg["infer"] = infer

    def _check_rows(self, msg):
        """Rows of the site's distribution and of its observed value along the plate's
        dimension: each must be 1 (broadcast) or the plate's size, as NumPyro's plate demands."""
        fn = msg["fn"]
        batch_shape = tuple((msg.get("kwargs") or {}).get("sample_shape", ())) + tuple(getattr(fn, "batch_shape", ()))
        found = []
        if len(batch_shape) >= -self.dim:
            found.append(("site", f" (its distribution's batch shape is {batch_shape})", batch_shape[self.dim]))
        if msg["is_observed"] and msg["value"] is not None:
            value_shape = np.shape(msg["value"])
            axis = self.dim - len(getattr(fn, "event_shape", ()))
            if len(value_shape) >= -axis:
                found.append(("observed site", "", value_shape[axis]))
        for what, detail, rows in found:
            if rows not in (1, self.rows):
                raise ValueError(
                    f"{what} '{msg['name']}' has {rows} rows along federated plate '{self.name}'{detail}, "
                    f"but the plate has size {self.rows}: give the plate the number of data rows, "
                    "e.g. `federated_plate(name, X.shape[0], ...)`"
                )


class federated_plate:
    """A :class:`numpyro.plate` whose rows are owned by clients.

    Use it where you would use ``numpyro.plate`` over the axis of the data that is split
    across clients. To every other handler it *is* that plate: the same model runs under
    NUTS, :class:`~numpyro.infer.Predictive` and ArviZ unchanged.

    A ``federated_plate`` whose size is the number of clients (one row per client) holds
    client-local latent variables, e.g. per-client random effects.

    Model arguments indexed by rows (covariates, responses, group indices) must be passed
    to the model as arguments with the rows on their leading axis, so that
    :func:`~numpyro_fed.split_potential` can hand each client only its own rows.

    What a user forgets is refused before any work, with a ``ValueError``: a site whose rows
    along the plate are neither 1 nor ``size`` (the plate's size does not match the data),
    and, in :func:`~numpyro_fed.split_potential`, a latent site inside a federated plate that
    looks like an observation given ``obs=None`` (nothing in the model depends on it, or it
    has the name of a model argument that is ``None``: "did you forget to pass ``y``?"). A
    site of that kind that is meant to be sampled says so with
    ``infer={"federated_latent": True}``.

    :param str name: plate name, as for ``numpyro.plate``.
    :param int size: number of rows.
    :param clients: who owns which row, one of

        * an ``int`` ``M``: rows split evenly and contiguously over ``M`` clients;
        * an integer array of shape ``(size,)``: the client (``0..M-1``) of each row;
        * a list of ``M`` disjoint integer index arrays that together cover all rows.

        Clients may own unequal and non-contiguous sets of rows.
    :param int dim: optional plate dimension, as for ``numpyro.plate``.
    :param int subsample_size: accepted so that the model still runs as a subsampled
        plate under plain NumPyro; :func:`~numpyro_fed.split_potential` rejects it since
        the federated algorithms need every row.

    **Example**

    .. doctest::

        >>> import jax.numpy as jnp, numpyro, numpyro.distributions as dist
        >>> import numpyro_fed as nf
        >>> def model(X, y=None):
        ...     w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
        ...     with nf.federated_plate("data", X.shape[0], clients=3):
        ...         numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)
        >>> X, y = jnp.ones((9, 2)), jnp.ones(9)
        >>> fp = nf.split_potential(model, (X, y))
        >>> fp.num_clients, fp.client_sizes.tolist()
        (3, [3, 3, 3])
    """

    def __init__(
        self,
        name: str,
        size: int,
        *,
        clients: Any,
        dim: int | None = None,
        subsample_size: int | None = None,
    ):
        if clients is None:
            raise TypeError(
                f"federated_plate '{name}': `clients` is required (an int M, a (size,) "
                "array of client ids, or a list of M index arrays)"
            )
        self.name = name
        self.size = _overridden_size(name, size)
        self.clients = clients
        self.dim = dim
        if self.size != size:
            subsample_size = None
        self._plate = numpyro.plate(name, self.size, subsample_size=subsample_size, dim=dim)
        self._federation = _federation(name, clients, self._plate.dim, self._plate.subsample_size)

    def __enter__(self):
        indices = self._plate.__enter__()
        self._federation.__enter__()
        return indices

    def __exit__(self, exc_type, exc_value, traceback):
        self._federation.__exit__(exc_type, exc_value, traceback)
        return self._plate.__exit__(exc_type, exc_value, traceback)

    def __repr__(self) -> str:
        return f"federated_plate({self.name!r}, {self.size}, dim={self.dim})"


def normalize_clients(clients: Any, size: int, *, name: str = "plate") -> tuple[np.ndarray, int]:
    """Turns any accepted form of ``clients`` into an owner array.

    :param clients: an ``int`` ``M``, a ``(size,)`` integer array of client ids, or a list
        of ``M`` disjoint index arrays covering ``range(size)``.
    :param int size: the number of rows of the plate.
    :param str name: the plate's name, used in error messages.
    :return: ``(owner, num_clients)`` where ``owner`` is an ``int64`` array of shape
        ``(size,)`` with values in ``0..num_clients-1``, every client owning at least one row.
    :raises ValueError, TypeError: naming the plate and what is wrong.

    >>> owner, M = normalize_clients([[0, 3], [1, 2]], 4, name="data")
    >>> owner.tolist(), M
    ([0, 1, 1, 0], 2)
    """
    where = f"federated plate '{name}'"
    if isinstance(clients, bool):
        raise TypeError(
            f"{where}: `clients` must be an int, an array of client ids or a list of index arrays, not a bool"
        )
    if isinstance(clients, (int, np.integer)):
        num_clients = int(clients)
        if num_clients < 1:
            raise ValueError(f"{where}: the number of clients must be at least 1, got {num_clients}")
        if num_clients > size:
            raise ValueError(f"{where}: cannot split {size} rows over {num_clients} clients (each client needs a row)")
        owner = np.empty(size, dtype=np.int64)
        for m, rows in enumerate(np.array_split(np.arange(size), num_clients)):
            owner[rows] = m
        return owner, num_clients

    if (
        isinstance(clients, Sequence)
        and not isinstance(clients, (str, bytes))
        and any(np.ndim(c) == 1 for c in clients)
    ):
        return _owner_from_index_lists(clients, size, where)

    owner = _concrete_integer_array(clients, where, "`clients`")
    if owner.ndim != 1:
        raise ValueError(
            f"{where}: `clients` as an array must have shape ({size},) (one client id per row), got shape {owner.shape}"
        )
    if owner.shape[0] != size:
        raise ValueError(f"{where}: `clients` has {owner.shape[0]} entries but the plate has {size} rows")
    if size and owner.min() < 0:
        bad = int(np.flatnonzero(owner < 0)[0])
        raise ValueError(f"{where}: client ids must be >= 0; row {bad} has client {owner[bad]}")
    num_clients = int(owner.max()) + 1 if size else 0
    present = np.bincount(owner, minlength=num_clients) > 0
    if not present.all():
        missing = np.flatnonzero(~present).tolist()
        raise ValueError(
            f"{where}: client ids must be 0..{num_clients - 1} with every client owning a row; "
            f"clients {missing} own no rows"
        )
    return owner.astype(np.int64), num_clients


def _concrete_integer_array(value: Any, where: str, what: str) -> np.ndarray:
    try:
        array = np.asarray(value)
    except Exception as exc:  # a jax tracer raises here
        raise TypeError(
            f"{where}: {what} must be concrete integers known before inference (got {type(value).__name__})"
        ) from exc
    if array.dtype == object or not (np.issubdtype(array.dtype, np.integer) or array.size == 0):
        raise TypeError(f"{where}: {what} must hold integers, got dtype {array.dtype}")
    return array.astype(np.int64)


def _owner_from_index_lists(clients: Sequence, size: int, where: str) -> tuple[np.ndarray, int]:
    owner = np.full(size, -1, dtype=np.int64)
    for m, rows in enumerate(clients):
        rows = _concrete_integer_array(rows, where, f"the index array of client {m}")
        if rows.ndim != 1:
            raise ValueError(f"{where}: the index array of client {m} must be 1-D, got shape {rows.shape}")
        if rows.size == 0:
            raise ValueError(f"{where}: client {m} owns no rows (empty index array)")
        out_of_range = rows[(rows < 0) | (rows >= size)]
        if out_of_range.size:
            raise ValueError(f"{where}: client {m} lists row {int(out_of_range[0])}, outside 0..{size - 1}")
        unique_rows, counts = np.unique(rows, return_counts=True)
        if (counts > 1).any():
            raise ValueError(f"{where}: client {m} lists row {int(unique_rows[counts > 1][0])} more than once")
        taken = owner[rows] >= 0
        if taken.any():
            row = int(rows[taken][0])
            raise ValueError(
                f"{where}: clients overlap: row {row} is listed by client {int(owner[row])} and client {m}"
            )
        owner[rows] = m
    missing = np.flatnonzero(owner < 0)
    if missing.size:
        shown = missing[:5].tolist()
        raise ValueError(
            f"{where}: the clients' index arrays miss {missing.size} row(s), e.g. {shown}: "
            "every row must belong to a client"
        )
    return owner, len(clients)
