"""Fit the barge-in decision's thresholds on the simulator's train split:
``python -m bench.fit_bargein``.

Two steps:

1. **Log.** Every train call is replayed once through the real call controller with a decision
   that acts only on a window 25 dB over the echo and the noise (``is_instant``: the bot is
   paused there and the recording's echo goes on, as in an open-loop replay; until then the
   echo in the recording matches what was played) and with the gate's margins open (so the
   window features are computed on every window). Each VAD window's readings are kept:
   Silero on the raw and on the echo-cancelled audio, the gate's reading, the features, what
   the bot was doing. Written to ``--windows`` (``.npz``).
2. **Fit.** A seeded random search over the decision's thresholds re-runs
   :class:`vad.BargeInPolicy` (which does no I/O) over the logged windows up to each call's
   first stop, and scores it with the evaluator's rules for a first stop: a barge-in detected
   when the first stop falls from 50 ms before the onset to 1.5 s after it; a false stop when it
   comes earlier while the bot talks, or at all on a call with no caller turn. The gate's
   ``passes`` is recomputed from its logged levels for each candidate's margins. The search
   starts from the hand-set values and from the thresholds ``--out`` already holds (a tie keeps
   those). The best candidate is written to ``--out`` (default ``vad/bargein_fit.json``), with
   its train scores.

Only the first stop is re-simulated: after a stop the bot's audio, and so the echo, differ.
The check split is scored separately, by full replays (``python -m bench.robustness --split
check``), never by this module.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["CLASSIFIER_OFF", "GRIDS", "SEARCH", "SEEDS", "WINDOWS", "default_windows", "fit",
           "load_windows", "log_windows", "main", "score", "window_inputs"]

FIT_FILE = Path(__file__).resolve().parents[1] / "vad" / "bargein_fit.json"
EARLY_SLACK_MS = 50.0  # linesim.scoring / eval_bargein.py
LATE_LIMIT_MS = 1500.0
_GATE = ("level_db", "echo_db", "noise_db", "echo_locked", "echo_free", "band_snr_db", "ref_db",
         "erl_db", "echo_corr", "unexplained_db", "prior_echo_db", "prior_fit", "echo_match")
_COLS = ("t_ms", "prob", "clean", *_GATE, "voicing", "dtmf", "bot")
_BOT = {"silent": 0, "interruptible": 1, "non_interruptible": 2}

# The thresholds searched, and their candidate values (barge_in.X and echo.X of CallSettings).
# The echo veto's seven are held at the values the first fit left them (it found nothing better
# on its train split): on today's windows the first-stop scoring below prefers clean_p_min 0.1,
# worst_erl_db 6, any_lag_margin_db 3 and no_echo_corr 0.4, which a closed-loop replay of train
# calls (seed 3) shows worse (false stops 20 -> 27 calls, p95 437 -> 575 ms; docs/bargein.md).
# What is searched is the echo-cancelled path (clean_*) and start_windows. The path's noise
# margin is searched from 3 dB up: a first stop counts one false stop per call, and a TV or
# babble (which AEC3 leaves in: Silero 0.6-0.7 on the cancelled window throughout) with no
# noise margin adds stops on calls that already have one (closed loop, train seed 3).
SEARCH: dict[str, list[Any]] = {
    "barge_in.clean_p_min": [0.3],
    "barge_in.clean_veto_db": [15.0],
    "barge_in.worst_erl_db": [None],
    "barge_in.any_lag_margin_db": [None],
    "barge_in.any_lag_floor_db": [None],
    "barge_in.no_echo_corr": [None],
    "barge_in.clean_veto_locked": [True],
    "barge_in.start_windows": [2, 3],
    # The cancelled path's three are held at session 6's values since the windows were logged
    # afresh with unexplained_db (session 7): the first-stop scoring now moves them to 0.4, 4
    # and 3 dB (train FS 48 -> 50, p95 585 -> 563 ms), and a 3 dB noise margin is what closed-loop
    # replays showed worse (check FI 5 -> 6: TV and a transient; docs/bargein.md).
    "barge_in.clean_on": [0.5],
    "barge_in.clean_echo_db": [4.0],
    "barge_in.clean_noise_db": [4.5],
    # Held at 1280 since session 8: with its searched keys the search met 960 first, which
    # scores the same on these windows (77/80, FS 42, 107/433 ms) and closed loop (session 6:
    # train FS 23, FI 1 either way); held so that the session's change is its own.
    "barge_in.clean_after_ms": [1280.0],
    # Held at session 8's values since session 9 re-logged the windows (a new gate reading):
    # the search over them with prior_margin_db met a poorer optimum (explain_share_db 1,
    # background_db 6, background_pct 90: train first stops 76/80 FS 40 against 78/80 FS 35
    # with them held; docs/bargein.md), and the change should be the session's own.
    "barge_in.explain_share_db": [2.0],
    # Held at what the search chose with the path (from 6, 9, 12 dB and None, 640, 960,
    # 1280 ms), while the background floor below was added:
    "barge_in.explain_noise_db": [9.0],
    # Held off (1.1) in session 7: hold music is voiced and closed-loop replays of train calls
    # (seed 3) stopped the bot for it in its first turn with 0.6 (music echo-only false
    # interrupts 0 -> 1-2 of 4 calls). Searched again since session 8's background floor holds
    # what was on the line before the bot (closed loop with 0.6 and background_db 9, seed 1:
    # music FS 0 FI 0, barge-ins in the bot's first 200 ms 290/747 -> 187/353 ms; seed 3: the
    # same verdicts as 1.1; docs/bargein.md).
    "barge_in.explain_voicing_min": [1.1, 0.6],
    "barge_in.explain_until_ms": [None],
    "barge_in.explain_veto_db": [None, 15.0, 20.0, 25.0],
    # Held (6 dB; 10 scored the same): a first stop counts one false stop per call and is blind
    # to a TV, babble or hold music stopping the bot earlier on a call that already had one.
    # Closed loop (train, seed 3) without the floor the path costs false interrupts (babble,
    # music: FI 1 -> 4); with it, on 8 points (32 calls) FI 3 -> 2 and babble 1/4 -> 2/4
    # detected, the same latencies (docs/bargein.md).
    "barge_in.explain_background_db": [6.0],
    # Session 8: the unexplained-energy path's own noise floor (a percentile of the unexplained
    # energy of idle windows) and the background floor for every path (docs/bargein.md).
    "barge_in.explain_floor_pct": [None, 50.0, 75.0, 90.0],
    # 12 dB left out: the search chose it (train first stops FS 42 -> 40, p95 420 -> 433 ms
    # against 9), and it fails the project's dev-set regression gate (tests/gateway/
    # test_replay.py: every barge-in within 250 ms; hard_snr10_babble_ljspeech 98 -> 258 ms).
    "barge_in.background_db": [9.0],
    "barge_in.background_pct": [100.0],
    # Held: no train call has the caller talk a real turn in the bot's silence before a
    # barge-in; the dev set's turn_gap_then_barge_in does (missed without the cap).
    "barge_in.background_caller_db": [18.0],
    # Session 9: the window that begins a caller run must stand over the echo the line's last
    # 160 ms before it predict for it (an echo path that changed: docs/bargein.md).
    "barge_in.prior_margin_db": [None, 0.0, 1.5, 3.0, 4.5, 6.0],
    "barge_in.prior_fit_min": [0.5, 0.6, 0.7, 0.8, 0.9],
    # Session 9 (review): ... and only where the gate's own lagged envelope explains this much
    # of the window (a caller's voice after a held window: docs/bargein.md).
    "barge_in.prior_explained_db": [None, 1.0, 2.0, 3.0, 4.5, 6.0],
    # Session 12: a loud, unvoiced burst over the echo that the canceller's output does not hear
    # as speech (a cough, a knock, a door: the ``impacts`` grid, logged beside ``small``).
    "barge_in.impulse_voicing": [None, 0.25, 0.3, 0.35, 0.4, 0.45],
    "barge_in.impulse_db": [10.0, 15.0, 20.0, 25.0],
}


def log_windows(calls: list[Any], *, runtime: str = "onnx", decision: str = "never",
                loop: str = "closed") -> dict[str, Any]:
    """Replay simulated calls under a decision that never acts; every window's readings.

    ``decision="configured"`` logs them instead as the configured decision (the shipped
    thresholds and classifier) acts on them, closed loop (``bench.robustness``: the echo
    follows what the gateway played, so a pause silences it): the windows of pauses, resumes
    and the caller's turns as a live line has them; with ``loop="open"`` the recording is
    replayed as written, its echo going on after a pause, as ``callgate replay`` and the
    evaluator have it. ``bench.fit_classifier --acting`` trains on such logs beside the
    never-acting one (session 17 measured both loops and shipped neither: docs/bargein.md);
    the thresholds' first-stop fits read only the never-acting log, whose windows before any
    stop do not depend on the decision."""
    from bench.robustness import _replay_closed, bot_turns
    from gateway.call import CallSettings
    from gateway.replay import replay
    from vad import BargeInPolicy, BargeInSettings, EchoGateSettings, VadEngine

    # One window 25 dB over the echo and the noise (``is_instant``) does start a turn: the
    # bot is paused there, as a live decision would pause it, and the windows after hold the
    # recording's echo with no reference to it, as an open-loop replay's do (45 of the small
    # grid's 184 train calls, 19 of the impacts grid's 32). A log where the bot never stops
    # (``instant_margin_db`` 1e9) was measured in session 16 and not adopted: the classifier
    # retrained on it resumed the bot over more real barge-ins (docs/bargein.md). It does not
    # run the caller classifier: the log must not depend on the weights it retrains.
    never = CallSettings(barge_in=BargeInSettings(start_windows=10**9, classifier_on=None,
                                                  classifier_veto=None),
                         echo=EchoGateSettings(echo_margin_db=-1000.0, noise_margin_db=-1000.0,
                                               min_level_dbfs=-1000.0))
    if decision not in ("never", "configured"):
        raise ValueError(f"decision must be never or configured, got {decision!r}")
    if loop not in ("closed", "open"):
        raise ValueError(f"loop must be closed or open, got {loop!r}")
    rows: list[list[float]] = []
    meta: list[dict[str, Any]] = []
    original = BargeInPolicy.step

    def spy(self: Any, prob: float, gate: Any, feat: Any, bot: Any, *,
            clean_prob: float | None = None, ghost: Any = None) -> Any:
        # (No ghost is logged: the classifier does not read it.)
        rows.append([self._window * 32.0 + 32.0, prob, -1.0 if clean_prob is None else clean_prob,
                     *(float(getattr(gate, k)) for k in _GATE), feat.voicing, feat.dtmf,
                     _BOT[getattr(bot, "audible", bot).value]])  # a BotView or a BotState
        return original(self, prob, gate, feat, bot, clean_prob=clean_prob, ghost=ghost)

    async def run() -> None:
        # (`runtime` is argparse's, limited by its choices to the engine's runtimes.)
        async with VadEngine(runtime=runtime) as engine:  # type: ignore[arg-type]
            with tempfile.TemporaryDirectory(prefix="fit-") as tmp:
                for call in calls:
                    start = len(rows)
                    if decision == "configured" and loop == "closed":
                        await _replay_closed(call, CallSettings(), engine)
                    else:
                        path = Path(tmp) / f"{call.name}.twilio.jsonl"
                        path.write_text("\n".join(call.messages()) + "\n")
                        await replay(path, bot_script=bot_turns(call), vad=engine,
                                     settings=never if decision == "never" else CallSettings())
                    meta.append({"labels": call.labels, "start": start, "end": len(rows)})

    # The spy patched onto the class records every step's inputs (restored below).
    BargeInPolicy.step = spy  # type: ignore[method-assign]
    try:
        asyncio.run(run())
    finally:
        BargeInPolicy.step = original  # type: ignore[method-assign]
    return {"rows": np.asarray(rows, dtype=np.float32), "meta": meta}


def _concat(logs: list[dict[str, Any]]) -> dict[str, Any]:
    """One windows log of several (the calls of each, in order)."""
    rows: list[np.ndarray] = []
    meta: list[dict[str, Any]] = []
    n = 0
    for log in logs:
        rows.append(log["rows"])
        meta += [dict(m, start=m["start"] + n, end=m["end"] + n) for m in log["meta"]]
        n += len(log["rows"])
    return {"rows": np.concatenate(rows) if rows else np.zeros((0, len(_COLS)), np.float32),
            "meta": meta}


def _save(log: dict[str, Any], path: Path) -> None:
    meta = json.dumps(log["meta"])
    np.savez_compressed(path, rows=log["rows"], meta=np.frombuffer(meta.encode(), dtype=np.uint8))


def _load(path: Path) -> dict[str, Any]:
    with np.load(path) as z:
        return {"rows": z["rows"], "meta": json.loads(z["meta"].tobytes().decode())}


def _call_truth(labels: dict[str, Any]) -> dict[str, Any]:
    expect = labels.get("expect", {})
    turns = [(b["start_ms"], b["end_ms"] + 200.0) for b in labels.get("bot_turns", [])]
    return {"barge_in": bool(expect.get("barge_in")), "onset": expect.get("barge_in_onset_ms"),
            "turns": turns,
            "echo_only": not any(e["kind"] in ("speech", "backchannel") for e in labels["events"])}


def _barge_in(params: dict[str, Any]) -> dict[str, Any]:
    """The ``barge_in.`` keys of ``params``, as BargeInSettings' keyword arguments."""
    return {k.split(".", 1)[1]: v for k, v in params.items() if k.startswith("barge_in.")}


