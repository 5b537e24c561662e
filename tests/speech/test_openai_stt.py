"""OpenAITranscriber against a local server speaking the transcription endpoint over real HTTP."""

from __future__ import annotations

import asyncio
import io
import wave
from collections.abc import AsyncIterator

import openai
import pytest

from speech import (
    ConfigurationError,
    OpenAITranscriber,
    StreamClosedError,
    StreamFinishedError,
    StreamState,
    Transcriber,
    TranscriptionError,
    TranscriptionStream,
)

from ..openai_audio_server import AudioServer
from . import GUARD_S, caller_speech

CLIP = "barge_in_command_goforward"


@pytest.fixture
async def transcriber(server: AudioServer) -> AsyncIterator[OpenAITranscriber]:
    async with OpenAITranscriber(
        model="whisper-1", api_key="sk-test", base_url=server.base_url, max_retries=0
    ) as transcriber:
        yield transcriber


def read_wav(data: bytes) -> tuple[int, int, int, bytes]:
    with wave.open(io.BytesIO(data)) as wav:
        return wav.getnchannels(), wav.getsampwidth(), wav.getframerate(), wav.readframes(-1)


async def test_uploads_the_utterance_as_a_wav(
    server: AudioServer, transcriber: OpenAITranscriber
) -> None:
    assert isinstance(transcriber, Transcriber)
    pcm, truth = caller_speech(CLIP)
    reply = server.transcribe(truth)
    stream = transcriber.open_stream()
    assert isinstance(stream, TranscriptionStream)
    for start in range(0, len(pcm), 333):  # odd chunks split samples
        stream.feed(pcm[start : start + 333])

    transcript = await stream.finish()
    stream.close()

    assert transcript.text == "go forward ten meters"
    assert transcript.final and transcript.confidence is None
    request = reply.request
    assert request is not None
    assert request.path == "/v1/audio/transcriptions"
    assert request.headers["Authorization"] == "Bearer sk-test"
    assert request.fields["model"] == "whisper-1"
    assert request.fields["response_format"] == "json"
    assert "language" not in request.fields and "prompt" not in request.fields
    upload = request.files["file"]
    assert upload.filename == "utterance.wav"
    assert upload.content_type == "audio/wav"
    # Duration in = duration out: every sample, as 8 kHz mono 16-bit.
    assert read_wav(upload.data) == (1, 2, 8000, pcm)


async def test_language_prompt_and_rate_are_sent(server: AudioServer) -> None:
    reply = server.transcribe("hello")
    async with OpenAITranscriber(
        model="gpt-4o-mini-transcribe",
        api_key="sk-test",
        base_url=server.base_url,
        language="en",
        prompt="Callers book appointments.",
    ) as transcriber:
        stream = transcriber.open_stream(sample_rate=16000)
        stream.feed(b"\x01\x00" * 16000)
        assert (await stream.finish()).text == "hello"
    assert reply.request is not None
    assert reply.request.fields["model"] == "gpt-4o-mini-transcribe"
    assert reply.request.fields["language"] == "en"
    assert reply.request.fields["prompt"] == "Callers book appointments."
    channels, width, rate, frames = read_wav(reply.request.files["file"].data)
    assert (channels, width, rate, len(frames)) == (1, 2, 16000, 32000)


async def test_silence_sends_nothing(server: AudioServer, transcriber: OpenAITranscriber) -> None:
    stream = transcriber.open_stream()
    assert await stream.partial() is None
    stream.feed(b"\x00")  # half a sample is not audio
    assert (await stream.finish()).text == ""
    assert server.requests == []


async def test_a_server_error_becomes_a_transcription_error(
    server: AudioServer, transcriber: OpenAITranscriber
) -> None:
    server.fail_transcription(503, "overloaded")
    stream = transcriber.open_stream()
    stream.feed(b"\x00\x00" * 800)
    with pytest.raises(TranscriptionError) as caught:
        await stream.finish()
    assert isinstance(caught.value.__cause__, openai.APIStatusError)
    assert caught.value.__cause__.status_code == 503


async def test_close_cancels_the_request(
    server: AudioServer, transcriber: OpenAITranscriber
) -> None:
    gate = asyncio.Event()  # never set: the server holds the answer
    reply = server.transcribe("never sent", wait=gate)
    stream = transcriber.open_stream()
    stream.feed(b"\x00\x00" * 800)
    finishing = asyncio.ensure_future(stream.finish())
    await asyncio.wait_for(reply.started.wait(), GUARD_S)

    stream.close()

    with pytest.raises(StreamClosedError):
        await asyncio.wait_for(finishing, GUARD_S)
    await asyncio.wait_for(reply.disconnected.wait(), GUARD_S)


async def test_lifecycle_is_checked(server: AudioServer, transcriber: OpenAITranscriber) -> None:
    server.transcribe("yes")
    stream = transcriber.open_stream()
    stream.feed(b"\x00\x00" * 80)
    await stream.finish()
    assert stream.state is StreamState.FINISHED
    with pytest.raises(StreamFinishedError):
        stream.feed(b"\x00\x00")
    with pytest.raises(StreamFinishedError):
        await stream.finish()
    stream.close()
    with pytest.raises(StreamClosedError):
        await stream.partial()


def test_no_api_key_is_a_configuration_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(ConfigurationError, match="API key"):
        OpenAITranscriber()


_FIRST_REQUEST_IMPORTS = r"""
import asyncio, json, sys
from tests.openai_audio_server import AudioServer
from speech import OpenAITranscriber

async def main():
    async with AudioServer() as server:
        server.transcribe("hello")
        t = OpenAITranscriber(model="whisper-1", api_key="sk-test", base_url=server.base_url)
        if sys.argv[1] == "warm":
            await t.warm_up(1)
        before = set(sys.modules)
        text = (await t.transcribe_wav(bytes.fromhex(sys.argv[2]))).text
        await t.aclose()
    print(json.dumps({"text": text, "imported": sorted(set(sys.modules) - before)}))

asyncio.run(main())
"""


@pytest.mark.parametrize("warm", [False, True])
def test_warm_up_leaves_nothing_to_import_on_the_first_request(warm: bool) -> None:
    """A fresh interpreter (imports are per process): without warm_up the first request imports
    the SDK's audio resources and anyio's backend, ~45 ms with the event loop stalled; after it,
    next to nothing (the loop's resolver executor at most)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from audio import encode_wav_pcm16

    wav = encode_wav_pcm16(b"\x00\x01" * 800, sample_rate=8000)
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", _FIRST_REQUEST_IMPORTS, "warm" if warm else "cold",
         wav.hex()],
        cwd=root, capture_output=True, text=True, timeout=120, check=True,
    )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["text"] == "hello"
    heavy = [m for m in result["imported"] if m.startswith(("openai.", "anyio."))]
    if warm:
        assert heavy == [], heavy
    else:
        assert len(heavy) > 10  # what warm_up is for
