"""Tests of vad/: Silero runtimes and the batched engine, on the recorded calls.

Recordings come from ``tests/recordings``.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from audio import read_wav_ulaw, ulaw_to_float32

RECORDINGS = Path(__file__).parents[1] / "recordings"


@cache
def recording(name: str) -> npt.NDArray[np.float32]:
    """Inbound audio of recording ``name`` as float32 at 8 kHz (read-only, cached)."""
    samples = ulaw_to_float32(read_wav_ulaw(RECORDINGS / f"{name}.wav"))
    samples.setflags(write=False)
    return samples


def labels(name: str) -> dict[str, Any]:
    """The ``NAME.json`` labels of a recording."""
    result: dict[str, Any] = json.loads((RECORDINGS / f"{name}.json").read_text())
    return result


def caller_recordings() -> list[str]:
    """Names of every inbound recording (not the ``.bot.wav`` reference tracks), sorted."""
    wavs = RECORDINGS.glob("*.wav")
    return sorted(p.name.removesuffix(".wav") for p in wavs if not p.name.endswith(".bot.wav"))
