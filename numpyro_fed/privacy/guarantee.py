"""The privacy guarantee attached to a result: the whole statement, as the DP literature
reports it (Ponomareva et al. 2023, "How to DP-fy ML"; Opacus; Flower's ``PrivacySpent``)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["NOT_COVERED", "PrivacyGuarantee"]

#: What no guarantee of the project covers, unless a statement says otherwise.
NOT_COVERED = (
    "the choice of hyper-parameters and any tuning runs (not counted: tune on public or "
    "other data); diagnostics the server computes from the clients' rows (the loss, "
    "curvature checks: not messages of the algorithm); the number of rows each client holds "
    "(public); the model and the data's shapes (public)"
)


@dataclass(frozen=True)
class PrivacyGuarantee:
    """An (epsilon, delta)-differential-privacy guarantee and everything it rests on.

    ``str(guarantee)`` is the statement in words (:meth:`statement`); ``as_attrs`` flattens it
    for ``InferenceData.attrs``.

    :ivar float epsilon: privacy loss bound.
    :ivar float delta: failure probability.
    :ivar str scope: what one guarantee protects, e.g. "each switching time a client
        sends" (per message, not composed over a run) or "the whole run".
    :ivar str neighbouring: the neighbouring relation, e.g. "one row of one client changed".
    :ivar str method: how it was computed (theorem or accountant) and the mechanism.
    :ivar str accountant: the accountant (e.g. "PLD (dp-accounting)") or the closed form.
    :ivar str tolerance: the accountant's error tolerance and its direction.
    :ivar str unit: the privacy unit (example-level: one row of one client).
    :ivar str sampling: how the rows entering each release are drawn, as implemented and as
        accounted.
    :ivar tuple noise_multipliers: per client, noise standard deviation over the clip norm.
    :ivar tuple clip_norms: the clip norms (per release or per client; empty where the
        mechanism has none).
    :ivar int steps: noised releases per client (DP-SGD steps; updates for update
        perturbation).
    :ivar int rounds: global rounds (server-client exchanges per client).
    :ivar bool client_private_randomness: each client's noise and subsampling came from
        randomness it drew itself, which the server cannot replay. ``False``: the guarantee
        does not hold against the server (it chose the keys).
    :ivar str not_covered: what the guarantee does not cover.
    :ivar str budget: the :class:`~numpyro_fed.privacy.PrivacyBudget` the run drew from and
        what that budget has spent with it (``""``: none).
    :ivar events: the ``dp-accounting`` events per client (for composition; not shown).
    :ivar float reserved_delta: the share of ``delta`` not given to the accountant (it covers
        e.g. the cap on Poisson batch sizes).
    """

    epsilon: float
    delta: float
    scope: str
    neighbouring: str
    method: str
    accountant: str = ""
    tolerance: str = ""
    unit: str = "example-level: one row of one client"
    sampling: str = ""
    noise_multipliers: tuple = ()
    clip_norms: tuple = ()
    steps: int = 0
    rounds: int = 0
    client_private_randomness: bool = False
    not_covered: str = NOT_COVERED
    budget: str = ""
    events: Any = field(default=(), repr=False, compare=False)
    reserved_delta: float = field(default=0.0, repr=False)

    def statement(self) -> str:
        """The guarantee in words, one line per part."""
        randomness = (
            "client-private: each client mixed a seed from its own operating system's entropy into the keys "
            "of its noise and batches; the server cannot replay them"
            if self.client_private_randomness
            else "NOT client-private: the noise and batches come from keys the server chose, so the guarantee "
            "does not hold against the server (it holds against the other clients and anyone who sees only "
            "the results)"
        )
        lines = [
            f"({self.epsilon:.4g}, {self.delta:.3g})-differential privacy for {self.scope}",
            f"unit: {self.unit}; neighbouring: {self.neighbouring}",
            f"mechanism: {self.method}",
        ]
        if self.accountant:
            lines.append(f"accountant: {self.accountant}" + (f" ({self.tolerance})" if self.tolerance else ""))
        if self.sampling:
            lines.append(f"sampling: {self.sampling}")
        if self.noise_multipliers:
            lines.append(f"noise multiplier(s): {_numbers(self.noise_multipliers)}")
        if self.clip_norms:
            lines.append(f"clip norm(s): {_numbers(self.clip_norms)}")
        if self.steps or self.rounds:
            lines.append(f"releases per client: {self.steps} noised step(s) over {self.rounds} round(s)")
        lines.append(f"randomness: {randomness}")
        if self.budget:
            lines.append(f"budget: {self.budget}")
        lines.append(f"not covered: {self.not_covered}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.statement()

    def replace(self, **changes) -> PrivacyGuarantee:
        """A copy with ``changes``."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return PrivacyGuarantee(**values)

    def as_attrs(self, prefix: str = "privacy_") -> dict:
        """Flat attributes for ``InferenceData.attrs`` (netCDF-safe: numbers, strings and
        lists of numbers; ``client_private_randomness`` as 0/1)."""
        out = {}
        for f in fields(self):
            if f.name in ("events", "reserved_delta"):
                continue
            value = getattr(self, f.name)
            if isinstance(value, bool):
                value = int(value)
            elif isinstance(value, tuple):
                value = [float(v) for v in value]
            out[prefix + f.name] = value
        out[prefix + "statement"] = self.statement()
        return out


def _numbers(values) -> str:
    unique = sorted({float(v) for v in values})
    if len(unique) == 1:
        return f"{unique[0]:.4g}" + (f" (each of {len(values)})" if len(values) > 1 else "")
    return ", ".join(f"{float(v):.4g}" for v in values)
