"""The telephone leg's audio: G.711 mu-law, PCM16, float32, resampling, WAV files.

Twilio Media Streams carry 8 kHz mono G.711 mu-law in both directions. The VAD wants float32,
TTS engines hand back PCM16 at 16, 22.05 or 24 kHz (often wrapped in a WAV header), and the test
corpus stores mu-law WAV files with an 18-byte ``fmt`` chunk and a ``fact`` chunk. This module
converts between those forms and nothing else: it never touches a socket or a clock.

PCM16 here always means signed 16-bit samples in the machine's native byte order, because that is
what :mod:`audioop` reads and writes. WAV files are little-endian; the WAV functions swap bytes on
big-endian hosts so callers never see the difference.

Errors::

    AudioError (ValueError)         anything this module refuses
    ├── FrameAlignmentError         PCM16 data with an odd number of bytes
    └── AudioFormatError            a WAV file or buffer this module cannot turn into 8 kHz mu-law
"""

from __future__ import annotations

import os
import struct
import sys
import warnings
from pathlib import Path
from typing import Any, Final, TypeAlias

import numpy as np
import numpy.typing as npt

# audioop is deprecated on 3.11/3.12 (removed in 3.13, where the audioop-lts package provides the
# same module name). Silence only the import-time DeprecationWarning, and only here: the test
# suite runs with warnings as errors, and any other warning should still surface.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import audioop

__all__ = [
    "FRAME_BYTES",
    "FRAME_MS",
    "TELEPHONY_RATE",
    "ULAW_BYTES_PER_MS",
    "ULAW_SILENCE",
    "AudioError",
    "AudioFormatError",
    "FrameAlignmentError",
    "ResampleState",
    "check_sample_rate",
    "chunk_audio",
    "decode_wav_ulaw",
    "duration_ms",
    "encode_wav_ulaw",
    "float32_to_pcm16",
    "pcm16_to_float32",
    "pcm16_to_ulaw",
    "read_wav_ulaw",
    "resample_pcm16",
    "ulaw_to_float32",
    "ulaw_to_pcm16",
    "write_wav_ulaw",
]

TELEPHONY_RATE: Final = 8000
"""Sample rate of every Twilio Media Streams payload, in Hz."""

ULAW_BYTES_PER_MS: Final = TELEPHONY_RATE // 1000
"""Bytes of 8 kHz mu-law per millisecond (one byte per sample)."""

FRAME_MS: Final = 20
"""Length of each inbound media frame Twilio sends, in ms."""

FRAME_BYTES: Final = FRAME_MS * ULAW_BYTES_PER_MS
"""Bytes of mu-law in one 20 ms frame (160)."""

ULAW_SILENCE: Final = b"\xff"
"""One mu-law sample of digital silence (+0); multiply for longer stretches."""

ResampleState: TypeAlias = "tuple[Any, ...] | None"
"""Opaque carry-over between calls of :func:`resample_pcm16` (``None`` to start a stream)."""

_WAVE_FORMAT_PCM: Final = 0x0001
_WAVE_FORMAT_ALAW: Final = 0x0006
_WAVE_FORMAT_MULAW: Final = 0x0007
_WAVE_FORMAT_EXTENSIBLE: Final = 0xFFFE
_BIG_ENDIAN: Final = sys.byteorder == "big"


class AudioError(ValueError):
    """Base class of every error this module raises on bad audio or bad arguments."""


class FrameAlignmentError(AudioError):
    """PCM16 data whose length is not a whole number of 2-byte samples.

    Raised instead of letting :class:`audioop.error` escape, so callers catch one tree.
    """


class AudioFormatError(AudioError):
    """A WAV file or buffer that cannot be turned into 8 kHz mono mu-law.

    Attributes:
        path: where the audio came from (a file path, or a label such as ``"<bytes>"``).
        reason: what is wrong with it, in words.
    """

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(path, reason)  # args match __init__, so the error pickles
        self.path = path
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


def check_sample_rate(name: str, rate: int) -> None:
    """Raise :class:`AudioError` naming ``name`` unless ``rate`` is a positive integer."""
    if isinstance(rate, bool) or not isinstance(rate, int) or rate <= 0:
        raise AudioError(f"{name} must be a positive integer, got {rate!r}")


