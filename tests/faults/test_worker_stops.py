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
import signal
from pathlib import Path

import pytest
from redis.asyncio import Redis

from bus import CallInfo, RedisBus
from bus import protocol as bp
from tests.redis_server import RedisServer, _free_port

from ._agents import DTMF_AGENTS_YAML
from .conftest import Processes, eventually

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


STUBBORN = DTMF_AGENTS_YAML.replace("tests.faults._agents:DtmfEcho", "tests.faults._agents:Stubborn")


@pytest.mark.redis
async def test_a_worker_whose_agent_ignores_cancellation_still_exits(
    redis_server: RedisServer, processes: Processes, tmp_path: Path
) -> None:
    """SIGTERM, drain timeout 0, a call stuck in an agent that swallows every cancellation: the
    worker abandons the call after its grace (logged with what it awaits) and the process exits
    (before: it waited for the call for good)."""
    config = tmp_path / "agents.yaml"
    config.write_text(STUBBORN)
    raw = Redis.from_url(redis_server.url)
    try:
        w1 = processes.start("w1", "--log-level", "INFO", "worker", "--redis", redis_server.url,
                             "--config", str(config), "--worker-id", "w1", "--drain-timeout", "0")
        await eventually(lambda: raw.exists("cg:worker:w1"), 120, "w1 up")
        async with RedisBus(redis_server.url, bus_id="gw") as gw:
            await gw.open_call(CallInfo(SID, agent="dtmf"))
            await gw.publish(SID, {"type": "call_started", "agent": "dtmf"})
            await gw.publish(SID, {"type": "dtmf", "digit": "5"})
            await eventually(lambda: _answered(raw), 60, "the answer (the node is stuck after it)")
            w1.send_signal(signal.SIGTERM)
            await eventually(lambda: w1.poll() is not None, 60, "w1 exiting")
    finally:
        await raw.aclose()
    log = processes.log("w1")
    assert w1.returncode == 1, log[-2000:]
    assert f"call {SID} abandoned" in log and "in its clean-up" in log
    assert "exiting" in log


async def _answered(raw: Redis) -> bool:
    return any(b"You pressed 5" in fields.get(b"e", b"")
               for _, fields in await raw.xrange(f"cg:{{{SID}}}:down"))
