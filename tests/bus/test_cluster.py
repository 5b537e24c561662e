"""RedisBus on a real Redis Cluster (three primaries, three replicas, started by the test): the
key layout keeps every script in one slot and spreads calls over the primaries, and a primary
failed over mid-call loses no event and repeats none, on either direction."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from redis.asyncio.cluster import RedisCluster
from redis.cluster import key_slot

from bus import CallInfo, RedisBus, make_bus
from tests.redis_cluster import RedisClusterServers

from .conftest import FAST_REDIS, eventually

pytestmark = pytest.mark.redis


def _bus(url: str, name: str, **options: Any) -> RedisBus:
    return RedisBus(url, prefix="cgc", bus_id=name, **{**FAST_REDIS, **options})


async def test_a_node_lost_in_the_lease_pipeline_fails_the_beat_as_an_outage() -> None:
    """A Cluster pipeline run with ``raise_on_error=False`` hands back a node's lost connection
    as one command's reply. Renewal raises it (the heartbeat counts an outage and beats again)
    instead of parsing it as lease codes: that TypeError failed 1 in 12 failover runs."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    class Pipeline:
        def execute_command(self, *args: Any) -> None:
            pass

        async def execute(self, raise_on_error: bool = True) -> list[Any]:
            assert raise_on_error is False
            return [[1, 1], RedisConnectionError("Connection closed by server.")]

    class Client:
        def pipeline(self, transaction: bool = True) -> Pipeline:
            return Pipeline()

    bus = _bus("redis+cluster://127.0.0.1:1", "wk")  # never opened: the client is given
    with pytest.raises(RedisConnectionError, match="closed by server"):
        await bus._renew_pipelined(Client(), [([], ["a", "b"], []), ([], ["c", "d"], [])])


async def test_a_script_the_new_primary_lacks_is_sent_whole_on_the_retry() -> None:
    """Right after a failover the promoted replica may not know the renewal script while the
    client's topology still names the old primary (a SCRIPT LOAD to every primary missed it:
    "lease renewal failed: No matching script" in a loaded clean-clone run). The retry sends
    the script itself (EVAL), which runs wherever the slot lives now."""
    from redis.exceptions import NoScriptError

    from bus._redis import _RENEW

    sent: list[list[tuple[Any, ...]]] = []

    class Pipeline:
        def __init__(self) -> None:
            sent.append([])

        def execute_command(self, *args: Any) -> None:
            sent[-1].append(args)

        async def execute(self, raise_on_error: bool = True) -> list[Any]:
            if len(sent) == 1:
                return [NoScriptError("No matching script. Please use EVAL.")]
            return [[1]]

    class Client:  # no script_load: the retry must not need one
        def pipeline(self, transaction: bool = True) -> Pipeline:
            return Pipeline()

    bus = _bus("redis+cluster://127.0.0.1:1", "wk")  # never opened: the client is given
    assert await bus._renew_pipelined(Client(), [([], ["a", "b"], ["w1"])]) == [[1]]
    assert [cmds[0][:2] for cmds in sent] == [("EVALSHA", sent[0][0][1]), ("EVAL", _RENEW)]
    assert sent[1][0][2:] == (2, "a", "b", "w1")


def test_cluster_urls_are_checked() -> None:
    assert isinstance(make_bus("redis+cluster://10.0.0.1:7000,10.0.0.2:7000"), RedisBus)
    assert isinstance(make_bus("rediss+cluster://u:p@h1:7000"), RedisBus)
    with pytest.raises(ValueError, match="host:port"):
        RedisBus("redis+cluster://h1:7000,h2")
    with pytest.raises(ValueError, match="only database 0"):
        RedisBus("redis+cluster://h1:7000/3")


def test_a_calls_keys_share_one_slot_and_calls_spread_over_slots() -> None:
    bus = RedisBus("redis+cluster://127.0.0.1:1", prefix="cg")
    sids = [f"CA{i:032x}" for i in range(2000)]
    for sid in sids[:50]:
        keys = [bus._key(sid, part) for part in ("up", "down", "ctx", "owner", "fence")]
        assert len({key_slot(k.encode()) for k in keys}) == 1, keys
    groups = {bus._group(sid) for sid in sids}
    assert groups == set(range(64)), "calls use every slot group"
    shards = {bus._calls_key_for(sid) for sid in sids}
    assert len(shards) == 8, "the calls registry is sharded"
    assert len({key_slot(s.encode()) for s in shards}) == 8
    single = RedisBus("redis://127.0.0.1:1/0", prefix="cg")
    assert single._key("CA1", "up") == "cg:{CA1}:up"  # the one-server layout is unchanged
    assert {single._calls_key_for(sid) for sid in sids} == {"cg:calls"}


