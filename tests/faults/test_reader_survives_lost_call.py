"""A worker's uplink reader outlives a call that leaves it while a claim is in flight (found by
``bench.chaos``: a worker resumed from SIGSTOP learnt it had lost 12 calls at once; one call's
session stopped while the reader's claim for it was on the wire, the claim was refused, and the
reader task died of a KeyError, taking the uplinks of the worker's other calls with it).

Real redis-server; the claim is held on the wire with ``CLIENT PAUSE WRITE`` (the reader's XREAD
answered, its claim script paused), the call's session stops meanwhile, and the other call on the
same reader must still get its events."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from redis.asyncio import Redis

from bus import BusMessage, CallInfo, RedisBus
from tests.bus.conftest import FAST_REDIS
from tests.redis_server import RedisServer

from .conftest import eventually

pytestmark = pytest.mark.redis


async def _claim_paused(raw: Redis) -> bool:
    clients = await raw.client_list()
    return any(c.get("cmd") == "evalsha" and "b" in c.get("flags", "") for c in clients)


async def test_a_call_lost_while_its_claim_is_in_flight_leaves_the_reader_running(
    redis_server: RedisServer,
) -> None:
    opts: dict[str, Any] = {**FAST_REDIS, "heartbeat_interval_s": 30.0, "worker_ttl_s": 60.0}
    gw = RedisBus(redis_server.url, prefix="cgr", bus_id="gw", **opts)
    w1 = RedisBus(redis_server.url, prefix="cgr", bus_id="w1", **opts)  # slow beat: no renewals
    raw = Redis.from_url(redis_server.url, decode_responses=True)
    got: dict[str, list[BusMessage]] = {"CA1": [], "CA2": []}

    async def session(sid: str) -> None:
        async for msg in w1.uplink(sid, "w1"):
            got[sid].append(msg)

    async with gw, w1:
        try:
            for sid in got:
                await gw.open_call(CallInfo(sid))
            tasks = {sid: asyncio.create_task(session(sid)) for sid in got}
            for sid in got:
                await gw.publish(sid, {"type": "dtmf", "digit": "1"})
            await eventually(lambda: _all(got, 1), 10, "both calls' first event")
            # Another worker takes CA1 over; an event for it arrives; the pause lets the reader's
            # XREAD answer go out (Redis serves it right after the XADD) and holds its claim.
            pipe = raw.pipeline(transaction=False)
            pipe.set("cgr:{CA1}:owner", "w2", px=60_000)
            pipe.incr("cgr:{CA1}:fence")
            pipe.xadd("cgr:{CA1}:up", {"e": json.dumps({"type": "dtmf", "digit": "2", "eid": "x"})})
            pipe.execute_command("CLIENT", "PAUSE", 10_000, "WRITE")
            await pipe.execute()
            try:
                await eventually(lambda: _claim_paused(raw), 10, "the claim of CA1 held on the wire")
                tasks["CA1"].cancel()  # CA1's session stops (as on a lost lease) mid-claim
                await asyncio.gather(tasks["CA1"], return_exceptions=True)
            finally:
                await raw.execute_command("CLIENT", "UNPAUSE")
            await gw.publish("CA2", {"type": "dtmf", "digit": "3"})
            await eventually(lambda: len(got["CA2"]) == 2, 10, "CA2's event after the refused claim")
            assert [m.event["digit"] for m in got["CA2"]] == ["1", "3"]
            assert [m.event["digit"] for m in got["CA1"]] == ["1"]  # nothing of w2's call
        finally:
            for task in tasks.values():
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
            await raw.aclose()


async def _all(got: dict[str, list[BusMessage]], n: int) -> bool:
    return all(len(v) == n for v in got.values())

