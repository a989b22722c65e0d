"""What a run's recorded infos say: problems, exact trajectory moments, the skeleton, the
per-client statistics and the message ledger of the rounds. Each function takes
``MCMC.get_extra_fields()`` output (the ``info.<name>`` fields of
:class:`~numpyro_fed.infer.zigzag.SampleInfo`) or a field of it."""

from __future__ import annotations

import warnings

import numpy as np

import jax
import jax.numpy as jnp

from numpyro.diagnostics import effective_sample_size

__all__ = [
    "DIAGNOSTICS",
    "TRAJECTORY",
    "SKELETON",
    "few_effective_draws",
    "per_client_stats",
    "round_ledger",
    "run_ledger",
    "rate_problems",
    "skeleton_of",
    "term_ledger",
    "trajectory_moments_of",
]

#: the counts of :class:`~numpyro_fed.infer.zigzag.SampleInfo` reported as diagnostics
DIAGNOSTICS = (
    "num_events",
    "num_proposals",
    "num_violations",
    "events_by_proposer",
    "grad_evals_by_proposer",
    "hit_event_cap",
    "rounds",
)
#: the fields the exact trajectory moments need
TRAJECTORY = ("elapsed", "path_integral", "path_square_integral")
#: the fields of the recorded switches
SKELETON = ("skeleton_times", "skeleton_x", "skeleton_v", "skeleton_count")

_VIOLATION_REMEDY = {
    "grid": "automatic bound (the chain is then slightly biased): raise safety_factor or grid_size",
    "affine": "affine extrapolation (the potential is not quadratic along lines; the "
    "chain is biased): use bounds='grid' or a user-supplied bound",
    "gradient": "GradientBound: it is not a bound for this model (the chain is biased); "
    "check each client's bound on |d_i U_m|",
    "hessian": "HessianBound: it is not a bound for this model (the chain is biased); "
    "check each client's bound on |d_i d_k U_m|",
    "subsample": "bound on the rows' curvature (the chain is then slightly biased): the curvature is "
    "not bounded where the process went (see the warning at set-up); pass a longer "
    "num_warmup (violations in warmup grow the bound), bounds=RowHessianBound(...) valid "
    "everywhere, or subsample_size=None",
}


def few_effective_draws(samples_by_chain: dict, min_ess: float, *, preconditioned: bool = True) -> list[str]:
    """One message per site with an element of fewer than ``min_ess`` effective draws
    (NumPyro's estimator over the chains): its mean carries a Monte Carlo error above
    ``1 / sqrt(min_ess)`` of its sd. Without ``preconditioned`` the message also names the
    preconditioner (the axis-aligned process is slow on correlated or unequally scaled
    parameters)."""
    problems = []
    for site, value in samples_by_chain.items():
        value = np.asarray(jax.device_get(value), dtype=np.float64)
        if value.shape[1] < 4 or not np.all(np.isfinite(value)):
            continue
        with np.errstate(divide="ignore", invalid="ignore"):
            ess = np.asarray(effective_sample_size(value)).reshape(-1)
        ess = np.where(np.isfinite(ess), ess, np.inf)  # a constant coordinate has no error
        if ess.min() < min_ess:
            j = int(np.argmin(ess))
            where = f"{site!r}" + (f" (element {j} of {ess.size})" if ess.size > 1 else "")
            # NumPyro's estimator can go below 1, even negative, on a few strongly correlated draws
            count = f"{ess[j]:.3g} effective draws" if ess[j] >= 1 else "less than one effective draw"
            problems.append(
                f"{where} has {count} (fewer than {min_ess:g}): its summaries "
                "carry a large Monte Carlo error; run more num_samples (or chains), a longer "
                "num_warmup, or a larger sample_interval"
                + (
                    ""
                    if preconditioned
                    else ", or pass preconditioner='laplace' (parameters that are correlated or on unequal scales)"
                )
            )
    return problems


