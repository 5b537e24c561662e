"""ScriptedLLM: keyword rules behind OpenAIClient's ``chat``; and ConfiguredLLMNode acting on the
rules' control calls (transfer, hang-up) in a session without a bus.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from config import ScriptRule
from nodes import (
    HANDOVER_TOOL,
    HANGUP_TOOL,
    TRANSFER_TOOL,
    AgentSession,
    ChatChunk,
    ChatResponse,
    ConfiguredLLMNode,
    ScriptedLLM,
    SDKAgentEndCallEvent,
    SDKAgentLLMResponseChunkEvent,
    SDKAgentLLMResponseEndEvent,
    SDKAgentReadyEvent,
    SDKAgentSpeakEvent,
    SDKAgentTransferConversationEvent,
    SDKAgentTranscriptUpdateEvent,
    SDKEvent,
    SDKSystemLLMRequestEvent,
    SDKSystemUserJoinedEvent,
)

from .conftest import guard

BALANCE = "Your balance is forty two dollars and seventeen cents."
RULES = [
    ScriptRule(keywords=["balance", "owe"], reply=BALANCE),
    ScriptRule(keywords=["pay"], reply="Sure, let's take a payment.", goto="payment"),
    ScriptRule(keywords=["human"], reply="Please hold.", transfer_to="+14155550199"),
    ScriptRule(keywords=["bye"], reply="Goodbye!", hangup=True),
    ScriptRule(keywords=["everything"], reply="Bye, transferring.", goto="main",
               transfer_to="+14155550100", hangup=True),  # fmt: skip
]


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


async def streamed(llm: ScriptedLLM, messages: list[dict[str, Any]]) -> list[ChatChunk]:
    stream = await llm.chat(messages=messages, stream=True)
    return [chunk async for chunk in stream]


def text_of(chunks: list[ChatChunk]) -> str:
    return "".join(c.content or "" for c in chunks)


async def test_first_matching_rule_answers_in_word_chunks() -> None:
    llm = ScriptedLLM(RULES, words_per_chunk=3)
    chunks = await streamed(
        llm, [{"role": "system", "content": "Be brief."}, user("How much do I OWE you?")]
    )
    assert text_of(chunks) == BALANCE
    contents = [c.content for c in chunks if c.content]
    assert contents == ["Your balance is ", "forty two dollars ", "and seventeen cents."]
    assert chunks[-1] == ChatChunk(finish_reason="stop")
    assert all(c.tool_calls is None for c in chunks)


async def test_only_the_latest_user_message_counts() -> None:
    llm = ScriptedLLM(RULES)
    messages = [user("what is my balance"), {"role": "assistant", "content": BALANCE},
                user("I'd like to pay my bill")]  # fmt: skip
    chunks = await streamed(llm, messages)
    assert text_of(chunks) == "Sure, let's take a payment."


async def test_no_match_gives_the_fallback() -> None:
    chunks = await streamed(ScriptedLLM(RULES, fallback="Say balance."), [user("the weather?")])
    assert text_of(chunks) == "Say balance."


async def test_default_fallback_lists_what_the_caller_can_say() -> None:
    llm = ScriptedLLM(RULES[:3])
    chunks = await streamed(llm, [user("the weather?")])
    assert text_of(chunks) == "Sorry, I didn't catch that. You can say balance, pay or human."
    assert ScriptedLLM().fallback == "Sorry, I didn't catch that."


@pytest.mark.parametrize(
    "messages",
    [
        [],
        [{"role": "system", "content": "Be brief."}],
        [user("balance"), {"role": "assistant", "content": "Sure."},
         {"role": "system", "content": "The conversation was handed over to you from main."}],
    ],
    ids=["nothing", "prompt only", "handover note"],
)  # fmt: skip
async def test_no_caller_turn_to_answer_gives_an_empty_reply(
    messages: list[dict[str, Any]],
) -> None:
    chunks = await streamed(ScriptedLLM(RULES), messages)
    assert chunks == [ChatChunk(finish_reason="stop")]


async def test_replies_after_the_caller_turn_do_not_hide_it() -> None:
    """A greeting (or the reply of the node that handed over) spoken before the caller's turn
    reached this node: the turn is still answered."""
    messages = [user("what do I owe"), {"role": "assistant", "content": "Payment desk here."}]
    assert text_of(await streamed(ScriptedLLM(RULES), messages)) == BALANCE


async def test_actions_come_after_the_reply_as_control_tool_calls() -> None:
    llm = ScriptedLLM(RULES)
    chunks = await streamed(llm, [user("everything please")])
    assert text_of(chunks) == "Bye, transferring."
    last = chunks[-1]
    assert last.finish_reason == "tool_calls" and last.content is None
    assert last.tool_calls is not None
    assert [(c.name, json.loads(c.arguments)) for c in last.tool_calls] == [
        (HANDOVER_TOOL, {"node": "main"}),
        (TRANSFER_TOOL, {"to": "+14155550100"}),
        (HANGUP_TOOL, {}),
    ]
    assert len({c.id for c in last.tool_calls}) == 3


async def test_without_stream_it_answers_a_chat_response() -> None:
    llm = ScriptedLLM(RULES)
    response = await llm.chat(messages=[user("bye now")])
    assert isinstance(response, ChatResponse)
    assert response.content == "Goodbye!"
    assert [c.name for c in response.tool_calls] == [HANGUP_TOOL]
    empty = await llm.chat(messages=[])
    assert empty.content is None and empty.tool_calls == []


def test_words_per_chunk_must_be_positive() -> None:
    with pytest.raises(ValueError, match="words_per_chunk"):
        ScriptedLLM(RULES, words_per_chunk=0)


# -- ConfiguredLLMNode with a ScriptedLLM, in a session of its own -----------------------------


class Conversation:
    """One ConfiguredLLMNode in an AgentSession; events pushed, output read."""

    def __init__(self, node: ConfiguredLLMNode) -> None:
        self.session = AgentSession("scripted")
        self.session.add_node(node)
        self._out = self.session.output_events().__aiter__()

    async def __aenter__(self) -> Conversation:
        await self.session.start()
        assert isinstance(await guard(self._out.__anext__()), SDKAgentReadyEvent)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.session.stop()

    async def say(self, text: str) -> None:
        await self.session.push_event(SDKAgentTranscriptUpdateEvent(role="user", content=text))
        await self.session.push_event(SDKSystemLLMRequestEvent())

    async def until(self, cls: type[SDKEvent]) -> list[SDKEvent]:
        """Output events up to and including the next one of class ``cls``."""
        seen: list[SDKEvent] = []
        while not seen or not isinstance(seen[-1], cls):
            seen.append(await guard(self._out.__anext__()))
        return seen


async def test_node_transfers_after_the_reply() -> None:
    node = ConfiguredLLMNode("main", llm=ScriptedLLM(RULES), prompt="Be brief.")
    async with Conversation(node) as conv:
        await conv.say("get me a human")
        events = await conv.until(SDKAgentTransferConversationEvent)
        kinds = [type(e) for e in events]
        assert kinds.index(SDKAgentLLMResponseEndEvent) < kinds.index(
            SDKAgentTransferConversationEvent
        )
        text = "".join(e.text for e in events if isinstance(e, SDKAgentLLMResponseChunkEvent))
        assert text == "Please hold."
        transfer = events[-1]
        assert isinstance(transfer, SDKAgentTransferConversationEvent)
        assert transfer.transfer_call_number == "+14155550199"
        assert transfer.origin is node
        # the prompt is sent, not stored; the control call is not stored either
        assert node.context.messages == [
            user("get me a human"),
            {"role": "assistant", "content": "Please hold."},
        ]


async def test_node_hangs_up_after_the_reply() -> None:
    node = ConfiguredLLMNode("main", llm=ScriptedLLM(RULES))
    async with Conversation(node) as conv:
        await conv.say("ok bye")
        events = await conv.until(SDKAgentEndCallEvent)
        assert isinstance(events[-2], SDKAgentLLMResponseEndEvent)


async def test_node_on_its_own_greets_on_join_and_answers_every_request() -> None:
    node = ConfiguredLLMNode("main", llm=ScriptedLLM(RULES), greeting="Hello!")
    async with Conversation(node) as conv:
        await conv.session.push_event(SDKSystemUserJoinedEvent())
        speak = (await conv.until(SDKAgentSpeakEvent))[-1]
        assert isinstance(speak, SDKAgentSpeakEvent) and speak.text == "Hello!"
        await conv.say("balance")
        events = await conv.until(SDKAgentLLMResponseEndEvent)
        text = "".join(e.text for e in events if isinstance(e, SDKAgentLLMResponseChunkEvent))
        assert text == BALANCE
