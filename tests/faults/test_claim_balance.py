"""New calls go to the least loaded worker (issue #16), from outside: a real redis-server, real
``callgate worker`` processes, the gateway's side a ``RedisBus`` in this process.

The claim was first come through the registry's consumer group: whichever worker's read was
waiting took the call, however many it had (loaded fleet runs: 7 / 2 / 0 of 9). The scene here
is a scale-up: one worker alone takes the first calls, two more start, and the next calls,
placed one at a time, must go to the new ones until the load is even. First come, the worker
that was there first took its third of them too."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest
from redis.asyncio import Redis

from bus import CallInfo, RedisBus
from tests.redis_server import RedisServer

from ._workers import owners, start_workers
from .conftest import Processes, eventually

pytestmark = [pytest.mark.redis, pytest.mark.slow]

FIRST = 4  # calls the first worker takes alone
LATER = 5  # calls placed once all three are up
WORKERS = ["w1", "w2", "w3"]


async def test_new_calls_go_to_the_least_loaded_workers(
    redis_server: RedisServer, processes: Processes, tmp_path: Path
) -> None:
    raw = Redis.from_url(redis_server.url, socket_timeout=5)
    sids = [f"CA{0x1600 + i:032x}" for i in range(FIRST + LATER)]
    try:
        async with RedisBus(redis_server.url, bus_id="gw") as gw:

            async def place(sid: str, workers: list[str]) -> str:
                await gw.open_call(CallInfo(sid, agent="dtmf"))
                await gw.publish(sid, {"type": "call_started", "agent": "dtmf"})

                async def owned() -> bool:
                    return (await owners(raw, [sid]))[sid] in workers

                await eventually(owned, 60, f"{sid} owned by one of {workers}")
                return (await owners(raw, [sid]))[sid]

            await start_workers(processes, raw, redis_server.url, tmp_path, WORKERS[:1])
            first = [await place(sid, WORKERS) for sid in sids[:FIRST]]
            assert first == ["w1"] * FIRST
            await start_workers(processes, raw, redis_server.url, tmp_path, WORKERS[1:])
            await eventually(lambda: _deferring(raw, "w1"), 30, "w1 leaving new calls to others")
            later = [await place(sid, WORKERS) for sid in sids[FIRST:]]  # one at a time
            final = await owners(raw, sids)
            for sid in sids:
                await gw.publish(sid, {"type": "call_ended", "reason": "stop"})
                await gw.close_call(sid)
    finally:
        await raw.aclose()

    per_worker = Counter(final.values())
    bound = math.ceil(len(sids) / len(WORKERS)) + 1
    assert max(per_worker.values()) <= bound, (per_worker, later)
    assert "w1" not in later, later  # it had 4 while the others had none


async def _deferring(raw: Redis, worker: str) -> bool:
    """The worker's heartbeat says it leaves new calls to less loaded workers."""
    info = await raw.get(f"cg:worker:{worker}")
    return bool(info) and bool(json.loads(info).get("deferring"))
