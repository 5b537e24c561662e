"""The in-process bus: the default when no Redis is configured, so a laptop runs callgate alone.

It keeps the Redis bus's semantics, so code tested against one works on the other: each call has
an uplink log with a consumer-group cursor and a pending list (delivered, not acked), a downlink
log, a context and an owner. Instances share an :class:`EmbeddedHub` (what a Redis server is to
``RedisBus`` instances); by default every ``EmbeddedBus`` in one event loop shares the loop's hub,
so a gateway and a worker that each build their own bus still meet. A bus that closes while it
owns calls hands them back to the pool, as a dead Redis worker's lease would run out, and the
next claimant gets their unacked uplink messages first.

Leases, fencing tokens and gateway liveness (``RedisBus``) are not needed here: everything lives
in one process, so a worker cannot be frozen apart from the hub, and a gateway cannot die apart
from its workers. A closed bus refuses every write, which is what fencing gives a stale worker.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import weakref
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from . import protocol
from ._base import Bus, BusMessage, CallInfo, Event, SeenWindow, check_name, parse_stream_id
from ._base import _Accepted
from ._errors import BusClosedError, CallOwnershipError, OwnershipLostError

_Packed = tuple[str, protocol.Binaries]

__all__ = ["EmbeddedBus", "EmbeddedHub"]

log = logging.getLogger("callgate.bus")


class _Signal:
    """Wakes every task waiting on it (a broadcast condition without a lock)."""

    __slots__ = ("_waiters",)

    def __init__(self) -> None:
        self._waiters: set[asyncio.Future[None]] = set()

    async def wait(self) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.add(fut)
        try:
            await fut
        finally:
            self._waiters.discard(fut)

    def notify(self) -> None:
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)


class _Call:
    """One call's state in the hub. Logs hold what ``protocol.pack`` made of each event (its
    JSON text and bytes fields); None is the end marker."""

    __slots__ = (
        "info", "up", "delivered", "pending", "down", "ctx", "through",
        "owner", "owner_bus", "closed", "announced", "signal", "orphaned",
    )  # fmt: skip

    def __init__(self) -> None:
        self.info: CallInfo | None = None
        self.up: list[_Packed | None] = []
        self.delivered = 0  # the group cursor: up[:delivered] went to a consumer
        self.pending: dict[int, str] = {}  # up index -> consumer, delivered and not acked
        self.down: list[_Packed | None] = []
        self.ctx: str | None = None
        self.through: str | None = None
        self.owner: str | None = None
        self.owner_bus: EmbeddedBus | None = None
        self.closed = False
        self.announced = False
        self.signal = _Signal()
        self.orphaned = False  # its worker's bus closed with the call open: up for takeover


def _msg_id(index: int) -> str:
    return f"0-{index + 1}"


def _msg_index(message_id: str) -> int | None:
    try:
        ms, seq = parse_stream_id(message_id)
    except ValueError:
        return None
    return seq - 1 if ms == 0 and seq > 0 else None


class EmbeddedHub:
    """State shared by the ``EmbeddedBus`` instances of one process (one event loop)."""

    _by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, EmbeddedHub] = (
        weakref.WeakKeyDictionary()
    )

    def __init__(self) -> None:
        self.calls: dict[str, _Call] = {}
        self.new_calls: deque[str] = deque()  # announced, not yet claimed
        self.orphans: deque[str] = deque()  # owner went away, claimable
        self.claim_signal = _Signal()

    @classmethod
    def for_running_loop(cls) -> EmbeddedHub:
        """The hub shared by every default ``EmbeddedBus`` in the running event loop."""
        loop = asyncio.get_running_loop()
        hub = cls._by_loop.get(loop)
        if hub is None:
            hub = cls._by_loop[loop] = cls()
        return hub

    def call(self, call_sid: str) -> _Call:
        call = self.calls.get(call_sid)
        if call is None:
            call = self.calls[call_sid] = _Call()
        return call

    def _expire(self, call_sid: str, call: _Call) -> None:
        if self.calls.get(call_sid) is call:
            del self.calls[call_sid]


class _State(enum.Enum):
    NEW = "new"  # built; the hub is picked on start (it needs the running loop)
    OPEN = "open"  # serving
    CLOSED = "closed"  # aclose() ran: owned calls went back to the pool; methods refuse work


class EmbeddedBus(Bus):
    """In-process implementation of :class:`~bus.Bus`.

    Args:
        hub: the hub to share; defaults to the running loop's hub.
        bus_id: prefix of the eids this bus assigns (random by default).
        call_ttl_s: how long a closed call's logs and context stay readable.
    """

    def __init__(
        self,
        *,
        hub: EmbeddedHub | None = None,
        bus_id: str | None = None,
        call_ttl_s: float = 3600.0,
    ) -> None:
        super().__init__(bus_id=bus_id)
        self._hub = hub
        self._call_ttl_s = call_ttl_s
        self._state = _State.NEW
        self._up_seen: dict[str, SeenWindow] = {}

    @property
    def hub(self) -> EmbeddedHub:
        if self._hub is None:
            self._hub = EmbeddedHub.for_running_loop()
        return self._hub

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        if self._state is _State.CLOSED:
            raise BusClosedError("this bus is closed; build a new one")
        if self._state is _State.NEW:
            _ = self.hub
            self._state = _State.OPEN

    async def aclose(self) -> None:
        if self._state is _State.CLOSED:
            return
        was_open = self._state is _State.OPEN
        self._state = _State.CLOSED
        if not was_open:
            return
        hub = self.hub
        for call_sid, call in hub.calls.items():
            if call.owner_bus is self:
                call.owner = None
                call.owner_bus = None
                if not call.closed:
                    call.orphaned = True
                    hub.orphans.append(call_sid)
            call.signal.notify()
        hub.claim_signal.notify()

    def _check_open(self) -> EmbeddedHub:
        if self._state is _State.CLOSED:
            raise BusClosedError("the bus is closed")
        self._state = _State.OPEN
        return self.hub

    # -- gateway side ---------------------------------------------------------------------
    async def open_call(self, call: CallInfo) -> None:
        check_name(call.call_sid, "call_sid")
        hub = self._check_open()
        state = hub.call(call.call_sid)
        if state.info is None:
            state.info = call
        if state.announced or state.closed:
            return
        state.announced = True
        hub.new_calls.append(call.call_sid)
        hub.claim_signal.notify()

    async def publish(self, call_sid: str, event: Event) -> str:
        return self._append(call_sid, event, uplink=True)

    def _append(self, call_sid: str, event: Event, *, uplink: bool) -> str:
        """``publish`` (uplink) and ``send`` (downlink): stamp, append, wake the readers."""
        check_name(call_sid, "call_sid")
        hub = self._check_open()
        _, eid, payload = self._stamp(event)
        call = hub.call(call_sid)
        if call.closed:
            log.debug("bus: %s %s to closed call %s: dropped", event.get("type"),
                      "published" if uplink else "sent", call_sid)
            return eid
        (call.up if uplink else call.down).append(payload)
        call.signal.notify()
        return eid

    async def downlink(self, call_sid: str) -> AsyncIterator[BusMessage]:
        check_name(call_sid, "call_sid")
        call = self._check_open().call(call_sid)
        seen = SeenWindow()
        index = 0
        while True:
            self._check_open()
            if index < len(call.down):
                payload = call.down[index]
                index += 1
                if payload is None:
                    return
                event = protocol.unpack(*payload)
                key = (0, index)
                eid = event.get("eid")
                if seen.seen(key, eid):
                    continue
                seen.add(key, eid)
                yield BusMessage(_msg_id(index - 1), event)
            else:
                await call.signal.wait()

    async def close_call(self, call_sid: str) -> None:
        check_name(call_sid, "call_sid")
        hub = self._check_open()
        call = hub.call(call_sid)
        if call.closed:
            return
        call.closed = True
        call.up.append(None)
        call.down.append(None)
        call.signal.notify()
        asyncio.get_running_loop().call_later(self._call_ttl_s, hub._expire, call_sid, call)

    # -- worker side ----------------------------------------------------------------------
    async def claim_calls(self, worker_id: str) -> AsyncIterator[CallInfo]:
        check_name(worker_id, "worker_id")
        hub = self._check_open()
        while True:
            self._check_open()
            call_sid = self._next_claimable(hub)
            if call_sid is None:
                await hub.claim_signal.wait()
                continue
            call = hub.calls[call_sid]
            if call.orphaned:
                self.counters["orphans_claimed"] += 1
                call.orphaned = False
            call.owner = worker_id
            call.owner_bus = self
            assert call.info is not None
            self.counters["calls_claimed"] += 1
            yield call.info

    def _next_claimable(self, hub: EmbeddedHub) -> str | None:
        for queue in (hub.orphans, hub.new_calls):
            while queue:
                call_sid = queue.popleft()
                call = hub.calls.get(call_sid)
                if call is None or call.closed or call.owner is not None or call.info is None:
                    continue
                return call_sid
        return None

    async def uplink(self, call_sid: str, worker_id: str) -> AsyncIterator[BusMessage]:
        check_name(call_sid, "call_sid")
        check_name(worker_id, "worker_id")
        call = self._check_open().call(call_sid)
        if not call.closed:
            if call.owner is None:
                call.owner, call.owner_bus = worker_id, self
            elif call.owner != worker_id or call.owner_bus is not self:
                raise CallOwnershipError(call_sid, call.owner)
        seen = self._up_seen.setdefault(call_sid, SeenWindow())
        through = parse_stream_id(call.through) if call.through else None

        # Messages an earlier consumer got and never acked come first, in order.
        for index in sorted(call.pending):
            self._check_owner(call, call_sid, worker_id)
            if index not in call.pending:
                continue
            call.pending[index] = worker_id
            message = self._accept(call, call_sid, index, seen, through, redelivered=True)
            if message is _Accepted.END:
                return
            if message is not None:
                yield message
        while True:
            self._check_owner(call, call_sid, worker_id)
            if call.delivered >= len(call.up):
                await call.signal.wait()
                continue
            index = call.delivered
            call.delivered += 1
            call.pending[index] = worker_id
            message = self._accept(call, call_sid, index, seen, through, redelivered=False)
            if message is _Accepted.END:
                return
            if message is not None:
                yield message

    def _check_owner(self, call: _Call, call_sid: str, worker_id: str) -> None:
        self._check_open()
        if not call.closed and call.owner is not None and call.owner != worker_id:
            raise OwnershipLostError(call_sid, call.owner)

    def _accept(
        self,
        call: _Call,
        call_sid: str,
        index: int,
        seen: SeenWindow,
        through: tuple[int, int] | None,
        *,
        redelivered: bool,
    ) -> BusMessage | _Accepted | None:
        payload = call.up[index]
        if payload is None:  # the end marker
            call.pending.pop(index, None)
            if call.owner_bus is self:
                call.owner, call.owner_bus = None, None
            self._up_seen.pop(call_sid, None)
            return _Accepted.END
        key = (0, index + 1)
        event = protocol.unpack(*payload)
        eid = event.get("eid")
        if through is not None and key <= through:
            call.pending.pop(index, None)  # the saved context already covers it
            return None
        if seen.seen(key, eid):
            if key > seen.high:
                call.pending.pop(index, None)  # a copy of an eid handled before
            return None
        seen.add(key, eid)
        message_id = _msg_id(index)
        return BusMessage(message_id, event, redelivered)

    async def ack(self, call_sid: str, message_id: str) -> None:
        hub = self._check_open()
        call = hub.calls.get(call_sid)
        index = _msg_index(message_id)
        if call is not None and index is not None:
            call.pending.pop(index, None)

    async def send(self, call_sid: str, event: Event) -> str:
        return self._append(call_sid, event, uplink=False)

    async def save_context(
        self, call_sid: str, context: dict[str, Any], *, through: str | None = None
    ) -> None:
        check_name(call_sid, "call_sid")
        hub = self._check_open()
        if through is not None and _msg_index(through) is None:
            raise ValueError(f"through={through!r} is not an uplink message id of this bus")
        payload = self._encode_context(call_sid, context)
        call = hub.call(call_sid)
        call.ctx = payload
        if through is not None:
            call.through = through

    async def load_context(self, call_sid: str) -> dict[str, Any] | None:
        hub = self._check_open()
        call = hub.calls.get(call_sid)
        if call is None or call.ctx is None:
            return None
        result: dict[str, Any] = json.loads(call.ctx)
        return result

