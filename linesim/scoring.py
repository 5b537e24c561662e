"""Barge-in scoring with the rules of ``tools/eval_bargein.py`` (../shared/tools), importable.

The evaluator is a script outside the project; the project's tests and ``bench.robustness``
score timelines with this copy of its rules, and ``tests/linesim/test_scoring.py`` checks that
both give the same verdicts on the same timelines. Rules (docs/bargein.md):

* a barge-in recording must make the bot stop (the first ``clear_sent``, else ``barge_in``)
  between ``EARLY_SLACK_MS`` before and ``LATE_LIMIT_MS`` after the labelled onset; the distance
  is the latency; a stop earlier than that while the bot talks is a false stop (a false
  interrupt when it published ``barge_in``);
* on any other recording, a stop while the bot talks (to 200 ms after a turn) is a false stop;
* a stop within ``DTMF_GRACE_MS`` after a ``dtmf`` event, or one with reason ``dtmf`` during or
  just after a labelled tone, is the DTMF policy's and not scored; a barge-in onset in a turn a
  keypress already ended is not applicable;
* with ``non_interruptible`` any stop is a violation and a barge-in must be suppressed.
"""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["DTMF_GRACE_MS", "EARLY_SLACK_MS", "LATE_LIMIT_MS", "STOP_TYPES", "bot_speaking",
           "pause_gaps", "pct", "score", "summarize", "summary"]

STOP_TYPES = ("clear_sent", "barge_in")
EARLY_SLACK_MS = 50
LATE_LIMIT_MS = 1500
DTMF_GRACE_MS = 150


def bot_speaking(labels: dict[str, Any], t: float) -> bool:
    return any(b["start_ms"] <= t <= b["end_ms"] + 200 for b in labels.get("bot_turns", []))


def _stopped_by_dtmf(labels: dict[str, Any], events: list[dict[str, Any]],
                     dtmf_stops: list[float], onset: float) -> bool:
    turn = next((b for b in labels.get("bot_turns", [])
                 if b["start_ms"] <= onset <= b["end_ms"]), None)
    if turn is None:
        return False
    cuts = [t for t in dtmf_stops if turn["start_ms"] <= t < onset]
    if not cuts:
        return False
    restarted = any(e["type"] in ("bot_utterance_started", "bot_utterance_resumed")
                    and min(cuts) < float(e["t_ms"]) <= onset for e in events)
    return not restarted


def score(labels: dict[str, Any], events: list[dict[str, Any]],
          non_interruptible: bool = False) -> dict[str, Any]:
    """One recording's verdict, with the keys the evaluator reports."""
    expect = labels.get("expect", {})
    onset = expect.get("barge_in_onset_ms")
    wants = bool(expect.get("barge_in"))
    dtmf_at = [float(e["t_ms"]) for e in events if e["type"] == "dtmf"]
    tones = [(float(x["start_ms"]), float(x["end_ms"])) for x in labels.get("events", [])
             if x.get("kind") == "dtmf"]

    def dtmf_stop(e: dict[str, Any]) -> bool:
        t = float(e["t_ms"])
        if any(0 <= t - d <= DTMF_GRACE_MS for d in dtmf_at):
            return True
        return e.get("reason") == "dtmf" and any(a <= t <= b + DTMF_GRACE_MS for a, b in tones)

    stops = [e for e in events if e["type"] in STOP_TYPES and not dtmf_stop(e)]
    dtmf_stops = [float(e["t_ms"]) for e in events if e["type"] in STOP_TYPES and dtmf_stop(e)]
    clears = [e for e in stops if e["type"] == "clear_sent"]
    first_stop = next(iter(clears or stops), None)
    res: dict[str, Any] = {"name": labels["name"], "scenario": labels.get("scenario", "?"),
                           "expect_barge_in": wants, "latency_ms": None, "missed": False,
                           "false_stop": False, "false_interrupt": False, "dtmf_ok": None,
                           "violation": False, "suppressed": None}
    if non_interruptible:
        res["violation"] = bool(stops)
        if wants:
            res["suppressed"] = any(e["type"] == "interrupt_suppressed" for e in events)
    elif wants and _stopped_by_dtmf(labels, events, dtmf_stops, onset):
        res["not_applicable"] = "bot turn already ended by the DTMF policy before the onset"
    elif wants:
        early = [e for e in stops if float(e["t_ms"]) < onset - EARLY_SLACK_MS
                 and bot_speaking(labels, float(e["t_ms"]))]
        in_time = [e for e in stops
                   if onset - EARLY_SLACK_MS <= float(e["t_ms"]) <= onset + LATE_LIMIT_MS]
        res["false_stop"] = bool(early)
        res["false_interrupt"] = any(e["type"] == "barge_in" for e in early)
        if in_time:
            c = [e for e in in_time if e["type"] == "clear_sent"] or in_time
            res["latency_ms"] = float(c[0]["t_ms"]) - onset
        else:
            res["missed"] = True
    else:
        res["false_stop"] = any(bot_speaking(labels, float(e["t_ms"])) for e in stops)
        res["false_interrupt"] = any(e["type"] == "barge_in"
                                     and bot_speaking(labels, float(e["t_ms"])) for e in stops)
    if expect.get("dtmf"):
        got = "".join(str(e.get("digit", "")) for e in events if e["type"] == "dtmf")
        res["dtmf_ok"] = got == expect["dtmf"]
    res["first_stop_ms"] = float(first_stop["t_ms"]) if first_stop else None
    return res


