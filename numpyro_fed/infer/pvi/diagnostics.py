"""How a :class:`~numpyro_fed.DPPVI` run is judged at its end: whether the local fits and
``q`` had converged (non-private runs) and whether the privacy noise or clipping dominate
the answer, each said with a ``RuntimeWarning`` that names what to change. Pure functions
of the run's metrics; the thresholds come from the measurements in ``docs/guide/dppvi.md``."""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import numpy as np

from numpyro_fed.infer.pvi.accounting import MAX_DP_ERROR

__all__ = [
    "FAILED_FIT_RESIDUAL",
    "PARETO_K_LIMIT",
    "PARETO_K_MOVED",
    "ImportanceCheck",
    "importance_check",
    "judge_run",
    "last_move",
    "mean_field_inflation",
    "warn_importance",
    "warn_mean_field",
]

# predicted_dp_error above which a run that goes ahead warns at its end (above MAX_DP_ERROR it
# has warned before its first round): measured errors were 0.2 to 2.5 times the prediction on
# the grid it was fitted to (docs/guide/dppvi.md; up to 5 times the earlier formula's), so 0.2
# can mean half a posterior sd and more off the grid.
WARN_DP_ERROR = 0.2
MAX_LAST_MOVE = 0.1  # non-private: largest move of q's means per round, in q's scales,
LAST_MOVE_SPAN = 3  # averaged over the last 3 rounds (or fewer in a shorter run)
MOSTLY_CLIPPED = 0.99  # update perturbation: share of clipped changes that bounds q's moves
MAX_RESIDUAL = 0.25  # local-optimization residual (in q's scales) above which it has not converged
# residual above which a non-private run's server does not apply a client's update at all (the
# fit failed: core.accepts). Converged fits end near 0.01-0.05; on kidiq_interaction over 8
# clients in float32 one fit ended non-finite and, applied, the next four ended 350 to 1.9e4
# scales away and q ran to alpha = -48,000
FAILED_FIT_RESIDUAL = 100.0
# largest single-round move of q's means (in q's scales) over the last LAST_MOVE_SPAN rounds:
# above it the rounds' answers scatter by more than q's width (a Student-t's log nu in float32
# jumped 1.9 and 2.3 scales between rounds while last_move, a net move, read 0.016); converged
# runs jittered 0.1-0.2
MAX_JUMP = 1.0
# A mean-field q's sds on a Gaussian posterior are 1 / sqrt(precision_ii), the posterior's
# sqrt(covariance_ii): above this ratio (q's sds below 0.83 of the truth) the run warns.
MAX_MEAN_FIELD_INFLATION = 1.2
# The importance check (Yao, Vehtari, Simpson & Gelman 2018, "Yes, but did it work?"): above
# this Pareto k-hat of the ratios p / q at q's draws, q's tails are too light for importance
# weights to be trusted (their own rule), and the run warns where the Pareto-smoothed weights
# also move a global coordinate's mean by more than IMPORTANCE_MEAN_SHIFT of its weighted sd
# or its sd by more than IMPORTANCE_SD_RATIO (the mean-field check's 1.2), or wherever k-hat
# is above PARETO_K_UNBOUNDED. Measured (docs/guide/dppvi.md, *Did it work?*): on the real
# zoo's 48 DPPVI cells, the 40 of the regressions and the mixture (q's sds 0.78-1.09 of NUTS's)
# read 0.08-0.72 and none warns; radon's 4 (sds 0.52-0.56) read 1.19-1.47 and warn; eight
# schools' 4 (sds 0.62-0.66) read 0.43-0.98, 2 warn (the mean-field check warns on all 4).
# Those were mean-field q's of the hierarchical models; with the structured default and
# PARETO_K_MOVED below, the 40 still do not warn and all 8 hierarchical cells do.
PARETO_K_LIMIT = 0.7
# Below PARETO_K_LIMIT the weights are reliable, and a k-hat above PARETO_K_MOVED already
# allows q's sd to be short of the posterior's by the variational targets' factor 1.5: for
# Gaussian tails k = 1 - (sd_q / sd_p)^2, 5/9 at sd_q / sd_p = 1/1.5. Between the two the run
# warns where the weights move a mean or an sd as above. Measured: the structured q on eight
# schools in float32 (tau's sd 0.64 of NUTS's) read k-hat 0.557-0.566 and weights putting tau's
# sd at 1.27-1.28 times q's, and said nothing with the 0.7 gate alone.
PARETO_K_MOVED = 0.5
PARETO_K_UNBOUNDED = 1.0  # above it the ratios have no finite mean: warned whatever the weights say
IMPORTANCE_MEAN_SHIFT = 0.3
IMPORTANCE_SD_RATIO = 1.2


