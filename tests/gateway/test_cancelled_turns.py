"""Replies to a turn whose reply the gateway cancelled (the caller resumed, or a speculation's
final revised it), arriving after the cancel (bus protocol 1.2, ``utterance_start.reply_to``).

The CallSession cases step the session's turn-taking directly (a started call on the embedded
bus, speech to text as stubs): a non-interruptible such reply plays, and the merge of the
resumed turn into the next transcript is undone, whatever the merge carried since. The
TurnClock cases feed it the timeline and downlink those calls make (docs/turns.md).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import generate_latest

from bus import EmbeddedBus
from bus import protocol as bp
from gateway.call import CallSession
from gateway.metrics import GatewayMetrics
from gateway.replay import recording_messages
from gateway.timeline import Timeline
from speech import Transcript
from tests import recordings_index as rec
from tests.turns.test_turn_clock import _call as _clock
from tests.turns.test_turn_clock import _reply
from vad import VadEngine


class _Said:
    """A speech-to-text stream whose final (and partial) is ``text``."""

    def __init__(self, text: str, partial: str | None = None) -> None:
        self.text = text
        self._partial = partial

    def feed(self, pcm16: bytes) -> None:
        pass

    async def partials(self) -> AsyncIterator[Transcript]:  # a streaming recogniser
        if self._partial is not None:
            yield Transcript(text=self._partial, final=False)

    async def partial(self) -> Transcript:
        return Transcript(text=self._partial or "", final=False)

    async def finish(self) -> Transcript:
        return Transcript(text=self.text)

    def close(self) -> None:
        pass


async def _started(bus: EmbeddedBus, engine: VadEngine) -> CallSession:
    async def send(text: str) -> None:
        pass

    session = CallSession(send=send, bus=bus, vad=engine, timeline=Timeline(),
                          transcribe_inline=True)
    for line in recording_messages(rec.source("barge_in_timit")):
        await session.handle_text(line)
        if json.loads(line).get("event") == "start":
            break
    assert session.info is not None
    return session


def _finals(session: CallSession) -> list[dict[str, Any]]:
    return [e for e in session.timeline.events if e["type"] == "transcript"
            and e.get("final", True) and not e.get("dropped")]


async def _non_interruptible_reply(session: CallSession, reply_to: str) -> None:
    await session.handle_downlink(bp.UtteranceStart(utterance_id="utt-1", node="pay",
                                                    interruptible=False, reply_to=reply_to))


async def test_undo_keeps_words_carried_since_and_the_next_turn_replaces_nothing() -> None:
    """Case (a) of the review: the caller resumed turn A, and an early transcript of theirs came
    back after they went on again (carried words); then A's non-interruptible reply came."""
    async with VadEngine(runtime="onnx", max_wait_ms=2.0) as engine, EmbeddedBus() as bus:
        session = await _started(bus, engine)
        await session._transcribed(_Said("what is my"), False, None)
        eid = session._reply_eid
        assert eid is not None
        await session._hold_reply("what is my")  # the caller went on before hearing a word
        account = _Said("account")
        session._carry_stream = account  # ... and again before this early transcript came back
        await session._transcribed(account, False, None)
        await _non_interruptible_reply(session, eid)
        await session._transcribed(_Said("number"), False, None)
        last = _finals(session)[-1]
        assert last["text"] == "account number" and "replaces_previous" not in last
        undone = [e for e in session.timeline.events if e["type"] == "turn_resume_undone"]
        assert len(undone) == 1 and undone[0]["reply_to"] == eid
        assert undone[0]["utterance_id"] == "utt-1" and undone[0]["kept"] is None
        await session.end("stop")


async def test_undo_after_a_settled_speculation_keeps_the_finals_new_words() -> None:
    """Case (c): the partial was sent and answered; the caller resumed; its final (which says
    more, in other words) replaced the merged text; then the partial's non-interruptible reply
    came. The merge is undone by the turn's eid, not by its text."""
    async with VadEngine(runtime="onnx", max_wait_ms=2.0) as engine, EmbeddedBus() as bus:
        session = await _started(bus, engine)
        stream = _Said("what's my name", partial="what is my")
        session._stt_stream = stream
        await session._speculate()
        eid = session._reply_eid
        assert eid is not None and _finals(session)[-1]["speculative"] is True
        await session._hold_reply("what is my")
        session._stt_stream = None
        await session._transcribed(stream, False, None)  # the final: carried, not published
        await _non_interruptible_reply(session, eid)
        await session._transcribed(_Said("please"), False, None)
        last = _finals(session)[-1]
        assert last["text"] == "what's my name please" and "replaces_previous" not in last
        [undone] = [e for e in session.timeline.events if e["type"] == "turn_resume_undone"]
        assert undone["text"] == "what is my" and undone["kept"] == "what's my name"
        await session.end("stop")


async def test_without_a_reply_the_resumed_turn_is_replaced() -> None:
    """The control: no reply to A came, so the whole turn replaces it (one user message)."""
    async with VadEngine(runtime="onnx", max_wait_ms=2.0) as engine, EmbeddedBus() as bus:
        session = await _started(bus, engine)
        await session._transcribed(_Said("what is my"), False, None)
        await session._hold_reply("what is my")
        account = _Said("account")
        session._carry_stream = account
        await session._transcribed(account, False, None)
        await session._transcribed(_Said("number"), False, None)
        last = _finals(session)[-1]
        assert last["text"] == "what is my account number" and last["replaces_previous"] is True
        assert not [e for e in session.timeline.events if e["type"] == "turn_resume_undone"]
        await session.end("stop")


