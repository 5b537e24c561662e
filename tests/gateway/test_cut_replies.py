"""An answer the worker cut before any of it played (a barge-in reached the agent first,
nodes/_worker.py) arrives as ``utterance_start`` then ``utterance_end {interrupted: true}``
with no audio: the call never shows it as said, and tells the worker it was not heard."""

from __future__ import annotations

import json

from bus import EmbeddedBus
from bus import protocol as bp
from gateway.call import CallSession
from gateway.replay import recording_messages
from gateway.timeline import Timeline
from tests import recordings_index as rec
from vad import VadEngine


async def test_an_answer_cut_in_the_worker_is_not_shown_as_said() -> None:
    async def send(text: str) -> None:
        pass

    async with VadEngine(runtime="onnx", max_wait_ms=2.0) as engine, EmbeddedBus() as bus:
        session = CallSession(send=send, bus=bus, vad=engine, timeline=Timeline())
        for line in recording_messages(rec.source("barge_in_timit")):
            await session.handle_text(line)
            if json.loads(line).get("event") == "start":
                break
        assert session.info is not None
        await session.handle_downlink(bp.UtteranceStart(utterance_id="utt-1", node="n",
                                                        text="You pressed 2"))
        await session.handle_downlink(bp.UtteranceEnd(utterance_id="utt-1", interrupted=True))
        types = [e["type"] for e in session.timeline.events]
        assert "bot_utterance_started" not in types and "bot_utterance_finished" not in types
        cut = [e for e in session.timeline.events if e["type"] == "bot_utterance_interrupted"]
        assert len(cut) == 1 and cut[0]["before_audio"] is True and cut[0]["heard_ms"] == 0.0
        assert cut[0]["text"] == "You pressed 2" and session.playback.current is None
        await session.end("stop")
