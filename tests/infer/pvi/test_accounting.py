"""Privacy accounting: our epsilons against dp-accounting used directly and reference values."""

import dp_accounting
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant

from numpyro_fed.privacy.accounting import (
    calibrate_noise_multiplier,
    compute_epsilon,
    dpsgd_event,
    gaussian_event,
)

REPLACE = dp_accounting.NeighboringRelation.REPLACE_ONE
ADD_REMOVE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
DELTA = 1e-5


def _direct(accountant, event):
    accountant.compose(event)
    return accountant.get_epsilon(DELTA)


@pytest.mark.parametrize(
    "event, accountant, expected",
    [
        (dpsgd_event(1.0, 1000, dataset_size=10_000, sampling_rate=0.01), "pld", 1.828),
        (dpsgd_event(1.0, 1000, dataset_size=10_000, sampling_rate=0.01), "rdp", 2.101),
        (gaussian_event(5.0, 10), "pld", 2.594),
        (gaussian_event(5.0, 10), "rdp", 2.814),
    ],
)
def test_reference_values_add_remove(event, accountant, expected):
    eps = compute_epsilon(event, DELTA, accountant=accountant, neighbouring="add_remove")
    assert eps == pytest.approx(expected, abs=1e-3)


def test_poisson_dpsgd_equals_direct_pld_replace_one():
    ours = compute_epsilon(dpsgd_event(2.0, 300, dataset_size=500, sampling_rate=0.02), DELTA)
    direct = _direct(
        PLDAccountant(REPLACE),
        dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(0.02, dp_event.GaussianDpEvent(2.0)), 300),
    )
    assert ours == direct


def test_without_replacement_equals_direct_rdp_with_halved_noise():
    # RDP takes the noise relative to the substitution sensitivity 2C.
    event = dpsgd_event(2.0, 300, dataset_size=500, batch_size=10, sampling="without_replacement")
    ours = compute_epsilon(event, DELTA)
    direct = _direct(
        RdpAccountant(neighboring_relation=REPLACE),
        dp_event.SelfComposedDpEvent(
            dp_event.SampledWithoutReplacementDpEvent(500, 10, dp_event.GaussianDpEvent(1.0)), 300
        ),
    )
    assert ours == direct


def test_gaussian_update_perturbation_equals_direct_pld():
    ours = compute_epsilon(gaussian_event(8.0, 20), DELTA)
    direct = _direct(PLDAccountant(REPLACE), dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(8.0), 20))
    assert ours == direct
    # Substitution moves a sum of C-bounded terms by 2C: as add/remove with half the noise.
    assert ours == pytest.approx(compute_epsilon(gaussian_event(4.0, 20), DELTA, neighbouring="add_remove"), rel=1e-3)


def test_rdp_and_pld_agree_on_the_convention_under_replace_one():
    # RDP is an upper bound on the (tight) PLD epsilon, and not a loose one here: a missing
    # factor of 2 in either convention would break one of the two inequalities.
    event = gaussian_event(8.0, 20)
    pld = compute_epsilon(event, DELTA, accountant="pld")
    rdp = compute_epsilon(event, DELTA, accountant="rdp")
    assert pld <= rdp <= 1.3 * pld


def test_pld_refuses_without_replacement():
    event = dpsgd_event(1.0, 10, dataset_size=100, batch_size=10, sampling="without_replacement")
    with pytest.raises(ValueError, match="RDP only"):
        compute_epsilon(event, DELTA, accountant="pld")


@pytest.mark.parametrize(
    "make_event",
    [
        lambda s: gaussian_event(s, 10),
        lambda s: dpsgd_event(s, 500, dataset_size=2000, sampling_rate=0.01),
        lambda s: dpsgd_event(s, 200, dataset_size=2000, batch_size=40, sampling="without_replacement"),
    ],
    ids=["gaussian", "poisson", "without_replacement"],
)
def test_calibration_hits_target_from_below(make_event):
    sigma = calibrate_noise_multiplier(make_event, 1.0, DELTA)
    eps = compute_epsilon(make_event(sigma), DELTA)
    assert 0.99 <= eps <= 1.0
    # A slightly smaller noise overspends: the calibration is the smallest noise.
    assert compute_epsilon(make_event(sigma * 0.99), DELTA) > 1.0


@pytest.mark.parametrize("eps", [0.0, -1.0, float("inf")])
def test_bad_epsilon(eps):
    with pytest.raises(ValueError, match="target_epsilon"):
        calibrate_noise_multiplier(lambda s: gaussian_event(s, 1), eps, DELTA)


@pytest.mark.parametrize("delta", [0.0, 1.0, -1e-5, 2.0])
def test_bad_delta(delta):
    with pytest.raises(ValueError, match="delta"):
        compute_epsilon(gaussian_event(1.0, 1), delta)


@pytest.mark.parametrize("rate", [0.0, 1.5, -0.1])
def test_bad_sampling_rate(rate):
    with pytest.raises(ValueError, match="sampling_rate"):
        dpsgd_event(1.0, 10, dataset_size=100, sampling_rate=rate)


def test_bad_noise_multiplier():
    with pytest.raises(ValueError, match="noise_multiplier"):
        gaussian_event(0.0, 3)