def _check_pcm16(data: bytes) -> None:
    if len(data) % 2:
        raise FrameAlignmentError(f"PCM16 data must have an even number of bytes, got {len(data)}")


# --- mu-law <-> PCM16 ------------------------------------------------------------------------


def ulaw_to_pcm16(data: bytes) -> bytes:
    """Decode G.711 mu-law to PCM16 (native byte order), one sample per input byte."""
    return audioop.ulaw2lin(data, 2)


def pcm16_to_ulaw(data: bytes) -> bytes:
    """Encode PCM16 (native byte order) to G.711 mu-law, one byte per sample.

    Raises:
        FrameAlignmentError: ``data`` has an odd number of bytes.
    """
    _check_pcm16(data)
    return audioop.lin2ulaw(data, 2)


# --- PCM16 <-> float32 ---------------------------------------------------------------------------


def pcm16_to_float32(data: bytes) -> npt.NDArray[np.float32]:
    """Convert PCM16 (native byte order) to float32 in [-1, 1), scaled by 1/32768.

    The scale is a power of two, so every int16 value maps to an exact float32 and
    :func:`float32_to_pcm16` gets it back bit for bit.

    Raises:
        FrameAlignmentError: ``data`` has an odd number of bytes.
    """
    _check_pcm16(data)
    samples = np.frombuffer(data, dtype=np.int16)
    return samples.astype(np.float32) * np.float32(1.0 / 32768.0)


def float32_to_pcm16(samples: npt.ArrayLike) -> bytes:
    """Convert float samples (nominally [-1, 1)) to PCM16 bytes (native byte order).

    Values are rounded to the nearest step and clipped to the int16 range, so a hot TTS engine
    saturates instead of wrapping around; NaN becomes silence. That keeps one bad sample from
    turning into a full-scale click on the caller's ear.
    """
    a = np.asarray(samples, dtype=np.float64).ravel()
    a = np.nan_to_num(a, nan=0.0, posinf=1.0, neginf=-1.0)
    scaled = np.clip(np.rint(a * 32768.0), -32768.0, 32767.0)
    return scaled.astype(np.int16).tobytes()


def _build_ulaw_table() -> npt.NDArray[np.float32]:
    # Derived from audioop itself so the fast path cannot drift from the reference decoder.
    table = pcm16_to_float32(audioop.ulaw2lin(bytes(range(256)), 2))
    table.setflags(write=False)
    return table


_ULAW_TO_FLOAT32: Final = _build_ulaw_table()


def ulaw_to_float32(data: bytes) -> npt.NDArray[np.float32]:
    """Decode mu-law straight to float32 in [-1, 1) through a 256-entry table.

    This is the hot path (every 20 ms frame of every call goes through it on its way to the VAD),
    so it skips the intermediate PCM16 buffer. The result equals
    ``pcm16_to_float32(ulaw_to_pcm16(data))`` exactly.
    """
    codes = np.frombuffer(data, dtype=np.uint8)
    return _ULAW_TO_FLOAT32[codes]


# --- resampling -------------------------------------------------------------------------------


def resample_pcm16(
    data: bytes, *, from_rate: int, to_rate: int, state: ResampleState = None
) -> tuple[bytes, ResampleState]:
    """Resample mono PCM16 with :func:`audioop.ratecv`, carrying state across chunks.

    Feed a stream chunk by chunk, passing back the state each call returned, and the output is
    the same as resampling the whole stream at once: no clicks at chunk boundaries. Used to
    bring TTS output (16, 22.05, 24 kHz) down to the 8 kHz of the phone line.

    ``ratecv`` interpolates without an anti-aliasing filter. Speech TTS has little energy above
    4 kHz, and the phone network band-limits to 3.4 kHz anyway, so that is acceptable here; it is
    not a general-purpose resampler.

    Args:
        data: PCM16 samples, native byte order.
        from_rate: sample rate of ``data`` in Hz.
        to_rate: wanted sample rate in Hz.
        state: ``None`` for the first chunk of a stream, then the state returned by the
            previous call.

    Returns:
        The resampled bytes and the state to pass with the next chunk.

    Raises:
        AudioError: a rate is not a positive integer.
        FrameAlignmentError: ``data`` has an odd number of bytes.
    """
    check_sample_rate("from_rate", from_rate)
    check_sample_rate("to_rate", to_rate)
    _check_pcm16(data)
    if from_rate == to_rate:
        return data, state
    out, new_state = audioop.ratecv(data, 2, 1, from_rate, to_rate, state)
    return out, new_state


