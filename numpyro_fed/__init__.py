"""numpyro_fed: federated Bayesian inference for NumPyro models."""

from numpyro_fed.arviz import to_inference_data
from numpyro_fed.federation import (
    ClientError,
    ClientProgram,
    ClientState,
    Federation,
    InProcess,
    MessageLedger,
    NetworkError,
    RayFederation,
)
from numpyro_fed.infer import (
    ADMM,
    BCM,
    DADMMS,
    DPPVI,
    DSGHMC,
    DSGLD,
    DSVGD,
    DULA,
    PDSVGD,
    SVGD,
    UDSVGD,
    ConsensusMC,
    DistributedSGLD,
    FedAvg,
    FedZigZag,
    GaussianPVI,
    GlobalVI,
    GradientBound,
    HessianBound,
    RowHessianBound,
    make_topology,
)
from numpyro_fed.infer.ledger import message_ledger
from numpyro_fed.plate import federated_plate, normalize_clients
from numpyro_fed.potential import FederatedPotential, FlatPotential, GroupIndex, PlateInfo, split_potential
from numpyro_fed.privacy.budget import PrivacyBudget

__version__ = "0.1.0.dev0"

__all__ = [
    "BCM",
    "ConsensusMC",
    "ClientError",
    "ClientProgram",
    "ClientState",
    "Federation",
    "InProcess",
    "MessageLedger",
    "NetworkError",
    "DPPVI",
    "GlobalVI",
    "ADMM",
    "DADMMS",
    "DSGHMC",
    "DSGLD",
    "DULA",
    "DSVGD",
    "DistributedSGLD",
    "FedAvg",
    "GaussianPVI",
    "PDSVGD",
    "SVGD",
    "UDSVGD",
    "make_topology",
    "message_ledger",
    "FedZigZag",
    "FederatedPotential",
    "FlatPotential",
    "GradientBound",
    "GroupIndex",
    "HessianBound",
    "RowHessianBound",
    "PlateInfo",
    "PrivacyBudget",
    "RayFederation",
    "federated_plate",
    "normalize_clients",
    "split_potential",
    "to_inference_data",
]
