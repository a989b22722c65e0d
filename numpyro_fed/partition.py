"""Client splits for federated experiments.

Every split helper returns an *owner array*: a numpy integer array of shape
``(n,)`` whose entry ``i`` is the id (``0 .. M-1``) of the client that owns
row ``i``. This is the ``clients=`` format accepted by
:func:`numpyro_fed.federated_plate`. Every helper guarantees that every
client owns at least one row and raises :class:`ValueError` otherwise.

>>> from numpyro_fed import partition
>>> owner = partition.even(10, 3)
>>> owner.tolist()
[0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
>>> partition.client_sizes(owner).tolist()
[4, 3, 3]
"""

from __future__ import annotations

import math

import numpy as np

from numpyro_fed._checks import check_int as _check_int
from numpyro_fed._checks import check_real as _check_real

__all__ = [
    "DPPVI_SPLITS",
    "by_label",
    "client_indices",
    "client_sizes",
    "dirichlet",
    "even",
]

#: ``(rho, kappa)`` of the three Adult splits of the DP-PVI paper
#: (Heikkilä et al. 2023, Appendix B, Table 2), for use with :func:`by_label`.
DPPVI_SPLITS: dict[str, tuple[float, float]] = {
    "balanced": (0.0, 0.0),
    "unbalanced1": (0.75, 0.95),
    "unbalanced2": (0.7, -3.0),
}

# Relative slack when flooring n/M*(1 -/+ rho): with rho given as a decimal
# (0.7, 0.75) the float product can land just below an integer the paper's
# exact arithmetic reaches (e.g. 732.9999999 instead of 733).
_FLOOR_SLACK = 1e-9


# --------------------------------------------------------------------------
# argument checks


def _check_labels(labels) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D (one label per row), got shape {labels.shape}")
    if labels.size == 0:
        raise ValueError("labels must not be empty")
    if labels.dtype.kind == "f" and not np.all(np.isfinite(labels)):
        raise ValueError("labels must not contain NaN or infinite values")
    return labels


def _check_enough_rows(n: int, num_clients: int) -> None:
    if num_clients > n:
        raise ValueError(
            f"num_clients={num_clients} exceeds the number of rows n={n}: every client must own at least one row"
        )


def _check_owner(owner) -> np.ndarray:
    owner = np.asarray(owner)
    if owner.ndim != 1:
        raise ValueError(f"owner must be a 1-D array of client ids, got shape {owner.shape}")
    if owner.dtype.kind not in "iu":
        raise TypeError(f"owner must hold integer client ids, got dtype {owner.dtype}")
    if owner.size and owner.min() < 0:
        raise ValueError(f"owner must hold client ids >= 0, found {int(owner.min())}")
    return owner


def _num_clients_of(owner: np.ndarray, num_clients: int | None) -> int:
    inferred = int(owner.max()) + 1 if owner.size else 0
    if num_clients is None:
        return inferred
    num_clients = _check_int(num_clients, "num_clients", minimum=1)
    if inferred > num_clients:
        raise ValueError(
            f"owner holds client id {inferred - 1}, outside 0..{num_clients - 1} for num_clients={num_clients}"
        )
    return num_clients


# --------------------------------------------------------------------------
# split helpers


def even(n: int, num_clients: int, *, shuffle: bool = False, seed=None) -> np.ndarray:
    """Split ``n`` rows into ``num_clients`` contiguous, near-equal blocks.

    Block sizes are those of :func:`numpy.array_split`: the first
    ``n % num_clients`` clients get one extra row.

    :param n: number of rows.
    :param num_clients: number of clients ``M`` (``1 <= M <= n``).
    :param shuffle: if true, the blocks are laid over a random permutation of
        the rows, so each client owns a random subset of the same size.
    :param seed: seed (or :class:`numpy.random.Generator`) for the permutation.
    :returns: owner array of shape ``(n,)``.
    :raises ValueError: if ``num_clients > n`` (some client would be empty).

    >>> even(7, 3).tolist()
    [0, 0, 0, 1, 1, 2, 2]
    >>> sorted(even(7, 3, shuffle=True, seed=0).tolist())
    [0, 0, 0, 1, 1, 2, 2]
    """
    n = _check_int(n, "n", minimum=1)
    num_clients = _check_int(num_clients, "num_clients", minimum=1)
    _check_enough_rows(n, num_clients)
    sizes = [len(block) for block in np.array_split(np.arange(n), num_clients)]
    owner = np.repeat(np.arange(num_clients), sizes)
    if shuffle:
        owner = np.random.default_rng(seed).permutation(owner)
    return owner


