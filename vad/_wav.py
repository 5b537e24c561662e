"""A tiny WAV reader for recorded calls: G.711 mu-law (format tag 7) and 16-bit PCM (tag 1).

The recordings in ``tests/recordings`` are mu-law WAV files with an 18-byte ``fmt `` chunk and a
``fact`` chunk, so their audio starts at byte 58, not 44: this reader walks the RIFF chunks instead
of assuming the canonical 44-byte header. It exists so tests and benchmarks can load audio without
sox or libsndfile; the live media path decodes Twilio payloads with :func:`mulaw_to_float32`.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import numpy.typing as npt

__all__ = ["MULAW_LUT", "WavFormatError", "mulaw_to_float32", "read_mulaw", "read_wav"]

_WAVE_FORMAT_PCM = 1
_WAVE_FORMAT_MULAW = 7


class WavFormatError(ValueError):
    """The file is not a WAV file this reader understands (names the file and the reason)."""


def _build_mulaw_lut() -> npt.NDArray[np.float32]:
    # Classic G.711 decoder (the one in audioop and sox): complement, split sign/exponent/mantissa,
    # rebuild the biased magnitude. Scaled by 1/32768 like sox's 16-bit -> float conversion.
    u = ~np.arange(256, dtype=np.int32) & 0xFF
    sign = u & 0x80
    exponent = (u >> 4) & 0x07
    mantissa = u & 0x0F
    magnitude = (((mantissa << 3) + 0x84) << exponent) - 0x84
    linear = np.where(sign != 0, -magnitude, magnitude)
    lut = (linear / 32768.0).astype(np.float32)
    lut.setflags(write=False)
    return lut


MULAW_LUT: npt.NDArray[np.float32] = _build_mulaw_lut()
"""Mu-law byte -> float32 sample in [-1, 1), indexed by the byte value (read-only)."""


def mulaw_to_float32(data: bytes | bytearray | memoryview) -> npt.NDArray[np.float32]:
    """Decode G.711 mu-law bytes to float32 samples in [-1, 1) with a 256-entry lookup table."""
    return MULAW_LUT[np.frombuffer(data, dtype=np.uint8)]


def _parse(path: Path) -> tuple[int, int, int, bytes]:
    """Walk the RIFF chunks: (format tag, sample rate, bits per sample, data bytes)."""
    blob = path.read_bytes()
    if len(blob) < 12 or blob[:4] != b"RIFF" or blob[8:12] != b"WAVE":
        raise WavFormatError(f"{path}: not a RIFF/WAVE file")
    fmt: tuple[int, int, int, int] | None = None
    pos = 12
    while pos + 8 <= len(blob):
        chunk_id = blob[pos : pos + 4]
        (size,) = struct.unpack_from("<I", blob, pos + 4)
        body = blob[pos + 8 : pos + 8 + size]
        if chunk_id == b"fmt ":
            if size < 16:
                raise WavFormatError(f"{path}: fmt chunk is {size} bytes, need at least 16")
            tag, channels, rate, _byte_rate, _align, bits = struct.unpack_from("<HHIIHH", body)
            fmt = (tag, channels, rate, bits)
        elif chunk_id == b"data":
            if fmt is None:
                raise WavFormatError(f"{path}: no fmt chunk before the data chunk")
            tag, channels, rate, bits = fmt
            if channels != 1:
                raise WavFormatError(f"{path}: {channels} channels, only mono is supported")
            return tag, rate, bits, body
        pos += 8 + size + (size & 1)  # chunks are padded to an even length
    raise WavFormatError(f"{path}: no data chunk")


def read_wav(path: str | Path) -> tuple[npt.NDArray[np.float32], int]:
    """Read a mono mu-law or 16-bit PCM WAV file.

    Args:
        path: The file to read.

    Returns:
        ``(samples, sample_rate)``: float32 samples in [-1, 1) and the rate in Hz.

    Raises:
        WavFormatError: The file is not RIFF/WAVE, is not mono, or uses another encoding.
    """
    path = Path(path)
    tag, rate, bits, data = _parse(path)
    if tag == _WAVE_FORMAT_MULAW and bits == 8:
        return mulaw_to_float32(data), rate
    if tag == _WAVE_FORMAT_PCM and bits == 16:
        pcm = np.frombuffer(data[: len(data) // 2 * 2], dtype="<i2")
        return (pcm / 32768.0).astype(np.float32), rate
    raise WavFormatError(f"{path}: format tag {tag} with {bits} bits/sample is not supported")


def read_mulaw(path: str | Path) -> bytes:
    """The raw G.711 mu-law bytes of a mono mu-law WAV file (what Twilio ``media`` carries).

    Raises:
        WavFormatError: The file is not a mono 8-bit mu-law WAV file.
    """
    path = Path(path)
    tag, _rate, bits, data = _parse(path)
    if tag != _WAVE_FORMAT_MULAW or bits != 8:
        raise WavFormatError(f"{path}: format tag {tag} with {bits} bits/sample is not mu-law")
    return data
