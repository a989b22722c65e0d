"""D-ADMMS's ``rho="auto"`` set-up: the scaling of the agents' potentials and the step size
and noise they run with, from one mode search over the federation (or, where the posterior
has no mode, from a point of its bulk), with the warnings that say which case ran.

:func:`auto_setup` is what :class:`~numpyro_fed.infer.admm.samplers.DADMMS` calls before a
run; the searches and settings themselves are in :mod:`~numpyro_fed.infer.admm.scaling`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

import jax.numpy as jnp

from numpyro_fed._checks import warn_user
from numpyro_fed.infer.admm.scaling import (
    MAX_CURVATURE_DRIFT,
    LaplaceScaling,
    auto_settings,
    calibrated_noise,
    curvature_drift,
    laplace_scaling,
    surrogate_scaling,
    tempered_settings,
    whitened_potentials,
)
from numpyro_fed.infer.admm.topology import num_components
from numpyro_fed.infer.modes import compare_modes

__all__ = ["NOISE_SCALE", "PAPER_RHO", "RUNAWAY_ADVICE", "AutoSetup", "auto_setup", "runaway"]

#: the paper's step size, in the model's units (its linear regression, Section 6.2.2)
PAPER_RHO = 5.0
#: the noise's scale where neither the user nor the set-up chose one (the paper's)
NOISE_SCALE = 1.0
#: what was measured on the centred radon model (docs/guide/dadmms.md, "Models without a mode")
RUNAWAY_ADVICE = (
    "On the centred radon model (85 county intercepts) at rho=5 the iterates ran down the county "
    "scale and stopped being finite from iteration 30-47; written non-centred "
    "(numpyro.infer.reparam.LocScaleReparam) the run has a mode and stays finite, but its group "
    "scale was 5.5 posterior sds high. For this posterior use FedZigZag (exact)"
)
SURROGATE_MEASURED = (
    "Measured so on the centred radon model (4 clients, 20 chains of 100 draws after 1000): every "
    "sd within 0.82-1.35 of NUTS's, means within 0.3 posterior sd on 84 of 89 coordinates (0.50 "
    "the worst); the end-of-run check reports the measured spread"
)


class AutoSetup(NamedTuple):
    """What a ``rho="auto"`` run runs with.

    :ivar potentials: the agents' potentials (whitened by ``scaling`` when there is one).
    :ivar x0: the start in those units (the mode, or its surrogate: zeros).
    :ivar rho: the step size; ``noise_scale``: the noise's scale.
    :ivar scaling: the :class:`~numpyro_fed.infer.admm.scaling.LaplaceScaling` (``None``: the
        model's units).
    :ivar runaway: the mode search's run down a direction without a mode, worded (see
        :func:`runaway`), or ``None``.
    :ivar noise_shape: ``(d, d)`` the noise's shape in the whitened coordinates (each agent's
        noise is ``noise_scale * noise_shape @ w``, ``w`` standard normal), ``None`` for the
        paper's isotropic noise: where the agents' Hessians are not proportional, the noise
        that makes the reporting agent's stationary covariance the posterior's in every
        direction (:func:`~numpyro_fed.infer.admm.scaling.calibrated_noise`).
    :ivar curvature_drift: at a mode, how far the posterior's curvature moves over its Laplace
        approximation (:func:`~numpyro_fed.infer.admm.scaling.curvature_drift`); past
        :data:`~numpyro_fed.infer.admm.scaling.MAX_CURVATURE_DRIFT` the run is tempered
        (:func:`~numpyro_fed.infer.admm.scaling.tempered_settings`) with the shaped noise's
        shape. ``None`` where it was not measured.
    """

    potentials: object
    x0: jnp.ndarray
    rho: float
    noise_scale: float
    scaling: LaplaceScaling | None
    runaway: str | None
    noise_shape: np.ndarray | None = None
    curvature_drift: float | None = None


def runaway(search, coordinate_names) -> str | None:
    """What the set-up's mode search measured when it found no mode: the coordinate it moved
    farthest while the potential kept falling (e.g. a centred hierarchy's log scale running
    down its funnel), worded; ``None`` when it did not run away (a potential not finite at
    the start, a search that ended where the Hessian is not positive definite)."""
    if not search or search.get("converged") or "end" not in search:
        return None
    start, end = search["start"], search["end"]
    moved = np.abs(end - start)
    if not (np.all(np.isfinite(moved)) and search["value_end"] < search["value_start"]) or moved.max() < 5.0:
        return None
    j = int(np.argmax(moved))
    return (
        f"the set-up's mode search ({search['rounds']} rounds) lowered the potential from "
        f"{search['value_start']:.4g} to {search['value_end']:.4g} while moving {coordinate_names[j]} "
        f"(unconstrained) from {start[j]:.3g} to {end[j]:.3g}: "
        "the density grows without bound that way (e.g. a centred hierarchy's funnel as its scale goes to 0)"
    )


def _log_mass(scaling, report) -> float:
    """The Laplace approximation's log mass of a mode, ``-U - log det(H) / 2``, up to a
    constant shared by every mode (``T = L^-T`` is triangular: ``log det T = -log det H / 2``)."""
    return -report["value_end"] + float(np.sum(np.log(np.abs(np.diag(scaling.transform)))))


def _larger_mode(first, first_report, second, second_report):
    """Of two searches' scalings, the mode to run at: the second where only it found one, or
    where both did, apart, and its Laplace mass is the larger
    (:func:`~numpyro_fed.infer.modes.compare_modes`: a mixture's label-swapped mode); else the
    first."""
    if second is None or not second.mode:
        return first
    if first is None or not first.mode:
        return second

    def mode(scaling, report):  # H^-1 = T T^T: the Laplace sds are the rows' norms
        return scaling.center, np.sqrt(np.sum(scaling.transform**2, 1)), _log_mass(scaling, report)

    found = compare_modes(mode(first, first_report), mode(second, second_report))
    return second if found is not None and found.take_second else first


def _scaling(potentials, x0, coordinate_names, second_start=None):
    """The scaling to run in: the mode's (Laplace; from two starts with ``second_start``, the
    mode whose Laplace mass is the larger), or where the search ran away a point of the bulk
    from other starts (``surrogate_scaling``), or ``None``; and the runaway."""
    search = {}
    scaling = laplace_scaling(potentials, x0, report=search, surrogate=True)
    rounds = search.get("rounds", 1)  # every search's rounds: what the ledger counts
    if second_start is not None:
        other_search = {}
        other = laplace_scaling(potentials, second_start, report=other_search, surrogate=True)
        rounds += other_search.get("rounds", 1)
        chosen = _larger_mode(scaling, search, other, other_search)
        if chosen is not None and chosen is other:
            return chosen._replace(rounds=rounds), None
        scaling = None if chosen is None else chosen._replace(rounds=rounds)
    if scaling is not None and scaling.mode:
        return scaling, None
    ran = runaway(search, coordinate_names)
    if not ran:
        return None, None  # a surrogate only where the search ran away (a funnel)
    if scaling is None:  # no mode: scale at a point of the bulk, from other starts
        scaling, more = surrogate_scaling(potentials, x0, starts=7)
        if scaling is not None:
            scaling = scaling._replace(rounds=rounds + more)
    return scaling, ran


def auto_setup(
    name, potentials, x0, topology, agent, noise_scale=None, coordinate_names=(), second_start=None
) -> AutoSetup:
    """``rho="auto"``: scale the potentials to the posterior (its Hessian at the mode, or
    where there is none at a point of its bulk, see :func:`_scaling`) and choose ``rho`` and
    the noise there (:func:`~numpyro_fed.infer.admm.scaling.auto_settings`; without a mode,
    or where the curvature moves over the mode's Laplace approximation by more than
    :data:`~numpyro_fed.infer.admm.scaling.MAX_CURVATURE_DRIFT`,
    :func:`~numpyro_fed.infer.admm.scaling.tempered_settings`, the network's average at
    temperature one); with no scaling, the paper's ``rho`` in the model's units. Warns where
    there is no mode, saying which of these ran. ``noise_scale``: the user's, or ``None``.
    ``second_start``: a second start of the mode search (the prior's medians), whose mode is
    taken where the first search found none, or a separate one with less Laplace mass."""
    scaling, ran = _scaling(potentials, x0, coordinate_names, second_start)
    rho, noise = PAPER_RHO, NOISE_SCALE if noise_scale is None else noise_scale
    if scaling is None:
        warn_user(
            f"{name}: rho='auto' found no mode with a positive definite Hessian "
            "(e.g. a centred hierarchical model, an improper posterior), so the proximal steps "
            f"are not scaled to the posterior: running the paper's rho={PAPER_RHO:g} in the "
            "model's units. "
            + (
                ran[0].upper()
                + ran[1:]
                + ", and no search from 8 starts (the run's and 7 drawn in (-2, 2)) crossed a point "
                "where the Hessian is positive definite; D-ADMMS's proximal steps are minimizations "
                "and follow the same way, "
                "so expect its iterates to run down there and stop being finite. " + RUNAWAY_ADVICE
                if ran
                else "Reparametrize (numpyro.infer.reparam.LocScaleReparam) or give proper priors; "
                "the end-of-run check reports the measured spread"
            ),
            RuntimeWarning,
        )
        return AutoSetup(potentials, x0, rho, noise, None, ran)
    shape, drift = None, None
    connected = num_components(topology.adjacency) == 1  # agents that never meet have no common law
    if connected and scaling.mode and noise_scale is None:
        drift, rounds = curvature_drift(potentials, scaling)
        scaling = scaling._replace(rounds=scaling.rounds + rounds)
    potentials = whitened_potentials(potentials, scaling)
    x0 = jnp.zeros_like(x0)  # the MAP (or its surrogate), in the posterior's units
    if connected:
        if drift is not None and drift > MAX_CURVATURE_DRIFT:
            # far from Gaussian: the linearization's calibration is not the posterior's spread
            # (tempered below one, the non-centred eight schools' school effects kept half
            # their sd); the network's average at temperature one follows the posterior's shape
            rho, noise = tempered_settings(topology.adjacency, scaling.shares, agent)
            if scaling.hessians is not None:
                shape = _shaped_noise(topology.adjacency, scaling.hessians, agent, rho, noise)[1]
        elif scaling.mode or noise_scale is not None:
            rho, noise = auto_settings(topology.adjacency, scaling.shares, agent, noise_scale=noise_scale)
            if scaling.mode and noise_scale is None and scaling.hessians is not None:
                noise, shape = _shaped_noise(topology.adjacency, scaling.hessians, agent, rho, noise)
        else:
            rho, noise = tempered_settings(topology.adjacency, scaling.shares, agent)
    if not scaling.mode:
        warn_user(
            f"{name}: rho='auto' found no mode with a positive definite Hessian. "
            + ran[0].upper()
            + ran[1:]
            + ". The agents run in the units of the Hessian where a search crossed the "
            "posterior's bulk (where it was positive definite, not a mode), with "
            f"rho={rho:g} and noise_scale={noise:.3g} there, so that the network's "
            "average moves at temperature one (below it a centred hierarchy's funnel "
            "swallows the iterates). " + SURROGATE_MEASURED,
            RuntimeWarning,
        )
    return AutoSetup(potentials, x0, rho, noise, scaling, ran, shape, drift)


def _shaped_noise(adjacency, hessians, agent, rho, noise):
    """``(noise_scale, noise_shape)``: the noise of
    :func:`~numpyro_fed.infer.admm.scaling.calibrated_noise` at ``rho`` as a scale (its
    covariance's mean variance) and a shape; the scalar ``noise`` and ``None`` where that is
    already right in every direction, to 1e-6, or no calibration was found."""
    covariance = calibrated_noise(adjacency, hessians, rho, agent)
    if covariance is None:
        return noise, None
    scale = float(np.sqrt(np.mean(np.diag(covariance))))
    shape = np.linalg.cholesky(covariance) / scale
    if np.allclose(shape, np.eye(shape.shape[0]), atol=1e-6):
        return noise, None
    return scale, shape
