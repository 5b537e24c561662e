"""The session worker end to end: bus in, the seed's agents, a real LLM stream over HTTP/SSE from
the local OpenAI-compatible server, audio out on the downlink.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import pytest

from bus import Bus
from bus import protocol as bp
from nodes import (
    AgentSession,
    OpenAIClient,
    OutputAgentNode,
    SDKAgentEndCallEvent,
    SDKAgentTransferConversationEvent,
    SDKEvent,
    SDKSystemControlInterruptEvent,
    SDKSystemUserDTMFEvent,
    SDKSystemUserStartedSpeakingEvent,
    SessionWorker,
    ToneSynthesizer,
)

from ..bus.conftest import eventually
from ..openai_server import Mark, OpenAIServer, Text, Wait
from . import test_seed_snippets as seed
from .conftest import GUARD_S, BusFactory, Line, guard, open_line, running, setup_with

MS_PER_CHAR = 10

pytestmark = pytest.mark.usefixtures("seed_llm")


@pytest.fixture
def seed_llm(llm: OpenAIClient, monkeypatch: pytest.MonkeyPatch) -> OpenAIClient:
    monkeypatch.setattr(seed, "llm", llm, raising=False)
    return llm


_WORKER_IDS = itertools.count(1)


def Worker(bus: Bus, setup: Any, **options: Any) -> AbstractAsyncContextManager[SessionWorker]:
    """A SessionWorker serving every call with ``setup``, running for the ``async with``."""
    options.setdefault("synthesizer", ToneSynthesizer(MS_PER_CHAR))
    return running(bus, lambda call: setup, worker_id=f"w-{next(_WORKER_IDS)}", **options)


def decoded_ms(line: Line, utterance_id: str) -> float:
    audio = [e for e in line.of("audio") if e["utterance_id"] == utterance_id]
    return sum(len(bp.decode(e).payload) for e in audio) / 8


def spoken(line: Line, utterance_id: str) -> str:
    """The utterance's text as carried by its audio events (each chunk once)."""
    spans: dict[int, str] = {}
    for e in line.of("audio"):
        if e["utterance_id"] == utterance_id:
            spans[e["text_start"]] = e["text"]
    return "".join(spans[k] for k in sorted(spans))


async def test_transcript_streams_an_utterance(
    bus: Bus, openai_server: OpenAIServer
) -> None:
    openai_server.respond(Text("Hello"), Text(" there, how can I help?"))
    async with Worker(bus, seed.setup) as worker:
        line = await open_line(bus, "CA1000", from_number="+15550001111")
        await line.publish({"type": "call_started"})
        await line.publish({"type": "transcript", "text": "Hi", "final": True})
        start = await line.next("utterance_start")
        assert start["node"] == "my-agent" and start["interruptible"] is True
        assert "text" not in start
        uid = start["utterance_id"]
        end = await line.next("utterance_end", utterance_id=uid)
        assert end == {**end, "interrupted": False, "text": "Hello there, how can I help?"}

        audio = line.of("audio")
        assert spoken(line, uid) == "Hello there, how can I help?"
        assert decoded_ms(line, uid) == len("Hello there, how can I help?") * MS_PER_CHAR
        assert audio[-1]["audio_ms"] == decoded_ms(line, uid)
        assert all(e["duration_ms"] * 8 == len(bp.decode(e).payload) for e in audio)
        first_chunk = [e for e in audio if e["text"] == "Hello"]
        assert first_chunk[-1]["audio_ms"] == 5 * MS_PER_CHAR

        body = openai_server.requests[0].body
        assert body["messages"] == [{"role": "user", "content": "Hi"}]
        assert body["stream"] is True and body["model"] == "gpt-test"

        await line.end(worker)
    saved = await bus.load_context("CA1000")
    assert saved is not None
    assert saved["nodes"]["my-agent"] == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello there, how can I help?"},
    ]