def rate_problems(fields: dict, *, kind: str, max_proposals: int, sample_interval: float):
    """``(violations, proposals, capped, messages)``: proposals whose exact rate exceeded its
    bound and samples cut short by ``max_proposals``, with a message for each kind."""
    violations = int(jnp.sum(fields["info.num_violations"]))
    proposals = int(jnp.sum(fields["info.num_proposals"]))
    capped = int(jnp.sum(fields["info.hit_event_cap"]))
    problems = []
    if violations:
        problems.append(f"{violations} of {proposals} proposals had an exact rate above its {_VIOLATION_REMEDY[kind]}")
    if capped:
        problems.append(
            f"{capped} samples stopped at max_proposals={max_proposals} before "
            f"sample_interval={sample_interval}: the rate is exploding or the "
            "interval is too long for the cap"
        )
    return violations, proposals, capped, problems


def trajectory_moments_of(fields: dict, preconditioner=None) -> dict:
    """Mean and covariance (or variance) of the whole piecewise-linear path, in ``x`` (mapped
    back from ``u`` through ``preconditioner`` when the process moved there)."""
    duration = float(jnp.sum(fields["info.elapsed"]))
    mean = jnp.sum(fields["info.path_integral"], 0) / duration
    second = jnp.sum(fields["info.path_square_integral"], 0) / duration
    full = second.ndim == 2
    cov = second - jnp.outer(mean, mean) if full else second - mean**2
    if preconditioner is not None:  # the path was integrated in u; x = center + scale u
        scale = preconditioner.scale
        if not full and scale.ndim == 2:
            raise ValueError("with a dense preconditioner the variances of x need full_covariance=True")
        mean = preconditioner.to_x(mean)
        if full:
            cov = scale[:, None] * cov * scale[None, :] if scale.ndim == 1 else scale @ cov @ scale.T
        else:
            cov = scale**2 * cov
    return {"mean": mean, "cov": cov} if full else {"mean": mean, "var": cov}


def skeleton_of(fields_by_chain: dict, chain: int, skeleton_size: int, preconditioner=None):
    """``(times, positions, velocities)`` of one chain's recorded switches, times counted
    from the first sample's start, positions flat unconstrained in ``x``."""
    fields = jax.device_get(fields_by_chain)
    num_chains = fields["info.elapsed"].shape[0]
    if not 0 <= chain < num_chains:
        raise ValueError(f"chain must be in [0, {num_chains}), got {chain}")
    fields = {name: value[chain] for name, value in fields.items()}
    counts = np.asarray(fields["info.skeleton_count"])
    if (counts > skeleton_size).any():
        warnings.warn(
            f"{int((counts > skeleton_size).sum())} samples had more than "
            f"skeleton_size={skeleton_size} switches; the skeleton misses some of them",
            stacklevel=3,
        )
    offsets = np.concatenate([[0.0], np.cumsum(fields["info.elapsed"])[:-1]])
    kept = np.arange(skeleton_size)[None, :] < np.minimum(counts, skeleton_size)[:, None]
    times = (fields["info.skeleton_times"] + offsets[:, None])[kept]
    positions, velocities = fields["info.skeleton_x"][kept], fields["info.skeleton_v"][kept]
    if preconditioner is not None:  # recorded in u: x = center + scale u moves along scale v
        positions = np.asarray(preconditioner.to_x(positions))
        velocities = np.asarray(preconditioner.direction_to_x(velocities))
    return times, positions, velocities


def per_client_stats(fields: dict, num_clients: int, prior_on_server: bool) -> dict:
    """``{name: (array, dims)}``: the diagnostics, per-proposer counts split into a
    ``*_by_client`` array with a ``client`` dim and (when the prior proposes on the server)
    a ``*_by_prior`` one."""
    stats = {}
    for name in DIAGNOSTICS:
        value = fields.get("info." + name)
        if value is None:
            continue
        value = jax.device_get(value)
        if name.endswith("_by_proposer"):
            base = name[: -len("_by_proposer")]
            stats[base + "_by_client"] = (value[..., :num_clients], ["client"])
            if prior_on_server:
                stats[base + "_by_prior"] = (value[..., num_clients], [])
        else:
            stats[name] = (value, [])
    return stats


