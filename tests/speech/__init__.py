"""Tests of speech/: offline engines on real audio, OpenAI providers against a local server.

Recordings come from ``tests/recordings`` (falling back to the shared corpus until they are
copied there).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any, Final

from audio import read_wav_ulaw, ulaw_to_pcm16

_LOCAL = Path(__file__).parents[1] / "recordings"
RECORDINGS: Final = _LOCAL if _LOCAL.is_dir() else Path("/work/shared/recordings")

GUARD_S: Final = 10.0
"""Hang guard for waits on something the code under test must do; reaching it is a failure."""

PRE_ROLL_MS: Final = 300
"""Audio kept before a labelled speech onset, as a VAD-gated call leg would."""


def labels(name: str) -> dict[str, Any]:
    """The ``NAME.json`` labels of a recording."""
    result: dict[str, Any] = json.loads((RECORDINGS / f"{name}.json").read_text())
    return result


@cache
def caller_speech(name: str, index: int = 0) -> tuple[bytes, str]:
    """PCM16 (8 kHz) of the ``index``-th labelled speech event, with margins, and its text."""
    events = [e for e in labels(name)["events"] if e["kind"] == "speech"]
    event = events[index]
    pcm = ulaw_to_pcm16(read_wav_ulaw(RECORDINGS / f"{name}.wav"))
    start_ms = max(0, event["start_ms"] - PRE_ROLL_MS)
    end_ms = event["end_ms"] + PRE_ROLL_MS
    return pcm[start_ms * 16 : end_ms * 16], str(event["text"])


def words(text: str) -> list[str]:
    """Lower-case words, punctuation dropped."""
    return "".join(c if c.isalnum() or c in "' " else " " for c in text.lower()).split()
