"""TurnClock (gateway/timeline.py): per-turn latencies from a call's timeline and downlink, and
their /metrics histograms. The event sequences are those CallSession emits (docs/turns.md);
tests/turns/test_bench_turns.py checks the same events from a real call."""

from __future__ import annotations

from typing import Any

from prometheus_client import generate_latest

from bus import protocol as bp

from gateway.metrics import GatewayMetrics
from gateway.timeline import TURN_STAGES, Timeline, TurnClock


def _call() -> tuple[Timeline, list[dict[str, Any]]]:
    timeline = Timeline()
    TurnClock(timeline)
    return timeline, timeline.events


def _reply(timeline: Timeline, uid: str, *, text_at: float, audio_at: float) -> None:
    timeline.downlink(text_at, bp.UtteranceStart(utterance_id=uid, node="n"))
    timeline.downlink(audio_at, bp.Audio(utterance_id=uid, payload=b""))
    timeline.downlink(audio_at + 5, bp.Audio(utterance_id=uid, payload=b""))


def test_an_early_reply_held_until_the_turn_end() -> None:
    timeline, events = _call()
    timeline.emit(1000, "speech_stopped")
    timeline.emit(1040, "turn_likely", speech_end_ms=840.0, silence_ms=200.0)
    timeline.emit(1200, "transcript", text="hello", final=False)  # a partial: not the final
    timeline.emit(1230, "transcript", text="yes", final=True)
    _reply(timeline, "u1", text_at=1600, audio_at=1820)
    timeline.emit(2000, "turn_end", speech_end_ms=840.0, wait_ms=1160.0, p_end=0.4,
                  text_hold=False)
    timeline.emit(2000, "bot_utterance_started", utterance_id="u1", play_at_ms=2020.0)
    timeline.emit(2060, "bot_utterance_heard", utterance_id="u1", played_from_ms=2020.0)
    [lat] = [e for e in events if e["type"] == "turn_latency"]
    assert lat == {"t_ms": 2060.0, "type": "turn_latency", "utterance_id": "u1",
                   "speech_end_ms": 840.0, "turn_end_ms": 1160.0, "transcript_ms": 390.0,
                   "llm_first_text_ms": 760.0, "tts_first_audio_ms": 980.0,
                   "first_audio_ms": 1180.0, "heard_ms": 1180.0, "stt_ms": 190.0,
                   "hold_ms": 20.0}


def test_a_reply_without_early_start_and_a_dropped_one() -> None:
    timeline, events = _call()
    # Turn 1: the caller resumed before the reply was heard: no latency for it.
    timeline.emit(500, "turn_end", speech_end_ms=100.0, wait_ms=400.0, p_end=0.5,
                  text_hold=False)
    timeline.emit(600, "transcript", text="my account is", final=True)
    _reply(timeline, "u1", text_at=900, audio_at=1100)
    timeline.emit(1150, "turn_resumed", utterance_id="u1", after_ms=650.0)
    timeline.emit(1160, "bot_utterance_started", utterance_id="u1", play_at_ms=1160.0)
    timeline.emit(1200, "bot_utterance_heard", utterance_id="u1", played_from_ms=1160.0)
    # Turn 2 (the whole turn): timed from its own end of speech and its own transcript.
    timeline.emit(3000, "turn_end", speech_end_ms=2500.0, wait_ms=500.0, p_end=0.6,
                  text_hold=False)
    timeline.emit(3150, "transcript", text="my account is four two", final=True,
                  replaces_previous=True)
    _reply(timeline, "u2", text_at=3500, audio_at=3700)
    timeline.emit(3710, "bot_utterance_started", utterance_id="u2", play_at_ms=3720.0)
    timeline.emit(3760, "bot_utterance_heard", utterance_id="u2", played_from_ms=3720.0)
    [lat] = [e for e in events if e["type"] == "turn_latency"]
    assert lat["utterance_id"] == "u2" and lat["speech_end_ms"] == 2500.0
    assert (lat["turn_end_ms"], lat["transcript_ms"], lat["first_audio_ms"]) == (500, 650, 1220)
    assert lat["stt_ms"] == 150.0 and lat["hold_ms"] == 20.0
    # The greeting (no caller turn before it) is never a turn.
    timeline.emit(5000, "bot_utterance_started", utterance_id="g", play_at_ms=5000.0)
    timeline.emit(5040, "bot_utterance_heard", utterance_id="g", played_from_ms=5000.0)
    assert len([e for e in events if e["type"] == "turn_latency"]) == 1


def test_metrics_observe_every_stage() -> None:
    state = {"calls": 1, "draining": False, "overloaded": False, "vad_batches": 0,
             "vad_windows": 0}
    metrics = GatewayMetrics(lambda: state)
    timeline, _ = _call()
    timeline.add_listener(metrics.observe_event)
    timeline.emit(500, "turn_end", speech_end_ms=100.0, wait_ms=400.0, p_end=0.5,
                  text_hold=False)
    timeline.emit(600, "transcript", text="yes", final=True)
    _reply(timeline, "u1", text_at=900, audio_at=1100)
    timeline.emit(1110, "bot_utterance_started", utterance_id="u1", play_at_ms=1110.0)
    timeline.emit(1150, "bot_utterance_heard", utterance_id="u1", played_from_ms=1110.0)
    timeline.emit(1200, "stt_error", error="boom", during="final", fallback="upload")
    text = generate_latest(metrics.registry).decode()
    for stage in TURN_STAGES:
        assert f'callgate_turn_latency_seconds_count{{stage="{stage}"}} 1.0' in text
    # Voice to voice 1.01 s: in the 1.1 s bucket, not in the 1.0 s one.
    assert 'callgate_turn_latency_seconds_bucket{le="1.0",stage="first_audio"} 0.0' in text
    assert 'callgate_turn_latency_seconds_bucket{le="1.1",stage="first_audio"} 1.0' in text
    assert "callgate_turn_stt_seconds_sum 0.1" in text
    assert 'callgate_stt_errors_total{fallback="upload"} 1.0' in text
