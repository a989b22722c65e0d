"""The federated inference algorithms."""

from numpyro_fed.infer.admm import (
    ADMM,
    DADMMS,
    DSGHMC,
    DSGLD,
    DULA,
    DisconnectedTopologyWarning,
    Topology,
    make_topology,
    metropolis_weights,
)
from numpyro_fed.infer.base import RunResult, VariationalMethod
from numpyro_fed.infer.consensus import ConsensusMC
from numpyro_fed.infer.kernel import FederatedMCMCKernel
from numpyro_fed.infer.pvi import BCM, DPPVI, GaussianPVI, GlobalVI
from numpyro_fed.infer.rounds import RunCheckpoint
from numpyro_fed.infer.stein import DSVGD, PDSVGD, SVGD, UDSVGD, DistributedSGLD, FedAvg
from numpyro_fed.infer.zigzag import FedZigZag, GradientBound, HessianBound, RowHessianBound

__all__ = [
    "ConsensusMC",
    "DPPVI",
    "BCM",
    "GlobalVI",
    "ADMM",
    "RunCheckpoint",
    "RunResult",
    "VariationalMethod",
    "FederatedMCMCKernel",
    "DADMMS",
    "DSGHMC",
    "DSGLD",
    "DULA",
    "DSVGD",
    "PDSVGD",
    "SVGD",
    "UDSVGD",
    "DistributedSGLD",
    "FedAvg",
    "DisconnectedTopologyWarning",
    "GaussianPVI",
    "Topology",
    "make_topology",
    "metropolis_weights",
    "FedZigZag",
    "GradientBound",
    "HessianBound",
    "RowHessianBound",
]
