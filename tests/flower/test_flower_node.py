"""A deployed Flower node answers each message in a new process: the executables it compiled
for a run are stored on the node (its ``jax-cache-dir``) and read back by the next message's
process instead of tracing and compiling again; a damaged store is compiled anew."""

import os

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from numpyro_fed.flower._node import stored_executable


def client_update(block, q, key):
    """A client function as a node runs it: local steps on its rows, then noise of its key."""

    def step(carry, _):
        return carry - 0.1 * jnp.tanh(block["X"] @ carry).mean() * carry, None

    q, _ = jax.lax.scan(step, q, None, length=20)
    return q + 0.01 * jax.random.normal(key, q.shape)


def arguments(dtype=jnp.float32):
    X = jnp.asarray(np.random.default_rng(0).normal(size=(50, 3)), dtype)
    return ({"X": X}, jnp.ones(3, dtype), jax.random.PRNGKey(3))


class NotTraced:
    """A jitted function that must not be traced again (the store must serve it)."""

    def lower(self, *args):
        raise AssertionError("the stored executable was not used: the function was traced again")


def test_the_next_message_reads_the_stored_executable(tmp_path):
    args = arguments()
    expected = jax.jit(client_update)(*args)
    first = stored_executable(jax.jit(client_update), args, "update f32", run_id=7, folder=str(tmp_path))
    stored = os.listdir(tmp_path / "7")
    assert len(stored) == 1 and stored[0].endswith(".pkl")
    again = stored_executable(NotTraced(), args, "update f32", run_id=7, folder=str(tmp_path))
    np.testing.assert_array_equal(again(*args), expected)
    np.testing.assert_array_equal(first(*args), expected)
    # another run (its app may differ) or other argument types: compiled anew, never read
    with pytest.raises(AssertionError, match="traced again"):
        stored_executable(NotTraced(), args, "update f32", run_id=8, folder=str(tmp_path))
    with pytest.raises(AssertionError, match="traced again"):
        stored_executable(NotTraced(), args, "update f64", run_id=7, folder=str(tmp_path))


def test_a_damaged_store_is_compiled_anew(tmp_path):
    args = arguments()
    stored_executable(jax.jit(client_update), args, "update f32", run_id=1, folder=str(tmp_path))
    (path,) = [tmp_path / "1" / name for name in os.listdir(tmp_path / "1")]
    path.write_bytes(path.read_bytes()[:100])  # a torn write
    again = stored_executable(jax.jit(client_update), args, "update f32", run_id=1, folder=str(tmp_path))
    np.testing.assert_array_equal(again(*args), jax.jit(client_update)(*args))


def test_without_a_store_it_compiles():
    args = arguments()
    compiled = stored_executable(jax.jit(client_update), args, "update f32", run_id=1, folder="")
    np.testing.assert_array_equal(compiled(*args), jax.jit(client_update)(*args))
