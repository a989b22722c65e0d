"""Partitioned variational inference with a mean-field Gaussian under DSVGD's interface (the
DSVGD paper's PVI baseline), an adapter over :mod:`numpyro_fed.infer.pvi`."""

from __future__ import annotations

import math

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from numpyro.infer.initialization import init_to_uniform

from numpyro_fed._checks import check_int, check_positive
from numpyro_fed.infer.stein.client_order import check_client_order, make_client_order
from numpyro_fed.infer.base import RunResult, run_rounds
from numpyro_fed.infer.stein.face import ParticleMethod
from numpyro_fed.infer.stein.model import data_plate

__all__ = ["GaussianPVI"]


class GaussianPVI(ParticleMethod):
    """Partitioned variational inference with a mean-field Gaussian (the paper's PVI
    baseline) under the interface of :class:`~numpyro_fed.DSVGD`: one scheduled client per round.

    ``q = p_0 prod_k t_k`` with Gaussian factors on the flat unconstrained space; the
    scheduled client maximizes its local ELBO against the cavity ``q / t_k`` with ``optim`` for
    ``num_local_steps`` steps, and the server adds ``damping`` times the change to ``q`` and to
    the client's factor. The model's prior must be a Gaussian with independent coordinates on
    the unconstrained space (e.g. ``Normal`` priors): a ``ValueError`` says so otherwise.

    The "particles" of each round, which the metrics see and :meth:`get_samples` draws from
    with ``num_samples=None``, are ``num_particles`` draws of ``q`` made with the same standard
    normal noise every round (common random numbers). ``result.metrics`` also holds ``loc``
    and ``scale`` of ``q`` after each round (``(num_rounds, d)``); :meth:`log_density`
    evaluates ``q``.

    :param int num_particles: draws of ``q`` reported per round.
    :param int num_local_steps: steps of the local optimization.
    :param optim: an optax optimizer (default ``adam(1e-2)``).
    :param int num_mc_samples: Monte Carlo draws of ``q`` per step.
    :param float damping: in ``(0, 1]``.
    :param client_order: as :class:`~numpyro_fed.DSVGD`.
    """

    repr_fields = ("num_particles", "num_local_steps", "num_mc_samples", "damping", "client_order")
    divergence_advice = "lower the optimizer's learning rate or damping"

    def __init__(self, model, *, num_particles: int = 20, num_local_steps: int = 200, optim=None,
                 num_mc_samples: int = 10, damping: float = 1.0, client_order="round_robin",
                 metrics=None, partition=None, init_strategy=init_to_uniform,
                 progress_bar: bool = True):
        super().__init__(model, num_particles=num_particles, metrics=metrics, partition=partition,
                         init_strategy=init_strategy, progress_bar=progress_bar, temperature=1.0)
        import optax

        self.num_local_steps = check_int(num_local_steps, "num_local_steps", minimum=1)
        self.optim = optax.adam(1e-2) if optim is None else optim
        self.num_mc_samples = check_int(num_mc_samples, "num_mc_samples", minimum=1)
        self.damping = check_positive(damping, "damping")
        if self.damping > 1.0:
            raise ValueError(f"damping must lie in (0, 1], got {self.damping}")
        self.client_order = check_client_order(client_order)

    def run(self, rng_key, num_rounds: int, *args, **kwargs):
        """Runs ``num_rounds`` rounds; ``result.state`` is the final
        :class:`~numpyro_fed.infer.pvi.PVIState`."""
        from numpyro_fed.infer import pvi

        num_rounds = check_int(num_rounds, "num_rounds", minimum=1)
        k_draws, k_order, k_rounds = jax.random.split(rng_key, 3)
        fp = self._setup(args, kwargs)
        plate = data_plate(fp, "GaussianPVI")
        unravel, d = fp.unravel, fp.num_latent
        prior = pvi.gaussian_prior(lambda x: fp.prior_potential_fn(unravel(x)), d)
        order = make_client_order(self.client_order, num_rounds, fp.num_clients, k_order, None)
        sizes = np.asarray(fp.client_sizes)
        shard_index, shard_valid = pvi.shard_layout(sizes, 1)
        data = pvi.ClientData(rows=fp.client_data["rows"], valid=fp.client_data["valid"][plate],
                              shard_index=shard_index, shard_valid=shard_valid)
        config = pvi.LocalConfig(optim=self.optim, num_steps=self.num_local_steps,
                                 num_mc_samples=self.num_mc_samples, sampling="full",
                                 sampling_rate=1.0, dpsgd=False, clip_norm=1.0)

        def row_log_lik(theta, rows):
            return fp.row_log_likelihood_fn(unravel(theta), rows)

        def one(tree, m):
            return jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, m, 1), tree)

        visit = pvi.build_round(row_log_lik, one(data, 0), config, dp=None,
                                schedule="sequential", damping=self.damping)

        @jax.jit
        def round_fn(state, key, m, data):  # PVI's round over the one scheduled client
            mine = state._replace(factors=one(state.factors, m), virtual=one(state.virtual, m))
            new, _ = visit(key, mine, one(data, m))

            def put(all_, new_):
                return jax.tree.map(lambda a, b: lax.dynamic_update_slice_in_dim(a, b, m, 0), all_, new_)

            return new._replace(factors=put(state.factors, new.factors), virtual=put(state.virtual, new.virtual))

        self._eps = jax.random.normal(k_draws, (self.num_particles, d))
        state = pvi.init(prior, fp.num_clients)
        self._initial_particles = self.particles(state)

        def update(key, state_and_round):
            state, i = state_and_round
            state = round_fn(state, key, jnp.asarray(order[i]), data)
            loc, scale = pvi.loc_scale(state.q)
            return (state, i + 1), {"client": order[i], "loc": loc, "scale": scale}

        def record(state_and_round, info):
            return {**info, **ParticleMethod.record(self, state_and_round[0], None)}

        (state, _), metrics = run_rounds(
            update, k_rounds, (state, 0), num_rounds, record=record,
            is_finite=lambda s: bool(jnp.all(jnp.isfinite(self.particles(s[0])))),
            progress_bar=self.progress_bar, desc=type(self).__name__,
            divergence_advice=self.divergence_advice,
        )
        return RunResult(state, metrics, None, self)

    def particles(self, state):
        from numpyro_fed.infer import pvi

        loc, scale = pvi.loc_scale(state.q)
        return loc + scale * self._eps

    def log_density(self, result, particles) -> jax.Array:
        """``log q`` of the final Gaussian at ``(M, d)`` flat unconstrained points."""
        from numpyro_fed.infer import pvi

        loc, scale = pvi.loc_scale(result.state.q)
        z = (jnp.asarray(particles) - loc) / scale
        return jnp.sum(-0.5 * z**2 - jnp.log(scale) - 0.5 * math.log(2 * math.pi), axis=-1)

    def get_samples(self, rng_key, result, num_samples: int | None = None) -> dict:
        """Constrained draws of the final ``q`` (``None``: the reported particles)."""
        from numpyro_fed.infer import pvi

        if num_samples is None:
            return self.constrained(self.particles(result.state))
        num_samples = check_int(num_samples, "num_samples", minimum=1)
        loc, scale = pvi.loc_scale(result.state.q)
        return self.constrained(loc + scale * jax.random.normal(rng_key, (num_samples, loc.shape[0]), loc.dtype))
