"""The bus between gateways and session workers: the one seam where gateway/ and nodes/ meet.

A call has two ordered streams of events: **uplink** (gateway -> worker: what happened on the
line) and **downlink** (worker -> gateway: what the bot says and does). What they carry is
``bus.protocol``'s records, encoded to JSON-able objects with a ``type``; the bus itself reads
only ``type`` (``is_critical``, logs) and ``eid``.

New calls are announced on a pool-wide stream that workers consume as a group, so each call is
owned by exactly one worker at a time. Delivery is at least once: every event carries an ``eid``
unique within its call, and consumers drop ids they have already handled.

The bus adds ``eid`` when absent (``<bus_id>-<seq>``). A publisher that may re-send an event
after a crash (a worker that took a call over re-speaking an utterance) can set its own
deterministic ``eid`` (``protocol.encode(event, eid=...)``) so the other side drops the copy.
Consumers receive a JSON round-trip of what was published (tuples become lists), but for its
top-level ``bytes`` values (``Audio.payload``), which travel as they are (``protocol.pack``).

Exactly-once handling across a worker crash: an ``uplink()`` never yields the same message (or
``eid``) twice within one bus instance. A worker that takes a call over gets the unacked messages
again, minus those the saved context already covers: ``save_context`` records ``through``, the
id of the last uplink message the context reflects, and the next owner's ``uplink()`` acks and
skips every message up to it. So a worker that handles a message, then saves its context, then
acks it, handles each uplink event exactly once into its context, crash or not.

A worker that stalls past its lease (frozen, not dead) and resumes after another worker took
the call over is fenced: the bus refuses everything it does to the call from then on (claims,
acks, downlink writes, context saves), ``uplink()`` raises ``OwnershipLostError``, and
``holds()`` says false, so the call is handled by one worker only.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import AsyncIterator
import itertools
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from . import protocol
from ._errors import EventError, InvalidNameError

__all__ = ["Bus", "BusMessage", "CallInfo", "Event"]

Event = dict[str, Any]


@dataclass(frozen=True, slots=True)
class CallInfo:
    """A call as announced to the worker pool."""

    call_sid: str
    stream_sid: str = ""
    agent: str = "default"
    from_number: str = ""
    to_number: str = ""
    params: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "call_sid": self.call_sid,
            "stream_sid": self.stream_sid,
            "agent": self.agent,
            "from_number": self.from_number,
            "to_number": self.to_number,
            "params": dict(self.params),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CallInfo:
        return cls(
            call_sid=str(d["call_sid"]),
            stream_sid=str(d.get("stream_sid", "")),
            agent=str(d.get("agent", "default")),
            from_number=str(d.get("from_number", "")),
            to_number=str(d.get("to_number", "")),
            params={str(k): str(v) for k, v in dict(d.get("params") or {}).items()},
        )


@dataclass(frozen=True, slots=True)
class BusMessage:
    """One delivered event: ``id`` is the transport's id (what ``ack`` takes).

    ``redelivered`` is true for uplink messages that an earlier owner of the call received but
    never acked (the worker is taking the call over).
    """

    id: str
    event: Event
    redelivered: bool = False


COUNTERS = ("outages", "reconnects", "calls_claimed", "orphans_claimed", "calls_lost",
            "calls_ended_gateway_lost")
"""Counters every bus keeps: ``outages`` (the server went away), ``reconnects`` (it came back),
``calls_claimed`` (calls handed to this process's workers by ``claim_calls``),
``orphans_claimed`` (of those, calls taken over from a worker that stopped renewing its lease),
``calls_lost`` (calls this process's workers lost to another worker: fenced out) and
``calls_ended_gateway_lost`` (calls its workers ended because their gateway died)."""


class Bus(abc.ABC):
    """Interface shared by the embedded (in-process) bus and the Redis Streams bus.

    One instance may serve both sides (a laptop ``callgate serve``) or one side; several
    instances over one backend behave like separate processes. Methods start the bus on first
    use; after ``aclose()`` they raise ``BusClosedError``, and running iterators end with it.

    Writes (``open_call``, ``publish``, ``close_call``, ``ack``, ``send``, ``save_context``)
    return without waiting for the server and never raise for an outage: they are applied in
    the order they were made, later if the server is away (see ``flush``). Bad input raises
    ``EventError`` (not a dict with a str ``type`` of JSON-able values and top-level ``bytes``)
    or ``InvalidNameError``.
    """

    def __init__(self, *, bus_id: str | None = None) -> None:
        self.bus_id: str = bus_id or uuid.uuid4().hex[:12]
        """This instance's name: the prefix of the eids it assigns."""
        check_name(self.bus_id, "bus_id")
        self._eid_seq = itertools.count(1)
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        """Totals since this bus was made (see ``COUNTERS``), exported as metrics."""

    def stats(self) -> dict[str, float]:
        """What ops watch: the ``counters`` plus gauges of the implementation's own."""
        return dict(self.counters)

    async def __aenter__(self) -> Bus:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Connect; idempotent."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release connections and stop background tasks."""

    # -- gateway side ---------------------------------------------------------------------
    @abc.abstractmethod
    async def open_call(self, call: CallInfo) -> None:
        """Announce a new call to the worker pool."""

    @abc.abstractmethod
    async def publish(self, call_sid: str, event: Event) -> str:
        """Append ``event`` to the call's uplink; returns its ``eid``. Never blocks the caller's
        audio path for long: an implementation that loses its server buffers (bounded) and
        flushes in order once it is back. After this bus closed the call, the event is
        dropped (logged at debug)."""

    @abc.abstractmethod
    def downlink(self, call_sid: str) -> AsyncIterator[BusMessage]:
        """The call's downlink, in order, from the start of the call; ends after ``close_call``.

        Each iterator reads the whole downlink itself (several may run) and drops events whose
        ``eid`` it already yielded (a re-send by a worker that took the call over)."""

    @abc.abstractmethod
    async def close_call(self, call_sid: str) -> None:
        """The call is over: stop its iterators and let its keys expire.

        Either side may call it. Both iterators end after yielding what was written before it;
        the call can no longer be claimed."""

    # -- worker side ----------------------------------------------------------------------
    @abc.abstractmethod
    def claim_calls(self, worker_id: str) -> AsyncIterator[CallInfo]:
        """New calls for this worker, and calls whose worker died (claimed over).

        Runs until the bus closes. Each call yielded is owned by ``worker_id`` on this bus
        from then on; call ``load_context`` for it: a call claimed over has the state its last
        worker saved. Calls this bus still owns when it closes go back to the pool at once.
        ``worker_id`` must be unique to this bus instance (two buses with one id share calls)."""

    @abc.abstractmethod
    def uplink(self, call_sid: str, worker_id: str) -> AsyncIterator[BusMessage]:
        """The call's uplink for the owning worker, unacked messages first; ends when the
        call ends.

        Takes the call if nobody owns it (a call taken this way, never claimed, is not
        registered for takeover). Raises ``CallOwnershipError`` when another live worker owns
        it, and ``OwnershipLostError`` mid-iteration when another worker took it over because
        this one stopped renewing its lease (a frozen process): stop handling the call then.
        Within one bus a message is yielded at most once, even across reopened iterators;
        messages the saved context covers (``save_context(through=...)``) are skipped."""

    @abc.abstractmethod
    async def ack(self, call_sid: str, message_id: str) -> None:
        """The worker has handled an uplink message (after ``save_context``, if it saves)."""

    @abc.abstractmethod
    async def send(self, call_sid: str, event: Event) -> str:
        """Append ``event`` to the call's downlink; returns its ``eid``. Buffered like
        ``publish``."""

    @abc.abstractmethod
    async def save_context(
        self, call_sid: str, context: dict[str, Any], *, through: str | None = None
    ) -> None:
        """Keep the conversation state so another worker can resume the call.

        Args:
            call_sid: the call.
            context: JSON-able state; replaces what was saved before.
            through: the id (``BusMessage.id``) of the last uplink message this context
                reflects, every earlier one included; the next owner's ``uplink()`` skips
                (and acks) messages up to it. None leaves the mark saved before unchanged.
                In the usual loop (handle a message, save with ``through=message.id``, then
                ack it) a takeover never handles a message twice into the context.
        """

    @abc.abstractmethod
    async def load_context(self, call_sid: str) -> dict[str, Any] | None:
        """The state saved by ``save_context``, or None."""

    async def holds(self, call_sid: str) -> bool:
        """Whether this bus's worker still holds the call, checked with the server now: False
        once another worker took it over (fenced out). True for calls it never owned.

        The bus refuses a stale worker's writes itself; this is for effects outside the bus
        (Twilio's REST API, before ending or transferring a call) that no fence covers."""
        return True

    async def record_once(self, call_sid: str, name: str, ttl_s: float) -> bool:
        """Record ``name`` under the call for ``ttl_s`` seconds unless it is recorded already;
        True when this call recorded it. Every bus on the same server sees the record (a
        gateway's spent stream tokens: one spent behind one gateway is spent behind all).

        Buses without a server return True: nothing is shared beyond the process, whose own
        record is the caller's. Raises ``BusUnavailableError`` when the server cannot answer.
        """
        return True

    # -- both sides -----------------------------------------------------------------------
    async def flush(self, timeout: float | None = None) -> bool:
        """Wait until every write made so far through this bus is stored on its server.

        Returns False when ``timeout`` passed first (the writes stay buffered). Buses without a
        server return True at once.
        """
        return True

    # -- helpers for implementations ------------------------------------------------------
    def _stamp(self, event: Event) -> tuple[Event, str, tuple[str, protocol.Binaries]]:
        """Validate ``event``; returns (a copy with its ``eid``, the eid, what the bus stores:
        ``protocol.pack``'s JSON text and bytes fields)."""
        if not isinstance(event, dict):
            raise EventError(f"an event is a dict, not {type(event).__name__}")
        kind = event.get("type")
        if not isinstance(kind, str) or not kind:
            raise EventError(f"an event needs a non-empty str 'type': {event!r:.200}")
        stamped = dict(event)
        eid = stamped.get("eid")
        if eid is None:
            eid = f"{self.bus_id}-{next(self._eid_seq)}"
            stamped["eid"] = eid
        elif not isinstance(eid, str) or not eid:
            raise EventError(f"'eid' must be a non-empty str: {eid!r}")
        try:
            payload = protocol.pack(stamped)
        except (TypeError, ValueError) as exc:
            raise EventError(f"event {kind!r} is not JSON-able: {exc}") from exc
        return stamped, eid, payload

    @staticmethod
    def _encode_context(call_sid: str, context: dict[str, Any]) -> str:
        """A call's context as the compact JSON every bus stores (``save_context``)."""
        try:
            return json.dumps(context, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise EventError(f"context of {call_sid} is not JSON-able: {exc}") from exc


_BAD_NAME = re.compile(r"[{}\s]")


def check_name(name: str, what: str) -> str:
    """Refuse names that would break the key layout (hash tags use braces)."""
    if not isinstance(name, str) or not name or _BAD_NAME.search(name) or len(name) > 200:
        raise InvalidNameError(f"invalid {what}: {name!r} (non-empty, no braces or whitespace)")
    return name


def parse_stream_id(message_id: str) -> tuple[int, int]:
    """``"<ms>-<seq>"`` -> (ms, seq), for ordering message ids."""
    ms, _, seq = message_id.partition("-")
    return int(ms), int(seq or 0)


class _Accepted(enum.Enum):
    """What a bus's ``_accept`` of an uplink entry returns besides a message or None (an enum,
    so the type checker narrows on it)."""

    END = "end"  # the call's end marker


class SeenWindow:
    """What one consumer has already yielded: the highest message id, and recent eids.

    Message ids only grow within a stream, so an id at or below the high-water mark is a
    redelivery. Eids catch the other duplicates (a publisher's retried write lands under a new
    id); the last ``size`` eids are remembered, far more than any redelivery can reach back.
    """

    __slots__ = ("high", "_eids", "_size")

    def __init__(self, size: int = 65536) -> None:
        self.high: tuple[int, int] = (-1, -1)
        self._eids: dict[str, None] = {}
        self._size = size

    def seen(self, id_key: tuple[int, int], eid: str | None) -> bool:
        return id_key <= self.high or (eid is not None and eid in self._eids)

    def add(self, id_key: tuple[int, int], eid: str | None) -> None:
        if id_key > self.high:
            self.high = id_key
        if eid is not None:
            self._eids[eid] = None
            if len(self._eids) > self._size:
                del self._eids[next(iter(self._eids))]
