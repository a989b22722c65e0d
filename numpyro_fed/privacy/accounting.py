"""Privacy accounting with ``dp-accounting``: the events of a run, their epsilon, and noise
calibration to a target epsilon.

Every mechanism of the project adds Gaussian noise of standard deviation
``noise_multiplier * C`` to a sum of terms, each bounded in norm by ``C`` and each depending
on one row (a clipped per-example gradient, a clipped change of one shard's parameters).
Events are written in that convention: ``GaussianDpEvent(noise_multiplier)``.

Two neighbouring relations are supported:

* ``"replace_one"`` (default; the substitution relation of the DP-PVI paper): one row of one
  client is replaced by another, so the sum moves by up to ``2C``;
* ``"add_remove"``: one row is added or removed, so the sum moves by up to ``C``.

The PLD accountant handles both relations itself. The RDP accountant takes its noise
multiplier relative to the full sensitivity, so under ``"replace_one"`` the noise multipliers
are halved before it sees them; it is the only accountant for sampling without replacement,
which ``dp-accounting`` analyses under ``"replace_one"`` only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from numpyro_fed._checks import check_int, check_positive, check_real
from numpyro_fed.privacy.guarantee import PrivacyGuarantee

if TYPE_CHECKING:
    from dp_accounting import dp_event

__all__ = [
    "NEIGHBOURING",
    "calibrate_noise_multiplier",
    "check_delta",
    "check_epsilon",
    "check_sampling_rate",
    "compute_epsilon",
    "dpsgd_event",
    "gaussian_event",
    "make_accountant",
    "ACCOUNTANT_TOLERANCE",
    "accountant_event",
    "describe_accountant",
    "privacy_guarantee",
    "resolve_accountant",
]

#: dp-accounting's name of each neighbouring relation (``NeighboringRelation``). dp-accounting
#: (and SciPy through it) is imported where an event or an accountant is made, not with this
#: module: a process that accounts nothing (a client's) does not pay for its import.
_RELATIONS = {"replace_one": "REPLACE_ONE", "add_remove": "ADD_OR_REMOVE_ONE"}


def _events():
    """dp-accounting's ``dp_event`` module, imported on first use."""
    from dp_accounting import dp_event

    return dp_event


#: What each neighbouring relation means, in words (for :class:`PrivacyGuarantee`).
NEIGHBOURING = {
    "replace_one": "one row of one client replaced by another (substitution)",
    "add_remove": "one row of one client added or removed",
}

_SAMPLING = ("poisson", "without_replacement", "full")


# -- checks -----------------------------------------------------------------------------------


def check_epsilon(epsilon, name: str = "target_epsilon") -> float:
    """``epsilon > 0`` (finite), or a ValueError naming the argument."""
    return check_positive(epsilon, name)


def check_delta(delta, name: str = "delta") -> float:
    """``delta`` in ``(0, 1)``, or a ValueError naming the argument."""
    delta = check_real(delta, name)
    if not 0.0 < delta < 1.0:
        raise ValueError(f"{name} must lie in (0, 1), got {delta}")
    return delta


def check_sampling_rate(rate, name: str = "sampling_rate") -> float:
    """``rate`` in ``(0, 1]``, or a ValueError naming the argument."""
    rate = check_real(rate, name)
    if not 0.0 < rate <= 1.0:
        raise ValueError(f"{name} must lie in (0, 1], got {rate}")
    return rate


def _check_relation(neighbouring: str) -> str:
    if neighbouring not in _RELATIONS:
        raise ValueError(f"neighbouring must be one of {sorted(_RELATIONS)}, got {neighbouring!r}")
    return neighbouring


def _check_noise(noise_multiplier) -> float:
    return check_positive(noise_multiplier, "noise_multiplier")


# -- events -----------------------------------------------------------------------------------


def gaussian_event(noise_multiplier: float, count: int = 1) -> dp_event.DpEvent:
    """``count`` uses of the Gaussian mechanism on the full data (no subsampling): the
    update perturbation of local averaging and virtual clients, one per global update.

    >>> gaussian_event(5.0, 10)
    SelfComposedDpEvent(event=GaussianDpEvent(noise_multiplier=5.0), count=10)
    """
    event = _events().GaussianDpEvent(_check_noise(noise_multiplier))
    return _events().SelfComposedDpEvent(event, check_int(count, "count", minimum=0))


