"""bench.turn_end's transcripts: the labelled turns' word times (a forced alignment, committed in
bench/data/turn_words.json), checked against human word labels, and how the words reach the
end-of-turn detector (as a streaming recogniser's partials, late by a set lag)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from bench import turn_end
from vad._turn import TurnDetector, TurnSettings

# TIMIT's hand-labelled word boundaries of its sample sentence (LDC93S1, FCJF0 SA1: the
# dev voice timit_ldc93s1), in samples at 16 kHz, as TIMIT's .WRD file gives them.
TIMIT_WRD = [(3050, 5723, "she"), (5723, 10337, "had"), (9190, 11517, "your"),
             (11517, 16334, "dark"), (16334, 21199, "suit"), (21199, 22560, "in"),
             (22560, 28064, "greasy"), (28064, 33360, "wash"), (33754, 37556, "water"),
             (37556, 40313, "all"), (40313, 44586, "year")]


def _words() -> dict[str, list[list[object]]]:
    return json.loads(turn_end.WORDS_FILE.read_text())


@pytest.mark.parametrize("event", ["barge_in_timit@2853", "turn_gap_then_barge_in@8420",
                                   "hard_clipped_loud_timit@2718"])
def test_the_word_times_match_timits_hand_labels(event: str) -> None:
    """The clip's place in the recording is one unknown (the median difference); after it, every
    aligned word edge is within 80 ms of TIMIT's, half within 20 ms (measured: median 10-12 ms,
    worst 67-75 ms, the last word's end, where the label has a weak tail)."""
    got = _words()[event]
    assert [w for w, _, _ in got] == [w for _, _, w in TIMIT_WRD]
    ours = np.array([[float(s), float(e)] for _, s, e in got])
    ref = np.array([[s / 16, e / 16] for s, e, _ in TIMIT_WRD])
    err = ours - ref
    err -= np.median(err)
    assert np.median(np.abs(err)) <= 20
    assert np.max(np.abs(err)) <= 80


def test_every_turn_with_a_transcript_has_its_words_in_order() -> None:
    cases = turn_end.build_cases(espeak=False)
    with_words = [c for c in cases if c.words is not None]
    # Only speechbrain's spk1_snt6 has no transcript anywhere (its two turns and their pauses).
    assert {c.name.split("@")[0] for c in cases if c.words is None} == {
        "barge_in_two_sentences_spk1#0", "turn_gap_then_barge_in#0"}
    assert len(with_words) > 150
    for c in with_words:
        assert c.words
        starts = [s for _, s, _ in c.words]
        assert starts == sorted(starts), c.name
        assert all(s <= e for _, s, e in c.words), c.name
        assert c.words[-1][2] <= c.end_ms + 1, c.name
    # A hesitation case's words: the natural turn's, those after the cut later by the pause.
    natural = next(c for c in cases if c.name == "barge_in_timit#0")
    hes = next(c for c in cases if c.name.startswith("barge_in_timit#0@wcut")
               and c.name.endswith("+500"))
    cut = next(p0 for p0, p1 in hes.pauses if p1 - p0 == 500)
    assert natural.words is not None and hes.words is not None
    for (w, s, e), (w2, s2, e2) in zip(natural.words, hes.words, strict=True):
        assert w == w2
        assert s2 == (s + 500 if s >= cut else s)
        assert e2 == (e + 500 if e >= cut else e)


def test_aligned_text_gives_each_word_lag_ms_after_its_end() -> None:
    case = turn_end.Case("t", "jfk", np.zeros(8000, dtype=np.float32), 900.0, (), "natural",
                         (("pay", 100.0, 400.0), ("the", 450.0, 600.0), ("bill", 600.0, 900.0)))
    sc = turn_end.Scored(case, [False] * 31)
    assert turn_end.aligned_text()(sc) == [(400.0, "pay"), (600.0, "pay the"),
                                           (900.0, "pay the bill")]
    assert turn_end.aligned_text(250)(sc)[0] == (650.0, "pay")
    assert turn_end.aligned_text()(turn_end.Scored(replace(case, words=None), [])) == []


def _buzz(ms: float) -> np.ndarray:
    n = int(ms * 8)
    phase = 2 * np.pi * 140 * np.arange(n) / 8000
    return (0.1 * sum(np.sin(k * phase) / k for k in range(1, 10))).astype(np.float32)


