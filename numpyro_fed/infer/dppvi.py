"""DP-PVI: differentially private partitioned variational inference (Heikkilä et al. 2023)
with an SVI-like face, on top of :func:`~numpyro_fed.split_potential`.

:class:`DPPVI` runs PVI (``dp=None``) or one of its private variants (``"dpsgd"``,
``"local_avg"``, ``"virtual"``; see :mod:`numpyro_fed.infer.pvi` for the mathematics),
accounts the privacy of the whole run with ``dp-accounting`` and, given a
``target_epsilon``, calibrates the noise so that the run spends at most that budget.
"""

from __future__ import annotations

import warnings
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

# The default local optimiser (see default_optimiser).
_DEFAULT_RATE = 0.1
_FINAL_RATE_SHARE = 0.01
_AVERAGE_FROM = 0.5

# The automatic DP-SGD settings (see DPPVI's docstring, "Automatic DP-SGD settings").
_AUTO_BATCH = 64  # expected rows per step in the smallest client
_AUTO_MIN_NOISE = 2.0  # smallest noise multiplier the automatic rate aims for
_AUTO_CLIP = 8.0  # clip norm over the typical scaled per-row gradient, sqrt(d / rows seen)
_MAX_DP_ERROR = 1.0  # predicted_dp_error above which the noise dominates (refuse / warn)
# predicted_dp_error above which a run that goes ahead warns: measured errors were up to
# 5 times the prediction (benchmarks/dppvi.md), so 0.2 can mean a posterior sd.
_WARN_DP_ERROR = 0.2
_MAX_LAST_MOVE = 0.1  # non-private: largest move of q's means per round, in q's scales,
_LAST_MOVE_SPAN = 3  # averaged over the last 3 rounds (or fewer in a shorter run)
_MIN_NOISE_MULTIPLIER = 0.3  # below: epsilon in the hundreds; accounting blows up
_MAX_RESIDUAL = 0.25  # local-optimisation residual (in q's scales) above which it has not converged
_ADAM_WINDOW = 10  # steps a user optimiser's last iterate is taken to average (Adam's momentum)


