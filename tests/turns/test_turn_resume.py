"""Never talk over a caller who resumed: the worker's side. The gateway dropped a reply nobody
heard (``interrupt``, reason ``resumed``) and then sends the whole turn with
``replaces_previous``: the agent answers it from ONE user message for the turn."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from bus import Bus
from bus import protocol as bp
from nodes import OpenAIClient, OutputAgentNode, ToneSynthesizer
from nodes._turns import drop_last_user_turn

from ..nodes.conftest import guard, open_line, running, setup_with
from ..openai_server import Mark, OpenAIServer, Text, Wait


class Answerer(OutputAgentNode):
    def __init__(self, llm: OpenAIClient) -> None:
        super().__init__(name="answerer")
        self.llm = llm

    async def generate_response(self) -> AsyncIterator[str]:
        response = await self.llm.chat(messages=self.context.messages, stream=True)
        async for chunk in response:
            if chunk.content:
                yield chunk.content


def test_drop_last_user_turn_takes_the_turn_and_what_followed() -> None:
    node = OutputAgentNode(name="n")
    node.context.add_messages([
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "what is my"}, {"role": "assistant", "content": "Your"},
    ])
    assert drop_last_user_turn([node]) == 2
    assert node.context.messages == [{"role": "user", "content": "hi"},
                                     {"role": "assistant", "content": "Hello."}]
    empty = OutputAgentNode(name="e")
    assert drop_last_user_turn([empty]) == 0


async def test_a_resumed_turn_is_answered_from_one_user_message(
    bus: Bus, openai_server: OpenAIServer, llm: OpenAIClient
) -> None:
    first_chunk, never = asyncio.Event(), asyncio.Event()
    held = openai_server.respond(Text("Your"), Mark(first_chunk), Wait(never), Text(" card?"))
    openai_server.respond(Text("Your balance is ten dollars."))

    setup = setup_with(lambda: Answerer(llm))
    async with running(bus, lambda call: setup, worker_id="w-turns",
                       synthesizer=ToneSynthesizer(10)) as worker:
        line = await open_line(bus, "CA1700")
        await line.publish({"type": "call_started"})
        await line.publish({"type": "transcript", "text": "what is my", "final": True})
        start = await line.next("utterance_start")
        await guard(first_chunk.wait())
        # The caller went on before hearing a word of it: the gateway dropped it ...
        await line.publish({"type": "speech_started"})
        await line.publish({"type": "interrupt", "utterance_id": start["utterance_id"],
                            "heard_ms": 0.0, "node": "answerer", "reason": "resumed"})
        await line.next("utterance_end", utterance_id=start["utterance_id"])
        await guard(held.disconnected.wait())
        # ... and sends the whole turn when it ends.
        await line.publish({"type": "transcript", "text": "what is my balance", "final": True,
                            "replaces_previous": True})
        second = await line.next("utterance_start")
        await line.next("utterance_end", utterance_id=second["utterance_id"])
        assert openai_server.requests[1].body["messages"] == [
            {"role": "user", "content": "what is my balance"}]
        node = worker.sessions["CA1700"].get_node("answerer")
        assert isinstance(node, OutputAgentNode)
        assert node.context.messages == [
            {"role": "user", "content": "what is my balance"},
            {"role": "assistant", "content": "Your balance is ten dollars."}]
        await line.end(worker)


async def test_the_gateway_holds_a_reply_the_caller_did_not_hear_and_sends_the_turn() -> None:
    """long_turn_librivox through the real gateway with a 200 ms silence timer (a turn end at
    each ~460 ms pause) and an agent too slow to have answered before the caller goes on: each
    time the caller resumes, the gateway cancels the reply being generated and the next
    transcript carries the whole turn so far, replacing the previous one."""
    from config import ConfigHolder
    from gateway.call import CallSettings
    from gateway.replay import replay
    from gateway.server import TranscriberCache
    from gateway.timeline import Timeline
    from tests import recordings_index as rec
    from vad._turn import TurnSettings

    from .test_turn_replay import ROOT

    uplink: list[bp.UplinkEvent] = []

    async def slow_agent(the_bus: Bus, stop: asyncio.Event) -> None:
        async for call in the_bus.claim_calls("slow"):
            async for m in the_bus.uplink(call.call_sid, "slow"):
                event = bp.decode(m.event)
                assert isinstance(event, bp.UplinkEvent)
                uplink.append(event)
                await the_bus.ack(call.call_sid, m.id)
                if isinstance(event, bp.CallEnded):
                    return

    holder = ConfigHolder(ROOT / "config" / "agents.yaml")
    transcribers = TranscriberCache(holder)
    timeline = Timeline()
    try:
        await transcribers.warm_up()
        await replay(rec.source("long_turn_librivox"), agent=slow_agent,
                     transcriber_for=lambda info: transcribers(info.agent),
                     settings=CallSettings(turn=TurnSettings(mode="silence", silence_ms=200)),
                     timeline=timeline)
    finally:
        transcribers.close()
    resumed = [e for e in timeline.events if e["type"] == "turn_resumed"]
    assert len(resumed) >= 2  # one per pause
    cancels = [e for e in uplink if isinstance(e, bp.Interrupt) and e.reason == "resumed"]
    assert len(cancels) == len(resumed) and all(e.heard_ms == 0.0 for e in cancels)
    transcripts = [e for e in uplink if isinstance(e, bp.Transcript)]
    assert transcripts[0].replaces_previous is False
    assert all(t.replaces_previous is True for t in transcripts[1:])
    # Each transcript carries the one before it: the last one is the whole turn.
    for before, after in zip(transcripts, transcripts[1:], strict=False):
        assert after.text.startswith(before.text)
    assert len(transcripts[-1].text.split()) > len(transcripts[0].text.split())
