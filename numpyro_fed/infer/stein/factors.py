"""A DSVGD client's factor in a round (Kassab & Simeone, Algorithm 1, lines 4-7): the scores of
the round's tilted target, ``grad log q^(i-1)`` and ``grad log c_k t_k^(i-1)`` (KDEs of the
global and local particles, or the densities Algorithm 1 knows exactly), and the distillation
of the client's new factor into its local particles (line 7). The round itself is
:mod:`~numpyro_fed.infer.stein.dsvgd`'s; :mod:`~numpyro_fed.infer.stein.local` runs the same
pieces on joint particles with client-local latents.
"""

from __future__ import annotations

import jax.numpy as jnp

from numpyro_fed.infer.stein.svgd import staged_svgd

__all__ = ["distill", "round_scores"]


def round_scores(global_particles, local_particles, prior_score, kde_score, *, visited, first, carrier=None):
    """``(score_previous, score_local)`` of a client's round: ``grad log q^(i-1)`` (the KDE of
    the ``global_particles``, or ``p_0`` exactly while no client has been ``visited``:
    ``first``) and ``grad log c_k t_k^(i-1)`` (the KDE of the ``local_particles``, or the
    carrier ``c_k`` exactly for a client not yet ``visited``; ``carrier``: its score, default
    ``prior_score``), each ``(N, d) -> (N, d)``."""
    carrier = prior_score if carrier is None else carrier

    def score_previous(x):  # grad log q^(i-1)
        return jnp.where(first, prior_score(x), kde_score(x, global_particles))

    def score_local(x):  # grad log c_k t_k^(i-1)
        return jnp.where(visited, kde_score(x, local_particles), carrier(x))

    return score_previous, score_local


def distill(
    new_global,
    local_particles,
    score_previous,
    score_local,
    *,
    kde_score,
    num_distill_steps,
    distill_optim,
    svgd_bandwidth,
    visited,
    stages=1,
    curvature=False,
    rebase=None,
):
    """Line 7 of Algorithm 1: the client's new local particles, ``L'`` SVGD steps towards
    ``c_k t_k^(i)``, ``t_k^(i) = t_k^(i-1) q^(i) / q^(i-1)`` (Eq. (17)), ``q^(i)`` the KDE of
    ``new_global`` (scores of :func:`round_scores`); ``rebase``: ``grad log c_k' / c_k``, a new
    carrier for the new particles (default: the same)."""

    def factor_score(x):  # grad log c_k t_k^(i)
        score = kde_score(x, new_global) + score_local(x) - score_previous(x)
        return score if rebase is None else score + rebase(x)

    # With stages (kde_bandwidth="auto"), a client's first distillation starts from the
    # uploaded particles: its initial local particles (prior draws) stand for no density
    # (t_k^(0) = 1 exactly) and may lie many whitened units from the target, further than
    # the distillation's steps travel. (The paper's variant starts from them.)
    start = local_particles if stages <= 1 else jnp.where(visited, local_particles, new_global)
    return staged_svgd(
        start, factor_score, num_distill_steps, distill_optim, svgd_bandwidth, stages=stages, curvature=curvature
    )
