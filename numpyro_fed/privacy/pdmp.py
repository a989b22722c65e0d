"""Differential privacy of the switching times of a federated PDMP (Theorem 5.1 of
Bierkens & Duncan 2022, *Federated Bayesian computation via piecewise deterministic Markov
processes*).

A client whose switching intensity satisfies ``lambda >= rho`` everywhere, and changes by at
most ``K`` when one of its rows changes (``|lambda - lambda~| <= K``, ``K > 1``), sends each
proposed switching time with (epsilon, delta)-differential privacy for every
``epsilon > log(1 + K / rho)`` with

    delta = exp(-(rho / K) (epsilon - log(1 + K / rho))).

The excess (refreshment) rate ``rho`` is what buys privacy; (7) gives a sufficient choice,
``rho >= K (1 + log(1 / delta)) / epsilon``. The guarantee is **per message**: it does not
compose the many switching times a client sends during a run.
"""

from __future__ import annotations

import math

from numpyro_fed._checks import check_positive
from numpyro_fed.privacy.guarantee import PrivacyGuarantee

__all__ = [
    "calibrate_excess_rate",
    "switching_time_delta",
    "switching_time_epsilon",
    "switching_time_guarantee",
]


def _check_sensitivity(sensitivity) -> float:
    sensitivity = check_positive(sensitivity, "sensitivity")
    if sensitivity <= 1:
        raise ValueError(f"sensitivity K must be > 1 (Theorem 5.1), got {sensitivity}")
    return sensitivity


def _check_delta(delta) -> float:
    delta = check_positive(delta, "delta")
    if not delta < 1:
        raise ValueError(f"delta must lie in (0, 1), got {delta}")
    return delta


def switching_time_delta(sensitivity: float, excess_rate: float, epsilon: float) -> float:
    """``delta`` of one switching time at ``epsilon`` (Theorem 5.1); 1.0 where the theorem
    gives nothing (``epsilon <= log(1 + K / rho)``).

    >>> f"{switching_time_delta(2.0, 50.0, 1.0):.2e}"
    '3.70e-11'
    """
    sensitivity = _check_sensitivity(sensitivity)
    excess_rate = check_positive(excess_rate, "excess_rate")
    epsilon = check_positive(epsilon, "epsilon")
    floor = math.log1p(sensitivity / excess_rate)
    if epsilon <= floor:
        return 1.0
    return math.exp(-(excess_rate / sensitivity) * (epsilon - floor))


def switching_time_epsilon(sensitivity: float, excess_rate: float, delta: float) -> float:
    """The smallest ``epsilon`` with ``switching_time_delta(K, rho, epsilon) <= delta``.

    >>> eps = switching_time_epsilon(2.0, 50.0, 1e-5)
    >>> abs(switching_time_delta(2.0, 50.0, eps) - 1e-5) < 1e-12
    True
    """
    sensitivity = _check_sensitivity(sensitivity)
    excess_rate = check_positive(excess_rate, "excess_rate")
    delta = _check_delta(delta)
    return math.log1p(sensitivity / excess_rate) + (sensitivity / excess_rate) * math.log(1 / delta)


def calibrate_excess_rate(sensitivity: float, epsilon: float, delta: float) -> float:
    """The excess rate ``rho = K (1 + log(1/delta)) / epsilon`` of (7), which makes each
    switching time (epsilon, delta)-DP.

    >>> rho = calibrate_excess_rate(2.0, 1.0, 1e-5)
    >>> round(rho, 3), switching_time_delta(2.0, rho, 1.0) <= 1e-5
    (25.026, True)
    """
    sensitivity = _check_sensitivity(sensitivity)
    epsilon = check_positive(epsilon, "epsilon")
    delta = _check_delta(delta)
    return sensitivity * (1 + math.log(1 / delta)) / epsilon


def switching_time_guarantee(
    sensitivity: float, excess_rate: float, delta: float, *, epsilon: float | None = None
) -> tuple[float, PrivacyGuarantee]:
    """The excess rate a federated PDMP runs with and the guarantee of Theorem 5.1 for each
    switching time a client sends.

    :param float sensitivity: ``K > 1``, the most one row of a client moves its intensity.
    :param float excess_rate: the refreshment rate ``rho`` asked for; 0 with ``epsilon``:
        calibrate it by (7).
    :param float delta: delta per switching time, in (0, 1).
    :param float epsilon: the target epsilon per switching time (``None``: whatever
        ``excess_rate`` gives).
    :return: ``(excess_rate, guarantee)``.

    >>> rho, guarantee = switching_time_guarantee(2.0, 0.0, 1e-5, epsilon=1.0)
    >>> round(rho, 3), guarantee.epsilon <= 1.0, guarantee.scope.startswith("each switching time")
    (25.026, True, True)
    """
    if epsilon is not None:
        target = check_positive(epsilon, "dp_epsilon")
        if excess_rate == 0.0:
            excess_rate = calibrate_excess_rate(sensitivity, target, delta)
        achieved = switching_time_epsilon(sensitivity, excess_rate, delta)
        if achieved > target:
            raise ValueError(
                f"excess_rate={excess_rate} gives epsilon={achieved:.4g} per switching "
                f"time, above dp_epsilon={target}; leave excess_rate unset to calibrate it"
            )
    elif excess_rate <= 0.0:
        raise ValueError("a privacy guarantee needs excess_rate > 0 (or dp_epsilon to calibrate it)")
    guarantee = PrivacyGuarantee(
        epsilon=switching_time_epsilon(sensitivity, excess_rate, delta),
        delta=float(delta),
        scope="each switching time a client sends (per message, not composed over the run)",
        neighbouring=f"one row of one client changed, moving its intensity by at most K={sensitivity}",
        method=f"Theorem 5.1 of Bierkens & Duncan (2022), excess rate rho={excess_rate:.6g} per client",
        accountant="none: the closed form of Theorem 5.1",
        tolerance="exact bound, no numerical tolerance; not composed over the switching times of a run",
        unit="example-level: one row of one client",
        sampling="none: each client's rate uses all its rows",
    )
    return excess_rate, guarantee