async def test_interrupt_cancels_and_cuts_to_what_was_heard(
    bus: Bus, openai_server: OpenAIServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=seed.logger.name)
    sent_two, gate = asyncio.Event(), asyncio.Event()
    reply = openai_server.respond(
        Text("Our opening hours are"),
        Text(" nine to five"),
        Mark(sent_two),
        Wait(gate),
        Text(" on weekdays."),
    )
    async with Worker(bus, seed.setup) as worker:
        line = await open_line(bus, "CA2000")
        await line.publish({"type": "call_started"})
        await line.publish({"type": "transcript", "text": "When are you open?", "final": True})
        start = await line.next("utterance_start")
        uid = start["utterance_id"]
        await guard(sent_two.wait())
        # wait until the second chunk's audio is on the downlink
        await line.next("audio", utterance_id=uid, text=" nine to five")

        # 21 characters of chunk one (210 ms), then 7.5 of " nine to five": " nine t|o"
        # -> back to the word boundary before "to".
        await line.publish({"type": "speech_started"})
        await line.publish({"type": "interrupt", "utterance_id": uid, "heard_ms": 285})
        end = await line.next("utterance_end", utterance_id=uid)
        assert end["interrupted"] is True
        await guard(reply.disconnected.wait())  # the LLM stream was cancelled mid-way
        assert not reply.finished.is_set()
        session = worker.sessions["CA2000"]
        await session.wait_for_event_handlers()
        assert "User barge-in detected" in caplog.messages

        agent = session.get_node("my-agent")
        assert isinstance(agent, seed.MyAgent)
        assert agent.was_interrupted
        assert agent.context.messages == [
            {"role": "user", "content": "When are you open?"},
            {"role": "assistant", "content": "Our opening hours are nine"},
        ]
        assert not any(e.get("text") == " on weekdays." for e in line.of("audio"))

        # Next turn: the seed's MyAgent apologises (no LLM call), and the cut message is what
        # the conversation keeps.
        await line.publish({"type": "transcript", "text": "Sorry?", "final": True})
        start2 = await line.next("utterance_start")
        await line.next("utterance_end", utterance_id=start2["utterance_id"])
        assert spoken(line, start2["utterance_id"]) == (
            "Sorry, I was saying something. What did you need?"
        )
        assert len(openai_server.requests) == 1
        await line.end(worker)
    saved = await bus.load_context("CA2000")
    assert saved is not None
    assert saved["nodes"]["my-agent"][1] == {
        "role": "assistant",
        "content": "Our opening hours are nine",
    }


class LLMPayment(seed.PaymentAgent):
    """The seed's PaymentAgent (is_interruptible=False) speaking from the LLM, with spies."""

    def __init__(self) -> None:
        super().__init__()
        self.received: list[str] = []
        self.interrupt_handled = False

    async def process_event(self, event: SDKEvent) -> None:
        self.received.append(event.type)
        await super().process_event(event)

    async def _handle_interrupt(self) -> None:
        self.interrupt_handled = True
        await super()._handle_interrupt()

    async def generate_response(self) -> AsyncIterator[str]:
        response = await seed.llm.chat(messages=self.context.messages, stream=True)
        async for chunk in response:
            if chunk.content:
                yield chunk.content


