"""DPPVI's budget-only rule: the DP-SGD settings a run chooses from public sizes only (rows
per client, dimension, clients, the budget), and the error the privacy noise is predicted to
put on ``q``'s means, fitted against measured errors (the guide's *DP-SGD given only a
budget* has the grid and the figures).

The prediction of DP-SGD's error, in posterior standard deviations (the largest over the
coordinates), is the root sum of squares of two terms:

* the privacy noise: ``A * kappa * (sigma / r) * d^1.5 * sqrt(M / N) / sqrt(W) * sqrt(rho / (2 - rho))``.
  A step adds noise ``sigma C`` per coordinate to a sum of clipped row gradients, rescaled by
  ``1 / r``; in units of ``q``'s width a row's gradient is about ``sqrt(d / N)`` near the
  posterior (the Fisher information sums to ``d``) and the local objective's curvature about
  1, so ``C = kappa sqrt(d / N)``; an average over ``W`` steps divides the noise by
  ``sqrt(W)``, the ``M`` clients' errors add, damping ``rho`` averages over rounds (when
  there are at least ``2 / rho`` of them). That reasoning gives ``sqrt(d)``; the measured
  largest errors grew faster (the largest of more coordinates, and clipping and the local
  optimization's own error growing with ``d``): ``d^1.5`` fitted the grid best;
* the subsampling noise of the local optimization: ``B * sqrt((1 - r) / (r W))`` (a Poisson
  batch at rate ``r`` estimates the client's gradient sum with variance ``(1 - r) / r``
  times the sum of the squared row gradients, about ``1 / M`` of the posterior's precision).

``A`` and ``B`` are fitted on the grid of the guide. With ``sigma / r`` about
``c sqrt(T)`` over ``T`` steps (``c`` the noise multiplier of one Gaussian mechanism with
the whole budget), the privacy term has a floor ``A kappa c d^1.5 sqrt(M / N)`` that no rate,
number of steps or rounds removes (every step averaged); the clip norm cannot go much below
``kappa = 8`` (clipping biased a logistic regression by 10-25 posterior sds at ``kappa``
2-3).
"""

from __future__ import annotations

import numpy as np

from numpyro_fed.infer.pvi.client import LocalConfig

__all__ = [
    "ADAM_WINDOW",
    "AUTO_BATCH",
    "AUTO_CLIP",
    "AUTO_MIN_NOISE",
    "AVERAGE_FROM",
    "FIT_NOISE",
    "FIT_SUBSAMPLING",
    "FIT_MAX_DIM",
    "MAX_DP_ERROR",
    "REFUSE_DP_ERROR",
    "auto_clip_norms",
    "auto_sampling_rate",
    "AUTO_DAMPING",
    "damping_factor",
    "default_damping",
    "dpsgd_error",
    "local_config",
    "noise_dominates_message",
    "refuses",
    "update_noise_error",
]

