"""Barge-in scoring with the rules of tools/eval_bargein.py (see docs/bargein.md), so the
project's own tests fail on a regression without the shared folder."""

from __future__ import annotations

import statistics
from typing import Any

STOP_TYPES = ("clear_sent", "barge_in")
EARLY_SLACK_MS = 50
LATE_LIMIT_MS = 1500
DTMF_GRACE_MS = 150


def bot_speaking(labels: dict[str, Any], t: float) -> bool:
    return any(b["start_ms"] <= t <= b["end_ms"] + 200 for b in labels.get("bot_turns", []))


def score(labels: dict[str, Any], events: list[dict[str, Any]], non_interruptible: bool) -> dict[str, Any]:
    expect = labels.get("expect", {})
    onset = expect.get("barge_in_onset_ms")
    wants = bool(expect.get("barge_in"))
    dtmf_at = [float(e["t_ms"]) for e in events if e["type"] == "dtmf"]
    stops = [e for e in events if e["type"] in STOP_TYPES
             and not any(0 <= float(e["t_ms"]) - t <= DTMF_GRACE_MS for t in dtmf_at)]
    res: dict[str, Any] = {"name": labels["name"], "scenario": labels.get("scenario"),
                           "expect_barge_in": wants, "latency_ms": None, "missed": False,
                           "false_stop": False, "false_interrupt": False, "violation": False,
                           "suppressed": None, "dtmf_ok": None}
    if non_interruptible:
        res["violation"] = bool(stops)
        if wants:
            res["suppressed"] = any(e["type"] == "interrupt_suppressed" for e in events)
    elif wants:
        early = [e for e in stops if float(e["t_ms"]) < onset - EARLY_SLACK_MS
                 and bot_speaking(labels, float(e["t_ms"]))]
        in_time = [e for e in stops if onset - EARLY_SLACK_MS <= float(e["t_ms"]) <= onset + LATE_LIMIT_MS]
        res["false_stop"] = bool(early)
        res["false_interrupt"] = any(e["type"] == "barge_in" for e in early)
        if in_time:
            c = [e for e in in_time if e["type"] == "clear_sent"] or in_time
            res["latency_ms"] = float(c[0]["t_ms"]) - onset
        else:
            res["missed"] = True
    else:
        res["false_stop"] = any(bot_speaking(labels, float(e["t_ms"])) for e in stops)
        res["false_interrupt"] = any(e["type"] == "barge_in" and bot_speaking(labels, float(e["t_ms"]))
                                     for e in stops)
    if expect.get("dtmf"):
        got = "".join(str(e.get("digit", "")) for e in events if e["type"] == "dtmf")
        res["dtmf_ok"] = got == expect["dtmf"]
    return res


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    lat = sorted(r["latency_ms"] for r in results if r["latency_ms"] is not None)
    return {
        "detected": len(lat),
        "missed": sum(r["missed"] for r in results),
        "latency_p50_ms": statistics.median(lat) if lat else None,
        "latency_max_ms": max(lat) if lat else None,
        "latencies": lat,
    }
