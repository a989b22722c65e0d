"""The federated inference algorithms."""

from numpyro_fed._lazy import lazy_names

#: where each public name lives; imported on first use (PEP 562): a process that runs one
#: method imports that family's modules only.
_WHERE = {
    **dict.fromkeys(
        (
            "ADMM",
            "DADMMS",
            "DSGHMC",
            "DSGLD",
            "DULA",
            "DisconnectedTopologyWarning",
            "Topology",
            "make_topology",
            "metropolis_weights",
        ),
        "numpyro_fed.infer.admm",
    ),
    "RunResult": "numpyro_fed.infer.base",
    "VariationalMethod": "numpyro_fed.infer.base",
    "ConsensusMC": "numpyro_fed.infer.consensus",
    "FederatedMCMCKernel": "numpyro_fed.infer.kernel",
    **dict.fromkeys(("BCM", "DPPVI", "GaussianPVI", "GlobalVI"), "numpyro_fed.infer.pvi"),
    "RunCheckpoint": "numpyro_fed.infer.rounds",
    **dict.fromkeys(("DSVGD", "PDSVGD", "SVGD", "UDSVGD", "DistributedSGLD", "FedAvg"), "numpyro_fed.infer.stein"),
    **dict.fromkeys(("FedZigZag", "GradientBound", "HessianBound", "RowHessianBound"), "numpyro_fed.infer.zigzag"),
}


__getattr__, __dir__ = lazy_names(__name__, _WHERE)


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