def window_inputs(rows: np.ndarray, params: dict[str, Any]) -> Iterator[tuple[Any, ...]]:
    """Each logged window as the policy's step gets it: (t_ms, prob, gate, features, bot,
    clean_prob); the gate's ``passes`` recomputed for ``params``' echo margins."""
    from vad import BotState, BotView, GateReading, WindowFeatures

    e = {k.split(".", 1)[1]: v for k, v in params.items() if k.startswith("echo.")}
    em, nm = e.get("echo_margin_db", 8.0), e.get("noise_margin_db", 6.0)
    # The views a bare BotState implies, made once: the policy made one on every step, a sixth
    # of tests/vad/test_fit.py's rerun of the search (profiled).
    bots = tuple(BotView.of(b) for b in (BotState.SILENT, BotState.INTERRUPTIBLE,
                                          BotState.NON_INTERRUPTIBLE))
    for r in rows:
        (t, prob, clean, level, echo, noise, locked, free, band, ref, erl, corr, unexp, prior,
         prior_fit, match, voicing, dtmf, bot) = r
        passes = level >= -55.0 and level >= noise + nm and level >= echo + em
        gate = GateReading(float(level), float(echo), float(noise), bool(locked), bool(passes),
                           bool(free), float(band), float(ref), float(erl), float(corr),
                           float(unexp), float(prior), float(prior_fit),
                           echo_match=float(match))
        yield (float(t), float(prob), gate, WindowFeatures(float(voicing), float(dtmf)),
               bots[int(bot)], None if clean < 0 else float(clean))


