"""Tests for audio._codec: G.711, float conversion, resampling, framing and WAV files."""

from __future__ import annotations

import struct
import sys
import wave
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import audio
from audio import (
    AudioError,
    AudioFormatError,
    FrameAlignmentError,
    chunk_audio,
    decode_wav_ulaw,
    duration_ms,
    encode_wav_ulaw,
    float32_to_pcm16,
    pcm16_to_float32,
    pcm16_to_ulaw,
    read_wav_ulaw,
    resample_pcm16,
    ulaw_to_float32,
    ulaw_to_pcm16,
    write_wav_ulaw,
)

from ..common import SHARED_RECORDINGS as RECORDINGS
from ..common import assert_exports_complete
from ..common import needs_shared_recordings as needs_recordings

ALL_CODES = bytes(range(256))
ALL_INT16 = np.arange(-32768, 32768, dtype=np.int16).tobytes()


def _sine_pcm16(freq: float, rate: int, seconds: float, amp: float = 0.5) -> bytes:
    t = np.arange(int(rate * seconds)) / rate
    return float32_to_pcm16(amp * np.sin(2 * np.pi * freq * t))


def _pcm_wav(path: Path, pcm: bytes, *, rate: int, channels: int, width: int = 2) -> None:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(pcm)


def test_exports_are_complete() -> None:
    assert_exports_complete(audio)


# --- mu-law <-> PCM16 ------------------------------------------------------------------------


def test_ulaw_decode_has_one_sample_per_byte_and_known_values() -> None:
    pcm = np.frombuffer(ulaw_to_pcm16(ALL_CODES), dtype=np.int16)
    assert pcm.shape == (256,)
    # G.711: 0xFF and 0x7F are +0 and -0, 0x00 and 0x80 the extremes.
    assert pcm[0xFF] == 0 and pcm[0x7F] == 0
    assert pcm[0x00] == -32124 and pcm[0x80] == 32124


def test_ulaw_round_trip_is_exact_except_negative_zero() -> None:
    back = pcm16_to_ulaw(ulaw_to_pcm16(ALL_CODES))
    expected = bytearray(ALL_CODES)
    expected[0x7F] = 0xFF  # -0 encodes back as +0
    assert back == bytes(expected)


def test_pcm16_to_ulaw_rejects_odd_length() -> None:
    with pytest.raises(FrameAlignmentError):
        pcm16_to_ulaw(b"\x00\x01\x02")


# --- float32 ------------------------------------------------------------------------------------


def test_ulaw_table_equals_audioop_path_for_all_256_codes() -> None:
    fast = ulaw_to_float32(ALL_CODES)
    slow = pcm16_to_float32(ulaw_to_pcm16(ALL_CODES))
    assert fast.dtype == np.float32
    assert np.array_equal(fast, slow)
    # And code by code, so a table built in the wrong order could not pass.
    for code in range(256):
        one = bytes([code])
        assert ulaw_to_float32(one)[0] == pcm16_to_float32(ulaw_to_pcm16(one))[0]


@given(st.binary(max_size=2000))
@settings(max_examples=200, database=None)
def test_ulaw_fast_path_matches_reference_on_any_frame(data: bytes) -> None:
    assert np.array_equal(ulaw_to_float32(data), pcm16_to_float32(ulaw_to_pcm16(data)))


def test_pcm16_float32_round_trip_is_exact_for_every_int16() -> None:
    f = pcm16_to_float32(ALL_INT16)
    assert f.dtype == np.float32
    assert f.min() == -1.0 and f.max() < 1.0
    assert float32_to_pcm16(f) == ALL_INT16


def test_float32_to_pcm16_clips_rounds_and_silences_nan() -> None:
    out = np.frombuffer(
        float32_to_pcm16(np.array([2.0, -2.0, 1.0, -1.0, np.nan, np.inf, -np.inf, 0.5 / 32768])),
        dtype=np.int16,
    )
    assert out.tolist() == [32767, -32768, 32767, -32768, 0, 32767, -32768, 0]


def test_float32_to_pcm16_accepts_lists_and_empty() -> None:
    assert float32_to_pcm16([]) == b""
    assert np.frombuffer(float32_to_pcm16([0.25]), dtype=np.int16).tolist() == [8192]


