"""Who proposes switching times: the clients' functions and the server's view of them.

A *client function* takes what the server sends (the position ``x`` and, for a slope, the
velocity ``v``) and that client's own data block, and returns what the client sends back (its
gradient, or its gradient and slope). :func:`in_process_proposers` is the in-process
transport: it runs every client's function under ``vmap`` over the stacked blocks and gives
the server the :class:`Proposers` it works with. A transport that runs clients elsewhere
builds the same :class:`Proposers` from the same :class:`ClientFunctions`.

Proposer ``j``'s term is ``T_j(x) + w_j U_0(x)``: its own term (a client's potential; zero
for the server) plus a share ``w_j`` of the prior ``U_0`` (the weights sum to one, so the
proposers' terms always add up to the potential).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
    "PRIOR_MODES",
    "ClientFunctions",
    "Proposers",
    "client_functions",
    "federation_proposers",
    "in_process_proposers",
    "initial_prior_weights",
    "proposers_from_potential",
]

#: where the prior's term goes: its own proposer on the server, shared evenly among the
#: clients, or shared at random and redrawn over time (Remark 3.2 and Appendix D)
PRIOR_MODES = ("server", "clients", "redistribute")


class ClientFunctions(NamedTuple):
    """What one client computes from its own rows and what the server sends.

    :ivar grad: ``(x, block) -> (d,)``: the gradient of the client's potential at ``x``.
    :ivar grad_and_slope: ``(x, v, block) -> ((d,), (d,))``: the gradient and its derivative
        along ``v`` (a Hessian-vector product).
    :ivar prior_grad_and_slope: ``(x, v) -> ((d,), (d,))``: the same for the prior's potential
        ``U_0``, computed by the server (it holds no rows).
    """

    grad: Callable
    grad_and_slope: Callable
    prior_grad_and_slope: Callable


class Proposers(NamedTuple):
    """The proposers' terms, as the server sees them: pure functions of the flat position.

    :ivar term_grads_and_slopes: ``(x, v) -> ((P, d), (P, d))``: gradients of the own terms
        and their derivatives along ``v`` (Hessian-vector products).
    :ivar term_grads: ``x -> (P, d)``: the gradients alone.
    :ivar term_grad_of: ``(x, j) -> (d,)``: the gradient of proposer ``j``'s own term alone
        (the winner's check: only that proposer evaluates).
    :ivar prior_grad_and_slope: ``(x, v) -> ((d,), (d,))`` for ``U_0``.
    :ivar int num: ``P``.
    :ivar term_grad_estimate: ``(x, j, key, reference, coordinate) -> (d,)``: an estimate
        of proposer ``j``'s own-term gradient from a random batch of its rows around the
        control variates' reference, unbiased in entry ``coordinate`` (the rows may be drawn
        for that coordinate) (``FedZigZag(subsample_size=...)``, see
        :mod:`~numpyro_fed.infer.zigzag.subsample`); ``None``: the winner's check evaluates
        :attr:`term_grad_of` on all its rows.
    """

    term_grads_and_slopes: Callable
    term_grads: Callable
    term_grad_of: Callable
    prior_grad_and_slope: Callable
    num: int
    term_grad_estimate: Callable | None = None


def client_functions(potential) -> ClientFunctions:
    """The client functions of a :class:`~numpyro_fed.FederatedPotential` on the flat
    unconstrained vector (see :meth:`~numpyro_fed.FederatedPotential.ravel`).

    **Example**

    >>> import jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> import numpyro_fed as nf
    >>> from numpyro_fed.infer.zigzag import client_functions
    >>> def model(y):
    ...     mu = numpyro.sample("mu", dist.Normal(0, 1))
    ...     with nf.federated_plate("data", 4, clients=2):
    ...         numpyro.sample("y", dist.Normal(mu, 1), obs=y)
    >>> potential = nf.split_potential(model, (jnp.arange(4.0),))
    >>> clients = client_functions(potential)
    >>> block = jax.tree.map(lambda a: a[1], potential.client_data)  # client 1's rows: y = 2, 3
    >>> float(clients.grad(jnp.zeros(1), block)[0])  # d/dmu of sum (y - mu)^2 / 2 at mu = 0
    -5.0
    """

    flat = potential.flat()
    grad = jax.grad(flat.client_potential)
    prior_grad = jax.grad(flat.prior_potential)

    def grad_and_slope(x, v, block):
        return jax.jvp(lambda f: grad(f, block), (x,), (v,))

    def prior_grad_and_slope(x, v):
        return jax.jvp(prior_grad, (x,), (v,))

    return ClientFunctions(grad, grad_and_slope, prior_grad_and_slope)


def in_process_proposers(
    clients: ClientFunctions, data: Any, num_clients: int, *, prior: str = "server"
) -> tuple[Proposers, jax.Array]:
    """The server's :class:`Proposers` when every client runs in this process (``vmap`` over
    the stacked data blocks), and the initial prior weights ``(P,)``.

    :param clients: the :class:`ClientFunctions`.
    :param data: the clients' stacked data blocks (leading axis ``num_clients``).
    :param str prior: one of :data:`PRIOR_MODES`: ``"server"`` adds a proposer (index ``M``)
        holding the whole prior; otherwise each client's term carries a share of it.
    """
    if prior not in PRIOR_MODES:
        raise ValueError(f"prior must be one of {PRIOR_MODES}, got {prior!r}")
    on_server = prior == "server"

    def with_server_row(values):
        # the server's own term is zero: it proposes from the prior alone
        return jnp.concatenate([values, jnp.zeros_like(values[:1])]) if on_server else values

    def term_grads_and_slopes(x, v):
        grads, slopes = jax.vmap(lambda block: clients.grad_and_slope(x, v, block))(data)
        return with_server_row(grads), with_server_row(slopes)

    def term_grads(x):
        return with_server_row(jax.vmap(lambda block: clients.grad(x, block))(data))

    def term_grad_of(x, j):
        block = jax.tree.map(
            lambda a: lax.dynamic_index_in_dim(a, jnp.minimum(j, num_clients - 1), keepdims=False), data
        )
        if not on_server:
            return clients.grad(x, block)
        return lax.cond(j == num_clients, lambda: jnp.zeros_like(x), lambda: clients.grad(x, block))

    weights = initial_prior_weights(num_clients, prior)
    proposers = Proposers(
        term_grads_and_slopes, term_grads, term_grad_of, clients.prior_grad_and_slope, weights.shape[0]
    )
    return proposers, weights


def initial_prior_weights(num_clients: int, prior: str = "server") -> jax.Array:
    """The proposers' initial shares of the prior, ``(P,)``: all of it to the server's own
    proposer (index ``M``) for ``prior="server"``, else an even share per client.

    >>> initial_prior_weights(2).tolist(), initial_prior_weights(2, "clients").tolist()
    ([0.0, 0.0, 1.0], [0.5, 0.5])
    """
    if prior not in PRIOR_MODES:
        raise ValueError(f"prior must be one of {PRIOR_MODES}, got {prior!r}")
    on_server = prior == "server"
    num = num_clients + on_server
    return jnp.zeros(num).at[-1].set(1.0) if on_server else jnp.full(num, 1.0 / num)


#: the clients' calls the server's thinning makes (``FedZigZag(thinning="server")``): a client's
#: gradient, and its gradient and slope, at the point the server sends
TERM_CALLS = ("grad", "grad_and_slope")


def term_functions(clients: ClientFunctions) -> dict:
    """The clients' :data:`TERM_CALLS`, ``name -> f(block, *args)``, for the
    :class:`~numpyro_fed.federation.ClientProgram`."""
    return {
        "grad": lambda block, x: clients.grad(x, block),
        "grad_and_slope": lambda block, x, v: clients.grad_and_slope(x, v, block),
    }


def federation_proposers(federation, prior_grad_and_slope, num_clients: int, *, prior: str = "server") -> Proposers:
    """The server's :class:`Proposers` whose own terms are the clients', reached through
    ``federation`` (started on a program with the :func:`term_functions`): the line bounds
    ask every client (``federation.map``), the winner's check asks the winner alone
    (``federation.one``). On :class:`~numpyro_fed.federation.InProcess` this is a ``vmap``
    over the stacked blocks inside the server's compiled program (what
    :func:`in_process_proposers` computes, the same arithmetic).

    :param prior_grad_and_slope: the server's ``(x, v) -> (grad, slope)`` of the prior.
    :param str prior: one of :data:`PRIOR_MODES` (as for :func:`in_process_proposers`).
    """
    on_server = prior == "server"

    def with_server_row(values):
        return jnp.concatenate([values, jnp.zeros_like(values[:1])]) if on_server else values

    def term_grads_and_slopes(x, v):
        grads, slopes = federation.map("grad_and_slope", x, v)
        return with_server_row(grads), with_server_row(slopes)

    def term_grads(x):
        return with_server_row(federation.map("grad", x))

    def term_grad_of(x, j):
        client = jnp.minimum(j, num_clients - 1)
        if not on_server:
            return federation.one("grad", client, x)
        return lax.cond(j == num_clients, lambda: jnp.zeros_like(x), lambda: federation.one("grad", client, x))

    return Proposers(term_grads_and_slopes, term_grads, term_grad_of, prior_grad_and_slope, num_clients + on_server)


def proposers_from_potential(potential, *, prior: str = "server") -> tuple[Proposers, jax.Array]:
    """The in-process :class:`Proposers` of a :class:`~numpyro_fed.FederatedPotential` and
    their initial prior weights.

    :param str prior: ``"server"``: the prior is an extra proposer held by the server
        (index ``M``); ``"clients"``: each client's term carries ``prior / M``;
        ``"redistribute"``: each client's term carries a random share of the prior,
        redrawn over time (Appendix D).
    :return: ``(proposers, prior_weights)``.

    **Example**

    >>> import jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> import numpyro_fed as nf
    >>> from numpyro_fed.infer.zigzag import proposers_from_potential
    >>> def model(y):
    ...     mu = numpyro.sample("mu", dist.Normal(0, 1))
    ...     with nf.federated_plate("data", 4, clients=2):
    ...         numpyro.sample("y", dist.Normal(mu, 1), obs=y)
    >>> proposers, weights = proposers_from_potential(nf.split_potential(model, (jnp.arange(4.0),)))
    >>> proposers.num, weights.tolist()  # two clients and the server's prior
    (3, [0.0, 0.0, 1.0])
    >>> proposers.term_grads(jnp.zeros(1))[:, 0].tolist()
    [-1.0, -5.0, 0.0]
    """
    return in_process_proposers(client_functions(potential), potential.client_data, potential.num_clients, prior=prior)
