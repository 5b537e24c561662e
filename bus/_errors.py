"""Errors raised by the bus.

    BusError
    ├── BusClosedError          the bus was closed (``aclose``) while, or before, being used
    ├── BusUnavailableError     the server stayed unreachable for a read that cannot be buffered
    ├── CallOwnershipError      ``uplink()`` for a call that another live worker owns
    │   └── OwnershipLostError  this worker's lease on a call was taken over (raised by ``uplink()``)
    ├── EventError              an event is not a JSON-able dict with a non-empty str ``type`` (also ValueError)
    │   └── EventDecodeError    ``bus.protocol.decode``: not a valid event (has .field, names it)
    │       ├── UnknownEventError     well-formed, of a ``type`` this version lacks
    │       └── VersionMismatchError  of another major protocol version (has .version)
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
    "EventDecodeError",
    "EventError",
    "InvalidNameError",
    "OwnershipLostError",
    "UnknownEventError",
    "VersionMismatchError",
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


class EventDecodeError(EventError):
    """What a bus delivered is not a valid event (``bus.protocol.decode``, which raises nothing
    else): skip it, and log the message, which names the field.

    Attributes:
        field: the field at fault, ``type.name`` (``"type"``, ``"audio.payload"``...); ``""``
            when the whole input is (not JSON, not an object).
    """

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


class UnknownEventError(EventDecodeError):
    """A well-formed event of a ``type`` this protocol version does not define (a newer minor
    version's): a reader skips it."""


class VersionMismatchError(EventDecodeError):
    """An event of another major protocol version: this side cannot read it.

    Attributes:
        version: the ``v`` the event carried.
    """

    def __init__(self, message: str, *, version: str) -> None:
        super().__init__(message, field="v")
        self.version = version


class InvalidNameError(BusError, ValueError):
    """A call sid or worker id that would break the key layout (empty, braces, whitespace)."""