def last_move(start_loc, locs, scales):
    """``(num_rounds, d)``: per round, the move of ``q``'s means per round over the last (up
    to) ``LAST_MOVE_SPAN`` rounds, in units of its scales; the first round's from the start.
    A steady drift keeps its size while the round-to-round jitter of the stochastic local fits
    shrinks by the span (one round's jitter alone reached 0.12 on a converged logistic run)."""
    history = np.concatenate([np.asarray(start_loc)[None], locs])
    out = np.empty_like(locs)
    for r in range(locs.shape[0]):
        span = max(1, min(LAST_MOVE_SPAN, r))
        out[r] = np.abs(history[r + 1] - history[r + 1 - span]) / (span * scales[r])
    return out


def judge_run(dp, metrics: dict, *, private: bool, clip_norm, stacklevel: int = 1) -> None:
    """The end-of-run warnings of a run with privacy variant ``dp`` and per-round
    ``metrics`` (``private``: whether it has a privacy guarantee); ``stacklevel`` as
    :func:`warnings.warn`'s, counted from the caller of this function."""
    level = stacklevel + 2  # the warning's function and this one
    if _warn_failed(metrics, level):
        return  # the other checks would only repeat it
    if not private and dp is None:
        _warn_unconverged(metrics, level)
    dp_error = float(metrics["predicted_dp_error"][-1])
    if dp in ("local_avg", "virtual") and private:
        _warn_update_perturbation(dp, dp_error, float(np.mean(metrics["clipped"][-1])), clip_norm, level)
    elif WARN_DP_ERROR < dp_error <= MAX_DP_ERROR:
        warnings.warn(
            f"DPPVI(dp='dpsgd'): the privacy noise is expected to have moved q's means by "
            f"about {dp_error:.2g} posterior standard deviations (predicted_dp_error; measured "
            f"errors have been 0.6 to 2.5 times that on a benchmark grid, possibly more off it), and q's "
            f"scales do not include that noise: "
            "read the answer as approximate. For a closer one raise target_epsilon, run "
            "fewer rounds, or give the clients more rows",
            RuntimeWarning,
            stacklevel=level - 1,
        )


def _warn_failed(metrics, stacklevel) -> bool:
    """Whether the last round failed (and a warning said so): a client's local fit ended
    non-finite, the loss of ``q`` is not finite, or every coordinate of every update was
    refused (each would have made ``q`` improper), so that ``q`` stayed where it was."""
    residual = np.asarray(metrics["residual"])[-1]
    loss = float(np.asarray(metrics["loss"])[-1])
    rejected = np.asarray(metrics["rejected"])[-1]
    dim = np.asarray(metrics["loc"]).shape[-1]
    problems = []
    if not np.all(np.isfinite(residual)):
        problems.append(
            f"the local fits of client(s) {np.flatnonzero(~np.isfinite(residual)).tolist()} ended non-finite"
        )
    if not math.isfinite(loss):
        problems.append(f"the loss of q is {loss}")
    if np.all(rejected >= dim):
        problems.append("every coordinate of every update was refused (it would have made q improper)")
    if not problems:
        return False
    warnings.warn(
        "DPPVI: the last round failed: " + "; ".join(problems) + ". q is not an approximation of the "
        "posterior. Clients with fewer rows than coefficients, or covariates on very different scales, "
        "make the local fits ill-posed: try float64, covariance='full', a smaller learning rate or "
        "damping, more num_local_steps, or fewer clients",
        RuntimeWarning,
        stacklevel=stacklevel,
    )
    return True


