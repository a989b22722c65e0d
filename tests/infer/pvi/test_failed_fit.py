"""A non-private server does not apply an update whose local fit failed (its residual not
finite, or orders of magnitude above convergence): ``core.accepts``, in the sequential visit
and the synchronous round. On kidiq_interaction over 8 clients in float32 (the zoo's seed)
one client's fit ended non-finite with a finite update; applied, the next four fits ended
350 to 1.9e4 of q's scales away and q ran to alpha = -48,000. Not applied, the run ends where
the other seeds do."""

from types import SimpleNamespace

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from numpyro_fed.infer.pvi import core
from numpyro_fed.infer.pvi.core import ClientReply
from numpyro_fed.infer.pvi.diagnostics import FAILED_FIT_RESIDUAL
from numpyro_fed.infer.pvi.gaussian import GaussianNatural

D, M = 3, 2


class _Stub:
    """A federation whose clients reply with fixed updates and residuals."""

    def __init__(self, delta, residual):
        self.delta, self.residual = delta, residual

    def one(self, name, m, *args, own=None, state=None, partial=False):
        delta = jax.tree_util.tree_map(lambda x: x[m], self.delta)
        return state, ClientReply(delta, jnp.zeros(()), self.residual[m])

    def map(self, name, *args, per_client=None, state=None, partial=False):
        return state, ClientReply(self.delta, jnp.zeros(M), self.residual, jnp.zeros(M))


def _setup():
    prior = GaussianNatural(jnp.zeros(D), -0.5 * jnp.ones(D))
    state = core.init(prior, M)
    # client 1's update is finite and would keep q proper, but its fit failed
    delta = GaussianNatural(jnp.array([[0.1] * D, [1e4] * D]), jnp.array([[-0.1] * D, [-1e3] * D]))
    return state, delta


def test_accepts():
    residual = jnp.array([0.01, 99.0, 101.0, jnp.inf, jnp.nan])
    assert core.accepts(residual, FAILED_FIT_RESIDUAL).tolist() == [True, True, False, False, False]
    assert core.accepts(residual, None).tolist() == [True] * 5  # private runs: the residual decides nothing


@pytest.mark.parametrize("residual", [jnp.inf, 1e4])
def test_a_failed_fit_is_not_applied_in_a_visit(residual):
    state, delta = _setup()
    stub = _Stub(delta, jnp.array([0.01, residual]))
    visit = core.build_visit(max_residual=FAILED_FIT_RESIDUAL)
    key = jax.random.PRNGKey(0)
    state, (rejected, *_) = visit(state, 0, key, stub)
    after_first = state.q
    state, (rejected, *_) = visit(state, 1, key, stub)
    np.testing.assert_array_equal(state.q.eta1, after_first.eta1)  # q stays
    np.testing.assert_array_equal(state.factors.eta1[1], 0.0)  # so does the server's record of the factor
    assert not state.applied[1].any() and state.applied[0].all()  # the client is told none was applied
    assert int(rejected) == D
    # without the gate (private runs) the update is applied
    plain, _ = core.build_visit()(core.init(state.prior, M), 1, key, stub)
    assert np.all(plain.q.eta1 == 1e4)


def test_a_failed_fit_is_not_applied_in_a_synchronous_round():
    state, delta = _setup()
    config = SimpleNamespace(num_mc_samples=2)  # what the server's side of a round reads of it
    step = core.build_step(config, num_clients=M, schedule="synchronous", max_residual=FAILED_FIT_RESIDUAL)
    stub = _Stub(delta, jnp.array([0.01, jnp.inf]))
    new, info = step(jax.random.PRNGKey(0), state, stub)
    np.testing.assert_allclose(new.q.eta1, state.q.eta1 + 0.1)  # client 0's update alone
    assert new.applied[0].all() and not new.applied[1].any()
    np.testing.assert_array_equal(new.factors.eta1[1], 0.0)
    assert int(info.rejected) == D
