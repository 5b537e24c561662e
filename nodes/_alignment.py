"""Which text of an utterance the caller heard, given how many milliseconds of it were played.

The worker synthesizes an utterance chunk by chunk (one chunk per piece of text the node
yielded) and records, for each chunk, its character span in the utterance text and its span of
audio milliseconds. ``heard_text(heard_ms)``:

1. ``heard_ms`` at or past the end of the audio: the whole text.
2. Otherwise find the chunk whose audio contains ``heard_ms``. Every character of the chunks
   before it was heard; within it, characters are taken in proportion to the time heard,
   ``floor(len(chunk) * (heard_ms - chunk_start_ms) / chunk_ms)``.
3. Cut at a word boundary: if that position falls inside a word (the characters on both sides of
   it are not whitespace), back off to the whitespace before the word, so a half-heard word is
   dropped. Trailing whitespace is stripped.

So with 40 ms per character, ``"Your balance is twelve dollars."`` heard for 500 ms (12.5
characters: ``"Your balance"``, ending before a space) gives ``"Your balance"``, and 580 ms (14
characters, in the middle of ``"is"``) also gives ``"Your balance"``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["AlignedChunk", "UtteranceAlignment"]

_SPACE = re.compile(r"\s")


@dataclass(frozen=True, slots=True)
class AlignedChunk:
    """One synthesized chunk: characters [text_start, text_end), audio [start_ms, end_ms)."""

    text_start: int
    text_end: int
    start_ms: float
    end_ms: float


class UtteranceAlignment:
    """Text of one utterance and the audio span of each of its chunks."""

    def __init__(self) -> None:
        self.text = ""
        self.chunks: list[AlignedChunk] = []

    @property
    def audio_ms(self) -> float:
        """Total audio length so far."""
        return self.chunks[-1].end_ms if self.chunks else 0.0

    def add(self, text: str, duration_ms: float) -> AlignedChunk:
        """Append a chunk of ``text`` whose audio lasts ``duration_ms``."""
        start = self.audio_ms
        chunk = AlignedChunk(len(self.text), len(self.text) + len(text), start, start + duration_ms)
        self.text += text
        self.chunks.append(chunk)
        return chunk

    def heard_position(self, heard_ms: float) -> int:
        """Characters heard after ``heard_ms`` ms, before the word-boundary cut."""
        if heard_ms <= 0:
            return 0
        if heard_ms >= self.audio_ms:
            return len(self.text)
        for chunk in self.chunks:
            if heard_ms < chunk.end_ms:
                span = chunk.end_ms - chunk.start_ms
                frac = (heard_ms - chunk.start_ms) / span if span > 0 else 1.0
                return chunk.text_start + math.floor((chunk.text_end - chunk.text_start) * frac)
        return len(self.text)  # pragma: no cover - heard_ms < audio_ms guarantees a chunk

    def heard_text(self, heard_ms: float) -> str:
        """The text the caller heard after ``heard_ms`` ms of this utterance's audio."""
        if heard_ms >= self.audio_ms and self.chunks:
            return self.text
        text = self.text
        pos = self.heard_position(heard_ms)
        inside_word = (
            0 < pos < len(text) and not text[pos].isspace() and not text[pos - 1].isspace()
        )
        if inside_word:
            spaces = [m.start() for m in _SPACE.finditer(text, 0, pos)]
            pos = spaces[-1] if spaces else 0
        return text[:pos].rstrip()
