"""The privacy guarantee attached to a result."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["PrivacyGuarantee"]


@dataclass(frozen=True)
class PrivacyGuarantee:
    """An (epsilon, delta)-differential-privacy guarantee and what it covers.

    :ivar float epsilon: privacy loss bound.
    :ivar float delta: failure probability.
    :ivar str scope: what one guarantee protects, e.g. "each switching time a client
        sends" (per message, not composed over a run) or "the whole run".
    :ivar str neighbouring: the neighbouring relation, e.g. "one row of one client changed".
    :ivar str method: how it was computed (theorem or accountant).
    """

    epsilon: float
    delta: float
    scope: str
    neighbouring: str
    method: str

    def as_attrs(self, prefix: str = "privacy_") -> dict:
        """Flat attributes for ``InferenceData.attrs``."""
        return {prefix + key: value for key, value in asdict(self).items()}