def test_pcm16_to_float32_rejects_odd_length() -> None:
    with pytest.raises(FrameAlignmentError):
        pcm16_to_float32(b"\x00")


# --- resampling ---------------------------------------------------------------------------------


@pytest.mark.parametrize("from_rate", [16000, 22050, 24000])
def test_resample_to_8k_has_expected_length_and_keeps_the_tone(from_rate: int) -> None:
    pcm = _sine_pcm16(1000.0, from_rate, 1.0)
    out, _ = resample_pcm16(pcm, from_rate=from_rate, to_rate=8000)
    assert abs(len(out) // 2 - 8000) <= 2
    spectrum = np.abs(np.fft.rfft(pcm16_to_float32(out)))
    peak_hz = np.argmax(spectrum) * 8000 / (len(out) // 2)
    assert abs(peak_hz - 1000.0) < 5.0


def test_resample_streaming_equals_one_shot() -> None:
    pcm = _sine_pcm16(440.0, 24000, 0.5)
    whole, _ = resample_pcm16(pcm, from_rate=24000, to_rate=8000)
    parts, state = [], None
    step = 24000 * 2 * 20 // 1000 + 2  # 20 ms plus an odd sample, so chunks don't divide evenly
    for i in range(0, len(pcm), step):
        out, state = resample_pcm16(pcm[i : i + step], from_rate=24000, to_rate=8000, state=state)
        parts.append(out)
    assert b"".join(parts) == whole


def test_resample_same_rate_is_identity() -> None:
    pcm = _sine_pcm16(300.0, 8000, 0.1)
    out, state = resample_pcm16(pcm, from_rate=8000, to_rate=8000)
    assert out == pcm and state is None


@pytest.mark.parametrize("rates", [(0, 8000), (8000, -1), (True, 8000)])
def test_resample_rejects_bad_rates(rates: tuple[int, int]) -> None:
    with pytest.raises(AudioError):
        resample_pcm16(b"\x00\x00", from_rate=rates[0], to_rate=rates[1])


def test_resample_rejects_odd_length() -> None:
    with pytest.raises(FrameAlignmentError):
        resample_pcm16(b"\x00", from_rate=16000, to_rate=8000)


# --- framing ------------------------------------------------------------------------------------


def test_chunk_audio_cuts_20ms_frames_with_short_tail() -> None:
    chunks = chunk_audio(b"\x01" * 8001)
    assert len(chunks) == 51
    assert all(len(c) == 160 for c in chunks[:-1]) and chunks[-1] == b"\x01"
    assert chunk_audio(b"") == []
    assert [len(c) for c in chunk_audio(b"\xff" * 100, chunk_ms=5)] == [40, 40, 20]


@given(st.binary(max_size=5000), st.integers(1, 200))
@settings(max_examples=200, database=None)
def test_chunk_audio_loses_nothing(data: bytes, chunk_ms: int) -> None:
    chunks = chunk_audio(data, chunk_ms=chunk_ms)
    assert b"".join(chunks) == data
    assert all(len(c) == 8 * chunk_ms for c in chunks[:-1])


@pytest.mark.parametrize("kwargs", [{"chunk_ms": 0}, {"rate": 0}, {"chunk_ms": 1, "rate": 500}])
def test_chunk_audio_rejects_empty_chunks(kwargs: dict[str, int]) -> None:
    with pytest.raises(AudioError):
        chunk_audio(b"\xff" * 10, **kwargs)


def test_duration_ms() -> None:
    assert duration_ms(160) == 20.0
    assert duration_ms(0) == 0.0
    assert duration_ms(16000, rate=16000) == 1000.0


# --- WAV ----------------------------------------------------------------------------------------


def test_encode_wav_ulaw_matches_corpus_layout() -> None:
    ulaw = bytes(range(256)) * 2 + b"\x7f"  # odd length exercises the pad byte
    wav = encode_wav_ulaw(ulaw)
    n = len(ulaw)
    assert wav[:4] == b"RIFF" and wav[8:16] == b"WAVEfmt "
    assert struct.unpack_from("<I", wav, 4)[0] == len(wav) - 8
    assert struct.unpack_from("<IHHIIHHH", wav, 16) == (18, 7, 1, 8000, 8000, 1, 8, 0)
    assert wav[38:42] == b"fact" and struct.unpack_from("<II", wav, 42) == (4, n)
    assert wav[50:54] == b"data" and struct.unpack_from("<I", wav, 54)[0] == n
    assert wav[58 : 58 + n] == ulaw and len(wav) == 58 + n + 1
    assert decode_wav_ulaw(wav) == ulaw


def test_write_then_read_round_trip(tmp_path: Path) -> None:
    ulaw = bytes(range(256)) * 10
    path = tmp_path / "x.wav"
    write_wav_ulaw(path, ulaw)
    assert read_wav_ulaw(path) == ulaw
    assert read_wav_ulaw(str(path)) == ulaw


def test_reads_pcm16_mono_8k_as_plain_encoding(tmp_path: Path) -> None:
    pcm = _sine_pcm16(500.0, 8000, 0.25)
    _pcm_wav(tmp_path / "m.wav", pcm, rate=8000, channels=1)
    assert read_wav_ulaw(tmp_path / "m.wav") == pcm16_to_ulaw(pcm)


def test_reads_pcm16_stereo_16k_downmixed_and_resampled(tmp_path: Path) -> None:
    mono = np.frombuffer(_sine_pcm16(500.0, 16000, 0.5), dtype=np.int16)
    stereo = np.stack([mono, mono], axis=1).tobytes()
    _pcm_wav(tmp_path / "s.wav", stereo, rate=16000, channels=2)
    _pcm_wav(tmp_path / "m.wav", mono.tobytes(), rate=16000, channels=1)
    got = read_wav_ulaw(tmp_path / "s.wav")
    assert got == read_wav_ulaw(tmp_path / "m.wav")  # identical channels: downmix is exact
    assert abs(len(got) - 4000) <= 2


def test_stereo_downmix_averages_channels(tmp_path: Path) -> None:
    left = np.full(800, 8000, dtype=np.int16)
    right = np.full(800, -4000, dtype=np.int16)
    _pcm_wav(tmp_path / "s.wav", np.stack([left, right], axis=1).tobytes(), rate=8000, channels=2)
    expected = pcm16_to_ulaw(np.full(800, 2000, dtype=np.int16).tobytes())
    assert read_wav_ulaw(tmp_path / "s.wav") == expected


def _chunk(chunk_id: bytes, body: bytes, *, size: int | None = None) -> bytes:
    size = len(body) if size is None else size
    return chunk_id + struct.pack("<I", size) + body + (b"\x00" if len(body) & 1 else b"")


def _riff(*chunks: bytes, size: int | None = None) -> bytes:
    body = b"WAVE" + b"".join(chunks)
    return b"RIFF" + struct.pack("<I", len(body) if size is None else size) + body


def _le(pcm: bytes) -> bytes:
    return pcm if sys.byteorder == "little" else np.frombuffer(pcm, np.int16).byteswap().tobytes()


def test_reads_streaming_wav_with_oversized_data_chunk() -> None:
    # TTS services stream WAV with a placeholder size (0xFFFFFFFF) in the data chunk header.
    pcm = _sine_pcm16(300.0, 24000, 0.1)
    fmt = struct.pack("<HHIIHH", 1, 1, 24000, 48000, 2, 16)
    wav = _riff(_chunk(b"fmt ", fmt), _chunk(b"data", _le(pcm), size=0xFFFFFFFF), size=0xFFFFFFFF)
    expected = pcm16_to_ulaw(resample_pcm16(pcm, from_rate=24000, to_rate=8000)[0])
    assert decode_wav_ulaw(wav) == expected


def test_skips_unknown_chunks_and_odd_padding() -> None:
    ulaw = bytes(range(200))
    fmt = struct.pack("<HHIIHHH", 7, 1, 8000, 8000, 1, 8, 0)
    wav = _riff(_chunk(b"LIST", b"abc"), _chunk(b"fmt ", fmt), _chunk(b"data", ulaw))
    assert decode_wav_ulaw(wav) == ulaw


def test_reads_alaw_and_extensible() -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import audioop

    pcm = _sine_pcm16(700.0, 8000, 0.1)
    alaw = audioop.lin2alaw(pcm, 2)
    fmt = struct.pack("<HHIIHHH", 6, 1, 8000, 8000, 1, 8, 0)
    wav = _riff(_chunk(b"fmt ", fmt), _chunk(b"data", alaw))
    assert decode_wav_ulaw(wav) == pcm16_to_ulaw(audioop.alaw2lin(alaw, 2))

    # WAVE_FORMAT_EXTENSIBLE wrapping PCM16: the sub-format GUID starts with the real tag.
    guid_tail = b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"
    ext = struct.pack("<HHIIHHHHI", 0xFFFE, 1, 8000, 16000, 2, 16, 22, 16, 4)
    ext += struct.pack("<H14s", 1, guid_tail)
    wav = _riff(_chunk(b"fmt ", ext), _chunk(b"data", _le(pcm)))
    assert decode_wav_ulaw(wav) == pcm16_to_ulaw(pcm)


def _wav_with(fmt: bytes, data: bytes = b"\x00" * 16) -> bytes:
    return _riff(_chunk(b"fmt ", fmt), _chunk(b"data", data))


@pytest.mark.parametrize(
    ("blob", "reason"),
    [
        (b"", "not a RIFF/WAVE"),
        (b"RIFX\x00\x00\x00\x00WAVE", "not a RIFF/WAVE"),
        (b"RIFF\x04\x00\x00\x00WAVE", "no 'fmt '"),
        (b"RIFF\x1c\x00\x00\x00WAVEfmt \x10\x00\x00\x00" + b"\x01\x00" * 8, "no 'data'"),
        (b"RIFF\x20\x00\x00\x00WAVEfmt \x40\x00\x00\x00\x01\x00", "runs past the end"),
        (_wav_with(struct.pack("<HHIIHH", 1, 1, 8000, 8000, 1, 8)), "8-bit PCM"),
        (_wav_with(struct.pack("<HHIIHH", 1, 1, 8000, 24000, 3, 24)), "24-bit PCM"),
        (_wav_with(struct.pack("<HHIIHH", 3, 1, 8000, 32000, 4, 32)), "format tag 0x0003"),
        (_wav_with(struct.pack("<HHIIHH", 7, 1, 8000, 16000, 2, 16)), "G.711 with 16 bits"),
        (_wav_with(struct.pack("<HHIIHH", 1, 0, 8000, 0, 0, 16)), "0 channels"),
        (_wav_with(struct.pack("<HHIIHH", 1, 1, 0, 0, 2, 16)), "0 Hz"),
        (_wav_with(b"\x01\x00\x01\x00"), "at least 16"),
    ],
)
def test_bad_wavs_raise_named_error_with_path_and_reason(
    tmp_path: Path, blob: bytes, reason: str
) -> None:
    path = tmp_path / "bad.wav"
    path.write_bytes(blob)
    with pytest.raises(AudioFormatError) as info:
        read_wav_ulaw(path)
    assert info.value.path == str(path)
    assert reason in info.value.reason
    assert str(path) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_missing_file_is_an_os_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_wav_ulaw(tmp_path / "nope.wav")


@given(st.binary(max_size=300))
@settings(max_examples=300, database=None)
def test_decode_wav_never_raises_anything_else(blob: bytes) -> None:
    for data in (blob, b"RIFF" + blob[:4] + b"WAVE" + blob[4:]):
        try:
            out = decode_wav_ulaw(data)
        except AudioFormatError:
            continue
        assert isinstance(out, bytes)


# --- the corpus ---------------------------------------------------------------------------------


@needs_recordings
@pytest.mark.parametrize("name", ["barge_in_timit", "dtmf_pin_after_prompt"])
def test_reads_corpus_recordings_and_rewrites_them_byte_for_byte(name: str) -> None:
    path = RECORDINGS / f"{name}.wav"
    raw = path.read_bytes()
    ulaw = read_wav_ulaw(path)
    assert ulaw == raw[58:]  # data starts at byte 58, not 44
    assert len(ulaw) % 160 == 0
    assert encode_wav_ulaw(ulaw) == raw
    bot = read_wav_ulaw(RECORDINGS / f"{name}.bot.wav")
    assert len(bot) > 0


def test_format_error_pickles() -> None:
    import pickle

    err = pickle.loads(pickle.dumps(AudioFormatError("/x.wav", "no 'data' chunk")))
    assert (err.path, err.reason, str(err)) == (
        "/x.wav",
        "no 'data' chunk",
        "/x.wav: no 'data' chunk",
    )
