"""The shipped config, offline, end to end: the default agent greets in eSpeak NG's voice, hears
the caller through pocketsphinx, answers from its keyword script, and can be interrupted.

The recording: a caller says "go forward ten meters" over the greeting (pocketsphinx hears
"go forward ..."). A copy of the shipped config adds one rule for the keyword "forward", so
the answer comes from the script, not the fallback. A config reload during the call leaves the
call alone; the next call gets the new greeting.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from audio import ulaw_to_float32
from config import ConfigHolder
from gateway.replay import replay
from gateway.server import TranscriberCache, call_settings_from
from gateway.timeline import Timeline
from nodes import Synthesizer, ToneSynthesizer, run_worker
from tests import recordings_index as rec
from vad import load_runtime, probabilities

ROOT = Path(__file__).resolve().parents[1]
RULE = '''      - keywords: [forward]
        reply: "Moving forward. Anything else?"
'''


def _config(tmp_path: Path, greeting: str | None = None) -> Path:
    text = (ROOT / "config" / "agents.yaml").read_text()
    anchor = "\n    script:\n"  # the agent's rules, not a node's
    assert anchor in text
    text = text.replace(anchor, anchor + RULE, 1)
    if greeting is not None:
        old = text.split('greeting: "', 1)[1].split('"', 1)[0]
        text = text.replace(old, greeting, 1)
    path = tmp_path / "agents.yaml"
    path.write_text(text)
    return path


async def _call(
    holder: ConfigHolder, timeline: Timeline, *, synthesizer: Synthesizer | None = None
) -> bytes:
    """One replayed call against the configured agent; returns the bot audio Twilio played.
    ``synthesizer``: speak with it instead of the agent's TTS."""
    transcribers = TranscriberCache(holder)
    try:
        await transcribers.warm_up()
        cfg = holder.current
        speak_with = None if synthesizer is None else (lambda agent: synthesizer)
        _, playout = await replay(
            rec.source("barge_in_command_goforward"),
            agent=lambda bus, stop: run_worker(holder, bus, stop=stop,
                                               synthesizer_factory=speak_with),
            transcriber_for=lambda info: transcribers(info.agent),
            settings=call_settings_from(cfg.agents[cfg.default_agent].barge_in),
            timeline=timeline, keep_audio=True,
        )  # fmt: skip
    finally:
        transcribers.close()
    return bytes(playout.stats.played)


@pytest.mark.slow
async def test_offline_agent_greets_hears_answers_and_is_interrupted(tmp_path: Path) -> None:
    holder = ConfigHolder(_config(tmp_path))
    timeline = Timeline()
    reloaded: list[bool] = []

    def reload_mid_call(event: dict[str, Any]) -> None:
        if event["type"] == "barge_in" and not reloaded:
            _config(tmp_path, greeting="Welcome back to Acme.")
            reloaded.append(holder.reload())

    timeline.add_listener(reload_mid_call)
    played = await _call(holder, timeline)
    events = timeline.events
    greeting = holder.current  # (already the new config; the call kept the old one)
    started = [e for e in events if e["type"] == "bot_utterance_started"]
    assert started[0]["node"] == "main" and started[0]["text"].startswith("Thanks for calling Acme")
    # The greeting was interrupted by the caller's command ...
    barge = [e for e in events if e["type"] == "barge_in"]
    assert barge and barge[0]["utterance_id"] == started[0]["utterance_id"]
    clear = next(e for e in events if e["type"] == "clear_sent")
    assert clear["t_ms"] - rec.labels("barge_in_command_goforward")["expect"]["barge_in_onset_ms"] < 250
    # ... heard through pocketsphinx ...
    transcript = next(e for e in events if e["type"] == "transcript" and not e.get("dropped"))
    assert "forward" in transcript["text"]
    # ... and answered from the script.
    assert len(started) >= 2 and started[1]["node"] == "main"
    assert events[-1]["type"] == "call_ended"
    # The bot's audio is eSpeak NG speech: Silero hears speech in most of it.
    speech = ulaw_to_float32(played)
    assert len(speech) > 8000 * 3  # the greeting alone is several seconds
    probs = probabilities(load_runtime("onnx"), speech)
    assert float(np.mean(probs > 0.5)) > 0.5
    # The reload happened mid-call and did not disturb it; the next call greets anew.
    assert reloaded == [True]
    assert greeting.agents["support"].greeting == "Welcome back to Acme."
    timeline2 = Timeline()
    await _call(holder, timeline2)
    first = next(e for e in timeline2.events if e["type"] == "bot_utterance_started")
    assert first["text"] == "Welcome back to Acme."


