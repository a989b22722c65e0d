"""DPPVI's privacy side: the automatic DP-SGD settings (the rule is
:mod:`~numpyro_fed.infer.pvi.dp_defaults`), noise calibration, the Poisson batch cap and the
accounting of a run with ``dp-accounting`` (the mixin :class:`PrivacyAccounting` that
:class:`~numpyro_fed.DPPVI` and its baselines inherit)."""

from __future__ import annotations

import warnings

import numpy as np

import jax

from numpyro_fed.infer.pvi import dp_defaults
from numpyro_fed.infer.pvi.dp_defaults import ADAM_WINDOW, AUTO_CLIP, AVERAGE_FROM, MAX_DP_ERROR
from numpyro_fed.privacy.accounting import (
    calibrate_noise_multiplier,
    compute_epsilon,
    describe_accountant,
    dpsgd_event,
    gaussian_event,
    privacy_guarantee,
)
from numpyro_fed.privacy.guarantee import NOT_COVERED, PrivacyGuarantee
from numpyro_fed.privacy.randomness import PrivateSeed, draw_seeds, private_program, resolve_private_randomness

__all__ = ["PrivacyAccounting"]

# Share of delta that covers capping Poisson batches (see PrivacyAccounting.batch_cap).
CAP_DELTA_SHARE = 1e-6