def _first_stop(rows: np.ndarray, params: dict[str, Any], classifier: Any = None,
                inputs: list[tuple[Any, ...]] | None = None) -> float | None:
    """When the decision with ``params`` (and ``classifier``, if it uses one: the shipped
    weights by default) first stops the bot on these logged windows (``inputs``: their
    :func:`window_inputs` for ``params``, if already made)."""
    from vad import BargeInPolicy, BargeInSettings, Decision

    policy = BargeInPolicy(BargeInSettings(**_barge_in(params)), classifier)
    for t, prob, gate, feat, bot, clean in (window_inputs(rows, params) if inputs is None
                                            else inputs):
        out = policy.step(prob, gate, feat, bot, clean_prob=clean)
        if out and any(e.kind in (Decision.PAUSE, Decision.COMMIT) for e in out):
            return float(t)
    return None


def _least_pct(latencies: list[float], more: int, q: float, goal: float) -> float:
    """The least the ``q`` percentile (as :func:`score` reads it) can end at once up to ``more``
    latencies join ``latencies``: each one added can only lower it as far as putting it below
    them all, and fewer added lower it less; never under ``goal``, where :func:`objective`
    stops counting."""
    lat = sorted(latencies)
    n = len(lat) + more
    at = min(n - 1, round(q * (n - 1))) - more if n else -1
    return goal if at < 0 else max(goal, lat[at])


