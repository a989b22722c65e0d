"""DP-PVI: differentially private partitioned variational inference (Heikkilä et al. 2023)
with an SVI-like face (:class:`~numpyro_fed.infer.VariationalMethod`).

:class:`DPPVI` runs PVI (``dp=None``) or one of its private variants (``"dpsgd"``,
``"local_avg"``, ``"virtual"``; the mathematics is in :mod:`numpyro_fed.infer.pvi.core` and
:mod:`numpyro_fed.infer.pvi.client`), accounts the privacy of the whole run with
``dp-accounting`` (:mod:`numpyro_fed.infer.pvi.accounting`) and, given a
``target_epsilon``, calibrates the noise so that the run spends at most that budget.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

import jax
import jax.numpy as jnp

from numpyro.infer.initialization import init_to_uniform

from numpyro_fed._checks import check_int, check_positive
from numpyro_fed.federation.base import ClientError, check_min_clients
from numpyro_fed.infer.base import (
    ClientSpec,
    RunCheckpoint,
    RunResult,
    VariationalMethod,
    adopt_client_state,
    build_potential,
    check_global_latents,
    jit_round,
)
from numpyro_fed.infer.pvi import core
from numpyro_fed.infer.pvi.accounting import PrivacyAccounting
from numpyro_fed.infer.pvi.core import PVIState
from numpyro_fed.infer.pvi.diagnostics import FAILED_FIT_RESIDUAL, judge_run, last_move
from numpyro_fed.infer.pvi.dp_defaults import default_damping, local_config
from numpyro_fed.infer.pvi.gaussian import loc_scale, sample
from numpyro_fed.infer.pvi.local import ClientLatentsFace
from numpyro_fed.infer.pvi.prior import PriorSplit, build_prior_update, initial_state, prior_remainder, split_prior
from numpyro_fed.infer.pvi.settings import (
    check_aggregation,
    check_noise,
    check_private_settings,
    default_optimizer,
    resolve_sampling,
)
from numpyro_fed.privacy.accounting import check_delta, check_epsilon

__all__ = ["DPPVI"]

_DEFAULT_NUM_SAMPLES = 1000  # get_samples' draws when num_samples is None
COVARIANCES = ("auto", "full", "diagonal")
#: covariance="auto": a full-rank q (non-private runs) up to this many latent coordinates
FULL_RANK_MAX_DIM = 100
#: the default non-private local optimization starts from this many variational Newton steps
NEWTON_STEPS = 20
#: the local optimization's defaults (``num_local_steps``, ``num_mc_samples``)
LOCAL_STEPS, MC_SAMPLES = 100, 10
#: ... and with client-local latents under ``covariance="auto"`` (the structured ``q(theta)
#: prod_m q(z_m | theta)``), whose joint fit over ``(theta, z_m)`` is funnel-shaped and
#: biased at the stochastic fit's noise: radon's log sigma_a sat 0.56 NUTS sds high at 100
#: steps of 10 draws, 0.19-0.25 at 300 of 30 (the guide's *Structured*)
STRUCTURED_LOCAL_STEPS, STRUCTURED_MC_SAMPLES = 300, 30


class _RunPlan(NamedTuple):
    """What :meth:`DPPVI.init` fixed for a run (layout, compiled round and loss, noise, guarantee)."""

    num_rounds: int
    client_sizes: np.ndarray
    noise_multiplier: np.ndarray
    privacy: Any
    predicted_dp_error: float
    layout: core.BlockLayout  # each client's block in PVI's layout, built where it lives
    round_fn: Any
    loss_fn: Any  # (key, q, prior, federation) -> negative ELBO, the clients' terms through it
    federation: Any  # the started federation that runs the clients
    prior: PriorSplit  # how the prior enters q


class DPPVI(ClientLatentsFace, PrivacyAccounting, VariationalMethod):
    """Differentially private partitioned variational inference.

    A Gaussian on the unconstrained latents (full-rank or mean-field, ``covariance``), one
    factor per client, local ELBOs against the cavity optimized with ``optim``; ``dp`` picks
    the privacy mechanism.

    :param model: a NumPyro model with one :func:`~numpyro_fed.federated_plate` over the data
        rows and continuous latent variables: global ones and client-local ones (sites in a
        ``federated_plate`` of clients, e.g. per-school effects: each client keeps its own
        ``q(z_m)``, mean-field, or ``q(z_m | theta)`` with ``covariance="full"``,
        :mod:`~numpyro_fed.infer.pvi.local`; ``dp=None`` only). Any
        prior: ``Normal`` (and ``LogNormal``) priors are factors of ``q`` exactly, flat ones
        zero-precision factors, any other (a ``HalfCauchy`` scale, a hierarchical ``Normal(0,
        tau)``) a factor of its own that the server refines with a client's local update
        (:mod:`~numpyro_fed.infer.pvi.prior`; no rows, no privacy budget). The guide's
        *Priors: the prior factor*.
    :param dp: ``None`` (non-private PVI), ``"dpsgd"`` (DP-SGD in the local optimization,
        Section 4.1), ``"local_avg"`` (Algorithm 2) or ``"virtual"`` (Algorithm 3).
    :param str schedule: ``"sequential"`` or ``"synchronous"``.
    :param str covariance: ``q``'s family: ``"full"`` (full-rank; ``dp=None`` only),
        ``"diagonal"`` (mean-field) or ``"auto"`` (the default): full-rank without privacy up
        to ``FULL_RANK_MAX_DIM`` (100) coordinates, mean-field otherwise. With client-local
        latents full-rank is the structured ``q(theta) prod_m q(z_m | theta)``, a full-rank
        Gaussian over ``(theta, z_m)`` on each client, chosen by ``"auto"`` without privacy
        where every client's ``d_g + L_m`` is at most ``FULL_RANK_MAX_DIM``. A mean-field ``q``
        underestimates the sds of a correlated posterior; a non-private mean-field run checks
        this at its end (each client returns the curvature of its log-likelihood at draws of
        ``q``, ``"curvature"`` in the ledger) and warns. Every non-private run (either
        family) also checks ``q``'s shape by importance weighting its draws towards the
        posterior (the clients return their log-likelihood at 1000 draws of ``q``,
        ``"log_lik_draws"`` or ``"log_weights"`` in the ledger; Pareto k-hat in
        ``metrics["pareto_k"]``) and warns where ``q``'s tails are too light and the weights
        move its means or sds (the guide's *Did it work?*). With the default optimizer a
        non-private local fit (full-rank, or mean-field up to 200 coordinates) starts from
        safeguarded variational Newton steps (expectations over draws of ``q``,
        ``LocalConfig.newton_start``).
    :param optim: an optax optimizer for the local optimization, run on ``(loc, log_scale)``
        and taking its last iterate. Default (``None``):
        :func:`~numpyro_fed.infer.pvi.settings.default_optimizer` (see *Defaults*).
    :param int num_local_steps: local optimization steps per client update. Default
        (``None``): ``LOCAL_STEPS`` (100), or ``STRUCTURED_LOCAL_STEPS`` (300) for the
        structured ``q`` that ``covariance="auto"`` chooses for client-local latents.
    :param int num_mc_samples: Monte Carlo draws of ``q`` per step. Default (``None``):
        ``MC_SAMPLES`` (10), or ``STRUCTURED_MC_SAMPLES`` (30) for that structured ``q``.
    :param float damping: ``rho`` in ``(0, 1]``: the server adds ``rho * Delta``. ``None``:
        1, or ``AUTO_DAMPING`` (0.5) for DP-SGD with a budget and the automatic clip norm.
    :param str sampling: minibatches of the local optimization: ``"full"``, ``"poisson"``
        (rate ``sampling_rate``, PLD) or ``"without_replacement"`` (``round(sampling_rate *
        n_m)`` rows, RDP). Default: ``"poisson"`` for ``"dpsgd"`` (at the automatic rate
        unless ``sampling_rate`` is given), else ``"full"`` (``"poisson"`` given a rate).
    :param float sampling_rate: in ``(0, 1]``; required for an explicit ``"poisson"`` or
        ``"without_replacement"``.
    :param float clip_norm: ``C``: bound on each per-example gradient wrt ``(loc, log_scale)``
        (``"dpsgd"``; ``None``: the automatic clip norm, in units of ``q``'s scale) or each
        shard's change of natural parameters (``"local_avg"``, ``"virtual"``; default 1).
    :param noise_multiplier: noise sd over ``C``; or give ``target_epsilon``. ``0`` clips
        without noise: no privacy (``result.privacy`` is ``None``), to study clipping alone.
    :param float target_epsilon: the run spends at most this. Alone, it calibrates the noise
        for the given number of rounds; with ``noise_multiplier`` too, it calibrates the
        number of rounds instead: ``run(rng_key, None, ...)`` runs the most rounds whose
        privacy cost stays within the target (see :meth:`max_rounds`).
    :param float delta: the run's delta.
    :param int num_shards: ``K``: shards (local averaging) or virtual clients per client.
    :param bool trusted_aggregator: the clients' updates are summed by a trusted aggregator
        (synchronous schedule, ``"local_avg"``/``"virtual"``): each client's noise is divided
        by ``sqrt(M)`` (Theorems 11, 14) and the guarantee covers the aggregate.
    :param str accountant: ``"pld"``, ``"rdp"`` or ``None`` (PLD unless without replacement).
    :param str neighboring: ``"replace_one"`` (the paper's) or ``"add_remove"``.
    :param partition, init_strategy: as :func:`~numpyro_fed.split_potential`.
    :param bool progress_bar: a progress bar over rounds.
    :param federation: where the clients run: ``None`` (the default: every client in this
        process, vectorised) or a :class:`~numpyro_fed.federation.Federation` such as
        :class:`~numpyro_fed.RayFederation`; same key, same answer (in distribution for a
        private run). What crosses, client state, failures: the guide's *On a federation*.
    :param bool private_randomness: each client folds a seed of its own into the keys of its
        noise and batches, so the server cannot replay them. ``None`` (default): for a private
        run whose clients are apart from the server (an engine, or ``loader=``); ``False``:
        reproducible, and the guarantee says it does not hold against the server.
    :param budget: a :class:`~numpyro_fed.PrivacyBudget` the run draws from (refused before
        it starts past it). ``result.privacy``: the guide's *What the guarantee covers*.
    :param int min_clients: ``None`` (default): every client must answer each round (else a
        :class:`~numpyro_fed.federation.ClientError` whose ``state`` resumes the run). An int:
        a round goes on without the clients that fail, their factors unchanged (which PVI
        allows), while ``min_clients`` answer; ``metrics["participated"]`` records who took
        part. Not with ``trusted_aggregator``. The guide's *Nodes that drop out*.

    **Running.** As :class:`numpyro.infer.SVI`: :meth:`run` returns a
    :class:`~numpyro_fed.infer.RunResult` whose ``metrics`` hold per round ``loss`` (the
    negative ELBO of ``q`` after the round, :meth:`evaluate`; the clients return their terms
    with the next round's update), ``loc`` and ``scale`` of ``q`` (flat), ``rejected``,
    ``clipped``, ``residual``, ``participated`` (per client), ``communications``,
    ``noise_multiplier``, ``predicted_dp_error`` and, without privacy, ``last_move``;
    ``result.privacy`` is the guarantee, ``result.ledger`` what crossed. :meth:`init` and
    :meth:`update` run rounds one at a time; :meth:`get_params`, :meth:`get_samples` read ``q``.

    **Defaults.** Without ``optim``, :func:`~numpyro_fed.infer.pvi.settings.default_optimizer`;
    given only a budget, DP-SGD chooses its settings (:mod:`~numpyro_fed.infer.pvi.dp_defaults`),
    warns where the privacy noise is predicted to move ``q``'s means by more than a posterior
    sd and refuses where it would dominate them (:meth:`predicted_dp_error`,
    :func:`~numpyro_fed.infer.pvi.dp_defaults.refuses`): the guide's *Default settings*.

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
        >>> pvi = nf.DPPVI(model, progress_bar=False)         # non-private, the defaults
        >>> result = pvi.run(jax.random.PRNGKey(1), 12, X, y)
        >>> bool(result.metrics["residual"][-1].max() < 0.25)  # the local fits converged
        True
        >>> bool(result.metrics["last_move"][-1].max() < 0.1)  # and so did q over the rounds
        True
        >>> draws = pvi.get_samples(jax.random.PRNGKey(2), result, 100)
        >>> draws["w"].shape
        (100, 2)
        >>> state, info = pvi.update(jax.random.PRNGKey(3), pvi.init(jax.random.PRNGKey(4), X, y))
        >>> bool(result.metrics["loss"][-1] < info.loss)  # the negative ELBO fell from the prior's
        True
        >>> pvi
        DPPVI(model, dp=None, schedule='sequential', num_local_steps=100, num_mc_samples=10, damping=1.0)

    Given only a budget, DP-SGD chooses its settings, or refuses when 400 rows cannot pay:

    .. doctest::

        >>> private = nf.DPPVI(model, dp="dpsgd", target_epsilon=1.0, delta=1e-5, progress_bar=False)
        >>> private.run(jax.random.PRNGKey(1), 2, X, y)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: DPPVI(dp='dpsgd'): with target_epsilon=1.0, 2 round(s) ... the answer would be mostly noise...
    """

    def __init__(
        self,
        model,
        *,
        dp: str | None = None,
        schedule: str = "sequential",
        optim=None,
        num_local_steps: int | None = None,
        num_mc_samples: int | None = None,
        damping: float | None = None,
        sampling: str | None = None,
        sampling_rate: float | None = None,
        clip_norm: float | None = None,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        delta: float = 1e-5,
        num_shards: int = 1,
        trusted_aggregator: bool = False,
        accountant: str | None = None,
        neighboring: str = "replace_one",
        partition=None,
        init_strategy=init_to_uniform,
        progress_bar: bool = True,
        federation=None,
        covariance: str = "auto",
        private_randomness: bool | None = None,
        budget=None,
        min_clients: int | None = None,
    ):
        sampling, sampling_rate, self.auto_sampling = resolve_sampling(dp, sampling, sampling_rate)
        if covariance not in COVARIANCES:
            raise ValueError(f"covariance must be one of {COVARIANCES}, got {covariance!r}")
        if covariance == "full" and dp is not None:
            raise ValueError(
                f"covariance='full' needs dp=None: the private variants clip and noise a diagonal q's "
                f"parameters (dp={dp!r}); use covariance='diagonal' or 'auto'"
            )
        self.covariance = covariance
        num_shards = check_int(num_shards, "num_shards", minimum=1)
        check_aggregation(dp, schedule, num_shards, trusted_aggregator)
        # DP-SGD without a clip norm: the automatic one (auto_clip_norms, see the guide).
        self.auto_clip = dp == "dpsgd" and clip_norm is None
        super().__init__(
            model, partition=partition, init_strategy=init_strategy, progress_bar=progress_bar, federation=federation
        )
        self.dp = dp
        self.schedule = schedule
        # None: the defaults, which _setup raises for the structured q once it knows the model
        self._given_local = (
            None if num_local_steps is None else check_int(num_local_steps, "num_local_steps", minimum=1),
            None if num_mc_samples is None else check_int(num_mc_samples, "num_mc_samples", minimum=1),
            optim,
        )
        # The default local optimizer: scale-free steps, a decaying rate, iterate averaging.
        self.default_optim = optim is None
        self._local_settings(structured=False)
        automatic = self.auto_clip and target_epsilon is not None and noise_multiplier is None
        self.damping = check_positive(default_damping(automatic) if damping is None else damping, "damping")
        if self.damping > 1.0:
            raise ValueError(f"damping must lie in (0, 1], got {self.damping}")
        self.sampling, self.sampling_rate = sampling, sampling_rate
        if not self.auto_clip:
            clip_norm = check_positive(1.0 if clip_norm is None else clip_norm, "clip_norm")
        self.clip_norm = clip_norm
        self.delta = check_delta(delta)
        self.num_shards = num_shards
        self.trusted_aggregator = bool(trusted_aggregator)
        self.noise_multiplier = check_noise(dp, noise_multiplier, target_epsilon)
        self.target_epsilon = None if target_epsilon is None else check_epsilon(target_epsilon)
        if accountant not in (None, "pld", "rdp"):
            raise ValueError(f"accountant must be 'pld', 'rdp' or None, got {accountant!r}")
        self.accountant = accountant
        if neighboring not in ("replace_one", "add_remove"):
            raise ValueError(f"neighboring must be 'replace_one' or 'add_remove', got {neighboring!r}")
        self.neighboring = neighboring
        self.private_randomness, self.budget = check_private_settings(dp, private_randomness, budget)
        self.min_clients = check_min_clients(min_clients)
        self._plan: _RunPlan | None = None

    repr_fields = ("dp", "schedule", "num_local_steps", "num_mc_samples", "damping")
    divergence_advice = "lower the optimizer's rate (optim) or, with privacy, damp the updates (damping=0.2-0.5)"

    # -- the model -----------------------------------------------------------------------------
    def _local_settings(self, structured: bool) -> None:
        """``num_local_steps``, ``num_mc_samples`` and ``optim``: the user's, else the
        defaults (:data:`LOCAL_STEPS`, :data:`MC_SAMPLES`; for a structured ``q`` chosen by
        ``covariance="auto"``, :data:`STRUCTURED_LOCAL_STEPS`, :data:`STRUCTURED_MC_SAMPLES`)."""
        steps, draws, optim = self._given_local
        default_steps, default_draws = (
            (STRUCTURED_LOCAL_STEPS, STRUCTURED_MC_SAMPLES) if structured else (LOCAL_STEPS, MC_SAMPLES)
        )
        self.num_local_steps = default_steps if steps is None else steps
        self.num_mc_samples = default_draws if draws is None else draws
        if optim is not None:
            self.optim = optim
        elif getattr(self, "_optim_steps", None) != self.num_local_steps:  # the same object while unchanged
            self.optim, self._optim_steps = default_optimizer(self.num_local_steps), self.num_local_steps

    def _setup(self, args, kwargs):
        potential = self.build_potential(args, kwargs, global_latents_only=False)
        if type(self) is not DPPVI:  # the baselines' clients hold factors of the global latents only
            check_global_latents(potential, type(self).__name__, "use DPPVI")
        self._find_local(potential)
        auto_structured = (
            self._local is not None and self.covariance == "auto" and self.full_rank(self._local.check_width)
        )
        self._local_settings(structured=auto_structured)
        return (potential,) + self._check_plates(potential)

    def _check_plates(self, potential):
        data_plates = [p for p in potential.plates.values() if p.holds_data]
        if len(data_plates) != 1:
            raise ValueError(
                f"{type(self).__name__} needs exactly one federated plate over the data rows; the "
                f"model has plates {list(potential.plates)}"
            )
        init_loc = potential.ravel(potential.init_params) if self._local is None else self._local.init_global
        return data_plates[0].name, split_prior(self._prior_potential(potential), init_loc)

    def full_rank(self, num_latent: int) -> bool:
        """Whether ``q`` is full-rank for a model with ``num_latent`` unconstrained
        coordinates: ``covariance="full"``, or ``"auto"`` without privacy up to
        ``FULL_RANK_MAX_DIM`` coordinates. With client-local latents ``num_latent`` is a
        client's joint width ``d_g + L`` and full-rank means the structured ``q(theta) prod_m
        q(z_m | theta)`` (:mod:`~numpyro_fed.infer.pvi.conditional`); otherwise the mean-field
        ``q(theta) prod_m q(z_m)``."""
        if self.covariance == "auto":
            return self.dp is None and num_latent <= FULL_RANK_MAX_DIM
        return self.covariance == "full"

    # -- the face ------------------------------------------------------------------------------
    def plan_clients(self, rng_key, args, kwargs, *, num_rounds: int | None = 1) -> ClientSpec:
        """Splits the model, chooses the automatic DP-SGD settings, calibrates the noise,
        accounts the run's privacy and draws each client's shards with ``rng_key`` (see
        :meth:`init`); returns what the clients run: PVI's client functions on their blocks
        in PVI's layout, built from their own rows where they live."""
        potential, plate, prior = self._setup(args, kwargs)
        self.has_prior_factor = not prior.exact
        sizes, num_rows = self._layout(potential, plate)
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
        d = int(prior.base.eta1.shape[-1])
        dp_error = self.planned_dp_error(sigmas, num_rounds, sizes, d, privacy)  # refused here if it dominates
        shard_seed = int(jax.random.randint(rng_key, (), 0, 2**31 - 1))
        shard_index, shard_valid = core.shard_layout(sizes, self.num_shards, seed=shard_seed)
        config = local_config(self, newton_start=NEWTON_STEPS if self.default_optim and self.dp is None else 0)
        clip_first, clip_later = self.clip_bounds(sizes, d)
        num_clients = int(sizes.size)
        noise = jnp.broadcast_to(jnp.asarray(sigmas, dtype=jnp.zeros(()).dtype), (num_clients,))
        layout = core.BlockLayout(plate, shard_index, shard_valid, noise, clip_first, clip_later)
        privacy = self.settle_privacy(privacy, clip_first, clip_later)  # refused here if over the budget
        if self._local is not None:  # clients with latents of their own
            self._client_plan = (num_rounds, sizes, sigmas, privacy, dp_error, layout, config, prior)
            programs = self._local.client_functions(config, damping=self.damping)
            return self._client_spec(programs, potential, self._local.layout())
        programs = core.client_functions(
            potential.flat().row_log_likelihood,
            config,
            dp=self.dp,
            trusted_aggregator=self.trusted_aggregator,
            num_clients=num_clients,
            auto_clip=self.auto_clip,
            batch_cap=self.batch_cap(privacy, num_rounds, sizes, num_rows),
            damping=self.damping,
            loss_draws=True,
        )
        self._client_plan = (num_rounds, sizes, sigmas, privacy, dp_error, layout, config, prior)
        return self.private_spec(self._client_spec(programs, potential, layout), privacy)

    def _prior_update(self, potential, prior: PriorSplit, config):
        """The server's prior update and the loss's prior potential, or ``(None, None)`` for an
        exact Gaussian prior."""
        if prior.exact:
            return None, None
        prior_potential = self._prior_potential(potential)
        remainder = prior_remainder(prior_potential, prior.base)
        return build_prior_update(remainder, prior.refined, config, damping=self.damping), prior_potential

    def init(self, rng_key, *args, num_rounds: int | None = 1, **kwargs) -> PVIState:
        """Prepares a run of ``num_rounds`` rounds on the model's arguments ``args``,
        ``kwargs`` and returns its initial state (``q`` the prior).

        It splits the model, chooses the automatic DP-SGD settings, calibrates the noise,
        accounts the run's privacy (refusing a run whose noise would dominate) and draws each
        client's shards with ``rng_key``; :meth:`update` runs rounds of that plan.

        :param int num_rounds: the rounds the noise and the guarantee are planned for;
            ``None`` (with both ``noise_multiplier`` and ``target_epsilon``): the most that
            fit the budget (:meth:`max_rounds`).
        """
        spec = self.plan_clients(rng_key, args, kwargs, num_rounds=num_rounds)
        num_rounds, sizes, sigmas, privacy, dp_error, layout, config, prior = self._client_plan
        num_clients = int(sizes.size)
        if self.budget is not None:  # charged as the run starts: its clients may send before it ends
            privacy = self.budget.charge(privacy)
        federation = self.start_clients(**spec._asdict())
        prior_update, prior_potential = self._prior_update(self.federated_potential, prior, config)
        step = core.build_step(
            config,
            num_clients=num_clients,
            schedule=self.schedule,
            damping=self.damping,
            auto_clip=self.auto_clip,
            prior_update=prior_update,
            prior_potential=prior_potential,
            min_clients=core.check_dropout(self.min_clients, num_clients, self.trusted_aggregator),
            max_residual=None if privacy is not None else FAILED_FIT_RESIDUAL,
        )
        self._plan = _RunPlan(
            num_rounds,
            sizes,
            sigmas,
            privacy,
            dp_error,
            layout,
            jit_round(step),
            jit_round(core.build_loss(self.num_mc_samples, prior_potential, stateful=self._local is not None)),
            federation,
            prior,
        )
        if self._local is None:
            return self._initial_state(prior, sizes.size)
        full = self.full_rank(self._local.check_width)  # the factors, then each q(z_m) (or q(z_m | theta)), keys
        state = initial_state(prior, num_clients, full_rank=full)
        key = jax.random.fold_in(rng_key, 1)
        clients = self._local.initial_clients(state.clients.values, key, federation, structured=full)
        return state._replace(clients=clients)

    def update(self, rng_key, state: PVIState, *args, **kwargs):
        """One round of the plan :meth:`init` prepared (every client visited once):
        ``(state, info)`` with ``info`` a :class:`~numpyro_fed.infer.pvi.core.PVIInfo`. The
        model's arguments are those given to :meth:`init` (accepted here for SVI's
        signature)."""
        plan = self._require_plan()
        with plan.federation.guard():
            return plan.round_fn(rng_key, state, plan.federation)

    def run(self, rng_key, num_rounds: int | None, *args, init_state: PVIState | None = None, **kwargs) -> RunResult:
        """Runs ``num_rounds`` rounds (each visits every client once).

        :param rng_key: a JAX PRNG key (split into :meth:`init`'s and the rounds').
        :param int num_rounds: global rounds; ``None`` (with both ``noise_multiplier`` and
            ``target_epsilon``) runs the most rounds that spend at most the target
            (:meth:`max_rounds`).
        :param args, kwargs: the model's arguments (the data).
        :param init_state: continue from a previous run's state (its privacy is not added),
            or resume a run stopped by a :class:`~numpyro_fed.federation.ClientError` from its
            ``error.state`` (a :class:`~numpyro_fed.infer.rounds.RunCheckpoint`; same
            ``rng_key`` and ``num_rounds``): the result is that of the uninterrupted run.
        :return: a :class:`~numpyro_fed.infer.RunResult` (see *Running* above).
        :raises ValueError: if ``noise_multiplier`` and ``target_epsilon`` are both given and
            ``num_rounds`` rounds would spend more than the target.
        """
        key_init, key_run = jax.random.split(rng_key)
        state = self.init(key_init, *args, num_rounds=num_rounds, **kwargs)
        plan = self._plan
        if type(self) is DPPVI:
            self.warn_one_round(plan.num_rounds, continuing=init_state is not None)
        resume = init_state if isinstance(init_state, RunCheckpoint) else None
        if resume is not None:
            state = resume.state
            start_loc = resume.context["start_loc"]
        else:
            if init_state is not None:
                state = init_state._replace(clients=adopt_client_state(plan.federation, init_state.clients))
            start_loc = np.asarray(loc_scale(self._final_state(state).q)[0])
        folded = self._final_state(state) is state  # the rounds' info.loss is of q as each round starts
        is_finite = lambda s: bool(jnp.all(jnp.isfinite(s.q.eta1)) & jnp.all(jnp.isfinite(s.q.eta2)))  # noqa: E731
        desc, context = f"{type(self).__name__} ({self.dp or 'non-private'})", {"start_loc": start_loc}
        try:
            result = self.drive(
                self.update,
                key_run,
                state,
                plan.num_rounds,
                resume=resume,
                privacy=plan.privacy,
                is_finite=is_finite,
                desc=desc,
                context=context,
            )
        except ClientError as error:
            if folded and getattr(error, "result", None) is not None:
                error.result = self._loss_after_rounds(error.result, None)
            raise
        if folded:
            result = self._loss_after_rounds(result, jax.random.fold_in(key_run, core.LOSS_STREAM))
        if self.dp is None:
            result.metrics["last_move"] = last_move(start_loc, result.metrics["loc"], result.metrics["scale"])
        result = self.finish(result)
        width = self.federated_potential.num_latent if self._local is None else self._local.check_width
        if self.dp is None and not self.full_rank(width):
            result = self._check_mean_field(result)
        if self.dp is None:
            result = self._check_importance(result)
        return result

    def record(self, state: PVIState, info) -> dict:
        """A round's metrics (see *Running* in the class docstring)."""
        plan = self._require_plan()
        final = self._final_state(state)
        loc, scale = loc_scale(final.q)
        dp_error = plan.predicted_dp_error
        if self.dp in ("local_avg", "virtual") and plan.privacy is not None:  # from q's scale, as the run goes
            dp_error = self.update_noise_error(plan.noise_multiplier, plan.num_rounds, plan.client_sizes.size, scale)
        return {
            "loss": info.loss if final is state else self.evaluate(final),
            "loc": loc,
            "scale": scale,
            "rejected": info.rejected,
            "clipped": info.clipped,
            "residual": info.residual,
            "participated": info.participated,
            "communications": int(state.round) * self._communications_per_round(),
            "noise_multiplier": plan.noise_multiplier,
            "predicted_dp_error": dp_error,
            **({} if info.prior_residual is None else {"prior_residual": info.prior_residual}),
        }

    def finish(self, result: RunResult) -> RunResult:
        """The final state (the baselines combine the factors) and the run's warnings: local
        fits that had not converged, ``q`` still moving between rounds (non-private), a
        privacy noise that makes the answer approximate."""
        judge_run(self.dp, result.metrics, private=result.privacy is not None, clip_norm=self.clip_norm, stacklevel=3)
        return result._replace(state=self._final_state(result.state))

    def get_params(self, state: PVIState) -> dict:
        """``{"loc": ..., "scale": ...}`` of ``q`` on the unconstrained space, each a dict by
        site shaped like the model's latent values (as ``SVI.get_params``)."""
        loc, scale = loc_scale(state.q)
        if self._local is not None:  # q covers the global latents
            return self._local.get_params(loc, scale)
        unravel = self.federated_potential.unravel
        return {"loc": unravel(loc), "scale": unravel(scale)}

    def get_samples(self, rng_key, result: RunResult, num_samples: int | None = None, *, sites=None) -> dict:
        """Draws of ``q``, constrained, as a dict by site (like the ``sample_posterior`` of
        :class:`numpyro.infer.SVI`'s guides); ``num_samples=None``: 1000; ``sites``: only
        these. A client-local site's draws are its clients' (each draws from its ``q(z_m)``,
        call ``"local_draws"``, counted in ``result.ledger``), fetched only when one is
        asked for (``sites=None``: every site)."""
        num_samples = _DEFAULT_NUM_SAMPLES if num_samples is None else check_int(num_samples, "num_samples", minimum=1)
        if self.federated_potential is None:
            raise ValueError("get_samples needs a run first: call run()")
        flat = sample(rng_key, result.state.q, num_samples)
        if self._local is not None:
            return self._local_samples(rng_key, result, flat, sites)
        draws = jax.vmap(self.federated_potential.flat().postprocess)(flat)
        return draws if sites is None else {k: v for k, v in draws.items() if k in sites}

    def evaluate(self, state: PVIState, *args, rng_key=None, **kwargs):
        """The negative ELBO of ``state``'s ``q``: ``KL(q || prior)`` minus every row's
        expected log-likelihood, estimated with ``num_mc_samples`` draws (``rng_key``,
        default ``PRNGKey(0)``). Without arguments, on the clients of the last :meth:`init`,
        through the federation: the server sends the draws of ``q`` and each client returns
        its rows' sum (``"expected_log_lik"``, counted in the ledger; in deployment too).
        Given the model's arguments ``args``, ``kwargs``, on those rows in this process. The
        loss of ``metrics["loss"]``: a diagnostic, not a message of the algorithm, and no
        privacy guarantee covers it."""
        rng_key = jax.random.PRNGKey(0) if rng_key is None else rng_key
        if (args or kwargs) and self._local is not None:
            raise ValueError("evaluate: with client-local latents the loss needs the clients' q(z_m): evaluate(state)")
        if args or kwargs:
            potential = build_potential(
                self.model, args, kwargs, partition=self.partition, init_strategy=self.init_strategy
            )
            plate, prior = self._check_plates(potential)
            data = core.ClientData(potential.client_data["rows"], potential.client_data["valid"][plate], None, None)
            prior_potential = None if prior.exact else potential.flat().prior_potential
            return core.negative_elbo(
                rng_key,
                potential.flat().row_log_likelihood,
                state.q,
                state.prior,
                data,
                self.num_mc_samples,
                prior_potential,
            )
        plan = self._require_plan()
        clients = () if self._local is None else (state.clients,)
        with plan.federation.guard():
            return plan.loss_fn(rng_key, state.q, state.prior, *clients, plan.federation)

    def arviz_dicts(self, result: RunResult, *, num_samples: int | None = None, rng_key=None) -> dict:
        """Draws of ``q`` as the posterior (one chain), per-round diagnostics as
        ``sample_stats`` (dims ``round``, ``client``), the settings, the federation and the
        privacy guarantee in ``attrs``."""
        out = super().arviz_dicts(result, num_samples=num_samples, rng_key=rng_key)
        metrics = result.metrics
        rejected = np.asarray(metrics["rejected"])
        ledger = {k: v for k, v in out["sample_stats"].items() if k.startswith("ledger.")}
        out["sample_stats"] = {
            **ledger,
            "loss": (metrics["loss"], ["round"]),
            "rejected": (rejected, ["round"] + (["client"] if rejected.ndim == 2 else [])),
            "clipped": (metrics["clipped"], ["round", "client"]),
            "residual": (metrics["residual"], ["round", "client"]),
            "communications": (metrics["communications"], ["round"]),
        }
        out["attrs"]["num_rounds"] = int(rejected.shape[0])  # the guarantee's privacy_* are the face's
        if "pareto_k" in metrics:  # the importance check's, after the last round
            out["attrs"]["pareto_k"] = float(np.asarray(metrics["pareto_k"])[-1])
        return out

    # -- hooks for the baselines ---------------------------------------------------------------
    def _require_plan(self) -> _RunPlan:
        if self._plan is None:
            raise ValueError(f"{type(self).__name__}: call init(rng_key, *args) (or run) first")
        return self._plan

    def _layout(self, potential, plate):
        """``(row counts, padded rows per party)`` of the parties that optimize (the clients;
        counts only, which the server knows in deployment too)."""
        return np.asarray(potential.client_sizes), int(potential.plates[plate].max_rows)

    def _client_spec(self, programs, potential, layout: core.BlockLayout) -> ClientSpec:
        """The clients run ``programs``, ``(functions, stateful)`` of
        :func:`~numpyro_fed.infer.pvi.core.client_functions`: each builds its block in PVI's
        layout (``layout``) from its own rows, where it lives."""
        functions, stateful = programs
        return ClientSpec(functions, transform=layout, stateful=stateful)

    def _initial_state(self, prior: PriorSplit, num_clients):
        virtual = self.num_shards if self.dp == "virtual" else None
        full = self.full_rank(prior.base.eta1.shape[-1])
        return initial_state(prior, num_clients, full_rank=full, num_virtual=virtual, federation=self._plan.federation)

    def _final_state(self, state):
        return state

    def _communications_per_round(self):
        return self.federated_potential.num_clients