#: the default local optimizer averages the iterates from this share of the steps on
AVERAGE_FROM = 0.5
#: expected rows per step in the smallest client (all its rows if it has fewer): at 64 rows
#: the subsampling noise alone put the 5 x 4,000 logistic regression 1.1 posterior sds off
#: without any privacy noise, at 1,024 rows 0.57
AUTO_BATCH = 1024
#: smallest noise multiplier the automatic rate aims for (below it subsampling's
#: amplification weakens and the accounting slows down)
AUTO_MIN_NOISE = 2.0
#: clip norm over the typical scaled row gradient ``sqrt(d / rows seen)``: at 3 and 2 the
#: clipping bias alone put the 5 x 4,000 logistic regression 10-25 posterior sds off
AUTO_CLIP = 8.0
#: predicted error (posterior sds) above which the privacy noise dominates q's means: a run
#: warns before its first round (or refuses: ``REFUSE_DP_ERROR``)
MAX_DP_ERROR = 1.0
#: predicted error above which the automatic settings refuse, where the prediction was fitted
#: (``d <= FIT_MAX_DIM``): on the grid measured errors were at least 0.2 times the prediction,
#: so every run refused would have ended more than a posterior sd off. Between
#: ``MAX_DP_ERROR`` and this a run goes ahead and warns: on 5 x 4,000 rows, d = 5, epsilon = 1
#: (predicted 4.2) the means ended 3.0-3.6 posterior sds off while the held-out log predictive
#: density was within 0.001 nats/row of NUTS's
REFUSE_DP_ERROR = 5.0
#: the largest dimension of the grid the prediction was checked on (dense covariates; d = 20
#: measured 1.4-1.7 times it); beyond it the prediction is an extrapolation and a run warns
#: instead of refusing: on UCI Adult (d = 109, one-hot columns) it predicted 435 posterior sds
#: where the largest measured error was 17 and the median 1.6 (against the Laplace
#: approximation of the pooled posterior)
FIT_MAX_DIM = 20
#: damping of DP-SGD with the automatic clip norm: with 1, one of q's sds ended 17-1,500 times
#: the posterior's in 6 of the grid's 16 runs; with 0.5, in none
AUTO_DAMPING = 0.5
#: steps a user optimizer's last iterate is taken to average (Adam's momentum)
ADAM_WINDOW = 10
#: fitted factors of the privacy and subsampling terms (the guide's grid: 16 runs, measured
#: errors 0.6-2.8 times the prediction but for one run 0.2)
FIT_NOISE = 0.2
FIT_SUBSAMPLING = 1.5


def auto_sampling_rate(min_rows: int, single_sigma: float | None, num_steps: int | None) -> float:
    """The automatic Poisson rate: ``AUTO_BATCH`` expected rows per step in the smallest
    client (all of them if it has fewer), raised so that the calibrated noise multiplier is
    about ``AUTO_MIN_NOISE`` or more. DP-SGD at rate ``r`` over ``T`` steps needs about
    ``sigma = c r sqrt(T)`` (``single_sigma`` is ``c``; ``None`` without a budget): the
    floor is ``AUTO_MIN_NOISE / (c sqrt(T))``.

    >>> auto_sampling_rate(4000, None, None)
    0.256
    """
    rate = min(1.0, AUTO_BATCH / float(min_rows))
    if single_sigma is not None and num_steps is not None:
        rate = max(rate, AUTO_MIN_NOISE / (single_sigma * np.sqrt(num_steps)))
    return float(min(1.0, rate))


def auto_clip_norms(num_rounds: int, sizes, d: int, *, sequential: bool, continuing: bool = False) -> np.ndarray:
    """``(num_rounds, M)`` clip norms in units of ``q``'s width: ``AUTO_CLIP * sqrt(d /
    N_seen)``, ``N_seen`` the rows whose information the client's ``q`` holds at its update
    (its own and the earlier clients' in the first sequential round, its own in the first
    synchronous one, all rows afterwards)."""
    sizes = np.asarray(sizes, float)
    seen = np.tile(sizes.sum(), (num_rounds, sizes.size))
    if not continuing:
        seen[0] = np.cumsum(sizes) if sequential else sizes
    return AUTO_CLIP * np.sqrt(d / seen)


def default_damping(automatic: bool) -> float:
    """``damping=None``: ``AUTO_DAMPING`` for DP-SGD with a budget and the automatic clip
    norm (given only a budget, or with a sampling rate too), else 1."""
    return AUTO_DAMPING if automatic else 1.0


def damping_factor(damping: float, num_rounds: int) -> float:
    """How much damping ``rho`` averages the noise of the rounds: ``sqrt(rho / (2 - rho))``
    when there are at least ``2 / rho`` of them, else 1."""
    return float(np.sqrt(damping / (2 - damping))) if num_rounds * damping >= 2 else 1.0