def test_the_words_reach_the_detector_and_hold_it_through_a_pause() -> None:
    """A turn "I want to pay the | bill" with a 704 ms pause after "the": with short waits and no
    text the turn ends in the pause; with the words (250 ms late) "the" holds it, and the end
    after "bill" comes from the same detector (its text given again after the pause). With
    ``text_cues: off`` the words change nothing."""
    audio = np.concatenate([_buzz(1536), np.zeros(704 * 8, np.float32), _buzz(512),
                            np.zeros(3000 * 8, np.float32)])
    speech = [k < 48 or 70 <= k < 86 for k in range(len(audio) // 256)]
    words = (("i", 0.0, 200.0), ("want", 200.0, 600.0), ("to", 600.0, 800.0),
             ("pay", 800.0, 1300.0), ("the", 1300.0, 1536.0), ("bill", 2240.0, 2752.0))
    case = turn_end.Case("t", "jfk", audio, 2752.0, ((1536.0, 2240.0),), "hesitation", words)
    sc = turn_end.Scored(case, speech)
    quick = TurnSettings(min_wait_ms=300, max_wait_ms=400, text_wait_ms=1500, early_ms=0)
    plain = turn_end.evaluate([sc], turn_end.detector_method(quick))
    assert plain.false_ends_1s == 1
    text = turn_end.evaluate([sc], turn_end.detector_method(quick, turn_end.aligned_text(250)))
    assert text.false_ends_1s == 0
    assert text.delays and 300 <= text.delays[0] <= 400 + 32 + 250
    # text_cues: off: the same partials, and the decisions of no partials at all.
    off = replace(quick, text_cues="off")
    ignored = turn_end.evaluate([sc], turn_end.detector_method(off, turn_end.aligned_text(250)))
    assert ignored.false_ends_1s == 1 and ignored.delays == plain.delays


@pytest.mark.slow
def test_the_word_file_is_what_the_aligner_gives() -> None:
    """``python -m bench.turn_end --align`` rebuilds the committed file exactly (pocketsphinx's
    alignment is deterministic; a new wheel or new labels would show here)."""
    assert turn_end.align_recordings() == _words()


def test_word_gap_cuts_put_every_pause_between_two_words() -> None:
    """The standard cases: the quietest-40-ms cuts fall inside a word in 18 of 26 places (a stop
    closure; ``--quiet-cuts`` keeps them there); moved to the nearest word end inside a phrase,
    none does, and a pause already there (a word gap of 100 ms or more) is not lengthened."""
    words = (("go", 0.0, 170.0), ("forward", 170.0, 700.0), ("ten", 900.0, 1260.0),
             ("meters", 1260.0, 1840.0))
    assert turn_end._snap_to_word_ends([1000 * 8, 1150 * 8], words) == [1260 * 8]
    assert turn_end._snap_to_word_ends([600 * 8], words) == [170 * 8]
    levels = turn_end.cut_levels()
    assert (sum(c["inside_word"] is not None for c in levels), len(levels)) == (18, 26)
    for c in turn_end.build_cases(espeak=False):
        if c.kind != "hesitation" or c.words is None:
            continue
        assert "@wcut" in c.name
        d = float(c.name.rsplit("+", 1)[1])
        cut = next(p0 for p0, p1 in c.pauses if p1 - p0 == d)
        assert not [w for w, s, e in c.words if s < cut - 1 and e - d > cut + 1], c.name


def test_the_end_of_sentence_lm_ranks_a_finished_phrase_above_an_open_one() -> None:
    """bench.turn_end --lm's text score: the pocketsphinx trigram's log10 P(</s> | last two
    words) (measured: "all year" -0.55, "of the" -2.14, "do for" -2.01, "for you" -0.43)."""
    lm = turn_end.EndOfSentenceLM()
    assert lm("") is None
    got = {t: lm(t) for t in ("all year", "wash water all year", "of the", "can do for",
                              "can do for you")}
    assert got["all year"] == pytest.approx(got["wash water all year"])  # two words of history
    assert got["all year"] == pytest.approx(-0.55, abs=0.01)
    assert got["can do for you"] > -1 > got["can do for"]
    assert got["of the"] < -2


def test_the_text_weight_is_not_fitted_without_words() -> None:
    """With bench/data/turn_words.json missing the rows carry no text: --fit refuses instead of
    writing a text weight of 0 (or NaN, with no rows) into vad/_turn.py's defaults."""
    import pytest

    from bench import turn_end
    from vad._turn import ProsodyWeights

    no_words = [((0.2, -3.0, 0.0, 0.0, 0.0), True), ((0.8, 2.0, 0.0, 0.0, 0.0), False)]
    for rows in ([], no_words):
        with pytest.raises(SystemExit, match="no transcripts"):
            turn_end.fit_text_weight(rows, ProsodyWeights())


def test_the_done_wait_experiment_shortens_only_where_text_and_prosody_say_done() -> None:
    """bench.turn_end --done-wait (tried and dropped: docs/turns.md): ``cap`` waits at most its
    wait where the partial ends on a word a sentence can end on and the prosody's own log-odds
    reach the threshold; a trailing "and", or prosody under the threshold, keeps the wait;
    ``floor`` lowers the wait's floor for such a partial only."""
    eager = TurnSettings(weights=replace(TurnSettings().weights, bias=3.0), early_ms=0)

    def wait(text: str, det: TurnDetector) -> float:
        """The wait after 1.5 s of voice with ``text`` as the partial at its end."""
        det.feed(_buzz(1536))
        for k in range(48):
            det.step(True, (k + 1) * 256)
        det.set_transcript(text)
        det.step(False, 49 * 256)
        assert det.estimate is not None
        return det.estimate.wait_ms

    def done_wait(kind: str, text: str, threshold: float = 0.0) -> float:
        return wait(text, turn_end._DoneWaitDetector(eager, kind, 400.0, threshold))

    plain = wait("I want to pay", TurnDetector(eager))
    assert plain > 400
    assert done_wait("cap", "I want to pay") == 400.0
    assert done_wait("cap", "I want to pay", threshold=10.0) == plain
    assert done_wait("cap", "I want to pay and") >= eager.text_wait_ms
    assert 400 < done_wait("floor", "I want to pay") < plain
    assert done_wait("floor", "I want to pay and") >= eager.text_wait_ms