async def test_non_interruptible_node_is_neither_cancelled_nor_cut(
    bus: Bus, openai_server: OpenAIServer
) -> None:
    handler_saw: list[SDKEvent] = []
    speech_seen = asyncio.Event()
    agents: list[LLMPayment] = []

    async def payment_setup(session: AgentSession) -> None:
        agent = LLMPayment()
        agents.append(agent)
        session.add_node(agent)
        await session.start()

        @session.on_event("on_event_received")
        async def record(session: AgentSession, event: SDKEvent) -> None:
            handler_saw.append(event)
            if isinstance(event, SDKSystemUserStartedSpeakingEvent):
                speech_seen.set()

        await session.wait_until_complete()

    first_sent, gate = asyncio.Event(), asyncio.Event()
    full = "Your card ending 4242 will be charged 20 dollars. Say yes to confirm."
    reply = openai_server.respond(
        Text("Your card ending 4242 will be charged 20 dollars."),
        Mark(first_sent),
        Wait(gate),
        Text(" Say yes to confirm."),
    )
    async with Worker(bus, payment_setup) as worker:
        line = await open_line(bus, "CA3000")
        await line.publish({"type": "transcript", "text": "Pay my bill", "final": True})
        start = await line.next("utterance_start")
        assert start["node"] == "payment-agent" and start["interruptible"] is False
        uid = start["utterance_id"]
        await guard(first_sent.wait())
        await line.next("audio", utterance_id=uid)

        # A misbehaving gateway sends `interrupt` anyway; speech_started after it tells us (the
        # handlers see events in order) when the worker has dealt with the interrupt.
        await line.publish({"type": "interrupt", "utterance_id": uid, "heard_ms": 50})
        await line.publish({"type": "speech_started"})
        await guard(speech_seen.wait())
        gate.set()

        end = await line.next("utterance_end", utterance_id=uid)
        assert end["interrupted"] is False and end["text"] == full
        assert spoken(line, uid) == full
        assert decoded_ms(line, uid) == len(full) * MS_PER_CHAR
        await guard(reply.finished.wait())
        assert not reply.disconnected.is_set()

        agent = agents[0]
        assert not agent.interrupt_handled
        assert SDKSystemControlInterruptEvent().type not in agent.received
        assert not any(isinstance(e, SDKSystemControlInterruptEvent) for e in handler_saw)
        assert agent.context.messages[-1] == {"role": "assistant", "content": full}
        await line.end(worker)


async def test_interrupt_suppressed_changes_nothing(bus: Bus, openai_server: OpenAIServer) -> None:
    openai_server.respond(Text("All done."))
    async with Worker(bus, seed.setup) as worker:
        line = await open_line(bus, "CA3500")
        await line.publish({"type": "transcript", "text": "Hi", "final": True})
        start = await line.next("utterance_start")
        await line.next("utterance_end", utterance_id=start["utterance_id"])
        await line.publish({"type": "interrupt_suppressed", "utterance_id": start["utterance_id"]})
        await line.end(worker)
    saved = await bus.load_context("CA3500")
    assert saved is not None and saved["nodes"]["my-agent"][-1]["content"] == "All done."


async def test_interrupt_after_generation_ended_still_cuts(
    bus: Bus, openai_server: OpenAIServer
) -> None:
    """The LLM finishes long before the caller has heard it all; a late barge-in still cuts."""
    openai_server.respond(Text("First, press one."), Text(" Then say your account number."))
    async with Worker(bus, seed.setup) as worker:
        line = await open_line(bus, "CA4000")
        await line.publish({"type": "transcript", "text": "How do I start?", "final": True})
        start = await line.next("utterance_start")
        uid = start["utterance_id"]
        await line.next("utterance_end", utterance_id=uid)
        await line.publish({"type": "interrupt", "utterance_id": uid, "heard_ms": 175})
        await line.end(worker)
    saved = await bus.load_context("CA4000")
    assert saved is not None
    assert saved["nodes"]["my-agent"][-1] == {"role": "assistant", "content": "First, press one."}


