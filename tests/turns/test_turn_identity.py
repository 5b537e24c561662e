"""A turn is its transcript's bus eid, not its words (review of session 9, issue #17).

Two places took a turn for another:

* the reply counted as heard when the caller heard *any* utterance (a greeting still playing, a
  key press's answer), so a caller who went on after it was taken to barge in on the reply,
  which then played, and the agent got two user messages for one turn. Only the utterance whose
  ``reply_to`` is the turn's transcript eid (or its revision's) closes the turn; one that names
  nothing (a 1.1 worker's reply, a prompt of the worker's own) closes it too (the reason is on
  ``CallSession._answers_turn``);
* a speculation's final found "its" turn by the partial's words, so a later turn with the same
  words ("yes", then "yes") was resumed or revised in its place.

And from the review of that fix: words over an audible utterance answering another eid are a
barge-in on it (through the policy: paused, resumed after a "yes", interrupted by a long turn,
which cancels the owed reply), not the turn resumed; a speculation's revision cuts only the
turn's own reply; and a settled speculation leaves no words "to carry" for the next turn.
From the second review: a committed interrupt over another eid's utterance closes the owed
turn (a key press too); a revision finds the turn's reply anywhere in the playout queue; and
whether words are over another eid's utterance is decided on the line the policy stepped.

The session is a real ``CallSession`` on the embedded bus and the Silero engine; the bot's audio
goes to a Twilio stand-in (``TwilioPlayout``) whose mark echoes come back as Twilio frames. The
end-to-end case replays long_turn_librivox through the gateway with an agent on the bus.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from bus import Bus, EmbeddedBus
from bus import protocol as bp
from gateway import twilio_protocol as tp
from gateway.call import CallSession, CallSettings
from gateway.replay import recording_messages, replay
from gateway.timeline import Timeline
from gateway.twilio_sim import TwilioPlayout
from tests import recordings_index as rec
from tests.gateway.test_cancelled_turns import _finals, _Said
from vad import SpeechStarted, VadEngine
from vad._turn import TurnSettings

_REPLY_MS = 120  # three 40 ms chunks: heard from the first echoed mark


async def _publish_turn(session: CallSession, text: str) -> str | None:
    """The caller's turn ``text`` transcribed and published; the eid it went out as."""
    await session._transcribed(_Said(text), False, None)
    return session._reply_eid


