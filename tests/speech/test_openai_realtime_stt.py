"""OpenAITranscriber(transport="realtime") against a local server speaking the Realtime
transcription protocol over a real WebSocket (tests/openai_audio_server.py), fed a real
recording at the pace of the phone line."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from audio import pcm16_to_ulaw
from speech import (
    ConfigurationError,
    OpenAIRealtimeStream,
    OpenAITranscriber,
    StreamClosedError,
    StreamState,
    Transcript,
    TranscriptionError,
    TranscriptionStream,
    make_transcriber,
)

from ..openai_audio_server import AudioServer
from . import GUARD_S, caller_speech

CLIP = "barge_in_command_goforward"
FRAME = 320  # bytes of PCM16 in a 20 ms Twilio frame


@pytest.fixture
async def transcriber(server: AudioServer) -> AsyncIterator[OpenAITranscriber]:
    async with OpenAITranscriber(transport="realtime", api_key="sk-test",
                                 base_url=server.base_url, language="en",
                                 max_retries=0) as transcriber:
        yield transcriber


async def feed_paced(stream: TranscriptionStream, pcm: bytes, upto: int | None = None) -> None:
    """Feed 20 ms frames, yielding to the loop after each (as frames arrive on a call)."""
    for start in range(0, len(pcm) if upto is None else upto, FRAME):
        stream.feed(pcm[start : start + FRAME])
        await asyncio.sleep(0)


async def collect(stream: OpenAIRealtimeStream, into: list[Transcript]) -> None:
    async for partial in stream.partials():
        into.append(partial)


async def test_partials_arrive_during_the_turn_and_the_final_at_the_commit(
    server: AudioServer, transcriber: OpenAITranscriber
) -> None:
    pcm, truth = caller_speech(CLIP)
    reply = server.realtime(truth, delta_every_ms=300)
    stream = transcriber.open_stream()
    assert isinstance(stream, OpenAIRealtimeStream) and isinstance(stream, TranscriptionStream)
    partials: list[Transcript] = []
    listener = asyncio.create_task(collect(stream, partials))
    await feed_paced(stream, pcm)
    # Wait until the server has every byte; the partials it sent meanwhile are events here.
    async with asyncio.timeout(GUARD_S):
        while reply.audio_ms < len(pcm) / 16 or len(partials) < len(reply.deltas):
            await asyncio.sleep(0.005)
    during = [p.text for p in partials]
    assert not reply.committed.is_set()
    assert len(during) >= 2 and all(not p.final for p in partials)
    assert truth.startswith(during[-1]) and during[0] != during[-1]  # each the text so far

    transcript = await asyncio.wait_for(stream.finish(), GUARD_S)
    await asyncio.wait_for(listener, GUARD_S)  # the partials end with the final
    stream.close()
    assert transcript == Transcript(truth, final=True)
    assert stream.degraded is None and stream.state is StreamState.CLOSED
    # The session as OpenAI's transcription intent wants it: mu-law 8 kHz, our model, no VAD.
    assert reply.query == {"intent": "transcription"}
    assert reply.headers["Authorization"] == "Bearer sk-test"
    assert reply.session == {"type": "transcription", "audio": {"input": {
        "format": {"type": "audio/pcmu"},
        "transcription": {"model": "gpt-live-transcribe", "language": "en"},
        "turn_detection": None}}}
    assert bytes(reply.audio) == pcm16_to_ulaw(pcm)  # every sample, once, in order


async def test_the_final_comes_within_100_ms_of_the_commit_on_a_fast_server(
    server: AudioServer, transcriber: OpenAITranscriber
) -> None:
    pcm, truth = caller_speech(CLIP)
    reply = server.realtime(truth, delta_every_ms=200, final_ms=20)
    stream = transcriber.open_stream()
    await feed_paced(stream, pcm)
    loop = asyncio.get_running_loop()
    started = loop.time()
    transcript = await asyncio.wait_for(stream.finish(), GUARD_S)
    returned = loop.time()
    stream.close()
    assert transcript.text == truth
    assert reply.committed_at is not None and reply.completed_at is not None
    # What the client adds to the server's own 20 ms, measured, not asserted on wall time:
    # the order is what must hold (commit sent after finish() began, answer after completed).
    assert started <= reply.committed_at <= reply.completed_at <= returned
    assert reply.completed_at - reply.committed_at >= 0.02


@pytest.mark.parametrize("failure", ["error", "close"])
async def test_a_failed_session_falls_back_to_the_upload(
    server: AudioServer, transcriber: OpenAITranscriber, failure: str
) -> None:
    pcm, truth = caller_speech(CLIP)
    reply = server.realtime(truth, delta_every_ms=200, fail=failure, fail_after_ms=400)
    upload = server.transcribe(truth)
    stream = transcriber.open_stream()
    partials: list[Transcript] = []
    listener = asyncio.create_task(collect(stream, partials))
    await feed_paced(stream, pcm)
    with pytest.raises(TranscriptionError):  # the listener hears of the failure
        await asyncio.wait_for(listener, GUARD_S)
    transcript = await asyncio.wait_for(stream.finish(), GUARD_S)
    stream.close()
    assert transcript.text == truth  # nothing lost: the whole turn, uploaded
    assert stream.degraded is not None
    expected = "scripted session failure" if failure == "error" else "session failed"
    assert expected in str(stream.degraded)
    assert upload.request is not None
    assert len(upload.request.files["file"].data) == 44 + len(pcm)
    assert not reply.committed.is_set()


async def test_a_transcription_failed_event_falls_back_to_the_upload(
    server: AudioServer, transcriber: OpenAITranscriber
) -> None:
    pcm, truth = caller_speech(CLIP)
    server.realtime(truth, fail="failed")
    server.transcribe("uploaded instead")
    stream = transcriber.open_stream()
    await feed_paced(stream, pcm)
    transcript = await asyncio.wait_for(stream.finish(), GUARD_S)
    stream.close()
    assert transcript.text == "uploaded instead"
    assert "scripted transcription failure" in str(stream.degraded)


async def test_no_final_in_time_falls_back_to_the_upload(server: AudioServer) -> None:
    pcm, truth = caller_speech(CLIP)
    reply = server.realtime(truth, final_ms=5_000)
    server.transcribe("uploaded instead")
    async with OpenAITranscriber(transport="realtime", api_key="sk-test",
                                 base_url=server.base_url, final_timeout=0.2,
                                 max_retries=0) as transcriber:
        stream = transcriber.open_stream()
        await feed_paced(stream, pcm)
        transcript = await asyncio.wait_for(stream.finish(), GUARD_S)
        stream.close()
    assert transcript.text == "uploaded instead"
    assert reply.committed.is_set() and not reply.completed.is_set()
    assert "no final transcript 0.2 s after the commit" in str(stream.degraded)


async def test_a_refused_session_falls_back_and_says_so() -> None:
    async with AudioServer() as server:
        server.transcribe("still heard")
        base_url = server.base_url
        async with OpenAITranscriber(transport="realtime", api_key="sk-test",
                                     base_url=base_url, max_retries=0) as transcriber:
            # No realtime session scripted: the server answers with an error event.
            stream = transcriber.open_stream()
            await feed_paced(stream, b"\x10\x00" * 8000)
            transcript = await asyncio.wait_for(stream.finish(), GUARD_S)
            stream.close()
    assert transcript.text == "still heard"
    assert "no scripted realtime session left" in str(stream.degraded)


async def test_a_server_that_is_gone_gives_a_clear_error() -> None:
    async with AudioServer() as server:
        base_url = server.base_url
    # Nothing listens there now: the session fails to connect, and so does the upload.
    async with OpenAITranscriber(transport="realtime", api_key="sk-test", base_url=base_url,
                                 max_retries=0, timeout=2.0) as transcriber:
        stream = transcriber.open_stream()
        await feed_paced(stream, b"\x10\x00" * 8000)
        with pytest.raises(TranscriptionError, match="transcription request failed"):
            await asyncio.wait_for(stream.finish(), GUARD_S)
        stream.close()
    assert "realtime transcription session failed" in str(stream.degraded)


async def test_close_while_waiting_raises_stream_closed(
    server: AudioServer, transcriber: OpenAITranscriber
) -> None:
    pcm, truth = caller_speech(CLIP)
    reply = server.realtime(truth, final_ms=5_000)
    stream = transcriber.open_stream()
    await feed_paced(stream, pcm)
    waiting = asyncio.create_task(stream.finish())
    await asyncio.wait_for(reply.committed.wait(), GUARD_S)
    stream.close()
    with pytest.raises(StreamClosedError):
        await asyncio.wait_for(waiting, GUARD_S)
    await asyncio.wait_for(reply.disconnected.wait(), GUARD_S)  # the session is ended


async def test_silence_commits_nothing(
    server: AudioServer, transcriber: OpenAITranscriber
) -> None:
    reply = server.realtime("unused")
    stream = transcriber.open_stream()
    assert await stream.partial() is None
    assert (await stream.finish()).text == ""
    stream.close()
    assert not reply.committed.is_set()


def test_the_factory_takes_the_transport() -> None:
    transcriber = make_transcriber("openai", transport="realtime", api_key="sk-test",
                                   model="gpt-realtime-whisper")
    assert transcriber.session_config()["audio"]["input"]["transcription"] == {
        "model": "gpt-realtime-whisper"}
    with pytest.raises(ConfigurationError, match="unknown transport 'carrier-pigeon'"):
        make_transcriber("openai", transport="carrier-pigeon", api_key="sk-test")
