"""Streaming speech to text through the real gateway: a recording replayed at the pace of the
line, the caller's audio streamed to a local server speaking OpenAI's Realtime transcription
protocol over a WebSocket (tests/openai_audio_server.py).

Partial transcripts are ``transcript {final: false}`` events, in the timeline and on the bus,
while the caller speaks; a session that fails gives a clear ``stt_error`` event, the turn is
uploaded instead, and the call goes on (the next turn streams again)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from bus import Bus, Event
from gateway.call import CallSettings
from gateway.replay import replay
from gateway.timeline import Timeline
from speech import OpenAITranscriber, Transcript
from tests import recordings_index as rec
from vad._turn import TurnSettings

from ..bus_agents import recording, serve
from ..openai_audio_server import AudioServer

NAME = "turn_gap_then_barge_in"  # two caller turns, ~5 s apart
SECOND = "She had your dark suit in greasy wash water all year."


def listener(uplink: list[Event]) -> Callable[[Bus, asyncio.Event], Awaitable[None]]:
    """An agent that answers nothing: it keeps the uplink events of the call in ``uplink``."""

    async def agent(the_bus: Bus, stop: asyncio.Event) -> None:
        await serve(the_bus, "listener", recording(uplink))

    return agent


async def test_partials_stream_during_the_turn_and_a_failed_session_is_survived() -> None:
    speech = [e for e in rec.labels(NAME)["events"] if e["kind"] == "speech"]
    uplink: list[dict[str, object]] = []

    timeline = Timeline()
    async with AudioServer() as server:
        # Turn 1: the session drops after 400 ms of audio; the turn is uploaded instead.
        server.realtime("never final", delta_every_ms=200, fail="close", fail_after_ms=400)
        server.transcribe("the first turn, uploaded")
        # Turn 2: a streaming model, a word per 250 ms of audio, the final 20 ms after commit.
        second = server.realtime(SECOND, delta_every_ms=250, final_ms=20)
        async with OpenAITranscriber(transport="realtime", api_key="sk-test",
                                     base_url=server.base_url, max_retries=0) as transcriber:
            await replay(rec.source(NAME), agent=listener(uplink), realtime=True, speed=2.0,
                         transcriber_for=lambda info: transcriber, timeline=timeline,
                         settings=CallSettings(turn=TurnSettings(mode="silence",
                                                                 silence_ms=600, early_ms=0)))
    events = timeline.events
    errors = [e for e in events if e["type"] == "stt_error"]
    finals = [e for e in events if e["type"] == "transcript" and e["final"]]
    partials = [e for e in events if e["type"] == "transcript" and not e["final"]]

    # The failed session: said once, clearly, and nothing lost.
    assert len(errors) >= 1 and errors[-1]["fallback"] == "upload"
    assert "session failed" in str(errors[-1]["error"])
    assert errors[0]["t_ms"] < speech[1]["start_ms"]
    assert [e["text"] for e in finals] == ["the first turn, uploaded",
                                           f"the first turn, uploaded {SECOND}"]
    # (This listener never answers, so the caller's second turn "resumed" the first: one
    # user message for both, replacing the first.)
    assert finals[1].get("replaces_previous") is True

    # The second turn streamed: its partials came while the caller spoke, each the text so
    # far, all before the final; the final came after the turn end was decided.
    turn_end = next(e for e in events
                    if e["type"] == "turn_end" and e["t_ms"] > speech[1]["end_ms"])
    mine = [e for e in partials if e["t_ms"] > speech[1]["start_ms"]]
    assert len(mine) >= 3 and len(second.deltas) == len(SECOND.split())
    assert all(SECOND.startswith(str(e["text"])) for e in mine)  # deltas read together: one
    assert all(len(str(a["text"])) < len(str(b["text"])) for a, b in zip(mine, mine[1:]))
    assert any(e["t_ms"] < speech[1]["end_ms"] for e in mine)  # during the caller's speech
    assert max(e["t_ms"] for e in mine) <= finals[-1]["t_ms"]
    assert finals[-1]["t_ms"] >= turn_end["t_ms"]

    # The same on the bus: the worker sees partials (final: false) and then one final per turn.
    bus_transcripts = [e for e in uplink if e["type"] == "transcript"]
    assert [e["text"] for e in bus_transcripts if e["final"]] == [f["text"] for f in finals]
    assert [e["text"] for e in bus_transcripts if not e["final"]] == [e["text"] for e in partials]
    assert uplink[-1]["type"] == "call_ended"  # the call went on to its end


@pytest.mark.parametrize("final_text", [None, "go forward ten metres please"])
async def test_a_speculative_transcript_is_confirmed_or_revised_by_the_final(
    final_text: str | None,
) -> None:
    """turn.speculate: at turn_likely the partial goes out as the turn's text; a final with the
    same words is only noted, one with other words drops the reply being made and replaces
    the turn's text (one user message)."""
    name, words = "barge_in_command_goforward", "go forward ten meters"
    uplink: list[dict[str, object]] = []

    timeline = Timeline()
    async with AudioServer() as server:
        # A word per 150 ms of audio: the partial has every word by the turn's likely end.
        server.realtime(words, delta_every_ms=150, final_ms=20, final_text=final_text)
        async with OpenAITranscriber(transport="realtime", api_key="sk-test",
                                     base_url=server.base_url, max_retries=0) as transcriber:
            await replay(rec.source(name), agent=listener(uplink), realtime=True, speed=2.0,
                         transcriber_for=lambda info: transcriber, timeline=timeline,
                         settings=CallSettings(turn=TurnSettings(speculate=True)))
    events = timeline.events
    likely = next(e for e in events if e["type"] == "turn_likely")
    finals = [e for e in events if e["type"] == "transcript" and e["final"]]
    sent = [e for e in uplink if e["type"] == "transcript" and e["final"]]
    # The partial went out at turn_likely, before the final came.
    assert finals[0] == {"t_ms": likely["t_ms"], "type": "transcript", "text": words,
                         "final": True, "speculative": True}
    assert sent[0]["text"] == words
    cancels = [e for e in uplink if e["type"] == "interrupt" and e["reason"] == "revised"]
    if final_text is None:
        assert finals[1]["dropped"] == "confirmed" and finals[1]["text"] == words
        assert len(sent) == 1 and cancels == []
    else:
        assert finals[1]["text"] == final_text and finals[1]["revises"] is True
        assert len(cancels) == 1
        assert (cancels[0].get("utterance_id"), cancels[0]["heard_ms"]) == (None, 0.0)
        assert [e["text"] for e in sent] == [words, final_text]
        assert sent[1]["replaces_previous"] is True
        assert uplink.index(cancels[0]) < uplink.index(sent[1])  # the cancel goes first


