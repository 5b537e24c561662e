"""Redis restarted mid-call: the call plays on, the barge-in during the outage still stops the
bot at once, and every uplink event reaches the worker, in order, once Redis is back."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from bus import Event, RedisBus
from gateway.replay import replay
from gateway.timeline import Timeline
from tests import recordings_index as rec
from tests.bus_agents import recording, serve
from tests.gateway.conftest import _script
from tests.redis_server import RedisServer, make_redis_server  # noqa: F401 (fixture)

pytestmark = pytest.mark.redis


class _GatewayBus(RedisBus):
    """The gateway's bus, whose ``call_started`` returns once the worker has the call.

    On a real line the bot's first utterance is the worker's: the worker has claimed the call
    before the bot speaks, so before the outage starts. The replay's scripted bot speaks at a
    fixed media time instead, 58 ms of wall time in at 10x, and on a loaded machine the worker
    was still claiming then (its lease script failed with the connection; retried with backoff
    once Redis was back, it found the call already closed, which by contract is claimed by
    nobody, and never saw an event of it). Holding the call here until the worker has read
    ``call_started`` gives the test the order a real line has, however loaded the machine."""

    def __init__(self, url: str, worker_has_call: asyncio.Event) -> None:
        super().__init__(url)
        self._worker_has_call = worker_has_call

    async def publish(self, call_sid: str, event: Event) -> str:
        eid = await super().publish(call_sid, event)
        if event["type"] == "call_started":
            await self._worker_has_call.wait()
        return eid


async def _worker(
    url: str, got: list[dict[str, Any]], ready: asyncio.Event, has_call: asyncio.Event
) -> None:
    record = recording(got)

    async def react(call_sid: str, event: Event) -> None:
        await record(call_sid, event)
        has_call.set()  # claimed, and its uplink read

    try:
        async with RedisBus(url) as bus:
            ready.set()
            await serve(bus, "w1", react)
    finally:
        has_call.set()  # a worker that failed must not hold the call forever: its error is the news


async def test_barge_in_during_a_redis_outage(make_redis_server: Callable[..., RedisServer]) -> None:
    server = make_redis_server("--appendonly", "yes")
    name = "barge_in_timit"
    outage: dict[str, float] = {}

    def on_event(event: dict[str, Any]) -> None:
        # Blocking calls on purpose: the outage starts and ends at exact points of the call.
        if event["type"] == "bot_utterance_started" and "down" not in outage:
            server.stop()
            outage["down"] = event["t_ms"]
        elif event["type"] == "barge_in" and "up" not in outage:
            server.start()
            outage["up"] = event["t_ms"]

    got: list[dict[str, Any]] = []
    ready, has_call = asyncio.Event(), asyncio.Event()
    worker = asyncio.create_task(_worker(server.url, got, ready, has_call))
    await ready.wait()
    timeline = Timeline()
    timeline.add_listener(on_event)
    async with _GatewayBus(server.url, has_call) as gateway_bus:
        # The worker has claimed the call before Redis goes away, as it would have on a real
        # line (see _GatewayBus); paced (10x) from there.
        await replay(rec.source(name), bot_script=_script(name, False), bus=gateway_bus,
                     timeline=timeline, realtime=True, speed=10.0)
        assert await gateway_bus.flush(timeout=20)
    await asyncio.wait_for(worker, 30)

    events = timeline.events
    assert outage["down"] < outage["up"]
    clear = next(e for e in events if e["type"] == "clear_sent")
    assert outage["down"] < clear["t_ms"] <= outage["up"]  # the bot was stopped during the outage
    assert events[-1]["type"] == "call_ended"

    kinds = [e["type"] for e in got]
    assert kinds[0] == "call_started" and kinds[-1] == "call_ended"
    interrupt = next(e for e in got if e["type"] == "interrupt")
    assert interrupt["utterance_id"] == "turn-0" and interrupt["heard_ms"] > 0
    eids = [e["eid"] for e in got]
    assert len(eids) == len(set(eids))  # exactly once
    t = [e["t_ms"] for e in got]
    assert t == sorted(t)  # in order
    published = [e for e in events if e["type"] in ("speech_started", "speech_stopped", "dtmf")]
    assert sum(k in ("speech_started", "speech_stopped", "dtmf") for k in kinds) == len(published)