def _warn_unconverged(metrics, stacklevel):
    """A non-private run: the local fits of the last round, and ``q`` over the rounds."""
    residual = metrics["residual"]
    if metrics.get("prior_residual") is not None:  # the server's refinement of the prior factor
        residual = np.concatenate([residual, np.asarray(metrics["prior_residual"]).reshape(-1, 1)], axis=1)
    if residual[-1].max() > MAX_RESIDUAL:
        warnings.warn(
            f"DPPVI: the local optimization had not converged in the last round: its "
            f"gradient puts the optimum about {residual[-1].max():.2g} of q's scale away "
            f"(metrics['residual']; above {MAX_RESIDUAL}): raise num_local_steps or run more "
            "rounds (or, with your own optim, a larger or decaying rate; num_mc_samples if "
            "the model is noisy)",
            RuntimeWarning,
            stacklevel=stacklevel,
        )
    num_rounds = residual.shape[0]
    if num_rounds < 2:
        return
    # A mean-field PVI fixed point is reached like coordinate ascent: on a strongly
    # correlated posterior q's means still move a lot between rounds when the run stops (the
    # zoo's d = 20, condition number 1e3: 2.7 posterior sds short after 10 rounds), while each
    # local fit has converged (residual small).
    _warn_jumps(metrics, stacklevel + 1)
    moved = metrics["last_move"][-1]
    if moved.max() > MAX_LAST_MOVE:
        span = min(LAST_MOVE_SPAN, num_rounds - 1)
        j = int(np.argmax(moved))
        last = "in the last round" if span == 1 else f"over the last {span} rounds"
        warnings.warn(
            f"DPPVI: q had not converged over the rounds: {last} its mean moved "
            f"{moved[j]:.2g} of its scale per round (coordinate {j}; metrics['last_move'], above "
            f"{MAX_LAST_MOVE}), so it is still on its way (a strongly correlated posterior "
            "converges slowly with one mean-field factor per client): run more rounds",
            RuntimeWarning,
            stacklevel=stacklevel,
        )


def _warn_jumps(metrics, stacklevel):
    """Non-private: ``q``'s means scattering between the last rounds by more than its width."""
    locs, scales = np.asarray(metrics["loc"]), np.asarray(metrics["scale"])
    span = min(LAST_MOVE_SPAN, locs.shape[0] - 1)
    jumps = np.abs(np.diff(locs[-span - 1 :], axis=0)) / scales[-span:]
    if jumps.max() > MAX_JUMP:
        j = int(np.argmax(jumps.max(axis=0)))
        warnings.warn(
            f"DPPVI: q's mean jumped by up to {jumps.max():.2g} of its scale between the last rounds "
            f"(coordinate {j}; above {MAX_JUMP}): the rounds' answers scatter more than q's width, so "
            "its means are uncertain by about that much. Raise num_mc_samples or num_local_steps "
            "(or use float64)",
            RuntimeWarning,
            stacklevel=stacklevel,
        )


def _warn_update_perturbation(dp, dp_error, clipped, clip_norm, stacklevel):
    """Update perturbation: ``q``'s scale is known only after the run, so the noise's error
    (``DPPVI.update_noise_error``) and the clipping are judged then."""
    shards = (
        "num_shards (the noise is divided by it)"
        if dp == "local_avg"
        else "num_shards (more virtual clients, each with fewer rows, are clipped less)"
    )
    if dp_error > WARN_DP_ERROR:
        verdict = "the answer is mostly noise" if dp_error > MAX_DP_ERROR else "read the answer as approximate"
        warnings.warn(
            f"DPPVI(dp='{dp}'): the privacy noise is expected to have moved q's means by "
            f"about {dp_error:.2g} of q's standard deviations (metrics['predicted_dp_error']; "
            f"measured errors have been up to 5 times that), and q's scales do not include "
            f"that noise: {verdict}. Raise target_epsilon, run fewer rounds, use damping "
            f"below 1 over several rounds, raise {shards}, or use dp='dpsgd' (its noise "
            "shrinks with the clients' rows)",
            RuntimeWarning,
            stacklevel=stacklevel,
        )
    if clipped >= MOSTLY_CLIPPED:
        warnings.warn(
            f"DPPVI(dp='{dp}'): {clipped:.0%} of the clients' changes were clipped to "
            f"clip_norm={clip_norm} in the last round (metrics['clipped']): the clip "
            "norm bounds each round's move of q's natural parameters, so q may not have "
            f"reached its fixed point (too wide, pulled toward the prior). Raise {shards}, "
            "run more rounds, or raise clip_norm (the noise grows with it)",
            RuntimeWarning,
            stacklevel=stacklevel,
        )


