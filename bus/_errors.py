"""Errors raised by the bus.

    BusError
    ├── BusClosedError          the bus was closed (``aclose``) while, or before, being used
    ├── BusUnavailableError     the server stayed unreachable for a read that cannot be buffered
    ├── CallOwnershipError      ``uplink()`` for a call that another live worker owns
    │   └── OwnershipLostError  this worker's lease on a call was taken over (raised by ``uplink()``)
    ├── EventError              an event is not a JSON-able dict with a non-empty str ``type`` (also ValueError)
    └── InvalidNameError        a call sid or worker id the key layout cannot hold (also ValueError)

Connection problems on the write path (``publish``, ``send``, ``ack``, ``save_context``,
``open_call``, ``close_call``) are never raised: those writes are buffered and retried.
"""

from __future__ import annotations

__all__ = [
    "BusClosedError",
    "BusError",
    "BusUnavailableError",
    "CallOwnershipError",
    "EventError",
    "InvalidNameError",
    "OwnershipLostError",
]


class BusError(Exception):
    """Base class of every error the bus raises on purpose."""


class BusClosedError(BusError):
    """The bus was closed; its iterators end with this and its methods refuse work."""


class BusUnavailableError(BusError):
    """The bus server could not be reached within the retry budget of a read."""


class CallOwnershipError(BusError):
    """The call is owned by another live worker."""

    def __init__(self, call_sid: str, owner: str, message: str | None = None) -> None:
        super().__init__(message or f"call {call_sid} is owned by worker {owner!r}")
        self.call_sid = call_sid
        self.owner = owner


class OwnershipLostError(CallOwnershipError):
    """Another worker took the call over (this worker missed its lease); stop handling it."""


class EventError(BusError, ValueError):
    """The event cannot travel on the bus."""


class InvalidNameError(BusError, ValueError):
    """A call sid or worker id that would break the key layout (empty, braces, whitespace)."""
