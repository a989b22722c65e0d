"""Stein's identity as a convergence check of a particle run, and the runaway warning."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np

import jax
import jax.numpy as jnp

__all__ = [
    "OFFSET_LIMIT",
    "SCALE_LIMITS",
    "SETTLED_LIMIT",
    "runaway_problems",
    "stein_moments",
    "stein_statistics",
    "unsettled_rounds",
    "warn_runaway",
]

#: Stein's check warns past these: a mean offset (``|stein_mean| / sqrt(stein_scale)``, in
#: posterior sds for a Gaussian target) and a variance ratio (``stein_scale``) outside these
#: limits. They are those of agreement with a reference, 0.3 sd and sd ratios within
#: ``[1/1.5, 1.5]``: a run the check passes is one it cannot tell from such agreement.
OFFSET_LIMIT = 0.3
SCALE_LIMITS = (1 / 1.5**2, 1.5**2)
#: :func:`unsettled_rounds` reports a global coordinate whose particles' sd varied by more than
#: this factor over the last cycle of rounds. Measured (DSVGD, 20 particles unless said, the
#: zoo's eight schools over 4 clients and the tests' random intercepts over 3): 1.03-1.05 on
#: the random intercepts (3 seeds, agreeing); 1.11-1.16 on eight schools with 50 particles
#: (3 runs agreeing, one of them warned by Stein's check); 1.54-1.57 on eight schools at 20
#: particles where ``log tau`` ended 0.30-0.73 reference sd off or with an sd ratio of 1.5 (3
#: seeds, one of them passing Stein's check). The statistic does not separate the two cleanly
#: near the targets: on another CPU (float32 rounds differently there) the zoo's float32 cell
#: read 1.18 and ended 0.47 sd off, passing Stein's check, and the next seed read 1.20 and
#: agreed at the edge (0.22 sd, an sd ratio of 1.49). The limit lies below the silent failure;
#: a run near the targets may warn.
SETTLED_LIMIT = 1.17


def stein_statistics(score_fn: Callable) -> Callable:
    """``history (R, N, d) -> (stein_mean, stein_scale)``, each ``(R, d)``.

    Stein's identity holds for any target ``p``: ``E_p[d log p / d x_j] = 0`` and
    ``E_p[(d log p / d x_j) (x_j - m_j)] = -1``. Per set of particles, ``stein_mean`` is
    ``(C g)_j / sd_j``, ``g`` the mean score, ``C`` the particles' covariance and ``sd_j``
    their sd (0 expected), and ``stein_scale`` minus the mean of score times deviation (1
    expected). For a Gaussian target and particles whose covariance is the target's times
    ``r``, they are ``sqrt(r)`` times the mean's offset in posterior sds (``-(m - mu) /
    sd``; with uncorrelated coordinates, ``g_j sd_j``), and ``r``.

    :param score_fn: ``(N, d) -> (N, d)``, the target's full ``grad log p`` (called once per
        set of particles: jit it, and it compiles once for all of them).

    >>> import jax, jax.numpy as jnp
    >>> x = jax.random.normal(jax.random.PRNGKey(0), (1, 4000, 1))
    >>> mean, scale = stein_statistics(lambda x: -x)(x)  # N(0, 1) draws for N(0, 1)
    >>> abs(float(mean[0, 0])) < 0.1, abs(float(scale[0, 0]) - 1) < 0.1
    (True, True)
    """

    def history(particles):
        moments = [stein_moments(x, score_fn(x)) for x in particles]
        return jnp.stack([m for m, _ in moments]), jnp.stack([s for _, s in moments])

    return history


@jax.jit
def stein_moments(x, score):
    """``(stein_mean, stein_scale)``, each ``(d,)``, of one ``(N, d)`` set of particles ``x``
    and the target's score at them (see :func:`stein_statistics`)."""
    mean = jnp.mean(x, axis=0)
    centered = x - mean
    sd = jnp.std(x, axis=0)
    # C g / sd (C the particles' covariance, g the mean score): for a Gaussian target
    # N(mu, S) with C = S, g = -S^-1 (m - mu) and C g / sd = -(m - mu) / sd, the mean's
    # offset in sds, also where the coordinates are correlated (then g_j sd_j is not).
    covariance_times_g = centered.T @ (centered @ jnp.mean(score, axis=0)) / x.shape[0]
    return covariance_times_g / jnp.where(sd > 0, sd, 1.0), -jnp.mean(score * centered, axis=0)