def test_turn_clock_times_the_reply_after_a_stale_one_to_the_whole_turn() -> None:
    """The stale reply's utterance_start comes after the whole turn's transcript: the clock took
    it for the turn's reply; its drop hands the turn to the next utterance."""
    timeline, events = _clock()
    timeline.emit(3000, "turn_end", speech_end_ms=2500.0, wait_ms=500.0, p_end=0.6,
                  text_hold=False)
    timeline.emit(3150, "transcript", text="my account is four two", final=True,
                  replaces_previous=True)
    timeline.downlink(3200, bp.UtteranceStart(utterance_id="stale", node="n", reply_to="1-0"))
    timeline.emit(3200, "bot_utterance_interrupted", utterance_id="stale", before_audio=True,
                  heard_ms=0.0, dropped="cancelled_turn", reason="resumed", reply_to="1-0")
    _reply(timeline, "u2", text_at=3500, audio_at=3700)
    timeline.emit(3710, "bot_utterance_started", utterance_id="u2", play_at_ms=3720.0)
    timeline.emit(3760, "bot_utterance_heard", utterance_id="u2", played_from_ms=3720.0)
    [lat] = [e for e in events if e["type"] == "turn_latency"]
    assert lat["utterance_id"] == "u2" and lat["llm_first_text_ms"] == 1000.0
    assert lat["tts_first_audio_ms"] == 1200.0 and lat["first_audio_ms"] == 1220.0


def test_turn_clock_keeps_a_reply_cut_unheard_by_a_barge_in() -> None:
    """Finding 5: a reply dropped before its audio by anything else (the worker cut it, a
    barge-in dropped it queued) is still the turn's reply, unheard: the turn has no latency,
    and a later utterance (the next turn's, a greeting) is not timed as its reply."""
    timeline, events = _clock()
    timeline.emit(3000, "turn_end", speech_end_ms=2500.0, wait_ms=500.0, p_end=0.6,
                  text_hold=False)
    timeline.emit(3150, "transcript", text="my account is four two", final=True)
    _reply(timeline, "u1", text_at=3500, audio_at=3700)
    timeline.emit(3705, "bot_utterance_interrupted", utterance_id="u1", before_audio=True,
                  heard_ms=0.0)
    _reply(timeline, "later", text_at=9000, audio_at=9100)
    timeline.emit(9110, "bot_utterance_started", utterance_id="later", play_at_ms=9120.0)
    timeline.emit(9160, "bot_utterance_heard", utterance_id="later", played_from_ms=9120.0)
    assert not [e for e in events if e["type"] == "turn_latency"]


def test_the_drops_are_counted_by_reason() -> None:
    metrics = GatewayMetrics(lambda: {"calls": 0, "draining": False, "overloaded": False,
                                      "vad_batches": 0, "vad_windows": 0})
    for reason in ("resumed", "resumed", "revised"):
        metrics.observe_event({"type": "bot_utterance_interrupted", "t_ms": 1.0,
                               "utterance_id": "u", "before_audio": True,
                               "dropped": "cancelled_turn", "reason": reason})
    metrics.observe_event({"type": "bot_utterance_interrupted", "t_ms": 2.0,
                           "utterance_id": "v", "before_audio": True})  # not such a drop
    text = generate_latest(metrics.registry).decode()
    assert 'callgate_stale_replies_dropped_total{reason="resumed"} 2.0' in text
    assert 'callgate_stale_replies_dropped_total{reason="revised"} 1.0' in text


async def test_only_replies_to_the_cancelled_turn_are_dropped() -> None:
    """An interruptible reply to the cancelled turn is dropped before any audio; a greeting or a
    key press's answer (another eid, or none from a 1.1 worker) still plays."""
    async with VadEngine(runtime="onnx", max_wait_ms=2.0) as engine, EmbeddedBus() as bus:
        session = await _started(bus, engine)
        await session._transcribed(_Said("what is my"), False, None)
        eid = session._reply_eid
        assert eid is not None
        await session._hold_reply("what is my")
        for uid, reply_to in (("utt-key", "9-0"), ("utt-old", None), ("utt-stale", eid)):
            await session.handle_downlink(bp.UtteranceStart(utterance_id=uid, node="n",
                                                            reply_to=reply_to))
        dropped = [e for e in session.timeline.events if e["type"] == "bot_utterance_interrupted"]
        assert [(e["utterance_id"], e["dropped"], e["reason"], e["reply_to"], e["before_audio"])
                for e in dropped] == [("utt-stale", "cancelled_turn", "resumed", eid, True)]
        assert session.playback.get("utt-key") is not None
        assert session.playback.add_audio("utt-key", b"\xff" * 160)
        assert not session.playback.add_audio("utt-stale", b"\xff" * 160)  # refused from now on
        await session.end("stop")


def test_the_words_beyond_a_published_partial_are_counted_as_words_not_tokens() -> None:
    """A token can hold several words ("well-known", "3.5") or none (a dash): the words kept
    for the next turn are those after the partial's, whatever the tokens (review, session 9:
    the tokens were sliced by the word count, and "place" was lost)."""
    from gateway.call import _beyond

    assert _beyond("book a well-known", "book a well-known place for two") == "place for two"
    assert _beyond("its 3.5", "its 3.5 miles away") == "miles away"
    assert _beyond("go forward", "go - forward ten") == "ten"
    assert _beyond("go forward ten", "go forward ten meters.") == "meters."
    assert _beyond("a b", "a b") is None
    assert _beyond("x", "y z") == "y z"  # not a continuation: all of it
    assert _beyond("", "hello there") == "hello there"