def default_optimiser(num_local_steps: int):
    """The default local optimiser: Adam whose rate decays from 0.1 to 0.001 (cosine)
    over the ``num_local_steps`` steps of each local optimisation. :class:`DPPVI` runs it in
    standardised coordinates (steps in units of the current ``q``'s scale) and returns the
    average of the iterates over the second half of the steps."""
    return optax.adam(optax.cosine_decay_schedule(_DEFAULT_RATE, num_local_steps, alpha=_FINAL_RATE_SHARE))


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
    :param optim: an optax optimiser for the local optimisation, run on ``(loc, log_scale)``
        and taking its last iterate. Default (``None``): :func:`default_optimiser`, run in
        units of ``q``'s scale with iterate averaging (see *The default local optimiser*).
    :param int num_local_steps: local optimisation steps per client update.
    :param int num_mc_samples: Monte Carlo draws of ``q`` per step.
    :param float damping: ``rho`` in ``(0, 1]``: the server adds ``rho * Delta``.
    :param str sampling: minibatches of the local optimisation: ``"full"``, ``"poisson"``
        (rate ``sampling_rate``, accounted with PLD) or ``"without_replacement"``
        (``round(sampling_rate * n_m)`` rows, accounted with RDP). Default: ``"poisson"``
        for ``"dpsgd"`` (at the automatic rate unless ``sampling_rate`` is given),
        ``"full"`` otherwise (``"poisson"`` if ``sampling_rate`` is given).
    :param float sampling_rate: in ``(0, 1]``; required for an explicit ``"poisson"`` or
        ``"without_replacement"``.
    :param float clip_norm: ``C``: bound on each per-example gradient wrt ``(loc,
        log_scale)`` (``"dpsgd"``) or each shard's change of natural parameters
        (``"local_avg"``, ``"virtual"``; default 1). ``None`` with ``"dpsgd"``: the automatic
        clip norm, in units of ``q``'s scale.
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

    **The default local optimiser.** Adam whose rate decays from 0.1 to 0.001 (cosine) over
    each local optimisation, on the location in units of the starting ``q``'s scale
    (``loc = loc_0 + scale_0 u``) and the log-scale; the new ``q`` is the average of the
    iterates over the second half of the steps. The steps are thus relative to ``q``'s width
    (the fit does not depend on the parameters' units), the decaying rate lets the iterates
    settle and the averaging removes most of their Monte Carlo jitter: on a conjugate linear
    regression the default run ends at the exact posterior within Monte Carlo error (a few
    hundredths of a posterior sd) where a constant rate of 0.01 stopped 0.1-0.4 sd short.
    ``result.metrics["residual"]`` holds, per round and client, the distance to the local
    optimum that the averaged gradient still points to (in units of ``q``'s scale); a
    non-private run warns when the last round's exceeds 0.25 (not converged: more
    ``num_local_steps`` or rounds). A user ``optim`` gets the plain optimisation.

    **Automatic DP-SGD settings.** With ``dp="dpsgd"`` and no ``sampling``,
    ``sampling_rate`` or ``clip_norm`` (only a budget, say), the run chooses:

    * *sampling*: Poisson, rate ``max(64 / n_min, 2 / (c sqrt(T)))`` (at most 1), where
      ``n_min`` is the smallest client's size, ``T`` the run's local steps and ``c`` the noise
      multiplier of one Gaussian mechanism spending the whole budget. DP-SGD over ``T``
      steps at rate ``r`` needs about ``sigma = c r sqrt(T)``: the noise per expected row,
      which is what the answer feels, does not depend on ``r``, so the rate buys cost (about
      64 rows per step) until ``sigma`` falls to 2, below which subsampling's amplification
      weakens. (Full batches, the former default, spend the same budget on 10-100 times the
      work.)
    * *clip norm*: each row's gradient is measured in units of the current ``q``'s width
      (location part times ``scale``) and clipped to ``8 sqrt(d / N_seen)``, where ``d`` is
      the number of latent dimensions and ``N_seen`` the rows whose information ``q`` holds
      at that update (the client's own and those of the clients before it in the first
      sequential round; all rows afterwards). Near the posterior the squared row gradients
      in these units sum to about ``d``, so a typical row's is ``sqrt(d / N)``; 8 times that
      leaves heavy-tailed rows (misclassified points of a logistic regression) unclipped
      often enough that clipping does not bias the fit (4 times did, by several sds).
      The clip norm depends on sizes only and adapts to the parameters' units.
    * *steps*: ``num_local_steps`` (100) with the default optimiser, whose averaging over
      the last 50 steps also averages the privacy noise.

    Before running, :meth:`predicted_dp_error` estimates from sizes only how far the privacy
    noise alone will move the means, in posterior sds; above 1 the automatic settings
    refuse (``ValueError``) with advice (raise ``target_epsilon``, fewer rounds, more rows,
    ``dp="virtual"`` with a trusted aggregator), and a user's settings get a
    ``RuntimeWarning``: the answer would be mostly noise. Measured: 4 clients of 250 rows
    of a logistic regression at ``epsilon = 1`` are refused (the former default answered
    2 sds off and 3-6 times too wide); 2 clients of 40,000 rows of a linear regression at
    ``epsilon = 4`` end within 0.3 posterior sds with sds within 15 %. The first round
    clips heavily while ``q`` is as wide as the prior: the automatic settings want at least
    2 rounds (one warns).

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
        >>> bool(result.metrics["last_move"].max() < 0.1)  # and so did q over the rounds
        True
        >>> draws = pvi.get_samples(jax.random.PRNGKey(2), result, 100)
        >>> draws["w"].shape
        (100, 2)

    Given only a budget, DP-SGD chooses its settings, or refuses when 400 rows cannot pay
    for it:

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
        num_local_steps: int = 100,
        num_mc_samples: int = 10,
        damping: float = 1.0,
        sampling: str | None = None,
        sampling_rate: float | None = None,
        clip_norm: float | None = None,
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
        if sampling is not None and sampling not in core.SAMPLING:
            raise ValueError(f"sampling must be one of {core.SAMPLING}, got {sampling!r}")
        # DP-SGD without a sampling scheme or a clip norm: chosen by the rule of
        # _auto_sampling_rate and _auto_clip_norms (see the class docstring).
        self.auto_sampling = dp == "dpsgd" and sampling is None and sampling_rate is None
        self.auto_clip = dp == "dpsgd" and clip_norm is None
        if sampling is None:
            sampling = "poisson" if dp == "dpsgd" or sampling_rate is not None else "full"
        self.model = model
        self.dp = dp
        self.schedule = schedule
        self.num_local_steps = check_int(num_local_steps, "num_local_steps", minimum=1)
        # The default local optimiser: scale-free steps, a decaying rate, iterate averaging.
        self.default_optim = optim is None
        self.optim = default_optimiser(self.num_local_steps) if optim is None else optim
        self.num_mc_samples = check_int(num_mc_samples, "num_mc_samples", minimum=1)
        self.damping = check_positive(damping, "damping")
        if self.damping > 1.0:
            raise ValueError(f"damping must lie in (0, 1], got {self.damping}")
        self.sampling = sampling
        if self.auto_sampling:
            self.sampling_rate = None  # resolved per run (sizes, rounds): _resolve
        elif sampling == "full":
            if sampling_rate not in (None, 1.0):
                raise ValueError("sampling='full' uses every row: leave sampling_rate unset")
            self.sampling_rate = 1.0
        else:
            if sampling_rate is None:
                raise ValueError(f"sampling={sampling!r} needs sampling_rate in (0, 1]")
            self.sampling_rate = check_sampling_rate(sampling_rate)
        if dp in ("local_avg", "virtual") and sampling != "full":
            raise ValueError(f"dp={dp!r} optimises every shard on all its rows: use sampling='full'")
        self.clip_norm = None if self.auto_clip else check_positive(1.0 if clip_norm is None else clip_norm, "clip_norm")
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
            if 0 < noise_multiplier < _MIN_NOISE_MULTIPLIER:
                # PLD accounting of 200 Poisson steps at sigma 0.1 gives epsilon ~ 2000 and takes
                # 20 s; at 1e-3 the accountant tries to allocate tens of GiB.
                raise ValueError(
                    f"noise_multiplier={noise_multiplier} gives no meaningful privacy (epsilon in "
                    f"the hundreds or more, which the accountant cannot compute in reasonable time "
                    f"and memory): use noise_multiplier >= {_MIN_NOISE_MULTIPLIER}, or dp=None"
                )
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
        local = [name for name, owner in potential.coordinate_owner_tree.items()
                 if (np.asarray(owner) >= 0).any()]
        if local:
            raise ValueError(
                f"{type(self).__name__} infers global latent variables only; site(s) {local} are "
                "client-local (inside a federated plate): a client's factor t_m cannot hold "
                "latents of its own. Use FedZigZag, which samples client-local latents"
            )
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

    # -- automatic DP-SGD settings ------------------------------------------------------------
    def _calibrate(self, make_event):
        """``calibrate_noise_multiplier`` for this run's budget, remembered per event."""
        cache = self.__dict__.setdefault("_sigma_cache", {})
        key = (repr(make_event(1.0)), self.target_epsilon, self.delta, self.accountant, self.neighbouring)
        if key not in cache:
            cache[key] = calibrate_noise_multiplier(
                make_event, self.target_epsilon, self._accounting_delta(),
                accountant=self.accountant, neighbouring=self.neighbouring,
            )
        return cache[key]

    def _auto_sampling_rate(self, num_rounds, sizes) -> float:
        """Poisson rate: ``_AUTO_BATCH`` expected rows per step in the smallest client (all
        rows if it has fewer), raised so that the calibrated noise multiplier is about
        ``_AUTO_MIN_NOISE`` or more: below it, subsampling stops paying for itself (and the
        accounting gets slow). With many steps, DP-SGD at rate ``r`` over ``T`` steps needs
        about ``sigma = c r sqrt(T)``, where ``c`` is the noise multiplier of a single
        Gaussian mechanism with the same budget: the floor is ``_AUTO_MIN_NOISE / (c sqrt(T))``."""
        rate = min(1.0, _AUTO_BATCH / float(np.min(sizes)))
        if self.target_epsilon is not None and self.noise_multiplier is None and num_rounds is not None:
            c = self._calibrate(lambda s: gaussian_event(s, 1))
            floor = _AUTO_MIN_NOISE / (c * np.sqrt(num_rounds * self.num_local_steps))
            rate = min(1.0, max(rate, floor))
        return float(rate)

    def _resolve(self, num_rounds, sizes):
        """Fixes the automatic sampling rate for a run of ``num_rounds`` on ``sizes``."""
        if self.auto_sampling:
            self.sampling_rate = self._auto_sampling_rate(num_rounds, np.asarray(sizes, int))

    def _auto_clip_norms(self, num_rounds, sizes, d, *, continuing=False) -> np.ndarray:
        """``(num_rounds, M)`` clip norms of the automatic rule: ``_AUTO_CLIP * sqrt(d / N_seen)``
        where ``N_seen`` counts the rows whose information the client's ``q`` holds at its
        update: its own and those of the clients before it in the first round (all of them
        in the first synchronous round: its own only), all rows afterwards."""
        sizes = np.asarray(sizes, float)
        seen = np.tile(sizes.sum(), (num_rounds, sizes.size))
        if not continuing:
            seen[0] = np.cumsum(sizes) if self.schedule == "sequential" else sizes
        return _AUTO_CLIP * np.sqrt(d / seen)

    def predicted_dp_error(self, noise_multipliers, num_rounds, client_sizes, num_latent) -> float:
        """The error the privacy noise alone is expected to put on ``q``'s means, in posterior
        standard deviations (a rule of thumb, computed from sizes only; ``0`` if non-private):

        ``kappa * sigma * sqrt(d * M / N) / (rate * sqrt(W)) * sqrt(rho / (2 - rho))``

        DP-SGD adds noise ``sigma * C`` per coordinate to a step's sum of clipped row
        gradients, rescaled by ``1 / rate``. Measured in units of ``q``'s width, a row's
        gradient is about ``sqrt(d / N)`` near the posterior and the local objective's
        curvature about 1; an average over ``W`` steps (the default optimiser's averaging
        window; 10 for a user optimiser) divides the noise by ``sqrt(W)``, the ``M`` clients'
        errors add up, and damping ``rho`` averages over rounds. ``kappa`` is the clip norm
        over that row gradient: ``_AUTO_CLIP`` for the automatic clip norm, 1 (the best case)
        for a user's. Update perturbation (``"local_avg"``, ``"virtual"``) is not covered
        (``nan``).
        """
        if self.dp is None:
            return 0.0
        if self.dp != "dpsgd":
            return float("nan")
        sizes = np.asarray(client_sizes, float)
        self._resolve(num_rounds, sizes)
        sigma = float(np.max(noise_multipliers))
        if self.sampling == "without_replacement":
            rate = float(np.min(self._batch_sizes(sizes) / sizes))
        else:
            rate = self.sampling_rate
        window = self.num_local_steps * (1 - _AVERAGE_FROM) if self.default_optim else _ADAM_WINDOW
        window = max(1.0, min(window, self.num_local_steps))
        kappa = _AUTO_CLIP if self.auto_clip else 1.0
        rho = self.damping
        damp = np.sqrt(rho / (2 - rho)) if num_rounds * rho >= 2 else 1.0
        return float(kappa * sigma * np.sqrt(num_latent * sizes.size / sizes.sum()) / (rate * np.sqrt(window)) * damp)

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
        self._resolve(num_rounds if self.noise_multiplier is None else None, sizes)
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
            sigma = self._calibrate(lambda s: self._client_events([s], num_rounds, np.array([n]))[0])
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
        self._resolve(num_rounds if self.noise_multiplier is None else None, sizes)
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
        d = potential.num_latent
        dp_error = self.predicted_dp_error(sigmas, num_rounds, sizes, d) if privacy is not None else 0.0
        if dp_error > _MAX_DP_ERROR:
            self._noise_dominates(dp_error, num_rounds, sizes)
        if self.auto_clip and num_rounds == 1 and init_state is None and type(self) is DPPVI:
            warnings.warn(
                "DPPVI(dp='dpsgd') with the automatic clip norm and one round: the first round "
                "clips heavily while q is still as wide as the prior, which biases it; run at "
                "least 2 rounds (the budget is calibrated for all of them)",
                RuntimeWarning, stacklevel=2,
            )
        num_clients = sizes.size
        key_shards, key_run = jax.random.split(rng_key)
        shard_seed = int(jax.random.randint(key_shards, (), 0, 2**31 - 1))
        shard_index, shard_valid = core.shard_layout(sizes, self.num_shards, seed=shard_seed)
        data = core.ClientData(rows=rows, valid=valid, shard_index=shard_index, shard_valid=shard_valid)
        config = core.LocalConfig(
            optim=self.optim, num_steps=self.num_local_steps, num_mc_samples=self.num_mc_samples,
            sampling=self.sampling, sampling_rate=self.sampling_rate, dpsgd=self.dp == "dpsgd",
            clip_norm=1.0 if self.auto_clip else self.clip_norm, standardise=self.default_optim,
            average_from=_AVERAGE_FROM if self.default_optim else 1.0, clip_scaled=self.auto_clip,
        )
        clip_norms = (
            jnp.asarray(self._auto_clip_norms(num_rounds, sizes, d, continuing=init_state is not None),
                        dtype=jnp.zeros(()).dtype)
            if self.auto_clip else [None] * num_rounds
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
            state, info = round_fn(keys[r], state, data, clip_norms[r])
            loc, scale = core.loc_scale(state.q)
            history.append((loc, scale, info.rejected, info.clipped, info.residual))
        state = self._final_state(state)
        if num_rounds:
            loc, scale = core.loc_scale(state.q)
            history[-1] = (loc, scale) + history[-1][2:]
        locs, scales, rejected, clipped, residual = (np.asarray(jnp.stack(x)) for x in zip(*history))
        metrics = {
            "loc": locs,
            "scale": scales,
            "rejected": rejected,
            "clipped": clipped,
            "residual": residual,
            "communications": np.arange(1, num_rounds + 1) * self._communications_per_round(potential),
            "predicted_dp_error": dp_error,
        }
        if not np.all(np.isfinite(locs[-1])) or not np.all(np.isfinite(scales[-1])):
            raise FloatingPointError(
                "DPPVI ended with a non-finite q: lower the optimiser's rate (optim) or, with "
                "privacy, raise the damping's effect (damping=0.2-0.5)"
            )
        if privacy is None and self.dp is None and residual[-1].max() > _MAX_RESIDUAL:
            warnings.warn(
                f"DPPVI: the local optimisation had not converged in the last round: its "
                f"gradient puts the optimum about {residual[-1].max():.2g} of q's scale away "
                f"(metrics['residual']; above {_MAX_RESIDUAL}): raise num_local_steps or run more "
                "rounds (or, with your own optim, a larger or decaying rate; num_mc_samples if "
                "the model is noisy)",
                RuntimeWarning, stacklevel=2,
            )
        if privacy is None and self.dp is None and num_rounds >= 2:
            # A mean-field PVI fixed point is reached like coordinate ascent: on a strongly
            # correlated posterior q's means still move a lot between rounds when the run
            # stops (the zoo's d = 20, condition number 1e3: 2.7 posterior sds short after 10
            # rounds), while each local fit has converged (residual small).
            # The move is averaged over the last (up to) 3 rounds: a steady drift keeps its
            # size while the round-to-round jitter of the stochastic local fits shrinks by
            # the span (one round's jitter alone reached 0.12 on a converged logistic run).
            span = min(_LAST_MOVE_SPAN, num_rounds - 1)
            moved = np.abs(locs[-1] - locs[-1 - span]) / (span * scales[-1])
            metrics["last_move"] = moved
            if moved.max() > _MAX_LAST_MOVE:
                j = int(np.argmax(moved))
                last = "in the last round" if span == 1 else f"over the last {span} rounds"
                warnings.warn(
                    f"DPPVI: q had not converged over the rounds: {last} its mean moved "
                    f"{moved[j]:.2g} of its scale per round (coordinate {j}; metrics['last_move'], above "
                    f"{_MAX_LAST_MOVE}), so it is still on its way (a strongly correlated posterior "
                    "converges slowly with one mean-field factor per client): run more rounds",
                    RuntimeWarning, stacklevel=2,
                )
        if _WARN_DP_ERROR < dp_error <= _MAX_DP_ERROR:
            warnings.warn(
                f"DPPVI(dp='dpsgd'): the privacy noise is expected to have moved q's means by "
                f"about {dp_error:.2g} posterior standard deviations (predicted_dp_error; measured "
                f"errors have been up to 5 times that), and q's scales do not include that noise: "
                "read the answer as approximate. For a closer one raise target_epsilon, run "
                "fewer rounds, or give the clients more rows",
                RuntimeWarning, stacklevel=2,
            )
        loc, scale = core.loc_scale(state.q)
        params = {"loc": unravel(loc), "scale": unravel(scale)}
        return DPPVIRunResult(params, state, metrics, privacy, sigmas)

    def _noise_dominates(self, dp_error, num_rounds, sizes):
        """Refuses (automatic settings) or warns (the user's settings): the privacy noise
        would dominate the answer."""
        budget = (f"target_epsilon={self.target_epsilon}" if self.target_epsilon is not None
                  else f"noise_multiplier={self.noise_multiplier}")
        message = (
            f"DPPVI(dp='dpsgd'): with {budget}, {num_rounds} round(s) of {self.num_local_steps} "
            f"local steps, {sizes.size} clients and {int(np.sum(sizes))} rows, the privacy noise "
            f"alone is expected to move each mean of q by about {dp_error:.2g} posterior standard "
            f"deviations (predicted_dp_error; more than {_MAX_DP_ERROR}): the answer would be "
            "mostly noise. Raise target_epsilon (the error scales about as 1/epsilon), run fewer "
            "rounds (as sqrt(num_rounds)), use damping=0.5 over several rounds, give the clients "
            "more rows (as 1/sqrt(rows)) or, for many small clients, use dp='virtual' with a "
            "trusted aggregator"
        )
        if self.auto_sampling and self.auto_clip:
            raise ValueError(message + "; or set sampling, sampling_rate and clip_norm yourself to run anyway")
        warnings.warn(message, RuntimeWarning, stacklevel=3)

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
    from numpyro_fed.arviz import from_dicts

    if not isinstance(method, DPPVI):
        raise TypeError("to_inference_data(DPPVIRunResult) needs method=<the DPPVI that ran it>")
    rng_key = jax.random.PRNGKey(0) if rng_key is None else rng_key
    draws = method.get_samples(rng_key, result, num_samples)
    posterior = {k: np.asarray(v)[None] for k, v in draws.items()}
    metrics = result.metrics
    rejected = np.asarray(metrics["rejected"])
    sample_stats = {
        "rejected": (rejected, ["round"] + (["client"] if rejected.ndim == 2 else [])),
        "clipped": (np.asarray(metrics["clipped"]), ["round", "client"]),
        "communications": (np.asarray(metrics["communications"]), ["round"]),
    }
    attrs = {"algorithm": "DPPVI", "dp": str(method.dp), "schedule": method.schedule,
             "num_rounds": int(np.asarray(metrics["communications"]).size)}
    attrs.update(federation_attrs(method.federated_potential))
    if result.privacy is not None:
        attrs.update(result.privacy.as_attrs())
        attrs["privacy_noise_multiplier"] = [float(s) for s in result.noise_multiplier]
    return from_dicts(posterior, sample_stats=sample_stats, attrs=attrs, **kwargs)


