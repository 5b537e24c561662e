"""A long, hesitant caller turn through the real gateway and the shipped offline agent.

long_turn_librivox: the bot asks a question, then the caller reads three sentences (~14.6 s)
with two ~460 ms pauses between them. Before turn taking, each pause ended a "turn": three
transcripts, and the agent answered the first while the caller was still talking. Now the
call's timeline shows one turn end (after the caller's last word), one transcript, and no bot
audio inside the caller's turn.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from config import ConfigHolder
from gateway.replay import replay
from gateway.server import TranscriberCache, call_settings_from
from gateway.timeline import Timeline
from nodes import run_worker
from tests import recordings_index as rec

ROOT = Path(__file__).resolve().parents[2]
NAME = "long_turn_librivox"


async def _replay(holder: ConfigHolder, turn: object) -> list[dict[str, object]]:
    transcribers = TranscriberCache(holder)
    timeline = Timeline()
    try:
        await transcribers.warm_up()
        cfg = holder.current
        await replay(
            rec.source(NAME),
            agent=lambda bus, stop: run_worker(holder, bus, stop=stop),
            transcriber_for=lambda info: transcribers(info.agent),
            settings=call_settings_from(cfg.agents[cfg.default_agent].barge_in, turn),
            timeline=timeline,
        )
    finally:
        transcribers.close()
    return timeline.events


@pytest.mark.slow
async def test_a_long_hesitant_turn_is_one_turn_and_the_bot_stays_quiet_inside_it() -> None:
    holder = ConfigHolder(ROOT / "config" / "agents.yaml")
    speech = [e for e in rec.labels(NAME)["events"] if e["kind"] == "speech"]
    first, last = speech[0]["start_ms"], speech[-1]["end_ms"]
    defaults = holder.current.agents[holder.current.default_agent].turn
    events = await _replay(holder, defaults)

    ends = [e for e in events if e["type"] == "turn_end"]
    assert len(ends) == 1
    assert last <= ends[0]["t_ms"] <= last + defaults.max_wait_ms + 200  # within the wait
    # The transcript goes out early at each pause (turn_likely) so the agent can start; the
    # caller went on both times before hearing the reply, so each later transcript carries the
    # whole turn so far and replaces the one before: the agent ends with one user message.
    transcripts = [e for e in events if e["type"] == "transcript" and not e.get("dropped")]
    assert len([e for e in events if e["type"] == "turn_resumed"]) == len(transcripts) - 1 >= 2
    assert all(t.get("replaces_previous") for t in transcripts[1:])
    for before, after in zip(transcripts, transcripts[1:], strict=False):
        assert str(after["text"]).startswith(str(before["text"]))
    # The policy still reports each pause (speech_stopped), but none of them ended the turn.
    stopped = [e for e in events if e["type"] == "speech_stopped" and first < e["t_ms"] < last]
    assert len(stopped) >= 2
    # No bot audio starts inside the caller's turn (the greeting plays before it).
    inside = [e for e in events if e["type"] == "bot_utterance_started"
              and first <= float(e.get("play_at_ms", e["t_ms"])) <= last]
    assert inside == []
    assert any(e["type"] == "bot_utterance_started" and e["t_ms"] > last for e in events)

    # The plain 200 ms silence timer, same call: a turn at every pause, and the bot answers
    # into them (the caller's next sentence then barges in on it).
    from config import TurnConfig

    late = await _replay(holder, defaults.model_copy(update={"early_ms": 0.0}))
    assert len([e for e in late if e["type"] == "transcript" and not e.get("dropped")]) == 1
    assert not [e for e in late
                if e["type"] == "bot_utterance_started" and first <= e["t_ms"] <= last]

    timer = await _replay(holder, TurnConfig(mode="silence", silence_ms=200, early_ms=0))
    assert len([e for e in timer if e["type"] == "turn_end"]) >= 3
    assert [e for e in timer
            if e["type"] == "bot_utterance_started" and first <= e["t_ms"] <= last]

