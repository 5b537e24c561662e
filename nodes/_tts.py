"""Text to speech for the session worker: the ``Synthesizer`` seam and deterministic test doubles.

A synthesizer turns text into mu-law 8 kHz audio (8 bytes per millisecond), as an async iterator
of byte strings. ``ToneSynthesizer`` and ``SilenceSynthesizer`` make exactly ``ms_per_char``
milliseconds of audio per character, so the text behind any audio position is known: tests and
benchmarks use them where a real TTS service cannot be reached.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

import numpy as np

from audio import TELEPHONY_RATE, ULAW_BYTES_PER_MS, ULAW_SILENCE, pcm16_to_ulaw

__all__ = [
    "SilenceSynthesizer",
    "Synthesizer",
    "ToneSynthesizer",
]


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

    def _audio(self, n_bytes: int) -> bytes:
        # Extend the kept tone only past what an earlier utterance already needed.
        if n_bytes > len(self._tone):
            n = np.arange(len(self._tone), n_bytes)
            value = self._level * 32767 * np.sin(2 * np.pi * self._frequency * n / TELEPHONY_RATE)
            self._tone += pcm16_to_ulaw(np.rint(value).astype(np.int16).tobytes())
        return self._tone[:n_bytes]

    async def synthesize(self, text: str) -> AsyncIterator[bytes]:
        audio = self._audio(self.duration_ms(text) * ULAW_BYTES_PER_MS)
        step = self.frame_ms * ULAW_BYTES_PER_MS
        for start in range(0, len(audio), step):
            yield audio[start : start + step]


class SilenceSynthesizer(ToneSynthesizer):
    """Like ToneSynthesizer, but mu-law silence (0xFF)."""

    def _audio(self, n_bytes: int) -> bytes:
        return ULAW_SILENCE * n_bytes