def round_ledger(rounds, num_clients: int, message_sizes: dict) -> dict:
    """The ledger of the ``"propose"`` rounds ``rounds`` (any shape, e.g. ``(chain, draw)``):
    ``{name: rounds.shape + (M,)}``; in a round the server sends every client one message and
    every client answers with one, of the bytes ``message_sizes`` gives (``"to_client"``,
    ``"from_client"``).

    >>> ledger = round_ledger(np.array([2, 3]), 2, {"to_client": 40, "from_client": 12})
    >>> ledger["bytes_from_client"].tolist()
    [[24, 24], [36, 36]]
    """
    messages = np.repeat(np.asarray(rounds)[..., None].astype(np.int64), num_clients, axis=-1)
    return {
        "messages_to_client": messages,
        "bytes_to_client": messages * message_sizes["to_client"],
        "messages_from_client": messages,
        "bytes_from_client": messages * message_sizes["from_client"],
    }


def term_ledger(grad_evals, num_proposals, num_clients: int, d: int, itemsize: int) -> dict:
    """The ledger of the server's thinning's calls, ``{"<name>/<count>": (M,)}``, from the
    draws' ``grad_evals_by_proposer`` ``(..., P)`` and ``num_proposals`` ``(...)``. Every
    evaluation of a line's bound asks every client for its gradient and slope
    (``"grad_and_slope"``: ``x`` and ``v`` down, ``2 d`` numbers up; the same number for all
    proposers), and every proposal asks its winner alone for its gradient (``"grad"``: ``x``
    down, ``d`` numbers up): a draw's evaluations are its line evaluations, the same for every
    proposer, plus one per proposal for its winner.

    >>> ledger = term_ledger(np.array([[3, 2, 2]]), np.array([1]), 2, d=1, itemsize=8)
    >>> ledger["grad_and_slope/messages_to_client"].tolist(), ledger["grad/messages_to_client"].tolist()
    ([2, 2], [1, 0])
    """
    evals = np.asarray(grad_evals, np.int64).reshape(-1, np.shape(grad_evals)[-1])
    proposals = np.asarray(num_proposals, np.int64).reshape(-1)
    lines = (evals.sum(-1) - proposals) // evals.shape[-1]  # per draw
    checks = (evals - lines[:, None])[:, :num_clients].sum(0)
    out = {}
    for name, messages, down, up in (
        ("grad_and_slope", np.full(num_clients, lines.sum()), 2 * d, 2 * d),
        ("grad", checks, d, d),
    ):
        out.update(
            {
                f"{name}/messages_to_client": messages,
                f"{name}/bytes_to_client": messages * down * itemsize,
                f"{name}/messages_from_client": messages.copy(),
                f"{name}/bytes_from_client": messages * up * itemsize,
                f"{name}/rounds": messages.copy(),
            }
        )
    return out


def run_ledger(rounds, num_clients: int, message_sizes: dict, setup: dict | None = None) -> dict:
    """A run's ledger per client, ``{name: (M,) int array}``: the rounds' totals (prefixed
    ``"propose/"``, ``"propose/rounds"`` included; or, given as ``rounds``, the server's
    thinning's calls of :func:`term_ledger`) plus the calls the federation counted (``setup``,
    ``{"<name>/<count>": (M,)}``: the set-up's and the warmup's), then their sums without the
    prefix."""
    if isinstance(rounds, dict):  # the server's thinning's calls, as term_ledger gives them
        ledger = dict(rounds)
    else:
        ledger = {
            "propose/" + name: value.reshape(-1, value.shape[-1]).sum(0)
            for name, value in round_ledger(rounds, num_clients, message_sizes).items()
        }
        ledger["propose/rounds"] = ledger["propose/messages_from_client"].copy()
    for key, value in (setup or {}).items():
        ledger[key] = ledger.get(key, 0) + value
    totals = {}
    for key, value in ledger.items():
        name = key.split("/", 1)[1]
        totals[name] = totals.get(name, 0) + value
    return {**totals, **ledger}
