"""Theorem 5.1 of the Fed-PDMC paper: the calibration (7) and its inverse."""

import math

import numpy as np
import pytest

from numpyro_fed.privacy import calibrate_excess_rate, switching_time_delta, switching_time_epsilon


def theorem_delta(K, rho, eps):
    return math.exp(-(rho / K) * (eps - math.log(1 + K / rho)))


@pytest.mark.parametrize("K", [1.5, 2.0, 10.0])
@pytest.mark.parametrize("eps", [0.1, 1.0, 4.0])
@pytest.mark.parametrize("delta", [1e-2, 1e-5, 1e-9])
def test_calibrated_rate_satisfies_inequality_7_and_the_theorem(K, eps, delta):
    rho = calibrate_excess_rate(K, eps, delta)
    assert rho >= K * (1 + math.log(1 / delta)) / eps * (1 - 1e-12)
    # the theorem's condition epsilon > log(1 + K/rho) holds and its delta is within target
    assert eps > math.log(1 + K / rho)
    assert theorem_delta(K, rho, eps) <= delta
    assert switching_time_delta(K, rho, eps) == pytest.approx(theorem_delta(K, rho, eps))
    # a smaller rate than (7) with the same epsilon can break the target: (7) is not slack by orders
    assert theorem_delta(K, rho / 3, eps) > delta


@pytest.mark.parametrize("K, rho, delta", [(2.0, 10.0, 1e-5), (5.0, 200.0, 1e-3), (1.1, 1.0, 0.5)])
def test_epsilon_is_the_inverse_of_delta(K, rho, delta):
    eps = switching_time_epsilon(K, rho, delta)
    assert switching_time_delta(K, rho, eps) == pytest.approx(delta, rel=1e-10)
    assert switching_time_delta(K, rho, eps * 1.01) < delta
    assert switching_time_delta(K, rho, eps * 0.99) > delta


def test_no_guarantee_below_the_floor():
    K, rho = 2.0, 1.0
    assert switching_time_delta(K, rho, 0.5 * math.log(1 + K / rho)) == 1.0


@pytest.mark.parametrize(
    "args, message",
    [
        ((1.0, 1.0, 1e-5), "sensitivity K must be > 1"),
        ((2.0, 0.0, 1e-5), "epsilon must be a finite number > 0"),
        ((2.0, -1.0, 1e-5), "epsilon must be a finite number > 0"),
        ((2.0, 1.0, 0.0), "delta must be a finite number > 0"),
        ((2.0, 1.0, 1.0), r"delta must lie in \(0, 1\)"),
        ((2.0, 1.0, np.nan), "delta must be finite"),
    ],
)
def test_bad_privacy_parameters(args, message):
    with pytest.raises(ValueError, match=message):
        calibrate_excess_rate(*args)
