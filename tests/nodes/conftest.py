"""Fixtures for the nodes tests: a local OpenAI-compatible server, buses, a worker harness.

The bus is ``bus.EmbeddedBus`` when the bus package exports it, else the in-test ``MemoryBus``
(``NODES_TEST_BUS=memory`` forces the latter). Tests use the ``Bus`` interface only.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

import bus as bus_pkg
from bus import Bus, CallInfo, Event
from nodes import AgentSession, Node, OpenAIClient, SessionWorker, SetupFn

from ..openai_server import OpenAIServer
from ._memory_bus import MemoryBus, MemoryHub

# Hang guard for waits on events that the code under test must produce; reaching it is a failure
# (a deadlock or a lost event), never a timing assertion.
GUARD_S = 10.0


def _embedded_bus_class() -> type[Bus] | None:
    if os.environ.get("NODES_TEST_BUS") == "memory":
        return None
    return getattr(bus_pkg, "EmbeddedBus", None)


BusFactory = Callable[[], Bus]


@pytest.fixture
async def make_bus() -> AsyncIterator[BusFactory]:
    """Builds buses that share one backend (like processes sharing a Redis server)."""
    embedded = _embedded_bus_class()
    hub = MemoryHub()
    made: list[Bus] = []

    def factory() -> Bus:
        b: Bus = embedded() if embedded is not None else MemoryBus(hub)
        made.append(b)
        return b

    yield factory
    for b in made:
        await b.aclose()


@pytest.fixture
async def bus(make_bus: BusFactory) -> Bus:
    b = make_bus()
    await b.start()
    return b


@pytest.fixture
async def openai_server() -> AsyncIterator[OpenAIServer]:
    async with OpenAIServer() as server:
        yield server


@pytest.fixture
async def llm(openai_server: OpenAIServer) -> AsyncIterator[OpenAIClient]:
    client = OpenAIClient(
        model="gpt-test", api_key="sk-test", base_url=openai_server.base_url, max_retries=0
    )
    yield client
    await client.aclose()


async def guard(awaitable: Any) -> Any:
    """Await with the hang guard."""
    async with asyncio.timeout(GUARD_S):
        return await awaitable


class Line:
    """The gateway's side of one call: publishes uplink events, reads the downlink."""

    def __init__(self, bus: Bus, call_sid: str) -> None:
        self.bus = bus
        self.call_sid = call_sid
        self.received: list[Event] = []
        self._down = bus.downlink(call_sid).__aiter__()

    async def publish(self, event: Event) -> str:
        return await self.bus.publish(self.call_sid, event)

    async def next(self, kind: str | None = None, **match: Any) -> Event:
        """The next downlink event of ``kind`` (and matching fields); earlier ones are kept."""
        async with asyncio.timeout(GUARD_S):
            while True:
                message = await self._down.__anext__()
                self.received.append(message.event)
                event = message.event
                if (kind is None or event.get("type") == kind) and all(
                    event.get(k) == v for k, v in match.items()
                ):
                    return event

    async def end(self, worker: SessionWorker) -> list[Event]:
        """Hang up: ``call_ended``, wait for the worker to finish the call, close it; returns the
        whole downlink (read to its end, so nothing the worker sent can be missed)."""
        await self.publish({"type": "call_ended"})
        await guard(worker.join(self.call_sid))
        await self.bus.close_call(self.call_sid)
        async with asyncio.timeout(GUARD_S):
            async for message in self._down:
                self.received.append(message.event)
        return self.received

    def of(self, kind: str) -> list[Event]:
        return [e for e in self.received if e.get("type") == kind]


async def open_line(bus: Bus, call_sid: str = "CA0001", **info: Any) -> Line:
    await bus.open_call(CallInfo(call_sid=call_sid, **info))
    return Line(bus, call_sid)


@contextlib.asynccontextmanager
async def running(
    bus: Bus, agent_factory: Callable[[CallInfo], SetupFn], **options: Any
) -> AsyncIterator[SessionWorker]:
    """``SessionWorker(bus, agent_factory=..., **options)`` running in a task for the block;
    cancelled (with the hang guard) and closed after it."""
    worker = SessionWorker(bus, agent_factory=agent_factory, **options)
    task = asyncio.create_task(worker.run())
    try:
        yield worker
    finally:
        task.cancel()
        await guard(asyncio.wait({task}))
        await worker.aclose()


def setup_with(make_node: Callable[[], Node]) -> SetupFn:
    """The setup of an agent of one node, ``make_node()`` (called once per session)."""

    async def setup(session: AgentSession) -> None:
        session.add_node(make_node())
        await session.start()
        await session.wait_until_complete()

    return setup