# -- the same timeline however loaded the machine is (issue #13, item 9) -----------------------
#
# A replay with an agent used to run at 1x in wall time: on a busy machine the transcript and the
# worker's answer came later in media time, or after the recording had ended. Now each frame waits
# for the work it started. eSpeak NG's output depends on what it rendered before in the same
# process (by a few samples: 17071, 17074, 17077 bytes for the same sentence three times), so the
# in-process comparison speaks with a deterministic test tone; the CLI one runs each replay in a
# fresh process, with eSpeak NG.

HOG = "import time\nend = time.monotonic() + 600\nwhile time.monotonic() < end: pass\n"


def _normalized(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The timeline with the worker's utterance ids (random) replaced by their order."""
    ids: dict[str, str] = {}
    out = []
    for event in events:
        uid = event.get("utterance_id")
        if isinstance(uid, str) and uid.startswith("utt-"):
            event = {**event, "utterance_id": ids.setdefault(uid, f"utt#{len(ids)}")}
        out.append(event)
    return out


def _worth_comparing(events: list[dict[str, Any]]) -> None:
    """The caller barges in on the greeting, is heard, and is answered."""
    types = [e["type"] for e in events]
    assert {"transcript", "barge_in", "bot_utterance_interrupted"} <= set(types), types
    assert types.count("bot_utterance_started") >= 2, types


@contextlib.contextmanager
def _busy_cores() -> Iterator[None]:
    """Every core busy in another process for as long as the block runs."""
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(os.cpu_count() or 2)]
    try:
        yield
    finally:
        for proc in hogs:
            proc.kill()
            proc.wait()


async def _loop_hog(stop: asyncio.Event) -> None:
    """Holds this process's event loop 20 ms at a time, letting it run 2 ms in between (as a
    stuck callback or long GC pauses would)."""
    while not stop.is_set():
        end = time.perf_counter() + 0.020
        while time.perf_counter() < end:
            pass
        await asyncio.sleep(0.002)


@pytest.mark.slow
async def test_replay_gives_the_same_timeline_with_the_loop_and_every_core_busy(
    tmp_path: Path,
) -> None:
    holder = ConfigHolder(_config(tmp_path))
    tone = ToneSynthesizer(60)  # 6.3 s of greeting: the caller talks over it at 5.1 s
    quiet = Timeline()
    await _call(holder, quiet, synthesizer=tone)
    _worth_comparing(quiet.events)
    stop = asyncio.Event()
    with _busy_cores():
        hog = asyncio.create_task(_loop_hog(stop))
        try:
            busy = Timeline()
            await _call(holder, busy, synthesizer=tone)
        finally:
            stop.set()
            await hog
    assert _normalized(busy.events) == _normalized(quiet.events)


def _replay_cli(tmp_path: Path, config: Path, name: str) -> list[dict[str, Any]]:
    out = tmp_path / f"{name}.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "replay", str(rec.source("barge_in_command_goforward")),
         "--config", str(config), "--events-out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    # Its stderr in the failure: one run of the suite saw this replay die with SIGABRT (not
    # reproduced in 9 reruns, quiet or busy), and CalledProcessError shows no output.
    assert done.returncode == 0, f"replay exited {done.returncode}:\n{done.stderr[-4000:]}"
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.slow
def test_callgate_replay_gives_the_same_events_with_every_core_busy(tmp_path: Path) -> None:
    config = _config(tmp_path)
    quiet = _replay_cli(tmp_path, config, "quiet")
    _worth_comparing(quiet)
    with _busy_cores():
        busy = _replay_cli(tmp_path, config, "busy")
    assert _normalized(busy) == _normalized(quiet)