def score(log: dict[str, Any], params: dict[str, Any],
          classifiers: Callable[[int], Any] | None = None,
          inputs: list[list[tuple[Any, ...]]] | None = None) -> dict[str, Any]:
    """The first-stop scores of ``params`` over a windows log; ``classifiers`` gives the caller
    classifier for the log's call at each index (default: the shipped one); ``inputs``, each
    call's :func:`window_inputs` for ``params``' echo margins, if already made."""
    s = score_to_beat(log, params, classifiers, inputs)
    assert s is not None
    return s


def score_to_beat(log: dict[str, Any], params: dict[str, Any],
                  classifiers: Callable[[int], Any] | None = None,
                  inputs: list[list[tuple[Any, ...]]] | None = None,
                  beat: float | None = None) -> dict[str, Any] | None:
    """:func:`score`; with ``beat``, None as soon as the calls scored so far show that
    :func:`objective` cannot exceed it (the calls left all detected, no false stop among them,
    latencies no higher than :func:`_least_pct` allows): the search asks only whether a
    candidate beats its best."""
    rows = log["rows"]
    detected = expected = fs = fs_echo = echo_calls = 0
    latencies: list[float] = []
    truths = [_call_truth(m["labels"]) for m in log["meta"]]
    expected_all = sum(t["barge_in"] and t["onset"] is not None for t in truths)
    echo_all = sum(t["echo_only"] and not t["barge_in"] for t in truths)
    missed = 0
    # The barge-in calls first: with their detections and latencies known, what is left can
    # only add false stops, and most candidates that lose are out by then.
    order = (range(len(truths)) if beat is None
             else sorted(range(len(truths)), key=lambda i: not truths[i]["barge_in"]))
    for i in order:
        m, truth = log["meta"][i], truths[i]
        ts = _first_stop(rows[m["start"]:m["end"]], params,
                         None if classifiers is None else classifiers(i),
                         None if inputs is None else inputs[i])
        talking = ts is not None and any(a <= ts <= b for a, b in truth["turns"])
        if truth["barge_in"] and truth["onset"] is not None:
            expected += 1
            onset = float(truth["onset"])
            if ts is not None and onset - EARLY_SLACK_MS <= ts <= onset + LATE_LIMIT_MS:
                detected += 1
                latencies.append(ts - onset)
            else:
                missed += 1
                if ts is not None and ts < onset - EARLY_SLACK_MS and talking:
                    fs += 1
        elif talking:
            fs += 1
            if truth["echo_only"]:
                fs_echo += 1
        echo_calls += truth["echo_only"] and not truth["barge_in"]
        if beat is not None and objective({
                "calls": len(truths), "expected": expected_all,
                "detected": expected_all - missed, "false_stops": fs,
                "echo_only_calls": echo_all, "echo_only_false_stops": fs_echo,
                "latency_p50_ms": _least_pct(latencies, expected_all - expected, 0.5, 100.0),
                "latency_p95_ms": _least_pct(latencies, expected_all - expected, 0.95, 250.0),
                }) <= beat:
            return None
    lat = sorted(latencies)

    def pct(q: float) -> float | None:
        return lat[min(len(lat) - 1, round(q * (len(lat) - 1)))] if lat else None

    calls = len(log["meta"])
    return {"calls": calls, "expected": expected, "detected": detected, "false_stops": fs,
            "echo_only_calls": echo_calls, "echo_only_false_stops": fs_echo,
            "latency_p50_ms": pct(0.5), "latency_p95_ms": pct(0.95)}


