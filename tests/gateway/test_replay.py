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


def _strong_echo_call(tmp_path: Any, *, delay_ms: int, erl_db: float) -> tuple[Any, Any]:
    """An echo-only call: the bot's voice of a dev recording coming back at ``erl_db`` of echo
    return loss (6-9 dB: a loud handset) and ``delay_ms``, from the bot's first word, under
    -50 dBFS of line noise. Nobody talks: every pause is a false stop."""
    import json

    import numpy as np

    from audio import (
        float32_to_pcm16,
        pcm16_to_ulaw,
        read_wav_ulaw,
        ulaw_to_float32,
        write_wav_ulaw,
    )

    labels = json.loads((rec.RECORDINGS / "long_turn_librivox.json").read_text())
    bot_wav = rec.RECORDINGS / labels["bot_wav"]
    bot = ulaw_to_float32(read_wav_ulaw(bot_wav)).astype(np.float64)
    d = delay_ms * 8
    echo = np.concatenate([np.zeros(d), bot])[: len(bot)] * 10 ** (-erl_db / 20)
    line = echo + np.random.default_rng(7).normal(0, 10 ** (-50 / 20), len(bot))
    wav = tmp_path / "strong_echo.wav"
    write_wav_ulaw(wav, pcm16_to_ulaw(float32_to_pcm16(np.clip(line, -1, 1).astype(np.float32))))
    script = dict(labels, bot_wav=str(bot_wav))
    return wav, script


# 450 ms and 8 dB was a known limit (strict xfail) until session 16: the echo stands 13-17 dB
# over the gate's pre-lock prediction, and 1.6 s in AEC3's residual scores 0.6-0.8. The caller
# classifier retrained with the gate's echo_match among its inputs vetoes those windows at its
# fitted 0.2 (with a veto of 0.1, or none, the bot is paused 1960 ms in).
@pytest.mark.parametrize(("delay_ms", "erl_db"), [
    (150, 7.0),
    (300, 9.0),
    (450, 8.0),
])
async def test_strong_echo_from_the_first_word_never_stops_the_bot(
        tmp_path: Any, delay_ms: int, erl_db: float) -> None:
    """With AEC3 in front and the fitted echo veto (the defaults), a loud echo from the bot's
    first word stops nothing; the echo gate alone (``echo_canceller: off``, the decision before
    issue #12) pauses the bot on it, which shows the case is hard."""
    from gateway.call import CallSettings
    from gateway.replay import load_bot_script, replay
    from vad import AecMode

    wav, script = _strong_echo_call(tmp_path, delay_ms=delay_ms, erl_db=erl_db)
    paused = {}
    for mode in (AecMode.AEC3, AecMode.OFF):
        timeline, _ = await replay(wav, bot_script=load_bot_script(script),
                                   settings=CallSettings(echo_canceller=mode))
        paused[mode] = [e["t_ms"] for e in timeline.events
                        if e["type"] == "bot_utterance_paused"]
    assert paused[AecMode.AEC3] == []
    assert paused[AecMode.OFF]
