"""FedZigZag's set-up through a federation: the mode search, the control variates' reference
and a Laplace preconditioner, with the clients reached only by named calls.

With a federation (:class:`~numpyro_fed.federation.InProcess`,
:class:`~numpyro_fed.RayFederation`, with or without ``loader=``) the server never evaluates a
client's term itself: it asks. Two calls, both of the flat unconstrained point ``x`` (``d``
numbers down per client and call):

* ``"value_and_grad"``: the client's potential and its gradient there (``d + 1`` numbers up).
  The mode search's BFGS minimises ``prior(x) + sum(federation.map("value_and_grad", x))``
  (one call per evaluation; its gradient is the sum of the replies), the control variates
  take the clients' gradients at the reference point from one call, and the warmup's
  re-centering and its end-of-warmup comparison use the same call.
* ``"hessian"``: the client's ``d x d`` Hessian there (``d^2`` numbers up): the mode
  search's test (one call per Newton check), a Laplace preconditioner (one call at the mode)
  and second-order control variates (one call at the reference).

The federation counts these calls as they run (its message ledger; an engine backend from the
real payloads), and :meth:`FedZigZag.message_ledger
<numpyro_fed.infer.zigzag.FedZigZag.message_ledger>` reports them.
"""

from __future__ import annotations

import contextlib
from functools import partial

import jax
import jax.numpy as jnp

from numpyro_fed.infer.zigzag.control_variates import ControlVariates
from numpyro_fed.infer.zigzag.proposers import Proposers

__all__ = ["SETUP_CALLS", "ClientTerms", "federated_reference", "setup_functions"]

#: the names of the set-up calls in the clients' program (and in the message ledger);
#: ``"row_curvature"`` (first order) and the stateful ``"row_remainders"`` (second order, the
#: clients' thinning) only with ``FedZigZag(subsample_size=...)``
SETUP_CALLS = ("value_and_grad", "hessian", "row_curvature", "row_remainders")
#: points the ``"row_curvature"`` call sends (see :mod:`~numpyro_fed.infer.zigzag.subsample`)
ROW_CURVATURE_POINTS = 10


def _value_and_grad(client_potential, block, x):
    return jax.value_and_grad(client_potential)(x, block)


def _hessian(client_potential, block, x):
    hessian = jax.hessian(client_potential)(x, block)
    return (hessian + hessian.T) / 2


def setup_functions(client_potential) -> dict:
    """The clients' set-up functions, ``name -> f(block, x)``, for the
    :class:`~numpyro_fed.federation.ClientProgram` (see the module's docstring).

    :param client_potential: ``(x, block) -> scalar``, a client's term on the flat vector
        (:attr:`FlatPotential.client_potential <numpyro_fed.potential.FlatPotential>`).
    """
    return {
        "value_and_grad": partial(_value_and_grad, client_potential),
        "hessian": partial(_hessian, client_potential),
    }


