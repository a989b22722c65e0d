"""Partitioned variational inference: PVI (Ashman et al. 2022), DP-PVI (Heikkilä et al. 2023)
and their baselines.

* :mod:`~numpyro_fed.infer.pvi.gaussian`: Gaussians (diagonal or full-rank) in natural
  parameters; :mod:`~numpyro_fed.infer.pvi.prior`: how the prior enters ``q`` (its exact
  Gaussian part and the server's prior factor);
  :mod:`~numpyro_fed.infer.pvi.layout`: a client's block in PVI's layout;
* :mod:`~numpyro_fed.infer.pvi.client`: a client's local optimization and message;
  :mod:`~numpyro_fed.infer.pvi.local`: clients with latents of their own (each keeps its
  ``q(z_m)``);
* :mod:`~numpyro_fed.infer.pvi.core`: state, server update and the pure rounds
  (``init``, ``build_step``, ``build_client_step``), the one core of every face below;
  :mod:`~numpyro_fed.infer.pvi.loss`: its loss, the negative ELBO (through the clients);
* :mod:`~numpyro_fed.infer.pvi.baseline_core`: the baselines' start and end of that core;
* :mod:`~numpyro_fed.infer.pvi.accounting`: the privacy side (automatic settings, noise
  calibration, accounting); :mod:`~numpyro_fed.infer.pvi.settings`: DPPVI's arguments;
  :mod:`~numpyro_fed.infer.pvi.diagnostics`: how a run is judged at its end;
* faces: :class:`DPPVI` (:mod:`~numpyro_fed.infer.pvi.dppvi`), :class:`BCM`,
  :class:`GlobalVI` (:mod:`~numpyro_fed.infer.pvi.baselines`) and :class:`GaussianPVI`
  (:mod:`~numpyro_fed.infer.pvi.gaussian_pvi`).
"""

from numpyro_fed.infer.pvi.baselines import BCM, GlobalVI
from numpyro_fed.infer.pvi.core import (
    ClientFactor,
    PVIInfo,
    PVIState,
    build_client_step,
    build_step,
    client_factors,
    client_functions,
    init,
)
from numpyro_fed.infer.pvi.dppvi import DPPVI
from numpyro_fed.infer.pvi.gaussian import GaussianNatural
from numpyro_fed.infer.pvi.gaussian_pvi import GaussianPVI, GaussianPVIInfo
from numpyro_fed.infer.pvi.settings import default_optimizer

__all__ = [
    "BCM",
    "ClientFactor",
    "DPPVI",
    "GaussianNatural",
    "GaussianPVI",
    "GaussianPVIInfo",
    "GlobalVI",
    "PVIInfo",
    "PVIState",
    "build_client_step",
    "build_step",
    "client_factors",
    "client_functions",
    "default_optimizer",
    "init",
]
