"""DP-PVI: differentially private partitioned variational inference (Heikkilä et al. 2023)
with an SVI-like face, on top of :func:`~numpyro_fed.split_potential`.

:class:`DPPVI` runs PVI (``dp=None``) or one of its private variants (``"dpsgd"``,
``"local_avg"``, ``"virtual"``; see :mod:`numpyro_fed.infer.pvi` for the mathematics),
accounts the privacy of the whole run with ``dp-accounting`` and, given a
``target_epsilon``, calibrates the noise so that the run spends at most that budget.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

import jax
import jax.numpy as jnp

import optax

from numpyro_fed._checks import check_int, check_positive, check_real
from numpyro_fed.arviz import federation_attrs, register_converter
from numpyro_fed.infer import pvi as core
from numpyro_fed.potential import split_potential
from numpyro_fed.privacy.accounting import (
    calibrate_noise_multiplier,
    check_delta,
    check_epsilon,
    check_sampling_rate,
    compute_epsilon,
    dpsgd_event,
    gaussian_event,
    privacy_guarantee,
)
from numpyro_fed.privacy.guarantee import PrivacyGuarantee

__all__ = ["BCM", "DPPVI", "DPPVIRunResult", "GlobalVI"]


# Share of delta that covers capping Poisson batches (see DPPVI._batch_cap).
_CAP_DELTA_SHARE = 1e-6


class DPPVIRunResult(NamedTuple):
    """What :meth:`DPPVI.run` returns.

    :ivar dict params: ``{"loc": ..., "scale": ...}`` of the final ``q`` on the unconstrained
        space, each shaped like the model's latent values (dict by site).
    :ivar state: the final :class:`~numpyro_fed.infer.pvi.PVIState` (natural parameters of
        ``q``, the prior and every client factor).
    :ivar dict metrics: per round: ``loc`` and ``scale`` of ``q`` after the round
        (``(num_rounds, d)``, flat), ``rejected`` (coordinates of server updates not
        applied: they would have made ``q`` improper), ``clipped`` (per client, fraction of clipped terms) and
        ``communications`` (server-client exchanges so far).
    :ivar privacy: the :class:`~numpyro_fed.privacy.PrivacyGuarantee` of the run (``None``
        for ``dp=None``).
    :ivar noise_multiplier: ``(M,)`` noise standard deviation over the clip norm used by each
        client (zeros for ``dp=None``).
    """

    params: dict
    state: core.PVIState
    metrics: dict
    privacy: PrivacyGuarantee | None
    noise_multiplier: np.ndarray


class DPPVI:
    """Differentially private partitioned variational inference.

    A mean-field Gaussian on the unconstrained latents, one factor per client, local ELBOs
    against the cavity optimised with ``optim``; ``dp`` picks the privacy mechanism.

    :param model: a NumPyro model with one :func:`~numpyro_fed.federated_plate` over the data
        rows, global latent variables only and a Gaussian prior on the unconstrained space
        (e.g. ``Normal`` priors).
    :param dp: ``None`` (non-private PVI), ``"dpsgd"`` (DP-SGD in the local optimisation,
        Section 4.1), ``"local_avg"`` (Algorithm 2) or ``"virtual"`` (Algorithm 3).
    :param str schedule: ``"sequential"`` or ``"synchronous"``.
    :param optim: an optax optimiser for the local optimisation (default ``adam(1e-2)``).
    :param int num_local_steps: local optimisation steps per client update.
    :param int num_mc_samples: Monte Carlo draws of ``q`` per step.
    :param float damping: ``rho`` in ``(0, 1]``: the server adds ``rho * Delta``.
    :param str sampling: minibatches of the local optimisation: ``"full"``, ``"poisson"``
        (rate ``sampling_rate``, accounted with PLD) or ``"without_replacement"``
        (``round(sampling_rate * n_m)`` rows, accounted with RDP).
    :param float sampling_rate: in ``(0, 1]``; required unless ``sampling="full"``.
    :param float clip_norm: ``C``: bound on each per-example gradient (``"dpsgd"``) or each
        shard's change of natural parameters (``"local_avg"``, ``"virtual"``).
    :param noise_multiplier: noise standard deviation over ``C``; or give ``target_epsilon``.
        ``0`` clips without noise: no privacy (``result.privacy`` is ``None``), for
        studying the effect of clipping and sharding alone.
    :param float target_epsilon: the run spends at most this. Alone, it calibrates the noise
        for the given number of rounds; with ``noise_multiplier`` too, it calibrates the
        number of rounds instead: ``run(rng_key, None, ...)`` runs the most rounds whose
        privacy cost stays within the target (see :meth:`max_rounds`).
    :param float delta: the run's delta.
    :param int num_shards: ``K``: shards (local averaging) or virtual clients per client.
    :param bool trusted_aggregator: the clients' updates are summed by a trusted aggregator
        (synchronous schedule, ``"local_avg"``/``"virtual"``): each client's noise is divided
        by ``sqrt(M)`` (Theorems 11, 14) and the guarantee covers the aggregate.
    :param str accountant: ``"pld"``, ``"rdp"`` or ``None`` (PLD unless sampling without
        replacement).
    :param str neighbouring: ``"replace_one"`` (the paper's) or ``"add_remove"``.
    :param bool progress_bar: a progress bar over rounds.

    **Example**

    .. doctest::

        >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist, optax
        >>> import numpyro_fed as nf
        >>> def model(X, y=None):
        ...     w = numpyro.sample("w", dist.Normal(0, 1).expand([2]).to_event(1))
        ...     with nf.federated_plate("data", X.shape[0], clients=4):
        ...         numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)
        >>> X = jax.random.normal(jax.random.PRNGKey(0), (400, 2))
        >>> y = (X @ jnp.array([1.5, -1.0]) > 0) * 1.0
        >>> pvi = nf.DPPVI(model, dp="dpsgd", target_epsilon=1.0, delta=1e-5,
        ...                sampling="poisson", sampling_rate=0.1, clip_norm=2.0,
        ...                optim=optax.adam(5e-2), num_local_steps=20, damping=0.5,
        ...                progress_bar=False)
        >>> result = pvi.run(jax.random.PRNGKey(1), 3, X, y)
        >>> result.privacy.epsilon <= 1.0
        True
        >>> draws = pvi.get_samples(jax.random.PRNGKey(2), result, 100)
        >>> draws["w"].shape
        (100, 2)
    """

    def __init__(
        self,
        model,
        *,
        dp: str | None = None,
        schedule: str = "sequential",
        optim=None,
        num_local_steps: int = 100,
        num_mc_samples: int = 10,
        damping: float = 1.0,
        sampling: str = "full",
        sampling_rate: float | None = None,
        clip_norm: float = 1.0,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        delta: float = 1e-5,
        num_shards: int = 1,
        trusted_aggregator: bool = False,
        accountant: str | None = None,
        neighbouring: str = "replace_one",
        progress_bar: bool = True,
    ):
        if dp not in core.DP_VARIANTS:
            raise ValueError(f"dp must be one of {core.DP_VARIANTS}, got {dp!r}")
        if schedule not in core.SCHEDULES:
            raise ValueError(f"schedule must be one of {core.SCHEDULES}, got {schedule!r}")
        if sampling not in core.SAMPLING:
            raise ValueError(f"sampling must be one of {core.SAMPLING}, got {sampling!r}")
        self.model = model
        self.dp = dp
        self.schedule = schedule
        self.optim = optax.adam(1e-2) if optim is None else optim
        self.num_local_steps = check_int(num_local_steps, "num_local_steps", minimum=1)
        self.num_mc_samples = check_int(num_mc_samples, "num_mc_samples", minimum=1)
        self.damping = check_positive(damping, "damping")
        if self.damping > 1.0:
            raise ValueError(f"damping must lie in (0, 1], got {self.damping}")
        self.sampling = sampling
        if sampling == "full":
            if sampling_rate not in (None, 1.0):
                raise ValueError("sampling='full' uses every row: leave sampling_rate unset")
            self.sampling_rate = 1.0
        else:
            if sampling_rate is None:
                raise ValueError(f"sampling={sampling!r} needs sampling_rate in (0, 1]")
            self.sampling_rate = check_sampling_rate(sampling_rate)
        if dp in ("local_avg", "virtual") and sampling != "full":
            raise ValueError(f"dp={dp!r} optimises every shard on all its rows: use sampling='full'")
        self.clip_norm = check_positive(clip_norm, "clip_norm")
        self.delta = check_delta(delta)
        self.num_shards = check_int(num_shards, "num_shards", minimum=1)
        if self.num_shards > 1 and dp not in ("local_avg", "virtual"):
            raise ValueError("num_shards > 1 applies to dp='local_avg' or dp='virtual' only")
        self.trusted_aggregator = bool(trusted_aggregator)
        if self.trusted_aggregator:
            if dp not in ("local_avg", "virtual"):
                raise ValueError(
                    "trusted_aggregator=True applies to dp='local_avg' or dp='virtual' "
                    "(DP-SGD's noise cannot be shared between clients)"
                )
            if schedule != "synchronous":
                raise ValueError("trusted_aggregator=True needs schedule='synchronous'")
        if dp is None:
            if noise_multiplier is not None or target_epsilon is not None:
                raise ValueError("dp=None is non-private: do not pass noise_multiplier or target_epsilon")
        elif noise_multiplier is None and target_epsilon is None:
            raise ValueError(f"dp={dp!r} needs noise_multiplier, target_epsilon or both")
        if noise_multiplier is not None:
            noise_multiplier = check_real(noise_multiplier, "noise_multiplier")
            if noise_multiplier < 0:
                raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
            if noise_multiplier == 0 and target_epsilon is not None:
                raise ValueError("noise_multiplier=0 gives no privacy: do not pass target_epsilon")
        self.noise_multiplier = noise_multiplier
        self.target_epsilon = None if target_epsilon is None else check_epsilon(target_epsilon)
        if accountant not in (None, "pld", "rdp"):
            raise ValueError(f"accountant must be 'pld', 'rdp' or None, got {accountant!r}")
        self.accountant = accountant
        if neighbouring not in ("replace_one", "add_remove"):
            raise ValueError(f"neighbouring must be 'replace_one' or 'add_remove', got {neighbouring!r}")
        self.neighbouring = neighbouring
        self.progress_bar = bool(progress_bar)
        self.federated_potential = None

    # -- set-up --------------------------------------------------------------------------------
    def _setup(self, args, kwargs):
        potential = split_potential(self.model, args, kwargs)
        data_plates = [p for p in potential.plates.values() if p.holds_data]
        if len(data_plates) != 1 or len(potential.plates) != 1:
            raise ValueError(
                "DPPVI needs exactly one federated plate, over the data rows, and global "
                f"latent variables only; the model has plates {list(potential.plates)}"
            )
        plate = data_plates[0].name
        self.federated_potential = potential
        unravel = potential.unravel
        d = potential.num_latent
        prior = core.gaussian_prior(lambda x: potential.prior_potential_fn(unravel(x)), d)
        return potential, plate, prior

    def _batch_sizes(self, sizes):
        return np.maximum(1, np.round(self.sampling_rate * sizes)).astype(int)

    def _client_events(self, sigmas, num_rounds, sizes):
        if self.dp == "dpsgd":
            steps = num_rounds * self.num_local_steps
            batch_sizes = self._batch_sizes(sizes)
            return [
                dpsgd_event(
                    float(s), steps, dataset_size=int(n), batch_size=int(b),
                    sampling_rate=self.sampling_rate, sampling=self.sampling,
                )
                for s, n, b in zip(sigmas, sizes, batch_sizes)
            ]
        return [gaussian_event(float(s), num_rounds) for s in sigmas]

    def noise_multipliers(self, num_rounds: int, client_sizes) -> np.ndarray:
        """``(M,)`` noise multipliers for a run of ``num_rounds``: the given one, or each
        client's smallest one spending at most ``target_epsilon``."""
        sizes = np.asarray(client_sizes, int)
        if self.dp is None:
            return np.zeros(sizes.size)
        if self.noise_multiplier is not None:
            return np.full(sizes.size, self.noise_multiplier)
        if self.dp != "dpsgd":
            # One Gaussian per round, whatever the client's size.
            sigma = calibrate_noise_multiplier(
                lambda s: gaussian_event(s, num_rounds), self.target_epsilon, self.delta,
                accountant=self.accountant, neighbouring=self.neighbouring,
            )
            return np.full(sizes.size, sigma)
        out = np.zeros(sizes.size)
        keys = [(int(n), int(b)) if self.sampling == "without_replacement" else 0
                for n, b in zip(sizes, self._batch_sizes(sizes))]
        for key in dict.fromkeys(keys):
            m = keys.index(key)
            n = int(sizes[m])
            sigma = calibrate_noise_multiplier(
                lambda s: self._client_events([s], num_rounds, np.array([n]))[0],
                self.target_epsilon, self._accounting_delta(),
                accountant=self.accountant, neighbouring=self.neighbouring,
            )
            out[[i for i, k in enumerate(keys) if k == key]] = sigma
        return out

    def max_rounds(self, client_sizes, *, limit: int = 100_000) -> int:
        """The most rounds a run can have with the given ``noise_multiplier`` and still
        spend at most ``target_epsilon`` (both given at construction): ``run(rng_key, None,
        ...)`` runs that many. For ``dp="dpsgd"`` a round is ``num_local_steps`` DP-SGD steps
        per client.

        :raises ValueError: when even one round spends more than the target.
        """
        if self.dp is None or self.noise_multiplier is None or self.target_epsilon is None:
            raise ValueError("max_rounds needs a private dp, noise_multiplier and target_epsilon")
        sizes = np.asarray(client_sizes, int)
        sigmas = np.full(sizes.size, self.noise_multiplier)

        def fits(rounds):
            return self.privacy(sigmas, rounds, sizes).epsilon <= self.target_epsilon

        if not fits(1):
            raise ValueError(
                f"one round with noise_multiplier={self.noise_multiplier} already spends more "
                f"than target_epsilon={self.target_epsilon}: raise the noise or the target"
            )
        # Epsilon grows with the number of rounds: double, then bisect.
        low, high = 1, 2
        while fits(high):
            low, high = high, 2 * high
            if high > limit:
                return limit
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if fits(mid) else (low, mid)
        return low

    def _accounting_delta(self):
        # Poisson batches are capped (see _batch_cap): a 1e-6 share of delta covers the cap.
        if self.dp == "dpsgd" and self.sampling == "poisson":
            return self.delta * (1.0 - _CAP_DELTA_SHARE)
        return self.delta

    def _batch_cap(self, guarantee, num_rounds, sizes, num_rows) -> int | None:
        """Rows per step's batch that the per-example work is sized for (``guarantee``: the
        run's :meth:`privacy`).

        Without replacement: the largest batch. Poisson: the smallest ``c`` such that a
        batch larger than ``c`` (whose extra rows would be dropped) has probability ``p``
        with ``T p (1 + e^epsilon) <= 1e-6 delta`` over the run's ``T`` steps; the capped
        mechanism then differs from the accounted one by at most that share of delta.
        """
        if self.sampling == "without_replacement":
            return int(self._batch_sizes(sizes).max())
        if self.sampling != "poisson":
            return None
        from scipy.stats import binom

        steps = num_rounds * self.num_local_steps
        epsilon = 50.0
        if self.dp == "dpsgd" and guarantee is not None:
            epsilon = guarantee.epsilon
        if epsilon > 50.0:
            return None
        budget = _CAP_DELTA_SHARE * self.delta / (steps * (1.0 + np.exp(epsilon)))
        caps = [int(binom.isf(budget, int(n), self.sampling_rate)) + 1 for n in sizes]
        cap = max(caps)
        return None if cap >= num_rows else cap

    def privacy(self, noise_multipliers, num_rounds: int, client_sizes) -> PrivacyGuarantee | None:
        """The guarantee of a run: each client's events accounted with ``dp-accounting``;
        the run's epsilon is the largest (each row belongs to one client)."""
        if self.dp is None or not np.all(np.asarray(noise_multipliers) > 0):
            return None
        sizes = np.asarray(client_sizes, int)
        events = self._client_events(np.asarray(noise_multipliers), num_rounds, sizes)
        cache = {}  # clients with the same events (same noise, and size where it matters)
        epsilons = []
        for e in events:
            key = repr(e)
            if key not in cache:
                cache[key] = compute_epsilon(
                    e, self._accounting_delta(), accountant=self.accountant, neighbouring=self.neighbouring
                )
            epsilons.append(cache[key])
        accountant = self.accountant or ("rdp" if self.sampling == "without_replacement" else "pld")
        if self.dp == "dpsgd":
            mechanism = (
                f"DP-SGD, {num_rounds * self.num_local_steps} steps per client, "
                f"{self.sampling} sampling at rate {self.sampling_rate:g} (Theorem 6)"
            )
            if self.sampling == "poisson":
                mechanism += (
                    f"; epsilon at delta (1 - {_CAP_DELTA_SHARE:g}), the rest of delta covers "
                    "the cap on Poisson batch sizes"
                )
            scope = "the whole run: every row, through all the client holding it sends"
        else:
            theorem = {"local_avg": "Theorem 7", "virtual": "Theorem 12"}[self.dp]
            if self.trusted_aggregator:
                theorem = {"local_avg": "Theorem 11", "virtual": "Theorem 14"}[self.dp]
            mechanism = f"Gaussian mechanism on clipped updates, {num_rounds} per client ({theorem})"
            scope = (
                "the whole run: every row, through the sums of the clients' updates that a "
                "trusted aggregator releases (each client's own message carries 1/sqrt(M) of "
                "the noise)"
                if self.trusted_aggregator
                else "the whole run: every row, through all the client holding it sends"
            )
        return privacy_guarantee(
            max(epsilons), self.delta, scope=scope, neighbouring=self.neighbouring,
            method=f"dp-accounting {accountant.upper()} accountant; {mechanism}",
        )

    # -- running -------------------------------------------------------------------------------
    def run(self, rng_key, num_rounds: int | None, *args, init_state: core.PVIState | None = None, **kwargs) -> DPPVIRunResult:
        """Runs ``num_rounds`` rounds (each visits every client once).

        :param rng_key: a JAX PRNG key.
        :param int num_rounds: global rounds; ``None`` (with both ``noise_multiplier`` and
            ``target_epsilon``) runs the most rounds that spend at most the target
            (:meth:`max_rounds`).
        :param args, kwargs: the model's arguments (the data).
        :param init_state: continue from a previous run's state (its privacy is not added).
        :raises ValueError: if ``noise_multiplier`` and ``target_epsilon`` are both given and
            ``num_rounds`` rounds would spend more than the target.
        """
        potential, plate, prior = self._setup(args, kwargs)
        sizes, rows, valid = self._layout(potential, plate)
        fixed_noise_budget = self.noise_multiplier is not None and self.target_epsilon is not None
        if num_rounds is None:
            if not fixed_noise_budget:
                raise ValueError("num_rounds=None needs both noise_multiplier and target_epsilon")
            num_rounds = self.max_rounds(sizes)
        num_rounds = check_int(num_rounds, "num_rounds", minimum=1)
        sigmas = self.noise_multipliers(num_rounds, sizes)
        privacy = self.privacy(sigmas, num_rounds, sizes)  # accounted once per run
        if fixed_noise_budget and privacy.epsilon > self.target_epsilon:
            raise ValueError(
                f"{num_rounds} rounds with noise_multiplier={self.noise_multiplier} spend "
                f"epsilon={privacy.epsilon:.4g} > target_epsilon={self.target_epsilon}; "
                f"pass num_rounds=None for the most that fit"
            )
        num_clients = sizes.size
        key_shards, key_run = jax.random.split(rng_key)
        shard_seed = int(jax.random.randint(key_shards, (), 0, 2**31 - 1))
        shard_index, shard_valid = core.shard_layout(sizes, self.num_shards, seed=shard_seed)
        data = core.ClientData(rows=rows, valid=valid, shard_index=shard_index, shard_valid=shard_valid)
        config = core.LocalConfig(
            optim=self.optim, num_steps=self.num_local_steps, num_mc_samples=self.num_mc_samples,
            sampling=self.sampling, sampling_rate=self.sampling_rate, dpsgd=self.dp == "dpsgd",
            clip_norm=self.clip_norm,
        )
        batch_cap = self._batch_cap(privacy, num_rounds, sizes, int(valid.shape[1]))
        unravel = potential.unravel

        def row_log_lik(theta, rows):
            return potential.row_log_likelihood_fn(unravel(theta), rows)

        round_fn = jax.jit(core.build_round(
            row_log_lik, data, config, dp=self.dp, schedule=self.schedule, damping=self.damping,
            noise_multiplier=sigmas, trusted_aggregator=self.trusted_aggregator, batch_cap=batch_cap,
        ))
        state = init_state if init_state is not None else self._initial_state(prior, num_clients)
        keys = jax.random.split(key_run, num_rounds)
        history = []
        iterator = range(num_rounds)
        if self.progress_bar:
            from tqdm.auto import tqdm

            iterator = tqdm(iterator, desc=f"DPPVI ({self.dp or 'non-private'})", unit="round")
        for r in iterator:
            state, info = round_fn(keys[r], state, data)
            loc, scale = core.loc_scale(state.q)
            history.append((loc, scale, info.rejected, info.clipped))
        state = self._final_state(state)
        if num_rounds:
            loc, scale = core.loc_scale(state.q)
            history[-1] = (loc, scale) + history[-1][2:]
        locs, scales, rejected, clipped = (np.asarray(jnp.stack(x)) for x in zip(*history))
        metrics = {
            "loc": locs,
            "scale": scales,
            "rejected": rejected,
            "clipped": clipped,
            "communications": np.arange(1, num_rounds + 1) * self._communications_per_round(potential),
        }
        loc, scale = core.loc_scale(state.q)
        params = {"loc": unravel(loc), "scale": unravel(scale)}
        return DPPVIRunResult(params, state, metrics, privacy, sigmas)

    # -- hooks for the baselines ---------------------------------------------------------------
    def _layout(self, potential, plate):
        """``(client sizes, stacked rows, valid mask)`` of the parties that optimise."""
        return (np.asarray(potential.client_sizes), potential.client_data["rows"],
                potential.client_data["valid"][plate])

    def _initial_state(self, prior, num_clients):
        return core.init(prior, num_clients, self.num_shards if self.dp == "virtual" else 1)

    def _final_state(self, state):
        return state

    def _communications_per_round(self, potential):
        return potential.num_clients

    def get_samples(self, rng_key, result: DPPVIRunResult, num_samples: int) -> dict:
        """``num_samples`` draws of ``q``, constrained, as a dict by site (like
        :meth:`numpyro.infer.SVI` guides' ``sample_posterior``)."""
        num_samples = check_int(num_samples, "num_samples", minimum=1)
        if self.federated_potential is None:
            raise ValueError("get_samples needs a run first: call run()")
        potential = self.federated_potential
        loc, scale = core.loc_scale(result.state.q)
        eps = jax.random.normal(rng_key, (num_samples, loc.shape[0]), loc.dtype)
        flat = loc + scale * eps
        return jax.vmap(lambda x: potential.postprocess_fn(potential.unravel(x)))(flat)