class ClientTerms:
    """The clients' terms as the server reaches them: through ``federation`` only.

    :param federation: a started federation whose program has the :func:`setup_functions`.
    :param prior_potential: ``x -> scalar``, the server's own term.
    :param int num_clients: ``M``. :param bool prior_on_server: the prior proposes on its own
        (a proposer with a zero own term after the clients').
    """

    def __init__(self, federation, prior_potential, num_clients: int, prior_on_server: bool):
        self.federation = federation
        self.prior_potential = prior_potential
        self.num_clients = int(num_clients)
        self.prior_on_server = bool(prior_on_server)
        federation_ = federation
        prior = prior_potential

        @jax.custom_jvp
        def potential(x):
            values, _ = federation_.map("value_and_grad", x)
            return prior(x) + values.sum()

        @potential.defjvp
        def potential_jvp(primals, tangents):
            (x,), (t,) = primals, tangents
            # one call gives the value and the gradient: the tangent is linear in t
            values, grads = federation_.map("value_and_grad", x)
            prior_value, prior_grad = jax.value_and_grad(prior)(x)
            return prior_value + values.sum(), (prior_grad + grads.sum(0)) @ t

        #: ``x -> prior(x) + sum_m U_m(x)``, differentiable (one ``"value_and_grad"`` call per
        #: value, or per value and gradient)
        self.potential = potential

    @contextlib.contextmanager
    def counted_evaluations(self):
        """A loop of :attr:`potential`'s evaluations traced and run under this counts them
        itself: it yields ``count(evaluations)``, one ``"value_and_grad"`` call per client
        each (see :meth:`Federation.counted_by_caller
        <numpyro_fed.federation.Federation.counted_by_caller>`)."""
        with self.federation.counted_by_caller() as count:
            yield lambda evaluations: count("value_and_grad", evaluations)

    def hessian(self, x):
        """The potential's Hessian at ``x``: the prior's (on the server) plus the clients'
        (one ``"hessian"`` call)."""
        hessians = self.federation.map("hessian", x)
        return jax.hessian(self.prior_potential)(x) + hessians.sum(0)

    def _with_server_row(self, values):
        return jnp.concatenate([values, jnp.zeros_like(values[:1])]) if self.prior_on_server else values

    def proposers(self, prior_grad_and_slope) -> Proposers:
        """The server's :class:`~numpyro_fed.infer.zigzag.Proposers` whose own terms are the
        clients' (through ``"value_and_grad"`` and ``"hessian"`` calls): what the control
        variates' reference and the warmup's comparison need. ``prior_grad_and_slope`` is the
        server's ``(x, v) -> (grad, slope)`` of the prior."""

        def term_grads(x):
            return self._with_server_row(self.federation.map("value_and_grad", x)[1])

        def term_grads_and_slopes(x, v):
            return term_grads(x), self._with_server_row(self.federation.map("hessian", x) @ v)

        def term_grad_of(x, j):
            return term_grads(x)[j]

        num = self.num_clients + self.prior_on_server
        return Proposers(term_grads_and_slopes, term_grads, term_grad_of, prior_grad_and_slope, num)


def federated_reference(
    terms: ClientTerms, prior_grad_and_slope, point, *, order: int = 1, preconditioner=None
) -> ControlVariates:
    """:class:`~numpyro_fed.infer.zigzag.ControlVariates` at ``point`` (in the space the
    process moves in) from one ``"value_and_grad"`` call (and, with ``order=2``, one
    ``"hessian"`` call): what :func:`~numpyro_fed.infer.zigzag.control_variate_reference`
    computes from the pooled blocks, to round-off.

    :param prior_grad_and_slope: the server's prior, in the process's space (preconditioned
        when ``preconditioner`` is given).
    """
    if order not in (1, 2):
        raise ValueError(f"order must be 1 or 2, got {order!r}")
    point = jnp.asarray(point)
    x = point if preconditioner is None else preconditioner.to_x(point)
    pull = (lambda rows: rows) if preconditioner is None else preconditioner.pull_back
    prior_grad = prior_grad_and_slope(point, jnp.zeros_like(point))[0]
    term_grads = terms._with_server_row(pull(terms.federation.map("value_and_grad", x)[1]))
    if order == 1:
        return ControlVariates(point, term_grads, prior_grad)
    hessians = terms.federation.map("hessian", x)
    # S^T H S for every client (H symmetric): pull the rows, then the columns
    hessians = pull(jnp.swapaxes(pull(hessians), -1, -2))
    term_hessians = terms._with_server_row((hessians + jnp.swapaxes(hessians, 1, 2)) / 2)
    basis = jnp.eye(point.shape[0], dtype=point.dtype)
    prior_hessian = jax.vmap(lambda e: prior_grad_and_slope(point, e)[1], out_axes=1)(basis)
    prior_hessian = (prior_hessian + prior_hessian.T) / 2
    return ControlVariates(point, term_grads, prior_grad, term_hessians, prior_hessian)