def runaway_problems(start, end, stein_mean, stein_scale, *, from_prior: bool, all_visited: bool) -> list[str]:
    """What is absurd about the particles ``end`` (``(N, d)``) of a run from ``start``: a
    spread or a move of more than 1000 sds of ``start`` (prior draws only: particles given by
    the user may be as narrow as they like) and, once every client has been visited, the last
    Stein statistics (``(d,)`` each) more than :data:`OFFSET_LIMIT` posterior sds off or a
    variance ratio outside :data:`SCALE_LIMITS`."""
    start, end = np.asarray(start, dtype=float), np.asarray(end, dtype=float)
    start_sd = start.std(axis=0) if from_prior else np.zeros(start.shape[1])
    safe_sd = np.where(start_sd > 0, start_sd, 1.0)
    spread = np.where(start_sd > 0, end.std(axis=0) / safe_sd, 0.0)
    distance = np.where(start_sd > 0, np.abs(end.mean(axis=0) - start.mean(axis=0)) / safe_sd, 0.0)
    problems = []
    if np.max(spread) > 1e3:
        problems.append(
            f"their spread grew {np.max(spread):.3g}-fold from the prior draws (coordinate {int(np.argmax(spread))})"
        )
    if np.max(distance) > 1e3:
        problems.append(f"their mean moved {np.max(distance):.3g} prior sds (coordinate {int(np.argmax(distance))})")
    if all_visited:
        # float64: in float32 the floor 1e-300 below would underflow to 0 (log of 0)
        m, v = np.asarray(stein_mean, dtype=float), np.asarray(stein_scale, dtype=float)
        # For a Gaussian target, stein_mean / sqrt(stein_scale) is the mean's offset in
        # posterior sds and stein_scale the variance ratio.
        offset = np.where(v > 0, np.abs(m) / np.sqrt(np.where(v > 0, v, 1.0)), np.inf)
        if np.max(offset) > OFFSET_LIMIT:
            j = int(np.argmax(offset))
            problems.append(
                f"the target's score at the particles does not average 0 "
                f"(stein_mean {m[j]:.3g}, stein_scale {v[j]:.3g} in coordinate {j}: "
                f"for a Gaussian posterior, a mean {offset[j]:.3g} posterior sds off)"
            )
        if np.max(v) > SCALE_LIMITS[1] or np.min(v) < SCALE_LIMITS[0]:
            j = int(np.argmax(np.abs(np.log(np.maximum(v, 1e-300)))))
            problems.append(
                f"their spread does not match the target's score (stein_scale "
                f"{v[j]:.3g} in coordinate {j}, 1 expected; for a Gaussian posterior, "
                f"the particles' variance over the posterior's)"
            )
    return problems


def unsettled_rounds(particles, num_clients: int) -> list[str]:
    """The problem (a one-item list; empty if none) of a run whose rounds have not settled:
    over its last ``num_clients + 1`` rounds' particles (``(R, N, d)``: every client's latest
    update and the round before them) some coordinate's sd varied by more than
    :data:`SETTLED_LIMIT`. At a fixed point a round leaves the particles where they are; one
    that moves their spread by that much leaves the last round's particles one point of a
    wander, which Stein's check, reading a skewed marginal as a Gaussian, may pass (DSVGD's
    eight schools: ``log tau``'s sd 1.46, 1.71, 2.21 and 1.76 posterior sds over the last four
    rounds, Stein's variance ratio 0.92, the reference's ratio 2.3).

    >>> import numpy as np
    >>> x = np.broadcast_to(np.random.default_rng(0).normal(size=(1, 20, 1)), (5, 20, 1))  # settled
    >>> unsettled_rounds(x, 3), len(unsettled_rounds(x * np.array([1, 1, 1, 2, 1])[:, None, None], 3))
    ([], 1)
    """
    particles = np.asarray(particles, dtype=float)
    if particles.shape[0] < num_clients + 1 or particles.shape[1] < 2:
        return []
    sds = particles[-(num_clients + 1) :].std(axis=1)  # (rounds, d)
    low, high = sds.min(axis=0), sds.max(axis=0)
    ratio = np.where(low > 0, high / np.where(low > 0, low, 1.0), np.inf)
    j = int(np.argmax(ratio))
    if not ratio[j] > SETTLED_LIMIT:
        return []
    return [
        f"the rounds have not settled: over the last {num_clients + 1} rounds the particles' sd in coordinate "
        f"{j} varied {ratio[j]:.3g}-fold (from {low[j]:.3g} to {high[j]:.3g}), more than {SETTLED_LIMIT}, and the "
        "last round's particles are one point of that wander"
    ]


def warn_runaway(
    method_name: str,
    num_rounds: int,
    problems: list[str],
    *,
    fixed_kde: bool,
    stacklevel: int = 3,
    advice: str | None = None,
):
    """A :class:`RuntimeWarning` naming the ``problems`` and what to change (``advice``, where
    the method knows better than the settings)."""
    if not problems:
        return
    remedy = "use kde_bandwidth='auto' (the default), which adapts to the particles' scale, " if fixed_kde else ""
    warnings.warn(
        f"{method_name}'s particles ran away or did not converge after {num_rounds} rounds: "
        + "; ".join(problems)
        + (
            f"; {advice}"
            if advice
            else ". Change the settings: "
            + remedy
            + "lower learning_rate, use more num_particles, num_local_steps or rounds"
        ),
        RuntimeWarning,
        stacklevel=stacklevel,
    )
