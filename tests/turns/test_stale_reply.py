"""A cancelled reply already in flight is never played (a real bus's race, issue #17).

The gateway ends a turn, publishes its transcript, and the worker starts the reply; the caller
goes on before the reply has come (``interrupt {utterance_id: null, reason: resumed}``). On a
real bus the worker may have made that reply before it read the interrupt: its
``utterance_start`` and audio reach the gateway *after* the interrupt. Each utterance says
which uplink event it answers (``utterance_start.reply_to``, protocol 1.2), so the gateway
drops one that answers the cancelled turn, sends none of it to Twilio, says so in the timeline
and tells the worker (``playback {state: interrupted, heard_ms: 0}``), and the call goes on with
the whole turn's reply.

The same for the reply to a speculative partial that its final revised (``reason: revised``).
A non-interruptible reply is never dropped: it plays, and the caller's next words are a turn of
their own (not merged with the cancelled turn's).

The race is made to happen every time: the worker's bus hands it the interrupt only once the
worker has sent the whole stale reply, and the agent starts that reply only once the interrupt
is on the Redis stream (the gateway has published it). A real gateway (``CallSession`` fed the
recording's frames), a real ``SessionWorker`` and two ``RedisBus`` clients of one redis-server.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import pytest

from bus import Bus, BusMessage, Event, RedisBus
from bus import protocol as bp
from gateway.call import CallSession, CallSettings
from gateway.replay import recording_messages
from gateway.timeline import Timeline
from nodes import OutputAgentNode, SessionWorker, ToneSynthesizer
from speech import Transcript
from tests import recordings_index as rec
from tests.redis_server import RedisServer, redis_server  # noqa: F401 (fixture)
from vad import VadEngine
from vad._turn import TurnSettings

from ..nodes.conftest import guard, setup_with

pytestmark = pytest.mark.redis

NAME = "long_turn_librivox"  # ~14 s, pauses of ~460 ms: a 200 ms timer ends a turn in each
STALE = "I think you asked"  # the reply to the first turn, made before the interrupt was read
ANSWER = "Here is the whole answer."


class _HoldsTheInterrupt:
    """The worker's bus, but its first ``interrupt`` is handed to the worker only once the
    worker has sent an ``utterance_end`` after it was on the stream: the worker reads it after
    its reply went out, as a busy worker on a real bus may. Everything else is the RedisBus."""

    def __init__(self, inner: RedisBus) -> None:
        self._inner = inner
        self.on_stream = asyncio.Event()  # the gateway has published the interrupt
        self.reply_sent = asyncio.Event()  # the stale reply is all on the downlink
        self.uplink_seen: list[Event] = []
        self.downlink_sent: list[Event] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def uplink(self, call_sid: str, worker_id: str) -> AsyncIterator[BusMessage]:
        async for message in self._inner.uplink(call_sid, worker_id):
            self.uplink_seen.append(message.event)
            if message.event.get("type") == "interrupt" and not self.on_stream.is_set():
                self.on_stream.set()
                await guard(self.reply_sent.wait())
            yield message

    async def send(self, call_sid: str, event: Event) -> str:
        eid = await self._inner.send(call_sid, event)
        self.downlink_sent.append(dict(event))
        if event.get("type") == "utterance_end" and self.on_stream.is_set():
            self.reply_sent.set()
        return eid


class _Replier(OutputAgentNode):
    """Answers every turn; the first answer waits until the interrupt is on the stream."""

    def __init__(self, bus: _HoldsTheInterrupt, *, interruptible: bool = True) -> None:
        super().__init__(name="replier", is_interruptible=interruptible)
        self._bus = bus
        self.answers = 0

    async def generate_response(self) -> AsyncIterator[str]:
        self.answers += 1
        if self.answers == 1:
            await self._bus.on_stream.wait()
            yield STALE
        else:
            yield ANSWER


class _Words:
    """Speech to text that hears the same words in every turn."""

    class _Stream:
        def feed(self, pcm16: bytes) -> None:
            pass

        async def finish(self) -> Transcript:
            return Transcript(text="what is my")

        def close(self) -> None:
            pass

    def open_stream(self, *, sample_rate: int) -> _Stream:
        return self._Stream()


class _Race:
    """One call of NAME through a real gateway and worker on Redis, the race forced: the frames
    stop while the stale reply travels, and (``until``) while the call's next answer does."""

    def __init__(self, url: str, *, interruptible: bool, recording: str = NAME,
                 turn: TurnSettings = TurnSettings(mode="silence", silence_ms=200),
                 words: Callable[[], Any] = lambda: _Words()) -> None:
        self.url = url
        self.interruptible = interruptible
        self.recording, self.turn, self.words = recording, turn, words
        self.sent: list[dict[str, Any]] = []
        self.sent_more = asyncio.Condition()
        self.timeline = Timeline()
        self.stale_in = asyncio.Event()  # the first utterance's end reached the gateway
        self.resumed = asyncio.Event()  # the gateway cancelled the first turn's reply
        self.reason = ""
        self.next_turn = asyncio.Event()  # ... and published the next final transcript
        self.node: _Replier | None = None
        self.worker_bus: _HoldsTheInterrupt | None = None
        self.timeline.add_listener(self._on_event)
        self.timeline.add_downlink_listener(
            lambda t, e: self.stale_in.set() if isinstance(e, bp.UtteranceEnd) else None)

    def _on_event(self, e: dict[str, Any]) -> None:
        if e["type"] == "turn_resumed" or e["type"] == "transcript" and e.get("revises"):
            self.reason = self.reason or ("resumed" if e["type"] == "turn_resumed" else "revised")
            self.resumed.set()
        if (e["type"] == "transcript" and e["final"] and not e.get("dropped")
                and self.resumed.is_set()):
            self.next_turn.set()

    async def _send(self, text: str) -> None:
        self.sent.append(json.loads(text))
        async with self.sent_more:
            self.sent_more.notify_all()

    def marked(self, utterance_id: str) -> bool:
        """Some of the utterance's audio went to Twilio (each chunk has a mark)."""
        return any(m.get("event") == "mark" and m["mark"]["name"].startswith(f"{utterance_id}#")
                   for m in self.sent)

    def uplink(self, kind: str, **match: Any) -> list[Event]:
        assert self.worker_bus is not None
        return [e for e in self.worker_bus.uplink_seen if e.get("type") == kind
                and all(e.get(k) == v for k, v in match.items())]

    def finals(self) -> list[Event]:
        """The final transcripts on the uplink: a streaming interim one (``final: false``, no
        reply asked) may come before a turn's while the caller talks, as the STT stream's
        iterator and the frames interleave (under load: 2 runs in 20 on the 2-core machine)."""
        return [e for e in self.uplink("transcript") if e.get("final", True)]

    def starts(self) -> list[bp.UtteranceStart]:
        assert self.worker_bus is not None
        return [s for s in (bp.decode(e) for e in self.worker_bus.downlink_sent)
                if isinstance(s, bp.UtteranceStart)]

    async def run(self, until: Callable[[], bool], after: Callable[[], bool] = lambda: True
                  ) -> None:
        """Feed the recording; once the next turn's transcript is out, wait for ``until``
        before the next frame; after the last frame, wait for ``after``."""
        async with (RedisBus(self.url) as gateway_bus, RedisBus(self.url) as raw,
                    VadEngine(runtime="onnx", max_wait_ms=2.0) as engine):
            worker_bus = self.worker_bus = _HoldsTheInterrupt(raw)

            def make() -> _Replier:
                self.node = _Replier(worker_bus, interruptible=self.interruptible)
                return self.node

            worker = SessionWorker(cast(Bus, worker_bus),
                                   agent_factory=lambda call: setup_with(make),
                                   synthesizer=ToneSynthesizer(10))
            worker_task = asyncio.create_task(worker.run())
            session = CallSession(
                send=self._send, bus=gateway_bus, vad=engine, timeline=self.timeline,
                settings=CallSettings(turn=self.turn),
                transcriber_for=lambda info: self.words(), transcribe_inline=True)
            downlink: asyncio.Task[None] | None = None
            waited = False
            try:
                for line in recording_messages(rec.source(self.recording)):
                    if json.loads(line).get("event") == "stop":
                        break  # the call ends below
                    await session.handle_text(line)
                    if session.info is not None and downlink is None:
                        downlink = asyncio.create_task(session.run_downlink())
                    if self.resumed.is_set() and not self.stale_in.is_set():
                        # The interrupt is out: the caller goes on once the stale reply is in.
                        await guard(self.stale_in.wait())
                        stale = self.starts()[0]
                        assert self.interruptible is not self.marked(stale.utterance_id), (
                            "the cancelled turn's reply went to Twilio" if self.interruptible
                            else "a non-interruptible reply was held")
                    if self.next_turn.is_set() and not waited:
                        async with self.sent_more:
                            await guard(self.sent_more.wait_for(until))
                        waited = True
                assert worker_bus.reply_sent.is_set(), "the race did not happen"
                assert waited, "no turn after the cancel"
                async with self.sent_more:
                    await guard(self.sent_more.wait_for(after))
            finally:
                await session.end("stop")
                if downlink is not None:
                    downlink.cancel()
                    await asyncio.gather(downlink, return_exceptions=True)
                await guard(worker.join(session.info.call_sid if session.info else ""))
                worker_task.cancel()
                await asyncio.gather(worker_task, return_exceptions=True)
                await worker.aclose()

    def check_the_race(self) -> tuple[Event, bp.UtteranceStart]:
        """The first turn's reply was made before the worker read the interrupt that cancelled
        its turn (``utterance_id`` null: nothing had come yet); returns (turn, reply)."""
        first = self.finals()[0]
        cancel = self.uplink("interrupt")[0]
        assert bp.decode(cancel) == bp.Interrupt(utterance_id=None, heard_ms=0.0,
                                                 heard_text="", reason=self.reason or "speech",
                                                 t_ms=cancel["t_ms"])
        stale = self.starts()[0]
        assert stale.reply_to == first["eid"] and stale.interruptible is self.interruptible
        return first, stale


