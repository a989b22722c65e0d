"""PVI's loss, the negative ELBO of ``q``: on every client's rows in this process
(:func:`negative_elbo`) or through the clients, each computing its rows' term where it lives
(:func:`federated_negative_elbo`, :func:`build_loss`). A diagnostic of a run, not one of the
algorithm's messages, and no privacy guarantee covers it."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from numpyro_fed.infer.pvi.gaussian import GaussianNatural, entropy, kl_divergence, sample
from numpyro_fed.infer.pvi.layout import ClientData

__all__ = [
    "LOSS_STREAM",
    "build_loss",
    "draw_q",
    "expected_log_lik",
    "federated_negative_elbo",
    "loss_of_client_terms",
    "negative_elbo",
    "prior_side_of_loss",
]


def draw_q(rng_key, q: GaussianNatural, num_samples: int):
    """``(num_samples, d)`` draws of ``q``: what the server sends the clients for the loss."""
    return sample(rng_key, q, num_samples)


def prior_side_of_loss(q: GaussianNatural, prior: GaussianNatural, thetas, prior_potential):
    """``KL(q || prior)``, or with ``prior_potential`` (a non-Gaussian or improper prior)
    ``E_q[log q] - E_q[log p]`` up to a constant, estimated at the draws ``thetas``."""
    if prior_potential is None:
        return kl_divergence(q, prior)
    return jnp.mean(jax.vmap(prior_potential)(thetas)) - entropy(q)


def loss_of_client_terms(q: GaussianNatural, prior: GaussianNatural, thetas, prior_potential, terms, answered=None):
    """The negative ELBO of ``q`` from the clients' terms ``terms`` (``(M,)``, each client's
    :func:`expected_log_lik` at the draws ``thetas``); ``nan`` (unknown) unless every client
    ``answered`` (``(M,)`` bool; ``None``: all did)."""
    total = jnp.sum(terms)
    if answered is not None:
        total = jnp.where(jnp.all(answered), total, jnp.nan)
    return prior_side_of_loss(q, prior, thetas, prior_potential) - total


def expected_log_lik(row_log_lik: Callable, thetas, rows, valid):
    """One client's term of the loss: the sum over its valid rows of the Monte Carlo estimate
    of ``E_q[log p(x | theta)]`` at the draws ``thetas`` (``(S, d)``)."""
    per_draw = jax.vmap(row_log_lik, in_axes=(0, None))(thetas, rows)  # (S, R)
    return jnp.sum(jnp.where(valid, jnp.mean(per_draw, axis=0), 0.0))


def negative_elbo(
    rng_key,
    row_log_lik: Callable,
    q: GaussianNatural,
    prior: GaussianNatural,
    data: ClientData,
    num_samples: int,
    prior_potential: Callable | None = None,
):
    """``-ELBO(q) = KL(q || prior) - sum_m sum_i E_q[log p(x_{m,i} | theta)]``, the
    expectation estimated with ``num_samples`` draws of ``q`` shared by every client (with
    ``prior_potential``, the prior's potential, ``KL(q || prior)`` is estimated with them
    too, up to the constant an improper prior leaves).

    A diagnostic of the run computed on every client's rows in this process: it is not one of
    the messages the clients send, and no privacy guarantee covers it.
    """
    thetas = draw_q(rng_key, q, num_samples)
    client_log_lik = lambda rows, valid: expected_log_lik(row_log_lik, thetas, rows, valid)  # noqa: E731
    expected = jnp.sum(jax.vmap(client_log_lik)(data.rows, data.valid))
    return prior_side_of_loss(q, prior, thetas, prior_potential) - expected


#: ``jax.random.fold_in`` stream of a round's key that draws :func:`negative_elbo`'s samples
#: (the clients' keys are ``jax.random.split(rng_key, M)``).
LOSS_STREAM = 1


def federated_negative_elbo(
    rng_key,
    federation,
    q: GaussianNatural,
    prior: GaussianNatural,
    num_samples: int,
    prior_potential=None,
    clients=None,
    partial: bool = False,
):
    """:func:`negative_elbo` with every client's term computed by the client
    (``federation.map("expected_log_lik", thetas)``): the server draws ``thetas`` from ``q``
    and sends them; each client returns one number. With ``clients`` (the clients'
    :class:`~numpyro_fed.federation.ClientState`; clients that keep latents of their own,
    :mod:`~numpyro_fed.infer.pvi.local`) the call is stateful (the same message; the client
    draws its own latents with a key it keeps) and the result is ``(clients, loss)``.
    ``partial``: a client that does not answer leaves the loss ``nan`` (unknown) instead of
    stopping the run."""
    thetas = draw_q(rng_key, q, num_samples)
    state = {} if clients is None else {"state": clients}
    out = federation.map("expected_log_lik", thetas, partial=partial, **state)
    answered = None
    if partial:
        *out, answered = out
    else:
        out = (out,) if clients is None else out
    loss = loss_of_client_terms(q, prior, thetas, prior_potential, out[-1], answered)
    return loss if clients is None else (out[0], loss)


def build_loss(num_mc_samples: int, prior_potential: Callable | None = None, *, stateful: bool = False) -> Callable:
    """A pure ``loss(rng_key, q, prior, federation)``: :func:`federated_negative_elbo` with
    ``num_mc_samples`` draws (the loss of a face's ``evaluate``); ``prior_potential`` for a
    prior that ``prior`` does not hold whole (see :func:`negative_elbo`). ``stateful``
    (clients with latents of their own): ``loss(rng_key, q, prior, clients, federation)``."""

    def loss(rng_key, q: GaussianNatural, prior: GaussianNatural, *clients_and_federation):
        *clients, federation = clients_and_federation
        out = federated_negative_elbo(
            rng_key, federation, q, prior, num_mc_samples, prior_potential, clients[0] if stateful else None
        )
        return out[1] if stateful else out

    return loss
