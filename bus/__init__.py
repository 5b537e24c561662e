"""The bus between gateways and session workers (see ``bus._base``).

``make_bus(url)`` picks the implementation from configuration: nothing or ``"embedded"`` gives
the in-process :class:`EmbeddedBus`; a ``redis://`` or ``rediss://`` URL gives :class:`RedisBus`.
"""

import typing as _typing

from ._base import Bus, BusMessage, CallInfo, Event
from ._embedded import EmbeddedBus, EmbeddedHub
from ._errors import (
    BusClosedError,
    BusError,
    BusUnavailableError,
    CallOwnershipError,
    EventError,
    InvalidNameError,
    OwnershipLostError,
)
from ._redis import RedisBus
from ._retry import CRITICAL_TYPES, is_critical

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
    "EventError",
    "InvalidNameError",
    "OwnershipLostError",
    "RedisBus",
    "is_critical",
    "make_bus",
]


def make_bus(url: str | None, **options: _typing.Any) -> Bus:
    """The bus a URL names.

    Args:
        url: None, "" or "embedded" for the in-process bus; ``redis://...`` or
            ``rediss://...`` for Redis Streams.
        **options: keyword options of the chosen class (e.g. ``prefix=`` for RedisBus).

    Raises:
        ValueError: any other URL.
    """
    if url is None or url.strip() in ("", "embedded"):
        return EmbeddedBus(**options)
    if url.startswith(("redis://", "rediss://")):
        return RedisBus(url, **options)
    raise ValueError(f"unknown bus URL {url!r}: use 'embedded' or a redis:// or rediss:// URL")
