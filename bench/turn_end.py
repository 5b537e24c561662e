"""End-of-turn detection on labelled phone turns: false turn ends in the caller's pauses and the
delay added at true ends, per method, fitted on one split of voices and reported on the other.

Run: ``python -m bench.turn_end`` (a minute or two, plus a few minutes for the pocketsphinx rows
unless ``--no-pocketsphinx``; ``--fit`` refits the model on the train voices (a logistic
regression as the start, then the weights chosen with the waits by the waits' criterion,
``fit_key``: about a minute) and writes it, with its inputs' verdicts, to ``vad/turn_fit.json`` and as the defaults in ``vad/_turn.py``;
``--smart-turn PATH`` adds Pipecat's smart-turn v3 from a ``pipecat_ai-*.whl`` got with
``pip download pipecat-ai --no-deps``: nothing is installed, the ONNX model and its numpy
feature code are read from the wheel).

The turns (all real human voices unless marked):

* the caller turns of the development recordings (``tests/recordings``) whose caller is clean
  (nothing but the caller's room tone and line hiss under the speech); speech events less than
  1.5 s apart are one turn (long_turn_librivox is one turn with two ~460 ms pauses between
  sentences; the labels' ``segments_ms`` pauses count too);
* the same turns with a hesitation pause inserted between two words of a phrase (up to three
  per turn: the quietest 40 ms runs inside 20-85% of a segment, each moved to the nearest
  aligned word end that the next word follows at once; a turn without words keeps the quiet
  run itself, which is often a stop closure inside a word, ``--quiet-cuts``) of 200, 350, 500,
  750, 1000 and 1500 ms of the line's own noise level: the phrase before the pause is
  unfinished;
* complete short answers: the real "yes" of the dev set, and eSpeak NG "no", "yes" and a digit
  string (marked ``espeak``: no real human recording of them is here).

Every turn with a transcript carries its words with their times (``Case.words``: a forced
alignment of the labels' texts, ``bench/data/turn_words.json``, ``--align`` rebuilds it), so
the text methods give the detector the words said so far as a streaming recogniser's partials:
exact, ``--lag-ms`` late, or pocketsphinx's decoding of the audio so far (docs/turns.md).

Each turn is followed by 3.5 s of line noise. Every method sees the same per-window verdicts of
the gateway's own VAD chain (Silero + echo/noise gate + ``BargeInPolicy.is_caller``). A *false
end* is a turn end decided inside a pause (before the caller resumes); the *delay* is from the
labelled end of speech to the turn end decided. The split is by voice, as linesim's
(``REAL_VOICE_SPLIT``): train = librivox, ljspeech, speechbrain_spk1, pocketsphinx_goforward;
check = jfk, timit_ldc93s1, speech_commands_yes (and the eSpeak short answers).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import sys
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from audio import TELEPHONY_RATE, read_wav_ulaw, ulaw_to_float32
from vad import BargeInPolicy, BotState, EchoGateSettings, PolicyState, VadEngine
from vad._turn import (
    EndEstimate,
    ProsodyWeights,
    TurnDecision,
    TurnDetector,
    TurnSettings,
    TurnState,
)

RECORDINGS = Path(__file__).resolve().parent.parent / "tests" / "recordings"
VOICE_SPLIT = {
    "librivox": "train", "ljspeech": "train", "speechbrain_spk1": "train",
    "pocketsphinx_goforward": "train",
    "jfk": "check", "timit_ldc93s1": "check", "speech_commands_yes": "check", "espeak": "check",
}
PAUSES_MS = (200, 350, 500, 750, 1000, 1500)
WORDS_FILE = Path(__file__).resolve().parent / "data" / "turn_words.json"
"""The labelled speech events' word times (``--align`` writes it): a forced alignment of each
event's ``text`` on its audio (below), committed so the fit does not depend on the aligner."""
EXTRA_TEXT = {
    # The dev labels have no text for it; speechbrain's own annotation does
    # (tests/samples/annotation/ASR_dev.json, "wrd" of spk1_snt5).
    "real:speechbrain/speechbrain/tests/samples/ASR/spk1_snt5.wav":
        "sunday is the best part of the week",
}
"""Transcripts from the source repositories where the labels have none (spk1_snt6 has none
anywhere: its turns have no text, and the text methods see them without a transcript)."""
TAIL_MS = 3500
RATE = TELEPHONY_RATE
Floats = npt.NDArray[np.float32]
Word = tuple[str, float, float]
"""(word, start ms, end ms) in the case's time."""


@dataclass(frozen=True, slots=True)
class Case:
    """One labelled turn as the gateway would hear it."""

    name: str
    voice: str
    audio: Floats
    end_ms: float  # labelled end of the turn's speech
    pauses: tuple[tuple[float, float], ...]  # (start, end) ms of pauses inside the turn
    kind: str  # natural / hesitation / short
    words: tuple[Word, ...] | None = None
    """What the caller says, word by word, with its aligned times (None: no transcript)."""

    @property
    def split(self) -> str:
        return VOICE_SPLIT[self.voice]


@dataclass(slots=True)
class Scored:
    """A case with the VAD chain's verdict per window (computed once, shared by methods)."""

    case: Case
    speech: list[bool] = field(default_factory=list)


def _noise(ms: float, level: float, rng: np.random.Generator) -> Floats:
    return (rng.standard_normal(int(ms * RATE / 1000)) * level).astype(np.float32)


