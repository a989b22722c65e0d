"""A worker's client state: what a stateful call leaves unchanged is neither copied nor saved
again, and the saved versions read back as they were."""

import os

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from numpyro_fed.federation.ray_worker import ClientWorker
from numpyro_fed.federation.state_store import StateStore, passthrough_jit


def step(block, state, x):
    """A sampler's round: reads its large weights, updates its counter."""
    return {"weights": state["weights"], "count": state["count"] + x}, (state["weights"] * block).sum() + x


def initial(n=1000):
    return {"weights": jnp.arange(n, dtype=jnp.float32), "count": jnp.zeros((), jnp.float32)}


def make_worker(tmp_path, **stateful):
    """Client 0's worker of federation ``"f"`` saving in ``tmp_path``, with the stateful
    functions ``stateful`` and the block 2 (the precision of this process)."""

    class Program:
        functions = {}

    Program.stateful = stateful
    w = ClientWorker(0, jax.config.jax_enable_x64, state_dir=str(tmp_path), federation_id="f")
    w.program, w.block = Program(), jnp.float32(2.0)
    return w


def test_unchanged_arrays_come_back_as_the_objects_given():
    call = passthrough_jit(step)
    state = initial()
    new, reply = call(jnp.float32(2.0), state, 1.0)
    assert new["weights"] is state["weights"]
    assert new["count"] is not state["count"]
    # the same values as the function run plainly
    plain_state, plain_reply = jax.jit(step)(jnp.float32(2.0), state, 1.0)
    for a, b in zip(jax.tree.leaves((new, reply)), jax.tree.leaves((plain_state, plain_reply))):
        np.testing.assert_array_equal(a, b)
    # a second call of the same signature (no new trace) and one of another shape
    again, _ = call(jnp.float32(2.0), new, 2.0)
    assert again["weights"] is state["weights"] and float(again["count"]) == 3.0
    other = initial(7)
    moved, _ = call(jnp.float32(1.0), other, 1.0)
    assert moved["weights"] is other["weights"]


def test_calls_of_earlier_signatures_forward_what_their_own_trace_forwarded():
    """Once the function traced for two signatures whose states it forwards differently, a
    call of either (a hit in jit's cache, no trace) forwards what that signature's trace did."""

    def f(block, state, x):  # forwards a long state's weights, rewrites a short one's
        weights = state["weights"] if state["weights"].shape[0] > 3 else state["weights"] + 0.0
        return {"weights": weights, "count": state["count"] + x}, x

    call = passthrough_jit(f)
    long, short = initial(5), initial(2)
    for _ in range(2):
        assert call(None, long, 1.0)[0]["weights"] is long["weights"]
        new = call(None, short, 1.0)[0]
        assert new["weights"] is not short["weights"]
        np.testing.assert_array_equal(new["weights"], short["weights"])


def test_a_changed_array_is_a_new_one():
    call = passthrough_jit(lambda block, state, x: ({"weights": state["weights"] * x, "count": state["count"]}, x))
    state = initial(5)
    new, _ = call(None, state, 2.0)
    assert new["weights"] is not state["weights"] and new["count"] is state["count"]
    np.testing.assert_array_equal(new["weights"], np.arange(5.0) * 2)


def test_the_store_writes_an_array_once_and_reads_the_versions_back(tmp_path):
    store = StateStore(str(tmp_path / "client0"))
    call = passthrough_jit(step)
    states = {0: initial()}
    store.save(states)
    files = set(os.listdir(store.folder))
    assert len(files) == 3  # two arrays and the index
    for version in range(3):
        new, _ = call(jnp.float32(1.0), states[version], 1.0)
        states = {version: states[version], version + 1: new}
        store.save(states)
    leaves = {name for name in os.listdir(store.folder) if name.startswith("leaf-")}
    # the weights' one file, and the counters of the two versions kept; older ones removed
    assert len(leaves) == 3
    assert sorted(files & leaves) and len(files & leaves) == 1  # the weights were never written again
    loaded = StateStore(store.folder).load()
    assert sorted(loaded) == [2, 3]
    for version in (2, 3):
        for a, b in zip(jax.tree.leaves(loaded[version]), jax.tree.leaves(states[version])):
            np.testing.assert_array_equal(a, b)
    store.clear()
    assert not os.path.exists(store.folder)
    assert StateStore(store.folder).load() == {}


def test_a_worker_answers_from_a_state_it_reloaded(tmp_path):
    """A worker replaced mid-run reloads the versions its predecessor saved and gives the same
    replies as the one that kept running (the Ray federation's restart, without Ray)."""

    def worker():
        return make_worker(tmp_path, step=step)

    first = worker()
    first.set_state(initial())
    (reply1, v1) = first.call("step", (1.0,), None, 0)
    (reply2, v2) = first.call("step", (1.0,), None, v1)
    replaced = worker()
    replaced._restore_state()
    assert sorted(replaced.states) == [1, 2]
    again, v = replaced.call("step", (1.0,), None, v1)  # the retried round, from version 1
    np.testing.assert_array_equal(again, reply2)
    assert v == v2
    with pytest.raises(LookupError, match="holds no client state of version 0"):
        replaced.call("step", (1.0,), None, 0)
    replaced.clear_state()
    assert not (tmp_path / "numpyro_fed_state" / "f").exists()


def test_a_call_that_only_reads_its_state_saves_nothing_and_a_restart_still_answers(tmp_path):
    """A sampler's rounds read the client's weights: no save after them, and a worker replaced
    after such rounds answers the retried round from the state saved before them."""

    def read(block, state, x):
        return state, (state["weights"] * block).sum() + x

    def worker():
        return make_worker(tmp_path, step=step, read=read)

    first = worker()
    first.set_state(initial())
    _, v = first.call("step", (1.0,), None, 0)  # changes the count: saved
    index = tmp_path / "numpyro_fed_state" / "f" / "client0" / StateStore.INDEX
    saved_at = index.stat().st_mtime_ns
    replies = []
    for _ in range(3):
        reply, v = first.call("read", (1.0,), None, v)
        replies.append(reply)
    assert index.stat().st_mtime_ns == saved_at  # reads wrote nothing
    replaced = worker()
    replaced._restore_state()
    assert sorted(replaced.states) == [0, 1]
    again, v_again = replaced.call("read", (1.0,), None, v - 1)  # the last round, retried
    np.testing.assert_array_equal(again, replies[-1])
    assert v_again == v
    # the round before it too, though the worker now holds versions v - 1 and v only
    before, _ = replaced.call("read", (1.0,), None, v - 2)
    np.testing.assert_array_equal(before, replies[-2])
    # and a change after the restart is saved from the state the reads kept
    _, v_next = replaced.call("step", (1.0,), None, v)
    assert float(StateStore(str(index.parent)).load()[v_next]["count"]) == 2.0