class BCM(DPPVI):
    """Bayesian committee machine (Tresp 2000) trained with DP-SGD: the one-round baseline
    of the DP-PVI paper. Every client fits its local posterior once, from the prior
    (``prior="same"``: ``q = prod_m q_m / p^(M-1)``) or from ``p^(1/M)``
    (``prior="split"``: ``q = prod_m q_m``); the server multiplies them.

    It is DPPVI with one synchronous round, no damping; ``run(rng_key, *args)`` takes no
    number of rounds. The privacy is that of ``num_local_steps`` DP-SGD steps per client.
    Other arguments as :class:`DPPVI` (``dp`` is ``"dpsgd"`` or ``None``).

    >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> import numpyro_fed as nf
    >>> from numpyro_fed.infer.dppvi import BCM
    >>> def model(y):
    ...     mu = numpyro.sample("mu", dist.Normal(0, 1))
    ...     with nf.federated_plate("data", y.shape[0], clients=2):
    ...         numpyro.sample("y", dist.Normal(mu, 1), obs=y)
    >>> bcm = BCM(model, prior="split", dp=None, num_local_steps=300, progress_bar=False)
    >>> result = bcm.run(jax.random.PRNGKey(0), jnp.ones(8))
    >>> loc, scale = result.params["loc"]["mu"], result.params["scale"]["mu"]
    >>> bool(abs(loc - 8 / 9) < 0.05 and abs(scale - 1 / 3) < 0.03)  # the exact posterior
    True
    """

    def __init__(self, model, *, prior: str = "same", dp: str | None = "dpsgd", **kwargs):
        if prior not in ("same", "split"):
            raise ValueError(f"prior must be 'same' or 'split', got {prior!r}")
        if dp not in (None, "dpsgd"):
            raise ValueError(f"BCM trains with DP-SGD: dp must be 'dpsgd' or None, got {dp!r}")
        for name in ("schedule", "damping"):
            if name in kwargs:
                raise ValueError(f"BCM fixes {name}: one synchronous round, no damping")
        self.prior = prior
        super().__init__(model, dp=dp, schedule="synchronous", damping=1.0, **kwargs)

    def _initial_state(self, prior, num_clients):
        state = core.init(prior, num_clients)
        if self.prior == "split":
            # factors (1 - 1/M) eta_prior make every cavity p^(1/M)
            share = jax.tree_util.tree_map(
                lambda x: jnp.broadcast_to((1.0 - 1.0 / num_clients) * x, (num_clients,) + x.shape), prior
            )
            state = state._replace(factors=share)
        return state

    def _final_state(self, state):
        q = jax.tree_util.tree_map(lambda p, f: p + f.sum(0), state.prior, state.factors)
        return state._replace(q=q)

    def run(self, rng_key, *args, **kwargs) -> DPPVIRunResult:  # noqa: D102
        return super().run(rng_key, 1, *args, **kwargs)