def mean_field_inflation(curvature, diagonal=None):
    """``(d,)``: per coordinate, the posterior sd over a mean-field ``q``'s, read off the
    curvature (minus the Hessian of the log posterior, ``(d, d)``) at draws of ``q``:
    ``sqrt(Sigma_ii * Lambda_ii)`` with ``Sigma = Lambda^-1``, which a Gaussian posterior's
    mean-field fit attains. ``None`` where the curvature is not positive definite (a
    multimodal posterior, say), which says nothing. ``diagonal``: the ``Lambda_ii`` of a
    larger mean-field ``q`` whose other coordinates ``curvature`` has integrated out (its
    Schur complement; client-local latents)."""
    precision = 0.5 * (np.asarray(curvature, np.float64) + np.asarray(curvature, np.float64).T)
    if not np.all(np.isfinite(precision)):
        return None
    try:
        chol = np.linalg.cholesky(precision)
    except np.linalg.LinAlgError:
        return None
    inv_chol = np.linalg.inv(chol)
    covariance_diag = np.sum(np.square(inv_chol), axis=0)
    return np.sqrt(covariance_diag * (np.diag(precision) if diagonal is None else np.asarray(diagonal)))


def warn_mean_field(curvature, *, diagonal=None, remedy="use covariance='full'", stacklevel: int = 1) -> None:
    """Warns when a mean-field ``q``'s sds are too small for the correlations the model's
    curvature shows (:func:`mean_field_inflation` above ``MAX_MEAN_FIELD_INFLATION``);
    ``stacklevel`` counted from the caller of this function."""
    inflation = mean_field_inflation(curvature, diagonal)
    if inflation is None or inflation.max() <= MAX_MEAN_FIELD_INFLATION:
        return
    j = int(np.argmax(inflation))
    warnings.warn(
        f"DPPVI: q is mean-field (covariance='diagonal') but the posterior is correlated: the "
        f"model's curvature at q's draws puts the posterior sd of coordinate {j} {inflation[j]:.2g} "
        f"times q's ({int(np.sum(inflation > MAX_MEAN_FIELD_INFLATION))} coordinate(s) above "
        f"{MAX_MEAN_FIELD_INFLATION}), so q's sds are too small there; {remedy}",
        RuntimeWarning,
        stacklevel=stacklevel + 1,
    )


class ImportanceCheck(NamedTuple):
    """What importance weighting ``q``'s draws towards the posterior says of ``q``.

    :ivar float pareto_k: the Pareto k-hat of the ratios ``p / q`` (above 0.7: the weights,
        and ``q``'s tails, are not to be trusted).
    :ivar mean_shift: ``(d,)`` the weighted mean minus ``q``'s draws' mean, in weighted sds.
    :ivar sd_ratio: ``(d,)`` ``q``'s draws' sd over the weighted sd.
    """

    pareto_k: float
    mean_shift: np.ndarray
    sd_ratio: np.ndarray


