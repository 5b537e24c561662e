"""A call no worker ever held is a claim, not a takeover, however the worker found it.

On a loaded machine a worker's registry reader can hold a new call's entry, read but not yet
handed over, past the claim idle time; the worker's own orphan scan then finds the entry idle
and takes the call. It used to count and log that as taking the call over from a worker that
"stopped renewing" (fencing token 1: there was none), and the contract suite's
``test_unacked_messages_go_to_the_next_owner[cluster]`` failed on it under load."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from bus import CallInfo, RedisBus
from bus._redis import GROUP
from tests.redis_server import RedisServer

from .conftest import FAST_REDIS
from .test_contract import claim_one

pytestmark = pytest.mark.redis


async def test_a_new_call_found_by_the_orphan_scan_is_no_takeover(redis_server: RedisServer) -> None:
    gw = RedisBus(redis_server.url, prefix="cc", bus_id="gw", **FAST_REDIS)
    w1 = RedisBus(redis_server.url, prefix="cc", bus_id="w1", **FAST_REDIS)
    raw = Redis.from_url(redis_server.url)
    async with gw, w1:
        await gw.open_call(CallInfo("CA1"))
        assert await gw.flush(10)
        shard = gw._calls_key_for("CA1")
        await raw.xgroup_create(shard, GROUP, id="0", mkstream=True)
        # As if w1's reader had read the entry and not handed it over for 100 s.
        read = await raw.xreadgroup(GROUP, "w1", {shard: ">"}, count=1)
        (entry_id, _), = read[0][1]
        await raw.xclaim(shard, GROUP, "w1", 0, [entry_id], idle=100_000, justid=True)
        assert (await claim_one(w1, "w1")).call_sid == "CA1"
        assert w1.stats()["calls_claimed"] == 1
        assert w1.stats()["orphans_claimed"] == 0
        await gw.close_call("CA1")
    await raw.aclose()
