"""The gateway's side of ``bus.protocol``: what it publishes decodes to the records the worker
expects, and a downlink event that does not decode is logged with the field at fault and skipped
while the call plays on."""

from __future__ import annotations

import asyncio
import itertools
import logging

import pytest

from bus import EmbeddedBus, EmbeddedHub
from bus import protocol as bp
from gateway import call as call_module
from gateway import twilio_protocol as tp
from gateway.call import CallSession
from gateway.logs import RateLimitedLog
from tests.bus.conftest import eventually
from vad import VadEngine


async def test_undecodable_downlink_events_are_logged_and_skipped(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every skip logged (a clock that moves a whole interval per call), not one per 10 s.
    ticks = itertools.count(0, 20)
    monkeypatch.setattr(call_module, "SKIPPED_DOWNLINK", RateLimitedLog(
        call_module.log, "skipped downlink events", interval_s=10.0, clock=lambda: next(ticks)))
    caplog.set_level(logging.WARNING, logger=call_module.log.name)
    sent: list[str] = []

    async def send(text: str) -> None:
        sent.append(text)

    hub = EmbeddedHub()
    async with VadEngine(runtime="onnx") as engine, EmbeddedBus(hub=hub) as gw, \
            EmbeddedBus(hub=hub) as wk:
        session = CallSession(send=send, bus=gw, vad=engine)
        await session.handle_text(tp.build_connected())
        await session.handle_text(tp.build_start(stream_sid="MZ1", account_sid="AC1",
                                                 call_sid="CA1"))
        uplink = wk.uplink("CA1", "w1")
        started = bp.decode((await asyncio.wait_for(anext(uplink), 10)).event)
        await uplink.aclose()  # type: ignore[attr-defined]
        assert isinstance(started, bp.CallStarted) and started.t_ms == 0.0
        downlink = asyncio.create_task(session.run_downlink())
        await wk.send("CA1", {"type": "audio", "utterance_id": "u1", "payload": "%%%"})
        await wk.send("CA1", {**bp.encode(bp.UtteranceStart(utterance_id="u0")), "v": "2.0"})
        await wk.send("CA1", {"type": "teleport"})
        await wk.send("CA1", bp.encode(bp.UtteranceStart(utterance_id="u1", node="main")))
        await wk.send("CA1", bp.encode(bp.Audio(utterance_id="u1", payload=b"\x7f" * 800,
                                                text="Hi.", text_start=0, text_end=3)))
        await eventually(lambda: (u := session.playback.get("u1")) is not None
                         and len(u.audio) == 800, 10, "the valid utterance queued")
        u1 = session.playback.get("u1")
        assert u1 is not None and u1.node == "main" and u1.text == "Hi."
        assert session.playback.get("u0") is None
        await session.end("stop")
        await gw.close_call("CA1")
        await asyncio.wait_for(downlink, 10)
    skipped = [m for m in caplog.messages if m.startswith("skipped downlink event")]
    assert len(skipped) == 3, caplog.messages
    assert "audio.payload is not valid base64" in skipped[0]
    assert "version 2.0" in skipped[1] and "speaks 1.2" in skipped[1]
    assert "unknown event type 'teleport'" in skipped[2]