def importance_check(log_ratios, draws) -> ImportanceCheck | None:
    """Pareto-smoothed importance sampling (PSIS, Vehtari et al. 2024, ArviZ's ``psislw``) of
    ``draws`` ``(S, d)`` of ``q`` with log ratios ``log p(theta, ...) - log q(theta, ...)``
    ``(S,)`` (any constant added). ``None`` where no ratio is finite.

    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(4000, 1))  # q = N(0, 1) against p = N(0, 3^2)
    >>> check = importance_check(x[:, 0] ** 2 / 2 - x[:, 0] ** 2 / 18, x)
    >>> bool(check.pareto_k > 0.7 and check.sd_ratio[0] < 0.8)  # q's tails too light
    True
    """
    log_ratios = np.asarray(log_ratios, np.float64)
    draws = np.asarray(draws, np.float64)
    finite = np.isfinite(log_ratios) & np.all(np.isfinite(draws), axis=-1)
    if not finite.any():
        return None
    from numpyro_fed.arviz import psis_log_weights

    shifted = np.where(finite, log_ratios - log_ratios[finite].max(), -np.inf)
    try:
        if np.ptp(shifted[finite]) == 0.0:  # q is p (ArviZ 0.2x would read k-hat inf)
            raise ValueError("All tail values are the same")
        log_weights, pareto_k = psis_log_weights(shifted)
    except ValueError:  # a flat tail (ArviZ 1.x: "All tail values are the same"): q is p there
        log_weights, pareto_k = shifted, -np.inf
    weights = np.exp(log_weights - np.max(log_weights))
    weights = np.where(finite, weights, 0.0) / np.sum(np.where(finite, weights, 0.0))
    x = np.where(finite[:, None], draws, 0.0)
    mean_q, sd_q = draws[finite].mean(0), draws[finite].std(0)
    mean_w = weights @ x
    sd_w = np.sqrt(np.maximum(weights @ np.square(x - mean_w), 1e-300))
    return ImportanceCheck(float(pareto_k), (mean_w - mean_q) / sd_w, sd_q / sd_w)


def warn_importance(check: ImportanceCheck | None, names=None, *, stacklevel: int = 1) -> None:
    """Warns where ``check`` (:func:`importance_check`) says ``q`` is not the posterior's shape:
    a Pareto k-hat above ``PARETO_K_UNBOUNDED`` (the ratios have no finite mean), or above
    ``PARETO_K_MOVED`` with weights that move a coordinate's mean or sd beyond
    ``IMPORTANCE_MEAN_SHIFT`` or ``IMPORTANCE_SD_RATIO``. ``names``: the coordinates' names
    (default: their positions); ``stacklevel`` counted from the caller."""
    if check is None or not check.pareto_k > PARETO_K_MOVED:
        return
    shift, log_ratio = np.abs(check.mean_shift), np.abs(np.log(check.sd_ratio))
    moved = shift.max() > IMPORTANCE_MEAN_SHIFT or log_ratio.max() > math.log(IMPORTANCE_SD_RATIO)
    if not moved and check.pareto_k <= PARETO_K_UNBOUNDED:
        return
    name = (lambda j: names[j]) if names is not None else (lambda j: f"coordinate {j}")  # noqa: E731
    i, j = int(np.argmax(shift)), int(np.argmax(log_ratio))
    if check.pareto_k > PARETO_K_UNBOUNDED:
        # the weighted moments rest on a few draws: name the coordinates, not their numbers
        what = (
            f"{check.pareto_k:.2f}, above {PARETO_K_UNBOUNDED}: the ratios have no finite mean, so q misses "
            f"part of the posterior's mass (the weights point at {name(i)}'s mean and {name(j)}'s sd)"
        )
    elif check.pareto_k > PARETO_K_LIMIT:
        what = (
            f"{check.pareto_k:.2f} (above {PARETO_K_LIMIT}), and they move {name(i)}'s mean by {shift[i]:.2g} "
            f"of its sd and put {name(j)}'s sd at {1.0 / check.sd_ratio[j]:.2g} times q's (weighted "
            "estimates understate the gap at such a k-hat)"
        )
    else:
        what = (
            f"{check.pareto_k:.2f} (above {PARETO_K_MOVED}: for Gaussian tails q's sd is then "
            f"about {np.sqrt(1.0 - check.pareto_k):.2g} of the posterior's along some direction), and they "
            f"move {name(i)}'s mean by {shift[i]:.2g} of its sd and put {name(j)}'s sd at "
            f"{1.0 / check.sd_ratio[j]:.2g} times q's"
        )
    warnings.warn(
        f"DPPVI: q is not the posterior's shape: the importance weights p/q at q's draws have Pareto "
        f"k-hat {what}; metrics['pareto_k']. Read q's means and sds there as approximate: a skewed or "
        "heavy-tailed posterior (a noise scale fitted on few rows, a hierarchical scale) has no good "
        "Gaussian fit; FedZigZag samples it",
        RuntimeWarning,
        stacklevel=stacklevel + 1,
    )
