"""A node never runs ahead of what the caller hears, in replayed calls.

The seed's ``StatefulAgent`` (verbatim, from ``test_seed_snippets``) is declared in YAML and run by
``run_worker`` behind the gateway, replaying ``turn_gap_then_barge_in``: the caller answers in a
gap (pocketsphinx transcribes it, the agent explains its return policy in four chunks), then talks
over that answer. The text to speech's pace decides which chunk the caller is hearing at the
barge-in; the node's progress logged in ``_handle_interrupt`` must be that chunk's (25% while the
second plays, 50% while the third does), not 100% as when chunks were pulled as fast as text to
speech returned them.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from bus import Bus, EmbeddedBus, EmbeddedHub, Event
from config import ConfigHolder
from gateway.call import CallSettings
from gateway.replay import replay
from nodes import ToneSynthesizer, run_worker
from speech import make_transcriber
from tests import recordings_index as rec
from vad._turn import TurnSettings

from .test_seed_snippets import logger as seed_logger

# The seed's StatefulAgent, chunk by chunk, and its progress once each has been yielded.
CHUNKS = [
    "Let me explain our return policy. ",
    "You have 30 days to return items. ",
    "Items must be unused and in original packaging. ",
    "Refunds are processed within 5 business days.",
]
LOOKAHEAD_MS = 300.0
# Pacing is under test, not turn taking: a short fixed wait answers the caller's first turn at
# a known time (as before the end-of-turn detector), so the barge-in lands in the chunk each
# case is built for.
SETTINGS = CallSettings(turn=TurnSettings(mode="silence", silence_ms=200.0, early_ms=0.0))

YAML = f"""
default_agent: policy
agents:
  policy:
    tts: {{lookahead_ms: {LOOKAHEAD_MS}}}
    nodes:
      - {{kind: python, name: stateful-agent, ref: "tests.nodes.test_seed_snippets:StatefulAgent"}}
"""


async def _replay(
    tmp_path: Path, ms_per_char: int, uplink: list[Event] | None = None
) -> list[dict[str, Any]]:
    """The replayed call's timeline; what the gateway published goes into ``uplink``."""
    path = tmp_path / "agents.yaml"
    path.write_text(YAML)
    holder = ConfigHolder(path, env={})

    async def agent(bus: Bus, stop: asyncio.Event) -> None:
        await run_worker(holder, bus, worker_id="w-paced", stop=stop, drain_timeout_s=20,
                         synthesizer_factory=lambda agent: ToneSynthesizer(ms_per_char))

    transcriber = make_transcriber("pocketsphinx")
    await transcriber.warm_up(1)
    bus = EmbeddedBus(hub=EmbeddedHub())
    publish = bus.publish

    async def recorded(call_sid: str, event: Event) -> str:
        if uplink is not None:
            uplink.append(event)
        return await publish(call_sid, event)

    bus.publish = recorded  # type: ignore[method-assign]
    await bus.start()
    try:
        timeline, _ = await replay(rec.source("turn_gap_then_barge_in"), agent=agent, bus=bus,
                                   transcriber_for=lambda call: transcriber, settings=SETTINGS)
    finally:
        await bus.aclose()
    return timeline.events


def _chunk_heard(heard_ms: float, ms_per_char: int) -> int:
    """1-based index of the chunk playing ``heard_ms`` into the utterance."""
    end = 0.0
    for index, chunk in enumerate(CHUNKS, 1):
        end += len(chunk) * ms_per_char
        if heard_ms < end:
            return index
    return len(CHUNKS) + 1


@pytest.mark.slow
@pytest.mark.parametrize(("ms_per_char", "chunk", "progress"), [(70, 2, 25), (40, 3, 50)])
async def test_stateful_agent_progress_is_the_chunk_the_caller_hears(
    caplog: pytest.LogCaptureFixture, tmp_path: Path, ms_per_char: int, chunk: int,
    progress: int,
) -> None:
    caplog.set_level(logging.INFO, logger=seed_logger.name)
    uplink: list[Event] = []
    events = await _replay(tmp_path, ms_per_char, uplink)
    barge = [e for e in events if e["type"] == "barge_in"]
    assert barge and barge[0]["node"] == "stateful-agent", events
    heard_ms = barge[0]["heard_ms"]
    # The pace puts the barge-in inside this chunk, clear of its last LOOKAHEAD_MS (where
    # the next one has been pulled already).
    assert _chunk_heard(heard_ms, ms_per_char) == chunk
    chunk_end = sum(len(c) for c in CHUNKS[:chunk]) * ms_per_char
    assert heard_ms < chunk_end - LOOKAHEAD_MS
    logged = [m for m in caplog.messages if m.startswith("Interrupted during")]
    assert logged == [f"Interrupted during explaining_policy at {progress}% progress"]
    # What the gateway was given is what was pulled: the chunks up to the one playing, and
    # at most the next (pulled within LOOKAHEAD_MS of the end of this one).
    started = next(e for e in events if e["type"] == "bot_utterance_started"
                   and e["node"] == "stateful-agent")
    ended = [e for e in events if e["type"] == "bot_utterance_interrupted"
             and e["utterance_id"] == started["utterance_id"]]
    assert ended and ended[0]["text"] == "".join(CHUNKS[:chunk]), ended
    # The interrupt carries what the caller heard: into the chunk playing, to a word boundary.
    (interrupt,) = [e for e in uplink if e["type"] == "interrupt"]
    assert interrupt["heard_ms"] == heard_ms
    heard_text = interrupt["heard_text"]
    assert heard_text == ended[0]["heard_text"]
    assert "".join(CHUNKS).startswith(heard_text)
    assert len("".join(CHUNKS[: chunk - 1])) < len(heard_text) <= heard_ms / ms_per_char
    # The pacing reports: from marks, at most one per 200 ms of audio heard plus the last.
    progress = [e["heard_ms"] for e in uplink if e["type"] == "playback"
                and e["state"] == "playing" and e["utterance_id"] == started["utterance_id"]]
    assert progress == sorted(progress) and progress[-1] <= heard_ms
    assert len(progress) <= heard_ms / 200 + 2


@pytest.mark.slow
async def test_paced_chunks_play_without_a_gap(tmp_path: Path) -> None:
    """Uninterrupted (the answer is short enough to end before the caller talks), the chunks
    pulled one by one still play back to back: the utterance's audio never runs dry."""
    events = await _replay(tmp_path, 8)
    started = next(e for e in events if e["type"] == "bot_utterance_started"
                   and e["node"] == "stateful-agent")
    uid = started["utterance_id"]
    finished = [e for e in events if e["type"] == "bot_utterance_finished"
                and e["utterance_id"] == uid]
    assert finished and finished[0]["text"] == "".join(CHUNKS), events
    total_ms = len("".join(CHUNKS)) * 8
    assert finished[0]["heard_ms"] == pytest.approx(total_ms)
    # Played back to back: it finished when its audio, started at play_at_ms, was all heard
    # (one 40 ms chunk of slack for the last mark's frame).
    assert finished[0]["t_ms"] - started["play_at_ms"] <= total_ms + 60
