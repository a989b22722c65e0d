"""Decentralized samplers: D-ADMMS (Tzikas et al. 2024), consensus ADMM and the paper's
gradient baselines (D-SGLD, D-SGHMC, D-ULA), agents on a communication graph.

* :mod:`~numpyro_fed.infer.admm.topology`: the communication graphs;
* :mod:`~numpyro_fed.infer.admm.agents`: what each agent knows (its local potential);
* :mod:`~numpyro_fed.infer.admm.dadmms`: D-ADMMS's core (``init`` and ``build_program``, what
  each agent runs on any network; the proximal solvers);
* :mod:`~numpyro_fed.infer.admm.scaling`: D-ADMMS in the posterior's units (``rho="auto"``)
  and the spread check's Stein estimate;
* :mod:`~numpyro_fed.infer.admm.gradient`: the baselines' cores (``init_<name>`` and
  ``build_<name>_program``);
* :mod:`~numpyro_fed.infer.admm.face`: :class:`DecentralizedKernel`, the NumPyro face they
  share;
* :mod:`~numpyro_fed.infer.admm.samplers`: :class:`DADMMS`, :class:`ADMM`, :class:`DSGLD`,
  :class:`DSGHMC`, :class:`DULA`.
"""

from numpyro_fed.infer.admm.agents import AgentPotentials, agent_potentials
from numpyro_fed.infer.admm.dadmms import (
    ADMMInfo,
    ADMMState,
    QuadraticPotentials,
    build_program,
    init,
    newton_prox,
    quadratic_potentials,
)
from numpyro_fed.infer.admm.face import DecentralizedKernel, DecentralizedState, SentCounts
from numpyro_fed.infer.admm.gradient import (
    GradientInfo,
    SGHMCState,
    SGLDState,
    ULAState,
    build_dsghmc_program,
    build_dsgld_program,
    build_dula_program,
    init_dsghmc,
    init_dsgld,
    init_dula,
    largest_curvatures,
)
from numpyro_fed.infer.admm.samplers import ADMM, DADMMS, DSGHMC, DSGLD, DULA
from numpyro_fed.infer.admm.scaling import (
    LaplaceScaling,
    auto_settings,
    calibrated_noise,
    calibrated_rho,
    curvature_drift,
    laplace_scaling,
    stationary_covariance,
    stationary_sd_ratio,
    stein_spread,
    whitened_potentials,
)
from numpyro_fed.infer.admm.topology import (
    DisconnectedTopologyWarning,
    Topology,
    make_topology,
    metropolis_weights,
    num_components,
)

__all__ = [
    "ADMM",
    "ADMMInfo",
    "ADMMState",
    "AgentPotentials",
    "DADMMS",
    "DSGHMC",
    "DSGLD",
    "DULA",
    "DecentralizedKernel",
    "DecentralizedState",
    "DisconnectedTopologyWarning",
    "GradientInfo",
    "LaplaceScaling",
    "QuadraticPotentials",
    "SGHMCState",
    "SGLDState",
    "SentCounts",
    "Topology",
    "ULAState",
    "agent_potentials",
    "auto_settings",
    "build_dsghmc_program",
    "build_dsgld_program",
    "build_dula_program",
    "build_program",
    "calibrated_noise",
    "calibrated_rho",
    "curvature_drift",
    "init",
    "init_dsghmc",
    "init_dsgld",
    "init_dula",
    "laplace_scaling",
    "largest_curvatures",
    "make_topology",
    "metropolis_weights",
    "newton_prox",
    "num_components",
    "quadratic_potentials",
    "stationary_covariance",
    "stationary_sd_ratio",
    "stein_spread",
    "whitened_potentials",
]
