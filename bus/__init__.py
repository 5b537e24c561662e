"""The bus between gateways and session workers (see ``bus._base``).

``make_bus(url)`` picks the implementation from configuration: nothing or ``"embedded"`` gives
the in-process :class:`EmbeddedBus`; a ``redis://`` or ``rediss://`` URL gives :class:`RedisBus`
on one server, ``redis+cluster://host:port,host:port`` (or ``rediss+cluster://``) on a Redis Cluster.

The events the bus carries are the typed records of :mod:`bus.protocol` (``encode`` / ``decode``).
"""

import typing as _typing

from ._base import Bus, BusMessage, CallInfo, Event
from ._embedded import EmbeddedBus, EmbeddedHub
from ._errors import (
    BusClosedError,
    BusError,
    BusUnavailableError,
    CallOwnershipError,
    EventDecodeError,
    EventError,
    InvalidNameError,
    OwnershipLostError,
    UnknownEventError,
    VersionMismatchError,
)
from ._redis import RedisBus
from ._retry import CRITICAL_TYPES, is_critical
from . import protocol  # noqa: F401 (bus.protocol: the events, used as a module)

__all__ = [
    "CRITICAL_TYPES",
    "Bus",
    "BusClosedError",
    "BusError",
    "BusMessage",
    "BusUnavailableError",
    "CallInfo",
    "CallOwnershipError",
    "EmbeddedBus",
    "EmbeddedHub",
    "Event",
    "EventDecodeError",
    "EventError",
    "InvalidNameError",
    "OwnershipLostError",
    "RedisBus",
    "UnknownEventError",
    "VersionMismatchError",
    "is_critical",
    "make_bus",
]


def make_bus(url: str | None, **options: _typing.Any) -> Bus:
    """The bus a URL names.

    Args:
        url: None, "" or "embedded" for the in-process bus; ``redis://...`` or
            ``rediss://...`` for Redis Streams on one server; ``redis+cluster://h:p,h:p,...``
            (``rediss+cluster://``) on a Redis Cluster.
        **options: keyword options of the chosen class (e.g. ``prefix=`` for RedisBus).

    Raises:
        ValueError: any other URL.
    """
    if url is None or url.strip() in ("", "embedded"):
        return EmbeddedBus(**options)
    if url.startswith(("redis://", "rediss://", "redis+cluster://", "rediss+cluster://")):
        return RedisBus(url, **options)
    raise ValueError(
        f"unknown bus URL {url!r}: use 'embedded', a redis:// or rediss:// URL, "
        "or redis+cluster://host:port,host:port for a Redis Cluster"
    )
