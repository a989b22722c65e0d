"""The cores of the DP-PVI paper's baselines, which run PVI's round (:mod:`~numpyro_fed.infer.pvi.core`)
with their own start and end: the Bayesian committee machine's initial factors and product of
the local posteriors (:class:`~numpyro_fed.BCM`), and global VI's one party holding the
pooled rows (:class:`~numpyro_fed.GlobalVI`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from numpyro_fed.infer.pvi import core
from numpyro_fed.infer.pvi.gaussian import GaussianNatural

__all__ = ["committee_init", "committee_posterior", "pooled_client_data"]


def committee_init(
    prior: GaussianNatural, num_clients: int, prior_share: str = "same", *, federation=None
) -> core.PVIState:
    """BCM's initial state: with ``prior_share="same"`` every client fits its local posterior
    from the prior (factors zero); with ``"split"`` from ``p^(1/M)``, its factor starting at
    ``(1 - 1/M) eta_prior`` (public values). ``federation`` as :func:`~numpyro_fed.infer.pvi.core.init`'s."""
    share = None
    if prior_share == "split":
        # factors (1 - 1/M) eta_prior make every cavity p^(1/M)
        share = jax.tree_util.tree_map(
            lambda x: jnp.broadcast_to((1.0 - 1.0 / num_clients) * x, (num_clients,) + x.shape), prior
        )
    return core.init(prior, num_clients, factors=share, federation=federation)


def committee_posterior(state: core.PVIState) -> core.PVIState:
    """The committee's answer, ``q = prior * prod_m t_m``, from the server's record of the
    factors: the public initial ones plus the local posteriors' changes the clients sent (BCM's
    messages)."""
    q = jax.tree_util.tree_map(lambda p, f: p + f.sum(0), state.prior, state.factors)
    return state._replace(q=q)


def pooled_client_data(client_data: dict, layout: core.BlockLayout) -> core.ClientData:
    """One party holding every client's rows (global VI's trusted aggregator, emulated in one
    process), in PVI's layout: ``client_data`` as :attr:`FederatedPotential.client_data
    <numpyro_fed.FederatedPotential.client_data>`, ``layout`` the party's shards, noise
    multiplier and clip norms (leading axis of size one)."""
    valid = client_data["valid"][layout.plate]
    rows = [r.reshape((1, -1) + r.shape[2:]) for r in client_data["rows"]]
    as_jax = lambda a: None if a is None else jnp.asarray(a)  # noqa: E731
    return core.ClientData(
        rows=rows,
        valid=valid.reshape(1, -1),
        shard_index=as_jax(layout.shard_index),
        shard_valid=as_jax(layout.shard_valid),
        noise_multiplier=as_jax(layout.noise_multiplier),
        clip_first=as_jax(layout.clip_first),
        clip_later=as_jax(layout.clip_later),
    )
