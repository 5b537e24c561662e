"""The ops streams and the console's call issuance on a real gateway (aiohttp on loopback,
the embedded bus, a minimal worker that streams its text with its audio as nodes/ does)."""

from __future__ import annotations

import asyncio
import re
import base64
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from bus import EmbeddedBus, Event
from gateway.client import play_call
from gateway.ops import OpsSettings
from gateway.server import GATEWAY_KEY, GatewayApp, GatewaySettings, build_app
from tests import recordings_index as rec
from tests.bus_agents import say, serve
from vad import VadEngine

OPS = "ops-token-for-tests"
BEARER = {"Authorization": f"Bearer {OPS}"}
SENTENCES = ["Hello there. ", "Your balance is ten dollars."]


@pytest.fixture
async def server() -> AsyncIterator[tuple[TestServer, GatewayApp]]:
    settings = GatewaySettings(
        public_url="https://gw.example.test", auth_token="twilio-auth-token-0123456789",
        validate_signatures=True, agent_for_number=lambda to: "support",
        ops=OpsSettings(enabled=True, token=OPS, agents=lambda: ["support", "sales"]),
    )
    app = build_app(settings, bus=EmbeddedBus(), vad=VadEngine(runtime="onnx"))
    async with TestServer(app) as srv:
        yield srv, app[GATEWAY_KEY]


async def _talking_worker(ready: asyncio.Event, ms_per_char: int = 20) -> list[str]:
    """Says SENTENCES as one utterance when the call starts, text spans with the audio."""
    seen: list[str] = []
    spans: list[dict[str, Any]] = []
    at = 0
    for s in SENTENCES:
        audio = b"\xff" * (8 * ms_per_char * len(s))
        spans.append({"payload": base64.b64encode(audio).decode(),
                      "text": s, "text_start": at, "text_end": at + len(s)})
        at += len(s)

    async def react(sid: str, event: Event) -> None:
        seen.append(event["type"])
        if event["type"] == "call_started":
            await say(bus, sid, *spans, interruptible=False)

    async with EmbeddedBus() as bus:
        ready.set()
        await serve(bus, "w1", react)
    return seen


async def test_ops_and_console_need_the_ops_token(server: Any) -> None:
    srv, _ = server
    async with aiohttp.ClientSession() as http:
        for method, path in [("GET", "/ops/calls"), ("GET", "/console"),
                             ("GET", "/console/agents"), ("POST", "/console/call")]:
            async with http.request(method, srv.make_url(path)) as r:
                assert r.status == 401, path
            async with http.request(method, srv.make_url(path),
                                    headers={"Authorization": "Bearer wrong"}) as r:
                assert r.status == 401, path
        async with http.get(srv.make_url("/ops/calls"), headers=BEARER) as r:
            assert r.status == 200 and await r.json() == {"calls": [], "ended": []}
        async with http.get(srv.make_url("/console"), params={"token": OPS}) as r:
            assert r.status == 200 and "<html" in await r.text()
        with pytest.raises(aiohttp.WSServerHandshakeError) as exc:
            await http.ws_connect(srv.make_url("/ops/calls/CA123/events"))
        assert exc.value.status == 401
        async with http.post(srv.make_url("/console/call"), json={"agent": "nobody"},
                             headers=BEARER) as r:
            assert r.status == 400 and "unknown agent 'nobody'" in await r.text()


async def test_a_console_ticket_admits_only_its_own_call(server: Any) -> None:
    srv, gw = server
    async with aiohttp.ClientSession() as http:
        async with http.post(srv.make_url("/console/call"), json={"agent": "sales"},
                             headers=BEARER) as r:
            placed = await r.json()
        assert placed["agent"] == "sales" and placed["call_sid"].startswith("CA")
        # No X-Twilio-Signature (a browser cannot send one): the ticket lets the socket in ...
        ws = await http.ws_connect(srv.make_url(placed["media_path"]))
        await ws.close()
        # ... but not for another call, nor with a made-up ticket.
        for query in [f"console={placed['token']}&call_sid=CA{'9' * 32}",
                      f"console=x.y&call_sid={placed['call_sid']}"]:
            with pytest.raises(aiohttp.WSServerHandshakeError) as exc:
                await http.ws_connect(srv.make_url(f"/twilio/media?{query}"))
            assert exc.value.status == 403
    assert gw.calls == {}