def by_label(labels, num_clients: int, *, rho: float, kappa: float, seed=None) -> np.ndarray:
    """Unbalanced split of the DP-PVI paper (Heikkilä et al. 2023, Appendix B).

    Half of the clients are *small* and half *large*, with

    .. math::

        n_{small} = \\lfloor \\tfrac{n}{M}(1-\\rho) \\rfloor, \\qquad
        n_{large} = \\lfloor \\tfrac{n}{M}(1+\\rho) \\rfloor .

    With :math:`\\lambda` the fraction of majority-class rows, every small
    client gets a fraction
    :math:`\\lambda_{small} = \\lambda + (1-\\lambda)\\kappa` of majority-class
    rows (clipped to ``[0, 1]``; ``kappa = 1`` gives only majority rows,
    ``kappa = -lambda/(1-lambda)`` only minority rows), drawn at random; the
    rest of each small client is drawn at random from the other classes.
    The large clients get the remaining rows at random, ``n_large`` each; the
    rows left over by the floors go to the large clients round-robin, so every
    row is owned.

    Clients ``0 .. M//2 - 1`` are the small ones and ``M//2 .. M-1`` the large
    ones. ``M`` must be even when ``rho > 0`` (with odd ``M`` the sizes above
    would need more rows than exist); with ``rho = 0`` all sizes agree and an
    odd ``M`` is allowed (``M//2`` clients then follow ``lambda_small``).
    Labels may have more than two classes: the majority class is the most
    frequent one (the smallest label on a tie) and "minority" means all others.

    :param labels: 1-D array of class labels, one per row.
    :param num_clients: number of clients ``M``.
    :param rho: size imbalance in ``[0, 1)``; see :data:`DPPVI_SPLITS`.
    :param kappa: label skew of the small clients; any real value, but the
        small clients' demand for majority or minority rows must not exceed
        what the labels hold.
    :param seed: seed (or :class:`numpy.random.Generator`).
    :returns: owner array of shape ``(n,)``.
    :raises ValueError: on a bad ``rho``, ``kappa``, ``labels`` or
        ``num_clients``, or if a client would own no rows.

    >>> import numpy as np
    >>> labels = np.r_[np.zeros(76), np.ones(24)]
    >>> owner = by_label(labels, 4, rho=0.5, kappa=1.0, seed=0)
    >>> client_sizes(owner).tolist()
    [12, 12, 38, 38]
    >>> float(labels[owner == 0].mean())  # small client: majority class only
    0.0
    """
    labels = _check_labels(labels)
    num_clients = _check_int(num_clients, "num_clients", minimum=1)
    rho = _check_real(rho, "rho")
    kappa = _check_real(kappa, "kappa")
    if not 0.0 <= rho <= 1.0:
        raise ValueError(f"rho must lie in [0, 1], got {rho}")
    n = labels.size
    _check_enough_rows(n, num_clients)
    if num_clients % 2 == 1 and rho > 0.0:
        raise ValueError(
            f"num_clients must be even when rho > 0 (half small, half large clients), "
            f"got num_clients={num_clients} with rho={rho}"
        )

    num_small_clients = num_clients // 2
    num_large_clients = num_clients - num_small_clients
    rows_per_client = n / num_clients
    n_small = math.floor(rows_per_client * (1.0 - rho) * (1.0 + _FLOOR_SLACK))
    n_large = math.floor(rows_per_client * (1.0 + rho) * (1.0 + _FLOOR_SLACK))
    if num_small_clients and n_small < 1:
        raise ValueError(
            f"rho={rho} leaves the small clients with n_small = floor({n}/{num_clients}"
            f"*(1-rho)) = {n_small} rows: every client must own at least one row"
        )

    classes, counts = np.unique(labels, return_counts=True)
    majority_class = classes[np.argmax(counts)]
    is_majority = labels == majority_class
    majority_fraction = float(is_majority.mean())
    small_majority_fraction = min(max(majority_fraction + (1.0 - majority_fraction) * kappa, 0.0), 1.0)
    majority_per_small = round(small_majority_fraction * n_small)
    minority_per_small = n_small - majority_per_small

    majority_rows = np.flatnonzero(is_majority)
    minority_rows = np.flatnonzero(~is_majority)
    if num_small_clients * majority_per_small > majority_rows.size:
        raise ValueError(
            f"kappa={kappa} gives lambda_small={small_majority_fraction:.3f}: the "
            f"{num_small_clients} small clients need {num_small_clients * majority_per_small} "
            f"majority-class rows but labels hold only {majority_rows.size}"
        )
    if num_small_clients * minority_per_small > minority_rows.size:
        raise ValueError(
            f"kappa={kappa} gives lambda_small={small_majority_fraction:.3f}: the "
            f"{num_small_clients} small clients need {num_small_clients * minority_per_small} "
            f"minority-class rows but labels hold only {minority_rows.size}"
        )

    rng = np.random.default_rng(seed)
    majority_rows = rng.permutation(majority_rows)
    minority_rows = rng.permutation(minority_rows)
    owner = np.full(n, -1, dtype=np.int64)
    for client in range(num_small_clients):
        owner[majority_rows[client * majority_per_small : (client + 1) * majority_per_small]] = client
        owner[minority_rows[client * minority_per_small : (client + 1) * minority_per_small]] = client

    remaining_rows = rng.permutation(np.flatnonzero(owner < 0))
    # Evenly-sized large blocks first, then the floors' leftovers dealt out
    # one by one so that no row is dropped.
    blocks_end = num_large_clients * n_large
    large_ids = num_small_clients + np.arange(num_large_clients)
    owner[remaining_rows[:blocks_end]] = np.repeat(large_ids, n_large)
    leftover = remaining_rows[blocks_end:]
    owner[leftover] = large_ids[np.arange(leftover.size) % num_large_clients]
    return owner


