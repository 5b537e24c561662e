"""Stream converters between the phone line and speech engines.

Speech engines want PCM16 at their own rate (Pocketsphinx 16 kHz) and hand back PCM16 at theirs
(eSpeak NG 22.05 kHz, OpenAI 24 kHz); the line is 8 kHz mu-law. Audio arrives in chunks of any
size, so a chunk may end in the middle of a sample: both converters carry the odd byte and the
resampler state over, and their output for a stream does not depend on how it was chunked.

:class:`UlawEncoder` low-pass filters before going down to 8 kHz. :func:`audio.resample_pcm16`
(``audioop.ratecv``) interpolates without an anti-aliasing filter, which is fine
for speech that was band-limited already, but TTS voices carry a lot of energy from 4 to 11 kHz
(sibilants, and eSpeak's formant buzz); folded back below 4 kHz that sounds like hiss and
clicks on the phone.
"""

from __future__ import annotations

import math
import struct
import sys
from typing import Final, Literal

import numpy as np
import numpy.typing as npt

from ._codec import (
    TELEPHONY_RATE,
    AudioError,
    ResampleState,
    check_sample_rate,
    pcm16_to_ulaw,
    resample_pcm16,
)

__all__ = ["ByteOrder", "PcmInput", "UlawEncoder", "encode_wav_pcm16"]

ByteOrder = Literal["little", "big"]

_NATIVE: Final[ByteOrder] = "little" if sys.byteorder == "little" else "big"
_CUTOFF_HZ: Final = 3600.0  # passes the 300-3400 Hz telephone band, stops above 4 kHz
_TRANSITION_HZ: Final = 700.0


def _to_native(data: bytes, byteorder: ByteOrder) -> bytes:
    if byteorder == _NATIVE:
        return data
    return np.frombuffer(data, dtype=np.int16).byteswap().tobytes()


class PcmInput:
    """Mono PCM16 in chunks of any size -> native-order PCM16 at another rate.

    Args:
        from_rate: Sample rate of the input in Hz.
        to_rate: Wanted sample rate in Hz.
        byteorder: Byte order of the input (the phone leg and WAV files are little-endian).

    Raises:
        AudioError: A rate is not a positive integer.
    """

    def __init__(self, *, from_rate: int, to_rate: int, byteorder: ByteOrder = "little") -> None:
        check_sample_rate("from_rate", from_rate)
        check_sample_rate("to_rate", to_rate)
        self.from_rate = from_rate
        self.to_rate = to_rate
        self._byteorder = byteorder
        self._carry = b""
        self._state: ResampleState = None

    def push(self, data: bytes) -> bytes:
        """Convert the next chunk; an odd trailing byte waits for the next call."""
        if self._carry:
            data = self._carry + data
        cut = len(data) & ~1
        self._carry = data[cut:]
        pcm = _to_native(data[:cut], self._byteorder)
        out, self._state = resample_pcm16(
            pcm, from_rate=self.from_rate, to_rate=self.to_rate, state=self._state
        )
        return out


def _lowpass_taps(rate: int) -> npt.NDArray[np.float64]:
    # Hamming-windowed sinc: transition width ~3.3 * rate / taps.
    n = math.ceil(3.3 * rate / _TRANSITION_HZ) | 1
    m = np.arange(n, dtype=np.float64) - (n - 1) / 2
    taps = np.sinc(2.0 * _CUTOFF_HZ / rate * m) * np.hamming(n)
    taps /= taps.sum()  # unity gain at DC
    return taps


class UlawEncoder:
    """Mono PCM16 at any rate, in chunks of any size -> 8 kHz G.711 mu-law.

    Above 8 kHz the audio goes through a linear-phase low-pass (cut-off 3.6 kHz) before
    ``audioop.ratecv``. The filter's delay is taken back out: after :meth:`flush`, N input samples
    have become ``N * 8000 / from_rate`` output samples (to within one), aligned with the input.

    Args:
        from_rate: Sample rate of the input in Hz.
        byteorder: Byte order of the input.

    Raises:
        AudioError: ``from_rate`` is not a positive integer.
    """

    def __init__(self, from_rate: int, *, byteorder: ByteOrder = "little") -> None:
        check_sample_rate("from_rate", from_rate)
        self.from_rate = from_rate
        self._byteorder = byteorder
        self._carry = b""
        self._state: ResampleState = None
        self._taps: npt.NDArray[np.float64] | None = None
        if from_rate > TELEPHONY_RATE:
            self._taps = _lowpass_taps(from_rate)
            self._history = np.zeros(len(self._taps) - 1, dtype=np.float64)
            self._skip = (len(self._taps) - 1) // 2  # group delay still to drop, in samples

    def push(self, data: bytes) -> bytes:
        """Convert the next chunk; returns the mu-law ready so far (may be empty)."""
        if self._carry:
            data = self._carry + data
        cut = len(data) & ~1
        self._carry = data[cut:]
        return self._encode(_to_native(data[:cut], self._byteorder))

    def flush(self) -> bytes:
        """End of stream: returns the filter's tail. A dangling odd byte is dropped."""
        self._carry = b""
        if self._taps is None:
            return b""
        tail = np.zeros((len(self._taps) - 1) // 2, dtype=np.int16).tobytes()
        return self._encode(tail)

    def _encode(self, pcm: bytes) -> bytes:
        if not pcm:
            return b""
        if self._taps is not None:
            x = np.frombuffer(pcm, dtype=np.int16).astype(np.float64)
            padded = np.concatenate((self._history, x))
            self._history = padded[len(padded) - len(self._history) :]
            y = np.convolve(padded, self._taps, mode="valid")
            if self._skip:
                dropped = min(self._skip, len(y))
                y = y[dropped:]
                self._skip -= dropped
            pcm = np.clip(np.rint(y), -32768, 32767).astype(np.int16).tobytes()
        out, self._state = resample_pcm16(
            pcm, from_rate=self.from_rate, to_rate=TELEPHONY_RATE, state=self._state
        )
        return pcm16_to_ulaw(out)


def encode_wav_pcm16(pcm_le: bytes, *, sample_rate: int) -> bytes:
    """Wrap little-endian mono PCM16 in a canonical 44-byte WAV header.

    Raises:
        AudioError: odd byte count or a bad rate.
    """
    check_sample_rate("sample_rate", sample_rate)
    if len(pcm_le) % 2:
        raise AudioError(f"PCM16 data must have an even number of bytes, got {len(pcm_le)}")
    header = struct.pack(
        "<4sI4s4sIHHIIHH4sI",
        b"RIFF",
        36 + len(pcm_le),
        b"WAVE",
        b"fmt ",
        16,
        1,  # PCM
        1,  # mono
        sample_rate,
        sample_rate * 2,
        2,
        16,
        b"data",
        len(pcm_le),
    )
    return header + pcm_le
