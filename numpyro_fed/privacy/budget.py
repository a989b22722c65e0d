"""A privacy budget that several runs on the same data draw from: :class:`PrivacyBudget`.

Each run's mechanisms (its ``dp-accounting`` events) are composed by one accountant with
those of the runs before it; a run whose composition would exceed the budget's epsilon at
its delta is refused before it starts.
"""

from __future__ import annotations

from numpyro_fed.privacy.accounting import (
    NEIGHBOURING,
    accountant_event,
    check_delta,
    check_epsilon,
    make_accountant,
    resolve_accountant,
)
from numpyro_fed.privacy.guarantee import PrivacyGuarantee

__all__ = ["PrivacyBudget"]


class PrivacyBudget:
    """An ``(epsilon, delta)`` budget for every private run on the same data.

    Give it to each run (``nf.DPPVI(..., budget=budget)``): before a run starts, its
    mechanisms are composed with those of the runs already charged (one accountant, at the
    budget's ``delta``); a run that would take the total past ``epsilon`` is refused with a
    ``ValueError`` and charges nothing. A run that starts is charged (whether or not it
    finishes: its clients may already have sent noised messages), and its guarantee names the
    budget and what it has spent.

    Within a run each row belongs to one client, so a run's guarantee is its worst client's.
    Across runs the budget does not assume the same partition: it composes every distinct
    mechanism of a run's clients (an upper bound; exact when the clients' mechanisms are equal,
    e.g. the same noise and equal sizes).

    :param float epsilon: the most the runs may spend together.
    :param float delta: the runs' delta together.
    :param str neighbouring: ``"replace_one"`` or ``"add_remove"``: the runs' relation.
    :param str name: shown in the runs' guarantees.

    >>> budget = PrivacyBudget(3.0, 1e-5, name="trial data")
    >>> budget
    PrivacyBudget(epsilon=3.0, delta=1e-05, name='trial data', spent=0, runs=0)
    """

    def __init__(self, epsilon: float, delta: float, *, neighbouring: str = "replace_one", name: str = "budget"):
        self.epsilon = check_epsilon(epsilon, "epsilon")
        self.delta = check_delta(delta)
        if neighbouring not in ("replace_one", "add_remove"):
            raise ValueError(f"neighbouring must be 'replace_one' or 'add_remove', got {neighbouring!r}")
        self.neighbouring = neighbouring
        self.name = str(name)
        #: the guarantees of the runs charged, in order
        self.runs: list[PrivacyGuarantee] = []
        self._events: list = []
        self._reserved = 0.0
        self._accountant: str | None = None

    def __repr__(self) -> str:
        return (
            f"PrivacyBudget(epsilon={self.epsilon}, delta={self.delta}, name={self.name!r}, "
            f"spent={self.spent:.4g}, runs={len(self.runs)})"
        )

    @property
    def spent(self) -> float:
        """The epsilon the runs charged so far spend together (0 before the first)."""
        return self._compose(self._events, self._reserved, self._accountant)[0] if self._events else 0

    @property
    def remaining(self) -> float:
        """``epsilon - spent``: composition is not additive, so a run that spends this much
        alone may still not fit (:meth:`check` says)."""
        return self.epsilon - self.spent

    def _compose(self, events, reserved, accountant):
        delta = self.delta - reserved
        if delta <= 0:
            raise ValueError(
                f"the runs reserve {reserved:.3g} of delta outside the accountant (e.g. for capped Poisson "
                f"batches), more than the budget's delta={self.delta}"
            )
        from dp_accounting import dp_event  # on first use: importing it costs seconds (SciPy)

        event = dp_event.ComposedDpEvent(list(events))
        accountant = resolve_accountant(event, accountant, self.neighbouring)
        acc = make_accountant(accountant, self.neighbouring)
        acc.compose(accountant_event(event, accountant, self.neighbouring))
        return float(acc.get_epsilon(delta)), accountant

    def _run_events(self, guarantee: PrivacyGuarantee) -> list:
        events = list({repr(e): e for e in guarantee.events}.values())
        if not events:
            raise ValueError(
                "this guarantee carries no dp-accounting events (e.g. a per-message guarantee): a "
                "PrivacyBudget composes whole runs"
            )
        return events

    def check(self, guarantee: PrivacyGuarantee, *, what: str = "the run") -> float:
        """The epsilon the budget would have spent with ``guarantee``'s run; a ``ValueError``
        if that exceeds :attr:`epsilon` (nothing is charged either way)."""
        if guarantee.neighbouring != NEIGHBOURING[self.neighbouring]:
            raise ValueError(
                f"PrivacyBudget {self.name!r} is under neighbouring={self.neighbouring!r} "
                f"({NEIGHBOURING[self.neighbouring]}), {what} under '{guarantee.neighbouring}'"
            )
        events = self._events + self._run_events(guarantee)
        reserved = self._reserved + guarantee.reserved_delta
        try:
            total, _ = self._compose(events, reserved, None)
        except ValueError as error:
            raise ValueError(f"PrivacyBudget {self.name!r}: {what} cannot be composed with it: {error}") from None
        if total > self.epsilon:
            raise ValueError(
                f"PrivacyBudget {self.name!r} (epsilon={self.epsilon}, delta={self.delta}): {what} "
                f"(epsilon={guarantee.epsilon:.4g} alone) would take it to epsilon={total:.4g} after "
                f"{len(self.runs)} run(s) that spent {self.spent:.4g}; it was not started. Add noise, "
                "run fewer rounds or steps, or lower the run's target_epsilon"
            )
        return total

    def charge(self, guarantee: PrivacyGuarantee) -> PrivacyGuarantee:
        """Charges ``guarantee``'s run (refused as :meth:`check` says) and returns the
        guarantee naming the budget."""
        total = self.check(guarantee)
        self._events += self._run_events(guarantee)
        self._reserved += guarantee.reserved_delta
        self._accountant = self._compose(self._events, self._reserved, None)[1]
        named = guarantee.replace(
            budget=(
                f"drew from PrivacyBudget {self.name!r} (epsilon={self.epsilon:g}, delta={self.delta:g}): run "
                f"{len(self.runs) + 1}, the runs so far spend epsilon={total:.4g} together "
                f"({self._accountant.upper()} composition)"
            )
        )
        self.runs.append(named)
        return named
