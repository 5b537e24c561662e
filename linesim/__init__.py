"""The line simulator: labelled phone calls in the format of ../shared/recordings, by thousands.

``callgate simulate OUT --split train|check --seed S --count N [--condition NAME ...]`` writes
them; ``python -m bench.robustness`` replays them through the gateway and scores them.

* ``_sources``: the voices (real caller clips cut out of the development recordings and, for
  the train split, linesim/voices' corpus; eSpeak NG) and the train/check split by source;
* ``build_voices``: ``python -m linesim.build_voices``, how linesim/voices was made;
* ``_noise``: synthetic backgrounds (room tone, hold music, coughs, laughs, breaths, clicks) and
  in-band DTMF;
* ``_echo``: the echo path (ERL, delay, loudspeaker nonlinearity, impulse response, changes);
* ``_call``: one call from a :class:`Condition` and a seed, its labels and Twilio messages;
* ``_grid``: the named grids of conditions;
* ``scoring``: the evaluator's scoring rules (tools/eval_bargein.py), importable;
* ``cli``: ``callgate simulate``.

The per-window readings the decision sees, for fitting one: ``bench.robustness.window_features``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from ._call import Condition, ConditionError, SimCall, simulate_call
from ._grid import GRIDS, full_grid, grid, impacts_grid, mixed_grid, small_grid
from ._sources import (
    ESPEAK_VOICES,
    REAL_VOICE_SPLIT,
    SourceError,
    Split,
    VoiceLibrary,
    synthetic_split,
)

__all__ = [
    "ESPEAK_VOICES",
    "GRIDS",
    "REAL_VOICE_SPLIT",
    "Condition",
    "ConditionError",
    "SimCall",
    "SourceError",
    "Split",
    "VoiceLibrary",
    "call_name",
    "full_grid",
    "impacts_grid",
    "mixed_grid",
    "generate",
    "grid",
    "iter_calls",
    "simulate_call",
    "small_grid",
    "synthetic_split",
]


def call_name(split: str, seed: int, index: int, cond: Condition) -> str:
    return f"sim_{split}_s{seed}_{index:05d}_{cond.name}"


def iter_calls(conditions: list[Condition], *, split: Split, seed: int, count: int,
               library: VoiceLibrary | None = None) -> Iterator[SimCall]:
    """Calls ``0 .. count-1`` of ``(split, seed)``; call ``i`` is under ``conditions[i % len]``."""
    if not conditions:
        raise ConditionError("no conditions to simulate")
    lib = library or VoiceLibrary()
    for i in range(count):
        cond = conditions[i % len(conditions)]
        yield simulate_call(cond, split=split, seed=seed, index=i, library=lib,
                            name=call_name(split, seed, i, cond))


def generate(out_dir: Path, *, split: Split, seed: int, count: int,
             conditions: list[Condition] | None = None,
             library: VoiceLibrary | None = None) -> list[Path]:
    """Write ``count`` calls to ``out_dir`` (see :func:`iter_calls`); returns the label files."""
    out = []
    for call in iter_calls(conditions or small_grid(), split=split, seed=seed, count=count,
                           library=library):
        out.append(call.write(Path(out_dir))[2])
    return out