async def test_worker_resumes_a_call_after_a_crash(
    make_bus: BusFactory, openai_server: OpenAIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    gateway_bus, bus_a, bus_b = make_bus(), make_bus(), make_bus()
    for b in (gateway_bus, bus_a, bus_b):
        await b.start()
    turn_saved = asyncio.Event()
    save = bus_a.save_context

    async def save_and_tell(call_sid: str, context: dict[str, Any], **kw: Any) -> None:
        await save(call_sid, context, **kw)
        if len(context["nodes"]["my-agent"]) == 2:
            turn_saved.set()

    monkeypatch.setattr(bus_a, "save_context", save_and_tell)
    openai_server.respond(Text("Your order shipped yesterday."))
    line = await open_line(gateway_bus, "CA5000")
    async with Worker(bus_a, seed.setup):
        await line.publish({"type": "call_started"})
        await line.publish({"type": "transcript", "text": "Where is my order?", "final": True})
        start = await line.next("utterance_start")
        await line.next("utterance_end", utterance_id=start["utterance_id"])
        await guard(turn_saved.wait())
    # Worker A "dies": its call task is cancelled (no final save) and its bus goes away, so
    # the call goes back to the pool.
    await bus_a.aclose()

    openai_server.respond(Text("It arrives tomorrow."))
    async with Worker(bus_b, seed.setup) as worker_b:
        await line.publish({"type": "transcript", "text": "When will it arrive?", "final": True})
        await line.next("utterance_end", text="It arrives tomorrow.")
        assert openai_server.requests[1].body["messages"] == [
            {"role": "user", "content": "Where is my order?"},
            {"role": "assistant", "content": "Your order shipped yesterday."},
            {"role": "user", "content": "When will it arrive?"},
        ]
        # nothing handled before the crash was handled again (no repeated turn)
        assert len(openai_server.requests) == 2
        await line.end(worker_b)


class Closer(OutputAgentNode):
    """Says goodbye and hangs up, or transfers when asked for a human."""

    greeting = "Thanks for calling."

    async def generate_response(self) -> AsyncIterator[str]:
        said = self.context.messages[-1]["content"]
        if "human" in said:
            yield "Transferring you now."
            await self.send_event(
                SDKAgentTransferConversationEvent(transfer_call_number="+15557654321")
            )
        else:
            yield "Goodbye!"
            await self.send_event(SDKAgentEndCallEvent())


closer_setup = setup_with(lambda: Closer(name="closer"))


class FakeTwilio:
    """Records ``client.calls(sid).update(**fields)`` like twilio.rest.Client, no network."""

    def __init__(self) -> None:
        self.updates: list[tuple[str, dict[str, Any]]] = []
        self.updated = threading.Event()

    def calls(self, sid: str) -> Any:
        client = self

        class _Call:
            def update(self, **fields: Any) -> None:
                client.updates.append((sid, fields))
                client.updated.set()

        return _Call()


@pytest.mark.parametrize(
    ("said", "downlink", "check"),
    [
        ("bye", {"type": "hangup"}, lambda f: f == {"status": "completed"}),
        (
            "a human please",
            {"type": "transfer", "to": "+15557654321"},
            lambda f: "<Dial>+15557654321</Dial>" in f["twiml"],
        ),
    ],
)
async def test_end_call_and_transfer_use_twilio_and_the_downlink(
    bus: Bus,
    said: str,
    downlink: dict[str, Any],
    check: Callable[[dict[str, Any]], bool],
) -> None:
    twilio = FakeTwilio()
    async with Worker(bus, closer_setup, twilio_client=twilio) as worker:
        line = await open_line(bus, "CA6000")
        await line.publish({"type": "call_started"})
        greeting = await line.next("utterance_start")
        assert greeting["text"] == "Thanks for calling." and greeting["node"] == "closer"
        await line.publish({"type": "transcript", "text": said, "final": True})
        event = await line.next(downlink["type"])
        assert {k: event[k] for k in downlink} == downlink
        assert await asyncio.to_thread(twilio.updated.wait, 10)
        ((sid, fields),) = twilio.updates
        assert sid == "CA6000" and check(fields)
        await line.end(worker)


async def test_duplicate_eids_and_dtmf(bus: Bus, openai_server: OpenAIServer) -> None:
    digits: list[str] = []

    async def setup(session: AgentSession) -> None:
        agent = seed.MyAgent()
        session.add_node(agent)
        await session.start()

        @session.on_event("on_event_received")
        def on_digit(session: AgentSession, event: SDKEvent) -> None:
            if isinstance(event, SDKSystemUserDTMFEvent):
                digits.append(event.digit)

        await session.wait_until_complete()

    openai_server.respond(Text("Once."))
    async with Worker(bus, setup) as worker:
        line = await open_line(bus, "CA7000")
        transcript = {"type": "transcript", "text": "Hello", "final": True, "eid": "gw-1"}
        await line.publish(transcript)
        await line.publish(dict(transcript))  # a retried publish: same eid
        await line.publish({"type": "transcript", "text": "partial", "final": False})
        await line.publish({"type": "dtmf", "digit": "5"})
        await line.publish({"type": "mystery"})  # unknown types are skipped, not fatal
        start = await line.next("utterance_start")
        await line.next("utterance_end", utterance_id=start["utterance_id"])
        await worker.sessions["CA7000"].wait_for_event_handlers()
        await line.end(worker)
    assert len(openai_server.requests) == 1
    assert digits == ["5"]


async def test_setup_failure_hangs_up(bus: Bus) -> None:
    async def broken_setup(session: AgentSession) -> None:
        raise RuntimeError("agent misconfigured")

    twilio = FakeTwilio()
    async with Worker(bus, broken_setup, twilio_client=twilio) as worker:
        line = await open_line(bus, "CA8000")
        assert (await line.next())["type"] == "hangup"
        await line.end(worker)
    assert twilio.updates == [("CA8000", {"status": "completed"})]


class GatedSynthesizer(ToneSynthesizer):
    """Holds the first synthesis until ``gate`` is set (a TTS that is slow to answer)."""

    def __init__(self) -> None:
        super().__init__(MS_PER_CHAR)
        self.gate = asyncio.Event()
        self.calls = 0

    async def synthesize(self, text: str) -> AsyncIterator[bytes]:
        self.calls += 1
        if self.calls == 1:
            await self.gate.wait()
        async for piece in super().synthesize(text):
            yield piece


class Scripted(OutputAgentNode):
    def __init__(self, name: str, text: str) -> None:
        super().__init__(name=name)
        self.text = text

    async def generate_response(self) -> AsyncIterator[str]:
        yield self.text


async def test_barge_in_drops_responses_queued_behind_the_interrupted_one(bus: Bus) -> None:
    """Two interruptible nodes answer; the caller barges in on the first: the second, generated
    but not yet played, is never played (on the downlink as an utterance interrupted before its
    first audio, as it would be had it been sent before the barge-in) and leaves no assistant
    message."""
    nodes = [Scripted("alpha", "Alpha speaking."), Scripted("bravo", "Bravo speaking.")]
    interrupted = asyncio.Event()

    async def two_setup(session: AgentSession) -> None:
        for node in nodes:
            session.add_node(node)
        await session.start()

        @session.on_event("on_event_received")
        def seen(session: AgentSession, event: SDKEvent) -> None:
            if isinstance(event, SDKSystemControlInterruptEvent):
                interrupted.set()

        await session.wait_until_complete()

    synth = GatedSynthesizer()
    async with Worker(bus, two_setup, synthesizer=synth) as worker:
        line = await open_line(bus, "CA9000")
        await line.publish({"type": "transcript", "text": "Hello?", "final": True})
        start = await line.next("utterance_start")  # its audio is held in the synthesizer
        uid = start["utterance_id"]
        await line.publish({"type": "interrupt", "utterance_id": uid, "heard_ms": 0})
        await guard(interrupted.wait())
        synth.gate.set()
        received = await line.end(worker)
    assert [(e["type"], e.get("node")) for e in received] == [
        ("utterance_start", "alpha"), ("utterance_end", None),
        ("utterance_start", "bravo"), ("utterance_end", None)]
    assert received[1]["interrupted"] is True and received[3]["interrupted"] is True
    for node in nodes:
        assert node.context.messages == [{"role": "user", "content": "Hello?"}]



class Chunked(OutputAgentNode):
    """Three chunks; with a lookahead the second is pulled only once the caller hears the first.
    Answers a key press with "You pressed <digit>"."""

    async def process_event(self, event: SDKEvent) -> None:
        if isinstance(event, SDKSystemUserDTMFEvent):
            await self.speak(f"You pressed {event.digit}")
        await super().process_event(event)

    async def generate_response(self) -> AsyncIterator[str]:
        for n in range(3):
            yield f"Part {n} of the answer. "


async def test_the_caller_s_input_queued_behind_an_answer_outlives_a_barge_in(bus: Bus) -> None:
    """A key press and a second turn queued behind the node's paced answer to the first, then a
    barge-in: the bot's work is dropped, the caller's input is not (the key is answered, the
    words are in the conversation), and every uplink event is settled (acked): none is held
    waiting to be applied for the rest of the call."""
    node = Chunked(name="alpha")

    async def setup(session: AgentSession) -> None:
        session.add_node(node)
        await session.start()
        await session.wait_until_complete()

    # No playback reports from this gateway: the node's generator waits on its pacing, busy.
    async with Worker(bus, setup, lookahead_ms=50.0) as worker:
        line = await open_line(bus, "CA9001")
        await line.publish({"type": "transcript", "text": "Hello?", "final": True})
        start = await line.next("utterance_start")
        await line.publish({"type": "dtmf", "digit": "5"})
        await line.publish({"type": "transcript", "text": "Are you there?", "final": True})

        def unapplied() -> int:
            state = worker._calls.get("CA9001")
            return -1 if state is None else len(state.unapplied)

        await eventually(lambda: unapplied() == 3, GUARD_S, "all three queued, owed their effects")
        await line.publish({"type": "interrupt", "utterance_id": start["utterance_id"], "heard_ms": 0})
        await eventually(lambda: unapplied() == 0, GUARD_S, "every one settled: nothing left to ack")
        await line.end(worker)
    spoken = [e.get("text") for e in line.of("utterance_start")]
    assert "You pressed 5" in spoken
    users = [m["content"] for m in node.context.messages if m["role"] == "user"]
    assert users == ["Hello?", "Are you there?"]


async def test_a_long_call_s_state_stays_bounded(bus: Bus, monkeypatch: pytest.MonkeyPatch) -> None:
    """A call's worker state does not grow with its length: handled eids and ended utterances
    beyond a bound are forgotten (shrunk here to 8 and 2 to see it), and every key press is
    still answered once, in order."""
    import nodes._worker as worker_module

    monkeypatch.setattr(worker_module, "_HANDLED_IN_MEMORY", 8)
    monkeypatch.setattr(worker_module, "_KEPT_UTTERANCES", 2)
    node = Chunked(name="alpha")

    async def setup(session: AgentSession) -> None:
        session.add_node(node)
        await session.start()
        await session.wait_until_complete()

    digits = [str(n % 10) for n in range(30)]
    sizes: list[tuple[int, int, int]] = []
    async with Worker(bus, setup) as worker:
        line = await open_line(bus, "CA9100")
        for digit in digits:
            await line.publish({"type": "dtmf", "digit": digit})
            start = await line.next("utterance_start", text=f"You pressed {digit}")
            await line.next("utterance_end", utterance_id=start["utterance_id"])
            state = worker._calls["CA9100"]
            sizes.append((len(state.handled), len(state.unapplied), len(state.utterances)))
        await line.end(worker)
    spoken = [e.get("text") for e in line.of("utterance_start")]
    assert spoken == [f"You pressed {d}" for d in digits]
    assert all(handled <= 8 + unapplied for handled, unapplied, _ in sizes)
    assert max(handled for handled, _, _ in sizes) >= 8  # it did fill up
    assert max(utterances for _, _, utterances in sizes) <= 2 * 2 + 1
