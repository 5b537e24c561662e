"""Recorded calls replay: a call made with `callgate call` against a real gateway whose agent
records, then `callgate replay FOLDER`, gives the same barge-in decisions at the same media
times; the folder also replays as the dev recordings do (bot turns from its .bot.wav)."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from audio import read_wav_ulaw
from gateway.recorder import RecordingSettings, prune, replay_folder
from gateway.replay import load_bot_script, replay
from tests import recordings_index as rec
from tests.console.conftest import ROOT, Served

DECISIONS = ("speech_started", "speech_stopped", "clear_sent", "bot_utterance_paused",
             "bot_utterance_resumed", "bot_utterance_interrupted", "barge_in",
             "interrupt_suppressed", "dtmf")


def decisions(events: list[dict[str, Any]]) -> list[tuple[str, float, Any]]:
    return [(e["type"], e["t_ms"], e.get("utterance_id")) for e in events
            if e["type"] in DECISIONS]


def recorded_folder(served: Served, call_sid: str) -> Path:
    """The call's folder; the gateway writes it right after the call's socket closes."""
    deadline = time.monotonic() + 30
    while not (found := [p for p in served.recordings.glob("*") if p.name.endswith(call_sid)]):
        assert time.monotonic() < deadline, served.log[-20:]
        time.sleep(0.1)
    assert len(found) == 1, found
    return found[0]


def read_events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.mark.slow
def test_a_call_recorded_by_the_gateway_replays_to_the_same_decisions(
        served: Served, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "call", str(rec.source("barge_in_command_goforward")),
         "--url", served.media_url, "--hold", "3"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    m = re.search(r"call (CA[0-9a-f]{32}) started", done.stdout)
    assert m, done.stdout
    folder = recorded_folder(served, m.group(1))
    name = folder.name
    for suffix in (".twilio.jsonl", ".downlink.jsonl", ".bot.wav", ".events.jsonl", ".json",
                   ".call.json"):
        assert (folder / f"{name}{suffix}").stat().st_size > 0, suffix
    capture = (folder / f"{name}.twilio.jsonl").read_text()
    assert '"token"' not in capture  # the call token is a credential: never recorded
    recorded = read_events(folder / f"{name}.events.jsonl")
    assert any(e["type"] == "barge_in" for e in recorded)

    out = tmp_path / "events.jsonl"
    page = tmp_path / "report.html"
    again = subprocess.run([sys.executable, "-m", "gateway", "replay", str(folder),
                            "--events-out", str(out), "--html", str(page)],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert decisions(read_events(out)) == decisions(recorded)
    report = page.read_text()
    assert report.count("<path ") == 2 and "go forward" in report  # waveforms, transcript

    # The labels skeleton: the bot's turns as sent, the caller as heard, ready for scoring.
    labels = json.loads((folder / f"{name}.json").read_text())
    assert labels["bot_wav"] == f"{name}.bot.wav"
    greeting = labels["bot_turns"][0]
    assert greeting["text"].startswith("Thanks for calling Acme") and greeting["interruptible"]
    clear = next(e for e in recorded if e["type"] == "clear_sent")
    # The greeting is there whole (the caller cut it off at the clear; a replay cuts it again).
    assert greeting["start_ms"] < clear["t_ms"] < greeting["end_ms"]
    assert labels["expect"]["barge_in"] is True
    assert labels["events"][0]["kind"] == "speech" and labels["events"][0]["unverified"]
    bot = read_wav_ulaw(folder / f"{name}.bot.wav")
    assert len(bot) / 8 >= labels["duration_ms"] - 1  # covers the call (and the reply's tail)


async def test_a_recorded_folder_replays_with_its_bot_turns_as_the_dev_recordings(
        tmp_path: Path) -> None:
    """A folder written by the recorder from an in-process call also replays the way
    eval_bargein.py replays the dev set: NAME.twilio.jsonl with NAME.json as the bot script."""
    from bus import EmbeddedBus, EmbeddedHub
    from gateway.call import CallSession
    from gateway.recorder import CallRecorder
    from gateway.timeline import Timeline
    from vad import VadEngine

    labels = rec.labels("barge_in_timit")
    labels["bot_wav"] = str(rec.RECORDINGS / labels["bot_wav"])
    settings = RecordingSettings(tmp_path / "rec")
    timeline = Timeline()
    recorder = CallRecorder(timeline, lambda agent: settings)
    # The live call: the dev recording's frames through a CallSession, the bot's turn
    # arriving as a worker's downlink (interleaved after the frame it follows).
    turn = load_bot_script(labels)[0]
    from bus import protocol as bp
    from gateway.replay import recording_messages

    sent: list[str] = []

    async def send(text: str) -> None:
        sent.append(text)

    async with VadEngine(runtime="onnx") as engine:
        bus = EmbeddedBus(hub=EmbeddedHub())
        await bus.start()
        session = CallSession(send=send, bus=bus, vad=engine, timeline=timeline)
        for line in recording_messages(rec.source("barge_in_timit")):
            recorder.inbound(line)
            await session.handle_text(line)
            if session.now_ms >= turn.start_ms and session.playback.get(turn.utterance_id) is None:
                for ev in [bp.UtteranceStart(utterance_id="u1", node="n", text="hello"),
                           bp.Audio(utterance_id="u1", payload=turn.audio),
                           bp.UtteranceEnd(utterance_id="u1")]:
                    await session.handle_downlink(ev)
        await session.end("stop")
        await bus.aclose()
        folder = await recorder.finish(session.settings)
        assert folder is not None
        again = await replay_folder(folder, vad=engine)
        assert decisions(again.events) == decisions(timeline.events)
        assert any(e["type"] == "barge_in" for e in again.events)
        name = folder.name
        scripted, _ = await replay(folder / f"{name}.twilio.jsonl",
                                   bot_script=load_bot_script(folder / f"{name}.json"),
                                   vad=engine)
    first = next(e for e in scripted.events if e["type"] == "clear_sent")
    live = next(e for e in timeline.events if e["type"] == "clear_sent")
    assert abs(first["t_ms"] - live["t_ms"]) <= 40  # the same barge-in, within two frames


def test_retention_by_count_and_age(tmp_path: Path) -> None:
    root = tmp_path / "rec"
    names = [f"2026120{d}T120000Z-CA{d:032d}" for d in range(1, 6)]
    for n in names:
        (root / n).mkdir(parents=True)
    (root / "notes").mkdir()  # not a call folder: never touched
    old = time.time() - 3 * 86400
    os.utime(root / names[3], (old, old))
    gone = prune(RecordingSettings(root, keep_calls=3, keep_days=2))
    assert sorted(p.name for p in gone) == [names[0], names[1], names[3]]
    assert sorted(p.name for p in root.iterdir()) == [names[2], names[4], "notes"]


async def test_an_agent_that_does_not_record_keeps_nothing(tmp_path: Path) -> None:
    from gateway.call import CallSettings
    from gateway.recorder import CallRecorder, RecorderState
    from gateway.timeline import Timeline

    timeline = Timeline()
    recorder = CallRecorder(timeline, lambda agent: None if agent == "private" else
                            RecordingSettings(tmp_path))
    recorder.inbound('{"event":"connected","protocol":"Call","version":"1.0.0"}')
    assert recorder.state is RecorderState.UNDECIDED
    timeline.emit(0, "call_started", call_sid="CA1", stream_sid="MZ1", agent="private")
    assert recorder.state is RecorderState.OFF and not timeline.sampling
    recorder.inbound('{"event":"stop"}')
    assert await recorder.finish(CallSettings()) is None
    assert list(tmp_path.iterdir()) == []


def test_a_start_frame_is_recorded_without_its_token_and_a_malformed_one_as_it_came() -> None:
    from gateway.recorder import _strip_token

    good = json.dumps({"event": "start", "start": {"customParameters": {"token": "t.k.n", "x": "1"}}})
    assert json.loads(_strip_token(good))["start"]["customParameters"] == {"x": "1"}
    for line in ('{"event":"start","start":1}', '{"event":"start"}', '{"event":"start","start":[]}',
                 "not json", '["start"]'):
        assert _strip_token(line) == line  # kept as it came: the call controller skips it


async def test_a_long_call_is_recorded_up_to_max_seconds_and_replays_to_there(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A recorded call is held in memory until it ends: ``max_seconds`` bounds it. The folder
    keeps the call's first ``max_seconds`` of media, says where it was cut, and replays to the
    same decisions up to the cut."""
    from bus import EmbeddedBus
    from gateway.call import CallSession
    from gateway.recorder import CallRecorder, RecorderState
    from gateway.replay import recording_messages
    from gateway.timeline import Timeline
    from vad import VadEngine

    timeline = Timeline()
    recorder = CallRecorder(timeline, lambda agent: RecordingSettings(tmp_path, max_seconds=4.0))

    async def send(text: str) -> None:
        pass

    async with VadEngine(runtime="onnx") as engine, EmbeddedBus() as bus:
        session = CallSession(send=send, bus=bus, vad=engine, timeline=timeline)
        for line in recording_messages(rec.source("barge_in_timit")):
            recorder.inbound(line)
            await session.handle_text(line)
        await session.end("stop")
        assert recorder.state is RecorderState.FULL and session.now_ms > 6000
        folder = await recorder.finish(session.settings)
        assert folder is not None
        frames = [json.loads(x) for x in
                  (folder / f"{folder.name}.twilio.jsonl").read_text().splitlines()]
        assert [f["event"] for f in frames[:2]] == ["connected", "start"]
        assert sum(f["event"] == "media" for f in frames) == 200  # 4 s of 20 ms frames
        call = json.loads((folder / f"{folder.name}.call.json").read_text())
        assert call["truncated_after_s"] == 4.0
        with caplog.at_level(logging.WARNING, logger="callgate.recorder"):
            again = await replay_folder(folder, vad=engine)
        assert "recorded for its first 4 s only" in caplog.text
    live = [d for d in decisions(timeline.events) if d[1] < 3900]
    assert live and live[0][0] == "speech_started"  # the caller starts at 2.85 s
    assert decisions(again.events)[:len(live)] == live
