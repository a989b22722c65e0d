"""Client state held by the clients: ``init_state`` and the stateful calls of the seam, on
every backend. What a client keeps between its calls stays with it: only replies cross (and
are counted), a Ray worker keeps its state across a restart, and a call that names a version
the worker does not hold is a ClientError naming the client."""

import os

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import numpyro_fed as nf
from numpyro_fed.federation import ClientError, ClientProgram, ClientState, InProcess

from helpers import holds_value

M = 3
SENTINEL = 911.0625  # planted in client 1's initial state only (the rows' sentinel is another value)


def accumulate(block, state, w, own):
    """The client adds ``block * w + own`` to its running total and replies with the total's
    sum (its state: the total and how many calls it has seen)."""
    total = state["total"] + block * w + own
    return {"total": total, "calls": state["calls"] + 1}, jnp.sum(total)


def program():
    blocks = jnp.arange(M * 2.0).reshape(M, 2)
    return ClientProgram.stacked({"plain": lambda block, w: block * w}, blocks, stateful={"accumulate": accumulate})


def initial():
    total = jnp.zeros((M, 2)).at[1, 0].set(SENTINEL)
    return {"total": total, "calls": jnp.zeros(M, jnp.int32)}


def reference(calls):
    """What the clients' totals are after ``calls``, a list of (clients, w, own)."""
    total = np.array(initial()["total"])
    blocks = np.arange(M * 2.0).reshape(M, 2)
    replies = []
    for clients, w, own in calls:
        for c in clients:
            total[c] = total[c] + blocks[c] * w + own[c]
        replies.append([total[c].sum() for c in clients])
    return total, replies


def run_calls(fed, cs):
    """A map, a one and a one of two clients, inside one jit."""
    own = jnp.array([1.0, 2.0, 3.0])

    @jax.jit
    def calls(fed, cs):
        cs, r1 = fed.map("accumulate", 2.0, per_client=(own,), state=cs)
        cs, r2 = fed.one("accumulate", 2, 3.0, own=(own,), state=cs)
        cs, r3 = fed.one("accumulate", jnp.array([0, 2]), 0.5, own=(own,), state=cs)
        return cs, (r1, r2, r3)

    if isinstance(fed, InProcess):
        return calls(fed, cs)
    return jax.jit(lambda cs: calls.__wrapped__(fed, cs))(cs)


def expected_calls():
    own = [1.0, 2.0, 3.0]
    return [([0, 1, 2], 2.0, own), ([2], 3.0, own), ([0, 2], 0.5, own)]


def test_in_process_state_is_kept_per_client_and_never_counted():
    fed = InProcess().start(program())
    cs = fed.init_state(initial())
    assert isinstance(cs, ClientState)
    cs, (r1, r2, r3) = run_calls(fed, cs)
    total, replies = reference(expected_calls())
    np.testing.assert_allclose(cs.values["total"], total)
    np.testing.assert_array_equal(cs.values["calls"], [2, 1, 3])
    np.testing.assert_array_equal(cs.version, [2, 1, 3])
    np.testing.assert_allclose(r1, replies[0])
    np.testing.assert_allclose(r2, replies[1][0])
    np.testing.assert_allclose(r3, replies[2])
    ledger = fed.ledger.summary()
    # down: w (8 bytes, float32 under the test's float64: w is a Python float -> weak type)
    # and the client's own number; up: its reply. The state (3 numbers) never.
    w = jnp.asarray(2.0).dtype.itemsize
    np.testing.assert_array_equal(ledger["accumulate/bytes_to_client"], np.array([2, 1, 3]) * 2 * w)
    np.testing.assert_array_equal(ledger["accumulate/bytes_from_client"], np.array([2, 1, 3]) * w)
    # the initial state: each client's slice down, once
    slice_bytes = 2 * w + 4
    np.testing.assert_array_equal(ledger["init_state/bytes_to_client"], [slice_bytes] * M)
    np.testing.assert_array_equal(ledger["init_state/rounds"], [1] * M)


def test_stateful_calls_are_checked():
    fed = InProcess().start(program())
    with pytest.raises(ValueError, match="leading axis of 3 clients"):
        fed.init_state(jnp.zeros(2))
    with pytest.raises(KeyError, match="no stateful function 'plain'"):
        fed.map("plain", 1.0, state=fed.init_state(initial()))
    with pytest.raises(ValueError, match="both functions and stateful"):
        ClientProgram.stacked({"f": accumulate}, jnp.zeros((2, 1)), stateful={"f": accumulate})


def test_on_ray_the_state_stays_on_the_workers(ray_session, tmp_path):
    local = InProcess().start(program())
    local_cs, local_replies = run_calls(local, local.init_state(initial()))
    with nf.RayFederation(timeout=60.0, state_dir=tmp_path) as fed:
        fed.start(program())
        sent, received = [], []
        submit, replies_of = fed._submit, fed._replies

        def spy_submit(m, name, args, in_axes, nbytes, version=None):
            sent.append(np.asarray(args, dtype=object))
            return submit(m, name, args, in_axes, nbytes, version)

        def spy_replies(call, refs):
            out = replies_of(call, refs)
            received.append(out)
            return out

        fed._submit, fed._replies = spy_submit, spy_replies
        cs = fed.init_state(initial())
        assert jax.tree.leaves(cs.values) == []
        sent.clear()  # the initial state went down once, in init_state (public values)
        cs, replies = run_calls(fed, cs)
        fed._submit, fed._replies = submit, replies_of
        # the same replies and versions as in process, bit for bit
        for a, b in zip(jax.tree.leaves(replies), jax.tree.leaves(local_replies)):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(cs.version, local_cs.version)
        # the calls carried no state: the sentinel (client 1's initial total) is in none of them
        assert not holds_value(SENTINEL, sent, received)
        ledger = fed.ledger.summary()
        np.testing.assert_array_equal(ledger["accumulate/rounds"], cs.version)
        np.testing.assert_array_equal(ledger["accumulate/bytes_from_client"], local_replies[0][:1].nbytes * cs.version)
        # each worker saved its state on its disk; close removes it
        folder = tmp_path / "numpyro_fed_state" / fed.federation_id
        assert sorted(os.listdir(folder)) == [f"client{m}" for m in range(M)]
    assert not folder.exists()


def test_on_ray_a_restarted_worker_reloads_its_state(ray_session):
    with nf.RayFederation(timeout=60.0) as fed:
        fed.start(program())
        step = jax.jit(lambda cs: fed.map("accumulate", 2.0, per_client=(jnp.ones(M),), state=cs))
        cs0 = fed.init_state(initial())
        cs1, _ = step(cs0)
        ray_session.kill(fed.actors[1])
        with pytest.raises(ClientError, match="client 1") as info, fed.guard():
            step(cs1)
        assert info.value.clients == (1,)
        fed.restart()
        # clients 0 and 2 are at version 2 (they answered), client 1 reloaded versions 0 and 1:
        # the round is retried from the last completed one (version 1), a pure function of it
        cs2, replies = step(cs1)
        np.testing.assert_array_equal(cs2.version, [2, 2, 2])
        total, _ = reference([([0, 1, 2], 2.0, [1.0] * M)] * 2)
        np.testing.assert_allclose(replies, total.sum(axis=1))
        # a version no worker holds any more: a named error saying why
        with pytest.raises(ClientError, match="client 0 .*no client state of version 0"), fed.guard():
            step(cs0)
