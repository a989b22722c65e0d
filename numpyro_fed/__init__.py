"""numpyro_fed: federated Bayesian inference for NumPyro models."""

from numpyro_fed._lazy import lazy_names

#: where each public name lives; imported on first use (PEP 562), so that a process that
#: needs one method (a Flower ClientApp, started anew for every message) imports that
#: method's modules only, not every algorithm's (and SciPy's statistics behind some).
_WHERE = {
    "to_inference_data": "numpyro_fed.arviz",
    **dict.fromkeys(
        (
            "ClientError",
            "ClientProgram",
            "ClientState",
            "Federation",
            "InProcess",
            "MessageLedger",
            "NetworkError",
            "RayFederation",
        ),
        "numpyro_fed.federation",
    ),
    **dict.fromkeys(
        (
            "ADMM",
            "BCM",
            "DADMMS",
            "DPPVI",
            "DSGHMC",
            "DSGLD",
            "DSVGD",
            "DULA",
            "PDSVGD",
            "SVGD",
            "UDSVGD",
            "ConsensusMC",
            "DistributedSGLD",
            "FedAvg",
            "FedZigZag",
            "GaussianPVI",
            "GlobalVI",
            "GradientBound",
            "HessianBound",
            "RowHessianBound",
            "make_topology",
        ),
        "numpyro_fed.infer",
    ),
    "message_ledger": "numpyro_fed.infer.ledger",
    "federated_plate": "numpyro_fed.plate",
    "normalize_clients": "numpyro_fed.plate",
    **dict.fromkeys(
        ("FederatedPotential", "FlatPotential", "GroupIndex", "PlateInfo", "split_potential"), "numpyro_fed.potential"
    ),
    "PrivacyBudget": "numpyro_fed.privacy.budget",
}


__getattr__, __dir__ = lazy_names(__name__, _WHERE)


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
