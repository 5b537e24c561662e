"""vad._turn: the end-of-turn core, on voiced signals whose pitch we choose, then silence."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from vad._turn import (
    ProsodyWeights,
    TurnDecision,
    TurnDetector,
    TurnSettings,
    TurnState,
    window_pitch,
)

RATE = 8000


def _voice(f0_start: float, f0_end: float, ms: float) -> np.ndarray:
    """A glottal-like buzz (harmonics 1-12) gliding from f0_start to f0_end."""
    n = int(ms * RATE / 1000)
    f0 = np.linspace(f0_start, f0_end, n)
    phase = 2 * np.pi * np.cumsum(f0) / RATE
    x = sum(np.sin(k * phase) / k for k in range(1, 13))
    return (0.1 * x / np.max(np.abs(x))).astype(np.float64)


def _run(
    det: TurnDetector, speech: np.ndarray, silence_ms: float
) -> list[tuple[float, TurnDecision]]:
    """Feed speech (every window marked speech) then silence; returns (ms, decision) pairs."""
    audio = np.concatenate([speech, np.zeros(int(silence_ms * RATE / 1000))])
    n_speech = len(speech) // 256
    out = []
    for k in range(len(audio) // 256):
        det.feed(audio[k * 256:(k + 1) * 256])
        d = det.step(k < n_speech)
        if d is not None and d is not TurnDecision.TURN_LIKELY:
            out.append(((k + 1) * 32.0, d))
    return out


def _end_after_transcript(det: TurnDetector, speech: np.ndarray, text: str) -> int | None:
    """Feed speech (every window marked speech) then 3 s of silence, ``text`` arriving as the
    transcript in the pause's first window (as a partial would); the ms from the end of the
    speech to the TURN_END, None if none came."""
    audio = np.concatenate([speech, np.zeros(3000 * 8)])
    n = len(speech) // 256
    for k in range(len(audio) // 256):
        det.feed(audio[k * 256:(k + 1) * 256])
        if k == n:
            det.set_transcript(text)
        if det.step(k < n) is TurnDecision.TURN_END:
            return (k + 1 - n) * 32
    return None


def test_window_pitch_reads_the_fundamental() -> None:
    x = _voice(200.0, 200.0, 48)[:384]
    voicing, f0 = window_pitch(x)
    assert voicing > 0.9
    assert f0 == pytest.approx(200.0, abs=3.0)
    noise = np.random.default_rng(1).standard_normal(384) * 0.1
    assert window_pitch(noise)[0] < 0.5


def test_a_falling_end_is_answered_sooner_than_a_held_up_one() -> None:
    # A long turn (no short-answer prior) whose last 300 ms fall below the speaker's range ...
    falling = np.concatenate([_voice(140, 160, 1200), _voice(160, 100, 300)])
    # ... and one that stays up at the top of it.
    rising = np.concatenate([_voice(140, 160, 1200), _voice(160, 190, 300)])
    ends = {}
    for name, sig in (("falling", falling), ("rising", rising)):
        det = TurnDetector()
        decisions = _run(det, sig, 3000)
        assert [d for _, d in decisions] == [TurnDecision.TURN_END]
        ends[name] = decisions[0][0] - len(sig) / 8
    assert ends["falling"] < ends["rising"]
    s = TurnSettings()
    assert s.min_wait_ms <= ends["falling"] < ends["rising"] <= s.max_wait_ms + 32


def test_speech_inside_the_wait_continues_the_turn() -> None:
    det = TurnDetector(TurnSettings(mode="silence", silence_ms=600))
    part = _voice(150, 150, 800)
    audio = np.concatenate([part, np.zeros(300 * 8), part, np.zeros(1000 * 8)])
    speech_windows = {k for k in range(len(audio) // 256)
                      if np.abs(audio[k * 256:(k + 1) * 256]).max() > 0}
    got = []
    for k in range(len(audio) // 256):
        det.feed(audio[k * 256:(k + 1) * 256])
        d = det.step(k in speech_windows)
        if d is not None:
            got.append((k, d))
    assert [d for _, d in got] == [TurnDecision.TURN_LIKELY, TurnDecision.TURN_CONTINUED,
                                   TurnDecision.TURN_LIKELY, TurnDecision.TURN_END]
    # Each pause's TURN_LIKELY comes once, after early_ms of silence.
    first_pause = max(k for k in speech_windows if k < 800 // 32 + 1)
    assert (got[0][0] - first_pause) * 32 == pytest.approx(200, abs=32)
    last_speech = max(speech_windows)
    # The fixed wait, counted from the last caller window, to the window.
    assert (got[-1][0] - last_speech) * 32 == pytest.approx(600, abs=32)
    assert det.state is TurnState.IDLE


def test_an_unfinished_phrase_waits_at_least_text_wait_ms() -> None:
    settings = TurnSettings(text_wait_ms=1500, min_wait_ms=300, max_wait_ms=1200)
    sig = _voice(150, 110, 1500)
    for text, hold in (("I want to pay and", True), ("I want to pay", False), ("um", True)):
        ended_at = _end_after_transcript(TurnDetector(settings), sig, text)
        assert ended_at is not None
        assert (ended_at >= 1500) is hold, text


def test_a_complete_short_answer_ends_after_answer_wait_ms() -> None:
    settings = TurnSettings(min_wait_ms=800, max_wait_ms=2400, answer_wait_ms=300)
    sig = _voice(150, 150, 1500)  # a level pitch: neither finished nor unfinished
    for text, quick in (("yes", True), ("No.", True), ("four one 2 7", True),
                        ("yes I want to pay", False), ("four one and", False), ("", False)):
        det = TurnDetector(settings)
        ended_at = _end_after_transcript(det, sig, text)
        assert ended_at is not None and det.estimate is not None
        assert det.estimate.text_answer is quick, text
        assert (ended_at <= 300 + 32) is quick, (text, ended_at)


def test_a_partial_ending_where_a_sentence_can_end_raises_p_end_by_text_done() -> None:
    """The fitted text weight: "I want to pay" (ends on a content word) adds ``text_done`` to
    the log-odds of an end, so the same voice waits less than with no transcript; "and" still
    holds, and a short answer is not counted twice."""
    weights = ProsodyWeights(text_done=1.0)
    settings = TurnSettings(min_wait_ms=300, max_wait_ms=2400, text_wait_ms=1500,
                            weights=weights)
    sig = _voice(150, 150, 1500)  # a level pitch: p_end from the bias alone
    got = {}
    for text in ("", "I want to pay", "I want to pay and", "yes"):
        det = TurnDetector(settings)
        got[text] = (_end_after_transcript(det, sig, text), det.estimate)
    (none_at, none), (done_at, done) = got[""], got["I want to pay"]
    assert none is not None and done is not None and none_at is not None
    assert done.text_done and not none.text_done
    logit = math.log(done.p_end / (1 - done.p_end)) - math.log(none.p_end / (1 - none.p_end))
    assert logit == pytest.approx(1.0, abs=1e-6)
    assert done_at is not None and done_at < none_at - 200
    hold, answer = got["I want to pay and"][1], got["yes"][1]
    assert hold is not None and hold.text_hold and not hold.text_done
    assert answer is not None and answer.text_answer and not answer.text_done


def test_with_text_cues_off_a_partial_changes_nothing() -> None:
    """``text_cues: off`` (callers in another language): no partial adds ``text_done``, holds
    the turn or ends it as an answer; every turn end and estimate is the one without partials.
    With the English lists a German partial's last word is one they do not know, so it counts
    as a word a sentence can end on and shortens the wait: what ``off`` is for."""
    english = TurnSettings(min_wait_ms=300, max_wait_ms=2400,
                           weights=ProsodyWeights(text_done=1.0))
    off = replace(english, text_cues="off")
    sig = _voice(150, 150, 1500)
    plain = TurnDetector(off)
    plain_at = _end_after_transcript(plain, sig, "")
    assert plain_at is not None and plain.estimate is not None
    german = "ich möchte meinen Kontostand"
    for text in (german, "I want to pay", "I want to pay and", "yes", "four one two"):
        det = TurnDetector(off)
        assert _end_after_transcript(det, sig, text) == plain_at, text
        assert det.estimate == plain.estimate, text
    det = TurnDetector(english)
    english_at = _end_after_transcript(det, sig, german)
    assert det.estimate is not None and det.estimate.text_done
    assert english_at is not None and english_at < plain_at - 200
    with pytest.raises(ValueError, match="text_cues"):
        TurnSettings(text_cues="german")  # type: ignore[arg-type]


def test_patience_scales_the_wait_and_a_short_answer_is_quick() -> None:
    sig = _voice(150, 150, 1500)
    waits = []
    for patience in (0.5, 1.0, 2.0):
        det = TurnDetector(TurnSettings(patience=patience))
        (t, _), = _run(det, sig, 6000)
        waits.append(t - len(sig) / 8)
    assert waits[0] < waits[1] < waits[2]
    # "Yes": 300 ms of speech gets the short-answer prior, so a shorter wait than the long turn.
    det = TurnDetector()
    (t, _), = _run(det, _voice(150, 150, 320), 3000)
    assert det.estimate is not None and det.estimate.speech_ms <= 700
    assert t - 320 < waits[1]


def test_weights_decide_and_settings_are_checked() -> None:
    sig = _voice(150, 150, 1500)
    eager = TurnSettings(weights=ProsodyWeights(bias=30.0, short_turn=0.0))
    (t, _), = _run(TurnDetector(eager), sig, 3000)
    assert t - len(sig) / 8 == pytest.approx(eager.min_wait_ms, abs=32)
    with pytest.raises(ValueError, match="patience"):
        TurnSettings(patience=0)
    with pytest.raises(ValueError, match="min_wait_ms"):
        TurnSettings(min_wait_ms=900, max_wait_ms=500)


def test_no_early_turn_when_early_ms_is_off() -> None:
    det = TurnDetector(TurnSettings(early_ms=0))
    audio = np.concatenate([_voice(150, 150, 800), np.zeros(2000 * 8)])
    got = []
    for k in range(len(audio) // 256):
        det.feed(audio[k * 256:(k + 1) * 256])
        d = det.step(k < 800 // 32)
        if d is not None:
            got.append(d)
    assert got == [TurnDecision.TURN_END]
