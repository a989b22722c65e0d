"""Communication graphs: named graphs, adjacency matrices, networkx-like graphs, Metropolis weights."""

import warnings

import numpy as np
import pytest

from numpyro_fed.infer.admm.topology import (
    DisconnectedTopologyWarning,
    make_topology,
    metropolis_weights,
    num_components,
)


class FakeGraph:
    """The part of networkx's Graph API that make_topology reads."""

    def __init__(self, nodes, edges, directed=False):
        self.nodes, self.edges, self._directed = list(nodes), list(edges), directed

    def is_directed(self):
        return self._directed


@pytest.mark.parametrize(
    "name, n, degrees, edges",
    [
        ("complete", 5, [4] * 5, 10),
        ("ring", 5, [2] * 5, 5),
        ("ring", 2, [1, 1], 1),
        ("ring", 1, [0], 0),
        ("star", 5, [4, 1, 1, 1, 1], 4),
        ("none", 3, [0, 0, 0], 0),
    ],
)
def test_named_topologies(name, n, degrees, edges):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DisconnectedTopologyWarning)
        t = make_topology(name, n)
    assert t.degrees.tolist() == degrees
    assert t.num_edges == edges
    a = t.adjacency
    assert np.array_equal(a, a.T) and np.all(np.diag(a) == 0)


def test_ring_links_neighbours_modulo_n():
    a = make_topology("ring", 6).adjacency
    for i in range(6):
        assert set(np.flatnonzero(a[i])) == {(i - 1) % 6, (i + 1) % 6}


def test_disconnected_graphs_warn_and_connected_ones_do_not():
    with pytest.warns(DisconnectedTopologyWarning, match="cannot reach consensus"):
        t = make_topology("none", 4)
    assert t.num_components == 4
    two_pairs = np.kron(np.eye(2), [[0, 1], [1, 0]])
    with pytest.warns(DisconnectedTopologyWarning, match="2 connected components"):
        make_topology(two_pairs, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in ("complete", "ring", "star"):
            assert make_topology(name, 7).is_connected
        assert make_topology("none", 1).is_connected  # a single agent needs no edges


def test_bad_adjacency_matrices_are_rejected():
    with pytest.raises(ValueError, match="symmetric"):
        make_topology(np.array([[0, 1, 0], [0, 0, 1], [0, 1, 0]]), 3)
    with pytest.raises(ValueError, match="self-loops at agents \\[1\\]"):
        make_topology(np.array([[0, 1], [1, 1]]), 2)
    with pytest.raises(ValueError, match="square"):
        make_topology(np.zeros((2, 3)), 2)
    with pytest.raises(ValueError, match="0 or 1"):
        make_topology(np.array([[0, 0.5], [0.5, 0]]), 2)
    with pytest.raises(ValueError, match="3 nodes but there are 4 agents"):
        make_topology(make_topology("ring", 3).adjacency, 4)
    with pytest.raises(ValueError, match="topology must be one of"):
        make_topology("grid", 4)


def test_networkx_like_graphs_by_duck_typing():
    ring = FakeGraph([3, 1, 0, 2], [(0, 1), (1, 2), (2, 3), (3, 0)])
    assert np.array_equal(make_topology(ring, 4).adjacency, make_topology("ring", 4).adjacency)
    named = FakeGraph(["a", "b", "c"], [("a", "b"), ("b", "c")])  # a path, nodes in given order
    assert make_topology(named, 3).degrees.tolist() == [1, 2, 1]
    with pytest.raises(ValueError, match="undirected"):
        make_topology(FakeGraph([0, 1], [(0, 1)], directed=True), 2)
    with pytest.raises(ValueError, match="self-loop"):
        make_topology(FakeGraph([0, 1], [(0, 1), (1, 1)]), 2)
    with pytest.raises(ValueError, match="2 nodes but there are 3 agents"):
        make_topology(FakeGraph([0, 1], [(0, 1)]), 3)


@pytest.mark.parametrize("seed", range(5))
def test_metropolis_weights_are_doubly_stochastic(seed):
    rng = np.random.default_rng(seed)
    upper = np.triu(rng.uniform(size=(8, 8)) < 0.4, 1)
    a = (upper | upper.T).astype(float)
    w = metropolis_weights(a)
    assert np.allclose(w.sum(0), 1) and np.allclose(w.sum(1), 1) and np.allclose(w, w.T)
    assert np.all(w >= 0)
    assert np.all((w > 0) | np.eye(8, dtype=bool) | (a == 0))  # every edge has weight
    assert np.all(w[(a == 0) & ~np.eye(8, dtype=bool)] == 0)  # no weight off the graph
    deg = a.sum(1)
    i, j = np.argwhere(a)[0]
    assert w[i, j] == pytest.approx(1 / (max(deg[i], deg[j]) + 1))


def test_num_components():
    assert num_components(make_topology("ring", 5).adjacency) == 1
    assert num_components(np.zeros((3, 3))) == 3