async def test_a_reply_made_before_the_worker_read_the_interrupt_is_never_played(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    race = _Race(redis_server.url, interruptible=True)

    def whole_reply_played() -> bool:
        """The reply to the whole turn (the first transcript after the cancel) has some of its
        audio sent to Twilio."""
        whole = race.uplink("transcript", replaces_previous=True)
        return any(race.marked(s.utterance_id) for s in race.starts()
                   if whole and s.reply_to == whole[0]["eid"])

    await race.run(until=whole_reply_played)
    first, stale = race.check_the_race()
    # The call went on with the whole turn, answered by an utterance that played.
    whole = bp.decode(race.uplink("transcript", replaces_previous=True)[0])
    assert isinstance(whole, bp.Transcript) and whole.text.startswith("what is my what is my")
    # Nothing of the stale reply went to Twilio, and the timeline says why.
    assert not race.marked(stale.utterance_id)
    events = race.timeline.events
    dropped = [e for e in events if e["type"] == "bot_utterance_interrupted"
               and e["utterance_id"] == stale.utterance_id]
    assert len(dropped) == 1 and dropped[0]["dropped"] == "cancelled_turn"
    assert dropped[0]["before_audio"] is True and dropped[0]["reason"] == "resumed"
    assert dropped[0]["reply_to"] == first["eid"]
    assert not any(e["type"] == "bot_utterance_started" and e["utterance_id"] == stale.utterance_id
                   for e in events)
    # The worker was told it was not heard, and its words are in no context.
    told = [e for e in (bp.decode(x) for x in race.uplink("playback"))
            if isinstance(e, bp.Playback) and e.utterance_id == stale.utterance_id]
    assert [(e.state, e.heard_ms) for e in told] == [("interrupted", 0.0)]
    assert race.node is not None
    assert all(STALE not in str(m.get("content")) for m in race.node.context.messages)


async def test_a_non_interruptible_reply_to_a_cancelled_turn_plays_and_the_next_words_are_a_turn(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    race = _Race(redis_server.url, interruptible=False)
    await race.run(until=lambda: True)  # the next transcript is out: nothing more to wait for
    first, stale = race.check_the_race()
    assert race.marked(stale.utterance_id)  # never held: it plays
    assert not any(e["type"] == "bot_utterance_interrupted" and e.get("dropped")
                   for e in race.timeline.events)
    undone = [e for e in race.timeline.events if e["type"] == "turn_resume_undone"]
    assert len(undone) == 1 and undone[0]["reply_to"] == first["eid"]
    assert undone[0]["utterance_id"] == stale.utterance_id and undone[0]["reason"] == "resumed"
    # The cancelled turn was answered after all: the caller's next words are a turn of their
    # own, not the whole turn replacing it.
    after = bp.decode(race.finals()[1])
    assert after == bp.Transcript(text="what is my", t_ms=after.t_ms)  # type: ignore[union-attr]
    assert race.node is not None
    assert {"role": "assistant", "content": STALE} in race.node.context.messages


class _Revising:
    """A streaming recogniser whose partial at ``turn_likely`` is one word short of its final."""

    class _Stream:
        def __init__(self) -> None:
            self._done = asyncio.Event()

        def feed(self, pcm16: bytes) -> None:
            pass

        async def partials(self) -> AsyncIterator[Transcript]:
            yield Transcript(text="go forward ten", final=False)
            await self._done.wait()

        async def partial(self) -> Transcript:
            return Transcript(text="go forward ten", final=False)

        async def finish(self) -> Transcript:
            self._done.set()
            return Transcript(text="go forward ten meters")

        def close(self) -> None:
            self._done.set()

    def open_stream(self, *, sample_rate: int) -> _Stream:
        return self._Stream()


async def test_a_reply_to_a_revised_speculation_made_before_the_interrupt_is_never_played(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    """``turn.speculate``: the partial went out at ``turn_likely``, the final revised it
    (``interrupt {utterance_id: null, reason: revised}``, then the final with
    ``replaces_previous``); the reply to the partial, made before the worker read the interrupt,
    is dropped, and the final's reply plays (at the turn end)."""
    race = _Race(redis_server.url, interruptible=True, recording="barge_in_command_goforward",
                 turn=TurnSettings(mode="silence", silence_ms=400, speculate=True),
                 words=lambda: _Revising())

    def revised_reply_played() -> bool:
        """The final's reply has audio on the line (or the stale one has: checked below)."""
        final = race.uplink("transcript", replaces_previous=True)
        starts = race.starts()
        return race.marked(starts[0].utterance_id) or any(
            race.marked(s.utterance_id) for s in starts
            if final and s.reply_to == final[0]["eid"])

    await race.run(until=lambda: True, after=revised_reply_played)
    first, stale = race.check_the_race()
    assert race.reason == "revised" and bp.decode(first) == bp.Transcript(
        text="go forward ten", t_ms=first["t_ms"])
    assert not race.marked(stale.utterance_id)
    final = race.uplink("transcript", replaces_previous=True)[0]
    assert bp.decode(final).text == "go forward ten meters"  # type: ignore[union-attr]
    assert any(race.marked(s.utterance_id) for s in race.starts() if s.reply_to == final["eid"])
    dropped = [e for e in race.timeline.events if e["type"] == "bot_utterance_interrupted"
               and e["utterance_id"] == stale.utterance_id]
    assert len(dropped) == 1 and dropped[0]["dropped"] == "cancelled_turn" and dropped[0]["reason"] == "revised"
