"""Gaussian PVI with one scheduled client per round: the PVI baseline of the DSVGD paper
(Kassab & Simeone 2022), under the same variational face as every other method."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

import jax
import jax.numpy as jnp
import optax

from numpyro.infer.initialization import init_to_uniform

from numpyro_fed._checks import check_int, check_positive
from numpyro_fed.federation.base import check_min_clients, resolve_min_clients
from numpyro_fed.infer.base import ClientSpec, RunResult, VariationalMethod, jit_round
from numpyro_fed.infer.pvi import core
from numpyro_fed.infer.pvi.client import LocalConfig
from numpyro_fed.infer.pvi.diagnostics import FAILED_FIT_RESIDUAL
from numpyro_fed.infer.pvi.gaussian import loc_scale, sample
from numpyro_fed.infer.pvi.prior import build_prior_update, initial_state, prior_remainder, split_prior
from numpyro_fed.infer.stein.client_order import check_client_order, make_client_order

__all__ = ["GaussianPVI", "GaussianPVIInfo"]

_DEFAULT_NUM_SAMPLES = 1000


class GaussianPVIInfo(NamedTuple):
    """Diagnostics of one :class:`GaussianPVI` round.

    :ivar client: the scheduled client.
    :ivar rejected: coordinates of its update not applied (they would make ``q`` improper).
    :ivar residual: its local optimization's residual (see
        :func:`~numpyro_fed.infer.pvi.client.optimize_local`).
    :ivar loss: the negative ELBO of ``q`` after the round (``nan`` when a client did not
        answer its call, with ``min_clients``).
    :ivar participated: ``(M,)`` bool: the scheduled client, if its update was applied.
    """

    client: jax.Array
    rejected: jax.Array
    residual: jax.Array
    loss: jax.Array
    participated: jax.Array


class GaussianPVI(VariationalMethod):
    """Partitioned variational inference with a mean-field Gaussian, one scheduled client
    per round (the PVI baseline of the DSVGD paper; :class:`~numpyro_fed.DPPVI` visits every
    client per round).

    ``q = p_0 prod_k t_k`` with Gaussian factors on the flat unconstrained space; the
    scheduled client maximizes its local ELBO against the cavity ``q / t_k`` with ``optim``
    for ``num_local_steps`` steps
    (:func:`~numpyro_fed.infer.pvi.client.client_update`), and the server adds ``damping``
    times the change to ``q`` and to the client's factor
    (:func:`~numpyro_fed.infer.pvi.core.server_update`). A prior that is not a Gaussian
    with independent coordinates on the unconstrained space (a ``HalfCauchy`` scale, a flat
    ``ImproperUniform``) is a factor of its own, refined by the server at the start of each
    round with the same local update (:mod:`~numpyro_fed.infer.pvi.prior`).

    ``result.metrics`` holds per round ``client``, ``loss`` (the negative ELBO, see
    :meth:`evaluate`), ``loc`` and ``scale`` of ``q`` (``(num_rounds, d)``, flat),
    ``rejected``, ``residual`` and ``participated`` (``(num_rounds, M)`` bool: the scheduled
    client, if its update was applied); :meth:`log_density` evaluates ``q``.

    :param int num_local_steps: steps of the local optimization.
    :param optim: an optax optimizer (default ``adam(1e-2)``).
    :param int num_mc_samples: Monte Carlo draws of ``q`` per step.
    :param float damping: in ``(0, 1]``.
    :param client_order: ``"round_robin"``, ``"random"`` (a client drawn per round) or a
        sequence of client indices, one per round.
    :param partition: as :func:`~numpyro_fed.split_potential`.
    :param init_strategy: as :func:`~numpyro_fed.split_potential`.
    :param bool progress_bar: a progress bar over rounds.
    :param federation: where the clients run: ``None`` (in this process, the default) or a
        :class:`~numpyro_fed.federation.Federation` such as :class:`~numpyro_fed.RayFederation`.
        Per round the scheduled client receives ``q`` (and which coordinates of its last
        update were applied) and returns the change of its factor, which it keeps (its client
        state, :class:`~numpyro_fed.federation.ClientState`); see ``result.ledger``. With a
        federation given ``loader=`` (deployment) each client loads its own rows and the
        method is run without data arguments: ``GaussianPVI(model,
        federation=nf.InProcess(loader=load, num_clients=M)).run(rng_key, num_rounds)``.
    :param int min_clients: ``None`` (default): every client must answer; one that fails or
        times out stops the run with a :class:`~numpyro_fed.federation.ClientError` whose
        ``state`` resumes it. An int: a scheduled client that fails is skipped (``q`` and its
        factor stay as they were; ``participated`` records it) and rejoins at its next visit
        from its client state; the run stops with the ``ClientError`` only when fewer than
        ``min_clients`` clients are in (those whose last visit answered, or not visited yet).
        See the guide's *Nodes that drop out*.

    >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> import numpyro_fed as nf
    >>> def model(y):
    ...     mu = numpyro.sample("mu", dist.Normal(0, 1))
    ...     with nf.federated_plate("data", y.shape[0], clients=2):
    ...         numpyro.sample("y", dist.Normal(mu, 1), obs=y)
    >>> pvi = nf.GaussianPVI(model, num_local_steps=300, progress_bar=False)
    >>> result = pvi.run(jax.random.PRNGKey(0), 4, jnp.ones(8))
    >>> result.metrics["client"].tolist()
    [0, 1, 0, 1]
    >>> bool(abs(result.metrics["loc"][-1, 0] - 8 / 9) < 0.05)  # the exact posterior mean
    True
    """

    repr_fields = ("num_local_steps", "num_mc_samples", "damping", "client_order")
    divergence_advice = "lower the optimizer's learning rate (optim) or the damping"

    def __init__(
        self,
        model,
        *,
        num_local_steps: int = 200,
        optim=None,
        num_mc_samples: int = 10,
        damping: float = 1.0,
        client_order="round_robin",
        partition=None,
        init_strategy=init_to_uniform,
        progress_bar: bool = True,
        federation=None,
        min_clients: int | None = None,
    ):
        super().__init__(
            model, partition=partition, init_strategy=init_strategy, progress_bar=progress_bar, federation=federation
        )
        self.num_local_steps = check_int(num_local_steps, "num_local_steps", minimum=1)
        self.optim = optax.adam(1e-2) if optim is None else optim
        self.num_mc_samples = check_int(num_mc_samples, "num_mc_samples", minimum=1)
        self.damping = check_positive(damping, "damping")
        if self.damping > 1.0:
            raise ValueError(f"damping must lie in (0, 1], got {self.damping}")
        check_client_order(client_order)
        if not isinstance(client_order, str):
            order = np.asarray(client_order)
            if order.ndim != 1 or order.dtype == bool or not np.issubdtype(order.dtype, np.integer):
                raise ValueError(f"client_order must be a 1-d sequence of client indices, got {client_order!r}")
            client_order = tuple(int(m) for m in order)
        self.client_order = client_order
        self.min_clients = check_min_clients(min_clients)
        self._round_fn = self._data = None

    def plan_clients(self, rng_key, args, kwargs, *, num_rounds=None) -> ClientSpec:
        """Splits the model and returns what the clients run: PVI's client functions on their
        blocks in PVI's layout, built from their own rows where they live."""
        fp = self.build_potential(args, kwargs)
        plates = [p.name for p in fp.plates.values() if p.holds_data]
        if len(plates) != 1:
            raise ValueError(f"GaussianPVI needs a model with one federated data plate, found {plates}")
        if not isinstance(self.client_order, str):  # its clients checked now, its length per round
            make_client_order(self.client_order, len(self.client_order), fp.num_clients, None)
        flat = fp.flat()
        prior = split_prior(flat.prior_potential, fp.ravel(fp.init_params))
        shard_index, shard_valid = core.shard_layout(np.asarray(fp.client_sizes), 1)
        # each client builds its block in PVI's layout from its own rows, where it lives
        layout = core.BlockLayout(plates[0], shard_index, shard_valid, jnp.zeros(fp.num_clients, prior.base.eta1.dtype))
        config = LocalConfig(
            optim=self.optim,
            num_steps=self.num_local_steps,
            num_mc_samples=self.num_mc_samples,
            sampling="full",
            sampling_rate=1.0,
            dpsgd=False,
            clip_norm=1.0,
        )
        functions, stateful = core.client_functions(flat.row_log_likelihood, config, damping=self.damping)
        self._prior, self._config = prior, config
        return ClientSpec(functions, transform=layout, stateful=stateful)

    def init(self, rng_key, *args, **kwargs) -> core.PVIState:
        """Splits the model and returns the initial state (``q`` the prior)."""
        spec = self.plan_clients(rng_key, args, kwargs)
        self.start_clients(**spec._asdict())
        fp, prior, layout = self.federated_potential, self._prior, spec.transform
        self._data = layout
        prior_update = prior_potential = None
        if not prior.exact:
            prior_potential = fp.flat().prior_potential
            remainder = prior_remainder(prior_potential, prior.base)
            prior_update = build_prior_update(remainder, prior.refined, self._config, damping=self.damping)
        self._loss_fn = jit_round(core.build_loss(self.num_mc_samples, prior_potential))
        step = core.build_client_step(
            self.num_mc_samples,
            damping=self.damping,
            prior_update=prior_update,
            prior_potential=prior_potential,
            min_clients=resolve_min_clients(self.min_clients, fp.num_clients),
            max_residual=FAILED_FIT_RESIDUAL,
        )

        @jit_round
        def round_fn(rng_key, state, m, federation):
            state, info = step(rng_key, state, federation, m)
            return state, GaussianPVIInfo(m, info.rejected, info.residual, info.loss, info.participated)

        self._round_fn = round_fn
        return initial_state(prior, fp.num_clients, federation=self._active_federation)

    def client_of_round(self, rng_key, round_index: int) -> int:
        """The client that ``client_order`` schedules in round ``round_index`` (0-based;
        ``"random"`` draws it with ``rng_key``), by
        :func:`~numpyro_fed.infer.stein.client_order.make_client_order`."""
        num_clients = self.federated_potential.num_clients
        if self.client_order == "random":
            return int(make_client_order("random", 1, num_clients, rng_key)[0])
        return int(make_client_order(self.client_order, round_index + 1, num_clients, None)[round_index])

    def update(self, rng_key, state: core.PVIState, *args, **kwargs):
        """One round: the scheduled client's update and the server's. ``(state,
        GaussianPVIInfo)``; the data are those given to :meth:`init`."""
        if self._round_fn is None:
            raise ValueError("GaussianPVI: call init(rng_key, *args) (or run) first")
        key_client, key_round = jax.random.split(rng_key)
        client = self.client_of_round(key_client, int(state.round))
        federation = self._active_federation
        with federation.guard():
            return self._round_fn(key_round, state, jnp.asarray(client), federation)

    def record(self, state, info) -> dict:
        loc, scale = loc_scale(state.q)
        return dict(info._asdict(), loc=loc, scale=scale)

    def evaluate(self, state: core.PVIState, *args, rng_key=None, **kwargs):
        """The negative ELBO of ``q`` on the clients of :meth:`init` (``rng_key`` for its
        ``num_mc_samples`` draws, default ``PRNGKey(0)``), through the federation: each client
        returns its rows' term (``"expected_log_lik"``, counted in the ledger)."""
        if self._data is None:
            raise ValueError("GaussianPVI: call init(rng_key, *args) (or run) first")
        rng_key = jax.random.PRNGKey(0) if rng_key is None else rng_key
        federation = self._active_federation
        with federation.guard():
            return self._loss_fn(rng_key, state.q, state.prior, federation)

    def log_density(self, result: RunResult, particles) -> jax.Array:
        """``log q`` of the final Gaussian at ``(n, d)`` flat unconstrained points."""
        loc, scale = loc_scale(result.state.q)
        z = (jnp.asarray(particles) - loc) / scale
        return jnp.sum(-0.5 * z**2 - jnp.log(scale) - 0.5 * math.log(2 * math.pi), axis=-1)

    def get_samples(self, rng_key, result: RunResult, num_samples: int | None = None) -> dict:
        """Constrained draws of the final ``q`` by site (``None``: 1000)."""
        num_samples = _DEFAULT_NUM_SAMPLES if num_samples is None else check_int(num_samples, "num_samples", minimum=1)
        flat = sample(rng_key, result.state.q, num_samples)
        return jax.vmap(self.federated_potential.flat().postprocess)(flat)
