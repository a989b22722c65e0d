"""The federated inference algorithms."""

from numpyro_fed.infer.admm import ADMM, DADMMS
from numpyro_fed.infer.baselines import DSGHMC, DSGLD, DULA
from numpyro_fed.infer.topology import Topology, make_topology, metropolis_weights
from numpyro_fed.infer.zigzag import FedZigZag, GradientBound, HessianBound

__all__ = [
    "ADMM",
    "DADMMS",
    "DSGHMC",
    "DSGLD",
    "DULA",
    "Topology",
    "make_topology",
    "metropolis_weights",
    "FedZigZag",
    "GradientBound",
    "HessianBound",
]
