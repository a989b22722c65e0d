"""Privacy guarantees: how they are computed, how they are reported, the budget runs draw
from and the clients' private randomness."""

from numpyro_fed.privacy.accounting import (
    calibrate_noise_multiplier,
    compute_epsilon,
    dpsgd_event,
    gaussian_event,
)
from numpyro_fed.privacy.budget import PrivacyBudget
from numpyro_fed.privacy.guarantee import PrivacyGuarantee
from numpyro_fed.privacy.pdmp import (
    calibrate_excess_rate,
    switching_time_delta,
    switching_time_epsilon,
    switching_time_guarantee,
)
from numpyro_fed.privacy.randomness import PrivateSeed, clients_are_separate, private_program

__all__ = [
    "PrivacyBudget",
    "PrivacyGuarantee",
    "PrivateSeed",
    "calibrate_noise_multiplier",
    "clients_are_separate",
    "compute_epsilon",
    "dpsgd_event",
    "gaussian_event",
    "private_program",
    "calibrate_excess_rate",
    "switching_time_delta",
    "switching_time_epsilon",
    "switching_time_guarantee",
]
