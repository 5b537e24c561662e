"""RedisBus fencing and gateway liveness, each against its own redis-server: a worker whose
lease was taken over while it stalled has every write refused by Redis and learns it lost the
call; a gateway that stops renewing its liveness key has its calls ended by their worker."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from redis.asyncio import Redis

from bus import BusMessage, CallInfo, OwnershipLostError, RedisBus
from bus import protocol as bp
from bus._redis import _cancel
from tests.redis_server import RedisServer

from .conftest import FAST_REDIS, eventually

pytestmark = pytest.mark.redis


def _bus(server: RedisServer, name: str, **options: Any) -> RedisBus:
    return RedisBus(server.url, prefix="cgf", bus_id=name, **{**FAST_REDIS, **options})


async def _downlink(raw: Redis, sid: str) -> list[dict[str, Any]]:
    return [json.loads(f[b"e"]) for _, f in await raw.xrange(f"cgf:{{{sid}}}:down") if b"e" in f]


async def test_a_stalled_worker_s_writes_are_refused_after_a_takeover(redis_server: RedisServer) -> None:
    gw, w1, w2 = _bus(redis_server, "gw"), _bus(redis_server, "w1"), _bus(redis_server, "w2")
    raw = Redis.from_url(redis_server.url)
    got1: list[BusMessage] = []
    got2: list[BusMessage] = []
    lost = asyncio.Event()

    async def stale() -> None:  # takes the call with uplink() alone: no claim loop to notice
        try:
            async for msg in w1.uplink("CA1", "w1"):
                got1.append(msg)
        except OwnershipLostError:
            lost.set()

    async def standby() -> None:
        async for call in w2.claim_calls("w2"):
            async for msg in w2.uplink(call.call_sid, "w2"):
                got2.append(msg)
                await w2.send(call.call_sid, {"type": "audio", "of": msg.event["n"]})
                await w2.ack(call.call_sid, msg.id)

    async with gw, w1, w2:
        try:
            await gw.open_call(CallInfo("CA1"))
            t1 = asyncio.create_task(stale())
            await eventually(lambda: _owner(raw, b"w1"), 10, "w1 owning the call")
            t2 = asyncio.create_task(standby())
            await gw.publish("CA1", {"type": "dtmf", "n": 1})
            await eventually(lambda: len(got1) == 1, 10, "w1 given the first event")
            token1 = await raw.get("cgf:{CA1}:fence")
            # w1 stalls: its heartbeat stops, its reader sits in its blocking read.
            assert w1._heartbeat is not None
            await _cancel(w1._heartbeat)
            await eventually(lambda: _owner(raw, b"w2"), 10, "w2 taking the call over")
            assert int(await raw.get("cgf:{CA1}:fence")) == int(token1) + 1  # a new token
            await eventually(lambda: [m.event["n"] for m in got2] == [1], 10, "w2 handling the unacked event")
            assert not lost.is_set()  # w1 has not noticed yet ...
            # w1 acts on its stale view: every write is refused by Redis, under its old token.
            await w1.send("CA1", {"type": "audio", "of": "stale"})
            await w1.save_context("CA1", {"by": "w1"}, through=got1[0].id)
            await w1.ack("CA1", got1[0].id)
            assert await w1.flush(5)
            await asyncio.wait_for(lost.wait(), 10)  # ... and tells it the call is lost
            assert not await w1.holds("CA1") and w1.stats()["calls_lost"] == 1
            await w1.send("CA1", {"type": "audio", "of": "after"})  # dropped locally now
            assert await w1.flush(5)
            await gw.publish("CA1", {"type": "dtmf", "n": 2})
            await eventually(lambda: [m.event["n"] for m in got2] == [1, 2], 10, "w2 handling the next")
            assert await w2.holds("CA1")
            assert [m.event["n"] for m in got1] == [1]
            assert [e["of"] for e in await _downlink(raw, "CA1")] == [1, 2]  # nothing from w1
            assert await raw.hget("cgf:{CA1}:ctx", "ctx") is None  # w1's save refused
            pending = await raw.xpending_range("cgf:{CA1}:up", "workers", "-", "+", 10, consumername="w1")
            assert pending == []
            for task in (t1, t2):
                task.cancel()
            await asyncio.gather(t1, t2, return_exceptions=True)
        finally:
            await raw.aclose()


async def test_a_dead_gateway_s_calls_are_ended_by_their_worker(redis_server: RedisServer) -> None:
    gw = _bus(redis_server, "gw")
    wk = _bus(redis_server, "wk", gateway_grace_s=0.3, dead_call_ttl_s=5)
    raw = Redis.from_url(redis_server.url)
    events: list[dict[str, Any]] = []

    async def worker() -> None:
        async for call in wk.claim_calls("w1"):
            async for msg in wk.uplink(call.call_sid, "w1"):
                events.append(msg.event)
                await wk.ack(call.call_sid, msg.id)
            return

    async with gw, wk:
        try:
            await gw.open_call(CallInfo("CA1"))
            await gw.publish("CA1", {"type": "call_started"})
            task = asyncio.create_task(worker())
            await eventually(lambda: len(events) == 1, 10, "the worker on the call")
            # Several liveness periods with the gateway alive: nothing happens.
            for _ in range(5):
                await gw.publish("CA1", {"type": "speech_started"})
            await eventually(lambda: len(events) == 6, 10, "events through")
            assert await raw.exists(f"cgf:gateway:{gw.incarnation}")
            # The gateway dies without a word (kill -9: its liveness key is left to expire).
            assert gw._gateway_task is not None
            await _cancel(gw._gateway_task)
            await asyncio.wait_for(task, 10)  # the uplink ended
            assert bp.decode(events[-1]) == bp.CallEnded(reason="gateway_lost")
            assert events[-1]["eid"] == "CA1-gateway-lost"
            assert wk.stats()["calls_ended_gateway_lost"] == 1
            assert await raw.get("cgf:{CA1}:owner") == b"!closed"
            ttls = [await raw.ttl(f"cgf:{{CA1}}:{k}") for k in ("up", "down", "ctx", "owner", "fence")]
            assert all(0 < t <= 5 for t in ttls), ttls
            await eventually(lambda: wk.stats()["calls_owned"] == 0, 5, "the lease let go")
        finally:
            await raw.aclose()


async def _owner(raw: Redis, worker: bytes) -> bool:
    return await raw.get("cgf:{CA1}:owner") == worker


async def test_holds_asks_redis_before_an_effect_no_fence_covers(redis_server: RedisServer) -> None:
    gw, w1, w2 = _bus(redis_server, "gw"), _bus(redis_server, "w1"), _bus(redis_server, "w2")
    raw = Redis.from_url(redis_server.url)
    taken: list[str] = []

    async def claim(bus: RedisBus, wid: str) -> None:
        async for call in bus.claim_calls(wid):
            taken.append(f"{wid}:{call.call_sid}")

    async with gw, w1, w2:
        try:
            await gw.open_call(CallInfo("CA1"))
            t1 = asyncio.create_task(claim(w1, "w1"))
            await eventually(lambda: taken == ["w1:CA1"], 10, "w1 claiming")
            assert await w1.holds("CA1")
            assert w1._heartbeat is not None
            await _cancel(w1._heartbeat)  # w1 stalls ...
            t1.cancel()
            await asyncio.gather(t1, return_exceptions=True)
            t2 = asyncio.create_task(claim(w2, "w2"))
            await eventually(lambda: taken == ["w1:CA1", "w2:CA1"], 10, "w2 taking over")
            # ... and before it hangs up through Twilio, it asks: the call is not its own now.
            assert not await w1.holds("CA1")
            assert await w2.holds("CA1")
            assert await raw.get("cgf:{CA1}:owner") == b"w2"  # asking took nothing back
            t2.cancel()
            await asyncio.gather(t2, return_exceptions=True)
        finally:
            await raw.aclose()
