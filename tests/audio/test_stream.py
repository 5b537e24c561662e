"""Stream converters: exact durations, chunking invariance, band limiting, byte order."""

from __future__ import annotations

import io
import wave

import numpy as np
import pytest

from audio import AudioError, resample_pcm16, ulaw_to_pcm16
from audio import PcmInput, UlawEncoder, encode_wav_pcm16


def tone(frequency: float, seconds: float, rate: int, level: float = 0.3) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    return np.rint(level * 32767 * np.sin(2 * np.pi * frequency * t)).astype("<i2").tobytes()


def encode(data: bytes, rate: int, chunk: int, **options: str) -> bytes:
    encoder = UlawEncoder(rate, **options)  # type: ignore[arg-type]
    out = b"".join(encoder.push(data[i : i + chunk]) for i in range(0, len(data), chunk))
    return out + encoder.flush()


def level_db(ulaw: bytes) -> float:
    pcm = np.frombuffer(ulaw_to_pcm16(ulaw), dtype=np.int16).astype(np.float64)
    return float(20 * np.log10(np.sqrt(np.mean(pcm**2)) / 32768 + 1e-12))


@pytest.mark.parametrize("rate", [8000, 16000, 22050, 24000, 44100])
def test_duration_in_is_duration_out(rate: int) -> None:
    ulaw = encode(tone(440, 2.0, rate), rate, 4096)
    assert abs(len(ulaw) - 16000) <= 1


@pytest.mark.parametrize("chunk", [1, 7, 640, 999])
def test_output_does_not_depend_on_chunking(chunk: int) -> None:
    audio = tone(440, 0.5, 22050)
    assert encode(audio, 22050, chunk) == encode(audio, 22050, len(audio))


def test_speech_band_passes_and_aliases_are_stopped() -> None:
    passed = encode(tone(1000, 1.0, 24000), 24000, 4800)
    assert level_db(passed) == pytest.approx(20 * np.log10(0.3 / np.sqrt(2)), abs=0.5)
    # A 6 kHz tone would fold to 2 kHz at 8 kHz; ratecv alone lets most of it through.
    aliased, _ = resample_pcm16(tone(6000, 1.0, 24000), from_rate=24000, to_rate=8000)
    assert np.sqrt(np.mean(np.frombuffer(aliased, dtype=np.int16).astype(float) ** 2)) > 1000
    assert level_db(encode(tone(6000, 1.0, 24000), 24000, 4800)) < -45


def test_big_endian_input() -> None:
    audio = tone(440, 0.5, 24000)
    swapped = np.frombuffer(audio, dtype="<i2").astype(">i2").tobytes()
    assert encode(swapped, 24000, 333, byteorder="big") == encode(audio, 24000, 333)


def test_pcm_input_upsamples_exactly_whatever_the_chunks() -> None:
    audio = tone(440, 0.5, 8000)
    whole = PcmInput(from_rate=8000, to_rate=16000).push(audio)
    pieces = PcmInput(from_rate=8000, to_rate=16000)
    chunked = b"".join(pieces.push(audio[i : i + 333]) for i in range(0, len(audio), 333))
    assert chunked == whole
    assert abs(len(whole) - 2 * len(audio)) <= 4


def test_wav_header_is_standard() -> None:
    pcm = tone(440, 0.25, 8000)
    with wave.open(io.BytesIO(encode_wav_pcm16(pcm, sample_rate=8000))) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, 8000)
        assert wav.readframes(-1) == pcm


@pytest.mark.parametrize("rate", [0, -8000, True])
def test_bad_rates_are_refused(rate: int) -> None:
    with pytest.raises(AudioError):
        UlawEncoder(rate)
    with pytest.raises(AudioError):
        PcmInput(from_rate=rate, to_rate=16000)