def dpsgd_event(
    noise_multiplier: float,
    num_steps: int,
    *,
    dataset_size: int,
    batch_size: int | None = None,
    sampling_rate: float | None = None,
    sampling: str = "poisson",
) -> dp_event.DpEvent:
    """``num_steps`` steps of DP-SGD on one client's ``dataset_size`` rows.

    :param str sampling: ``"poisson"`` (each row joins a step's batch with probability
        ``sampling_rate``), ``"without_replacement"`` (a uniformly random batch of
        ``batch_size`` rows) or ``"full"`` (every row, every step).

    >>> dpsgd_event(1.0, 1000, dataset_size=100, sampling_rate=0.01)  # doctest: +ELLIPSIS
    SelfComposedDpEvent(event=PoissonSampledDpEvent(sampling_probability=0.01, ...), count=1000)
    """
    noise_multiplier = _check_noise(noise_multiplier)
    num_steps = check_int(num_steps, "num_steps", minimum=0)
    dataset_size = check_int(dataset_size, "dataset_size", minimum=1)
    gaussian = _events().GaussianDpEvent(noise_multiplier)
    if sampling == "poisson":
        if sampling_rate is None:
            raise ValueError("Poisson sampling needs sampling_rate")
        rate = check_sampling_rate(sampling_rate)
        step = gaussian if rate == 1.0 else _events().PoissonSampledDpEvent(rate, gaussian)
    elif sampling == "without_replacement":
        if batch_size is None:
            raise ValueError("sampling without replacement needs batch_size")
        batch_size = check_int(batch_size, "batch_size", minimum=1)
        if batch_size > dataset_size:
            raise ValueError(f"batch_size ({batch_size}) exceeds dataset_size ({dataset_size})")
        step = (
            gaussian
            if batch_size == dataset_size
            else _events().SampledWithoutReplacementDpEvent(dataset_size, batch_size, gaussian)
        )
    elif sampling == "full":
        step = gaussian
    else:
        raise ValueError(f"sampling must be one of {_SAMPLING}, got {sampling!r}")
    return _events().SelfComposedDpEvent(step, num_steps)


def _contains(event, kind) -> bool:
    if isinstance(event, kind):
        return True
    if isinstance(event, _events().SelfComposedDpEvent):
        return _contains(event.event, kind)
    if isinstance(event, _events().ComposedDpEvent):
        return any(_contains(e, kind) for e in event.events)
    if isinstance(event, (_events().PoissonSampledDpEvent, _events().SampledWithoutReplacementDpEvent)):
        return _contains(event.event, kind)
    return False


def _scale_noise(event, factor: float):
    """The same event with every Gaussian noise multiplier multiplied by ``factor``."""
    if isinstance(event, _events().GaussianDpEvent):
        return _events().GaussianDpEvent(event.noise_multiplier * factor)
    if isinstance(event, _events().SelfComposedDpEvent):
        return _events().SelfComposedDpEvent(_scale_noise(event.event, factor), event.count)
    if isinstance(event, _events().ComposedDpEvent):
        return _events().ComposedDpEvent([_scale_noise(e, factor) for e in event.events])
    if isinstance(event, _events().PoissonSampledDpEvent):
        return _events().PoissonSampledDpEvent(event.sampling_probability, _scale_noise(event.event, factor))
    if isinstance(event, _events().SampledWithoutReplacementDpEvent):
        return _events().SampledWithoutReplacementDpEvent(
            event.source_dataset_size, event.sample_size, _scale_noise(event.event, factor)
        )
    return event


def resolve_accountant(event, accountant: str | None, neighbouring: str) -> str:
    """The accountant that covers ``event`` (``None``: PLD unless it samples without
    replacement); a ``ValueError`` where ``dp-accounting`` has none for it."""
    without_replacement = _contains(event, _events().SampledWithoutReplacementDpEvent)
    if accountant is None:
        accountant = "rdp" if without_replacement else "pld"
    if accountant not in ("pld", "rdp"):
        raise ValueError(f"accountant must be 'pld', 'rdp' or None, got {accountant!r}")
    if without_replacement:
        if accountant == "pld":
            raise ValueError(
                "sampling without replacement is accounted with RDP only (dp-accounting has no "
                "PLD for it): use accountant='rdp' or Poisson sampling"
            )
        if neighbouring != "replace_one":
            raise ValueError("sampling without replacement is accounted under neighbouring='replace_one' only")
    if accountant == "rdp" and neighbouring == "replace_one" and _contains(event, _events().PoissonSampledDpEvent):
        raise ValueError(
            "dp-accounting's RDP accountant has no Poisson subsampling under 'replace_one': "
            "use accountant='pld' or neighbouring='add_remove'"
        )
    return accountant


def make_accountant(accountant: str, neighbouring: str = "replace_one", *, value_discretization_interval: float = 1e-4):
    """A fresh ``dp-accounting`` accountant: ``"pld"`` or ``"rdp"``."""
    import dp_accounting
    from dp_accounting.pld import PLDAccountant
    from dp_accounting.rdp import RdpAccountant

    relation = getattr(dp_accounting.NeighboringRelation, _RELATIONS[_check_relation(neighbouring)])
    if accountant == "pld":
        return PLDAccountant(relation, value_discretization_interval=value_discretization_interval)
    if accountant == "rdp":
        return RdpAccountant(neighboring_relation=relation)
    raise ValueError(f"accountant must be 'pld' or 'rdp', got {accountant!r}")


def accountant_event(event, accountant: str, neighbouring: str):
    """``event`` in the accountant's own noise convention (see the module's docstring)."""
    # RDP takes noise relative to the full sensitivity: 2C under substitution.
    if accountant == "rdp" and neighbouring == "replace_one":
        return _scale_noise(event, 0.5)
    return event


