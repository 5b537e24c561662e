"""The end-of-turn model the code ships is the one ``python -m bench.turn_end --fit`` fitted on the
train voices (vad/turn_fit.json), and it was fitted on what today's VAD chain hears.

The second half is what let the model drift unnoticed once: the barge-in policy's DTMF veto
(merged after the fit) turned 4% of the dev voices' voiced windows into "not the caller", the
pitch features at the pauses moved, and held-out AUC fell from 0.80 to 0.62 with nothing failing
(docs/turns.md). Now a change to the verdicts the detector is stepped with fails here, and says
to refit."""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict, replace

import pytest

from bench import turn_end
from vad._turn import ProsodyWeights, TurnSettings

FIT = json.loads(turn_end.FIT_FILE.read_text())


def _train_cases() -> list[turn_end.Case]:
    # The train turns are real voices only: no eSpeak needed (its cases are all held out).
    return [c for c in turn_end.build_cases(espeak=False) if c.split == "train"]


def test_defaults_are_the_fitted_model() -> None:
    settings = TurnSettings()
    assert asdict(settings.weights) == FIT["weights"]
    assert (settings.min_wait_ms, settings.max_wait_ms) == (FIT["min_wait_ms"],
                                                            FIT["max_wait_ms"])
    assert turn_end.fitted_settings(FIT) == settings
    assert FIT["source"]["split"] == "train"
    assert set(FIT["source"]["voices"]) == {v for v, s in turn_end.VOICE_SPLIT.items()
                                            if s == "train"}


def test_verdicts_round_trip() -> None:
    for speech in ([], [True], [False, True, True] * 7, [True] * 8 + [False] * 9):
        assert turn_end.unpack_verdicts(turn_end.pack_verdicts(speech)) == speech


def test_fit_refuses_held_out_voices() -> None:
    case = turn_end.Case("x", "jfk", turn_end.np.zeros(256, dtype="float32"), 0.0, (), "short")
    with pytest.raises(ValueError, match="train"):
        turn_end.fit_model([turn_end.Scored(case, [False])])


def test_the_replay_decides_as_the_detector() -> None:
    """The weight search runs the detector from a table of each window's pitch
    (``pitch_tables``, ``_ReplayDetector``): on train turns with pauses, natural and inserted,
    and with the partials, it decides exactly as ``TurnDetector`` fed the audio, for the shipped
    model and for one with other weights and waits (a false end resets the turn's pitch)."""
    verdicts = FIT["source"]["verdicts"]
    cases = [c for c in _train_cases() if c.name.startswith(
        ("barge_in_late_ljspeech#0", "barge_in_early_librivox#0@wcut1"))]
    assert len(cases) >= 7
    scored = [turn_end.Scored(c, turn_end.unpack_verdicts(verdicts[c.name])) for c in cases]
    pitch = turn_end.pitch_tables(scored)
    quick = replace(TurnSettings(), min_wait_ms=300.0, max_wait_ms=1000.0,
                    weights=replace(TurnSettings().weights, bias=2.0))
    outcomes = []
    for settings in (TurnSettings(), quick):
        for text in (None, turn_end.aligned_text(turn_end.FIT_LAG_MS)):
            real = turn_end.evaluate(scored, turn_end.detector_method(settings, text))
            replayed = turn_end.evaluate(scored, turn_end.detector_method(settings, text,
                                                                          pitch=pitch))
            assert replayed == real
            outcomes.append(real)
    assert outcomes[2].false_ends > outcomes[0].false_ends  # the quick one does end in pauses


@pytest.mark.slow
def test_shipped_file_is_what_the_fit_produces() -> None:
    """Refit from the file's own inputs (the train turns rebuilt from the recordings, with the
    verdicts the file records, and their words from bench/data/turn_words.json) and get the
    file's weights (the text weight too), waits and train figures back."""
    cases = _train_cases()
    verdicts = FIT["source"]["verdicts"]
    assert sorted(c.name for c in cases) == sorted(verdicts)
    scored = [turn_end.Scored(c, turn_end.unpack_verdicts(verdicts[c.name])) for c in cases]
    assert turn_end.verdicts_digest(scored) == FIT["source"]["verdicts_sha256"]
    got = turn_end.fit_model(scored)
    assert got["weights"] == FIT["weights"]
    assert (got["min_wait_ms"], got["max_wait_ms"]) == (FIT["min_wait_ms"], FIT["max_wait_ms"])
    assert got["train"] == FIT["train"]
    assert got["train_text"] == FIT["train_text"]
    assert got["search"] == FIT["search"] and got["text_search"] == FIT["text_search"]
    assert ProsodyWeights(**got["weights"]) == TurnSettings().weights


@pytest.mark.slow
def test_vad_chain_still_gives_the_verdicts_it_was_fitted_on() -> None:
    """Today's VAD chain (Silero + echo/noise gate + BargeInPolicy.is_caller, as the gateway
    steps its TurnDetector) on the train turns: the same per-window verdicts as at the fit."""
    cases = _train_cases()
    scored = asyncio.run(turn_end.score(cases))
    fitted = FIT["source"]["verdicts"]
    moved = [sc.case.name for sc in scored
             if turn_end.pack_verdicts(sc.speech) != fitted.get(sc.case.name)]
    assert not moved, (
        f"the VAD chain's verdicts changed on {len(moved)} of {len(scored)} train turns since the "
        f"end-of-turn model was fitted (e.g. {moved[:3]}): its features at the pauses moved; "
        "refit with `python -m bench.turn_end --fit` (train voices only) and ship the new "
        "weights in vad/_turn.py")


def test_the_refit_writes_the_defaults_into_the_code() -> None:
    """``python -m bench.turn_end --fit`` is the whole refit: it writes the fit's weights and
    waits as the defaults in vad/_turn.py. With the shipped fit the source stays as it is;
    with other values exactly those lines change."""
    source = turn_end.TURN_SOURCE.read_text()
    assert turn_end.with_fitted_defaults(source, FIT) == source
    other = {**FIT, "weights": {**FIT["weights"], "text_done": 0.25, "bias": -0.1},
             "min_wait_ms": 600.0}
    changed = turn_end.with_fitted_defaults(source, other)
    diff = [(a, b) for a, b in zip(source.splitlines(), changed.splitlines(), strict=True)
            if a != b]
    assert [b.strip() for _, b in diff] == ["bias: float = -0.1", "text_done: float = 0.25",
                                            "min_wait_ms: float = 600.0"]
