"""The shipped config, offline, end to end: the default agent greets in eSpeak NG's voice, hears
the caller through pocketsphinx, answers from its keyword script, and can be interrupted.

The recording: a caller says "go forward ten meters" over the greeting (pocketsphinx hears
"go forward ..."). A copy of the shipped config adds one rule for the keyword "forward", so
the answer comes from the script, not the fallback. A config reload during the call leaves the
call alone; the next call gets the new greeting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from config import ConfigHolder
from gateway.audio import ulaw_to_float32
from gateway.replay import replay
from gateway.server import TranscriberCache, call_settings_from
from gateway.timeline import Timeline
from nodes import run_worker
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


async def _call(holder: ConfigHolder, timeline: Timeline) -> bytes:
    """One replayed call against the configured agent; returns the bot audio Twilio played."""
    transcribers = TranscriberCache(holder)
    await transcribers.warm_up()
    cfg = holder.current
    _, playout = await replay(
        rec.source("barge_in_command_goforward"),
        agent=lambda bus, stop: run_worker(holder, bus, stop=stop),
        transcriber_for=lambda info: transcribers(info.agent),
        settings=call_settings_from(cfg.agents[cfg.default_agent].barge_in),
        timeline=timeline, speed=1.0, keep_audio=True,
    )
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