def dirichlet(
    labels,
    num_clients: int,
    *,
    alpha: float,
    seed=None,
    min_size: int = 1,
    max_tries: int = 1000,
) -> np.ndarray:
    """Label-skewed non-iid split with Dirichlet class proportions.

    For every class, the proportions of its rows that go to each client are
    drawn from :math:`\\mathrm{Dirichlet}(\\alpha, \\dots, \\alpha)` over the
    ``M`` clients and the class's rows (in random order) are cut accordingly
    (the scheme popularised by Hsu et al. 2019). Small ``alpha`` gives strong
    skew, large ``alpha`` approaches an iid split. The whole draw is repeated
    until every client owns at least ``min_size`` rows.

    :param labels: 1-D array of class labels, one per row.
    :param num_clients: number of clients ``M``.
    :param alpha: Dirichlet concentration, ``> 0``.
    :param seed: seed (or :class:`numpy.random.Generator`).
    :param min_size: minimum number of rows per client, ``>= 1``.
    :param max_tries: how many draws to try before giving up.
    :returns: owner array of shape ``(n,)``.
    :raises ValueError: on bad arguments, or if no draw within ``max_tries``
        gives every client ``min_size`` rows (raise ``alpha`` or lower
        ``min_size``/``num_clients``).

    >>> import numpy as np
    >>> labels = np.repeat([0, 1, 2], 50)
    >>> owner = dirichlet(labels, 5, alpha=0.5, seed=0, min_size=5)
    >>> owner.shape, bool(client_sizes(owner).min() >= 5)
    ((150,), True)
    """
    labels = _check_labels(labels)
    num_clients = _check_int(num_clients, "num_clients", minimum=1)
    alpha = _check_real(alpha, "alpha")
    if alpha <= 0.0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    min_size = _check_int(min_size, "min_size", minimum=1)
    max_tries = _check_int(max_tries, "max_tries", minimum=1)
    n = labels.size
    _check_enough_rows(n, num_clients)
    if min_size * num_clients > n:
        raise ValueError(
            f"min_size={min_size} with num_clients={num_clients} needs "
            f"{min_size * num_clients} rows but labels hold only {n}"
        )

    rng = np.random.default_rng(seed)
    rows_by_class = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    owner = np.empty(n, dtype=np.int64)
    smallest = 0
    for _ in range(max_tries):
        for rows in rows_by_class:
            proportions = rng.dirichlet(np.full(num_clients, alpha))
            cuts = (np.cumsum(proportions)[:-1] * rows.size).astype(np.int64)
            for client, block in enumerate(np.split(rng.permutation(rows), cuts)):
                owner[block] = client
        smallest = int(np.bincount(owner, minlength=num_clients).min())
        if smallest >= min_size:
            return owner
    raise ValueError(
        f"dirichlet split: no draw in max_tries={max_tries} gave every client "
        f"min_size={min_size} rows (last draw's smallest client had {smallest}); "
        f"increase alpha or max_tries, or lower min_size or num_clients"
    )


# --------------------------------------------------------------------------
# owner-array utilities


def client_sizes(owner, *, num_clients: int | None = None) -> np.ndarray:
    """Number of rows owned by each client.

    :param owner: owner array (1-D, non-negative integer client ids).
    :param num_clients: number of clients ``M``; defaults to ``owner.max()+1``.
        Give it to count clients that own no rows (reported as ``0``).
    :returns: integer array of shape ``(M,)``.

    >>> client_sizes([0, 2, 2, 1, 2]).tolist()
    [1, 1, 3]
    >>> client_sizes([0, 0], num_clients=3).tolist()
    [2, 0, 0]
    """
    owner = _check_owner(owner)
    num_clients = _num_clients_of(owner, num_clients)
    return np.bincount(owner, minlength=num_clients)


def client_indices(owner, *, num_clients: int | None = None) -> list[np.ndarray]:
    """Row indices of each client, in increasing order.

    :param owner: owner array (1-D, non-negative integer client ids).
    :param num_clients: number of clients ``M``; defaults to ``owner.max()+1``.
        A client that owns no rows gets an empty array.
    :returns: list of ``M`` integer arrays; together they partition
        ``range(len(owner))``.

    >>> [idx.tolist() for idx in client_indices([1, 0, 1, 0, 0])]
    [[1, 3, 4], [0, 2]]
    """
    owner = _check_owner(owner)
    num_clients = _num_clients_of(owner, num_clients)
    # One stable sort instead of M passes over the array.
    order = np.argsort(owner, kind="stable")
    boundaries = np.cumsum(np.bincount(owner, minlength=num_clients))[:-1]
    return np.split(order, boundaries)