def objective(s: dict[str, Any]) -> float:
    """Higher is better: detection first (a missed barge-in weighs three false stops), then no
    false stops (thrice as bad on echo-only calls), then latency over the issue's goals (p50
    100 ms, p95 250 ms)."""
    det = s["detected"] / max(1, s["expected"])
    fs = s["false_stops"] / max(1, s["calls"])
    fse = s["echo_only_false_stops"] / max(1, s["echo_only_calls"])
    p50 = s["latency_p50_ms"] or 1500.0
    p95 = s["latency_p95_ms"] or 1500.0
    return float(3.0 * det - fs - 2.0 * fse - 0.5 * max(0.0, p50 - 100.0) / 100.0
                 - 0.25 * max(0.0, p95 - 250.0) / 250.0)


# The echo veto's values before any fit (hand-set on the dev set and a few synthetic echo calls):
# the search starts from them and the file records their train scores beside the fitted ones.
HAND_TUNED: dict[str, Any] = {
    "barge_in.clean_p_min": 0.3, "barge_in.clean_veto_db": 15.0,
    "barge_in.worst_erl_db": None, "barge_in.any_lag_margin_db": None,
    "barge_in.any_lag_floor_db": None, "barge_in.no_echo_corr": None,
    "barge_in.clean_veto_locked": True, "barge_in.start_windows": 2,
    "barge_in.clean_on": None, "barge_in.clean_echo_db": 3.0, "barge_in.clean_noise_db": 3.0,
    "barge_in.clean_after_ms": 0.0,
    "barge_in.explain_share_db": None, "barge_in.explain_noise_db": 9.0,
    "barge_in.explain_voicing_min": 1.1, "barge_in.explain_until_ms": None,
    "barge_in.explain_veto_db": None, "barge_in.explain_background_db": None,
    "barge_in.explain_floor_pct": None, "barge_in.background_db": None,
    "barge_in.background_pct": 75.0, "barge_in.background_caller_db": 18.0,
    "barge_in.prior_margin_db": None, "barge_in.prior_fit_min": 0.5,
    "barge_in.prior_explained_db": None,
    "barge_in.impulse_voicing": None, "barge_in.impulse_db": 15.0,
}


