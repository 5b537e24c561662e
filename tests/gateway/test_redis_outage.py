"""Redis restarted mid-call: the call plays on, the barge-in during the outage still stops the
bot at once, and every uplink event reaches the worker, in order, once Redis is back."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from bus import RedisBus
from gateway.replay import replay
from gateway.timeline import Timeline
from tests import recordings_index as rec
from tests.bus_agents import recording, serve
from tests.gateway.conftest import _script
from tests.redis_server import RedisServer, make_redis_server  # noqa: F401 (fixture)

pytestmark = pytest.mark.redis


async def _worker(url: str, got: list[dict[str, Any]], ready: asyncio.Event) -> None:
    async with RedisBus(url) as bus:
        ready.set()
        await serve(bus, "w1", recording(got))


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
    ready = asyncio.Event()
    worker = asyncio.create_task(_worker(server.url, got, ready))
    await ready.wait()
    timeline = Timeline()
    timeline.add_listener(on_event)
    async with RedisBus(server.url) as gateway_bus:
        # Paced (10x): the worker must have claimed the call before Redis goes away, as it
        # would have on a real line.
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