async def test_the_ops_stream_tells_the_call_as_it_happens(server: Any) -> None:
    srv, gw = server
    ready = asyncio.Event()
    worker = asyncio.create_task(_talking_worker(ready))
    await ready.wait()
    async with aiohttp.ClientSession() as http:
        async with http.post(srv.make_url("/console/call"), json={}, headers=BEARER) as r:
            placed = await r.json()
        live = await http.ws_connect(srv.make_url("/ops/live"), headers=BEARER)
        first = await live.receive_json()
        assert first["kind"] == "calls" and first["calls"] == []
        base = str(srv.make_url("")).rstrip("/").replace("http", "ws", 1)
        seen: list[dict[str, Any]] = []
        report = await play_call(
            rec.source("dtmf_pin_after_prompt"), base + placed["media_path"],
            token=placed["token"], call_sid=placed["call_sid"], speed=20.0,
            events_url=base + placed["events_path"], ops_headers=BEARER, on_event=seen.append)
        listed = await live.receive_json()
        assert [c["call_sid"] for c in listed["calls"]] == [placed["call_sid"]]
        await live.close()
    assert await asyncio.wait_for(worker, 10)
    events = report.events
    assert events == seen
    types = [e.get("type") for e in events if e["kind"] == "event"]
    assert types[0] == "call_started" and types[-1] == "call_ended"
    assert events[0]["agent"] == "support"
    started = next(e for e in events if e.get("type") == "bot_utterance_started")
    assert started["node"] == "greeter" and started["interruptible"] is False
    assert started["text"] == SENTENCES[0]  # the text of the audio that had come
    finished = next(e for e in events if e.get("type") == "bot_utterance_finished")
    assert finished["text"] == "".join(SENTENCES)
    assert finished["heard_text"] == "".join(SENTENCES).rstrip()
    assert [e["digit"] for e in events if e.get("type") == "dtmf"]
    assert report.ended_reason == "stop" and not report.closed_by_gateway
    assert gw.ops.feeds == {} and gw.ops.listing()["ended"][0]["call_sid"] == placed["call_sid"]


async def test_samples_flow_only_while_the_call_is_watched(server: Any) -> None:
    srv, gw = server
    async with aiohttp.ClientSession() as http:
        async with http.post(srv.make_url("/console/call"), json={}, headers=BEARER) as r:
            placed = await r.json()
        base = str(srv.make_url("")).rstrip("/").replace("http", "ws", 1)
        watcher = await http.ws_connect(base + placed["events_path"], headers=BEARER)
        samples: list[dict[str, Any]] = []

        async def collect() -> None:
            async for msg in watcher:
                obj = msg.json()
                if obj["kind"] == "sample":
                    samples.append(obj)

        task = asyncio.create_task(collect())
        await play_call(rec.source("barge_in_timit"), base + placed["media_path"],
                        token=placed["token"], call_sid=placed["call_sid"], realtime=False)
        await asyncio.wait_for(task, 10)  # the stream ends with the call
    inbound = [s for s in samples if s["dir"] == "in"]
    # One per 32 ms window of the 7.68 s recording, with Silero and the gate's reading.
    assert len(inbound) == 7680 // 32
    assert max(s["prob"] for s in inbound) > 0.9 and min(s["prob"] for s in inbound) < 0.1
    loud = [s for s in inbound if s["level_db"] > -40]
    assert loud and all(s["noise_db"] < s["level_db"] for s in loud)
    assert {"idle", "speaking"} <= {s["state"] for s in inbound}


def test_replay_html_report(tmp_path: Any) -> None:
    """`callgate replay ... --html`: one static page with both waveforms, the probability,
    the decisions and the events."""
    import subprocess
    import sys
    from html.parser import HTMLParser

    from tests.console.conftest import ROOT

    page = tmp_path / "report.html"
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "replay", str(rec.source("barge_in_timit")),
         "--bot-script", str(rec.RECORDINGS / "barge_in_timit.json"), "--html", str(page)],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr

    class Parts(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.tags: list[tuple[str, dict[str, str | None]]] = []
            self.text: list[str] = []

        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            self.tags.append((tag, dict(attrs)))

        def handle_data(self, data: str) -> None:
            self.text.append(data)

    parts = Parts()
    parts.feed(page.read_text())
    tags = [t for t, _ in parts.tags]
    assert tags.count("svg") == 1 and "script" not in tags  # static: no script, no network
    waves = [a for t, a in parts.tags if t == "path"]
    assert [a["fill"] for a in waves] == ["#1f8a4c", "#1b5fae"]  # caller, then bot
    assert all(len(str(a["d"]).split("L")) > 1000 for a in waves)  # a point per column
    probability = [a for t, a in parts.tags if t == "polyline"]
    assert len(str(probability[0]["points"]).split()) == 7680 // 32  # one per window
    text = " ".join(parts.text)
    assert re.search(r"pause \d+ ms after onset", text) and "commit" in text
    rows = [a.get("class") for t, a in parts.tags if t == "tr"]
    assert {"clear_sent", "barge_in", "latency"} <= set(rows)


async def test_without_the_console_nothing_is_served() -> None:
    app = build_app(GatewaySettings(validate_signatures=False), bus=EmbeddedBus(),
                    vad=VadEngine(runtime="onnx"))
    async with TestServer(app) as srv, aiohttp.ClientSession() as http:
        for path in ("/console", "/console/agents", "/ops/calls", "/console/static/console.js"):
            async with http.get(srv.make_url(path)) as r:
                assert r.status == 404, path
        async with http.post(srv.make_url("/console/call")) as r:
            assert r.status in (404, 405)


async def test_a_stream_for_a_call_that_never_starts_ends(
        server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import gateway.ops

    monkeypatch.setattr(gateway.ops, "PENDING_TTL_S", 0.2)
    srv, gw = server
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(srv.make_url(f"/ops/calls/CA{'7' * 32}/events"),
                                   headers=BEARER)
        assert f"CA{'7' * 32}" in gw.ops.feeds  # waiting for the call
        msg = await asyncio.wait_for(ws.receive(), 10)
        assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
        await ws.close()
    assert gw.ops.feeds == {}
