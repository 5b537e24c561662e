"""A Twilio socket that stops taking data stalls its own call only.

Each call's frames are handled by its own task and every send awaits only that call's socket, so
a call whose ``send`` never returns (a dead peer, a full TCP window) holds nothing the others
need: the shared VAD engine does not wait for windows that call will never push (it batches
what is ready after ``max_wait_ms``), and the other calls decide exactly as they would alone.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from bus import EmbeddedBus
from bus import protocol as bp
from gateway.call import CallSession
from gateway.replay import recording_messages, replay
from tests import recordings_index as rec
from tests.gateway.conftest import _script
from vad import VadEngine


async def _stuck_call(engine: VadEngine, sending: asyncio.Event) -> None:
    """A call whose Twilio socket never accepts a byte: its first outbound send hangs."""
    never = asyncio.Event()

    async def send(text: str) -> None:
        sending.set()
        await never.wait()

    async with EmbeddedBus() as bus:
        session = CallSession(send=send, bus=bus, vad=engine)
        lines = iter(recording_messages(rec.source("barge_in_timit")))
        for line in lines:  # connected, start and a second of audio
            await session.handle_text(line)
            if json.loads(line).get("event") == "media" and session.now_ms >= 1000:
                break
        await session.handle_downlink(bp.UtteranceStart(utterance_id="u1", node="n"))
        await session.handle_downlink(bp.Audio(utterance_id="u1", payload=b"\x10" * 16000))
        for line in lines:  # never gets here: the pump's first send hangs
            await session.handle_text(line)


async def test_a_stuck_socket_does_not_stall_other_calls(
    replayed: dict[str, list[dict[str, Any]]],
) -> None:
    async with VadEngine(runtime="onnx", max_wait_ms=2.0) as engine:
        sending = asyncio.Event()
        stuck = asyncio.create_task(_stuck_call(engine, sending))
        await asyncio.wait_for(sending.wait(), 30)
        names = ["barge_in_timit", "echo_only_long_delay", "backchannel_uhhuh_mmhmm"]
        others = await asyncio.wait_for(asyncio.gather(*[
            replay(rec.source(n), bot_script=_script(n, False), vad=engine) for n in names
        ]), 120)
        assert not stuck.done()  # still hanging in its send the whole time
        # ... with its VAD streams open (the raw one and, AEC3 in front, the echo-cancelled one)
        assert engine.stats.open_streams == 2
        stuck.cancel()
        await asyncio.gather(stuck, return_exceptions=True)
    for name, (timeline, _) in zip(names, others, strict=True):
        solo = [e for e in replayed[name] if e["type"] != "call_started"]
        together = [e for e in timeline.events if e["type"] != "call_started"]
        assert together == solo, name
    assert any(e["type"] == "clear_sent" for e in others[0][0].events)
