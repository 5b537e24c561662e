"""Build linesim's corpus of extra real caller voices: ``python -m linesim.build_voices``.

The development recordings give the simulator's train split four real voices (11 clips). A
classifier fitted on so few voices scores new ones lower (session 18: the check split's callers
over 0.5 in 51-57 % of their windows, the train callers in 75-83 %). This script cuts real speech
from two public corpora into caller clips, all of them for the train split:

* the Free Spoken Digit Dataset (``Jakobovski/free-spoken-digit-dataset``: six speakers, 8 kHz
  wav, one digit a file, trimmed to the word): four digits of one speaker read as a caller reads
  a number (each digit at one level, within 1.5 dB), 120-320 ms apart, on that speaker's own background noise (the quietest 10 ms frames
  of their other files, joined with crossfades);
* LibriSpeech excerpts shipped by ``librosa/data`` (three readers, ogg): phrases of 1.2-4.5 s cut
  at pauses, on the reader's own background noise taken the same way.

Each clip is stored as 8 kHz mu-law wav in ``linesim/voices/`` with its labels in
``manifest.json``: onset and offset by the corpus rule (``tests/recordings/README.md``; the
functions of :mod:`linesim._dsp`), the loud part's start, segments at pauses of 300 ms or more,
the voice, the source path and the text. Every choice is drawn from a generator seeded by the
speaker's name, so the same inputs give the same files.

Reading ogg needs ``soundfile`` (``pip install soundfile``), which the project does not depend on:
the corpus is built once and committed; the simulator reads only the wav files and the manifest.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import sys
import wave
from pathlib import Path
from typing import Any

import numpy as np

from ._dsp import (
    RATE,
    Floats,
    _frame_energy,
    active_level_dbfs,
    band_limit,
    decode_ulaw,
    encode_ulaw,
    onset_offset,
    resample,
    speech_end,
)

OUT = Path(__file__).resolve().parent / "voices"
FSDD_SPEAKERS = ("george", "jackson", "lucas", "nicolas", "theo", "yweweler")
FSDD_CLIPS = 3  # per speaker
FSDD_REPO = "Jakobovski/free-spoken-digit-dataset"
DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
LIBRI = {  # librosa/data file -> (voice, reader)
    "198-209-0000.hq.ogg": ("librispeech_198", "Heather Barnett"),
    "3436-172162-0000.hq.ogg": ("librispeech_3436", "Anders Lankford"),
    "5703-47212-0000.hq.ogg": ("librispeech_5703", "Garth Comira"),
}
LIBRI_CLIPS = 3  # per reader
LIBRI_REPO = "librosa/data"
LEVEL_DBFS = -20.0  # stored active level: mu-law's steps are then far under the line's noise
LEAD = 960  # samples of the speaker's own background before the onset (120 ms)
TAIL = 1200  # and after the offset (150 ms)
BED_S = 2.0  # seconds of background noise kept with each clip (the simulator's room tone)


def _rng(name: str) -> np.random.Generator:
    return np.random.default_rng(int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big"))


def _read_wav(path: Path) -> Floats:
    with wave.open(str(path)) as w:
        if w.getsampwidth() != 2 or w.getnchannels() != 1:
            raise ValueError(f"{path}: expected 16-bit mono wav")
        x = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.float64) / 32768
        return resample(x, w.getframerate())


def _quiet_frames(xs: list[Floats], n: int) -> Floats:
    """``n`` samples of background noise: the quietest 10 ms frames of ``xs`` (those within 3 dB
    of each file's 10th percentile), joined with 2 ms crossfades and repeated as needed."""
    frames = []
    for x in xs:
        e = _frame_energy(x, 80, 80)
        if not len(e):
            continue
        floor = float(np.percentile(e, 10))
        frames += [x[i * 80 : i * 80 + 96] for i in np.flatnonzero(e <= floor * 2.0)
                   if i * 80 + 96 <= len(x)]
    if not frames:
        raise ValueError("no quiet frames to build a background from")
    fade = np.linspace(0.0, 1.0, 16)
    out = np.zeros(n + 96)
    k, pos = 0, 0
    while pos < n:
        f = frames[k % len(frames)].copy()
        f[:16] *= fade
        f[-16:] *= fade[::-1]
        out[pos : pos + 96] += f
        pos += 80
        k += 1
    return out[:n]


def _labels(x: Floats) -> dict[str, Any]:
    """Onset, loud part, offset and segments (ms) of the speech in ``x`` by the corpus rule."""
    y = band_limit(x)
    onset = onset_offset(y)
    end = speech_end(y)
    e = _frame_energy(y, 40, 8)
    peak = float(np.max(e))
    loud = np.flatnonzero(e >= peak * 10 ** (-2.5))
    core = int(loud[loud * 8 >= onset][0] * 8) if len(loud) else onset
    thr = max(peak * 1e-4, float(np.percentile(e, 10)) * 10 ** 1.2)
    active = np.flatnonzero(e >= thr) * 8
    segs: list[list[float]] = []
    for t in active:
        if t < onset or t > end:
            continue
        if segs and t - segs[-1][1] * 8 < 300 * 8:
            segs[-1][1] = (t + 40) / 8
        else:
            segs.append([t / 8, (t + 40) / 8])
    return {"onset_ms": onset / 8, "core_onset_ms": core / 8, "end_ms": end / 8,
            "segments_ms": segs if len(segs) > 1 else []}


def _store(x: Floats, bed: Floats, name: str, meta: dict[str, Any], out: Path) -> dict[str, Any]:
    gain = 10 ** ((LEVEL_DBFS - active_level_dbfs(x)) / 20)
    ulaw = encode_ulaw(x * gain)
    from audio import write_wav_ulaw

    write_wav_ulaw(out / f"{name}.wav", ulaw)
    write_wav_ulaw(out / f"{name}.bed.wav", encode_ulaw(bed * gain))
    stored = decode_ulaw(ulaw)
    labels = _labels(stored)
    speech = band_limit(stored)[int(labels["onset_ms"] * 8) : int(labels["end_ms"] * 8)]
    return {"file": f"{name}.wav", "bed": f"{name}.bed.wav", **meta, **labels,
            "level_dbfs": round(active_level_dbfs(speech), 1)}


def build_fsdd(root: Path, out: Path) -> list[dict[str, Any]]:
    entries = []
    for spk in FSDD_SPEAKERS:
        files = sorted((root / "recordings").glob(f"*_{spk}_*.wav"))
        if not files:
            raise FileNotFoundError(f"{root}/recordings: no files of speaker {spk!r}")
        rng = _rng(f"fsdd:{spk}")
        by_name = {f.name: f for f in files}
        bed = _quiet_frames([_read_wav(f) for f in files[::10]], int(BED_S * RATE))
        for k in range(FSDD_CLIPS):
            digits = [int(d) for d in rng.integers(0, 10, 4)]
            picks = [f"{d}_{spk}_{int(rng.integers(5, 50))}.wav" for d in digits]
            gaps = [int(g) for g in rng.integers(120, 321, 3)]
            # The files' levels differ by up to 20 dB; a caller reading a number keeps a
            # steady voice: each digit at one level, within 1.5 dB.
            words = [_read_wav(by_name[p]) for p in picks]
            ref = active_level_dbfs(words[0])
            words = [w * 10 ** ((ref - active_level_dbfs(w) + rng.uniform(-1.5, 1.5)) / 20)
                     for w in words]
            n = LEAD + sum(len(w) for w in words) + sum(gaps) * 8 + TAIL
            x = _quiet_frames([bed], n)
            pos = LEAD
            for w, gap in zip(words, [*gaps, 0], strict=True):
                ramp = np.ones(len(w))
                ramp[:16] = np.linspace(0, 1, 16)
                ramp[-16:] = np.linspace(1, 0, 16)
                x[pos : pos + len(w)] += w * ramp
                pos += len(w) + gap * 8
            name = f"fsdd_{spk}_{k}"
            entries.append(_store(x, bed, name, {
                "voice": f"fsdd_{spk}", "text": " ".join(DIGIT_WORDS[d] for d in digits),
                "source": f"real:{FSDD_REPO}/recordings/" + "+".join(picks),
                "license": "CC BY-SA 4.0"}, out))
    return entries


def build_libri(root: Path, out: Path) -> list[dict[str, Any]]:
    try:
        soundfile = importlib.import_module("soundfile")  # not a dependency: see the docstring
    except ImportError:
        raise SystemExit("reading librosa/data's ogg files needs soundfile: "
                         "pip install soundfile") from None
    entries = []
    for fname, (voice, reader) in LIBRI.items():
        data, rate = soundfile.read(str(root / "audio" / fname), dtype="float64")
        x = resample(data if data.ndim == 1 else data.mean(axis=1), int(rate))
        bed = _quiet_frames([x], int(BED_S * RATE))
        e = _frame_energy(band_limit(x), 80, 80)
        thr = float(np.percentile(e, 10)) * 10 ** 1.2
        quiet = e < thr
        # pauses of 200 ms or more: phrase boundaries
        bounds, run = [], 0
        for i, q in enumerate(quiet):
            run = run + 1 if q else 0
            if run == 20:
                bounds.append((i - 10) * 80)
        cuts, start = [], 0
        for b in [*bounds, len(x)]:
            if 1.2 * RATE <= b - start <= 4.5 * RATE:
                cuts.append((start, b))
                start = b
            elif b - start > 4.5 * RATE:
                start = b
        rng = _rng(f"libri:{voice}")
        chosen = sorted(rng.choice(len(cuts), size=min(LIBRI_CLIPS, len(cuts)), replace=False))
        for k, c in enumerate(chosen):
            a, b = cuts[int(c)]
            seg = x[a:b]
            y = _quiet_frames([bed], LEAD + len(seg) + TAIL)
            y[LEAD : LEAD + len(seg)] = seg
            name = f"{voice}_{k}"
            entries.append(_store(y, bed, name, {
                "voice": voice, "text": "",
                "source": f"real:{LIBRI_REPO}/audio/{fname}@{a / 8:.0f}-{b / 8:.0f}ms",
                "license": f"CC BY 4.0 (LibriSpeech; read by {reader})"}, out))
    return entries


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m linesim.build_voices", description=__doc__.split(
        "\n")[0])
    ap.add_argument("--fsdd", type=Path, required=True, help=f"a checkout of {FSDD_REPO}")
    ap.add_argument("--librosa-data", type=Path, required=True,
                    help=f"a checkout of {LIBRI_REPO}")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    entries = build_fsdd(args.fsdd, args.out) + build_libri(args.librosa_data, args.out)
    (args.out / "manifest.json").write_text(json.dumps({"clips": entries}, indent=1) + "\n")
    print(f"{len(entries)} clips of {len({e['voice'] for e in entries})} voices -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
