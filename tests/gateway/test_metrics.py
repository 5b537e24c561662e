"""GET /metrics during a call: the barge-in is counted and onset-to-clear is observed."""

from __future__ import annotations

import asyncio
import base64

from collections.abc import Callable

import aiohttp
from aiohttp.test_utils import TestServer
from prometheus_client import generate_latest

from bus import CallInfo, EmbeddedBus, Event
from gateway.client import play_call
from gateway.server import GATEWAY_KEY, GatewaySettings, build_app
from tests import recordings_index as rec
from tests.bus_agents import say, serve
from vad import VadEngine


async def _worker(ready: asyncio.Event, interrupted: asyncio.Event,
                  on_interrupt: Callable[[], None] = lambda: None) -> None:
    async def react(sid: str, event: Event) -> None:
        kind = event["type"]
        if kind == "call_started":
            audio = base64.b64encode(b"\xfe" * 8 * 7000).decode()  # 7 s, near silence
            await say(bus, sid, {"payload": audio}, utterance_id="u", node="n")
        elif kind == "interrupt":
            on_interrupt()
            interrupted.set()

    async with EmbeddedBus() as bus:
        ready.set()
        await serve(bus, "w", react)


def _value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in metrics")


async def test_metrics_count_the_barge_in() -> None:
    app = build_app(GatewaySettings(validate_signatures=False), bus=EmbeddedBus(),
                    vad=VadEngine())
    registry = app[GATEWAY_KEY].metrics.registry
    snapshots: list[str] = []
    async with TestServer(app) as srv, aiohttp.ClientSession() as http:
        ready, interrupted = asyncio.Event(), asyncio.Event()
        # The figures as the worker handles the interrupt: the call is live then, however
        # fast the rest of the recording is played (a GET after it raced the call's end).
        worker = asyncio.create_task(_worker(
            ready, interrupted, lambda: snapshots.append(generate_latest(registry).decode())))
        await ready.wait()
        call = asyncio.create_task(play_call(rec.source("barge_in_timit"),
                                             str(srv.make_url("/twilio/media")), speed=8.0))
        await asyncio.wait_for(interrupted.wait(), 30)
        served = await (await http.get(srv.make_url("/metrics"))).text()
        await asyncio.wait_for(call, 30)
        await asyncio.wait_for(worker, 10)
    (during,) = snapshots
    assert _value(served, "callgate_calls_total") == 1  # GET /metrics serves the same registry
    assert _value(during, "callgate_active_calls") == 1
    assert _value(during, 'callgate_barge_ins_total{reason="speech"}') == 1
    assert _value(during, "callgate_clears_total") >= 1
    assert _value(during, "callgate_onset_to_clear_seconds_count") >= 1
    total = _value(during, "callgate_onset_to_clear_seconds_sum")
    assert 0 < total < 0.5  # the policy's own onset estimate: ~2-3 windows before the clear
    assert _value(during, "callgate_frames_total") > 100
    assert _value(during, "callgate_calls_total") == 1
    # The bus's figures are there too (this gateway's bus claims no calls: a worker does).
    assert _value(during, "callgate_bus_calls_claimed_total") == 0
    assert _value(during, "callgate_bus_reconnects_total") == 0


async def test_worker_metrics_show_its_claims() -> None:
    """``callgate worker --metrics-port``: the worker's bus figures at GET /metrics."""
    import socket

    from gateway.launch import _serve_worker_metrics

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with EmbeddedBus() as gw, EmbeddedBus() as worker:
        runner = await _serve_worker_metrics(worker, "127.0.0.1", port)
        try:
            await gw.open_call(CallInfo("CA1"))
            claims = worker.claim_calls("w1")
            assert (await asyncio.wait_for(anext(claims), 10)).call_sid == "CA1"
            async with aiohttp.ClientSession() as http:
                text = await (await http.get(f"http://127.0.0.1:{port}/metrics")).text()
                health = await (await http.get(f"http://127.0.0.1:{port}/healthz")).json()
            await claims.aclose()  # type: ignore[attr-defined]
        finally:
            await runner.cleanup()
    assert _value(text, "callgate_bus_calls_claimed_total") == 1
    assert _value(text, "callgate_bus_orphans_claimed_total") == 0
    assert _value(text, "callgate_bus_outages_total") == 0
    assert health == {"status": "ok", "bus": worker.bus_id}


def test_frame_histogram_reads_like_prometheus_clients() -> None:
    """The lock-free per-frame histogram renders exactly what prometheus_client's would."""
    import random

    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from gateway.metrics import FrameHistogram

    bounds = (0.001, 0.005, 0.02, 0.1)
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    fast = FrameHistogram("lag_seconds", "doc", bounds)
    ours.register(fast)
    ref = Histogram("lag_seconds", "doc", buckets=bounds, registry=theirs)
    rng = random.Random(5)
    for v in [*bounds, 0.0, 5.0, *(rng.expovariate(50) for _ in range(500))]:
        fast.observe(v)
        ref.observe(v)

    def samples(reg: CollectorRegistry) -> list[str]:
        return sorted(line for line in generate_latest(reg).decode().splitlines()
                      if line.startswith("lag_seconds_") and "_created" not in line)

    assert samples(ours) == samples(theirs)
    assert any('le="+Inf"} 506.0' in line for line in samples(ours))
