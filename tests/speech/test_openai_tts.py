"""OpenAISynthesizer against a local server streaming the speech endpoint over real HTTP."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator
from contextlib import aclosing

import numpy as np
import openai
import pytest

from audio import ulaw_to_pcm16
from speech import ConfigurationError, OpenAISynthesizer, SynthesisError, Synthesizer

from ..openai_audio_server import AudioServer, Mark, Wait
from . import GUARD_S


@pytest.fixture
async def synthesizer(server: AudioServer) -> AsyncIterator[OpenAISynthesizer]:
    async with OpenAISynthesizer(
        model="gpt-4o-mini-tts",
        voice="alloy",
        api_key="sk-test",
        base_url=server.base_url,
        max_retries=0,
    ) as synthesizer:
        yield synthesizer


def tone(frequency: float, seconds: float, rate: int, level: float = 0.3) -> bytes:
    """A sine as little-endian PCM16."""
    t = np.arange(int(seconds * rate)) / rate
    samples = np.rint(level * 32767 * np.sin(2 * np.pi * frequency * t)).astype("<i2")
    return samples.tobytes()


def pcm_wav(pcm_le: bytes, rate: int) -> bytes:
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    return (
        b"RIFF" + struct.pack("<I", 36 + len(pcm_le)) + b"WAVE"
        + b"fmt " + struct.pack("<I", 16) + fmt
        + b"data" + struct.pack("<I", len(pcm_le)) + pcm_le
    )  # fmt: skip


def peak_frequency(ulaw: bytes) -> float:
    pcm = np.frombuffer(ulaw_to_pcm16(ulaw), dtype=np.int16).astype(np.float64)
    spectrum = np.abs(np.fft.rfft(pcm * np.hanning(len(pcm))))
    return float(np.fft.rfftfreq(len(pcm), 1 / 8000)[np.argmax(spectrum)])


def rms(ulaw: bytes) -> float:
    return float(
        np.sqrt(np.mean(np.frombuffer(ulaw_to_pcm16(ulaw), dtype=np.int16).astype(float) ** 2))
    )


async def collect(synthesizer: OpenAISynthesizer, text: str) -> list[bytes]:
    return [piece async for piece in synthesizer.synthesize(text)]


async def test_pcm_is_streamed_and_converted_to_8k_mulaw(
    server: AudioServer, synthesizer: OpenAISynthesizer
) -> None:
    assert isinstance(synthesizer, Synthesizer)
    audio = tone(440, 1.0, 24000)
    # Odd chunk sizes split samples across network chunks.
    reply = server.speak(*(audio[i : i + 999] for i in range(0, len(audio), 999)))

    ulaw = b"".join(await collect(synthesizer, "Hello there."))

    assert abs(len(ulaw) - 8000) <= 1  # one second in, one second out
    assert peak_frequency(ulaw) == pytest.approx(440, abs=5)
    assert rms(ulaw) == pytest.approx(0.3 * 32767 / np.sqrt(2), rel=0.05)
    assert reply.request is not None
    assert reply.request.path == "/v1/audio/speech"
    assert reply.request.headers["Authorization"] == "Bearer sk-test"
    assert reply.request.body == {
        "model": "gpt-4o-mini-tts",
        "voice": "alloy",
        "input": "Hello there.",
        "response_format": "pcm",
    }


async def test_audio_is_yielded_as_it_arrives(
    server: AudioServer, synthesizer: OpenAISynthesizer
) -> None:
    audio = tone(300, 0.5, 24000)
    gate = asyncio.Event()
    reply = server.speak(audio[:4800], Wait(gate), audio[4800:])

    async with aclosing(synthesizer.synthesize("Streaming.")) as pieces:
        # The server holds the rest until the test has the first piece: a synthesizer that
        # waited for the whole body would hang here, and the guard would fail the test.
        first = await asyncio.wait_for(anext(pieces), GUARD_S)
        assert not reply.finished.is_set()
        gate.set()
        rest = [piece async for piece in pieces]

    assert 700 < len(first) < 800  # 0.1 s, less the low-pass filter's look-ahead
    assert abs(len(first) + sum(map(len, rest)) - 4000) <= 1


async def test_leaving_early_closes_the_response(
    server: AudioServer, synthesizer: OpenAISynthesizer
) -> None:
    never = asyncio.Event()
    sent = asyncio.Event()
    reply = server.speak(tone(300, 0.2, 24000), Mark(sent), Wait(never))

    async with aclosing(synthesizer.synthesize("Interrupt me.")) as pieces:
        async for _ in pieces:
            break

    await asyncio.wait_for(reply.disconnected.wait(), GUARD_S)
    assert sent.is_set() and not reply.finished.is_set()


@pytest.mark.parametrize("content_type", ["audio/wav", "application/octet-stream"])
async def test_a_wav_answer_is_decoded(server: AudioServer, content_type: str) -> None:
    # Recognised by its Content-Type, or by its RIFF/WAVE header when the label is generic.
    audio = tone(1000, 0.5, 16000)
    reply = server.speak(pcm_wav(audio, 16000), content_type=content_type)
    async with OpenAISynthesizer(
        model="tts-1", voice="verse", api_key="sk-test", base_url=server.base_url,
        response_format="wav", speed=1.25, instructions="Warm and calm.",
    ) as synthesizer:  # fmt: skip
        ulaw = b"".join(await collect(synthesizer, "A WAV, please."))

    assert len(ulaw) == 4000
    assert peak_frequency(ulaw) == pytest.approx(1000, abs=5)
    assert reply.request is not None
    assert reply.request.body["response_format"] == "wav"
    assert reply.request.body["speed"] == 1.25
    assert reply.request.body["instructions"] == "Warm and calm."


async def test_a_broken_wav_is_a_synthesis_error(
    server: AudioServer, synthesizer: OpenAISynthesizer
) -> None:
    server.speak(b"RIFF\x00\x00\x00\x00WAVEjunk", content_type="audio/wav")
    with pytest.raises(SynthesisError, match="not usable audio"):
        await collect(synthesizer, "Broken.")


async def test_a_server_error_becomes_a_synthesis_error(
    server: AudioServer, synthesizer: OpenAISynthesizer
) -> None:
    server.fail_speech(400, "voice not found")
    with pytest.raises(SynthesisError) as caught:
        await collect(synthesizer, "Hello.")
    assert isinstance(caught.value.__cause__, openai.BadRequestError)


async def test_blank_text_sends_nothing(
    server: AudioServer, synthesizer: OpenAISynthesizer
) -> None:
    assert await collect(synthesizer, " \n") == []
    assert server.requests == []


@pytest.mark.parametrize(
    "options",
    [{"response_format": "mp3"}, {"speed": 5.0}, {"pcm_sample_rate": 0}],
)
def test_bad_settings_are_refused(options: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError):
        OpenAISynthesizer(api_key="sk-test", **options)  # type: ignore[arg-type]


def test_no_api_key_is_a_configuration_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(ConfigurationError, match="API key"):
        OpenAISynthesizer()
