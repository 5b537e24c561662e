"""`callgate replay` against every recording in tests/recordings (the replay contract)."""

from __future__ import annotations

from typing import Any

import pytest

from tests import recordings_index as rec
from tests.gateway import scoring

NAMES = rec.names()


def test_recordings_are_present() -> None:
    assert len(NAMES) == 24


@pytest.mark.parametrize("name", NAMES)
def test_timeline_matches_labels(name: str, replayed: dict[str, list[dict[str, Any]]]) -> None:
    labels = rec.labels(name)
    events = replayed[name]
    assert events[-1]["type"] == "call_ended"
    assert events == sorted(events, key=lambda e: e["t_ms"])
    digits = "".join(e["digit"] for e in events if e["type"] == "dtmf")
    assert digits == labels["expect"]["dtmf"]
    started = {e["utterance_id"]: e for e in events if e["type"] == "bot_utterance_started"}
    finished = {e["utterance_id"]: e for e in events if e["type"] == "bot_utterance_finished"}
    cut = {e.get("utterance_id") for e in events
           if e["type"] in ("clear_sent", "barge_in", "bot_utterance_paused",
                            "bot_utterance_interrupted")}
    for i, turn in enumerate(labels["bot_turns"]):
        uid = f"turn-{i}"
        assert uid in started, f"{uid} never started"
        assert abs(started[uid]["t_ms"] - turn["start_ms"]) <= 40
        assert started[uid]["node"] == "bot-script"
        if uid not in cut:
            assert uid in finished, f"{uid} never finished"
            assert abs(finished[uid]["t_ms"] - turn["end_ms"]) <= 40


def test_replay_is_deterministic(replayed: dict[str, list[dict[str, Any]]]) -> None:
    import asyncio

    from tests.gateway.conftest import _script
    from gateway.replay import replay

    name = "echo_plus_barge_in"
    timeline, _ = asyncio.run(replay(rec.source(name), bot_script=_script(name, False)))
    assert timeline.events == replayed[name]


def test_barge_in_scores(replayed: dict[str, list[dict[str, Any]]]) -> None:
    """The evaluator's rules on every recording: this is the barge-in regression gate."""
    results = [scoring.score(rec.labels(n), replayed[n], False) for n in NAMES]
    by_name = {r["name"]: r for r in results}
    summ = scoring.summary(results)
    expected = sum(rec.labels(n)["expect"]["barge_in"] for n in NAMES)
    assert summ["detected"] == expected and summ["missed"] == 0, results
    assert summ["latency_p50_ms"] <= 120
    # Every barge-in within 250 ms, the 5 dB SNR kitchen one included (the band path).
    slow = {r["name"]: r["latency_ms"] for r in results
            if r["latency_ms"] is not None and r["latency_ms"] > 250}
    assert not slow, slow
    assert summ["latency_max_ms"] <= 250
    for r in results:
        if r["scenario"] in ("noise_only", "echo", "silence", "dtmf", "normal_turn"):
            assert not r["false_stop"], r
        assert not r["false_interrupt"], r
        if r["dtmf_ok"] is not None:
            assert r["dtmf_ok"], r
    for n in ("backchannel_real_yes", "backchannel_uhhuh_mmhmm"):
        assert not any(e["type"] == "barge_in" for e in replayed[n])
        # Paused for the backchannel, then resumed from what the caller heard.
        assert any(e["type"] == "bot_utterance_resumed" for e in replayed[n])
    assert not by_name["echo_only_short_delay"]["false_stop"]


def test_non_interruptible_is_never_cut(
    replayed_non_interruptible: dict[str, list[dict[str, Any]]],
) -> None:
    results = [scoring.score(rec.labels(n), replayed_non_interruptible[n], True) for n in NAMES]
    assert not [r["name"] for r in results if r["violation"]]
    assert not [r["name"] for r in results if r["suppressed"] is False]
    for n in NAMES:
        events = replayed_non_interruptible[n]
        assert not [e for e in events if e["type"] in ("clear_sent", "barge_in")]
        labels = rec.labels(n)
        finished = {e["utterance_id"] for e in events if e["type"] == "bot_utterance_finished"}
        # Every turn plays to its end (the recording may stop before a late turn is over).
        for i, turn in enumerate(labels["bot_turns"]):
            if turn["end_ms"] + 40 <= labels["duration_ms"]:
                assert f"turn-{i}" in finished, (n, i)