class _Line:
    """A started call whose bot audio plays on a Twilio stand-in."""

    def __init__(self, bus: EmbeddedBus, engine: VadEngine,
                 session: type[CallSession] = CallSession) -> None:
        self.playout: TwilioPlayout | None = None
        self.session = session(send=self._send, bus=bus, vad=engine, timeline=Timeline(),
                               transcribe_inline=True)
        self._echoes: list[str] = []
        self._seq = 10_000  # sequence numbers of the silent frames fed while the bot talks

    async def _send(self, text: str) -> None:
        assert self.playout is not None
        self._echoes.extend(self.playout.receive(text, at_ms=self.session.now_ms))

    async def start(self) -> CallSession:
        for line in recording_messages(rec.source("barge_in_timit")):
            await self.session.handle_text(line)
            if json.loads(line).get("event") == "start":
                break
        assert self.session.info is not None
        self.playout = TwilioPlayout(stream_sid=self.session.stream_sid)
        return self.session

    async def send(self, utterance_id: str, reply_to: str | None, ms: int = _REPLY_MS) -> None:
        """The worker sends a whole utterance of ``ms``."""
        session = self.session
        await session.handle_downlink(bp.UtteranceStart(utterance_id=utterance_id, node="n",
                                                        reply_to=reply_to))
        await session.handle_downlink(bp.Audio(utterance_id=utterance_id,
                                               payload=b"\xff" * (8 * ms)))
        await session.handle_downlink(bp.UtteranceEnd(utterance_id=utterance_id))

    async def play(self, utterance_id: str, reply_to: str | None, ms: int = _REPLY_MS) -> None:
        """The worker sends a whole utterance of ``ms``; Twilio plays it and echoes its marks."""
        await self.send(utterance_id, reply_to, ms)
        await self.play_out(utterance_id, ms)

    async def play_out(self, utterance_id: str, ms: int) -> None:
        """The line runs until ``utterance_id`` (``ms`` long) has played to its end."""
        for _ in range(ms // 20 + 25):
            if self._finished(utterance_id):
                return
            await self.frame()
        raise AssertionError(f"{utterance_id} was not played to the end")

    async def frames(self, n: int) -> None:
        """``n`` silent frames of the line (:meth:`frame`)."""
        for _ in range(n):
            await self.frame()

    async def frame(self, payload: bytes = b"\xff" * 160) -> None:
        """20 ms of the line: the marks Twilio echoes by now, then a caller frame (silent)."""
        session = self.session
        assert self.playout is not None
        self._echoes.extend(self.playout.advance(session.now_ms))
        while self._echoes:
            await session.handle_text(self._echoes.pop(0))
        self._seq += 1
        await session.handle_text(tp.build_media(
            sequence_number=self._seq, stream_sid=session.stream_sid, chunk=self._seq,
            timestamp_ms=int(session.now_ms), payload=payload))

    async def speak(self, name: str, from_ms: int, to_ms: int) -> None:
        """The caller's audio of recording ``name`` from ``from_ms`` to ``to_ms`` goes on the
        line (the policy hears it as it would any caller)."""
        for text in recording_messages(rec.source(name)):
            msg = tp.parse_message(text)
            if isinstance(msg, tp.Media) and from_ms <= msg.timestamp_ms < to_ms:
                await self.frame(msg.payload)

    def _finished(self, utterance_id: str) -> bool:
        return any(e["type"] == "bot_utterance_finished" and e["utterance_id"] == utterance_id
                   for e in self.session.timeline.events)

    async def caller_goes_on(self) -> None:
        """The caller speaks again before hearing the reply: the policy's effect for it."""
        view = self.session._bot_view()
        assert view.reply_unheard
        await self.session._carry_out(SpeechStarted(over_uninterruptible=False, drop_reply=True))


async def test_only_the_turns_own_reply_heard_closes_the_turn() -> None:
    async with VadEngine(runtime="onnx", max_wait_ms=2.0) as engine, EmbeddedBus() as bus:
        line = _Line(bus, engine)
        session = await line.start()
        eid = await _publish_turn(session, "what is my")
        assert eid is not None
        # A greeting (it answers call_started) and a key press's answer, heard in full: the
        # turn's reply is still owed, so the caller going on now resumes the turn.
        await line.play("utt-greeting", reply_to="1-0")
        await line.play("utt-key", reply_to="7-0")
        assert session._bot_view().reply_unheard
        await line.play("utt-reply", reply_to=eid)
        assert not session._bot_view().reply_unheard
        # A one-chunk reply is finished by its only mark: it is heard all the same.
        await session._transcribed(_Said("thanks"), False, None)
        assert session._bot_view().reply_unheard
        await line.play("utt-ok", reply_to=session._reply_eid, ms=40)
        assert not session._bot_view().reply_unheard
        heard = [e["utterance_id"] for e in session.timeline.events
                 if e["type"] == "bot_utterance_heard"]
        assert heard == ["utt-greeting", "utt-key", "utt-reply", "utt-ok"]
        await session.end("stop")


async def test_an_utterance_that_names_no_turn_closes_it() -> None:
    """A 1.1 worker's reply, or a prompt of the worker's own, names no uplink event: heard, the
    turn is closed (kept open, a reply the caller heard would be cancelled by their next words
    and its turn replaced)."""
    async with VadEngine(runtime="onnx", max_wait_ms=2.0) as engine, EmbeddedBus() as bus:
        line = _Line(bus, engine)
        session = await line.start()
        await session._transcribed(_Said("what is my balance"), False, None)
        await line.play("utt-prompt", reply_to=None)
        assert not session._bot_view().reply_unheard
        await session.end("stop")


async def _speculated(line: _Line, partial: str, final: str) -> tuple[_Said, str]:
    """``turn.speculate``: the partial goes out as the turn; its final is still to come."""
    stream = _Said(final, partial=partial)
    line.session._stt_stream = stream
    await line.session._speculate()
    line.session._stt_stream = None
    eid = line.session._reply_eid
    assert eid is not None and _finals(line.session)[-1]["speculative"] is True
    return stream, eid


async def _yes_twice(line: _Line) -> tuple[_Said, str]:
    """Turn 1 "yes" (a partial; its final "yes sir" is late), answered and heard; then turn 2
    says "yes" too. Returns turn 1's stream (its final still to come) and turn 2's eid."""
    first, first_eid = await _speculated(line, "yes", "yes sir")
    await line.play("utt-1", reply_to=first_eid)
    await line.session._transcribed(_Said("yes"), False, None)
    second_eid = line.session._reply_eid
    assert second_eid is not None and second_eid != first_eid
    return first, second_eid


async def test_a_late_final_does_not_revise_a_later_turn_with_the_same_words() -> None:
    """Turn 1's final is too late: turn 2 ("yes" too) stands, and its reply is not cancelled."""
    async with VadEngine(runtime="onnx", max_wait_ms=2.0) as engine, EmbeddedBus() as bus:
        line = _Line(bus, engine)
        session = await line.start()
        first, second_eid = await _yes_twice(line)
        await session._transcribed(first, False, None)  # turn 1's final comes now
        settled = session.timeline.events[-1]
        assert settled["type"] == "transcript" and settled["text"] == "yes sir"
        assert settled["dropped"] == "late"
        assert _finals(session)[-1]["text"] == "yes" and session._reply_eid == second_eid
        assert second_eid not in session._cancelled_turns
        assert not [e for e in session.timeline.events if e.get("reason") == "revised"]
        await session.end("stop")


async def test_a_late_final_is_not_merged_into_a_later_resumed_turn_with_the_same_words() -> None:
    """The caller goes on before turn 2's reply: turn 2 is resumed. Turn 1's late final is not
    turn 2's: the whole turn is turn 2's words and the new ones."""
    async with VadEngine(runtime="onnx", max_wait_ms=2.0) as engine, EmbeddedBus() as bus:
        line = _Line(bus, engine)
        session = await line.start()
        first, _ = await _yes_twice(line)
        await line.caller_goes_on()
        await session._transcribed(first, False, None)  # turn 1's final comes now
        assert session.timeline.events[-1]["dropped"] == "late"
        await session._transcribed(_Said("please"), False, None)
        whole = _finals(session)[-1]
        assert whole["text"] == "yes please" and whole["replaces_previous"] is True
        await session.end("stop")


async def test_the_speculated_turn_resumed_takes_its_final_words() -> None:
    """The control: the caller resumed the speculated turn itself; its final's words replace
    the partial's in the whole turn."""
    async with VadEngine(runtime="onnx", max_wait_ms=2.0) as engine, EmbeddedBus() as bus:
        line = _Line(bus, engine)
        session = await line.start()
        first, _ = await _speculated(line, "yes", "yes sir")
        await line.caller_goes_on()
        await session._transcribed(first, False, None)
        assert session.timeline.events[-1]["dropped"] == "resumed"
        await session._transcribed(_Said("please"), False, None)
        whole = _finals(session)[-1]
        assert whole["text"] == "yes sir please" and whole["replaces_previous"] is True
        await session.end("stop")


async def test_a_revision_leaves_an_utterance_answering_another_eid_playing() -> None:
    """A speculation's final revises its turn while the caller hears a key press's answer (it
    answers the ``dtmf`` event): that answer plays on to its end; only the turn's reply, not
    come yet, is cancelled (``interrupt {utterance_id: null, reason: revised}``, its eid kept
    as cancelled). Before, the revision interrupted whatever was playing."""
    async with VadEngine(runtime="onnx", max_wait_ms=2.0) as engine, EmbeddedBus() as bus:
        line = _Line(bus, engine)
        session = await line.start()
        first, eid = await _speculated(line, "what is my", "what's my balance")
        await line.send("utt-key", reply_to="7-0", ms=400)
        await line.frames(6)
        assert [e["utterance_id"] for e in session.timeline.events
                if e["type"] == "bot_utterance_heard"] == ["utt-key"]
        await session._transcribed(first, False, None)
        revised = _finals(session)[-1]
        assert revised["text"] == "what's my balance" and revised["revises"] is True
        assert session._cancelled_turns == {eid: "revised"}
        await line.play_out("utt-key", 400)
        assert not [e for e in session.timeline.events
                    if e["type"] in ("barge_in", "bot_utterance_interrupted")]
        await session.end("stop")


async def test_a_non_interruptible_utterance_answering_another_eid_does_not_stop_a_revision(
) -> None:
    """A non-interruptible greeting playing is not the turn's reply: the final still revises
    the turn (before, any non-interruptible head made the final ``dropped: late``)."""
    async with VadEngine(runtime="onnx", max_wait_ms=2.0) as engine, EmbeddedBus() as bus:
        line = _Line(bus, engine)
        session = await line.start()
        first, eid = await _speculated(line, "what is my", "what's my balance")
        await session.handle_downlink(bp.UtteranceStart(utterance_id="utt-hello", node="n",
                                                        interruptible=False, reply_to="1-0"))
        await session._transcribed(first, False, None)
        assert _finals(session)[-1]["revises"] is True
        assert session._cancelled_turns == {eid: "revised"}
        await session.end("stop")


class _Agent:
    """A worker on the bus that answers the call's first turn with one utterance of ``ms``: a
    reply to that turn (``reply_to`` its transcript's eid) or, with ``other``, one answering
    ``call_started`` (a late greeting); nothing else. Records the uplink."""

    def __init__(self, *, other: bool, ms: int = _REPLY_MS) -> None:
        self.other = other
        self.ms = ms
        self.uplink: list[bp.UplinkEvent] = []

    async def __call__(self, bus: Bus, stop: asyncio.Event) -> None:
        async for call in bus.claim_calls("w17e"):
            started = ""
            async for m in bus.uplink(call.call_sid, "w17e"):
                event = bp.decode(m.event)
                assert isinstance(event, bp.UplinkEvent)
                self.uplink.append(event)
                await bus.ack(call.call_sid, m.id)
                if isinstance(event, bp.CallStarted):
                    started = str(m.event["eid"])
                if isinstance(event, bp.Transcript) and len(self._finals()) == 1:
                    uid = "utt-first"
                    reply_to = started if self.other else str(m.event["eid"])
                    for out in (bp.UtteranceStart(utterance_id=uid, node="n", reply_to=reply_to),
                                bp.Audio(utterance_id=uid, payload=b"\xff" * (8 * self.ms)),
                                bp.UtteranceEnd(utterance_id=uid)):
                        await bus.send(call.call_sid, bp.encode(out))
                if isinstance(event, bp.CallEnded):
                    return

    def _finals(self) -> list[bp.Transcript]:
        return [e for e in self.uplink if isinstance(e, bp.Transcript) and e.final]


class _Words:
    def open_stream(self, *, sample_rate: int) -> _Said:
        return _Said("what is my")


async def _replayed(agent: _Agent) -> list[dict[str, Any]]:
    """long_turn_librivox with a 200 ms silence timer: a turn end in each ~460 ms pause, so
    the first turn's utterance plays and is heard inside the pause, before the caller goes on."""
    timeline = Timeline()
    await replay(rec.source("long_turn_librivox"), agent=agent,
                 transcriber_for=lambda info: _Words(),
                 settings=CallSettings(turn=TurnSettings(mode="silence", silence_ms=200)),
                 timeline=timeline)
    heard = [e for e in timeline.events if e["type"] == "bot_utterance_heard"]
    assert [e["utterance_id"] for e in heard] == ["utt-first"]
    first_final = next(e for e in timeline.events if e["type"] == "transcript" and e["final"])
    speech = [e for e in timeline.events
              if e["type"] == "speech_started" and e["t_ms"] > first_final["t_ms"]]
    assert speech and heard[0]["t_ms"] < speech[0]["t_ms"], "heard only after the caller went on"
    return timeline.events


async def test_a_caller_who_goes_on_after_hearing_another_utterance_resumes_the_turn() -> None:
    """End to end: a late greeting plays in the first pause and is heard; the caller goes on:
    the turn is resumed (one user message), as in every later pause. The control: the turn's
    own reply heard in that pause closes it, and the caller's next words are a turn of their
    own."""
    other = _Agent(other=True)
    events = await _replayed(other)
    transcripts = other._finals()
    resumed = [e for e in events if e["type"] == "turn_resumed"]
    assert len(transcripts) >= 3 and len(resumed) == len(transcripts) - 1
    assert [t.replaces_previous for t in transcripts] == [False] + [True] * len(resumed)

    own = _Agent(other=False)
    events = await _replayed(own)
    transcripts = own._finals()
    resumed = [e for e in events if e["type"] == "turn_resumed"]
    assert len(resumed) == len(transcripts) - 2  # every pause but the first
    assert [t.replaces_previous for t in transcripts[:2]] == [False, False]


async def test_a_final_that_comes_after_the_next_speculation_is_no_turn_of_its_own() -> None:
    """Turn 1's partial went out, the caller resumed it, and the whole turn's partial went out
    before turn 1's final came back: that final settles turn 1 (too late to revise it: the
    whole turn is out), it is not published as a turn after the whole one. Before, one
    speculation was kept at a time, and turn 1's final went out as a new turn."""
    async with VadEngine(runtime="onnx", max_wait_ms=2.0) as engine, EmbeddedBus() as bus:
        line = _Line(bus, engine)
        session = await line.start()
        first, _ = await _speculated(line, "what is my", "what's my")
        await line.caller_goes_on()
        second, whole_eid = await _speculated(line, "balance", "balance please")
        assert _finals(session)[-1]["text"] == "what is my balance"
        await session._transcribed(first, False, None)
        settled = session.timeline.events[-1]
        assert settled["text"] == "what's my" and settled["dropped"] == "late"
        assert session._reply_eid == whole_eid
        await session._transcribed(second, False, None)  # the whole turn's own final revises it
        revised = _finals(session)[-1]
        assert revised["text"] == "what is my balance please" and revised["revises"] is True
        await session.end("stop")


async def test_words_over_another_eids_utterance_are_a_barge_in_on_it() -> None:
    """End to end: a late greeting of 2 s begins in the first pause and is heard; the caller
    goes on while it plays: that is a barge-in on the greeting (paused, then interrupted by
    the caller's long turn with ``reason: speech``), not the turn resumed. Before, the turn
    owed a reply made the policy drop the greeting as that reply (``interrupt {reason:
    resumed}`` with heard_ms > 0, no pause)."""
    agent = _Agent(other=True, ms=2000)
    events = await _replayed(agent)
    first = [(e["type"], e.get("reason")) for e in events
             if e.get("utterance_id") == "utt-first" and e["type"] != "turn_latency"]
    assert first == [("bot_utterance_started", None), ("bot_utterance_heard", None),
                     ("clear_sent", "barge_in"), ("bot_utterance_paused", None),
                     ("bot_utterance_interrupted", None), ("barge_in", "speech")]
    went_on = next(e for e in events if e["type"] == "bot_utterance_paused")["t_ms"]
    assert not [e for e in events if e["type"] == "turn_resumed" and e["t_ms"] <= went_on]
    # The caller's words over it are a turn of their own; the later pauses resume as before.
    assert [t.replaces_previous for t in agent._finals()] == [False, False, True]


async def test_a_backchannel_over_another_eids_utterance_leaves_the_turn_owed() -> None:
    """Through the policy: the caller says "yes" over a key press's answer they are hearing;
    that answer is paused and resumed (a backchannel), and the turn is still owed its reply:
    the turn's reply heard closes it. Before, the policy dropped the answer as the reply."""
    async with VadEngine(runtime="onnx", max_wait_ms=2.0) as engine, EmbeddedBus() as bus:
        line = _Line(bus, engine)
        session = await line.start()
        eid = await _publish_turn(session, "what is my")
        await line.send("utt-key", reply_to="7-0", ms=3000)
        await line.frames(10)
        await line.speak("backchannel_real_yes", 3200, 4400)
        key = [e["type"] for e in session.timeline.events
               if e.get("utterance_id") == "utt-key"]
        assert key[-2:] == ["bot_utterance_paused", "bot_utterance_resumed"], key
        assert not [e for e in session.timeline.events if e["type"] == "turn_resumed"]
        assert session._bot_view().reply_unheard is False  # the answer is audible again
        await line.play_out("utt-key", 3000)
        assert session._bot_view().reply_unheard  # the turn is still owed its reply
        await line.play("utt-reply", reply_to=eid)
        assert not session._bot_view().reply_unheard
        await session.end("stop")


async def test_a_barge_in_on_another_eids_utterance_cancels_the_owed_reply() -> None:
    """Through the policy: the caller talks over a key press's answer long enough to take the
    turn; the answer is interrupted (``reason: speech``) and the worker cancels every
    generation, the turn's reply among them. That reply, made before the worker read the
    interrupt, comes after it: it is dropped before any of it plays."""
    async with VadEngine(runtime="onnx", max_wait_ms=2.0) as engine, EmbeddedBus() as bus:
        line = _Line(bus, engine)
        session = await line.start()
        eid = await _publish_turn(session, "what is my")
        assert eid is not None
        await line.send("utt-key", reply_to="7-0", ms=3000)
        await line.frames(10)
        await line.speak("long_turn_librivox", 2900, 4400)
        cut = [e for e in session.timeline.events if e["type"] == "barge_in"]
        assert [(e["utterance_id"], e["reason"]) for e in cut] == [("utt-key", "speech")]
        assert session._cancelled_turns == {eid: "speech"}
        await line.send("utt-reply", reply_to=eid)
        dropped = session.timeline.events[-1]
        assert dropped["type"] == "bot_utterance_interrupted"
        assert dropped["utterance_id"] == "utt-reply" and dropped["dropped"] == "cancelled_turn"
        await session.end("stop")


async def test_a_settled_speculation_leaves_no_carry_for_the_next_turn() -> None:
    """The caller goes on after a speculated turn likely over, once a worker prompt (it names
    no eid) they hear has closed that turn: the speculation's final settles it; the caller's
    next turn is published, not held back as words "still on their way". Before, the flag
    set for the early transcript was cleared only by a final that was not a speculation's, so
    that next final was carried into the turn after it (``dropped: resumed``)."""
    async with VadEngine(runtime="onnx", max_wait_ms=2.0) as engine, EmbeddedBus() as bus:
        line = _Line(bus, engine)
        session = await line.start()
        await line.send("utt-prompt", reply_to=None, ms=3000)
        await line.frame()
        first, _ = await _speculated(line, "what is my", "what is my")
        session._turn_tentative = True  # as at turn_likely: the turn's end is still awaited
        session._turn_text_stream = first
        await line.frames(6)
        assert not session._bot_view().reply_unheard  # the prompt heard closed the turn
        await line.speak("long_turn_librivox", 2900, 4400)
        assert any(e["type"] == "speech_started" for e in session.timeline.events)
        await session._transcribed(first, False, None)
        assert session.timeline.events[-1]["dropped"] == "confirmed"
        await session._transcribed(_Said("and my card"), False, None)
        assert _finals(session)[-1]["text"] == "and my card"
        await session.end("stop")


async def _uplink(bus: EmbeddedBus, session: CallSession) -> list[bp.UplinkEvent]:
    """Every event the ended call put on its uplink, as a worker reads them."""
    assert session.info is not None
    events: list[bp.UplinkEvent] = []
    async for m in bus.uplink(session.info.call_sid, "w17g"):
        event = bp.decode(m.event)
        assert isinstance(event, bp.UplinkEvent)
        events.append(event)
        await bus.ack(session.info.call_sid, m.id)
        if isinstance(event, bp.CallEnded):
            break
    return events


async def test_a_key_press_over_another_eids_utterance_closes_the_owed_turn() -> None:
    """A key press cuts a greeting while the turn is owed its reply: the reply is cancelled
    (``dtmf``) and the turn closed with it. The key's answer heard, the caller's next words
    are a turn of their own. Before, the turn stayed owed (no transcript replaces it after a
    key press), and those words were glued onto it (``replaces_previous``)."""
    async with VadEngine(runtime="onnx", max_wait_ms=2.0) as engine, EmbeddedBus() as bus:
        line = _Line(bus, engine)
        session = await line.start()
        eid = await _publish_turn(session, "what is my balance")
        assert eid is not None
        await line.send("utt-greet", reply_to="1-0", ms=2000)
        await line.frames(10)
        await session.handle_text(tp.build_dtmf(sequence_number=99,
                                                stream_sid=session.stream_sid, digit="1"))
        assert session._cancelled_turns == {eid: "dtmf"}
        await line.send("utt-reply", reply_to=eid)  # made before the worker read the interrupt
        assert session.timeline.events[-1]["dropped"] == "cancelled_turn"
        await line.play("utt-keyans", reply_to="9-0", ms=600)
        assert not session._bot_view().reply_unheard
        await line.speak("long_turn_librivox", 2900, 4400)
        assert not [e for e in session.timeline.events if e["type"] == "turn_resumed"]
        await session._transcribed(_Said("yes the second one"), False, None)
        final = _finals(session)[-1]
        assert final["text"] == "yes the second one" and "replaces_previous" not in final
        await session.end("stop")


async def test_a_revision_drops_the_reply_queued_behind_another_eids_utterance() -> None:
    """The turn's reply is queued behind a key press's answer the caller is hearing when the
    speculation's final revises the turn: the reply is dropped unheard (the worker reads
    ``playback {interrupted, heard_ms: 0}``), the key's answer plays on to its end, and the
    revision alone is answered. Before, the revision looked at the head only: the stale reply
    played in full after the key's answer, and the revision was answered too."""
    async with VadEngine(runtime="onnx", max_wait_ms=2.0) as engine, EmbeddedBus() as bus:
        line = _Line(bus, engine)
        session = await line.start()
        first, eid = await _speculated(line, "what is my", "what's my balance")
        await line.send("utt-key", reply_to="7-0", ms=400)
        await line.send("utt-reply", reply_to=eid, ms=400)
        await line.frames(6)
        await session._transcribed(first, False, None)
        assert _finals(session)[-1]["revises"] is True
        assert session._cancelled_turns == {eid: "revised"}
        await line.play_out("utt-key", 400)
        reply = [(e["type"], e.get("reason"), e.get("before_audio")) for e in
                 session.timeline.events if e.get("utterance_id") == "utt-reply"]
        assert reply == [("bot_utterance_interrupted", "revised", True)]
        assert not [e for e in session.timeline.events if e["type"] == "barge_in"]
        await session.end("stop")
        dropped = [e for e in await _uplink(bus, session)
                   if isinstance(e, bp.Playback) and e.utterance_id == "utt-reply"]
        assert [(e.state, e.heard_ms) for e in dropped] == [("interrupted", 0.0)]


async def test_a_non_interruptible_reply_queued_behind_another_eids_is_too_late_to_revise(
) -> None:
    """Both the greeting playing and the turn's reply behind it must be heard in full: the
    reply will be heard, so the final is ``dropped: late``. Before, only the head was looked
    at: the turn was revised too, and answered twice."""
    async with VadEngine(runtime="onnx", max_wait_ms=2.0) as engine, EmbeddedBus() as bus:
        line = _Line(bus, engine)
        session = await line.start()
        first, eid = await _speculated(line, "what is my", "what's my balance")
        for uid, reply_to in (("utt-hello", "1-0"), ("utt-reply", eid)):
            await session.handle_downlink(bp.UtteranceStart(utterance_id=uid, node="n",
                                                            interruptible=False,
                                                            reply_to=reply_to))
        await session._transcribed(first, False, None)
        assert session.timeline.events[-1]["dropped"] == "late"
        assert _finals(session)[-1]["text"] == "what is my" and not session._cancelled_turns
        await session.end("stop")


async def test_a_revision_of_a_reply_not_come_yet_tells_the_worker() -> None:
    """On the bus: the revised turn's reply is not in the queue, so the worker is told to
    cancel its generation (``interrupt {utterance_id: null, reason: revised}``) before the
    revision goes out."""
    async with VadEngine(runtime="onnx", max_wait_ms=2.0) as engine, EmbeddedBus() as bus:
        line = _Line(bus, engine)
        session = await line.start()
        first, _ = await _speculated(line, "what is my", "what's my balance")
        await session._transcribed(first, False, None)
        await session.end("stop")
        uplink = await _uplink(bus, session)
        cut = [e for e in uplink if isinstance(e, bp.Interrupt)]
        assert [(e.utterance_id, e.reason) for e in cut] == [(None, "revised")]
        finals = [e for e in uplink if isinstance(e, bp.Transcript) and e.final]
        assert [(e.text, e.replaces_previous) for e in finals] == [
            ("what is my", False), ("what's my balance", True)]
        assert uplink.index(cut[0]) < uplink.index(finals[1])


class _EndDuringSpeechStarted(CallSession):
    """The call's downlink task delivers ``utterance_end`` for the head while the gateway is
    publishing ``speech_started`` (an await: on a real bus the downlink runs then); made
    deterministic here by delivering it from that publish."""

    end_of: str | None = None

    async def publish(self, event: bp.UplinkEvent) -> str | None:
        eid = await super().publish(event)
        if isinstance(event, bp.SpeechStarted) and self.end_of is not None:
            end_of, self.end_of = self.end_of, None
            await self.handle_downlink(bp.UtteranceEnd(utterance_id=end_of))
        return eid


async def test_a_downlink_event_during_speech_started_does_not_flip_the_decision() -> None:
    """The caller says "yes" over a key press's answer whose audio is all out, its end not
    come yet: the policy saw it audible (a barge-in on it, the turn still owed). Its
    ``utterance_end`` arrives while speech_started is published and it finishes: the turn is
    still owed, and its reply heard closes it. Before, the line was read again after that
    await (nothing audible): the turn was taken as resumed and closed, the reply unheard."""
    async with VadEngine(runtime="onnx", max_wait_ms=2.0) as engine, EmbeddedBus() as bus:
        line = _Line(bus, engine, session=_EndDuringSpeechStarted)
        session = await line.start()
        assert isinstance(session, _EndDuringSpeechStarted)
        eid = await _publish_turn(session, "what is my")
        await session.handle_downlink(bp.UtteranceStart(utterance_id="utt-key", node="n",
                                                        reply_to="7-0"))
        await session.handle_downlink(bp.Audio(utterance_id="utt-key",
                                               payload=b"\xff" * (8 * _REPLY_MS)))
        await line.frames(20)
        view = session._bot_view()
        assert view.utterance_id == "utt-key" and not view.reply_unheard
        session.end_of = "utt-key"
        await line.speak("backchannel_real_yes", 3200, 4400)
        assert session.end_of is None  # the speech started and the end came during it
        assert session._unanswered == "what is my"
        assert not [e for e in session.timeline.events if e["type"] == "turn_resumed"]
        await line.play("utt-reply", reply_to=eid)
        assert not session._bot_view().reply_unheard and session._unanswered is None
        await session.end("stop")