class PrivacyAccounting:
    """The privacy methods of :class:`~numpyro_fed.DPPVI` (a mixin: it reads the settings the
    constructor validated: ``dp``, ``sampling``, ``sampling_rate``, ``num_local_steps``,
    ``noise_multiplier``, ``target_epsilon``, ``delta``, ``accountant``, ``neighboring``,
    ``schedule``, ``damping``, ``trusted_aggregator``, ``auto_sampling``, ``auto_clip``,
    ``default_optim``)."""

    # -- automatic DP-SGD settings ------------------------------------------------------------
    def _calibrate(self, make_event):
        """``calibrate_noise_multiplier`` for this run's budget, remembered per event."""
        cache = self.__dict__.setdefault("_sigma_cache", {})
        key = (repr(make_event(1.0)), self.target_epsilon, self.delta, self.accountant, self.neighboring)
        if key not in cache:
            cache[key] = calibrate_noise_multiplier(
                make_event,
                self.target_epsilon,
                self._accounting_delta(),
                accountant=self.accountant,
                neighbouring=self.neighboring,
            )
        return cache[key]

    def _resolve(self, num_rounds, sizes):
        """Fixes the automatic sampling rate for a run of ``num_rounds`` on ``sizes``
        (:func:`~numpyro_fed.infer.pvi.dp_defaults.auto_sampling_rate`)."""
        if self.auto_sampling:
            single = steps = None
            if self.target_epsilon is not None and self.noise_multiplier is None and num_rounds is not None:
                single, steps = self.single_noise_multiplier(), num_rounds * self.num_local_steps
            self.sampling_rate = dp_defaults.auto_sampling_rate(int(np.min(sizes)), single, steps)

    def single_noise_multiplier(self) -> float:
        """``c``: the noise multiplier of one Gaussian mechanism spending the whole budget."""
        return self._calibrate(lambda s: gaussian_event(s, 1))

    def auto_clip_norms(self, num_rounds, sizes, d, *, continuing=False) -> np.ndarray:
        """``(num_rounds, M)`` clip norms of the automatic rule
        (:func:`~numpyro_fed.infer.pvi.dp_defaults.auto_clip_norms`)."""
        sequential = self.schedule == "sequential"
        return dp_defaults.auto_clip_norms(num_rounds, sizes, d, sequential=sequential, continuing=continuing)

    def _averaging_window(self) -> float:
        window = self.num_local_steps * (1 - AVERAGE_FROM) if self.default_optim else ADAM_WINDOW
        return max(1.0, min(window, self.num_local_steps))

    def predicted_dp_error(self, noise_multipliers, num_rounds, client_sizes, num_latent) -> float:
        """The error the privacy noise and the local optimization's subsampling are expected
        to put on ``q``'s means, in posterior standard deviations, the largest over the
        coordinates (computed from sizes only; ``0`` if non-private): the formula of
        :mod:`~numpyro_fed.infer.pvi.dp_defaults`, fitted to measured errors for the
        automatic clip norm (for a user's, a best-case lower bound), with ``W`` the default
        optimizer's averaging window (10 for a user's optimizer). Update perturbation (``"local_avg"``,
        ``"virtual"``) depends on ``q``'s scale, known only as the run goes: ``nan`` here,
        and each round's :meth:`update_noise_error` in the run's metrics.
        """
        if self.dp is None:
            return 0.0
        if self.dp != "dpsgd":
            return float("nan")
        sizes = np.asarray(client_sizes, float)
        self._resolve(num_rounds, sizes)
        if self.sampling == "without_replacement":
            rate = float(np.min(self._batch_sizes(sizes) / sizes))
        else:
            rate = self.sampling_rate
        return dp_defaults.dpsgd_error(
            float(np.max(noise_multipliers)),
            rate,
            sizes,
            num_latent,
            window=self._averaging_window(),
            automatic=self.auto_clip,
            damping=self.damping,
            rounds=num_rounds,
        )

    def dp_error_floor(self, client_sizes, num_latent) -> float:
        """The privacy term's floor for these sizes and budget, whatever the rate, steps and
        rounds: every step of the run averaged (``sigma / r = c sqrt(T)``, ``W = T``), at the
        automatic clip norm; ``nan`` without a ``target_epsilon``."""
        sizes = np.asarray(client_sizes, float)
        c = self.single_noise_multiplier() if self.target_epsilon is not None else float("nan")
        return float(dp_defaults.FIT_NOISE * AUTO_CLIP * c * num_latent**1.5 * np.sqrt(sizes.size / sizes.sum()))

    def update_noise_error(self, noise_multipliers, num_rounds, num_clients, scale) -> float:
        """Update perturbation (``"local_avg"``, ``"virtual"``): the error the privacy noise
        alone is expected to put on ``q``'s means, in ``q``'s standard deviations ``scale``
        (a rule of thumb; ``0`` for other variants):

        ``sigma * C * sqrt(M) / (K_avg * D) * max(scale) * sqrt(rho / (2 - rho))``

        Each client adds noise ``sigma * C`` per natural parameter to its clipped change
        (divided by the ``K`` shards it averages with ``"local_avg"``, by ``D = sqrt(M)``
        with a trusted aggregator); the ``M`` clients' noises add up on ``q``'s first natural
        parameter ``mu / s^2``, which moves a mean by ``s`` times its noise in units of
        ``s``; damping ``rho`` averages over rounds. Measured errors were up to about 5 times
        the rule (clipping adds its own bias: see the ``clipped`` metric)."""
        if self.dp not in ("local_avg", "virtual"):
            return 0.0
        per_client = float(np.max(noise_multipliers)) * (1.0 if self.clip_norm is None else self.clip_norm)
        if self.dp == "local_avg":
            per_client /= self.num_shards
        if self.trusted_aggregator:
            per_client /= np.sqrt(num_clients)
        return dp_defaults.update_noise_error(per_client, num_clients, scale, self.damping, num_rounds)

    def _batch_sizes(self, sizes):
        return np.maximum(1, np.round(self.sampling_rate * sizes)).astype(int)

    def _client_events(self, sigmas, num_rounds, sizes):
        if self.dp == "dpsgd":
            steps = num_rounds * self.num_local_steps
            batch_sizes = self._batch_sizes(sizes)
            return [
                dpsgd_event(
                    float(s),
                    steps,
                    dataset_size=int(n),
                    batch_size=int(b),
                    sampling_rate=self.sampling_rate,
                    sampling=self.sampling,
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
                lambda s: gaussian_event(s, num_rounds),
                self.target_epsilon,
                self.delta,
                accountant=self.accountant,
                neighbouring=self.neighboring,
            )
            return np.full(sizes.size, sigma)
        out = np.zeros(sizes.size)
        keys = [
            (int(n), int(b)) if self.sampling == "without_replacement" else 0
            for n, b in zip(sizes, self._batch_sizes(sizes))
        ]
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
        # Poisson batches are capped (see batch_cap): a 1e-6 share of delta covers the cap.
        if self.dp == "dpsgd" and self.sampling == "poisson":
            return self.delta * (1.0 - CAP_DELTA_SHARE)
        return self.delta

    def batch_cap(self, guarantee, num_rounds, sizes, num_rows) -> int | None:
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
        budget = CAP_DELTA_SHARE * self.delta / (steps * (1.0 + np.exp(epsilon)))
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
                    e, self._accounting_delta(), accountant=self.accountant, neighbouring=self.neighboring
                )
            epsilons.append(cache[key])
        accountant = self.accountant or ("rdp" if self.sampling == "without_replacement" else "pld")
        if self.dp == "dpsgd":
            steps = num_rounds * self.num_local_steps
            mechanism = f"DP-SGD on each client's rows, {steps} steps per client (Theorem 6)"
            scope = "the whole run: every row, through all the client holding it sends"
        else:
            theorem = {"local_avg": "Theorem 7", "virtual": "Theorem 12"}[self.dp]
            if self.trusted_aggregator:
                theorem = {"local_avg": "Theorem 11", "virtual": "Theorem 14"}[self.dp]
            steps = num_rounds
            mechanism = f"Gaussian mechanism on clipped updates, {num_rounds} per client ({theorem})"
            scope = (
                "the whole run: every row, through the sums of the clients' updates that a "
                "trusted aggregator releases (each client's own message carries 1/sqrt(M) of "
                "the noise)"
                if self.trusted_aggregator
                else "the whole run: every row, through all the client holding it sends"
            )
        name, tolerance = describe_accountant(accountant)
        private_keys = self.client_private_randomness()
        return privacy_guarantee(
            max(epsilons),
            self.delta,
            scope=scope,
            neighbouring=self.neighboring,
            method=f"dp-accounting {accountant.upper()} accountant; {mechanism}{self._prior_factor_note()}",
            accountant=name,
            tolerance=tolerance,
            sampling=self._sampling_statement(sizes),
            noise_multipliers=tuple(float(s) for s in noise_multipliers),
            clip_norms=() if self.auto_clip else (float(self.clip_norm),),
            steps=int(steps),
            rounds=int(num_rounds),
            client_private_randomness=private_keys,
            not_covered=self._not_covered(private_keys),
            events=tuple(events),
            reserved_delta=self.delta - self._accounting_delta(),
        )

    def client_private_randomness(self) -> bool:
        """Whether the clients draw their noise and batches from keys of their own (see
        :mod:`numpyro_fed.privacy.randomness`): ``private_randomness`` when given, else
        whenever the clients are parties apart from the server (an engine, or ``loader=``)."""
        return self.dp is not None and resolve_private_randomness(self.private_randomness, self.federation, True)

    def _sampling_statement(self, sizes) -> str:
        """How the rows entering each noised release are drawn, as the clients do it and as
        it is accounted."""
        if self.dp != "dpsgd":
            shards = f"split into {self.num_shards} fixed shards (the split is public), " if self.num_shards > 1 else ""
            return (
                f"none accounted: each update is computed from all of a client's rows, {shards}each "
                "shard's change clipped, then noised; the local optimization's minibatches are inside the "
                "released update and cost nothing extra"
            )
        if self.sampling == "poisson":
            return (
                f"Poisson: each row joins each step's batch independently with probability "
                f"{self.sampling_rate:.4g}, accounted as Poisson subsampling; a batch above a size cap "
                f"(set so it binds with probability within {CAP_DELTA_SHARE:g} of delta over the run) "
                "is truncated, and that share of delta covers it"
            )
        if self.sampling == "without_replacement":
            batches = sorted(set(self._batch_sizes(np.asarray(sizes)).tolist()))
            return (
                f"fixed-size batches of {', '.join(map(str, batches))} row(s) per step, drawn uniformly "
                "without replacement from the client's rows, accounted as sampling without replacement"
            )
        return "none: every row of the client in every step"

    def _not_covered(self, private_keys: bool) -> str:
        if private_keys:
            return NOT_COVERED
        return f"{NOT_COVERED}; the server, which chose the keys of the clients' noise and batches"

    def settle_privacy(self, privacy, clip_first=None, clip_later=None):
        """The run's guarantee with what :meth:`privacy` cannot know (the automatic clip
        norms, in units of ``q``'s scale), checked against the budget (a run that would
        exceed it is refused here, before it starts)."""
        if privacy is None:
            return None
        if clip_first is not None:
            privacy = privacy.replace(
                clip_norms=tuple(float(c) for c in np.concatenate([np.ravel(clip_first), np.ravel(clip_later)])),
                method=privacy.method + "; clip norms in units of q's scale (the first round's, then the later ones')",
            )
        if self.budget is not None:
            self.budget.check(privacy, what=f"this {type(self).__name__} run")
        return privacy

    def private_spec(self, spec, privacy):
        """``spec`` (a :class:`~numpyro_fed.infer.base.ClientSpec`) with each client's seed
        folded into the key of its updates (:func:`~numpyro_fed.privacy.randomness.private_program`)
        when the run's randomness is client-private. The seed is drawn where the block is
        built: on the client with a loader; in this process for blocks cut here (simulation,
        where this process holds every row anyway)."""
        if privacy is None or not privacy.client_private_randomness:
            return spec
        # update(block, own, q, thetas, [first,] key, applied): the key follows q, the loss's
        # draws (DPPVI's clients take them, loss_draws=True) and first
        key_index = 2 + bool(self.auto_clip)
        functions, stateful = private_program(spec.functions, spec.stateful, keys={"update": key_index})
        if spec.blocks is not None:
            num = len(jax.tree_util.tree_leaves(spec.blocks)[0])
            return spec._replace(
                functions=functions, stateful=stateful, blocks={"rows": spec.blocks, "seed": draw_seeds(num)}
            )
        return spec._replace(functions=functions, stateful=stateful, transform=PrivateSeed(spec.transform))

    def _prior_factor_note(self) -> str:
        """What the guarantee says of the server's prior factor (a non-Gaussian or improper
        prior): its refinement reads no rows, so it is not charged."""
        if not getattr(self, "has_prior_factor", False):
            return ""
        return (
            "; the server's refinements of the prior factor (a non-Gaussian or improper prior) "
            "read no rows and are not charged: only the clients' updates are accounted"
        )

    def planned_dp_error(self, sigmas, num_rounds, sizes, num_latent, privacy) -> float:
        """The run's :meth:`predicted_dp_error` (``0`` without a guarantee); past
        ``MAX_DP_ERROR`` the privacy noise would dominate ``q``'s means: the run warns before
        its first round, or, with the automatic settings where the prediction was fitted and
        past ``REFUSE_DP_ERROR`` (:func:`~numpyro_fed.infer.pvi.dp_defaults.refuses`),
        refuses."""
        if privacy is None:
            return 0.0
        dp_error = self.predicted_dp_error(sigmas, num_rounds, sizes, num_latent)
        if not dp_error > MAX_DP_ERROR:
            return dp_error
        budget = (
            f"target_epsilon={self.target_epsilon}"
            if self.target_epsilon is not None
            else f"noise_multiplier={self.noise_multiplier}"
        )
        automatic = self.auto_sampling and self.auto_clip
        extrapolated = num_latent > dp_defaults.FIT_MAX_DIM
        # beyond the grid the floor is as far extrapolated as the prediction: not stated
        floor = float("nan") if extrapolated else self.dp_error_floor(sizes, num_latent)
        args = (budget, dp_error, num_rounds, self.num_local_steps, sizes, floor)
        if automatic and dp_defaults.refuses(dp_error, num_latent):
            message = dp_defaults.noise_dominates_message(*args)
            raise ValueError(message + "; or set sampling, sampling_rate and clip_norm yourself to run anyway")
        if not automatic:  # the user's clip norm: the prediction is a lower bound
            verdict = None
        elif extrapolated:
            verdict = (
                f"going ahead, as the prediction is extrapolated beyond the {dp_defaults.FIT_MAX_DIM} "
                "coordinates of the grid it was checked on and can be far too high (UCI Adult, 109 "
                "coordinates: predicted 435, measured 17 at most and 1.6 at the median); still, read "
                "q's means as noisy and its scales as leaving that noise out"
            )
        else:
            verdict = (
                "going ahead, but q's means will be noisy (measured 0.2 to 2.5 times the prediction on "
                "a benchmark grid) and its scales leave that noise out; predictions can stay close (5 "
                "clients x 4,000 rows, 5 coefficients, epsilon 1: predicted 4.2, measured 3.0-3.6, "
                "held-out log predictive density within 0.001 nats/row of NUTS's)"
            )
        message = dp_defaults.noise_dominates_message(*args, verdict=verdict)
        warnings.warn(message, RuntimeWarning, stacklevel=5)  # run -> init -> plan_clients -> here
        return dp_error

    def clip_bounds(self, sizes, d):
        """``(first, later)``: each client's automatic clip norm (in units of ``q``'s width)
        in the first round and afterwards, ``(None, None)`` with a user's clip norm."""
        if not self.auto_clip:
            return None, None
        dtype = jax.numpy.zeros(()).dtype
        first = jax.numpy.asarray(self.auto_clip_norms(1, sizes, d)[0], dtype=dtype)
        return first, jax.numpy.asarray(self.auto_clip_norms(1, sizes, d, continuing=True)[0], dtype=dtype)

    def warn_one_round(self, num_rounds: int, continuing: bool) -> None:
        """The automatic clip norm over one round: the first round clips heavily while ``q``
        is still as wide as the prior."""
        if self.auto_clip and num_rounds == 1 and not continuing:
            warnings.warn(
                "DPPVI(dp='dpsgd') with the automatic clip norm and one round: the first round "
                "clips heavily while q is still as wide as the prior, which biases it; run at "
                "least 2 rounds (the budget is calibrated for all of them)",
                RuntimeWarning,
                stacklevel=3,
            )