# --- framing ----------------------------------------------------------------------------------


def chunk_audio(ulaw: bytes, *, chunk_ms: int = 20, rate: int = TELEPHONY_RATE) -> list[bytes]:
    """Cut outbound mu-law into media-message payloads of ``chunk_ms`` each.

    Twilio accepts payloads of any size, but small even chunks let a ``clear`` cut the bot off
    within one chunk and keep marks precise. The last chunk holds the remainder and may be short.

    Raises:
        AudioError: ``chunk_ms`` or ``rate`` is not positive, or a chunk would hold no sample.
    """
    if chunk_ms <= 0 or rate <= 0:
        raise AudioError(f"chunk_ms and rate must be positive, got {chunk_ms} and {rate}")
    size = rate * chunk_ms // 1000
    if size < 1:
        raise AudioError(f"{chunk_ms} ms at {rate} Hz is less than one sample")
    return [ulaw[i : i + size] for i in range(0, len(ulaw), size)]


def duration_ms(n_ulaw_bytes: int, *, rate: int = TELEPHONY_RATE) -> float:
    """Playing time of ``n_ulaw_bytes`` of mono mu-law (one byte per sample), in ms."""
    return n_ulaw_bytes * 1000.0 / rate


# --- WAV --------------------------------------------------------------------------------------


def _to_mono_8k_ulaw(pcm: bytes, *, channels: int, rate: int) -> bytes:
    """Interleaved native-order PCM16 at any rate -> 8 kHz mono mu-law."""
    if channels > 1:
        frames = np.frombuffer(pcm, dtype=np.int16).reshape(-1, channels)
        mono = np.rint(frames.mean(axis=1, dtype=np.float64)).astype(np.int16)
        pcm = mono.tobytes()
    pcm, _ = resample_pcm16(pcm, from_rate=rate, to_rate=TELEPHONY_RATE)
    return audioop.lin2ulaw(pcm, 2)


