"""A cancelled reply already in flight is never played (a real bus's race, issue #17).

The gateway ends a turn, publishes its transcript, and the worker starts the reply; the caller
goes on before the reply has come (``interrupt {utterance_id: null, reason: resumed}``). On a
real bus the worker may have made that reply before it read the interrupt: its
``utterance_start`` and audio reach the gateway *after* the interrupt. Each utterance says
which uplink event it answers (``utterance_start.reply_to``, protocol 1.2), so the gateway
drops one that answers the cancelled turn, sends none of it to Twilio, says so in the timeline
and tells the worker (``playback {state: interrupted, heard_ms: 0}``), and the call goes on with
the whole turn's reply.

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

    def __init__(self, bus: _HoldsTheInterrupt) -> None:
        super().__init__(name="replier")
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


async def test_a_reply_made_before_the_worker_read_the_interrupt_is_never_played(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    sent: list[dict[str, Any]] = []
    sent_more = asyncio.Condition()

    async def send(text: str) -> None:
        sent.append(json.loads(text))
        async with sent_more:
            sent_more.notify_all()

    def marked(utterance_id: str) -> bool:
        return any(m.get("event") == "mark" and m["mark"]["name"].startswith(f"{utterance_id}#")
                   for m in sent)

    timeline = Timeline()
    stale_in = asyncio.Event()
    resumed = asyncio.Event()  # the gateway has cancelled the first turn's reply
    whole_turn = asyncio.Event()  # ... and published the whole turn's transcript
    timeline.add_listener(lambda e: resumed.set() if e["type"] == "turn_resumed" else None)
    timeline.add_listener(lambda e: whole_turn.set() if e["type"] == "transcript" and e["final"]
                          and e.get("replaces_previous") and resumed.is_set() else None)
    # The first utterance's end reaching the gateway's downlink: the stale reply is all in.
    timeline.add_downlink_listener(
        lambda t, e: stale_in.set() if isinstance(e, bp.UtteranceEnd) else None)
    async with (RedisBus(redis_server.url) as gateway_bus, RedisBus(redis_server.url) as raw,
                VadEngine(runtime="onnx", max_wait_ms=2.0) as engine):
        worker_bus = _HoldsTheInterrupt(raw)
        node: list[_Replier] = []

        def make() -> _Replier:
            node.append(_Replier(worker_bus))
            return node[-1]

        worker = SessionWorker(cast(Bus, worker_bus), agent_factory=lambda call: setup_with(make),
                               synthesizer=ToneSynthesizer(10))
        worker_task = asyncio.create_task(worker.run())
        session = CallSession(
            send=send, bus=gateway_bus, vad=engine, timeline=timeline,
            settings=CallSettings(turn=TurnSettings(mode="silence", silence_ms=200)),
            transcriber_for=lambda info: _Words(), transcribe_inline=True)
        downlink: asyncio.Task[None] | None = None

        def whole_reply() -> str | None:
            """The id of the reply to the whole turn (the first transcript after the
            cancel) once the gateway has sent some of its audio to Twilio."""
            after = [e for e in worker_bus.uplink_seen if e.get("type") == "transcript"
                     and e.get("replaces_previous")]
            starts = [bp.decode(e) for e in worker_bus.downlink_sent
                      if e.get("type") == "utterance_start"]
            ids = [s.utterance_id for s in starts if isinstance(s, bp.UtteranceStart)
                   and after and s.reply_to == after[0]["eid"]]
            return ids[0] if ids and marked(ids[0]) else None

        played: str | None = None
        try:
            for line in recording_messages(rec.source(NAME)):
                if json.loads(line).get("event") == "stop":
                    break  # the call ends below
                await session.handle_text(line)
                if session.info is not None and downlink is None:
                    downlink = asyncio.create_task(session.run_downlink())
                if resumed.is_set() and not stale_in.is_set():
                    # The interrupt is out: the caller goes on once the stale reply is in.
                    await guard(stale_in.wait())
                    stale_id = next(e["utterance_id"] for e in worker_bus.downlink_sent
                                    if e.get("type") == "utterance_start")
                    assert not marked(stale_id), "the cancelled turn's reply went to Twilio"
                if whole_turn.is_set() and played is None:
                    async with sent_more:
                        await guard(sent_more.wait_for(lambda: whole_reply() is not None))
                    played = whole_reply()
            assert worker_bus.reply_sent.is_set(), "the race did not happen"
            assert played is not None, "no whole turn"
        finally:
            await session.end("stop")
            if downlink is not None:
                downlink.cancel()
                await asyncio.gather(downlink, return_exceptions=True)
            await guard(worker.join(session.info.call_sid if session.info else ""))
            worker_task.cancel()
            await asyncio.gather(worker_task, return_exceptions=True)
            await worker.aclose()

    up = [bp.decode(e) for e in worker_bus.uplink_seen]
    down = [bp.decode(e) for e in worker_bus.downlink_sent]

    def first_of(kind: str, **match: Any) -> Event:
        return next(e for e in worker_bus.uplink_seen if e.get("type") == kind
                    and all(e.get(k) == v for k, v in match.items()))

    first, cancel = first_of("transcript"), first_of("interrupt")
    whole = first_of("transcript", replaces_previous=True)
    assert bp.decode(cancel) == bp.Interrupt(utterance_id=None, heard_ms=0.0, heard_text="",
                                             reason="resumed", t_ms=cancel["t_ms"])
    stale = next(e for e in down if isinstance(e, bp.UtteranceStart))
    assert stale.reply_to == first["eid"] and stale.interruptible
    # The call went on with the whole turn, answered by an utterance that played.
    assert bp.decode(whole).text.startswith(bp.decode(first).text)  # type: ignore[union-attr]
    answer = next(e for e in down if isinstance(e, bp.UtteranceStart)
                  and e.reply_to == whole["eid"])
    assert played == answer.utterance_id
    # Nothing of the stale reply went to Twilio, and the timeline says why.
    assert not marked(stale.utterance_id)
    dropped = [e for e in timeline.events if e["type"] == "bot_utterance_interrupted"
               and e["utterance_id"] == stale.utterance_id]
    assert len(dropped) == 1 and dropped[0]["stale"] is True
    assert dropped[0]["before_audio"] is True and dropped[0]["reason"] == "resumed"
    assert dropped[0]["reply_to"] == first["eid"]
    assert not any(e["type"] == "bot_utterance_started" and e["utterance_id"] == stale.utterance_id
                   for e in timeline.events)
    # The worker was told it was not heard, and its words are in no context.
    told = [e for e in up if isinstance(e, bp.Playback) and e.utterance_id == stale.utterance_id]
    assert [(e.state, e.heard_ms) for e in told] == [("interrupted", 0.0)]
    assert all(STALE not in str(m.get("content")) for m in node[0].context.messages)
