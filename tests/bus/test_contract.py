"""The bus contract: every test runs against EmbeddedBus and RedisBus (``make_bus`` fixture)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from bus import (
    Bus,
    BusClosedError,
    BusMessage,
    CallInfo,
    CallOwnershipError,
    EmbeddedBus,
    EventError,
    InvalidNameError,
    RedisBus,
)
from bus import make_bus as make_bus_from_url

from .conftest import STEADY_REDIS, eventually


async def take(it: AsyncIterator[Any], n: int, timeout: float = 10.0) -> list[Any]:
    """The next ``n`` items of ``it``."""
    out = []
    async with asyncio.timeout(timeout):
        for _ in range(n):
            out.append(await anext(it))
    return out


async def drain(it: AsyncIterator[Any], timeout: float = 10.0) -> list[Any]:
    """Everything ``it`` yields until it ends."""
    out = []
    async with asyncio.timeout(timeout):
        async for item in it:
            out.append(item)
    return out


async def claim_one(bus: Bus, worker_id: str, timeout: float = 10.0) -> CallInfo:
    it = bus.claim_calls(worker_id)
    try:
        (call,) = await take(it, 1, timeout)
    finally:
        await it.aclose()  # type: ignore[attr-defined]
    return call


def types(messages: list[BusMessage]) -> list[str]:
    return [m.event["type"] for m in messages]


async def test_uplink_in_order_with_eids(make_bus: Any) -> None:
    gw, wk = await make_bus(), await make_bus()
    await gw.open_call(CallInfo("CA1", agent="sales", params={"k": "v"}))
    call = await claim_one(wk, "w1")
    assert call == CallInfo("CA1", agent="sales", params={"k": "v"})
    eids = [await gw.publish("CA1", {"type": "transcript", "n": i, "final": True}) for i in range(20)]
    assert len(set(eids)) == 20
    got = await take(wk.uplink("CA1", "w1"), 20)
    assert [m.event["n"] for m in got] == list(range(20))
    assert [m.event["eid"] for m in got] == eids
    assert not any(m.redelivered for m in got)


async def test_publisher_eid_kept_and_duplicates_dropped(make_bus: Any) -> None:
    gw, wk = await make_bus(), await make_bus()
    await gw.open_call(CallInfo("CA1"))
    assert await gw.publish("CA1", {"type": "dtmf", "digit": "1", "eid": "x-1"}) == "x-1"
    await gw.publish("CA1", {"type": "dtmf", "digit": "1", "eid": "x-1"})  # a retried write
    await gw.publish("CA1", {"type": "dtmf", "digit": "2", "eid": "x-2"})
    await gw.close_call("CA1")
    got = await drain(wk.uplink("CA1", "w1"))
    assert [m.event["eid"] for m in got] == ["x-1", "x-2"]


async def test_event_is_a_copy_and_input_untouched(make_bus: Any) -> None:
    gw, wk = await make_bus(), await make_bus()
    event = {"type": "transcript", "text": "hi", "final": True, "words": ("a", "b")}
    eid = await gw.publish("CA1", event)
    assert "eid" not in event
    (msg,) = await take(wk.uplink("CA1", "w1"), 1)
    assert msg.event == {"type": "transcript", "text": "hi", "final": True, "words": ["a", "b"], "eid": eid}


async def test_bad_events_and_names_are_refused(make_bus: Any) -> None:
    bus = await make_bus()
    with pytest.raises(EventError):
        await bus.publish("CA1", {"no": "type"})
    with pytest.raises(EventError):
        await bus.send("CA1", {"type": "audio", "payload": object()})
    with pytest.raises(EventError):
        await bus.publish("CA1", {"type": "x", "eid": 5})
    with pytest.raises(InvalidNameError):
        await bus.publish("CA{1}", {"type": "x"})
    with pytest.raises(InvalidNameError):
        await bus.open_call(CallInfo("CA 1"))
    with pytest.raises(EventError):
        await bus.save_context("CA1", {"x": {1, 2}})


async def test_unacked_messages_go_to_the_next_owner(make_bus: Any) -> None:
    gw, w1 = await make_bus(), await make_bus()
    await gw.open_call(CallInfo("CA1"))
    assert (await claim_one(w1, "w1")).call_sid == "CA1"
    for i in range(3):
        await gw.publish("CA1", {"type": "speech_started", "n": i})
    up = w1.uplink("CA1", "w1")
    first = await take(up, 3)
    await w1.ack("CA1", first[0].id)
    await up.aclose()  # type: ignore[attr-defined]
    await w1.aclose()  # the worker goes away; its unacked messages stay with the call

    w2 = await make_bus()
    assert (await claim_one(w2, "w2")).call_sid == "CA1"
    await gw.publish("CA1", {"type": "speech_started", "n": 3})
    got = await take(w2.uplink("CA1", "w2"), 3)
    assert [m.event["n"] for m in got] == [1, 2, 3]
    assert [m.redelivered for m in got] == [True, True, False]
    assert [m.id for m in got[:2]] == [m.id for m in first[1:]]
    assert w1.stats()["calls_claimed"] == 1 and w1.stats()["orphans_claimed"] == 0
    assert w2.stats()["calls_claimed"] == 1
    assert w2.stats()["orphans_claimed"] == 1  # its owner went away: taken over
    assert gw.stats()["calls_claimed"] == 0


async def test_context_through_skips_what_it_covers(make_bus: Any) -> None:
    gw, w1 = await make_bus(), await make_bus()
    await gw.open_call(CallInfo("CA1"))
    await claim_one(w1, "w1")
    for i in range(4):
        await gw.publish("CA1", {"type": "transcript", "n": i, "final": True})
    up = w1.uplink("CA1", "w1")
    handled: list[int] = []
    msgs = await take(up, 2)
    for msg in msgs:
        handled.append(msg.event["n"])
        await w1.save_context("CA1", {"handled": handled}, through=msg.id)
    await w1.save_context("CA1", {"handled": handled})  # no through: the mark stays
    await w1.ack("CA1", msgs[0].id)  # dies before acking the second
    await up.aclose()  # type: ignore[attr-defined]
    await w1.aclose()

    w2 = await make_bus()
    await claim_one(w2, "w2")
    assert await w2.load_context("CA1") == {"handled": [0, 1]}
    got = await take(w2.uplink("CA1", "w2"), 2)
    assert [m.event["n"] for m in got] == [2, 3]


async def test_explicit_through(make_bus: Any) -> None:
    gw, w1 = await make_bus(), await make_bus()
    for i in range(3):
        await gw.publish("CA1", {"type": "dtmf", "digit": str(i)})
    got = await take(w1.uplink("CA1", "w1"), 3)
    await w1.save_context("CA1", {"digits": "0"}, through=got[0].id)
    await w1.aclose()
    w2 = await make_bus()
    rest = await take(w2.uplink("CA1", "w2"), 2)
    assert [m.event["digit"] for m in rest] == ["1", "2"]


async def test_context_roundtrip(make_bus: Any) -> None:
    a, b = await make_bus(), await make_bus()
    assert await a.load_context("CA1") is None
    ctx = {"messages": [{"role": "user", "content": "héllo"}], "n": 1.5, "ok": True, "none": None}
    await a.save_context("CA1", ctx)
    assert await a.load_context("CA1") == ctx
    assert await a.flush(5.0)
    assert await b.load_context("CA1") == ctx
    await b.save_context("CA1", {"n": 2})
    assert await b.flush(5.0)
    assert await a.load_context("CA1") == {"n": 2}


async def test_two_workers_get_distinct_calls(make_bus: Any) -> None:
    gw, w1, w2 = await make_bus(), await make_bus(), await make_bus()
    got: dict[str, list[str]] = {"w1": [], "w2": []}

    async def worker(bus: Bus, wid: str) -> None:
        async for call in bus.claim_calls(wid):
            got[wid].append(call.call_sid)
            await asyncio.sleep(0)  # let the other worker in

    tasks = [asyncio.create_task(worker(w1, "w1")), asyncio.create_task(worker(w2, "w2"))]
    sids = [f"CA{i}" for i in range(40)]
    for sid in sids:
        await gw.open_call(CallInfo(sid))
    await eventually(lambda: len(got["w1"]) + len(got["w2"]) >= 40, what="all calls claimed")
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert sorted(got["w1"] + got["w2"]) == sorted(sids)
    assert not set(got["w1"]) & set(got["w2"])


async def test_calls_a_stopped_claim_loop_read_ahead_go_to_others(make_bus: Any) -> None:
    gw, w1, w2 = await make_bus(), await make_bus(), await make_bus()
    sids = [f"CA{i}" for i in range(6)]
    for sid in sids:
        await gw.open_call(CallInfo(sid))
    assert await gw.flush(5)
    first = await claim_one(w1, "w1")  # w1's loop may have read more than it handed out
    it = w2.claim_calls("w2")
    rest = await take(it, 5)
    await it.aclose()  # type: ignore[attr-defined]
    assert sorted([first.call_sid, *(c.call_sid for c in rest)]) == sids


async def test_uplink_of_a_call_owned_by_another_worker_is_refused(make_bus: Any) -> None:
    gw, w1, w2 = await make_bus(), await make_bus(), await make_bus()
    await gw.open_call(CallInfo("CA1"))
    await claim_one(w1, "w1")
    with pytest.raises(CallOwnershipError) as info:
        await anext(w2.uplink("CA1", "w2"))
    assert info.value.owner == "w1"


async def test_close_call_ends_both_iterators_after_pending_events(make_bus: Any) -> None:
    gw, wk = await make_bus(), await make_bus()
    await gw.open_call(CallInfo("CA1"))
    await claim_one(wk, "w1")
    up_task = asyncio.create_task(drain(wk.uplink("CA1", "w1")))
    down_task = asyncio.create_task(drain(gw.downlink("CA1")))
    await gw.publish("CA1", {"type": "call_started"})
    await wk.send("CA1", {"type": "utterance_start", "utterance_id": "u1"})
    await gw.publish("CA1", {"type": "call_ended"})
    await wk.send("CA1", {"type": "utterance_end", "utterance_id": "u1"})
    assert await wk.flush(5.0)
    await gw.close_call("CA1")
    up, down = await asyncio.gather(up_task, down_task)
    assert types(up) == ["call_started", "call_ended"]
    assert types(down) == ["utterance_start", "utterance_end"]
    # Late events are not delivered; a new iterator on the closed call ends at once.
    await gw.publish("CA1", {"type": "dtmf", "digit": "9"})
    assert types(await drain(gw.downlink("CA1"))) == ["utterance_start", "utterance_end"]


async def test_worker_can_close_the_call(make_bus: Any) -> None:
    gw, wk = await make_bus(), await make_bus()
    await gw.open_call(CallInfo("CA1"))
    await claim_one(wk, "w1")
    down_task = asyncio.create_task(drain(gw.downlink("CA1")))
    up_task = asyncio.create_task(drain(wk.uplink("CA1", "w1")))
    await wk.send("CA1", {"type": "hangup"})
    await wk.close_call("CA1")
    assert types(await down_task) == ["hangup"]
    assert await up_task == []


async def test_downlink_from_start_for_every_reader(make_bus: Any) -> None:
    gw, wk = await make_bus(), await make_bus()
    for i in range(5):
        await wk.send("CA1", {"type": "audio", "seq": i, "eid": f"a{i}"})
    await wk.send("CA1", {"type": "audio", "seq": 4, "eid": "a4"})  # a re-send after takeover
    first = await take(gw.downlink("CA1"), 5)
    second = await take(gw.downlink("CA1"), 5)
    assert [m.event["seq"] for m in first] == [m.event["seq"] for m in second] == list(range(5))
    end_eid = await wk.send("CA1", {"type": "utterance_end", "utterance_id": "u"})
    await wk.close_call("CA1")
    got = [m.event["eid"] for m in await drain(gw.downlink("CA1"))]
    assert got == ["a0", "a1", "a2", "a3", "a4", end_eid]


async def test_reopened_uplink_does_not_repeat_within_a_bus(make_bus: Any) -> None:
    gw, wk = await make_bus(), await make_bus()
    for i in range(3):
        await gw.publish("CA1", {"type": "dtmf", "digit": str(i)})
    up = wk.uplink("CA1", "w1")
    await take(up, 2)
    await up.aclose()  # type: ignore[attr-defined]
    await gw.publish("CA1", {"type": "dtmf", "digit": "3"})
    got = await take(wk.uplink("CA1", "w1"), 2)
    assert [m.event["digit"] for m in got] == ["2", "3"]


async def test_closed_bus_refuses_and_ends_iterators(make_bus: Any) -> None:
    gw, wk = await make_bus(), await make_bus()
    seen: dict[str, list[Any]] = {"up": [], "down": [], "claim": []}

    async def collect(name: str, it: AsyncIterator[Any]) -> None:
        async for item in it:
            seen[name].append(item)

    await gw.open_call(CallInfo("CA1"))
    claim_task = asyncio.create_task(collect("claim", wk.claim_calls("w1")))
    await eventually(lambda: len(seen["claim"]) == 1, what="claimed")
    up_task = asyncio.create_task(collect("up", wk.uplink("CA1", "w1")))
    down_task = asyncio.create_task(collect("down", gw.downlink("CA1")))
    await gw.publish("CA1", {"type": "dtmf", "digit": "1"})
    await wk.send("CA1", {"type": "dtmf", "digit": "2"})
    # Each iterator has yielded, so it is now waiting for more when the buses close.
    await eventually(lambda: len(seen["up"]) == 1 and len(seen["down"]) == 1, what="events")
    await wk.aclose()
    await gw.aclose()
    for task in (up_task, down_task, claim_task):
        with pytest.raises(BusClosedError):
            await asyncio.wait_for(task, 10)
    with pytest.raises(BusClosedError):
        await gw.publish("CA1", {"type": "dtmf"})
    with pytest.raises(BusClosedError):
        await gw.start()
    await gw.aclose()  # idempotent


async def test_many_calls_fan_out(make_bus: Any) -> None:
    n_calls, n_events = 300, 6
    # No worker dies: leases that cannot lapse under load (a call claimed twice failed this).
    gw = await make_bus(**STEADY_REDIS)
    workers = [await make_bus(**STEADY_REDIS) for _ in range(2)]
    handled: dict[str, list[int]] = {}
    owner: dict[str, str] = {}
    handlers: set[asyncio.Task[None]] = set()

    async def handle(bus: Bus, wid: str, sid: str) -> None:
        async for msg in bus.uplink(sid, wid):
            handled.setdefault(sid, []).append(msg.event["n"])
            await bus.ack(sid, msg.id)
            await bus.send(sid, {"type": "audio", "n": msg.event["n"]})

    async def worker(bus: Bus, wid: str) -> None:
        async for call in bus.claim_calls(wid):
            assert call.call_sid not in owner
            owner[call.call_sid] = wid
            handlers.add(asyncio.create_task(handle(bus, wid, call.call_sid)))

    claimers = [asyncio.create_task(worker(b, f"w{i}")) for i, b in enumerate(workers)]
    sids = [f"CA{i:04d}" for i in range(n_calls)]
    downs = {sid: asyncio.create_task(drain(gw.downlink(sid), 60)) for sid in sids}
    for sid in sids:
        await gw.open_call(CallInfo(sid))
    for n in range(n_events):
        for sid in sids:
            await gw.publish(sid, {"type": "transcript", "n": n, "final": True})
    await eventually(
        lambda: sum(len(v) for v in handled.values()) == n_calls * n_events, 30, "all handled"
    )
    for wk in workers:
        assert await wk.flush(10)
    for sid in sids:
        await gw.close_call(sid)
    await asyncio.wait_for(asyncio.gather(*handlers), 30)
    for task in claimers:
        task.cancel()
    await asyncio.gather(*claimers, return_exceptions=True)
    assert set(owner) == set(sids)
    assert all(handled[sid] == list(range(n_events)) for sid in sids)
    for sid, task in downs.items():
        assert [m.event["n"] for m in await task] == list(range(n_events)), sid


async def test_flush_and_unknown_ack(make_bus: Any) -> None:
    bus = await make_bus()
    assert await bus.flush(1.0)
    await bus.ack("CA1", "0-1")  # an id nobody delivered: a no-op
    assert await bus.flush(5.0)


def test_make_bus_picks_the_implementation() -> None:
    assert isinstance(make_bus_from_url(None), EmbeddedBus)
    assert isinstance(make_bus_from_url(""), EmbeddedBus)
    assert isinstance(make_bus_from_url("embedded"), EmbeddedBus)
    bus = make_bus_from_url("redis://127.0.0.1:1/0", prefix="x")
    assert isinstance(bus, RedisBus)
    assert isinstance(make_bus_from_url("rediss://h:6380/0"), RedisBus)
    with pytest.raises(ValueError, match="unknown bus URL"):
        make_bus_from_url("amqp://h")


def test_export_list_is_complete_and_exact() -> None:
    import types

    import bus
    from bus import _base, _embedded, _errors, _redis, _retry

    public = {n for n, v in vars(bus).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)}
    assert public == set(bus.__all__)
    for module in (_base, _embedded, _errors, _redis, _retry):
        assert set(module.__all__) <= public, module.__name__
    assert {"Bus", "BusMessage", "CallInfo", "Event", "EmbeddedBus", "RedisBus", "make_bus"} <= public
