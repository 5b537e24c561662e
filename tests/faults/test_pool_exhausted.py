"""redis-py's connection pool running out (its default limit is 100 connections; a gateway hit it
at 300 calls) is this process being busy, not Redis being away (issue #13): the bus retries the
command, but it must not go into an outage (log "lost Redis", report ``redis_down``, count an
outage, refuse ``record_once`` at once, hold back takeovers after "coming back"). A real
redis-server, a real ``RedisBus``; the pool is exhausted by holding every connection it has."""

from __future__ import annotations

import logging

import pytest
from redis.asyncio import Redis

from bus import CallInfo, RedisBus
from tests.redis_server import RedisServer

from ._workers import key
from .conftest import eventually

SID = "CA0000000000000000000000000013c1"


@pytest.mark.redis
async def test_an_exhausted_connection_pool_is_retried_and_is_not_an_outage(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="callgate.bus")
    raw = Redis.from_url(redis_server.url)
    try:
        async with RedisBus(redis_server.url, bus_id="gw") as gw:
            await gw.open_call(CallInfo(SID))
            await gw.flush()
            pool = gw._redis.connection_pool
            held = []
            pool.max_connections = len(pool._in_use_connections) + len(pool._available_connections)

            async def holding_all() -> bool:
                # Every connection the pool has, held here: one the bus's own tasks had in use
                # when the limit was set goes back to the pool a moment later, and a write that
                # took it would never meet the exhausted pool (a CI run, alone: timed out).
                while pool._available_connections:
                    held.append(await pool.get_connection())
                return bool(len(held) == pool.max_connections)

            await eventually(holding_all, 10, "every connection of the pool held")
            await gw.publish(SID, {"type": "dtmf", "digit": "1"})
            def tried() -> bool:  # (on the old code: an outage, and no such counter)
                return gw.stats().get("pool_exhausted", 0) > 0 or gw.stats()["outages"] > 0

            await eventually(tried, 10, "the write meeting the exhausted pool")
            stats = gw.stats()
            for conn in held:
                await pool.release(conn)
            pool.max_connections = 100
            assert await gw.flush(10), "the buffered write never landed"
            entries = await raw.xrange(key(SID, "up"))
    finally:
        await raw.aclose()

    assert stats["redis_down"] == 0 and stats["outages"] == 0, stats
    assert stats["pool_exhausted"] > 0
    assert "lost Redis" not in caplog.text
    assert caplog.text.count("connection pool is exhausted") == 1  # rate-limited
    assert [b'"digit":"1"' in fields[b"e"] for _, fields in entries][-1:] == [True]
