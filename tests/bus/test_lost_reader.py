"""A worker that has dropped a call from its owned set (its heartbeat found the lease gone) while
its uplink reader still watches the call's stream must not claim the new owner's messages: it
claims under the token it opened the uplink with, which Redis refuses once the call was taken
over. With the empty token ("unfenced") it used to read them into its own pending list, where
nobody read them again: events lost (code review of session 5, finding 1)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.asyncio import Redis

from bus import BusMessage, CallInfo, OwnershipLostError
from bus._redis import _cancel
from tests.redis_server import RedisServer

from .conftest import eventually
from .test_fencing import _bus, _owner

pytestmark = pytest.mark.redis

async def test_a_reader_that_lost_its_call_claims_nothing_of_the_new_owner_s(redis_server: RedisServer) -> None:
    gw, w1, w2 = _bus(redis_server, "gw"), _bus(redis_server, "w1"), _bus(redis_server, "w2")
    raw = Redis.from_url(redis_server.url)
    got1: list[BusMessage] = []
    got2: list[BusMessage] = []

    async def stale() -> None:
        try:
            async for msg in w1.uplink("CA1", "w1"):
                got1.append(msg)
        except OwnershipLostError:
            pass

    async def standby() -> None:
        async for call in w2.claim_calls("w2"):
            async for msg in w2.uplink(call.call_sid, "w2"):
                got2.append(msg)
                await w2.ack(call.call_sid, msg.id)

    async with gw, w1, w2:
        tasks: list[asyncio.Task[Any]] = []
        try:
            await gw.open_call(CallInfo("CA1"))
            tasks.append(asyncio.create_task(stale()))
            await eventually(lambda: _owner(raw, b"w1"), 10, "w1 owning the call")
            standby_task = asyncio.create_task(standby())
            tasks.append(standby_task)
            await gw.publish("CA1", {"type": "dtmf", "digit": "0"})
            await eventually(lambda: len(got1) == 1, 10, "w1 given the first event")
            assert w1._heartbeat is not None
            await _cancel(w1._heartbeat)  # w1 stalls ...
            await eventually(lambda: _owner(raw, b"w2"), 10, "w2 taking the call over")
            await eventually(lambda: len(got2) == 1, 10, "w2 handling the unacked event")
            # w2 holds the call (its heartbeat renews the lease) but is between reads, so only
            # w1's reader can see the next event: the race made deterministic.
            await _cancel(standby_task)
            # w1's heartbeat, back, drops the call from its owned set; the uplink's reader has
            # not stopped yet (no sentinel in its inbox): the window the race lives in.
            w1._drop_owned(w1._owned["CA1"], None)
            await gw.publish("CA1", {"type": "dtmf", "digit": "1"})
            await eventually(lambda: "CA1" in w1._lost or len(got1) > 1, 10,
                             "w1's reader refused the claim (or took the event)")
            assert len(got1) == 1  # the new owner's event was not read by the stale worker ...
            pending = await raw.xpending_range("cgf:{CA1}:up", "workers", "-", "+", 10, consumername="w1")
            assert pending == []  # ... nor left pending under its name
            assert await w2.holds("CA1")
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await raw.aclose()
