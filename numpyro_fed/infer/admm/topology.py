"""Communication graphs of decentralized samplers: who talks to whom.

A :class:`Topology` is an undirected graph on the agents (one agent per client), stored as a
symmetric 0/1 adjacency matrix without self-loops. :func:`make_topology` builds one from a
name (``"complete"``, ``"ring"``, ``"star"``, ``"none"``), an adjacency matrix or a
networkx graph (read by duck typing: networkx is not a dependency). Disconnected graphs are
accepted with a :class:`DisconnectedTopologyWarning`: agents in different components never
exchange information, so they cannot reach consensus (the "no edges" case of the D-ADMMS
paper, Section 6).

:func:`metropolis_weights` gives the doubly stochastic mixing matrix that the gradient
baselines (D-SGLD, D-SGHMC) average with.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np

from numpyro_fed._checks import check_int

__all__ = [
    "DisconnectedTopologyWarning",
    "Topology",
    "make_topology",
    "metropolis_weights",
    "num_components",
]

TOPOLOGY_NAMES = ("complete", "ring", "star", "none")


class DisconnectedTopologyWarning(UserWarning):
    """The communication graph has more than one connected component."""


@dataclass(frozen=True, eq=False)
class Topology:
    """An undirected communication graph on ``num_agents`` agents.

    :ivar str name: ``"complete"``, ``"ring"``, ``"star"``, ``"none"`` or ``"custom"``.
    :ivar numpy.ndarray adjacency: ``(N, N)`` symmetric 0/1 float matrix, zero diagonal.
    :ivar numpy.ndarray degrees: ``(N,)`` number of neighbors of each agent.
    :ivar int num_components: connected components (1: connected).

    >>> t = make_topology("ring", 5)
    >>> t.degrees.tolist(), t.num_edges, t.is_connected
    ([2.0, 2.0, 2.0, 2.0, 2.0], 5, True)
    """

    name: str
    adjacency: np.ndarray = field(repr=False)

    @property
    def num_agents(self) -> int:
        return int(self.adjacency.shape[0])

    @property
    def degrees(self) -> np.ndarray:
        return self.adjacency.sum(axis=1)

    @property
    def num_edges(self) -> int:
        return int(self.adjacency.sum() // 2)

    @property
    def num_components(self) -> int:
        return num_components(self.adjacency)

    @property
    def is_connected(self) -> bool:
        return self.num_components == 1

    def __repr__(self) -> str:
        return f"Topology(name={self.name!r}, num_agents={self.num_agents}, num_edges={self.num_edges})"


def _named(name: str, n: int) -> np.ndarray:
    a = np.zeros((n, n))
    if name == "complete":
        a = 1.0 - np.eye(n)
    elif name == "ring":
        if n > 1:
            i = np.arange(n)
            a[i, (i + 1) % n] = 1.0
            a[(i + 1) % n, i] = 1.0
            np.fill_diagonal(a, 0.0)  # n == 1 would link the agent to itself
    elif name == "star":
        a[0, 1:] = a[1:, 0] = 1.0
    return a


def _from_graph(graph) -> np.ndarray:
    """Adjacency of a networkx-like graph (``nodes``, ``edges``); nodes in ``graph.nodes`` order,
    or ``0..N-1`` when the nodes are exactly those integers."""
    if getattr(graph, "is_directed", lambda: False)():
        raise ValueError("topology: the graph must be undirected (agents exchange iterates both ways)")
    nodes = list(graph.nodes)
    if sorted(nodes, key=repr) == sorted(range(len(nodes)), key=repr) and all(
        isinstance(v, (int, np.integer)) for v in nodes
    ):
        nodes = sorted(nodes)
    index = {v: k for k, v in enumerate(nodes)}
    a = np.zeros((len(nodes), len(nodes)))
    for edge in graph.edges:
        u, v = edge[0], edge[1]
        if u == v:
            raise ValueError(f"topology: the graph has a self-loop at node {u!r}")
        a[index[u], index[v]] = a[index[v], index[u]] = 1.0
    return a


def _check_adjacency(adjacency) -> np.ndarray:
    a = np.asarray(adjacency)
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"topology: an adjacency matrix must be square, got shape {a.shape}")
    if a.dtype == bool:
        a = a.astype(float)
    if not np.issubdtype(a.dtype, np.number):
        raise TypeError(f"topology: an adjacency matrix must be numeric, got dtype {a.dtype}")
    a = a.astype(float)
    if not np.all(np.isin(a, (0.0, 1.0))):
        raise ValueError("topology: adjacency entries must be 0 or 1 (weights are derived, not given)")
    if np.any(np.diag(a) != 0):
        raise ValueError(
            f"topology: the adjacency matrix has self-loops at agents {np.flatnonzero(np.diag(a)).tolist()}; "
            "its diagonal must be zero"
        )
    if not np.array_equal(a, a.T):
        i, j = np.argwhere(a != a.T)[0]
        raise ValueError(
            f"topology: the adjacency matrix must be symmetric (the graph is undirected), "
            f"but A[{i}, {j}] = {a[i, j]:g} and A[{j}, {i}] = {a[j, i]:g}"
        )
    return a


def num_components(adjacency) -> int:
    """Number of connected components of the graph (breadth-first search).

    >>> num_components(np.zeros((3, 3)))
    3
    """
    a = np.asarray(adjacency) != 0
    n = a.shape[0]
    seen = np.zeros(n, dtype=bool)
    count = 0
    for start in range(n):
        if seen[start]:
            continue
        count += 1
        frontier = np.zeros(n, dtype=bool)
        frontier[start] = True
        while frontier.any():
            seen |= frontier
            frontier = a[frontier].any(axis=0) & ~seen
    return count


def make_topology(topology, num_agents: int | None = None, *, warn_disconnected: bool = True) -> Topology:
    """The communication graph of ``num_agents`` agents.

    :param topology: ``"complete"``, ``"ring"`` (agent ``i`` talks to ``i - 1`` and
        ``i + 1`` modulo ``N``), ``"star"`` (agent 0 is the hub), ``"none"`` (no edges),
        a :class:`Topology`, a square symmetric 0/1 adjacency matrix with a zero diagonal,
        or an undirected networkx graph (any object with ``nodes`` and ``edges``).
    :param int num_agents: ``N``; required for a name, checked against the others.
    :param bool warn_disconnected: warn (:class:`DisconnectedTopologyWarning`) when the
        graph is not connected.
    :raises ValueError: unknown name, non-square, non-symmetric or non-0/1 matrix,
        self-loops, or a number of nodes that differs from ``num_agents``.

    >>> make_topology("star", 4).adjacency.astype(int).tolist()
    [[0, 1, 1, 1], [1, 0, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0]]
    >>> make_topology([[0, 1], [0, 0]], 2)
    Traceback (most recent call last):
    ...
    ValueError: topology: the adjacency matrix must be symmetric (the graph is undirected), but A[0, 1] = 1 and A[1, 0] = 0
    """
    if num_agents is not None:
        num_agents = check_int(num_agents, "num_agents", minimum=1)
    if isinstance(topology, Topology):
        name, adjacency = topology.name, topology.adjacency
    elif isinstance(topology, str):
        if topology not in TOPOLOGY_NAMES:
            raise ValueError(
                f"topology must be one of {TOPOLOGY_NAMES}, an adjacency matrix or a graph; got {topology!r}"
            )
        if num_agents is None:
            raise ValueError(f"topology={topology!r} needs num_agents")
        name, adjacency = topology, _named(topology, num_agents)
    elif hasattr(topology, "nodes") and hasattr(topology, "edges"):
        name, adjacency = "custom", _check_adjacency(_from_graph(topology))
    else:
        name, adjacency = "custom", _check_adjacency(topology)
    if num_agents is not None and adjacency.shape[0] != num_agents:
        raise ValueError(
            f"topology has {adjacency.shape[0]} nodes but there are {num_agents} agents "
            "(one per client): the graph needs one node per client"
        )
    result = Topology(name, adjacency)
    if warn_disconnected and not result.is_connected:
        warnings.warn(
            f"topology {name!r} has {result.num_components} connected components: agents in "
            "different components never exchange information and cannot reach consensus, so "
            "each component samples from its own clients' posterior only",
            DisconnectedTopologyWarning,
            stacklevel=2,
        )
    return result


def metropolis_weights(adjacency) -> np.ndarray:
    """Doubly stochastic Metropolis(-Hastings) mixing matrix of a graph:
    ``W_ij = 1 / (max(deg_i, deg_j) + 1)`` on edges, ``W_ii = 1 - sum_j W_ij``.

    >>> metropolis_weights(make_topology("star", 3).adjacency).round(3).tolist()
    [[0.333, 0.333, 0.333], [0.333, 0.667, 0.0], [0.333, 0.0, 0.667]]
    """
    a = _check_adjacency(adjacency.adjacency if isinstance(adjacency, Topology) else adjacency)
    deg = a.sum(axis=1)
    w = a / (np.maximum(deg[:, None], deg[None, :]) + 1.0)
    w[np.diag_indices_from(w)] = 1.0 - w.sum(axis=1)
    return w
