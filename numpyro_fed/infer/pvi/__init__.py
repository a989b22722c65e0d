"""Partitioned variational inference: PVI (Ashman et al. 2022), DP-PVI (Heikkilä et al. 2023)
and their baselines.

* :mod:`~numpyro_fed.infer.pvi.gaussian`: diagonal Gaussians in natural parameters;
* :mod:`~numpyro_fed.infer.pvi.client`: a client's local optimization and message;
* :mod:`~numpyro_fed.infer.pvi.core`: state, server update and the pure round
  (``init``, ``build_step``);
* :mod:`~numpyro_fed.infer.pvi.accounting`: the privacy side (automatic settings, noise
  calibration, accounting);
* faces: :class:`DPPVI` (:mod:`~numpyro_fed.infer.pvi.dppvi`), :class:`BCM`,
  :class:`GlobalVI` (:mod:`~numpyro_fed.infer.pvi.baselines`) and :class:`GaussianPVI`
  (:mod:`~numpyro_fed.infer.pvi.gaussian_pvi`).
"""

from numpyro_fed.infer.pvi.baselines import BCM, GlobalVI
from numpyro_fed.infer.pvi.client import LocalConfig, LocalParams, client_update, clip_by_norm, optimize_local, per_example_grads
from numpyro_fed.infer.pvi.core import (ClientData, ClientFactor, PVIInfo, PVIState, build_step, client_factors, init,
                                       negative_elbo, server_update, shard_layout)
from numpyro_fed.infer.pvi.dppvi import DPPVI, default_optimizer
from numpyro_fed.infer.pvi.gaussian import GaussianNatural, gaussian_prior, kl_divergence, loc_scale, natural
from numpyro_fed.infer.pvi.gaussian_pvi import GaussianPVI, GaussianPVIInfo

__all__ = [
    "BCM",
    "ClientData",
    "ClientFactor",
    "DPPVI",
    "GaussianNatural",
    "GaussianPVI",
    "GaussianPVIInfo",
    "GlobalVI",
    "LocalConfig",
    "LocalParams",
    "PVIInfo",
    "PVIState",
    "build_step",
    "client_factors",
    "client_update",
    "clip_by_norm",
    "default_optimizer",
    "gaussian_prior",
    "init",
    "kl_divergence",
    "loc_scale",
    "natural",
    "negative_elbo",
    "optimize_local",
    "per_example_grads",
    "server_update",
    "shard_layout",
]