def decode_wav_ulaw(data: bytes, *, source: str = "<bytes>") -> bytes:
    """Turn a WAV file's bytes into 8 kHz mono mu-law.

    Accepts mu-law (format tag 7) and A-law (tag 6), and 16-bit PCM (tag 1), each at any sample
    rate and channel count, plain or wrapped in ``WAVE_FORMAT_EXTENSIBLE``. 8 kHz mono mu-law
    is returned as stored, byte for byte; everything else is downmixed, resampled and encoded.

    The RIFF chunks are walked rather than assuming a 44-byte header: the corpus files have an
    18-byte ``fmt`` chunk and a ``fact`` chunk (data at byte 58), and stdlib :mod:`wave` refuses
    tag 7 outright. A ``data`` chunk whose declared size runs past the end (streaming writers,
    including TTS services, put 0 or 0xFFFFFFFF there) is read to the end of the buffer.

    Args:
        data: the whole file.
        source: where it came from, for error messages.

    Raises:
        AudioFormatError: not RIFF/WAVE, chunks missing or cut short, or a sample format
            other than those above.
    """
    if len(data) < 12 or data[0:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise AudioFormatError(source, "not a RIFF/WAVE file")
    fmt: bytes | None = None
    audio: bytes | None = None
    pos = 12
    while pos + 8 <= len(data):
        chunk_id = data[pos : pos + 4]
        (size,) = struct.unpack_from("<I", data, pos + 4)
        body_start = pos + 8
        if chunk_id == b"data":
            # Tolerate a size that overruns the buffer: read what is there.
            audio = data[body_start : body_start + size]
            if body_start + size >= len(data):
                break
        elif body_start + size > len(data):
            raise AudioFormatError(
                source, f"chunk {chunk_id!r} at byte {pos} runs past the end of the file"
            )
        elif chunk_id == b"fmt ":
            fmt = data[body_start : body_start + size]
        pos = body_start + size + (size & 1)  # chunks are padded to even length
    if fmt is None:
        raise AudioFormatError(source, "no 'fmt ' chunk")
    if audio is None:
        raise AudioFormatError(source, "no 'data' chunk")
    if len(fmt) < 16:
        raise AudioFormatError(source, f"'fmt ' chunk is {len(fmt)} bytes, need at least 16")

    tag, channels, rate, _byte_rate, _block_align, bits = struct.unpack_from("<HHIIHH", fmt)
    if tag == _WAVE_FORMAT_EXTENSIBLE:
        if len(fmt) < 40:
            raise AudioFormatError(source, "WAVE_FORMAT_EXTENSIBLE 'fmt ' chunk is too short")
        (tag,) = struct.unpack_from("<H", fmt, 24)  # first two bytes of the sub-format GUID
    if channels < 1:
        raise AudioFormatError(source, "declares 0 channels")
    if rate < 1:
        raise AudioFormatError(source, "declares a sample rate of 0 Hz")

    if tag in (_WAVE_FORMAT_MULAW, _WAVE_FORMAT_ALAW):
        if bits != 8:
            raise AudioFormatError(source, f"G.711 with {bits} bits per sample, expected 8")
        audio = audio[: len(audio) - len(audio) % channels]
        if tag == _WAVE_FORMAT_MULAW and channels == 1 and rate == TELEPHONY_RATE:
            return audio  # already what Twilio wants: no decode/encode round trip
        decode = audioop.ulaw2lin if tag == _WAVE_FORMAT_MULAW else audioop.alaw2lin
        return _to_mono_8k_ulaw(decode(audio, 2), channels=channels, rate=rate)
    if tag == _WAVE_FORMAT_PCM:
        if bits != 16:
            raise AudioFormatError(source, f"{bits}-bit PCM; only 16-bit PCM is supported")
        frame = 2 * channels
        audio = audio[: len(audio) - len(audio) % frame]
        pcm = audioop.byteswap(audio, 2) if _BIG_ENDIAN else audio  # WAV is little-endian
        return _to_mono_8k_ulaw(pcm, channels=channels, rate=rate)
    raise AudioFormatError(
        source, f"format tag {tag:#06x}; supported: PCM16 (1), A-law (6), mu-law (7)"
    )


def read_wav_ulaw(path: str | os.PathLike[str]) -> bytes:
    """Read a WAV file as 8 kHz mono mu-law. See :func:`decode_wav_ulaw` for what it accepts.

    Raises:
        AudioFormatError: the file is not a WAV this module can convert (names the path).
        OSError: the file cannot be read.
    """
    p = Path(path)
    return decode_wav_ulaw(p.read_bytes(), source=str(p))


def encode_wav_ulaw(ulaw: bytes) -> bytes:
    """Wrap 8 kHz mono mu-law in a WAV header laid out like the corpus recordings.

    ``RIFF``/``WAVE``, an 18-byte ``fmt`` chunk (tag 7, 1 channel, 8000 Hz, 8000 bytes/s,
    block align 1, 8 bits, cbSize 0), a ``fact`` chunk with the sample count, then ``data``:
    58 bytes of header. The 18-byte form with ``fact`` is what the WAV spec asks of non-PCM
    formats, and it is what sox and libsndfile write.
    """
    n = len(ulaw)
    pad = b"\x00" if n & 1 else b""
    fmt = struct.pack("<HHIIHHH", _WAVE_FORMAT_MULAW, 1, TELEPHONY_RATE, TELEPHONY_RATE, 1, 8, 0)
    body = (
        b"WAVE"
        + b"fmt "
        + struct.pack("<I", len(fmt))
        + fmt
        + b"fact"
        + struct.pack("<II", 4, n)
        + b"data"
        + struct.pack("<I", n)
        + ulaw
        + pad
    )
    return b"RIFF" + struct.pack("<I", len(body)) + body


def write_wav_ulaw(path: str | os.PathLike[str], ulaw: bytes) -> None:
    """Write 8 kHz mono mu-law to ``path`` in the corpus layout (see :func:`encode_wav_ulaw`)."""
    Path(path).write_bytes(encode_wav_ulaw(ulaw))
