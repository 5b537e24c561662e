"""The bus's side of the worker shutdown hang (issue #16's rolling restart; the worker's side is
tests/nodes/test_worker_stops.py): a task cancelled as its wait for the bus ends must end.

A worker's call task waits after every uplink step until the step's writes are written
(``RedisBus._step_written``). A SIGTERM's cancellation that landed in the loop step in which the
writer released that wait was dropped by Python 3.11's ``asyncio.wait_for`` (it returns the
future's result instead), and the call went on reading its uplink: ``callgate worker
--drain-timeout 0`` never exited. In a loop of 30 in-process worker shutdowns under a steady
uplink (4 calls, key presses and playback reports) it hung in the 1st to 5th, every time."""

from __future__ import annotations

import asyncio

from bus import RedisBus
from bus import protocol as bp
from tests.redis_server import _free_port

SID = "CA00000000000000000000000000000b16"


async def test_a_flush_wait_cancelled_as_the_writer_releases_it_is_cancelled() -> None:
    # Nothing listens on the port: the write stays buffered and the flush waits for it.
    bus = RedisBus(f"redis://127.0.0.1:{_free_port()}", close_timeout_s=0.1,
                   connect_timeout_s=0.2, backoff_cap_s=0.2)  # fmt: skip
    await bus.start()
    try:
        await bus.publish(SID, bp.encode(bp.Dtmf(digit="1")))
        flushing = asyncio.create_task(bus._flush_until(30.0))
        while not bus._flush_waiters:
            await asyncio.sleep(0)  # until the flush waits
        # In one loop step: the writer releases the waiters, and the worker is cancelled.
        bus._flush_waiters[-1].set_result(None)
        flushing.cancel()
        # Before: the cancellation was dropped and the flush waited on for its 30 s.
        await asyncio.wait({flushing}, timeout=10.0)
        assert flushing.cancelled()
    finally:
        await bus.aclose()