class GlobalVI(DPPVI):
    """Global (centralised) DP-VI with a trusted aggregator (Jälkö et al. 2017): the
    baseline of the DP-PVI paper that needs a communication per optimisation step.

    Every step, each client sends its sum of clipped per-example gradients to a trusted
    aggregator that adds the noise once: the same as DP-SGD on the pooled rows, which is
    how it is computed here. ``run(rng_key, *args)`` runs ``num_local_steps`` steps; the
    communications count ``M`` per step. Other arguments as :class:`DPPVI`.
    """

    def __init__(self, model, *, dp: str | None = "dpsgd", **kwargs):
        if dp not in (None, "dpsgd"):
            raise ValueError(f"GlobalVI trains with DP-SGD: dp must be 'dpsgd' or None, got {dp!r}")
        for name in ("schedule", "damping"):
            if name in kwargs:
                raise ValueError(f"GlobalVI fixes {name}")
        super().__init__(model, dp=dp, schedule="synchronous", damping=1.0, **kwargs)

    def _layout(self, potential, plate):
        valid = potential.client_data["valid"][plate]
        rows = [r.reshape((1, -1) + r.shape[2:]) for r in potential.client_data["rows"]]
        return np.array([int(np.sum(valid))]), rows, valid.reshape(1, -1)

    def _communications_per_round(self, potential):
        return potential.num_clients * self.num_local_steps

    def run(self, rng_key, *args, **kwargs) -> DPPVIRunResult:  # noqa: D102
        return super().run(rng_key, 1, *args, **kwargs)


