"""Text to speech for the session worker: the ``Synthesizer`` seam and deterministic test doubles.

A synthesizer turns text into mu-law 8 kHz audio (8 bytes per millisecond), as an async iterator
of byte strings. ``ToneSynthesizer`` and ``SilenceSynthesizer`` make exactly ``ms_per_char``
milliseconds of audio per character, so the text behind any audio position is known: tests and
benchmarks use them where a real TTS service cannot be reached.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

__all__ = [
    "MULAW_BYTES_PER_MS",
    "SilenceSynthesizer",
    "Synthesizer",
    "ToneSynthesizer",
    "linear_to_mulaw",
]

MULAW_BYTES_PER_MS = 8  # 8 kHz, one byte per sample

_SEG_END = (0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF)


def linear_to_mulaw(sample: int) -> int:
    """G.711 mu-law byte of one signed 16-bit sample (bit-exact with ``audioop.lin2ulaw``)."""
    pcm = sample >> 2  # G.711 works on 14 bits
    mask = 0xFF
    if pcm < 0:
        pcm, mask = -pcm, 0x7F
    pcm = min(pcm, 8159) + 0x21
    segment = next((i for i, end in enumerate(_SEG_END) if pcm <= end), 8)
    if segment >= 8:
        return 0x7F ^ mask
    return ((segment << 4) | ((pcm >> (segment + 1)) & 0x0F)) ^ mask


@runtime_checkable
class Synthesizer(Protocol):
    """Text to mu-law 8 kHz audio."""

    def synthesize(self, text: str) -> AsyncIterator[bytes]:
        """Yield the audio of ``text`` in pieces, in order."""
        ...


class ToneSynthesizer:
    """``ms_per_char`` ms of a sine tone per character, in ``frame_ms`` pieces.

    Args:
        ms_per_char: Audio length of one character.
        frame_ms: Length of each yielded piece (the last one may be shorter).
        frequency: Tone frequency in Hz.
        level: Peak amplitude as a fraction of full scale.
    """

    def __init__(
        self,
        ms_per_char: int = 40,
        *,
        frame_ms: int = 20,
        frequency: float = 440.0,
        level: float = 0.25,
    ) -> None:
        if ms_per_char <= 0 or frame_ms <= 0:
            raise ValueError("ms_per_char and frame_ms must be positive")
        self.ms_per_char = ms_per_char
        self.frame_ms = frame_ms
        self._frequency = frequency
        self._level = level
        self._tone = b""  # the longest tone made so far: sample n depends only on n

    def duration_ms(self, text: str) -> int:
        """Audio length of ``text``."""
        return len(text) * self.ms_per_char

    def _sample(self, n: int) -> int:
        value = self._level * 32767 * math.sin(2 * math.pi * self._frequency * n / 8000)
        return linear_to_mulaw(round(value))

    def _audio(self, n_bytes: int) -> bytes:
        # Made sample by sample in Python (~1 ms per 100 bytes, on the event loop): extend the
        # kept tone only past what an earlier utterance already needed.
        if n_bytes > len(self._tone):
            self._tone += bytes(self._sample(n) for n in range(len(self._tone), n_bytes))
        return self._tone[:n_bytes]

    async def synthesize(self, text: str) -> AsyncIterator[bytes]:
        audio = self._audio(self.duration_ms(text) * MULAW_BYTES_PER_MS)
        step = self.frame_ms * MULAW_BYTES_PER_MS
        for start in range(0, len(audio), step):
            yield audio[start : start + step]


class SilenceSynthesizer(ToneSynthesizer):
    """Like ToneSynthesizer, but mu-law silence (0xFF)."""

    def _audio(self, n_bytes: int) -> bytes:
        return b"\xff" * n_bytes
