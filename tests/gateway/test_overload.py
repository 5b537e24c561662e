"""Overload shedding: the lag guard's arithmetic; a gateway that runs late itself refusing new
calls (busy TwiML, /readyz 503, the gauge), and one caller's late network not making it refuse
anyone, over real loopback sockets."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from bus import EmbeddedBus
from gateway import twilio_protocol as tp
from gateway.overload import LagGuard, OverloadGuard
from gateway.server import GATEWAY_KEY, GatewayApp, GatewaySettings, build_app
from vad import VadEngine


def _feed(guard: LagGuard, count: int, lag_s: float) -> None:
    for _ in range(count):
        guard.observe(lag_s)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_guard_trips_on_the_window_p99_and_lifts_once_it_rolls_out() -> None:
    clock = Clock()
    guard = LagGuard(50.0, window_s=5, min_frames=100, clock=clock)
    _feed(guard, 990, 0.010)
    _feed(guard, 10, 0.200)  # exactly 1 % late: the p99 is not over the limit yet
    assert guard.frames == 1000 and not guard.overloaded
    _feed(guard, 10, 0.051)  # 2 % late
    assert guard.overloaded
    assert guard.late_share == pytest.approx(20 / 1010)
    for _ in range(4):  # the late second is still in the window: 20 late of 1410
        clock.t += 1
        _feed(guard, 100, 0.001)
    assert guard.overloaded
    clock.t += 1  # ... and now it is not
    assert guard.late_share == 0.0
    assert not guard.overloaded
    assert guard.frames == 400


def test_guard_needs_enough_frames_to_judge() -> None:
    clock = Clock()
    guard = LagGuard(50.0, min_frames=500, clock=clock)
    _feed(guard, 499, 1.0)  # every frame a second late, but too few to call it an overload
    assert not guard.overloaded
    guard.observe(1.0)
    assert guard.overloaded


def test_the_ring_clears_the_seconds_it_skips() -> None:
    """Seconds with no frame at all still leave the window on time."""
    clock = Clock()
    guard = LagGuard(20.0, window_s=5, min_frames=10, clock=clock)
    _feed(guard, 30, 0.5)  # second 0: all late
    clock.t += 2  # second 2 (1 skipped)
    _feed(guard, 30, 0.001)
    assert guard.frames == 60 and guard.overloaded
    clock.t += 2  # second 4: second 0 still in (0..4)
    assert guard.frames == 60
    clock.t += 1  # second 5: second 0 gone
    assert guard.frames == 30 and not guard.overloaded
    clock.t += 6  # window_s + 1 on: all gone
    assert guard.frames == 0


def test_the_quantile_is_exact() -> None:
    """p90 over the limit means more than 10 % late: exactly 10 % is not (1 - 0.9 in floats
    is just under 0.1)."""
    clock = Clock()
    guard = LagGuard(50.0, quantile=0.9, min_frames=10, clock=clock)
    for k in range(10):
        guard.observe(0.2 if k == 0 else 0.001)
    assert not guard.overloaded
    guard.observe(0.2)
    assert guard.overloaded


def test_an_idle_gateway_forgets_its_past() -> None:
    clock = Clock()
    guard = LagGuard(20.0, window_s=3, min_frames=10, clock=clock)
    _feed(guard, 50, 0.5)
    assert guard.overloaded
    clock.t += 3601
    assert guard.frames == 0 and not guard.overloaded


def test_guard_off_and_bad_settings() -> None:
    guard = LagGuard(None, min_frames=1)
    _feed(guard, 10, 10.0)
    assert not guard.overloaded and guard.frames == 0
    with pytest.raises(ValueError, match="limit_ms"):
        LagGuard(0.0)
    with pytest.raises(ValueError, match="window_s"):
        LagGuard(50.0, window_s=0)
    with pytest.raises(ValueError, match="quantile"):
        LagGuard(50.0, quantile=1.0)


def test_overload_is_either_guard_and_a_new_limit_starts_afresh() -> None:
    clock = Clock()
    guard = OverloadGuard(50.0, window_s=1, min_frames=10, probe_interval_s=0.1, clock=clock)
    assert guard.loop.limit_ms == 50.0 and not guard.overloaded
    for _ in range(5):  # 5 probes = half the window's 10: enough to judge
        guard.observe_loop(0.080)
    assert guard.overloaded and guard.reason == "event loop"
    guard.set_limit(100.0)
    assert not guard.overloaded and guard.limit_ms == 100.0
    for _ in range(10):
        guard.observe_frame(0.150)
    assert guard.overloaded and guard.reason == "frame processing"
    guard.set_limit(None)
    guard.observe_frame(10.0)
    assert not guard.overloaded and guard.reason is None
    with pytest.raises(ValueError, match="probe_interval_s"):
        OverloadGuard(50.0, probe_interval_s=0)


FORM = {"CallSid": "CA" + "7" * 32, "AccountSid": "AC" + "2" * 32, "From": "+14155550100",
        "To": "+14155550199", "CallStatus": "ringing"}
SID = "MZ" + "7" * 32


@pytest.fixture
async def server() -> AsyncIterator[tuple[TestServer, GatewayApp]]:
    app = build_app(GatewaySettings(validate_signatures=False), bus=EmbeddedBus(),
                    vad=VadEngine(runtime="onnx"))
    gw = app[GATEWAY_KEY]
    assert gw.overload.limit_ms == 50.0  # the settings' limit
    # Set before the app starts, so that its loop probe feeds this guard: a 1 s window on a
    # clock that stands still (every sample stays in it however slow the test runs), judging
    # from 20 frames (the default, 500, takes ~3 calls) or 25 loop probes.
    gw.overload = OverloadGuard(50.0, window_s=1, min_frames=20, probe_interval_s=0.02,
                                clock=Clock())
    async with TestServer(app) as srv:
        yield srv, gw


async def _until(condition: Any, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def _status(http: aiohttp.ClientSession, srv: TestServer, k: int = 7
                  ) -> tuple[int, dict[str, Any], str]:
    ready = await http.get(srv.make_url("/readyz"))
    webhook = await http.post(srv.make_url("/twilio/voice"),
                              data={**FORM, "CallSid": f"CA{k:032d}"})
    return ready.status, await ready.json(), await webhook.text()


async def _start(ws: aiohttp.ClientWebSocketResponse) -> None:
    await ws.send_str(tp.build_connected())
    await ws.send_str(tp.build_start(
        sequence_number=1, stream_sid=SID, account_sid=FORM["AccountSid"],
        call_sid=FORM["CallSid"], tracks=["inbound"], custom_parameters={}))


def _media(k: int) -> str:
    return tp.build_media(sequence_number=k + 2, stream_sid=SID, chunk=k + 1,
                          timestamp_ms=20 * k, payload=b"\xff" * 160)


async def test_one_callers_network_bursts_do_not_refuse_other_calls(server: Any) -> None:
    """A caller whose frames arrive in 200 ms bursts (a TCP retransmission stall: ten 20 ms
    frames at once, then nothing): most of its frames are 20-180 ms behind their media time,
    which is the caller's network, not the gateway. The gateway is not overloaded and takes
    the next calls (the frame-lag guard of before refused 17 of 17)."""
    srv, gw = server
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(srv.make_url("/twilio/media")) as ws:
            await _start(ws)
            for burst in range(8):
                for k in range(10):
                    await ws.send_str(_media(10 * burst + k))
                await asyncio.sleep(0.2)  # the network stall: the next burst comes 200 ms on
            await _until(lambda: gw.overload.frames.frames >= 80)  # every frame handled
            metrics = await (await http.get(srv.make_url("/metrics"))).text()
            # The media-clock lag saw the bursts (the old guard's input, 1 in 10 on time) ...
            late = _histogram_share_over(metrics, "callgate_frame_lag_seconds", 0.05)
            assert late > 0.5, late
            # ... and the gateway's own lateness did not: new calls are welcome.
            for k in range(3):
                status, body, twiml = await _status(http, srv, k)
                assert status == 200 and body["overloaded"] is False, body
                assert "<Connect>" in twiml
            assert not gw.overload.overloaded


def _histogram_share_over(metrics: str, name: str, bound: float) -> float:
    """Share of a histogram's observations above ``bound`` (one of its bucket bounds)."""
    count = le = None
    for line in metrics.splitlines():
        if line.startswith(f"{name}_count "):
            count = float(line.split()[-1])
        if line.startswith(f'{name}_bucket{{le="{bound!r}"}}'):
            le = float(line.split()[-1])
    assert count and le is not None, metrics
    return (count - le) / count


