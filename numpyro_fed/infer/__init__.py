"""The federated inference algorithms."""

from numpyro_fed.infer.zigzag import FedZigZag

__all__ = ["FedZigZag"]
