"""A worker that stalls past its lease and comes back (issue 13, item 1), from outside: a real
redis-server, two real `callgate worker` processes, SIGSTOP and SIGCONT.

The owner is frozen while a key press arrives; the other worker takes the call over and answers
it; the frozen one is resumed while the caller keeps pressing keys. Each key press must be
answered exactly once ("You pressed N" once on the downlink), nothing may stay pending under the
stale worker, and the stale worker must say that it lost the call."""

from __future__ import annotations

import json
import os
import signal
import textwrap
from collections import Counter
from pathlib import Path

import pytest
from redis.asyncio import Redis

from bus import CallInfo, RedisBus
from tests.redis_server import RedisServer

from .conftest import Processes, eventually

SID = "CA00000000000000000000000000000013"
CONFIG = textwrap.dedent(
    """
    default_agent: dtmf
    agents:
      dtmf:
        nodes:
          - {kind: python, name: echo, ref: "tests.faults._agents:DtmfEcho"}
    """
)


async def _said(raw: Redis) -> list[str]:
    """Every utterance the workers started on the call's downlink, in order, as the gateway
    plays them: one copy per eid (a key press whose answer was written but not yet acked when
    its worker froze is answered again by the next owner under the same eids)."""
    out = []
    eids = set()
    for _, fields in await raw.xrange(f"cg:{{{SID}}}:down"):
        if b"e" in fields:
            event = json.loads(fields[b"e"])
            if event["type"] == "utterance_start" and event["eid"] not in eids:
                eids.add(event["eid"])
                out.append(event.get("text", ""))
    return out


async def _pending_of(raw: Redis, consumer: str) -> int:
    return len(await raw.xpending_range(f"cg:{{{SID}}}:up", "workers", "-", "+", 100, consumername=consumer))


@pytest.mark.redis
async def test_a_frozen_worker_that_comes_back_does_not_split_the_call(
    redis_server: RedisServer, processes: Processes, tmp_path: Path
) -> None:
    config = tmp_path / "agents.yaml"
    config.write_text(CONFIG)
    worker = ("--log-level", "INFO", "worker", "--redis", redis_server.url, "--config", str(config))
    raw = Redis.from_url(redis_server.url)
    gw = RedisBus(redis_server.url, bus_id="gw")  # production timings: a 2 s lease
    try:
        async with gw:
            w1 = processes.start("w1", *worker, "--worker-id", "w1")
            await eventually(lambda: raw.exists("cg:worker:w1"), 60, "w1 up")
            await gw.open_call(CallInfo(SID, agent="dtmf"))
            await gw.publish(SID, {"type": "call_started", "agent": "dtmf", "t_ms": 0})
            await eventually(lambda: _owner_is(raw, b"w1"), 20, "w1 owning the call")
            processes.start("w2", *worker, "--worker-id", "w2")
            await eventually(lambda: raw.exists("cg:worker:w2"), 60, "w2 up")

            async def answered(*digits: str) -> bool:
                return await _said(raw) == [f"You pressed {d}" for d in digits]

            await gw.publish(SID, {"type": "dtmf", "digit": "1", "t_ms": 1000})
            await eventually(lambda: answered("1"), 20, "w1 answering 1")

            os.kill(w1.pid, signal.SIGSTOP)  # a long GC pause, a VM migration, a stuck loop
            try:
                await gw.publish(SID, {"type": "dtmf", "digit": "2", "t_ms": 2000})  # while frozen
                await eventually(lambda: _owner_is(raw, b"w2"), 20, "w2 taking the call over")
                await eventually(lambda: answered("1", "2"), 20, "w2 answering 2")
            finally:
                os.kill(w1.pid, signal.SIGCONT)
            await gw.publish(SID, {"type": "dtmf", "digit": "3", "t_ms": 3000})  # as w1 wakes
            await eventually(lambda: answered("1", "2", "3"), 20, "3 answered")
            await eventually(lambda: "session stopped here" in processes.log("w1"), 20,
                             "w1 noticing the lost lease")  # fmt: skip
            await gw.publish(SID, {"type": "dtmf", "digit": "4", "t_ms": 4000})
            await eventually(lambda: answered("1", "2", "3", "4"), 20, "4 answered")
            # Everything handled is acked by its one handler; nothing waits under the stale one.
            await eventually(lambda: _all_acked(raw), 20, "every uplink message acked")
            assert await _pending_of(raw, "w1") == 0
            await gw.publish(SID, {"type": "call_ended", "reason": "stop", "t_ms": 5000})
            await gw.close_call(SID)
            assert await gw.flush(5)
            # call_ended handled and acked, and the end marker behind it acked once the owner
            # sees the call closed (it stops reading at call_ended)
            await eventually(lambda: _all_acked(raw), 20, "every message of the ended call acked")

        said = Counter(await _said(raw))
        assert said == Counter(f"You pressed {d}" for d in "1234"), said  # each exactly once
        assert w1.poll() is None, "the stale worker went on running"
        w1_log = processes.log("w1")
        assert "lost call" in w1_log and SID in w1_log
        assert f"call {SID} failed" not in w1_log  # stopped as designed, not crashed
    finally:
        await raw.aclose()


async def _owner_is(raw: Redis, worker: bytes) -> bool:
    return await raw.get(f"cg:{{{SID}}}:owner") == worker


async def _all_acked(raw: Redis) -> bool:
    summary = await raw.xpending(f"cg:{{{SID}}}:up", "workers")
    return int(summary["pending"]) == 0