def pause_gaps(events: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """``(clear_ms, gap_ms)`` for every pause that resumed (issue #12, item 6; the project's own
    measure, not the evaluator's): the audible gap runs from the ``clear_sent`` of a barge-in
    pause, when Twilio drops what it had queued, to the ``bot_utterance_resumed`` of that
    utterance, when its audio goes out again (the paced playout sends it at once: it plays from
    that media time). A pause that ended in an interrupt has no gap: the bot stopped for good."""
    gaps: list[tuple[float, float]] = []
    paused: dict[str, float] = {}
    for e in events:
        kind = e["type"]
        if kind == "clear_sent" and e.get("reason") == "barge_in":
            paused[str(e.get("utterance_id"))] = float(e["t_ms"])
        elif kind == "bot_utterance_resumed":
            at = paused.pop(str(e.get("utterance_id")), None)
            if at is not None:
                gaps.append((at, float(e["t_ms"]) - at))
        elif kind in ("bot_utterance_interrupted", "barge_in"):
            paused.pop(str(e.get("utterance_id")), None)
    return gaps


def pct(values: list[float], q: float) -> float | None:
    """The evaluator's percentile: the value at rank round(q * (n - 1))."""
    if not values:
        return None
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q * (len(values) - 1))))
    return values[k]


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The evaluator's summary line (``--json``) for a list of :func:`score` results."""
    lat = [r["latency_ms"] for r in results if r["latency_ms"] is not None]
    by_scenario: dict[str, int] = {}
    fi_by_scenario: dict[str, int] = {}
    for r in results:
        if r["false_stop"]:
            by_scenario[r["scenario"]] = by_scenario.get(r["scenario"], 0) + 1
        if r["false_interrupt"]:
            fi_by_scenario[r["scenario"]] = fi_by_scenario.get(r["scenario"], 0) + 1
    return {
        "recordings": len(results), "failed_to_replay": 0,
        "barge_in_expected": sum(r["expect_barge_in"] and not r.get("not_applicable")
                                 for r in results),
        "not_applicable": sum(bool(r.get("not_applicable")) for r in results),
        "detected": len(lat), "missed": sum(r["missed"] for r in results),
        "latency_p50_ms": statistics.median(lat) if lat else None,
        "latency_p95_ms": pct(lat, 0.95), "latency_max_ms": max(lat) if lat else None,
        "false_stops": sum(r["false_stop"] for r in results),
        "false_stops_by_scenario": by_scenario,
        "false_interrupts": sum(r["false_interrupt"] for r in results),
        "false_interrupts_by_scenario": fi_by_scenario,
        "dtmf_wrong": sum(r["dtmf_ok"] is False for r in results),
        "non_interruptible_violations": sum(r["violation"] for r in results),
        "not_suppressed": sum(r["suppressed"] is False for r in results),
    }


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """:func:`summarize` plus the sorted latencies (what the project's tests read)."""
    out = summarize(results)
    out["latencies"] = sorted(r["latency_ms"] for r in results if r["latency_ms"] is not None)
    return out
