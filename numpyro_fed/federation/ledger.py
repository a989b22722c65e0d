"""The message ledger: what crossed the wire, per client, per call and direction."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

__all__ = ["MessageLedger", "DIRECTIONS"]

#: The directions a message can take. ``to_client``: server to client (a request);
#: ``from_client``: client to server (a reply); ``to_peer``: client to client (decentralized
#: exchange, no server), counted at the sender.
DIRECTIONS = ("to_client", "from_client", "to_peer")


class MessageLedger:
    """Counts messages and bytes per client, per call name and per direction, and rounds per
    client.

    A *message* is one logical request or reply of one client in one call (under a ``vmap``
    over ``C`` chains, one call carries ``C`` messages per client). *Bytes* are the bytes of
    the arrays in the message (``nbytes`` of every leaf; serialization overhead is not
    counted). A *round* of a client is one call it took part in (a request and its reply).
    A call that reached a client but got no reply (it failed or timed out, in a ``partial``
    call) counts its request, no reply and no round, and one ``failed``.

    :class:`~numpyro_fed.federation.RayFederation` fills its ledger from the payloads it
    really sends; :class:`~numpyro_fed.federation.InProcess` from its calls as they run (a
    host callback per call), with the message sizes known from the shapes: the same counts.

    :param int num_clients: ``M``.

    >>> from numpyro_fed.federation import MessageLedger
    >>> ledger = MessageLedger(2)
    >>> ledger.add("grad", "to_client", client=[0, 1], messages=1, nbytes=8)
    >>> ledger.add("grad", "from_client", client=[0, 1], messages=1, nbytes=16, rounds=1)
    >>> ledger.summary()["bytes_from_client"].tolist()
    [16, 16]
    >>> ledger.summary()["grad/rounds"].tolist()
    [1, 1]
    """

    def __init__(self, num_clients: int):
        self.num_clients = int(num_clients)
        self._counts = defaultdict(lambda: np.zeros(self.num_clients, dtype=np.int64))
        #: Host round trips (a batch of requests sent together and waited for together);
        #: counted by engine backends only.
        self.round_trips = 0

    def add(self, name: str, direction: str, client, *, messages=1, nbytes=0, rounds=0) -> None:
        """Adds ``messages`` messages of ``nbytes`` bytes in total (each array entry per
        client in ``client``), and ``rounds`` rounds, to call ``name`` in ``direction``.

        :param client: a client index, a sequence of them, or ``None`` for all clients.
        """
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, not {direction!r}")
        idx = np.arange(self.num_clients) if client is None else np.asarray(client, dtype=np.int64)
        np.add.at(self._counts[(name, direction, "messages")], idx, np.broadcast_to(messages, idx.shape))
        np.add.at(self._counts[(name, direction, "bytes")], idx, np.broadcast_to(nbytes, idx.shape))
        if np.any(rounds):
            np.add.at(self._counts[(name, "rounds")], idx, np.broadcast_to(rounds, idx.shape))

    def add_failures(self, name: str, client, calls=1) -> None:
        """Counts ``calls`` failed calls ``name`` of ``client`` (an index or a sequence of
        them): requests sent that got no reply (their request is counted as sent, no reply
        and no round)."""
        idx = np.asarray(client, dtype=np.int64).reshape(-1)
        np.add.at(self._counts[(name, "failed")], idx, np.broadcast_to(calls, idx.shape))

    def failures(self, name: str | None = None) -> np.ndarray:
        """``(M,)`` failed calls per client of call ``name`` (all calls if ``None``)."""
        names = self.names if name is None else [name]
        out = np.zeros(self.num_clients, dtype=np.int64)
        for n in names:
            out = out + self._counts.get((n, "failed"), 0)
        return out

    def reset(self) -> None:
        """Forgets every count."""
        self._counts.clear()
        self.round_trips = 0

    @property
    def names(self) -> list[str]:
        """The call names seen so far."""
        return sorted({key[0] for key in self._counts})

    def count(self, name: str | None, direction: str, what: str) -> np.ndarray:
        """``(M,)`` counts of ``what`` (``"messages"`` or ``"bytes"``) of call ``name`` (all
        calls if ``None``) in ``direction``."""
        names = self.names if name is None else [name]
        out = np.zeros(self.num_clients, dtype=np.int64)
        for n in names:
            out = out + self._counts.get((n, direction, what), 0)
        return out

    def rounds(self, name: str | None = None) -> np.ndarray:
        """``(M,)`` rounds per client of call ``name`` (all calls if ``None``)."""
        names = self.names if name is None else [name]
        out = np.zeros(self.num_clients, dtype=np.int64)
        for n in names:
            out = out + self._counts.get((n, "rounds"), 0)
        return out

    def summary(self) -> dict[str, np.ndarray]:
        """A dict of ``(M,)`` int arrays: ``messages_<direction>``, ``bytes_<direction>`` and
        ``rounds`` over all calls, and the same prefixed with ``"<name>/"`` per call. The
        shape ArviZ's ``sample_stats`` takes (a ``client`` dim)."""
        out = {}
        for name in [None] + self.names:
            prefix = "" if name is None else f"{name}/"
            for direction in DIRECTIONS:
                for what in ("messages", "bytes"):
                    values = self.count(name, direction, what)
                    if name is None or values.any():
                        out[f"{prefix}{what}_{direction}"] = values
            out[f"{prefix}rounds"] = self.rounds(name)
            failed = self.failures(name)
            if failed.any():
                out[f"{prefix}failed"] = failed
        return out

    def since(self, baseline: dict | None) -> dict[str, np.ndarray]:
        """:meth:`summary` less ``baseline`` (an earlier :meth:`summary`): what was counted
        since, e.g. in one run on a federation that served others before it."""
        baseline = baseline or {}
        return {k: np.asarray(v) - np.asarray(baseline.get(k, 0)) for k, v in self.summary().items()}

    def total_bytes(self) -> int:
        """All bytes in every direction, summed over clients."""
        return int(sum(self.count(None, d, "bytes").sum() for d in DIRECTIONS))

    def __repr__(self) -> str:
        rows = [f"MessageLedger(num_clients={self.num_clients}, round_trips={self.round_trips})"]
        for name in self.names:
            parts = []
            for direction in DIRECTIONS:
                m = self.count(name, direction, "messages")
                if m.any():
                    b = self.count(name, direction, "bytes")
                    parts.append(f"{direction}: {int(m.sum())} msg, {int(b.sum())} B")
            rows.append(f"  {name}: rounds {self.rounds(name).tolist()}; " + "; ".join(parts))
        return "\n".join(rows)