def dpsgd_error(
    sigma: float, rate: float, sizes, num_latent: int, *, window: float, automatic: bool, damping: float, rounds: int
) -> float:
    """DP-SGD's predicted error on ``q``'s means, in posterior sds: the module's fitted
    formula for the automatic clip norm (``kappa = AUTO_CLIP``); for a user's clip norm,
    whose ratio to the row gradients is unknown, the best case (``kappa = 1``, the unfitted
    ``sqrt(d)`` reasoning, ``A = 1``), a lower bound."""
    sizes = np.asarray(sizes, float)
    window = max(1.0, float(window))
    if automatic:
        spread = FIT_NOISE * AUTO_CLIP * num_latent**1.5
    else:
        spread = np.sqrt(num_latent)
    noise = spread * sigma / rate * np.sqrt(sizes.size / sizes.sum()) / np.sqrt(window)
    noise *= damping_factor(damping, rounds)
    subsampling = FIT_SUBSAMPLING * np.sqrt((1.0 - rate) / (rate * window))
    return float(np.hypot(noise, subsampling))


def update_noise_error(per_client_noise: float, num_clients: int, scale, damping: float, num_rounds: int) -> float:
    """Update perturbation (``"local_avg"``, ``"virtual"``): the noise's expected error on
    ``q``'s means in ``q``'s sds, ``per_client_noise * sqrt(M) * max(scale)`` times the
    damping factor (each client's noise on ``q``'s first natural parameter ``mu / s^2``
    moves a mean by ``s`` times its noise in units of ``s``)."""
    return float(per_client_noise * np.sqrt(num_clients) * np.max(scale) * damping_factor(damping, num_rounds))


def refuses(dp_error: float, num_latent: int) -> bool:
    """Whether the automatic settings refuse a run predicted ``dp_error`` posterior sds off:
    above ``REFUSE_DP_ERROR`` where the prediction was fitted (``num_latent <= FIT_MAX_DIM``).

    >>> refuses(13.0, 5), refuses(4.2, 5), refuses(435.0, 109)
    (True, False, False)
    """
    return bool(dp_error > REFUSE_DP_ERROR and num_latent <= FIT_MAX_DIM)


def noise_dominates_message(
    budget: str, dp_error: float, num_rounds, num_local_steps, sizes, floor: float, *, verdict: str | None = None
) -> str:
    """The refusal's (or warning's) text: what the noise would do and what to change;
    ``verdict`` replaces "the answer would be mostly noise" (a run that goes ahead)."""
    verdict = "the answer would be mostly noise" if verdict is None else verdict
    return (
        f"DPPVI(dp='dpsgd'): with {budget}, {num_rounds} round(s) of {num_local_steps} "
        f"local steps, {sizes.size} clients and {int(np.sum(sizes))} rows, the privacy noise "
        f"is expected to move the means of q by up to about {dp_error:.2g} posterior standard "
        f"deviations (predicted_dp_error; more than {MAX_DP_ERROR}): {verdict}. "
        + (
            f"No choice of rate, steps or rounds brings it below about {floor:.2g} for these sizes and "
            "this budget (at the automatic clip norm). "
            if np.isfinite(floor)
            else ""
        )
        + "Raise target_epsilon (the error scales about as "
        "1/epsilon), give the clients more rows (as 1/sqrt(rows)), account under "
        "neighboring='add_remove' if that relation is acceptable (half the noise) or, for many "
        "small clients, use dp='virtual' with a trusted aggregator"
    )


def local_config(method, *, newton_start: int = 0) -> LocalConfig:
    """The local optimization's settings of a :class:`~numpyro_fed.DPPVI` run (its
    validated attributes): the default optimizer runs in units of ``q``'s scale and averages
    its iterates from ``AVERAGE_FROM`` of the steps on; the automatic clip norm is in units of
    ``q``'s width (the per-client norms travel in the clients' blocks, so the configured one
    is 1)."""
    return LocalConfig(
        optim=method.optim,
        num_steps=method.num_local_steps,
        num_mc_samples=method.num_mc_samples,
        sampling=method.sampling,
        sampling_rate=method.sampling_rate,
        dpsgd=method.dp == "dpsgd",
        clip_norm=1.0 if method.auto_clip else method.clip_norm,
        standardize=method.default_optim,
        average_from=AVERAGE_FROM if method.default_optim else 1.0,
        newton_start=newton_start,
        clip_scaled=method.auto_clip,
    )
