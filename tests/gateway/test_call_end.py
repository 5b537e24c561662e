"""A call that ends waits for its speech-to-text work to stop.

The caller's turns are transcribed in tasks of their own (the final answer of each turn, the
partials of a streaming recogniser). When the call ends, Twilio's ``stop`` or the socket gone,
those tasks are cancelled *and awaited*: once ``CallSession.end`` returns, no transcription of
this call is still running, every stream it opened is closed (a recogniser process or a
provider's WebSocket let go), and nothing of the call can reach the bus after its
``call_ended``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from bus import EmbeddedBus
from gateway.call import CallSession
from gateway.replay import recording_messages
from tests import recordings_index as rec
from vad import VadEngine

NAME = "turn_gap_then_barge_in"  # the caller's first turn ends ~5 s before the call does


class _Stream:
    """A transcription stream whose final answer never comes (a provider that hangs)."""

    def __init__(self, opened: list[_Stream], finishing: asyncio.Event) -> None:
        self.closed = False
        self.finishing = False
        self.cancelled = False
        self._finishing = finishing
        opened.append(self)

    def feed(self, pcm: bytes) -> None:
        pass

    async def finish(self) -> Any:
        self.finishing = True
        self._finishing.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise

    def close(self) -> None:
        self.closed = True


class _Transcriber:
    def __init__(self) -> None:
        self.opened: list[_Stream] = []
        self.finishing = asyncio.Event()

    def open_stream(self, *, sample_rate: int) -> _Stream:
        return _Stream(self.opened, self.finishing)


async def test_ending_a_call_awaits_its_transcriptions() -> None:
    transcriber = _Transcriber()
    sent: list[str] = []

    async def send(text: str) -> None:
        sent.append(text)

    async with VadEngine(runtime="onnx", max_wait_ms=2.0) as engine, EmbeddedBus() as bus:
        session = CallSession(send=send, bus=bus, vad=engine,
                              transcriber_for=lambda info: transcriber)
        for line in recording_messages(rec.source(NAME)):
            if json.loads(line).get("event") != "stop":  # the call ends below, not by Twilio
                await session.handle_text(line)
        # The VAD's verdicts come back from the engine's batches: wait for the turn's final.
        await asyncio.wait_for(transcriber.finishing.wait(), 60)
        hanging = [s for s in transcriber.opened if not s.closed]
        assert hanging, "a turn's transcription is in flight"

        await session.end("stop")

        # Cancelled and finished by the time end() returns, every stream closed.
        assert all(s.closed for s in hanging)
        assert all(s.cancelled for s in hanging if s.finishing)
        assert not session._stt_tasks


async def test_a_hangup_whose_end_is_cancelled_by_the_socket_handler_still_ends_the_call() -> None:
    """The bot's hang-up ends the call from the downlink task; the socket handler, seeing the
    call ended at its next frame, cancels that task. Nothing that must happen (``call_ended``
    on the bus, the call closed, ``wait_ended``) may wait behind the speech-to-text tasks.
    (Found in review: with the wait first, call_ended was lost whenever STT was in flight.)"""
    from bus import protocol as bp

    transcriber = _Transcriber()

    async def send(text: str) -> None:
        pass

    async with VadEngine(runtime="onnx", max_wait_ms=2.0) as engine, EmbeddedBus() as bus:
        session = CallSession(send=send, bus=bus, vad=engine,
                              transcriber_for=lambda info: transcriber)
        events: list[str] = []
        session.timeline.add_listener(lambda e: events.append(e["type"]))
        downlink: asyncio.Task[None] | None = None
        for line in recording_messages(rec.source(NAME)):
            if json.loads(line).get("event") != "stop":
                await session.handle_text(line)
            if session.info is not None and downlink is None:
                downlink = asyncio.create_task(session.run_downlink())
        assert downlink is not None and session.info is not None
        await asyncio.wait_for(transcriber.finishing.wait(), 60)
        assert session._stt_tasks, "a turn's transcription is in flight"

        await bus.send(session.info.call_sid, bp.encode(bp.Hangup()))

        async def ended() -> None:
            while not session.ended:
                await asyncio.sleep(0)

        await asyncio.wait_for(ended(), 30)
        # What the server's _end_stream does once the handler sees the call ended:
        await session.end("socket_closed")
        downlink.cancel()
        await asyncio.gather(downlink, return_exceptions=True)
        assert "call_ended" in events
        await asyncio.wait_for(session.wait_ended(), 5)
