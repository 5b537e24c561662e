"""The labelled recordings the tests replay (tests/recordings, copied from the shared corpus).

Captures (``NAME.twilio.jsonl``) are kept for a few recordings, the DTMF ones among them, since
their out-of-band ``dtmf`` messages are not in the WAV; the others are replayed from ``NAME.wav``
through the project's own WAV -> Twilio messages converter.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RECORDINGS = Path(__file__).parent / "recordings"


def names() -> list[str]:
    return sorted(p.stem for p in RECORDINGS.glob("*.json"))


def labels(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((RECORDINGS / f"{name}.json").read_text())
    return data


def source(name: str) -> Path:
    """The capture when there is one, else the WAV."""
    capture = RECORDINGS / f"{name}.twilio.jsonl"
    return capture if capture.exists() else RECORDINGS / f"{name}.wav"