def _floor(x: Floats) -> float:
    frames = x[: len(x) // 80 * 80].reshape(-1, 80)
    rms = np.sqrt(np.mean(frames.astype(np.float64) ** 2, axis=1))
    return float(max(np.percentile(rms, 10), 1e-5))


def _word_gaps(x: Floats, lo: int, hi: int, n: int) -> list[int]:
    """Up to ``n`` cut points (sample index) at the quietest 40 ms runs in [lo, hi)."""
    hop = 80  # 10 ms
    seg = x[lo:hi].astype(np.float64)
    m = len(seg) // hop
    if m < 10:
        return []
    e = 10 * np.log10(np.mean(seg[: m * hop].reshape(m, hop) ** 2, axis=1) + 1e-12)
    run = np.convolve(e, np.ones(4) / 4, mode="valid")  # 40 ms
    a, b = int(m * 0.2), int(m * 0.85) - 3
    if b <= a:
        return []
    order = np.argsort(run[a:b]) + a
    picks: list[int] = []
    for i in order:
        if run[i] > np.max(e) - 20:
            break
        if all(abs(i - p) > 50 for p in picks):  # 500 ms apart
            picks.append(int(i))
        if len(picks) == n:
            break
    return sorted(lo + (p + 2) * hop for p in picks)


def _turn_groups(labels: dict[str, Any]) -> list[list[dict[str, Any]]]:
    events = [e for e in labels["events"] if e["kind"] in ("speech", "backchannel")
              and str(e["source"]).startswith("real:") and e.get("voice") in VOICE_SPLIT]
    groups: list[list[dict[str, Any]]] = []
    for e in events:
        others = [o for o in labels["events"] if o is not e and o["kind"] not in
                  ("speech", "backchannel") and o["start_ms"] < e["end_ms"]
                  and o["end_ms"] > e["start_ms"] - 400
                  and o.get("noise_type") not in ("caller_room_tone", "line_hiss")]
        if others:
            groups.append([])  # an unclean event breaks grouping, and is not used
            continue
        if groups and groups[-1] and e["start_ms"] - groups[-1][-1]["end_ms"] < 1500:
            groups[-1].append(e)
        else:
            groups.append([e])
    return [g for g in groups if g]


def _event_key(labels: dict[str, Any], e: dict[str, Any]) -> str:
    return f"{labels['name']}@{e['start_ms']}"


def _event_text(e: dict[str, Any]) -> str | None:
    text = e.get("text") or EXTRA_TEXT.get(str(e["source"]))
    return " ".join(_TOKEN.findall(text.lower())) if text else None


_TOKEN = re.compile(r"[a-z']+")
_ALIGN_PAD_MS = 300


class Aligner:
    """Word times by forced alignment with the pocketsphinx wheel's model (5.x:
    ``Decoder.set_align_text``, then the word segmentation ``Decoder.seg()``, 10 ms frames), on
    the 8 kHz audio upsampled to 16 kHz as ``speech._pocketsphinx`` decodes it (its telephone
    cepstral mean), the whole utterance at once. Checked against TIMIT's hand-labelled word
    boundaries of LDC93S1 (docs/turns.md)."""

    def __init__(self) -> None:
        import pocketsphinx

        from speech._pocketsphinx import TELEPHONE_CMNINIT

        self._cmninit = TELEPHONE_CMNINIT
        self._decoder = pocketsphinx.Decoder(loglevel="FATAL", cmninit=TELEPHONE_CMNINIT)

    def align(self, x: Floats, text: str, offset_ms: float = 0.0) -> list[Word]:
        """``text``'s words in ``x`` (8 kHz float): [(word, start, end)] in ms + ``offset_ms``."""
        from audio import float32_to_pcm16, resample_pcm16
        from speech._pocketsphinx import _reset

        words = text.split()
        missing = [w for w in words if self._decoder.lookup_word(w) is None]
        if missing:
            raise ValueError(f"not in the pronouncing dictionary: {missing}")
        up, _ = resample_pcm16(float32_to_pcm16(x), from_rate=RATE, to_rate=16000)
        d = self._decoder
        d.set_align_text(" ".join(words))
        _reset(d, self._cmninit)  # each utterance from a fresh normalisation
        d.start_utt()
        d.process_raw(up, full_utt=True)
        d.end_utt()
        frame_ms = 1000.0 / float(d.config["frate"])
        if d.hyp() is None:
            raise ValueError(f"alignment failed for {text!r}: no path through the audio")
        out = [(re.sub(r"\(\d+\)$", "", seg.word), offset_ms + seg.start_frame * frame_ms,
                offset_ms + (seg.end_frame + 1) * frame_ms)
               for seg in d.seg() if not seg.word.startswith(("<", "["))]
        got = [w for w, _, _ in out]
        if got != words[: len(got)] or not got:
            raise ValueError(f"alignment failed: {' '.join(got)!r} for {text!r}")
        return out


def _labelled_audio(recordings: Path) -> Iterator[tuple[dict[str, Any], Floats]]:
    """Each recording with labels and a WAV: (its labels, its audio as floats)."""
    for path in sorted(recordings.glob("*.json")):
        wav = path.with_suffix(".wav")
        if wav.exists():
            yield json.loads(path.read_text()), ulaw_to_float32(read_wav_ulaw(wav))


def align_recordings(recordings: Path = RECORDINGS) -> dict[str, list[list[Any]]]:
    """Every speech event of the turns (``_turn_groups``: clean real voices) with a transcript, aligned on the recording's
    audio from 300 ms before its onset to 300 ms after its offset: ``{"NAME@START_MS":
    [[word, start_ms, end_ms], ...]}`` in the recording's ms."""
    aligner = Aligner()
    out: dict[str, list[list[Any]]] = {}
    for labels, x in _labelled_audio(recordings):
        for e in (e for group in _turn_groups(labels) for e in group):
            text = _event_text(e)
            if text is None:
                continue
            a = max(0, int((e["start_ms"] - _ALIGN_PAD_MS) * 8))
            b = int((e["end_ms"] + _ALIGN_PAD_MS) * 8)
            try:
                words = aligner.align(x[a:b], text, a / 8)
            except ValueError as exc:
                raise ValueError(f"{_event_key(labels, e)}: {exc}") from exc
            rest = text.split()[len(words):]
            if rest:
                # The aligner found no room for the last word(s) (long_turn_librivox's "them":
                # the source clip's last word is cut short): they end at the labelled offset.
                print(f"# {_event_key(labels, e)}: {' '.join(rest)!r} not aligned; placed at "
                      "the labelled end", file=sys.stderr)
                t0 = words[-1][2]
                t1 = max(float(e["end_ms"]), t0 + 50.0)
                step = (t1 - t0) / len(rest)
                words += [(w, t0 + i * step, t0 + (i + 1) * step) for i, w in enumerate(rest)]
            # The labels' energy-based segments are the better word *edges* at pauses: the
            # aligner runs a word on into a pause it has no silence for (barge_in_late_ljspeech's
            # "that" over its 376 ms pause, barge_in_mid_jfk's "you" 297 ms past the offset).
            segs = e.get("segments_ms") or [[e["start_ms"], e["end_ms"]]]
            clamped = []
            for w, s0, s1 in words:
                seg = next((g for g in segs if g[0] - 60 <= s0 < g[1]), segs[-1])
                clamped.append([w, round(s0, 1), round(min(s1, float(seg[1])), 1)])
            out[_event_key(labels, e)] = clamped
    return out


def _load_words() -> dict[str, list[list[Any]]]:
    if not WORDS_FILE.exists():
        print(f"# {WORDS_FILE.name} missing: no transcripts (python -m bench.turn_end --align)",
              file=sys.stderr)
        return {}
    words: dict[str, list[list[Any]]] = json.loads(WORDS_FILE.read_text())
    return words


def _snap_to_word_ends(cuts: Sequence[int], words: Sequence[Word]) -> list[int]:
    """Each cut moved to the nearest aligned word end followed at once by the next word (a
    word gap inside a phrase, not a pause already there), in samples; duplicates dropped."""
    ends = [int(round(w1 * 8)) for (_, _, w1), (_, n0, _) in zip(words, words[1:], strict=False)
            if n0 - w1 < 100]
    if not ends:
        return list(cuts)
    return sorted({min(ends, key=lambda e: abs(e - c)) for c in cuts})


def _level_db(x: Floats, centre: int, half: int = 160) -> float:
    """The level of the 40 ms of ``x`` centred on sample ``centre``, in dB (full scale 0)."""
    seg = x[max(0, centre - half):centre + half].astype(np.float64)
    return float(10 * np.log10(np.mean(seg ** 2) + 1e-12)) if len(seg) else -120.0


def cut_levels(recordings: Path = RECORDINGS) -> list[dict[str, Any]]:
    """Where the standard hesitation cuts fall, without listening: for each distinct cut of a
    turn with aligned words, whether it is more than 30 ms inside a word, the level of its
    40 ms and, in the same turn, the levels at the word gaps inside a phrase (a word end
    followed within 100 ms by the next word: where ``_snap_to_word_ends`` puts a pause), each
    in dB below the turn's loudest 40 ms."""
    aligned = _load_words()
    out: list[dict[str, Any]] = []
    for labels, x in _labelled_audio(recordings):
        for gi, group in enumerate(_turn_groups(labels)):
            start = max(0, int((group[0]["start_ms"] - 400) * 8))
            clip = x[start:int(group[-1]["end_ms"] * 8)]
            keys = [_event_key(labels, e) for e in group]
            if group[-1]["end_ms"] - group[0]["start_ms"] < 800 or not all(
                    k in aligned for k in keys):
                continue
            words = [(str(w), float(w0) - start / 8, float(w1) - start / 8)
                     for k in keys for w, w0, w1 in aligned[k]]
            frames = clip[: len(clip) // 320 * 320].astype(np.float64).reshape(-1, 320)
            peak = float(10 * np.log10(np.max(np.mean(frames ** 2, axis=1)) + 1e-12))
            gaps = [int(round((w1 + n0) / 2 * 8)) for (_, _, w1), (_, n0, _)
                    in zip(words, words[1:], strict=False) if n0 - w1 < 100]
            gap_db = [round(_level_db(clip, g) - peak, 1) for g in gaps]
            cuts: list[int] = []
            for e in group:
                for s0, s1 in e.get("segments_ms") or [[e["start_ms"], e["end_ms"]]]:
                    cuts += _word_gaps(clip, int((s0 - start / 8) * 8),
                                       int((s1 - start / 8) * 8), 3)
            for cut in cuts[:3]:
                t = cut / 8
                inside = next((w for w, w0, w1 in words if w0 + 30 < t < w1 - 30), None)
                db = _level_db(clip, cut) - peak
                out.append({"turn": f"{labels['name']}#{gi}", "voice": str(group[0]["voice"]),
                            "split": VOICE_SPLIT.get(str(group[0]["voice"]), "check"),
                            "cut_ms": round(t, 1), "inside_word": inside,
                            "cut_db": round(db, 1), "gap_db": gap_db,
                            "gaps_quieter": sum(g <= db for g in gap_db)})
    return out


def build_cases(recordings: Path = RECORDINGS, espeak: bool = True,
                quiet_cuts: bool = False) -> list[Case]:
    """The labelled turns (module docstring). The hesitation pauses go at the aligned word ends
    nearest the quietest-40-ms cuts, named ``@wcutN+D`` (turns without words keep the quiet
    cuts, ``@cutN+D``); ``quiet_cuts``: at the quietest 40 ms themselves, the placement before
    session 9, 18 of 26 of them inside a word (a stop closure: ``cut_levels``, docs/turns.md)."""
    rng = np.random.default_rng(17)
    cases: list[Case] = []
    aligned = _load_words()
    for labels, x in _labelled_audio(recordings):
        for gi, group in enumerate(_turn_groups(labels)):
            start = max(0, int((group[0]["start_ms"] - 400) * 8))
            end = int(group[-1]["end_ms"] * 8)
            clip = x[start:end]
            level = _floor(clip)
            voice = str(group[0]["voice"])
            pauses: list[tuple[float, float]] = []
            segs: list[tuple[float, float]] = []
            for e in group:
                for s0, s1 in e.get("segments_ms") or [[e["start_ms"], e["end_ms"]]]:
                    segs.append((s0 - start / 8, s1 - start / 8))
            for (_, a1), (b0, _) in zip(segs, segs[1:], strict=False):
                pauses.append((a1, b0))
            name = f"{labels['name']}#{gi}"
            audio = np.concatenate([clip, _noise(TAIL_MS, level, rng)])
            kind = "short" if group[-1]["end_ms"] - group[0]["start_ms"] < 800 else "natural"
            keys = [_event_key(labels, e) for e in group]
            words: tuple[Word, ...] | None = None
            if all(k in aligned for k in keys):
                words = tuple((str(w), float(w0) - start / 8, float(w1) - start / 8)
                              for k in keys for w, w0, w1 in aligned[k])
            cases.append(Case(name, voice, audio, end / 8 - start / 8, tuple(pauses), kind,
                              words))
            if kind == "short":
                continue
            cuts = []
            for s0, s1 in segs:
                cuts += _word_gaps(clip, int(s0 * 8), int(s1 * 8), 3)
            tag = "cut"
            if not quiet_cuts and words is not None:
                cuts, tag = _snap_to_word_ends(cuts[:3], words), "wcut"
            for ci, cut in enumerate(cuts[:3]):
                for d in PAUSES_MS:
                    ins = _noise(d, level, rng)
                    a = np.concatenate([clip[:cut], ins, clip[cut:], _noise(TAIL_MS, level, rng)])

                    def shift(t: float, c: int = cut, d: float = d) -> float:
                        return t + d if t * 8 >= c else t

                    ps = [(shift(p0), shift(p1)) for p0, p1 in pauses]
                    ps.append((cut / 8, cut / 8 + d))
                    ws = None if words is None else tuple(
                        (w, shift(w0), shift(w1)) for w, w0, w1 in words)
                    cases.append(Case(f"{name}@{tag}{ci}+{d}", voice, a, end / 8 - start / 8 + d,
                                      tuple(sorted(ps)), "hesitation", ws))
    if espeak:
        cases += _espeak_cases(rng)
    return cases


def _espeak_cases(rng: np.random.Generator) -> list[Case]:
    from speech import EspeakSynthesizer

    out: list[Case] = []
    try:
        synth = EspeakSynthesizer(voice="en-gb-scotland+m4")
    except Exception as exc:  # noqa: BLE001 - eSpeak missing only drops these cases
        print(f"# eSpeak NG unavailable ({exc}); no synthetic short answers", file=sys.stderr)
        return out
    import asyncio

    aligner = Aligner()
    for text in ("No.", "Yes.", "Four one two seven."):
        x = ulaw_to_float32(asyncio.run(_render(synth, text)))
        nz = np.nonzero(np.abs(x) > 0.01)[0]
        x = x[: nz[-1] + 1] if len(nz) else x
        level = 10 ** (-60 / 20)
        audio = np.concatenate([_noise(400, level, rng), x, _noise(TAIL_MS, level, rng)])
        words = aligner.align(audio[: 400 * 8 + len(x) + _ALIGN_PAD_MS * 8],
                              " ".join(_TOKEN.findall(text.lower())))
        out.append(Case(f"espeak:{text}", "espeak", audio, 400 + len(x) / 8, (), "short",
                        tuple(words)))
    return out


async def _render(synth: Any, text: str) -> bytes:
    chunks = []
    async for chunk in synth.synthesize(text):  # mu-law, 8 kHz
        chunks.append(chunk)
    return b"".join(chunks)


async def score(cases: Sequence[Case]) -> list[Scored]:
    """Per case, the gateway's VAD chain verdict on each 32 ms window."""
    out = []
    async with VadEngine(runtime="onnx") as engine:
        for case in cases:
            stream = engine.open_stream(echo=EchoGateSettings())
            policy = BargeInPolicy()
            sc = Scored(case)
            for i in range(0, len(case.audio), 160):
                for r in stream.process_now(case.audio[i:i + 160]):
                    assert r.gate is not None and r.features is not None
                    # As the gateway steps its TurnDetector: caller windows of a speech turn.
                    caller = policy.is_caller(r.prob, r.gate, r.features)
                    policy.step(r.prob, r.gate, r.features, BotState.SILENT)
                    sc.speech.append(caller and policy.state is not PolicyState.IDLE)
            stream.close()
            out.append(sc)
    return out


Method = Callable[[Scored], list[tuple[float, float]]]
"""Per case, the turn ends decided: (ms of stream time, when the reply was started: the
turn_likely before it, or the end itself)."""


TextSource = Callable[[Scored], Sequence[tuple[float, str]]]
"""Per case, the partial transcripts a streaming recogniser would give the detector: (ms of
stream time from which it has it, the turn's words so far), in time order."""


def aligned_text(lag_ms: float = 0.0) -> TextSource:
    """The words the caller has said, from the forced alignment: each word from ``lag_ms`` after
    its aligned end (0: an oracle; a streaming recogniser's partial lags the audio by about a
    word: bench.turns' stub sends each word 250 ms after its end). No transcript: nothing."""
    def run(sc: Scored) -> list[tuple[float, str]]:
        ws = sc.case.words or ()
        return [(w1 + lag_ms, " ".join(w for w, _, _ in ws[: i + 1]))
                for i, (_, _, w1) in enumerate(ws)]
    return run


class PrefixRecogniser:
    """The shipped offline recogniser's text at each silence onset: pocketsphinx as
    ``speech._pocketsphinx_pool`` runs it by default (its decoder options, 8 -> 16 kHz, the
    whole prefix at once with batch normalisation) on the case's audio from its start to the
    onset, given to the detector ``latency_ms`` after the onset. Decodes are cached by the
    prefix audio's hash (the variants of a hesitation case share the audio before the cut)."""

    def __init__(self, latency_ms: float = 0.0) -> None:
        import pocketsphinx

        from speech._pocketsphinx import _DEFAULT_OPTIONS

        self._decoder = pocketsphinx.Decoder(**_DEFAULT_OPTIONS)
        self._cmninit = str(_DEFAULT_OPTIONS["cmninit"])
        self.latency_ms = latency_ms
        self.cache: dict[str, str] = {}
        self.decodes = 0

    def text(self, x: Floats) -> str:
        from audio import float32_to_pcm16, resample_pcm16
        from speech._pocketsphinx import _reset

        pcm = float32_to_pcm16(x)
        key = hashlib.sha1(pcm).hexdigest()
        if key not in self.cache:
            up, _ = resample_pcm16(pcm, from_rate=RATE, to_rate=16000)
            d = self._decoder
            _reset(d, self._cmninit)
            d.start_utt()
            d.process_raw(up, full_utt=True)
            d.end_utt()
            hyp = d.hyp()
            self.cache[key] = str(hyp.hypstr) if hyp is not None else ""
            self.decodes += 1
        return self.cache[key]

    def __call__(self, sc: Scored) -> list[tuple[float, str]]:
        # Decoded only at the onsets that are scored (inside a labelled pause, or at the end):
        # every onset would be 1,491 prefixes, 9,256 s of audio. Between them the text is the
        # last decoded one.
        out = []
        for k in range(1, len(sc.speech)):
            t = k * 32.0
            if sc.speech[k - 1] and not sc.speech[k] and (
                    t >= sc.case.end_ms - 150
                    or any(p0 - 100 <= t <= p1 for p0, p1 in sc.case.pauses)):
                out.append((t + self.latency_ms, self.text(sc.case.audio[: k * 256])))
        return out


ASR_PAUSES_MS = (500, 1000)
"""The pocketsphinx rows are scored on the natural turns and short answers and, of the
hesitation cases, those with these pauses only (a third: each decode is ~0.5 x the prefix on
one core)."""


def asr_subset(scored: Sequence[Scored]) -> list[Scored]:
    return [sc for sc in scored if sc.case.kind != "hesitation"
            or any(sc.case.name.endswith(f"+{d}") for d in ASR_PAUSES_MS)]


class EndOfSentenceLM:
    """log10 P(</s> | the last two words) from the pocketsphinx wheel's trigram model
    (en-us.lm.bin): how likely a sentence ends after the words so far. An experiment of the
    bench (``--lm``), not in the detector: it would need the model loaded in the gateway."""

    def __init__(self) -> None:
        import os

        import pocketsphinx

        path = os.path.join(pocketsphinx.get_model_path(), "en-us", "en-us.lm.bin")
        self._lm = pocketsphinx.NGramModel(pocketsphinx.Config(loglevel="FATAL"),
                                           pocketsphinx.LogMath(), path)
        self._to_log10 = math.log(1.0001) / math.log(10)  # the model's log base is 1.0001

    def __call__(self, text: str) -> float | None:
        words = _TOKEN.findall(text.lower())
        if not words:
            return None
        h = (["<s>", *words])[-2:]
        # NGramModel.prob([word, history newest first ...]), in logmath units.
        return float(self._lm.prob(["</s>", h[1], h[0]])) * self._to_log10


class _LMDetector(TurnDetector):
    """The detector with the text's binary cue replaced by ``weight`` * (the end-of-sentence
    log-probability - ``centre``): a bench experiment (``--lm``)."""

    def __init__(self, settings: TurnSettings, lm: EndOfSentenceLM, weight: float,
                 centre: float) -> None:
        super().__init__(replace(settings, weights=replace(settings.weights, text_done=0.0)))
        self._lm, self._w, self._c = lm, weight, centre

    def _estimate(self) -> EndEstimate:
        est = super()._estimate()
        score = self._lm(self._text)
        s = self.settings
        if score is None or s.mode == "silence" or est.text_hold or est.text_answer:
            return est
        z = math.log(max(est.p_end, 1e-12) / max(1 - est.p_end, 1e-12))
        z += self._w * (score - self._c)
        p_end = 1.0 / (1.0 + math.exp(-max(-30.0, min(30.0, z))))
        wait = s.patience * (s.min_wait_ms + (s.max_wait_ms - s.min_wait_ms) * (1.0 - p_end))
        return replace(est, p_end=p_end, wait_ms=wait)


def fit_lm_weight(train: Sequence[Scored], weights: ProsodyWeights,
                  lm: EndOfSentenceLM) -> tuple[float, float]:
    """(weight, centre) of the end-of-sentence log-probability, fitted as ``text_done`` is
    (prosody as a fixed offset, train onsets whose words do not end on a continuation word)."""
    off, x, y = [], [], []
    for sc in train:
        for t, det in _silence_onsets(sc):
            said = " ".join(w for w, _, w1 in sc.case.words or () if w1 <= t + TEXT_SETTLE_MS)
            label = _onset_label(sc, t)
            score = lm(said)
            if label is not None and score is not None and not text_flags(said)[1]:
                pos, slope, _ = det.features()
                off.append(weights.bias + weights.pitch_position * pos
                           + weights.pitch_slope * slope)
                x.append(score)
                y.append(1.0 if label else 0.0)
    o, xs, ys = np.array(off), np.array(x), np.array(y)
    centre = float(xs.mean())
    cw = np.where(ys > 0, 0.5 / max(ys.mean(), 1e-9), 0.5 / max(1 - ys.mean(), 1e-9))
    w = 0.0
    for _ in range(3000):
        p = 1 / (1 + np.exp(-(o + w * (xs - centre))))
        w -= 0.5 * float(np.sum(cw * (p - ys) * (xs - centre)) / len(ys))
    return round(w, 3), round(centre, 3)


class _DoneWaitDetector(TurnDetector):
    """A shorter wait where the text and the prosody both say the turn is done: a bench
    experiment (``--done-wait``; tried and dropped, docs/turns.md). With ``text_done``: ``cap``
    waits at most ``wait_ms`` when the prosody's own log-odds (bias, pitch, short turn; no
    text) are at least ``threshold``; ``floor`` puts ``wait_ms`` in place of ``min_wait_ms``."""

    def __init__(self, settings: TurnSettings, kind: str, wait_ms: float,
                 threshold: float = 0.0) -> None:
        super().__init__(settings)
        self._kind, self._wait, self._threshold = kind, wait_ms, threshold

    def _estimate(self) -> EndEstimate:
        est = super()._estimate()
        s, w = self.settings, self.settings.weights
        if s.mode == "silence" or not est.text_done:
            return est
        if self._kind == "floor":
            return replace(est, wait_ms=s.patience * (
                self._wait + (s.max_wait_ms - self._wait) * (1.0 - est.p_end)))
        z = w.bias + w.pitch_position * est.pitch_position + w.pitch_slope * est.pitch_slope
        z += w.short_turn if est.speech_ms <= s.short_turn_ms else 0.0
        if z < self._threshold:
            return est
        return replace(est, wait_ms=min(est.wait_ms, s.patience * self._wait))


DONE_WAIT_GRID = (
    *[("cap", float(ms), thr) for thr in (-0.5, 0.0, 0.5, 1.0, 1.5, 2.0) for ms in
      (300, 500, 700)],
    *[("floor", float(ms), 0.0) for ms in (200, 300, 400, 500, 600, 700)],
)
"""``--done-wait``'s candidates: (kind, wait_ms, prosody threshold in log-odds)."""


def done_wait_methods(settings: TurnSettings, text: TextSource) -> list[tuple[str, Method]]:
    out = []
    for kind, ms, thr in DONE_WAIT_GRID:
        def make(kind: str = kind, ms: float = ms, thr: float = thr) -> TurnDetector:
            return _DoneWaitDetector(settings, kind, ms, thr)

        label = (f"text_done and prosody log-odds >= {thr:g}: wait <= {ms:g} ms"
                 if kind == "cap" else f"text_done: wait floor {ms:g} ms")
        out.append((label, detector_method(settings, text, make)))
    return out


PitchTables = dict[str, list[float | None]]
"""Per case name, each window's pitch in semitones as the detector reads it (None: not voiced
or not a caller window): ``pitch_tables``."""


def pitch_tables(scored: Sequence[Scored]) -> PitchTables:
    """What ``TurnDetector`` appends to its pitch history at each caller window of each case,
    computed once: a window's pitch depends on the audio fed so far, never on the weights or
    the detector's state, so the weight search (``fit_model``) replays it."""

    out: PitchTables = {}
    for sc in scored:
        det = TurnDetector()
        row: list[float | None] = []
        for k, speech in enumerate(sc.speech):
            end = (k + 1) * 256
            det.feed(sc.case.audio[k * 256:end])
            # What TurnDetector._on_speech reads of a caller window (the ring is the audio fed).
            row.append(det._window_semitones(end) if speech else None)  # noqa: SLF001
        out[sc.case.name] = row
    return out


class _ReplayDetector(TurnDetector):
    """``TurnDetector`` with each window's pitch read from ``pitch_tables`` and the prosody
    summary cached by the pitch history it summarises: the same decisions (tests/turns/
    test_turn_fit.py), about ten times sooner, for the search that runs the detector for every
    candidate weight and wait."""

    def __init__(self, settings: TurnSettings, pitch: list[float | None],
                 memo: dict[tuple[float, ...], tuple[float, float]]) -> None:
        super().__init__(settings)
        self._table, self._memo = pitch, memo

    def feed(self, samples: npt.ArrayLike) -> None:
        self._fed += len(np.asarray(samples).ravel())  # the ring is not read: the table is

    def _window_semitones(self, end: int) -> float | None:
        return self._table[end // 256 - 1]

    def _prosody(self) -> tuple[float, float]:
        key = tuple(self._pitch)
        got = self._memo.get(key)
        if got is None:
            got = self._memo[key] = super()._prosody()
        return got


def detector_method(settings: TurnSettings, text: TextSource | None = None,
                    make: Callable[[], TurnDetector] | None = None,
                    pitch: PitchTables | None = None) -> Method:
    """The detector stepped over a case's verdicts (``make``: another detector; ``pitch``: the
    replay of ``pitch_tables``, the same decisions sooner)."""
    if pitch is not None and make is not None:
        raise ValueError("detector_method: give make or pitch, not both (the replay is a TurnDetector)")
    memo: dict[tuple[float, ...], tuple[float, float]] = {}

    def run(sc: Scored) -> list[tuple[float, float]]:
        if pitch is not None:
            det: TurnDetector = _ReplayDetector(settings, pitch[sc.case.name], memo)
        else:
            det = make() if make is not None else TurnDetector(settings)
        ends: list[tuple[float, float]] = []
        likely: float | None = None
        partials = list(text(sc)) if text is not None else []
        i, current, fed = 0, "", ""
        for k, speech in enumerate(sc.speech):
            end = (k + 1) * 256
            det.feed(sc.case.audio[k * 256:end])
            idle = det.state is TurnState.IDLE
            d = det.step(speech, end)
            if idle and det.state is not TurnState.IDLE:
                fed = ""  # a new turn forgot the text: give it again
            if d is TurnDecision.TURN_LIKELY:
                likely = end / 8
            elif d is TurnDecision.TURN_CONTINUED:
                likely = None
            elif d is TurnDecision.TURN_END:
                ends.append((end / 8, likely if likely is not None else end / 8))
                likely = None
                det.new_turn()
                fed = ""
            # The partial as of this window's end, for the next window. After a false end
            # the text stays the whole turn's (the gateway merges the turn once the caller
            # resumes).
            while i < len(partials) and partials[i][0] <= end / 8:
                current = partials[i][1]
                i += 1
            if current != fed and det.state is not TurnState.IDLE:
                det.set_transcript(current)
                fed = current
        return ends
    return run


TEXT_SETTLE_MS = 150.0
"""For fitting the text weight: the words aligned to end up to this long after a silence onset
count as said before it (the VAD lets go inside a weak last word; no word after a pause of
at least 200 ms ends this soon). The detector re-estimates when a later partial comes."""


def features_at_pauses(sc: Scored, with_text: bool = False
                       ) -> list[tuple[tuple[float, ...], bool]]:
    """The prosody model's inputs at each silence onset of a case, with whether the turn really
    ended there (for fitting). The detector never ends the turn here, so the inputs do not depend
    on the weights being fitted (a case is one turn). ``with_text``: two more inputs, whether
    the words so far end on a word a sentence can end on, and on a continuation word (both 0
    without a transcript)."""
    rows: list[tuple[tuple[float, ...], bool]] = []
    for t, det in _silence_onsets(sc):
        f: tuple[float, ...] = det.features()
        if with_text:
            said = [w for w, _, w1 in sc.case.words or () if w1 <= t + TEXT_SETTLE_MS]
            f = (*f, *text_flags(" ".join(said)))
        label = _onset_label(sc, t)
        if label is not None:
            rows.append((f, label))
    return rows


def _silence_onsets(sc: Scored) -> Iterator[tuple[float, TurnDetector]]:
    """(ms, the detector fed up to there) at each silence onset of a case: a detector that never
    ends the turn, stepped over the case's VAD verdicts."""
    det = TurnDetector(TurnSettings(mode="silence", silence_ms=math.inf, early_ms=0))
    prev = False
    for k, speech in enumerate(sc.speech):
        end = (k + 1) * 256
        det.feed(sc.case.audio[k * 256:end])
        if prev and not speech:
            yield k * 32.0, det
        det.step(speech, end)
        prev = speech


def _onset_label(sc: Scored, t: float) -> bool | None:
    """A silence onset at ``t`` ms: in an inserted pause (False), at the turn's end (True), or
    neither (None, not used)."""
    if any(p0 - 100 <= t <= p1 for p0, p1 in sc.case.pauses):
        return False
    return True if t >= sc.case.end_ms - 150 else None


@dataclass(frozen=True, slots=True)
class Outcome:
    pauses: int = 0
    false_ends: int = 0
    pauses_1s: int = 0
    false_ends_1s: int = 0
    turns: int = 0
    turns_false: int = 0  # turns with a false end in a pause of <= 1 s
    delays: tuple[float, ...] = ()
    missed: int = 0
    audible_1s: int = 0  # false ends whose reply would be heard before the caller resumed


REPLY_MS = 700.0
"""From sending the transcript to the reply's first audio with the default provider latencies
(final transcript 150 ms after the upload, first LLM token 350 ms, first TTS byte 200 ms). The
reply is heard at max(turn end, reply started + this): a false end is *heard* only if the
caller's pause outlasts that, since the gateway drops a reply the caller has not heard when the
caller goes on (docs/turns.md)."""


def evaluate(scored: Sequence[Scored], method: Method, reply_ms: float = REPLY_MS) -> Outcome:
    o = Outcome()
    pauses = false = p1 = f1 = turns_false = missed = audible = 0
    delays = []
    for sc in scored:
        decided = method(sc)
        ends = [t for t, _ in decided]
        bad = False
        for p0, p1_ in sc.case.pauses:
            hit = any(p0 <= t <= p1_ + 32 for t in ends)
            pauses += 1
            false += hit
            if p1_ - p0 <= 1000:
                p1 += 1
                f1 += hit
                audible += any(p0 <= t and max(t, s + reply_ms) < p1_ for t, s in decided)
                bad = bad or hit
        turns_false += bad
        # The end decided after the caller's last speech (earlier ends are in pauses).
        if ends and ends[-1] > sc.case.end_ms - 300:
            delays.append(ends[-1] - sc.case.end_ms)
        else:
            missed += 1
    return replace(o, pauses=pauses, false_ends=false, pauses_1s=p1, false_ends_1s=f1,
                   turns=len(scored), turns_false=turns_false, delays=tuple(delays),
                   missed=missed, audible_1s=audible)


def fit_logistic(rows: Sequence[tuple[tuple[float, ...], bool]],
                 short_turn: float) -> ProsodyWeights:
    """Logistic regression of "the turn ended here" on (pitch position, pitch slope), ends and
    pauses weighted equally (pauses outnumber ends), a little L2; the short-turn term is kept as
    given (a prior: too few short answers to fit)."""
    x = np.array([r[0][:2] for r in rows], dtype=np.float64)
    y = np.array([1.0 if r[1] else 0.0 for r in rows])
    mu, sd = x.mean(axis=0), x.std(axis=0) + 1e-9
    zb = np.hstack([np.ones((len(x), 1)), (x - mu) / sd])
    w = np.zeros(zb.shape[1])
    cw = np.where(y > 0, 0.5 / max(y.mean(), 1e-9), 0.5 / max(1 - y.mean(), 1e-9))
    for _ in range(3000):
        p = 1 / (1 + np.exp(-zb @ w))
        w -= 0.5 * (zb.T @ (cw * (p - y)) / len(y) + 0.01 * np.r_[0, w[1:]])
    coef = w[1:] / sd
    bias = w[0] - float(np.sum(w[1:] * mu / sd))
    return ProsodyWeights(bias=round(float(bias), 3), pitch_position=round(float(coef[0]), 3),
                          pitch_slope=round(float(coef[1]), 4), short_turn=short_turn)


def text_flags(text: str) -> tuple[float, float]:
    """(ends on a word a sentence can end on, ends on a continuation word) as the detector
    reads a partial (0, 0 for no words or a complete short answer)."""
    from vad._turn import _complete_answer, _ends_unfinished

    hold = _ends_unfinished(text)
    done = bool(text.split()) and not hold and not _complete_answer(text)
    return float(done), float(hold)


def fit_text_weight(rows: Sequence[tuple[tuple[float, ...], bool]],
                    weights: ProsodyWeights) -> ProsodyWeights:
    """The ``text_done`` log-odds: logistic regression of "the turn ended here" on the text
    flag with the prosody model's score as a fixed offset, over the silence onsets whose words
    do not end on a continuation word (those wait ``text_wait_ms`` regardless; onsets with no
    words yet are the flag's 0), ends and pauses weighted equally."""
    use = [r for r in rows if r[0][4] == 0]
    if not use or len({r[1] for r in use}) < 2 or not any(r[0][3] for r in use):
        # No words (turn_words.json missing) or one class only: refuse rather than write 0 or
        # NaN into vad/_turn.py's defaults.
        raise SystemExit("bench.turn_end --fit: no transcripts to fit the text weight on "
                         "(run python -m bench.turn_end --align first)")
    off = np.array([weights.bias + weights.pitch_position * r[0][0]
                    + weights.pitch_slope * r[0][1] for r in use])
    x = np.array([r[0][3] for r in use])
    y = np.array([1.0 if r[1] else 0.0 for r in use])
    cw = np.where(y > 0, 0.5 / max(y.mean(), 1e-9), 0.5 / max(1 - y.mean(), 1e-9))
    w = 0.0
    for _ in range(3000):
        p = 1 / (1 + np.exp(-(off + w * x)))
        w -= 0.5 * float(np.sum(cw * (p - y) * x) / len(y))
    return replace(weights, text_done=round(w, 3))


def auc(rows: Sequence[tuple[tuple[float, ...], bool]], weights: ProsodyWeights) -> float:
    """ROC AUC of the model's score: ends against pauses (with the text weight where the rows
    carry the text flags)."""
    s = [weights.pitch_position * r[0][0] + weights.pitch_slope * r[0][1]
         + (weights.text_done * r[0][3] if len(r[0]) > 3 else 0.0) for r in rows]
    pos = [v for v, r in zip(s, rows, strict=True) if r[1]]
    neg = [v for v, r in zip(s, rows, strict=True) if not r[1]]
    if not pos or not neg:
        return math.nan
    return float(np.mean([(p > n) + 0.5 * (p == n) for p in pos for n in neg]))


def fit_key(o: Outcome, max_false: float = 0.02) -> tuple[float, float]:
    """What a fit minimises: the audible false ends on pauses of at most 1 s, counted only
    above ``max_false``, then the median delay."""
    return max(o.audible_1s / max(1, o.pauses_1s), max_false), _pct(o.delays, 50)


MIN_WAITS_MS = (200, 300, 400, 500, 600, 800)
MAX_WAITS_MS = (700, 1000, 1300, 1600, 2000, 2400)
"""The waits' grid (``fit_waits``; ``search_weights`` steps along it)."""


def fit_waits(scored: Sequence[Scored], base: TurnSettings,
              max_false: float = 0.02, pitch: PitchTables | None = None) -> TurnSettings:
    """The (min_wait_ms, max_wait_ms) with the lowest median delay whose audible false ends on
    pauses of at most 1 s stay within ``max_false`` (else the fewest)."""
    best: tuple[float, float, TurnSettings] | None = None
    for lo in MIN_WAITS_MS:
        for hi in MAX_WAITS_MS:
            if hi < lo:
                continue
            st = replace(base, min_wait_ms=float(lo), max_wait_ms=float(hi))
            key = fit_key(evaluate(scored, detector_method(st, pitch=pitch)), max_false)
            if best is None or key < best[:2]:
                best = (*key, st)
    assert best is not None
    return best[2]


FIT_FILE = Path(__file__).resolve().parent.parent / "vad" / "turn_fit.json"
"""The shipped fit (``--fit`` writes it): the weights and waits ``vad._turn`` has as defaults,
what they scored on the train voices, and the VAD chain's verdicts on the train turns it was
fitted from (tests/turns/test_turn_fit.py holds the three together)."""


def pack_verdicts(speech: Sequence[bool]) -> str:
    """One case's per-window verdicts as ``"<windows>:<hex of the bits>"``."""
    bits = np.packbits(np.asarray(speech, dtype=bool))
    return f"{len(speech)}:{bits.tobytes().hex()}"


def unpack_verdicts(packed: str) -> list[bool]:
    n, hexbits = packed.split(":")
    bits = np.unpackbits(np.frombuffer(bytes.fromhex(hexbits), dtype=np.uint8))
    return [bool(b) for b in bits[: int(n)]]


def verdicts_digest(scored: Sequence[Scored]) -> str:
    """sha256 of the cases' names and verdicts, in order: what the fit was made from."""
    h = hashlib.sha256()
    for sc in scored:
        h.update(f"{sc.case.name}={pack_verdicts(sc.speech)}\n".encode())
    return h.hexdigest()


def _figures(o: Outcome) -> dict[str, Any]:
    return {"pauses_1s": o.pauses_1s, "false_ends_1s": o.false_ends_1s,
            "audible_1s": o.audible_1s, "pauses": o.pauses, "false_ends": o.false_ends,
            "delay_p50": round(_pct(o.delays, 50), 1), "delay_p95": round(_pct(o.delays, 95), 1),
            "missed": o.missed, "turns": o.turns}


SEARCH_STEPS = {"bias": 0.125, "pitch_position": 0.125, "pitch_slope": 0.0025}
"""``search_weights``' step per weight (the waits step along their grid)."""
SEARCH_ROUNDS = 60
TEXT_DONE_GRID = tuple(round(0.1 * i, 1) for i in range(21))
"""``fit_text_done``'s candidates, with the logistic estimate (0 to 2 log-odds)."""


def _key_list(key: tuple[float, float]) -> list[float]:
    return [round(key[0], 5), round(key[1], 1)]


def search_weights(train: Sequence[Scored], start: TurnSettings, pitch: PitchTables,
                   max_false: float = 0.02) -> tuple[TurnSettings, dict[str, Any]]:
    """The prosody weights and the waits chosen together by the waits' own criterion
    (``fit_key``: audible false ends on pauses of at most 1 s within ``max_false``, then the
    lowest median delay), no transcript: a steepest-descent coordinate search from ``start``
    (the logistic fit and the waits ``fit_waits`` gives it), one step of ``SEARCH_STEPS`` (the
    waits: one grid step) up or down per coordinate, the best neighbour taken while it is
    strictly better (ties: the first in order), at most ``SEARCH_ROUNDS`` rounds.
    Deterministic. Returns the pick and a record of the search for vad/turn_fit.json."""
    los, his = [float(v) for v in MIN_WAITS_MS], [float(v) for v in MAX_WAITS_MS]
    seen: dict[tuple[float, ...], tuple[float, float]] = {}

    def point(st: TurnSettings) -> tuple[float, ...]:
        w = st.weights
        return (w.bias, w.pitch_position, w.pitch_slope, st.min_wait_ms, st.max_wait_ms)

    def key(st: TurnSettings) -> tuple[float, float]:
        p = point(st)
        if p not in seen:
            seen[p] = fit_key(evaluate(train, detector_method(st, pitch=pitch)), max_false)
        return seen[p]

    def neighbours(st: TurnSettings) -> Iterator[TurnSettings]:
        w = st.weights
        for name, step in SEARCH_STEPS.items():
            for sign in (-1, 1):
                value = round(getattr(w, name) + sign * step, 4)
                yield replace(st, weights=replace(w, **{name: value}))
        i, j = los.index(st.min_wait_ms), his.index(st.max_wait_ms)
        for lo, hi in ((i - 1, j), (i + 1, j), (i, j - 1), (i, j + 1)):
            if 0 <= lo < len(los) and 0 <= hi < len(his) and los[lo] <= his[hi]:
                yield replace(st, min_wait_ms=los[lo], max_wait_ms=his[hi])

    best, rounds = start, 0
    start_key = key(start)
    while rounds < SEARCH_ROUNDS:
        cands = [(key(c), i, c) for i, c in enumerate(neighbours(best))]
        k, _, cand = min(cands, key=lambda t: (t[0], t[1]))
        if k >= key(best):
            break
        best, rounds = cand, rounds + 1
    return best, {"criterion": "fit_key, no transcript", "start": {
        "bias": start.weights.bias, "pitch_position": start.weights.pitch_position,
        "pitch_slope": start.weights.pitch_slope, "min_wait_ms": start.min_wait_ms,
        "max_wait_ms": start.max_wait_ms, "key": _key_list(start_key)},
        "key": _key_list(key(best)), "rounds": rounds, "evaluated": len(seen)}


def fit_text_done(train: Sequence[Scored], settings: TurnSettings, pitch: PitchTables,
                  logistic: float, max_false: float = 0.02) -> tuple[float, dict[str, Any]]:
    """``text_done`` by the same criterion, with the partials ``FIT_LAG_MS`` late and the
    prosody and waits held: the best of ``TEXT_DONE_GRID`` and the logistic estimate (ties:
    the nearest the logistic estimate)."""
    text = aligned_text(FIT_LAG_MS)
    keys = {}
    for v in sorted({*TEXT_DONE_GRID, logistic}):
        st = replace(settings, weights=replace(settings.weights, text_done=v))
        keys[v] = fit_key(evaluate(train, detector_method(st, text, pitch=pitch)), max_false)
    pick = min(keys, key=lambda v: (keys[v], abs(v - logistic)))
    return pick, {"criterion": f"fit_key, partials {FIT_LAG_MS:g} ms late", "logistic": logistic,
                  "logistic_key": _key_list(keys[logistic]), "key": _key_list(keys[pick])}


def fit_model(train: Sequence[Scored], base: TurnSettings | None = None) -> dict[str, Any]:
    """The whole fit from the train turns' verdicts: the logistic weights and the waits' grid
    as the start, then the weights and waits together by the waits' criterion
    (``search_weights``), then the text's weight by it (``fit_text_done``); deterministic
    (fixed iterations, fixed grids and steps), so the same verdicts give the same file."""
    base = base or TurnSettings()
    if any(sc.case.split != "train" for sc in train):
        raise ValueError("fit on the train voices only")
    rows = [r for sc in train for r in features_at_pauses(sc)]
    pitch = pitch_tables(train)
    weights = fit_logistic(rows, base.weights.short_turn)
    start = fit_waits(train, replace(base, weights=weights), pitch=pitch)
    settings, search = search_weights(train, start, pitch)
    # Then the text's weight on top, the prosody held: without a transcript (the offline
    # recogniser, uploads) the detector is the prosody model as chosen above.
    text_rows = [r for sc in train for r in features_at_pauses(sc, with_text=True)]
    logistic = fit_text_weight(text_rows, settings.weights).text_done
    text_done, text_search = fit_text_done(train, settings, pitch, logistic)
    weights = replace(settings.weights, text_done=text_done)
    settings = replace(settings, weights=weights)
    return {
        "search": search, "text_search": text_search,
        "weights": {"bias": weights.bias, "pitch_position": weights.pitch_position,
                    "pitch_slope": weights.pitch_slope, "text_done": weights.text_done,
                    "short_turn": weights.short_turn},
        "min_wait_ms": settings.min_wait_ms, "max_wait_ms": settings.max_wait_ms,
        "train": {"auc": round(auc(rows, weights), 4), "silence_onsets": len(rows),
                  "true_ends": sum(r[1] for r in rows),
                  **_figures(evaluate(train, detector_method(settings)))},
        "train_text": {"auc": round(auc(text_rows, weights), 4), "lag_ms": FIT_LAG_MS,
                       "onsets_with_words": sum(r[0][3] + r[0][4] > 0 for r in text_rows),
                       **_figures(evaluate(train, detector_method(
                           settings, aligned_text(FIT_LAG_MS))))},
        "source": {"split": "train", "voices": sorted({sc.case.voice for sc in train}),
                   "turns": len(train), "verdicts_sha256": verdicts_digest(train),
                   "verdicts": {sc.case.name: pack_verdicts(sc.speech) for sc in train}},
    }


FIT_LAG_MS = 250.0
"""The fit's train figures with text give the detector each word this long after its aligned
end (a streaming recogniser's lag; bench.turns' stub sends each word's partial this long after
its end, ``Latencies.partial_lag_ms``)."""


TURN_SOURCE = Path(__file__).resolve().parent.parent / "vad" / "_turn.py"
_DEFAULTS = {"ProsodyWeights": ("bias", "pitch_position", "pitch_slope", "text_done"),
             "TurnSettings": ("min_wait_ms", "max_wait_ms")}


def with_fitted_defaults(source: str, fit: dict[str, Any]) -> str:
    """``vad/_turn.py``'s text with the fit's values as the defaults of ``ProsodyWeights``'
    weights and ``TurnSettings``' waits (the ``name: float = value`` line of each field in its
    class body), so that ``--fit`` is the whole refit. Raises if a field's line is not found."""
    values = {**fit["weights"], "min_wait_ms": fit["min_wait_ms"],
              "max_wait_ms": fit["max_wait_ms"]}
    out = source
    for cls, names in _DEFAULTS.items():
        start = out.index(f"\nclass {cls}")
        end = out.find("\nclass ", start + 1)
        body = out[start:end if end >= 0 else len(out)]
        for name in names:
            value = float(values[name])
            body, n = re.subn(rf"(?m)^(    {name}: float = )[-+0-9.e]+$",
                              lambda m: f"{m.group(1)}{value!r}", body)  # noqa: B023 - now
            if n != 1:
                raise ValueError(f"{cls}.{name}: no single default line in vad/_turn.py")
        out = out[:start] + body + (out[end:] if end >= 0 else "")
    return out


def fitted_settings(fit: dict[str, Any], base: TurnSettings | None = None) -> TurnSettings:
    base = base or TurnSettings()
    return replace(base, weights=ProsodyWeights(**fit["weights"]),
                   min_wait_ms=fit["min_wait_ms"], max_wait_ms=fit["max_wait_ms"])


def _pct(v: Sequence[float], q: float) -> float:
    return float(np.percentile(v, q)) if v else math.nan


def _frac(a: int, b: int) -> str:
    return f"{a}/{b} ({100 * a / max(1, b):.1f}%)"


def row(name: str, o: Outcome) -> str:
    return (f"| {name} | {_frac(o.false_ends_1s, o.pauses_1s)}"
            f" | {_frac(o.audible_1s, o.pauses_1s)}"
            f" | {o.false_ends}/{o.pauses} | {_frac(o.turns_false, o.turns)}"
            f" | {_pct(o.delays, 50):.0f} ms | {_pct(o.delays, 95):.0f} ms | {o.missed} |")


HEADER = ("| method | false ends, pauses <= 1 s | ... heard (reply 700 ms after it started) | "
          "false ends, all pauses (to 1.5 s) | turns with a false end (<= 1 s) | delay p50 | "
          "delay p95 | no end |\n|---|---|---|---|---|---|---|---|")


class SmartTurn:
    """Pipecat's smart-turn v3 read out of its wheel (ONNX + its numpy Whisper features), run as
    Pipecat runs it: on the turn's audio (the last 8 s, 16 kHz) once the VAD has been quiet for
    ``stop_ms``; "complete" (p > 0.5) ends the turn there, else the turn ends after
    ``timeout_ms`` of silence (Pipecat's stop_secs, 3 s by default)."""

    def __init__(self, wheel: Path) -> None:
        import onnxruntime as ort

        with zipfile.ZipFile(wheel) as z:
            names = z.namelist()
            onnx = next(n for n in names if n.endswith(".onnx") and "smart-turn" in n)
            feat_src = z.read(next(n for n in names
                                   if n.endswith("smart_turn/_whisper_features.py")))
            model = z.read(onnx)
        ns: dict[str, Any] = {}
        # The wheel's own numpy feature code, run as is (no pipecat import, nothing installed).
        exec(compile(feat_src, "_whisper_features.py", "exec"), ns)  # noqa: S102
        self._features = ns["compute_whisper_log_mel_features"]
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        self._session = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
        self.model = Path(onnx).name
        self.infer_ms: list[float] = []

    def probability(self, audio8k: Floats) -> float:
        x = audio8k.astype(np.float64)
        n = len(x)
        # 8 -> 16 kHz: FFT interpolation (band-limited; the phone band is all there is anyway).
        spec = np.fft.rfft(x)
        y = np.fft.irfft(spec, 2 * n) * 2
        y = y[-8 * 16000:]
        if len(y) < 8 * 16000:
            y = np.pad(y, (8 * 16000 - len(y), 0))
        t0 = time.perf_counter()
        mel = self._features(y.astype(np.float32), do_normalize=True)
        out = self._session.run(None, {"input_features": mel[None].astype(np.float32)})
        self.infer_ms.append((time.perf_counter() - t0) * 1000)
        return float(np.asarray(out[0]).ravel()[0])

    def method(self, stop_ms: float = 200.0, timeout_ms: float = 3000.0) -> Method:
        def run(sc: Scored) -> list[tuple[float, float]]:
            ends: list[tuple[float, float]] = []
            start: int | None = None
            quiet = 0.0
            verdict: bool | None = None
            for k, speech in enumerate(sc.speech):
                if speech:
                    if start is None:
                        start = max(0, k * 256 - 200 * 8)
                    quiet = 0.0
                    verdict = None
                    continue
                if start is None:
                    continue
                quiet += 32.0
                if verdict is None and quiet >= stop_ms:
                    verdict = self.probability(sc.case.audio[start:(k + 1) * 256]) > 0.5
                if (verdict and quiet >= stop_ms) or quiet >= timeout_ms:
                    ends.append(((k + 1) * 32.0, (k + 1) * 32.0))
                    start, verdict, quiet = None, None, 0.0
            return ends
        return run


def _print_splits(scored: Sequence[Scored], methods: Sequence[tuple[str, Method]], title: str,
                  key: str, report: dict[str, Any]) -> None:
    """Each method's row on the train, then the check turns; figures in ``report[split+key]``."""
    for split in ("train", "check"):
        part = [sc for sc in scored if sc.case.split == split]
        print(f"\n## {split} voices, {title}\n\n{HEADER}")
        for name, m in methods:
            o = evaluate(part, m)
            print(row(name, o), flush=True)
            report.setdefault(f"{split}{key}", {})[name] = _figures(o)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.turn_end",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--fit", action="store_true",
                    help="refit the model on the train voices: write vad/turn_fit.json and "
                    "the defaults in vad/_turn.py (the whole refit)")
    ap.add_argument("--fit-out", type=Path, metavar="JSON",
                    help="with --fit: write the fit here instead of vad/turn_fit.json")
    ap.add_argument("--smart-turn", type=Path, metavar="WHEEL",
                    help="a pipecat_ai-*.whl: also evaluate its smart-turn v3 model")
    ap.add_argument("--no-espeak", action="store_true", help="no synthetic short answers")
    ap.add_argument("--quiet-cuts", action="store_true",
                    help="insert the hesitation pauses at the quietest 40 ms of a segment (often "
                    "a stop closure inside a word), not at the nearest aligned word end: the "
                    "placement before session 9; not with --fit")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    ap.add_argument("--patience", type=float, nargs="*", default=[],
                    help="also score the prosody detector with these turn.patience values")
    ap.add_argument("--lag-ms", type=float, default=250.0,
                    help="the streaming recogniser's lag: a word reaches the detector this long "
                    "after its aligned end (default 250, as bench.turns' stub)")
    ap.add_argument("--asr-ms", type=float, default=0.0,
                    help="pocketsphinx text reaches the detector this long after the silence "
                    "onset it was decoded at (default 0: as if it decoded as the audio came)")
    ap.add_argument("--asr-cache", type=Path, metavar="JSON",
                    help="keep pocketsphinx's decodes here (by the prefix audio's sha1) for reruns")
    ap.add_argument("--no-pocketsphinx", action="store_true",
                    help="no pocketsphinx rows (they decode every prefix: minutes)")
    ap.add_argument("--lm", action="store_true",
                    help="also try the pocketsphinx trigram's end-of-sentence probability as "
                    "the text cue (an experiment: fitted on train, reported on both)")
    ap.add_argument("--lm-waits", type=float, nargs=2, action="append", default=[],
                    metavar=("MIN", "MAX"), help="with --lm: also these waits (repeatable)")
    ap.add_argument("--done-wait", action="store_true",
                    help="also try a shorter wait where the text and the prosody both say done "
                    "(an experiment: candidates picked on train as --fit picks, reported on both)")
    ap.add_argument("--align", action="store_true",
                    help="force-align the labels' texts and write bench/data/turn_words.json")
    ap.add_argument("--cut-levels", action="store_true",
                    help="print where the standard hesitation cuts fall (inside a word or "
                    "not, their level against the turn's word gaps) and exit")
    ap.add_argument("--scored", type=Path, help=argparse.SUPPRESS)  # a pickle of score(): reruns
    args = ap.parse_args(argv)
    if args.fit and args.quiet_cuts:
        print("error: --fit is made on the standard cases, not with --quiet-cuts",
              file=sys.stderr)
        return 2
    if args.smart_turn is not None and not args.smart_turn.is_file():
        print(f"error: --smart-turn: no such wheel {args.smart_turn}", file=sys.stderr)
        return 2
    import asyncio

    if args.cut_levels:
        levels = cut_levels()
        for c in levels:
            print(json.dumps(c))
        inside = [c for c in levels if c["inside_word"]]
        gaps = [g for c in levels for g in c["gap_db"]]
        print(f"# {len(inside)} of {len(levels)} cuts inside a word; cut level median "
              f"{np.median([c['cut_db'] for c in levels]):.1f} dB (inside a word "
              f"{np.median([c['cut_db'] for c in inside]):.1f}), word gaps median "
              f"{np.median(gaps):.1f} dB (n={len(gaps)}), below the turn's loudest 40 ms")
        return 0
    if args.align:
        words = align_recordings()
        WORDS_FILE.write_text(json.dumps(words, indent=0, sort_keys=True) + "\n")
        print(f"# {sum(len(v) for v in words.values())} words of {len(words)} speech events "
              f"aligned; written to {WORDS_FILE}")
    t0 = time.perf_counter()
    if args.scored is not None and args.scored.exists():
        import pickle

        scored = pickle.loads(args.scored.read_bytes())  # noqa: S301 - our own file
        cases = [sc.case for sc in scored]
    else:
        cases = build_cases(espeak=not args.no_espeak, quiet_cuts=args.quiet_cuts)
        scored = asyncio.run(score(cases))
        if args.scored is not None:
            import pickle

            args.scored.write_bytes(pickle.dumps(scored))
    print(f"# {len(cases)} turns ({sum(c.split == 'train' for c in cases)} train, "
          f"{sum(c.split == 'check' for c in cases)} check), "
          f"VAD in {time.perf_counter() - t0:.1f} s")
    settings = TurnSettings()
    rows = {split: [r for sc in scored if sc.case.split == split for r in features_at_pauses(sc)]
            for split in ("train", "check")}
    train = [sc for sc in scored if sc.case.split == "train"]
    if FIT_FILE.exists() and not args.quiet_cuts:
        shipped = json.loads(FIT_FILE.read_text())["source"]["verdicts_sha256"]
        if shipped != verdicts_digest(train):
            print("# the VAD chain's verdicts on the train turns are not the ones the shipped "
                  f"model was fitted on ({FIT_FILE.name}): refit with --fit")
    if args.fit:
        fit = fit_model(train, settings)
        settings = fitted_settings(fit, settings)
        check = [sc for sc in scored if sc.case.split == "check"]
        fit["check_reported"] = {"auc": round(auc(rows["check"], settings.weights), 4),
                                 **_figures(evaluate(check, detector_method(settings)))}
        check_text = [r for sc in check for r in features_at_pauses(sc, with_text=True)]
        fit["check_reported_text"] = {
            "auc": round(auc(check_text, settings.weights), 4), "lag_ms": FIT_LAG_MS,
            **_figures(evaluate(check, detector_method(settings, aligned_text(FIT_LAG_MS))))}
        out = args.fit_out or FIT_FILE
        out.write_text(json.dumps(fit, indent=1, sort_keys=True) + "\n")
        if args.fit_out is None:  # the shipped fit: the code's defaults follow it
            TURN_SOURCE.write_text(with_fitted_defaults(TURN_SOURCE.read_text(), fit))
            print(f"# the defaults in {TURN_SOURCE.name} are the fit's now")
        print(f"# fitted on {fit['train']['silence_onsets']} silence onsets of the train voices "
              f"({fit['train']['true_ends']} true ends): {settings.weights}, "
              f"min_wait_ms={settings.min_wait_ms}, max_wait_ms={settings.max_wait_ms}; "
              f"written to {out}")
    print("# model ROC AUC (ends vs pauses): " + ", ".join(
        f"{k} {auc(v, settings.weights):.2f} (n={len(v)})" for k, v in rows.items()))
    text_rows = {split: [r for sc in scored if sc.case.split == split
                         for r in features_at_pauses(sc, with_text=True)]
                 for split in ("train", "check")}
    print("# with the aligned words (text_done): " + ", ".join(
        f"{k} {auc(v, settings.weights):.2f}" for k, v in text_rows.items()))
    methods: list[tuple[str, Method]] = [
        (f"silence {ms} ms", detector_method(TurnSettings(mode="silence", silence_ms=ms,
                                                          early_ms=0)))
        for ms in (300, 500, 700, 1000, 1200)
    ]
    methods.append((f"prosody (min {settings.min_wait_ms:.0f}, max {settings.max_wait_ms:.0f} ms)",
                    detector_method(settings)))
    for patience in (1.3, *args.patience):
        methods.append((f"prosody, patience {patience:g}",
                        detector_method(replace(settings, patience=patience))))
    methods.append(("prosody, no early start", detector_method(replace(settings, early_ms=0))))
    lag = args.lag_ms
    texts: list[tuple[str, TextSource]] = [("oracle text", aligned_text()),
                                           (f"text {lag:g} ms late", aligned_text(lag))]
    cues_only = replace(settings, weights=replace(settings.weights, text_done=0.0))
    for label, source in texts:
        methods.append((f"prosody + {label}, hold/answer cues only",
                        detector_method(cues_only, source)))
        methods.append((f"prosody + {label}, text_done {settings.weights.text_done:g}",
                        detector_method(settings, source)))
    smart = SmartTurn(args.smart_turn) if args.smart_turn else None
    if smart is not None:
        methods.append((f"smart-turn {smart.model} (stop 200 ms, timeout 3 s)", smart.method()))
    report: dict[str, Any] = {}
    for split in ("train", "check"):
        part = [sc for sc in scored if sc.case.split == split]
        print(f"\n## {split} voices: {len(part)} turns, "
              f"{sum(len(sc.case.pauses) for sc in part)} pauses\n\n{HEADER}")
        for name, m in methods:
            o = evaluate(part, m)
            print(row(name, o))
            report.setdefault(split, {})[name] = {
                "pauses_1s": o.pauses_1s, "false_ends_1s": o.false_ends_1s, "pauses": o.pauses,
                "false_ends": o.false_ends, "audible_1s": o.audible_1s,
                "delay_p50": _pct(o.delays, 50),
                "delay_p95": _pct(o.delays, 95), "missed": o.missed, "turns": o.turns}
    if args.lm:
        lm = EndOfSentenceLM()
        train_part = [sc for sc in scored if sc.case.split == "train"]
        lm_w, lm_c = fit_lm_weight(train_part, settings.weights, lm)
        lm_methods: list[tuple[str, Method]] = []
        for lo, hi in ((settings.min_wait_ms, settings.max_wait_ms), *args.lm_waits):
            st = replace(settings, min_wait_ms=lo, max_wait_ms=hi)

            def make(st: TurnSettings = st) -> TurnDetector:
                return _LMDetector(st, lm, lm_w, lm_c)

            lm_methods.append((f"prosody + text {lag:g} ms late, end-of-sentence LM "
                               f"(waits {lo:g}-{hi:g} ms)",
                               detector_method(st, aligned_text(lag), make)))
        print(f"\n# end-of-sentence LM: weight {lm_w} per log10, centre {lm_c} (fitted on "
              "train, text_done off)")
        _print_splits(scored, lm_methods, "end-of-sentence LM", "_lm", report)
    if args.done_wait:
        train_part = [sc for sc in scored if sc.case.split == "train"]
        shipped = (f"prosody + text {lag:g} ms late (shipped)",
                   detector_method(settings, aligned_text(lag)))
        candidates = [shipped, *done_wait_methods(settings, aligned_text(lag))]
        keys = {name: fit_key(evaluate(train_part, m)) for name, m in candidates}
        pick = min(keys, key=lambda name: keys[name])
        print(f"\n# --done-wait: picked on train as --fit picks (heard false ends on pauses <= "
              f"1 s, counted above 2%, then the median delay): {pick}")
        _print_splits(scored, candidates, "shorter waits where text and prosody say done",
                      "_done_wait", report)
    if not args.no_pocketsphinx:
        recogniser = PrefixRecogniser(args.asr_ms)
        if args.asr_cache is not None and args.asr_cache.exists():
            recogniser.cache.update(json.loads(args.asr_cache.read_text()))
        sub_methods: list[tuple[str, Method]] = [
            ("prosody", detector_method(settings)),
            (f"prosody + text {lag:g} ms late", detector_method(settings, aligned_text(lag))),
            (f"prosody + pocketsphinx text (+{args.asr_ms:g} ms), hold/answer cues only",
             detector_method(cues_only, recogniser)),
            (f"prosody + pocketsphinx text (+{args.asr_ms:g} ms)",
             detector_method(settings, recogniser))]
        for split in ("train", "check"):
            part = asr_subset([sc for sc in scored if sc.case.split == split])
            print(f"\n## {split} voices, the pocketsphinx subset (hesitation pauses "
                  f"{'/'.join(map(str, ASR_PAUSES_MS))} ms only): {len(part)} turns\n\n{HEADER}")
            for name, m in sub_methods:
                o = evaluate(part, m)
                print(row(name, o), flush=True)
                report.setdefault(f"{split}_asr_subset", {})[name] = _figures(o)
            if args.asr_cache is not None:
                args.asr_cache.write_text(json.dumps(recogniser.cache))
        print(f"\n# pocketsphinx: {recogniser.decodes} prefixes decoded")
    if smart is not None and smart.infer_ms:
        print(f"\n# smart-turn inference: median {np.median(smart.infer_ms):.1f} ms "
              f"(n={len(smart.infer_ms)}, one thread)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