async def test_calls_land_on_every_primary(redis_cluster: RedisClusterServers) -> None:
    gw = _bus(redis_cluster.url, "gw")
    sids = [f"CA{i:03d}" for i in range(40)]
    async with gw:
        for sid in sids:
            await gw.open_call(CallInfo(sid))
        assert await gw.flush(10)
        primaries = {redis_cluster.primary_of(gw._key(sid, "up")).port for sid in sids}
        registry = {redis_cluster.primary_of(key).port for key in gw._calls_keys}
    assert primaries == {s.port for s in redis_cluster.primaries}
    assert len(registry) > 1, "the registry shards are served by more than one primary"


async def test_failover_mid_call_loses_nothing(
    redis_cluster: RedisClusterServers, caplog: pytest.LogCaptureFixture
) -> None:
    n_before, n_during, n_after = 30, 30, 30
    total = n_before + n_during + n_after
    gw, wk = _bus(redis_cluster.url, "gw"), _bus(redis_cluster.url, "wk")
    sid = "CA1"
    handled: list[int] = []
    heard: list[int] = []
    claimed: list[str] = []

    handlers: list[asyncio.Task[None]] = []

    async def handle(call_sid: str) -> None:
        async for msg in wk.uplink(call_sid, "w1"):
            handled.append(msg.event["n"])
            await wk.save_context(call_sid, {"n": msg.event["n"]}, through=msg.id)
            await wk.ack(call_sid, msg.id)
            await wk.send(call_sid, {"type": "audio", "n": msg.event["n"]})

    async def worker() -> None:
        async for call in wk.claim_calls("w1"):
            claimed.append(call.call_sid)
            handlers.append(asyncio.create_task(handle(call.call_sid)))

    async def listen() -> None:
        async for msg in gw.downlink(sid):
            heard.append(msg.event["n"])

    async with gw, wk:
        await gw.open_call(CallInfo(sid, agent="support"))
        work = asyncio.create_task(worker())
        ear = asyncio.create_task(listen())
        for n in range(n_before):
            await gw.publish(sid, {"type": "transcript", "n": n, "final": True})
        await eventually(lambda: len(heard) == n_before, 20, "the call under way")
        primary = redis_cluster.primary_of(gw._key(sid, "up"))
        failover = asyncio.create_task(asyncio.to_thread(redis_cluster.failover, primary))
        for n in range(n_before, n_before + n_during):  # written while the primary moves
            await gw.publish(sid, {"type": "transcript", "n": n, "final": True})
        new_primary = await failover
        assert redis_cluster.primary_of(gw._key(sid, "up")) is new_primary is not primary
        for n in range(n_before + n_during, total):
            await gw.publish(sid, {"type": "transcript", "n": n, "final": True})
        await eventually(lambda: len(heard) >= total, 30, "every reply after the failover")
        # The claim loop still takes new calls, on every registry shard (each read a failover
        # unblocked is read again).
        later = [f"CB{i}" for i in range(24)]
        for later_sid in later:
            await gw.open_call(CallInfo(later_sid))
        await eventually(lambda: set(later) <= set(claimed), 30, "calls opened after the failover claimed")
        for later_sid in later:
            await gw.close_call(later_sid)
        assert await wk.flush(10)
        await gw.close_call(sid)
        await asyncio.wait_for(ear, 20)
        assert await gw.flush(10)
        await asyncio.wait_for(asyncio.gather(*handlers), 20)  # every call ended, none stuck
        ctx = await wk.load_context(sid)
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        raw = RedisCluster(host="127.0.0.1", port=new_primary.port)
        try:
            stored = [f[b"e"] for _, f in await raw.xrange(gw._key(sid, "up")) if b"e" in f]
        finally:
            await raw.aclose()
    assert claimed[0] == sid and sorted(claimed[1:]) == sorted(later)
    assert {gw._calls_key_for(s) for s in later} == set(gw._calls_keys)
    failures = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not failures, failures
    assert handled == list(range(total)), "every event handled once, in order"
    assert heard == list(range(total)), "every reply heard once, in order"
    assert ctx == {"n": total - 1}
    assert len(stored) >= total  # retried batches may store a copy; the bus drops it by eid
