"""The barge-in thresholds the code ships are the ones ``python -m bench.fit_bargein`` fitted
on the simulator's train split (vad/bargein_fit.json), and its scoring reads a decision's first
stop the way the evaluator does."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench import fit_bargein, fit_classifier
from gateway.call import CallSettings
from vad import BargeInSettings, CallerClassifier

FIT = json.loads(fit_bargein.FIT_FILE.read_text())
CLASSIFIER = json.loads(fit_classifier.OUT.read_text())


def test_defaults_are_the_fitted_thresholds() -> None:
    settings = CallSettings()
    for key, value in FIT["params"].items():
        group, name = key.split(".")
        assert getattr(getattr(settings, group), name) == value, key
    assert set(FIT["params"]) == set(fit_bargein.SEARCH)
    assert FIT["source"]["split"] == "train"


def test_fit_is_no_worse_than_the_hand_tuned_values_on_train() -> None:
    """What the file records: the fitted thresholds against the ones before the fit (the
    search starts from those; on today's train split nothing it tried beat them)."""
    fitted, before = FIT["train"], FIT["hand_tuned_train"]
    assert fitted["calls"] == before["calls"] > 0
    assert fit_bargein.objective(fitted) >= fit_bargein.objective(before)
    assert FIT["objective"] == round(fit_bargein.objective(fitted), 4)


def _log(rows: list[list[float]], labels: dict[str, object]) -> dict[str, object]:
    return {"rows": np.asarray(rows, dtype=np.float32),
            "meta": [{"labels": labels, "start": 0, "end": len(rows)}]}


def _window(t: float, prob: float, level: float, bot: int = 1) -> list[float]:
    # t, prob, clean, level, echo, noise, locked, free, band, ref, erl, corr, unexplained,
    # prior_echo, prior_fit, echo_match, voicing, dtmf, bot
    return [t, prob, prob, level, -100.0, -35.0, 0, 0, 0.0, -100.0, 0.0, 1.0, level, -100.0,
            0.0, 0.0, 0.9, 0.0, bot]


@pytest.mark.parametrize(("onset", "detected", "false_stops"), [
    (1000.0, 1, 0),  # speech from 1000 ms: a stop 64 ms later, in time
    (2000.0, 0, 1),  # the same stop 936 ms before the labelled onset: a false stop
])
def test_score_reads_the_first_stop_as_the_evaluator(onset: float, detected: int,
                                                     false_stops: int) -> None:
    rows = [_window(32.0 * (k + 1), 0.02, -60.0) for k in range(31)]  # bot talks, line quiet
    rows += [_window(32.0 * (k + 1), 0.99, -20.0) for k in range(31, 40)]  # then a voice
    labels = {"expect": {"barge_in": True, "barge_in_onset_ms": onset},
              "bot_turns": [{"start_ms": 0.0, "end_ms": 5000.0}],
              "events": [{"kind": "speech", "start_ms": onset, "end_ms": onset + 500}]}
    s = fit_bargein.score(_log(rows, labels), fit_bargein.CLASSIFIER_OFF)  # hand-set paths
    assert (s["detected"], s["false_stops"]) == (detected, false_stops)
    if detected:
        assert s["latency_p50_ms"] == 32.0 * 33 - onset  # 2nd caller window: speech + pause


@pytest.mark.slow
def test_shipped_file_is_what_the_fit_produces() -> None:
    """Re-run the search on the logged train windows (bench/data/fit_windows_train.npz and
    fit_windows_impacts.npz, from ``python -m bench.fit_bargein`` with the file's source
    settings) and get the file back."""
    assert FIT["source"]["grids"] == list(fit_bargein.GRIDS)
    log = fit_bargein.load_windows()
    got = fit_bargein.fit(log, candidates=FIT["candidates"], seed=FIT["seed"],
                          passes=FIT["passes"], start=FIT["start"])
    assert got["params"] == FIT["params"]
    assert got["train"] == FIT["train"]


def test_a_refit_keeps_the_thresholds_it_starts_from_where_the_calls_cannot_tell() -> None:
    """``start`` (the shipped thresholds, on a refit) stays where no candidate scores strictly
    better; from the hand-set values alone the same search ends elsewhere."""
    rows = [_window(32.0 * (k + 1), 0.02, -60.0) for k in range(31)]
    rows += [_window(32.0 * (k + 1), 0.99, -20.0) for k in range(31, 40)]
    labels = {"expect": {"barge_in": True, "barge_in_onset_ms": 1000.0},
              "bot_turns": [{"start_ms": 0.0, "end_ms": 5000.0}],
              "events": [{"kind": "speech", "start_ms": 1000.0, "end_ms": 1500.0}]}
    log = _log(rows, labels)
    start = {k: v[-1] for k, v in fit_bargein.SEARCH.items()}
    assert start != {k: fit_bargein.HAND_TUNED[k] for k in start}
    off = fit_bargein.CLASSIFIER_OFF
    tie = fit_bargein.score(log, dict(off, **start))
    hand = fit_bargein.score(log, dict(off, **fit_bargein.HAND_TUNED))
    assert tie["detected"] == hand["detected"] == 1  # both stop within 100 ms of the onset
    assert fit_bargein.objective(tie) == fit_bargein.objective(hand)
    got = fit_bargein.fit(log, candidates=20, start=start)
    assert got["params"] == dict(fit_bargein.HAND_TUNED, **start)
    assert got["start"] == start
    assert fit_bargein.fit(log, candidates=20)["params"] == fit_bargein.HAND_TUNED


def test_the_fit_reads_the_shipped_logs_by_default() -> None:
    assert tuple(fit_bargein.default_windows(list(fit_bargein.GRIDS))) == fit_bargein.WINDOWS
    assert all(p.exists() for p in fit_bargein.WINDOWS)
    assert fit_bargein.default_windows(["full"])[0].parent == fit_bargein.WINDOWS[0].parent


def test_logs_of_several_seeds_fit_as_one() -> None:
    """``--seed 1 --seed 3``: the windows of both runs in one log, each call's rows its own."""
    rows = [_window(32.0 * (k + 1), 0.02, -60.0) for k in range(31)]
    rows += [_window(32.0 * (k + 1), 0.99, -20.0) for k in range(31, 40)]
    hit = {"expect": {"barge_in": True, "barge_in_onset_ms": 1000.0},
           "bot_turns": [{"start_ms": 0.0, "end_ms": 5000.0}],
           "events": [{"kind": "speech", "start_ms": 1000.0, "end_ms": 1500.0}]}
    early = dict(hit, expect={"barge_in": True, "barge_in_onset_ms": 2000.0})
    both = fit_bargein._concat([_log(rows, hit), _log(rows, early)])
    assert [(m["start"], m["end"]) for m in both["meta"]] == [(0, 40), (40, 80)]
    s = fit_bargein.score(both, fit_bargein.CLASSIFIER_OFF)
    assert (s["calls"], s["detected"], s["false_stops"]) == (2, 1, 1)


def test_the_shipped_classifier_is_what_its_training_code_produces() -> None:
    """vad/bargein_classifier.json is ``python -m bench.fit_classifier``'s network, trained on
    the train windows log (the weights as written, to their last digit)."""
    x, y, w, _ = fit_classifier.training_set(fit_bargein.load_windows(fit_classifier.WINDOWS))
    model = fit_classifier.train(x, y, w, seed=CLASSIFIER["seed"])
    assert model.to_json() == CLASSIFIER["model"]
    assert CallerClassifier.shipped().to_json() == CLASSIFIER["model"]


def test_the_classifier_file_records_its_fitted_thresholds() -> None:
    """The fitted fast path and veto beat the classifier off on train first stops (out of
    fold), and they are the defaults."""
    settings = BargeInSettings()
    assert set(CLASSIFIER["params"]) == set(fit_classifier.SEARCH)
    for key, value in CLASSIFIER["params"].items():
        assert getattr(settings, key.split(".", 1)[1]) == value, key
    assert settings.with_fitted_classifier() == settings
    assert CLASSIFIER["params"]["barge_in.classifier_on"] is not None
    off = settings.without_classifier()
    assert off.classifier_on is None and off.classifier_veto is None
    scores = CLASSIFIER["first_stop_out_of_fold"]
    assert fit_bargein.objective(scores["with"]) > fit_bargein.objective(scores["without"])
    assert scores["objective"] == round(fit_bargein.objective(scores["with"]), 4)


@pytest.mark.slow
def test_the_acting_log_has_the_pauses_the_never_acting_one_has_not() -> None:
    """``log_windows(decision="configured")`` logs a barge-in call as the shipped decision acts
    on it, closed loop: where the bot stops for the caller, fewer of the windows after the onset
    hear it than in the never-acting log. Both log every window, and before the onset the bot
    plays in the same windows of both. (Their audio is not equal to the sample: the
    never-acting log replays the recording, whose echo is of the bot's labelled turns; the
    acting one builds each frame's echo from what the Twilio stand-in played.) Not every call
    shows the stop: the never-acting log pauses the bot too where one window stands 25 dB over
    the echo, and the acting decision can resume over a caller; of the three callers here (a
    450 ms echo 12 dB down), two show it."""
    from linesim import grid, iter_calls

    conditions = [c for c in grid("small") if c.name == "erl12-d450-none-none-quiet-barge_in"]
    calls = [c for c in iter_calls(conditions, split="train", seed=1, count=3)
             if c.labels["expect"]["barge_in"]]
    assert len(calls) == 3
    stopped = 0
    for call in calls:
        onset = call.labels["expect"]["barge_in_onset_ms"]
        never = fit_bargein.log_windows([call])["rows"]
        acting = fit_bargein.log_windows([call], decision="configured")["rows"]
        assert len(never) == len(acting)
        t, bot = never[:, 0], never[:, -1]
        before = t <= onset
        assert np.array_equal(bot[before], acting[before, -1])
        assert (bot[before] > 0).any()  # the bot was playing (from 786 ms on the third call)
        after = t > onset + 300.0
        stopped += int((acting[after, -1] > 0).sum() < (bot[after] > 0).sum())
    assert stopped >= 1
    with pytest.raises(ValueError, match="never or configured"):
        fit_bargein.log_windows([call], decision="sometimes")


def test_acting_logs_train_with_their_calls_in_the_same_fold() -> None:
    """``training_set``: an acting log's windows join the set under the same call indices (a
    fold by call holds out both logs of a call); a log of other calls is refused."""
    rows = [_window(32.0 * (k + 1), 0.02, -60.0) for k in range(10)]
    hit = {"name": "a", "expect": {"barge_in": True, "barge_in_onset_ms": 100.0},
           "bot_turns": [{"start_ms": 0.0, "end_ms": 5000.0}],
           "events": [{"kind": "speech", "start_ms": 100.0, "end_ms": 200.0}]}
    other = dict(hit, name="b")
    log = fit_bargein._concat([_log(rows, hit), _log(rows[:6], other)])
    x, y, _, calls = fit_classifier.training_set(log)
    xa, ya, _, ca = fit_classifier.training_set(log, [log])
    assert len(xa) == 2 * len(x) and list(ca) == list(calls) * 2
    assert y.sum() > 0 and list(ya) == list(y) * 2
    swapped = fit_bargein._concat([_log(rows[:6], other), _log(rows, hit)])
    with pytest.raises(ValueError, match="not the windows log's"):
        fit_classifier.training_set(log, [swapped])


@given(st.lists(st.integers(-100, 1500), max_size=30), st.lists(st.integers(-100, 1500),
                                                                max_size=10),
       st.integers(0, 10), st.sampled_from([(0.5, 100.0), (0.95, 250.0)]))
def test_a_percentile_cannot_end_below_its_least(seen: list[int], later: list[int], more: int,
                                                 q_goal: tuple[float, float]) -> None:
    """Whatever latencies (up to ``more``) join the ones seen, the percentile the objective
    reads ends at or above ``_least_pct``'s (both held to the goal, where the objective stops
    counting): the search may drop a candidate on it."""
    q, goal = q_goal
    later = later[:more]
    final = sorted(float(v) for v in seen + later)
    got = final[min(len(final) - 1, round(q * (len(final) - 1)))] if final else None
    least = fit_bargein._least_pct([float(v) for v in seen], more, q, goal)
    assert least >= goal
    if got is not None:
        assert max(goal, got) >= least


def test_a_candidate_is_dropped_only_where_it_cannot_beat() -> None:
    """``score_to_beat`` gives the full score wherever the objective beats ``beat``, and None
    where it does not, on the shipped train log (the search's early exit changes no choice)."""
    log = fit_bargein.load_windows()
    log = {"rows": log["rows"], "meta": log["meta"][::9]}
    rng = random.Random(5)
    for _ in range(4):
        drawn = {k: rng.choice(v) for k, v in fit_bargein.SEARCH.items()}
        params = dict(fit_bargein.CLASSIFIER_OFF, **dict(fit_bargein.HAND_TUNED, **drawn))
        full = fit_bargein.score(log, params)
        j = fit_bargein.objective(full)
        assert fit_bargein.score_to_beat(log, params, beat=j - 1e-9) == full
        assert fit_bargein.score_to_beat(log, params, beat=j) is None
        assert fit_bargein.score_to_beat(log, params, beat=j + 1.0) is None