@register_converter(DPPVIRunResult)
def _dppvi_to_inference_data(result: DPPVIRunResult, method: DPPVI | None = None, *,
                             num_samples: int = 1000, rng_key=None, **kwargs):
    """``nf.to_inference_data(result, method=pvi, num_samples=..., rng_key=...)``: draws of
    ``q`` as the posterior, per-round diagnostics as ``sample_stats`` (dims ``round``,
    ``client``), the federation and the privacy guarantee in ``attrs``."""
    import arviz as az

    from numpyro_fed.arviz import _set_attrs

    if not isinstance(method, DPPVI):
        raise TypeError("to_inference_data(DPPVIRunResult) needs method=<the DPPVI that ran it>")
    rng_key = jax.random.PRNGKey(0) if rng_key is None else rng_key
    draws = method.get_samples(rng_key, result, num_samples)
    posterior = {k: np.asarray(v)[None] for k, v in draws.items()}
    idata = az.from_dict(posterior=posterior, **kwargs)
    metrics = result.metrics
    stats = {
        "rejected": np.asarray(metrics["rejected"]),
        "clipped": np.asarray(metrics["clipped"]),
        "communications": np.asarray(metrics["communications"]),
    }
    dims = {
        "rejected": ["round"] + (["client"] if stats["rejected"].ndim == 2 else []),
        "clipped": ["round", "client"],
        "communications": ["round"],
    }
    dataset = az.dict_to_dataset(stats, library=None, dims=dims, default_dims=[])
    idata.add_groups(sample_stats=dataset)
    attrs = {"algorithm": "DPPVI", "dp": str(method.dp), "schedule": method.schedule,
             "num_rounds": int(np.asarray(metrics["communications"]).size)}
    attrs.update(federation_attrs(method.federated_potential))
    if result.privacy is not None:
        attrs.update(result.privacy.as_attrs())
        attrs["privacy_noise_multiplier"] = [float(s) for s in result.noise_multiplier]
    return _set_attrs(idata, attrs)


