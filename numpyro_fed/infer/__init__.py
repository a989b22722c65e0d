"""The federated inference algorithms."""

from numpyro_fed.infer.admm import ADMM, DADMMS
from numpyro_fed.infer.base import RunResult, VariationalMethod
from numpyro_fed.infer.baselines import DSGHMC, DSGLD, DULA
from numpyro_fed.infer.dppvi import DPPVI, DPPVIRunResult
from numpyro_fed.infer.svgd import DSVGD, PDSVGD, SVGD, UDSVGD, DistributedSGLD, FedAvg
from numpyro_fed.infer.topology import Topology, make_topology, metropolis_weights
from numpyro_fed.infer.zigzag import FedZigZag, GradientBound, HessianBound

__all__ = [
    "DPPVI",
    "DPPVIRunResult",
    "ADMM",
    "RunResult",
    "VariationalMethod",
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
    "Topology",
    "make_topology",
    "metropolis_weights",
    "FedZigZag",
    "GradientBound",
    "HessianBound",
]
