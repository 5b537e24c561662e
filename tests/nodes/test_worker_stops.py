"""A worker told to stop stops (issue #16's rolling-restart hang): ``SessionWorker.aclose``
returns within its grace whatever its calls are doing, and says what it abandoned.

The hang it fixes: a ``callgate worker`` given SIGTERM with ``--drain-timeout 0`` never exited.
Its calls' tasks had been cancelled once, at the moment the bus's per-step flush
(``RedisBus._step_written``) was released by the writer; Python 3.11's ``asyncio.wait_for``
returns a result that came with the cancellation and drops the cancellation, so the call went on
reading its uplink, and ``aclose`` waited for it for good (tests/faults/test_worker_stops.py has
the bus's side). Here the bus swallows one cancellation the same way, deterministically."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest

from bus import BusMessage, CallInfo, EmbeddedBus
from nodes import AgentSession, SessionWorker
from tests.faults._agents import DtmfEcho

from .conftest import guard

SID = "CA00000000000000000000000000000a16"


class SwallowsOneCancel(EmbeddedBus):
    """After its first message an uplink waits on a step (as RedisBus waits for the step's
    writes) and, cancelled there, goes on as if the step had completed: what ``wait_for`` does
    when the awaited future completes as the cancellation lands."""

    def __init__(self) -> None:
        super().__init__()
        self.stepping = asyncio.Event()
        self.swallowed = 0

    async def uplink(self, call_sid: str, worker_id: str) -> AsyncIterator[BusMessage]:
        first = True
        async for message in super().uplink(call_sid, worker_id):
            yield message
            if first:
                first = False
                self.stepping.set()
                try:
                    await asyncio.Event().wait()  # the step's write, never done here
                except asyncio.CancelledError:
                    self.swallowed += 1


async def _echo(session: AgentSession) -> None:
    session.add_node(DtmfEcho(name="echo"))
    await session.start()
    await session.wait_until_complete()


async def test_a_call_whose_cancellation_is_swallowed_still_stops() -> None:
    bus = SwallowsOneCancel()
    gateway = EmbeddedBus()
    worker = SessionWorker(bus, agent_factory=lambda call: _echo, worker_id="w-stop")
    claiming = asyncio.create_task(worker.run())
    try:
        await gateway.open_call(CallInfo(call_sid=SID))
        await gateway.publish(SID, {"type": "dtmf", "digit": "1"})
        await guard(bus.stepping.wait())
        claiming.cancel()
        await asyncio.wait({claiming})
        # Before: aclose cancelled each call once and waited; the call went on reading its
        # uplink and this never returned (the guard fails the test).
        abandoned = await guard(worker.aclose())
        assert abandoned == []
        assert bus.swallowed == 1
        assert worker.sessions == {}
    finally:
        claiming.cancel()
        await asyncio.wait({claiming})
        await bus.aclose()
        await gateway.aclose()


async def test_a_call_that_will_not_stop_is_abandoned_after_the_grace_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    released = asyncio.Event()
    in_setup = asyncio.Event()

    async def stubborn(session: AgentSession) -> None:
        session.add_node(DtmfEcho(name="echo"))
        await session.start()
        in_setup.set()
        while not released.is_set():  # an agent that ignores its cancellation
            try:
                await session.wait_until_complete()
                await released.wait()
            except asyncio.CancelledError:
                continue

    bus, gateway = EmbeddedBus(), EmbeddedBus()
    worker = SessionWorker(bus, agent_factory=lambda call: stubborn, worker_id="w-stuck")
    claiming = asyncio.create_task(worker.run())
    try:
        await gateway.open_call(CallInfo(call_sid=SID))
        await guard(in_setup.wait())
        claiming.cancel()
        await asyncio.wait({claiming})
        call_task = worker._tasks[SID]
        with caplog.at_level(logging.ERROR, logger="nodes._worker"):
            abandoned = await guard(worker.aclose(grace_s=0.2))
        assert abandoned == [SID]
        assert not call_task.done()
        [line] = [r.getMessage() for r in caplog.records if "abandoned" in r.getMessage()]
        assert SID in line and "in its clean-up" in line
        assert "_finish" in line  # what it awaits: the agent's setup task, in the clean-up
    finally:
        released.set()
        claiming.cancel()
        await guard(asyncio.wait([claiming, *worker._tasks.values()]))
        await bus.aclose()
        await gateway.aclose()