CLASSIFIER_OFF: dict[str, Any] = {"barge_in.classifier_on": None,
                                  "barge_in.classifier_veto": None}
"""The thresholds here are fitted for the hand-set paths alone, as before the caller classifier
(``python -m bench.fit_classifier`` fits its fast path and veto on top of them)."""


def fit(log: dict[str, Any], *, candidates: int = 200, seed: int = 0, passes: int = 3,
        start: dict[str, Any] | None = None) -> dict[str, Any]:
    """Seeded random search over :data:`SEARCH` (from :data:`HAND_TUNED`, and from ``start``
    where given: the thresholds a refit would replace); the best candidate.

    A candidate replaces the one before it only by scoring strictly better, so where the train
    calls cannot tell two values apart, ``start``'s stays: a default moves on evidence, not on
    the order the search met its ties in. (Session 18: on four train seeds the search from
    :data:`HAND_TUNED` alone ended on the shipped thresholds but for ``prior_explained_db``
    1.0 -> None, which scored the same, call for call.)"""
    default = dict(HAND_TUNED)
    rng = random.Random(seed)
    drawn = [{k: rng.choice(v) for k, v in SEARCH.items()} for _ in range(candidates)]
    tried = ([dict(default, **start)] if start is not None else []) + [default] + drawn

    # Each call's windows as the policy gets them, made once per set of echo margins (the
    # gate's ``passes`` is all they change; the search varies none): built again for every
    # candidate, they were most of the fit's time (tests/vad/test_fit.py's rerun of the search,
    # alone on the 2-core machine: 177 -> 71 s, the same file back).
    made: dict[tuple[tuple[str, Any], ...], list[list[tuple[Any, ...]]]] = {}

    def score_off(params: dict[str, Any], beat: float | None = None) -> dict[str, Any] | None:
        p = dict(CLASSIFIER_OFF, **params)
        key = tuple(sorted((k, v) for k, v in p.items() if k.startswith("echo.")))
        if key not in made:
            made[key] = [list(window_inputs(log["rows"][m["start"]:m["end"]], p))
                         for m in log["meta"]]
        return score_to_beat(log, p, inputs=made[key], beat=beat)

    # A candidate that cannot beat the best so far is dropped part way (``score_to_beat``): it
    # would not have replaced the best, so the search ends where it did (the same file back).
    # With the barge-in calls scored first, the search from the shipped file's start took 121 ->
    # 60 s on this 2-core machine, another process on the other core (155 of its 234
    # candidates' worth of calls scored).
    best: tuple[float, int, dict[str, Any], dict[str, Any]] | None = None
    for i, params in enumerate(tried):
        s = score_off(params, None if best is None else best[0])
        if s is None:
            continue
        j = objective(s)
        if best is None or j > best[0]:
            best = (j, i, params, s)
    assert best is not None
    # Then coordinate ascent from the best: each threshold in turn over its candidates, the
    # others held, until a pass changes nothing (at most ``passes``).
    for _ in range(passes):
        moved = False
        for key, values in SEARCH.items():
            for v in values:
                if v == best[2][key]:
                    continue
                params = dict(best[2], **{key: v})
                s = score_off(params, best[0])
                if s is None:
                    continue
                j = objective(s)
                if j > best[0]:
                    best, moved = (j, best[1], params, s), True
        if not moved:
            break
    hand = score_off(default)
    assert hand is not None
    return {"params": best[2], "train": best[3], "objective": round(best[0], 4),
            "hand_tuned_train": hand, "candidates": candidates, "seed": seed,
            "passes": passes, "start": None if start is None else dict(start)}


