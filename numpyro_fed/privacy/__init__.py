"""Privacy guarantees: how they are computed and how they are reported."""

from numpyro_fed.privacy.accounting import (
    calibrate_noise_multiplier,
    compute_epsilon,
    dpsgd_event,
    gaussian_event,
)
from numpyro_fed.privacy.guarantee import PrivacyGuarantee
from numpyro_fed.privacy.pdmp import (
    calibrate_excess_rate,
    switching_time_delta,
    switching_time_epsilon,
    switching_time_guarantee,
)

__all__ = [
    "PrivacyGuarantee",
    "calibrate_noise_multiplier",
    "compute_epsilon",
    "dpsgd_event",
    "gaussian_event",
    "calibrate_excess_rate",
    "switching_time_delta",
    "switching_time_epsilon",
    "switching_time_guarantee",
]
