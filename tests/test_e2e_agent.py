"""A recorded call end to end: gateway (VAD, barge-in, speech to text) -> bus -> session worker
running a seed-style LLM agent against a local OpenAI-compatible server -> TTS -> gateway.

turn_gap_then_barge_in: the caller answers in a gap (a normal turn, transcribed by pocketsphinx),
the agent's LLM answers at length, and the caller talks over that answer at 8.4 s.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bus import Bus
from gateway.replay import replay
from nodes import (
    AgentSession,
    OpenAIClient,
    OutputAgentNode,
    SDKSystemControlInterruptEvent,
    SessionWorker,
    ToneSynthesizer,
)
from speech import make_transcriber
from tests import recordings_index as rec
from tests.common import uninterruptible_utterance
from tests.openai_server import OpenAIServer, Text

REPLY = (
    "Thanks, I have found your order. It left our warehouse this morning and should reach you "
    "within two business days. You will get a text message with the tracking link, and you can "
    "also follow it on our website under your account, in the section called my orders."
)
MS_PER_CHAR = 40


async def _run_call(interruptible: bool) -> dict[str, Any]:
    seen: list[Any] = []
    nodes: list[OutputAgentNode] = []
    async with OpenAIServer() as llm_server:
        for _ in range(4):  # the answer in the gap, then whatever the barge-in turn says
            llm_server.respond(*[Text(w + " ") for w in REPLY.split(" ")])

        class Answerer(OutputAgentNode):
            def __init__(self) -> None:
                super().__init__(name="answerer", is_interruptible=interruptible)
                self.llm = OpenAIClient(model="gpt-test", api_key="test-key",
                                        base_url=llm_server.base_url)

            async def generate_response(self):  # type: ignore[no-untyped-def]
                response = await self.llm.chat(messages=self.context.messages, stream=True)
                async for chunk in response:
                    if chunk.content:
                        yield chunk.content

        async def setup(session: AgentSession) -> None:
            node = Answerer()
            nodes.append(node)
            session.add_node(node)
            await session.start()

            @session.on_event("on_event_received")
            async def handle_event(session: AgentSession, event: Any) -> None:
                seen.append(event)

            await session.wait_until_complete()

        async def agent(bus: Bus, stop: asyncio.Event) -> None:
            worker = SessionWorker(bus, agent_factory=lambda call: setup,
                                   synthesizer=ToneSynthesizer(MS_PER_CHAR))
            task = asyncio.create_task(worker.run())
            await stop.wait()
            for sid in list(worker.sessions):
                await asyncio.wait_for(worker.join(sid), 20)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await worker.aclose()

        transcriber = make_transcriber("pocketsphinx")
        await transcriber.warm_up(1)  # load the decoder before the call, as `serve` does
        try:
            timeline, _ = await replay(rec.source("turn_gap_then_barge_in"), agent=agent,
                                       transcriber_for=lambda call: transcriber, speed=1.0)
        finally:
            for node in nodes:
                await node.llm.aclose()
        requests = list(llm_server.requests)
    return {"events": timeline.events, "seen": seen, "node": nodes[0], "requests": requests}


def _assistant_text(node: OutputAgentNode) -> str:
    """The agent's first answer as kept in the conversation."""
    msgs = [m for m in node.context.messages if m["role"] == "assistant"]
    assert msgs, node.context.messages
    return str(msgs[0]["content"])


@pytest.mark.slow
async def test_barge_in_cuts_the_llm_answer_to_what_was_heard() -> None:
    out = await _run_call(interruptible=True)
    events = out["events"]
    transcripts = [e for e in events if e["type"] == "transcript" and not e.get("dropped")]
    assert transcripts and transcripts[0]["text"], events  # the answer in the gap was heard
    assert out["requests"]  # ... and answered by the LLM
    first = out["requests"][0].body["messages"][-1]
    assert first == {"role": "user", "content": transcripts[0]["text"]}
    started = [e for e in events if e["type"] == "bot_utterance_started"
               and e["node"] == "answerer"]
    assert started and started[0]["interruptible"] is True
    barge = [e for e in events if e["type"] == "barge_in"]
    assert barge and barge[0]["utterance_id"] == started[0]["utterance_id"]
    heard_ms = barge[0]["heard_ms"]
    assert 0 < heard_ms < len(REPLY) * MS_PER_CHAR
    text = _assistant_text(out["node"])
    assert REPLY.startswith(text) and len(text) < len(REPLY)
    # The kept text is what the caller heard: heard_ms of audio at 40 ms a character, cut back
    # to a word boundary.
    assert len(text) <= heard_ms / MS_PER_CHAR + 1
    assert len(text) >= heard_ms / MS_PER_CHAR - 20
    assert any(isinstance(e, SDKSystemControlInterruptEvent) for e in out["seen"])


@pytest.mark.slow
async def test_non_interruptible_answer_plays_to_the_end() -> None:
    out = await _run_call(interruptible=False)
    events = out["events"]
    uninterruptible_utterance(events, "answerer")
    assert not any(isinstance(e, SDKSystemControlInterruptEvent) for e in out["seen"])
    assert _assistant_text(out["node"]).strip() == REPLY
