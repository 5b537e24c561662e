"""The pure parts: what was heard of an utterance's text, turn latencies, the printed lines."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from gateway.client import ConversationPrinter
from gateway.ops import TurnLatencies
from gateway.playback import Utterance


def _utterance(*spans: tuple[str, int]) -> Utterance:
    """Spans of text, each spoken by ``ms`` of audio in two pieces (as the worker streams)."""
    u = Utterance("u1", "main", True)
    at = 0
    for text, ms in spans:
        for half in (ms // 2, ms - ms // 2):
            u.audio.extend(b"\xff" * (8 * half))
            u.add_text(text, at, at + len(text), 8 * half)
        at += len(text)
    return u


def test_heard_text_follows_the_audio_heard() -> None:
    u = _utterance(("Hello there. ", 1000), ("Your balance is ten dollars.", 2000))
    assert u.text == "Hello there. Your balance is ten dollars."
    assert len(u.spans) == 2  # the two pieces of a span make one
    assert u.heard_text() == ""
    u.heard = 8 * 1000
    assert u.heard_text() == "Hello there."
    u.heard = 8 * 1500  # a quarter into the second span: cut back to a word boundary
    assert u.heard_text() == "Hello there. Your"
    u.heard = len(u.audio)
    assert u.heard_text() == u.text


def test_heard_text_without_text_spans() -> None:
    u = Utterance("u1", "main", True, text="Known up front.")
    u.audio.extend(b"\xff" * 800)
    assert u.heard_text() == ""
    u.heard = 800
    assert u.heard_text() == "Known up front."


def test_turn_latencies() -> None:
    t = TurnLatencies()
    assert t.feed({"type": "clear_sent", "t_ms": 3000, "onset_ms": 2916, "reason": "barge_in"}) \
        == [{"kind": "latency", "t_ms": 3000, "what": "onset_to_clear", "ms": 84.0}]
    assert t.feed({"type": "speech_stopped", "t_ms": 5000}) == []
    assert [r["what"] for r in t.feed({"type": "transcript", "t_ms": 5400, "text": "hi"})] \
        == ["stop_to_transcript"]
    out = t.feed({"type": "bot_utterance_started", "t_ms": 5420, "play_at_ms": 5440})
    assert [(r["what"], r["ms"]) for r in out] == [("transcript_to_bot_audio", 40.0),
                                                  ("stop_to_bot_audio", 440.0)]
    # A backchannel's transcript (dropped) starts no turn.
    t.feed({"type": "speech_stopped", "t_ms": 7000})
    assert t.feed({"type": "transcript", "t_ms": 7300, "text": "yes",
                   "dropped": "backchannel"}) == []


def test_printer_lines() -> None:
    p = ConversationPrinter()
    assert p.feed({"kind": "event", "type": "bot_utterance_started", "t_ms": 20,
                   "utterance_id": "u1", "node": "pay", "interruptible": False,
                   "text": "Your card ends in 42."}) == [
        '  0.02 s  bot [pay, NOT interruptible]: "Your card ends in 42."']
    assert p.feed({"kind": "event", "type": "interrupt_suppressed", "t_ms": 900,
                   "utterance_id": "u1", "policy": "keep"}) == [
        "  0.90 s  caller speaks over a non-interruptible utterance: interrupt suppressed "
        "(policy keep)"]
    assert p.feed({"kind": "event", "type": "bot_utterance_resumed", "t_ms": 1500,
                   "utterance_id": "u1", "heard_ms": 1240}) == [
        "  1.50 s  bot resumes from 1.24 s (the caller's sound was no turn: a backchannel or "
        "noise)"]
    assert p.feed({"kind": "event", "type": "dtmf", "t_ms": 2000, "digit": "#"}) == [
        "  2.00 s  caller pressed #"]
    assert p.feed({"kind": "event", "type": "call_ended", "t_ms": 3000, "reason": "hangup"}) \
        == ["  3.00 s  call ended: the bot hung up"]
    assert p.feed({"kind": "event", "type": "speech_started", "t_ms": 1}) == []


def test_console_is_never_open_on_a_gateway_that_checks_signatures(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    from config import ConfigHolder
    from gateway.server import settings_from_config

    monkeypatch.setenv("CALLGATE_VALIDATE_SIGNATURES", "true")
    monkeypatch.setenv("TWILIO_AUTH_TOKEN", "twilio-auth-token-0123456789")
    monkeypatch.delenv("CALLGATE_OPS_TOKEN", raising=False)
    monkeypatch.delenv("CALLGATE_CONSOLE", raising=False)
    shipped = Path(__file__).resolve().parents[2] / "config" / "agents.yaml"
    with caplog.at_level(logging.WARNING, logger="callgate.gateway"):
        settings = settings_from_config(ConfigHolder(shipped))
    assert settings.ops.enabled is False
    assert "console and ops streams OFF" in caplog.text
    monkeypatch.setenv("CALLGATE_OPS_TOKEN", "an-ops-token")
    settings = settings_from_config(ConfigHolder(shipped))
    assert settings.ops.enabled is True and settings.ops.token == "an-ops-token"
    assert settings.ops.agents() == ["support"]