class _LaggingStream:
    """A streaming recogniser one word behind: its partial ends on "and" (a continuation: the
    turn waits longest), its final, asked for at turn_likely, has the whole phrase."""

    PARTIAL, FINAL = "go forward and", "go forward ten meters"

    def __init__(self) -> None:
        self._done = asyncio.Event()

    def feed(self, pcm: bytes) -> None:
        pass

    async def partials(self) -> AsyncIterator[Transcript]:
        yield Transcript(text=self.PARTIAL, final=False)
        await self._done.wait()

    async def partial(self) -> Transcript:
        return Transcript(text=self.PARTIAL, final=False)

    async def finish(self) -> Transcript:
        self._done.set()
        return Transcript(text=self.FINAL)

    def close(self) -> None:
        self._done.set()


class _LaggingTranscriber:
    def open_stream(self, *, sample_rate: int) -> _LaggingStream:
        return _LaggingStream()


async def test_the_final_transcript_reaches_the_turn_end_decided_after_it() -> None:
    """At turn_likely the turn's speech to text is finished (the agent starts on it), but the
    turn end comes 0.6-2 s later: what the recogniser says after turn_likely still reaches the
    detector. Before, it kept the partial of turn_likely, one word behind a lagging recogniser
    ("go forward and"), and held the turn for text_wait_ms (found in review)."""
    uplink: list[dict[str, object]] = []
    timeline = Timeline()
    await replay(rec.source("barge_in_command_goforward"), agent=listener(uplink),
                 transcriber_for=lambda info: _LaggingTranscriber(), timeline=timeline,
                 settings=CallSettings(turn=TurnSettings()))
    events = timeline.events
    likely = next(e for e in events if e["type"] == "turn_likely")
    final = next(e for e in events if e["type"] == "transcript" and e["final"])
    end = next(e for e in events if e["type"] == "turn_end" and e["t_ms"] >= likely["t_ms"])
    assert final["text"] == _LaggingStream.FINAL and final["t_ms"] <= end["t_ms"]
    assert end["text_hold"] is False and end["text_done"] is True
    assert end["wait_ms"] < TurnSettings().text_wait_ms
