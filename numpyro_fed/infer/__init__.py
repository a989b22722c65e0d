"""The federated inference algorithms."""

from numpyro_fed.infer.zigzag import FedZigZag, GradientBound, HessianBound

__all__ = ["FedZigZag", "GradientBound", "HessianBound"]