SEEDS = (1, 3, 5, 7)
"""The simulator's seeds whose train calls are logged (4 calls per grid point each). Two seeds
(sessions 9-17) were too few: fitted on seeds 1 and 3 and on 5 and 7 apart, the search chose
different values for 7 of its 9 free thresholds, and each half's thresholds lost on the other
half to the shipped ones (objective 1.37 and 1.03 against 1.56 and 1.68); on all four, from
the hand-set values alone, it met the shipped thresholds' score with one tie
(``prior_explained_db`` None for 1.0), and from the shipped ones it keeps them (docs/bargein.md,
session 18)."""

GRIDS = ("small", "impacts")
"""The grids whose train calls the fit logs, each to its own windows file (``impacts`` is kept
out of ``small`` so that grid's calls, and its log, stay as they were)."""
def default_windows(grids: list[str]) -> list[Path]:
    """Each grid's shipped windows log (``train`` is the small grid's, its older name), read
    where it exists, else written: a plain ``python -m bench.fit_bargein`` refits the shipped
    logs (it logged every call again into the working directory before session 18, 10 minutes
    on this machine, and fitted those)."""
    data = Path(__file__).resolve().parent / "data"
    return [data / f"fit_windows_{'train' if g == 'small' else g}.npz" for g in grids]


WINDOWS = tuple(default_windows(list(GRIDS)))
"""The shipped windows logs of :data:`GRIDS`."""


def load_windows(paths: tuple[Path, ...] = WINDOWS) -> dict[str, Any]:
    """One log of the windows files ``paths`` (the shipped ones by default), in order."""
    return _concat([_load(p) for p in paths])


def main(argv: list[str] | None = None) -> int:
    from linesim import GRIDS as SIMULATOR_GRIDS, grid, iter_calls

    ap = argparse.ArgumentParser(prog="python -m bench.fit_bargein", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grid", choices=tuple(SIMULATOR_GRIDS), action="append",
                    help="a grid whose calls are logged; repeatable, each with its own "
                         f"--windows (default: {' and '.join(GRIDS)})")
    ap.add_argument("--calls-per-point", type=int, default=4)
    ap.add_argument("--seed", type=int, action="append",
                    help="the simulator's seed; repeatable: the calls of every seed are logged "
                         "and fitted together (default: 1, 3, 5 and 7)")
    ap.add_argument("--windows", type=Path, action="append",
                    help="each grid's windows log: read if it exists, else written "
                         "(default: the shipped logs, bench/data/fit_windows_train.npz for "
                         "small and fit_windows_GRID.npz for the others)")
    ap.add_argument("--acting", choices=("closed", "open"),
                    help="also log each grid's calls as the configured decision acts on them, "
                         "closed loop or open, beside its --windows (NAME_acting_LOOP.npz), for "
                         "bench.fit_classifier --acting; the fit reads neither")
    ap.add_argument("--candidates", type=int, default=200)
    ap.add_argument("--out", type=Path, default=FIT_FILE)
    ap.add_argument("--start", type=Path,
                    help="a fit file whose thresholds the search also starts from, so that a "
                         "tie keeps them (default: --out, where it exists)")
    ap.add_argument("--no-start", action="store_true",
                    help="search from the hand-set values alone")
    args = ap.parse_args(argv)
    start_file = args.start or (args.out if args.out.exists() else None)
    start = None
    if start_file is not None and not args.no_start:
        try:
            start = json.loads(start_file.read_text())["params"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            ap.error(f"--start {start_file}: not a fit file ({exc})")
    seeds = args.seed or list(SEEDS)
    grids = args.grid or list(GRIDS)
    paths = args.windows or default_windows(grids)
    if len(paths) != len(grids):
        ap.error(f"{len(grids)} grids need as many --windows, got {len(paths)}")
    logs = []
    for name, path in zip(grids, paths, strict=True):
        conditions = grid(name)
        jobs = [("never", path, "closed")]
        if args.acting:
            jobs.append(("configured", path.with_name(f"{path.stem}_acting_{args.acting}.npz"),
                         args.acting))
        for decision, out, loop in jobs:
            if not out.exists():
                _save(_concat([log_windows(list(iter_calls(
                    conditions, split="train", seed=seed,
                    count=len(conditions) * args.calls_per_point)), decision=decision,
                    loop=loop) for seed in seeds]), out)
        logs.append(_load(path))
    result = fit(_concat(logs), candidates=args.candidates, start=start)
    result["source"] = {"split": "train", "grids": grids, "calls_per_point":
                        args.calls_per_point, "seeds": seeds}
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(json.dumps({k: result[k] for k in ("params", "train", "hand_tuned_train")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
