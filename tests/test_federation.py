"""The federation seam: InProcess and RayFederation agree, the ledger counts what crosses the
wire, faults name the client, and no client's function holds another client's rows."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax import lax

from numpyro_fed.federation import ClientError, ClientProgram, InProcess, MessageLedger

M, R, D = 3, 4, 2


def toy_blocks():
    rng = np.random.default_rng(0)
    return [{"x": rng.normal(size=(R, D)), "w": np.full(R, 1.0 + m)} for m in range(M)]


def weighted_sum(block, theta):
    return jnp.sum(block["w"][:, None] * jnp.tanh(block["x"] * theta), axis=0)


def scaled(block, theta, own):
    return weighted_sum(block, theta) * own


def ring_step(block, state, inbox, mask, t, step_size):
    new = state + step_size * (inbox.sum(0) - mask.sum() * state) + 0.0 * t
    return new, new


FUNCTIONS = {"sum": weighted_sum, "scaled": scaled}
AGENTS = {"ring": ring_step}


def toy_program(blocks=None):
    return ClientProgram(FUNCTIONS, blocks=blocks or toy_blocks(), agents=AGENTS)


def reference_map(theta, own=None):
    blocks = toy_blocks()
    if own is None:
        return jnp.stack([weighted_sum(b, theta) for b in blocks])
    return jnp.stack([scaled(b, theta, own[m]) for m, b in enumerate(blocks)])


def test_inprocess_map_and_one_inside_jit_and_vmap_equal_plain_computation():
    fed = InProcess().start(toy_program())
    theta = jnp.array([0.3, -0.7])
    own = jnp.arange(1.0, M + 1)

    np.testing.assert_allclose(jax.jit(lambda f, t: f.map("sum", t))(fed, theta),
                               reference_map(theta), rtol=1e-13)
    np.testing.assert_allclose(jax.jit(lambda f, t, o: f.map("scaled", t, per_client=(o,)))(fed, theta, own),
                               reference_map(theta, own), rtol=1e-13)
    # vmap over chains: each chain its own theta and own client.
    thetas = jnp.stack([theta, 2 * theta, -theta])
    clients = jnp.array([2, 0, 1])
    chains = jax.jit(jax.vmap(lambda t, c: fed.one("sum", c, t)))(thetas, clients)
    for k in range(3):
        np.testing.assert_allclose(chains[k], reference_map(thetas[k])[clients[k]], rtol=1e-13)
    # inside a while loop, closed over rather than passed
    def body(carry):
        i, acc = carry
        return i + 1, acc + fed.map("sum", theta).sum()
    _, total = jax.jit(lambda: lax.while_loop(lambda c: c[0] < 3, body, (0, 0.0)))()
    np.testing.assert_allclose(total, 3 * reference_map(theta).sum(), rtol=1e-12)


def test_inprocess_ledger_derives_bytes_from_shapes():
    fed = InProcess().start(toy_program())
    theta = jnp.zeros(D)
    jax.jit(lambda f, t, o: f.map("scaled", t, per_client=(o,)))(fed, theta, jnp.ones(M))
    jax.jit(lambda f, c: f.one("sum", c, theta))(fed, 1)
    fed.record_calls("scaled", 5)
    fed.record_calls("sum", [0, 2, 0])
    s = fed.ledger.summary()
    itemsize = theta.dtype.itemsize
    np.testing.assert_array_equal(s["scaled/bytes_to_client"], 5 * (D + 1) * itemsize)
    np.testing.assert_array_equal(s["scaled/bytes_from_client"], 5 * D * itemsize)
    np.testing.assert_array_equal(s["sum/messages_to_client"], [0, 2, 0])
    np.testing.assert_array_equal(s["rounds"], [5, 7, 5])
    with pytest.raises(KeyError, match="not been traced"):
        fed.record_calls("never", 1)


def test_inprocess_exchange_runs_the_agents_against_their_neighbours_only():
    fed = InProcess().start(toy_program())
    adjacency = np.array([[0, 1, 0], [1, 0, 1], [0, 1, 0]], bool)
    states = jnp.array([[1.0], [0.0], [4.0]])
    out_states, out_msgs = jax.jit(
        lambda f, s: f.exchange("ring", s, s, adjacency, 20, 0.1))(fed, states)
    x = np.array(states)
    for _ in range(20):
        x = x + 0.1 * (adjacency.T.astype(float) @ x - adjacency.sum(0)[:, None] * x)
    np.testing.assert_allclose(out_states, x, rtol=1e-12)
    fed.record_calls("ring", 20)
    np.testing.assert_array_equal(fed.ledger.summary()["ring/messages_to_peer"], [20, 40, 20])


def test_bad_blocks_are_refused_naming_the_client():
    blocks = toy_blocks()
    blocks[2]["x"][1, 0] = np.nan
    with pytest.raises(ValueError, match="client 2.*non-finite"):
        InProcess().start(toy_program(blocks))
    blocks = toy_blocks()
    blocks[1]["x"] = blocks[1]["x"][:, :1]
    spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), toy_blocks()[0])
    with pytest.raises(ValueError, match=r"client 1: \['x'\] has shape"):
        InProcess().start(ClientProgram(FUNCTIONS, blocks=blocks, spec=spec))
    with pytest.raises(ValueError, match="exactly one of blocks"):
        ClientProgram(FUNCTIONS)


def test_ledger_adds_per_client_and_direction():
    ledger = MessageLedger(3)
    ledger.add("x", "to_client", [0, 0, 2], messages=1, nbytes=4, rounds=1)
    s = ledger.summary()
    assert s["messages_to_client"].tolist() == [2, 0, 1]
    assert s["x/bytes_to_client"].tolist() == [8, 0, 4]
    assert s["rounds"].tolist() == [2, 0, 1]
    with pytest.raises(ValueError, match="direction"):
        ledger.add("x", "sideways", 0)
    assert issubclass(ClientError, RuntimeError)
