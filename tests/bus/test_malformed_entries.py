"""A stream entry no bus wrote (a foreign producer, a hand-made XADD: no ``e`` field, not JSON, not
an object) is skipped with a log line, and on the uplink acked, instead of raising out of the
iterator: raised there, it ended the call's uplink on every owner in turn (the entry stayed
pending and came back to the next), and on the downlink it ended the gateway's pump silently."""

from __future__ import annotations

import asyncio
import logging

import pytest
from redis.asyncio import Redis

from bus import CallInfo
from tests.redis_server import RedisServer

from .conftest import eventually
from .test_fencing import _bus

pytestmark = pytest.mark.redis

GARBAGE = [{"x": "1"}, {"e": "not json"}, {"e": "[1]"}, {"e": b"\xff\xfe"}]


async def test_malformed_entries_are_skipped_and_acked_and_the_call_goes_on(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    gw, wk = _bus(redis_server, "gw"), _bus(redis_server, "wk")
    raw = Redis.from_url(redis_server.url)
    up: list[str] = []
    down: list[str] = []

    async def worker() -> None:
        async for msg in wk.uplink("CA1", "wk"):
            up.append(msg.event["digit"])
            await wk.ack("CA1", msg.id)

    async def gateway() -> None:
        async for msg in gw.downlink("CA1"):
            down.append(msg.event["text"])

    async with gw, wk:
        tasks = []
        try:
            await gw.open_call(CallInfo("CA1"))
            tasks = [asyncio.create_task(worker()), asyncio.create_task(gateway())]
            with caplog.at_level(logging.WARNING, logger="callgate.bus"):
                for fields in GARBAGE:
                    await raw.xadd("cgf:{CA1}:up", fields)  # type: ignore[arg-type]
                    await raw.xadd("cgf:{CA1}:down", fields)  # type: ignore[arg-type]
                await gw.publish("CA1", {"type": "dtmf", "digit": "7"})
                await gw.send("CA1", {"type": "hangup", "text": "after the garbage"})
                await eventually(lambda: up == ["7"] and down == ["after the garbage"], 10,
                                 "the good events after the malformed ones")
                await eventually(lambda: _nothing_pending(raw), 10, "every uplink entry acked")
            assert all(not t.done() for t in tasks)  # neither iterator ended
            assert any("malformed stream entry" in r.getMessage() for r in caplog.records)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await raw.aclose()


async def _nothing_pending(raw: Redis) -> bool:
    summary = await raw.xpending("cgf:{CA1}:up", "workers")
    return summary["pending"] == 0
