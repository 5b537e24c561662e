"""Calls live across a Redis outage longer than the lease (issue #13's last loss), from outside:
a real redis-server (AOF, ``appendfsync always``, as bench.chaos runs it) SIGKILLed and started
again after twice the 2 s lease, three real ``callgate worker`` processes, and the gateway's side
played by a ``RedisBus`` in this process (its writes are buffered while Redis is away).

When Redis comes back every lease has lapsed and every call's registry entry has idled past the
claim threshold. Before the fix the other workers' claim loops raced the owners' renewals: calls
moved from one live worker to another at once (bench.chaos: 3 calls w3 -> w2), and the key
presses that reached the old owner's reader after it had let go of a call were claimed into
its pending list without a lease check and answered by nobody (one call lost "012")."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from bus import CallInfo, OwnershipLostError, RedisBus
from tests.redis_server import RedisServer

from ._workers import answers, key, owners, start_workers
from .conftest import Processes, eventually

pytestmark = [pytest.mark.redis, pytest.mark.slow]

CALLS = 6
WORKERS = 3
LEASE_S = 2.0  # the bus's default worker_ttl_s
OUTAGE_S = 2 * LEASE_S  # the fault itself: Redis away this long (not a wait for anything)


def _id(stream_id: str) -> tuple[int, int]:
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)


async def test_calls_stay_with_their_live_owners_across_an_outage_longer_than_the_lease(
    make_redis_server, processes: Processes, tmp_path: Path  # type: ignore[no-untyped-def]
) -> None:
    server: RedisServer = make_redis_server("--appendonly", "yes", "--appendfsync", "always")
    workers = [f"w{i + 1}" for i in range(WORKERS)]
    # The test's own reads retry across the restart (the first command meets a dead socket).
    raw = Redis.from_url(server.url, socket_timeout=5, retry=Retry(ExponentialBackoff(), 8),
                         retry_on_error=[RedisConnectionError])  # fmt: skip
    sids = [f"CA{0x1300 + i:032x}" for i in range(CALLS)]
    sent = dict.fromkeys(sids, "")

    async def press(digits: str) -> None:
        for sid in sids:
            for digit in digits:
                await gw.publish(sid, {"type": "dtmf", "digit": digit})
                sent[sid] += digit

    async def all_answered() -> bool:
        for sid in sids:
            if len(await answers(raw, sid)) < len(sent[sid]):
                return False
        return True

    try:
        await start_workers(processes, raw, server.url, tmp_path, workers)
        async with RedisBus(server.url, bus_id="gw") as gw:
            for sid in sids:
                await gw.open_call(CallInfo(sid, agent="dtmf"))
                await gw.publish(sid, {"type": "call_started", "agent": "dtmf"})

            async def owned() -> bool:
                return all(o in workers for o in (await owners(raw, sids)).values())

            await eventually(owned, 60, "every call owned")
            await press("0")
            await eventually(all_answered, 60, "answers to 0")
            before = await owners(raw, sids)

            server.kill()
            await press("12")  # during the outage: buffered by the gateway's bus
            await asyncio.sleep(OUTAGE_S)
            await asyncio.to_thread(server.start)
            await press("3")  # after it
            await eventually(all_answered, 60, "answers to 1, 2 and 3")
            await eventually(owned, 60, "every call owned")  # (a lease may lapse under load)
            after = await owners(raw, sids)
            answered = {sid: await answers(raw, sid) for sid in sids}
            for sid in sids:
                await gw.publish(sid, {"type": "call_ended", "reason": "stop"})
                await gw.close_call(sid)
    finally:
        await raw.aclose()

    assert answered == {sid: "0123" for sid in sids}  # exactly once, in order
    moved = {sid: (before[sid], after[sid]) for sid in sids if before[sid] != after[sid]}
    assert moved == {}, f"calls moved between live workers: {moved} (owners {Counter(before.values())})"


@pytest.mark.redis
async def test_a_message_arriving_after_the_owner_lost_the_call_goes_to_the_new_owner(
    redis_server: RedisServer,
) -> None:
    """The loss itself, deterministically: the old owner has learnt it lost the call, but its
    uplink iterator has not yet reached the lost mark (a busy call task), so its reader still
    watches the stream. A key press arriving then must stay unclaimed for the new owner; it was
    claimed without a lease check into the old owner's pending list, after the new owner had
    moved the pending messages to itself, and nobody ever answered it."""
    sid = "CA000000000000000000000000000013aa"
    raw = Redis.from_url(redis_server.url)
    old, new = RedisBus(redis_server.url, bus_id="old"), RedisBus(redis_server.url, bus_id="new")
    try:
        async with RedisBus(redis_server.url, bus_id="gw") as gw, old, new:
            await gw.open_call(CallInfo(sid))
            await gw.publish(sid, {"type": "call_started"})
            await gw.flush()
            mine = old.uplink(sid, "w-old")
            first = await asyncio.wait_for(anext(mine), 10)
            await old.ack(sid, first.id)
            # The old owner's lease lapses (Redis away longer than it) and the new one takes it.
            await raw.delete(key(sid, "owner"))
            code, _, _ = await new._acquire(sid, "w-new", orphan=True)
            assert code == 2
            await eventually(lambda: sid in old._lost, 10, "the old owner learning it lost the call")
            # The old owner's iterator is parked at its last message: it has not seen the mark.
            await gw.publish(sid, {"type": "dtmf", "digit": "7"})
            await gw.flush()
            [(press_id, _)] = await raw.xrevrange(key(sid, "up"), count=1)
            press = press_id.decode()
            [shard] = [s for s in old._up_readers["w-old"].shards if s.subs]
            up_key = key(sid, "up").encode()

            async def looked_at_it() -> bool:
                pending = await raw.xpending_range(key(sid, "up"), "workers", "-", "+", 10,
                                                   consumername="w-old")  # fmt: skip
                seen = up_key in shard._pos and _id(shard._pos[up_key]) >= _id(press)
                return bool(pending) or seen

            await eventually(looked_at_it, 10, "the old owner's reader seeing the key press")
            pending = await raw.xpending_range(key(sid, "up"), "workers", "-", "+", 10,
                                               consumername="w-old")  # fmt: skip
            assert pending == [], "claimed by the worker that lost the call"
            theirs = new.uplink(sid, "w-new")
            message = await asyncio.wait_for(anext(theirs), 10)
            assert (message.id, message.event["digit"]) == (press, "7")
            await theirs.aclose()
            with pytest.raises(OwnershipLostError):
                await asyncio.wait_for(anext(mine), 10)
    finally:
        await raw.aclose()
