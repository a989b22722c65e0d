"""Shared by the tests of the engine backends: a run on Ray or Flower is the in-process run."""

import numpy as np

import jax

from numpyro_fed.federation import ClientState


def is_client_state(x):
    return isinstance(x, ClientState)


def server_view(state):
    """A state without the values of its client states (in process they are kept beside the
    server's state; on an engine they stay with the clients)."""
    return jax.tree.map(
        lambda x: ClientState((), x.version) if is_client_state(x) else x, state, is_leaf=is_client_state
    )


def assert_same_run(remote_result, local_result, *, interrupted=False, state_rtol=0.0):
    """``remote_result`` (a run on an engine) is ``local_result`` (the same run in process).

    ``state_rtol > 0``: the server's state agrees to that relative tolerance instead of bit
    for bit, for a server state computed from what the clients upload (P-DSVGD's particles:
    each client's function compiled alone on its worker rounds differently from the same
    function vmapped over the clients in process)."""
    # the clients kept their states: none came back to the server
    for cs in jax.tree.leaves(remote_result.state, is_leaf=is_client_state):
        if is_client_state(cs):
            assert jax.tree.leaves(cs.values) == []
    # The server's state is bit-for-bit the in-process run's: the same client functions on
    # the same blocks with the same keys. The loss, DPPVI's Pareto k-hat and DSVGD's importance
    # effective size (diagnostics summed from the clients' terms, each compiled alone on its
    # client rather than vmapped) agree to round-off.
    remote_state, local_state = server_view(remote_result.state), server_view(local_result.state)
    assert jax.tree.structure(remote_state) == jax.tree.structure(local_state)
    for a, b in zip(jax.tree.leaves(remote_state), jax.tree.leaves(local_state)):
        if state_rtol and np.issubdtype(np.asarray(b).dtype, np.floating):
            np.testing.assert_allclose(a, b, rtol=state_rtol, atol=state_rtol * float(np.max(np.abs(b), initial=0.0)))
        else:
            np.testing.assert_array_equal(a, b)
    for name, value in local_result.metrics.items():
        # a diagnostic of the clients' terms, or a metric of a state equal to round-off (to
        # round-off of the metric's scale: Stein's statistics of corrected particles are ~0)
        if name in ("loss", "pareto_k", "conditional_ess") or (state_rtol and name != "wall_time"):
            rtol = max(state_rtol, 1e-12)
            scale = float(np.nanmax(np.abs(np.asarray(value, dtype=float)), initial=0.0))
            np.testing.assert_allclose(remote_result.metrics[name], value, rtol=rtol, atol=rtol * scale, err_msg=name)
        elif name != "wall_time":
            np.testing.assert_array_equal(remote_result.metrics[name], value, err_msg=name)
    assert (remote_result.privacy is None) == (local_result.privacy is None)
    if local_result.privacy is not None:
        assert remote_result.privacy.epsilon == local_result.privacy.epsilon
        assert remote_result.privacy.delta == local_result.privacy.delta
    # the ledger counted from the payloads the engine carried is the one counted from shapes;
    # an interrupted run also counts the messages of the round that failed (they crossed: the
    # clients visited before the failing one answered), at most one call per client
    assert set(remote_result.ledger) == set(local_result.ledger)
    for name, value in local_result.ledger.items():
        if interrupted:
            extra = remote_result.ledger[name] - value
            assert (extra >= 0).all(), name
            if name.endswith("rounds"):
                assert (extra <= 1).all(), name
        else:
            np.testing.assert_array_equal(remote_result.ledger[name], value, err_msg=name)