async def test_a_gateway_that_runs_late_refuses_new_calls(server: Any) -> None:
    """The gateway's own loop is busy (CPU work in 100 ms slices, as a gateway with more calls
    than its core holds runs): its timers fire late, the guard trips, new calls get the busy
    answer and readiness fails; the call in progress goes on."""
    srv, gw = server
    stop = asyncio.Event()

    async def hog() -> None:
        while not stop.is_set():
            end = time.perf_counter() + 0.100
            while time.perf_counter() < end:
                pass
            await asyncio.sleep(0)

    async with aiohttp.ClientSession() as http:
        status, body, twiml = await _status(http, srv)
        assert status == 200 and body["overloaded"] is False
        assert "<Connect>" in twiml and "busy" not in twiml
        async with http.ws_connect(srv.make_url("/twilio/media")) as ws:
            await _start(ws)
            busy = asyncio.create_task(hog())
            try:
                await _until(lambda: gw.overload.overloaded)
                for k in range(5):
                    await ws.send_str(_media(k))
                await _until(lambda: gw.overload.frames.frames >= 5)
            finally:
                stop.set()
                await busy
            status, body, twiml = await _status(http, srv, 8)
            assert status == 503 and body["overloaded"] is True and body["reason"] == "overloaded"
            assert body["late"] == "event loop"
            assert "all our lines are busy" in twiml and "<Connect>" not in twiml
            metrics = await (await http.get(srv.make_url("/metrics"))).text()
            assert "callgate_overloaded 1.0" in metrics
            assert 'callgate_calls_refused_total{reason="overloaded"} 1.0' in metrics
            assert _histogram_share_over(metrics, "callgate_event_loop_lag_seconds", 0.05) > 0
            assert not ws.closed  # the call in progress is never cut
            assert len(gw.calls) == 1


def test_the_config_sets_the_guard(tmp_path: Any) -> None:
    """The shipped config's 50 ms, another value, and null (the guard off) reach the gateway."""
    import yaml

    from config import DEFAULT_CONFIG, ConfigHolder
    from gateway.server import settings_from_config

    shipped = yaml.safe_load(Path(DEFAULT_CONFIG).read_text())
    for value, limit in (("keep", 50.0), (80, 80.0), (None, None)):
        cfg = dict(shipped, server=dict(shipped["server"]))
        if value != "keep":
            cfg["server"]["overload_lag_ms"] = value
        path = tmp_path / "agents.yaml"
        path.write_text(yaml.safe_dump(cfg))
        settings = settings_from_config(ConfigHolder(path))
        assert settings.overload_lag_ms == limit
        assert GatewayApp(settings, bus=EmbeddedBus(), vad=VadEngine()).overload.limit_ms == limit