def compute_epsilon(
    event: dp_event.DpEvent,
    delta: float,
    *,
    accountant: str | None = None,
    neighbouring: str = "replace_one",
) -> float:
    """Epsilon at ``delta`` of ``event`` (in the noise convention of this module).

    :param str accountant: ``"pld"``, ``"rdp"`` or ``None`` (PLD unless the event samples
        without replacement, which only RDP covers).
    :param str neighbouring: ``"replace_one"`` or ``"add_remove"``.

    >>> round(compute_epsilon(gaussian_event(5.0, 10), 1e-5, neighbouring="add_remove"), 3)
    2.594
    """
    delta = check_delta(delta)
    neighbouring = _check_relation(neighbouring)
    accountant = resolve_accountant(event, accountant, neighbouring)
    acc = make_accountant(accountant, neighbouring)
    acc.compose(accountant_event(event, accountant, neighbouring))
    return float(acc.get_epsilon(delta))


def calibrate_noise_multiplier(
    make_event: Callable[[float], dp_event.DpEvent],
    target_epsilon: float,
    delta: float,
    *,
    accountant: str | None = None,
    neighbouring: str = "replace_one",
    rtol: float = 1e-3,
) -> float:
    """The smallest noise multiplier (within ``rtol``) whose event spends at most
    ``target_epsilon``: ``compute_epsilon(make_event(result), delta) <= target_epsilon``.

    :param make_event: ``noise_multiplier -> DpEvent``.

    >>> sigma = calibrate_noise_multiplier(lambda s: gaussian_event(s, 10), 1.0, 1e-5)
    >>> eps = compute_epsilon(gaussian_event(sigma, 10), 1e-5)
    >>> eps <= 1.0, eps > 0.99
    (True, True)
    """
    from scipy.optimize import brentq

    target_epsilon = check_epsilon(target_epsilon)
    delta = check_delta(delta)
    neighbouring = _check_relation(neighbouring)
    accountant = resolve_accountant(make_event(1.0), accountant, neighbouring)

    def epsilon_of(sigma, interval=1e-4):
        acc = make_accountant(accountant, neighbouring, value_discretization_interval=interval)
        acc.compose(accountant_event(make_event(sigma), accountant, neighbouring))
        return float(acc.get_epsilon(delta))

    def refine(low, high, tol, interval):
        """The root of epsilon(sigma) = target in [low, high] (Brent), then the smallest
        sigma above it, in steps of ``tol``, that spends at most the target."""
        root = brentq(
            lambda log_sigma: epsilon_of(math.exp(log_sigma), interval) - target_epsilon,
            math.log(low),
            math.log(high),
            xtol=tol / 4,
        )
        sigma = math.exp(root)
        while epsilon_of(sigma, interval) > target_epsilon:
            sigma *= 1.0 + tol / 4
        return sigma

    # A coarse PLD (pessimistic, so an upper bound on the fine one, and fast) brackets the
    # answer; the accountant's own resolution then refines it. Epsilon decreases in sigma.
    coarse = 1e-2 if accountant == "pld" else 1e-4
    low, high = 0.25, 1.0
    while epsilon_of(high, coarse) > target_epsilon:
        low, high = high, high * 2.0
        if high > 1e6:
            raise ValueError(f"no noise multiplier below 1e6 reaches epsilon={target_epsilon}")
    while epsilon_of(low, coarse) <= target_epsilon:
        high, low = low, low / 2.0
        if low < 1e-4:
            return high
    if accountant == "rdp":
        return refine(low, high, rtol, coarse)
    high = refine(low, high, 1e-2, coarse)  # feasible for the fine accountant too
    low = high / (1.0 + 1e-2)
    while epsilon_of(low) <= target_epsilon:
        high, low = low, low / (1.0 + 1e-2)
    return refine(low, high, rtol, 1e-4)


def privacy_guarantee(
    epsilon: float, delta: float, *, scope: str, neighbouring: str, method: str, **details
) -> PrivacyGuarantee:
    """A :class:`PrivacyGuarantee` with the relation written out in words; ``details``: its
    other fields (accountant, sampling, noise, clip norms, steps, ...)."""
    return PrivacyGuarantee(
        epsilon=float(epsilon),
        delta=float(delta),
        scope=scope,
        neighbouring=NEIGHBOURING[_check_relation(neighbouring)],
        method=method,
        **details,
    )


#: What each accountant's epsilon is, in words (for :class:`PrivacyGuarantee`).
ACCOUNTANT_TOLERANCE = {
    "pld": (
        "a pessimistic privacy-loss-distribution estimate at value_discretization_interval=1e-4: "
        "the reported epsilon upper-bounds the exact one"
    ),
    "rdp": (
        "Renyi-DP at dp-accounting's default orders, converted to (epsilon, delta): an upper bound, "
        "looser than PLD (e.g. 2.10 against 1.83 for DP-SGD at rate 0.01, noise 1, 1000 steps, delta 1e-5)"
    ),
}


def describe_accountant(accountant: str) -> tuple[str, str]:
    """``(accountant, tolerance)`` in words for ``"pld"`` or ``"rdp"``."""
    name = {"pld": "PLD", "rdp": "RDP"}[accountant]
    return f"{name} (dp-accounting)", ACCOUNTANT_TOLERANCE[accountant]
