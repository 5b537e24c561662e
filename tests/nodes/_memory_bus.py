"""A tiny in-memory ``bus.Bus`` for the nodes tests, used only while ``bus.EmbeddedBus`` is missing.

It follows the interface's contract closely enough for the worker: calls claimed once, uplink
with unacked messages first, ``save_context(through=)`` skipping covered messages for the next
owner, downlinks that end on ``close_call``, and a closed bus handing its calls back to the pool.
Several ``MemoryBus`` instances sharing one ``MemoryHub`` behave like processes sharing a server.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from bus import Bus, BusMessage, CallInfo, Event

__all__ = ["MemoryBus", "MemoryHub"]


@dataclass
class _CallState:
    info: CallInfo | None = None
    up: list[Event | None] = field(default_factory=list)
    delivered: int = 0
    pending: set[int] = field(default_factory=set)
    down: list[Event | None] = field(default_factory=list)
    ctx: dict[str, Any] | None = None
    through: int = -1
    owner: MemoryBus | None = None
    closed: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


class MemoryHub:
    def __init__(self) -> None:
        self.calls: dict[str, _CallState] = {}
        self.claimable: deque[str] = deque()
        self.claim_changed = asyncio.Event()

    def call(self, sid: str) -> _CallState:
        return self.calls.setdefault(sid, _CallState())

    def notify_claim(self) -> None:
        self.claim_changed.set()
        self.claim_changed = asyncio.Event()


class MemoryBus(Bus):
    def __init__(self, hub: MemoryHub | None = None) -> None:
        super().__init__()
        self.hub = hub or MemoryHub()
        self._ids = itertools.count(1)
        self._prefix = uuid.uuid4().hex[:6]
        self._last: dict[str, int] = {}
        self._closed = False

    def _stamp_event(self, event: Event) -> Event:
        stamped = copy.deepcopy(dict(event))
        stamped.setdefault("eid", f"{self._prefix}-{next(self._ids)}")
        return stamped

    async def aclose(self) -> None:
        self._closed = True
        for sid, call in self.hub.calls.items():
            if call.owner is self:
                call.owner = None
                if not call.closed:
                    self.hub.claimable.append(sid)
            call.notify()
        self.hub.notify_claim()

    async def open_call(self, call: CallInfo) -> None:
        state = self.hub.call(call.call_sid)
        state.info = call
        self.hub.claimable.append(call.call_sid)
        self.hub.notify_claim()

    def _append(self, call_sid: str, event: Event, *, uplink: bool) -> str:
        """Stamp ``event`` and add it to the call's uplink or downlink (unless the call is
        closed); its eid."""
        stamped = self._stamp_event(event)
        state = self.hub.call(call_sid)
        if not state.closed:
            (state.up if uplink else state.down).append(stamped)
            state.notify()
        return str(stamped["eid"])

    async def publish(self, call_sid: str, event: Event) -> str:
        return self._append(call_sid, event, uplink=True)

    async def downlink(self, call_sid: str) -> AsyncIterator[BusMessage]:
        state = self.hub.call(call_sid)
        index = 0
        while True:
            if index < len(state.down):
                event = state.down[index]
                index += 1
                if event is None:
                    return
                yield BusMessage(f"d-{index}", copy.deepcopy(event))
            else:
                await state.changed.wait()

    async def close_call(self, call_sid: str) -> None:
        state = self.hub.call(call_sid)
        if state.closed:
            return
        state.closed = True
        state.up.append(None)
        state.down.append(None)
        state.notify()

    async def claim_calls(self, worker_id: str) -> AsyncIterator[CallInfo]:
        while not self._closed:
            while self.hub.claimable:
                sid = self.hub.claimable.popleft()
                state = self.hub.calls[sid]
                if state.closed or state.owner is not None or state.info is None:
                    continue
                state.owner = self
                yield state.info
            await self.hub.claim_changed.wait()

    async def uplink(self, call_sid: str, worker_id: str) -> AsyncIterator[BusMessage]:
        state = self.hub.call(call_sid)
        if state.owner is None:
            state.owner = self
        for index in sorted(state.pending):
            if index <= state.through:
                state.pending.discard(index)
                continue
            event = state.up[index]
            if event is None:
                return
            self._last[call_sid] = index
            yield BusMessage(f"0-{index + 1}", copy.deepcopy(event), redelivered=True)
        while not self._closed:
            if state.delivered >= len(state.up):
                await state.changed.wait()
                continue
            index = state.delivered
            state.delivered += 1
            event = state.up[index]
            if event is None:
                return
            state.pending.add(index)
            self._last[call_sid] = index
            yield BusMessage(f"0-{index + 1}", copy.deepcopy(event))

    async def ack(self, call_sid: str, message_id: str) -> None:
        self.hub.call(call_sid).pending.discard(int(message_id.split("-")[1]) - 1)

    async def send(self, call_sid: str, event: Event) -> str:
        return self._append(call_sid, event, uplink=False)

    async def save_context(
        self, call_sid: str, context: dict[str, Any], *, through: str | None = None
    ) -> None:
        state = self.hub.call(call_sid)
        state.ctx = copy.deepcopy(context)
        if through is not None:
            state.through = int(through.split("-")[1]) - 1
        elif call_sid in self._last:
            state.through = self._last[call_sid]

    async def load_context(self, call_sid: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.hub.call(call_sid).ctx)
