"""The seed document's code (shared/seed/interruption-handling.clean.md), run unchanged against
the SDK, and what its comments promise.

Between the markers below is the seed's code, byte for byte (``test_seed_code_is_verbatim``
checks it against the document when ../shared is present). Around it are only the definitions a
user of the snippets would write: the imports, ``logger``, ``llm``, ``tool_registry`` and a body
for ``MyAgent._generate_normal``; tests subclass the agents where the seed leaves a body out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from nodes import (
    AgentSession,
    OpenAIClient,
    OutputAgentNode,
    SDKAgentErrorEvent,
    SDKAgentLLMResponseChunkEvent,
    SDKAgentLLMResponseEndEvent,
    SDKAgentTranscriptUpdateEvent,
    SDKEvent,
    SDKSystemControlInterruptEvent,
    SDKSystemLLMRequestEvent,
    ToolRegistry,
    function_tool,
)

from ..openai_server import OpenAIServer, Text, ToolCallStep, Wait
from .conftest import guard, setup_with

logger = logging.getLogger("tests.nodes.seed")

llm: OpenAIClient  # set per test by the ``seed_llm`` fixture (the server's port changes)
tool_registry = ToolRegistry()

# ---- seed code, verbatim ----
class MyAgent(OutputAgentNode):
    def __init__(self):
        super().__init__(
            name="my-agent",
            is_interruptible=True  # Default
        )

class PaymentAgent(OutputAgentNode):
    def __init__(self):
        super().__init__(
            name="payment-agent",
            is_interruptible=False  # User must hear the full message
        )

class MyAgent(OutputAgentNode):
    def __init__(self):
        super().__init__(name="my-agent")
        self.was_interrupted = False
        self.pending_message = ""
    async def _handle_interrupt(self):
        """Called when the user interrupts."""
        self.was_interrupted = True
        
        # Clear any pending state
        self.pending_message = ""
        
        # Call parent handler
        await super()._handle_interrupt()
    async def generate_response(self):
        if self.was_interrupted:
            yield "Sorry, I was saying something. What did you need?"
            self.was_interrupted = False
            return
        
        # Normal response generation
        async for chunk in self._generate_normal():
            yield chunk

async def setup(session: AgentSession):
    agent = MyAgent()
    session.add_node(agent)
    await session.start()
    
    @session.on_event("on_event_received")
    async def handle_event(session, event):
        if isinstance(event, SDKSystemControlInterruptEvent):
            # User interrupted
            logger.info("User barge-in detected")
    
    await session.wait_until_complete()

class StatefulAgent(OutputAgentNode):
    def __init__(self):
        super().__init__(name="stateful-agent")
        self.current_task = None
        self.task_progress = 0
    async def _handle_interrupt(self):
        # Save state before handling
        if self.current_task:
            logger.info(
                f"Interrupted during {self.current_task} "
                f"at {self.task_progress}% progress"
            )
        
        await super()._handle_interrupt()
    async def generate_response(self):
        self.current_task = "explaining_policy"
        self.task_progress = 0
        
        yield "Let me explain our return policy. "
        self.task_progress = 25
        
        yield "You have 30 days to return items. "
        self.task_progress = 50
        
        yield "Items must be unused and in original packaging. "
        self.task_progress = 75
        
        yield "Refunds are processed within 5 business days."
        self.task_progress = 100
        self.current_task = None

class ResumableAgent(OutputAgentNode):
    def __init__(self):
        super().__init__(name="resumable-agent")
        self.last_topic = None
        self.interrupted_mid_response = False
    async def _handle_interrupt(self):
        self.interrupted_mid_response = True
        await super()._handle_interrupt()
    async def generate_response(self):
        # Get last user message
        user_msgs = [m for m in self.context.messages if m["role"] == "user"]
        user_message = user_msgs[-1]["content"] if user_msgs else ""
        
        # Check if user wants to continue previous topic
        if self.interrupted_mid_response and "continue" in user_message.lower():
            yield f"Sure, back to {self.last_topic}. "
            # Resume previous topic
            self.interrupted_mid_response = False
            return
        
        self.interrupted_mid_response = False
        # Normal response generation...

class ToolAgent(OutputAgentNode):
    async def generate_response(self):
        # LLM calls a tool
        response = await self.llm.chat(
            messages=self.context.messages,
            tools=self.tool_schemas,
            stream=True
        )
        
        tool_calls = []
        
        async for chunk in response:
            if chunk.content:
                yield chunk.content
            if chunk.tool_calls:
                tool_calls.extend(chunk.tool_calls)
        
        # Tool execution happens after streaming completes
        # If interrupted mid-stream, tools may still execute on next turn
        if tool_calls:
            results = await self.tool_registry.execute(
                tool_calls=tool_calls, parallel=True
            )
            
            self.context.add_messages([
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"id": tc.id, "type": "function", "function": {"name": tc.name, "arguments": str(tc.arguments)}}
                        for tc in tool_calls
                    ],
                },
                *[
                    {"role": "tool", "tool_call_id": tc.id, "content": result.content}
                    for tc, result in zip(tool_calls, results)
                ],
            ])
# ---- end of seed code ----


async def _generate_normal(self: MyAgent) -> AsyncIterator[str]:
    """What a user fills in for the seed's ``self._generate_normal()``: stream from the LLM."""
    response = await llm.chat(messages=self.context.messages, stream=True)
    async for chunk in response:
        if chunk.content:
            yield chunk.content


MyAgent._generate_normal = _generate_normal  # type: ignore[attr-defined]

SEED = Path(__file__).resolve().parents[3] / "shared" / "seed" / "interruption-handling.clean.md"
START, END = "# ---- seed code, verbatim ----\n", "# ---- end of seed code ----\n"


@pytest.fixture
def seed_llm(llm: OpenAIClient) -> OpenAIClient:
    globals()["llm"] = llm
    return llm


class Conversation:
    """Drives an agent's ``setup(session)`` the way the worker does, without a bus."""

    def __init__(self, setup: Any) -> None:
        self.session = AgentSession("test")
        self._setup = setup
        self.seen: list[SDKEvent] = []
        self._task: asyncio.Task[None] | None = None
        self._out = self.session.output_events().__aiter__()

    async def __aenter__(self) -> Conversation:
        self._task = asyncio.create_task(self._setup(self.session))
        ready = asyncio.create_task(self.session.wait_for_setup())
        await guard(asyncio.wait({ready, self._task}, return_when=asyncio.FIRST_COMPLETED))
        assert ready.done(), "setup did not reach wait_until_complete()"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.session.stop()
        assert self._task is not None
        await guard(self._task)

    def node(self, name: str) -> Any:
        node = self.session.get_node(name)
        assert node is not None
        return node

    async def say(self, text: str) -> None:
        await self.session.push_event(SDKAgentTranscriptUpdateEvent(role="user", content=text))
        await self.session.push_event(SDKSystemLLMRequestEvent())

    async def interrupt(self) -> None:
        await self.session.push_event(SDKSystemControlInterruptEvent())

    async def next(self, cls: type[SDKEvent]) -> Any:
        """The next output event of class ``cls``; everything read is kept in ``seen``."""
        async with asyncio.timeout(10):
            while True:
                event = await self._out.__anext__()
                self.seen.append(event)
                if isinstance(event, cls):
                    return event

    async def response(self) -> str:
        """Read to the end of the current response; returns its text."""
        texts = []
        while True:
            event = await self.next(SDKEvent)
            if isinstance(event, SDKAgentLLMResponseChunkEvent):
                texts.append(event.text)
            elif isinstance(event, SDKAgentLLMResponseEndEvent):
                return "".join(texts)

    def chunks(self) -> list[str]:
        return [e.text for e in self.seen if isinstance(e, SDKAgentLLMResponseChunkEvent)]


def test_seed_code_is_verbatim() -> None:
    if not SEED.exists():
        pytest.skip(f"seed document not found at {SEED}")
    document = SEED.read_text()
    seed_code = document.split("```python\n", 1)[1].split("```", 1)[0]
    source = Path(__file__).read_text()
    here = source.split(START, 1)[1].split(END, 1)[0]
    assert here == seed_code


# -- MyAgent + setup: barge-in detected, generation cancelled, apology next turn -----------------


async def test_my_agent_apologises_after_an_interrupt(
    seed_llm: OpenAIClient, openai_server: OpenAIServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=logger.name)
    gate = asyncio.Event()
    reply = openai_server.respond(Text("Our opening hours are"), Wait(gate), Text(" nine to five."))

    async with Conversation(setup) as conv:
        agent = conv.node("my-agent")
        assert isinstance(agent, MyAgent) and agent.is_interruptible
        await conv.say("When are you open?")
        first = await conv.next(SDKAgentLLMResponseChunkEvent)
        assert first.text == "Our opening hours are"

        await conv.interrupt()  # returns once the generation is cancelled
        assert agent.was_interrupted and agent.pending_message == ""
        await guard(reply.disconnected.wait())  # the LLM's HTTP stream was closed mid-way
        assert not reply.finished.is_set()
        end = await conv.next(SDKAgentLLMResponseEndEvent)
        assert end.request_id == first.request_id
        await conv.session.wait_for_event_handlers()
        assert "User barge-in detected" in caplog.messages

        await conv.say("Sorry, what?")
        assert await conv.response() == "Sorry, I was saying something. What did you need?"
        assert not agent.was_interrupted
        assert len(openai_server.requests) == 1  # the apology needed no LLM call
        assert " nine to five." not in conv.chunks()
        assert [m["role"] for m in agent.context.messages] == [
            "user",
            "assistant",
            "user",
            "assistant",
        ]
        assert agent.context.messages[1]["content"] == "Our opening hours are"


async def test_my_agent_without_interrupt_streams_the_llm(
    seed_llm: OpenAIClient, openai_server: OpenAIServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=logger.name)
    openai_server.respond(Text("We open"), Text(" at nine."))
    async with Conversation(setup) as conv:
        await conv.say("When are you open?")
        assert await conv.response() == "We open at nine."
        await conv.session.wait_for_event_handlers()
    assert openai_server.requests[0].body["messages"] == [
        {"role": "user", "content": "When are you open?"}
    ]
    assert "User barge-in detected" not in caplog.messages


# -- PaymentAgent: is_interruptible=False, the message is produced in full ----------------------


class CardPayment(PaymentAgent):
    """The seed's PaymentAgent with a body (the seed leaves generate_response out)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.interrupts_received = 0
        self.interrupt_handled = False

    async def process_event(self, event: SDKEvent) -> None:
        if isinstance(event, SDKSystemControlInterruptEvent):
            self.interrupts_received += 1
        await super().process_event(event)

    async def _handle_interrupt(self) -> None:
        self.interrupt_handled = True
        await super()._handle_interrupt()

    async def generate_response(self) -> AsyncIterator[str]:
        yield "Your card ending 4242 will be charged 20 dollars. "
        await self.gate.wait()
        yield "Say yes to confirm."


async def test_payment_agent_is_never_cancelled() -> None:
    agent = CardPayment()
    assert agent.name == "payment-agent" and not agent.is_interruptible

    payment_setup = setup_with(lambda: agent)

    async with Conversation(payment_setup) as conv:
        await conv.say("I want to pay my bill")
        await conv.next(SDKAgentLLMResponseChunkEvent)
        await conv.interrupt()  # the caller talks over the disclosure
        assert agent.interrupts_received == 1
        assert not agent.interrupt_handled
        agent.gate.set()
        rest = await conv.response()
    assert rest == "Say yes to confirm."
    assert conv.chunks() == [
        "Your card ending 4242 will be charged 20 dollars. ",
        "Say yes to confirm.",
    ]
    assert not any(isinstance(e, SDKAgentErrorEvent) for e in conv.seen)
    assert agent.context.messages[-1] == {
        "role": "assistant",
        "content": "Your card ending 4242 will be charged 20 dollars. Say yes to confirm.",
    }


# -- StatefulAgent: logs task and progress at the interrupt -------------------------------------


@contextlib.asynccontextmanager
async def asked_for_the_return_policy(
    caplog: pytest.LogCaptureFixture,
) -> AsyncIterator[tuple[Conversation, Any]]:
    """A conversation with the StatefulAgent (its log read at INFO), just asked for the return
    policy; yields it and the agent."""
    caplog.set_level(logging.INFO, logger=logger.name)
    async with Conversation(setup_with(StatefulAgent)) as conv:
        agent = conv.node("stateful-agent")
        await conv.say("What's your return policy?")
        yield conv, agent


async def test_stateful_agent_logs_progress_at_the_interrupt(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with asked_for_the_return_policy(caplog) as (conv, agent):
        # The consumer has taken the first sentence; the node waits to hand over the second.
        first = await conv.next(SDKAgentLLMResponseChunkEvent)
        assert first.text == "Let me explain our return policy. "
        await conv.interrupt()
        await conv.next(SDKAgentLLMResponseEndEvent)
    assert "Interrupted during explaining_policy at 25% progress" in caplog.messages
    assert conv.chunks() == ["Let me explain our return policy. "]
    assert agent.current_task == "explaining_policy"  # cancelled before it finished
    # the sentence it was holding when cancelled was never said, so it is not in the context
    assert agent.context.messages[-1] == {
        "role": "assistant",
        "content": "Let me explain our return policy. ",
    }


async def test_stateful_agent_uninterrupted_logs_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with asked_for_the_return_policy(caplog) as (conv, agent):
        text = await conv.response()
        assert text.endswith("Refunds are processed within 5 business days.")
        assert agent.task_progress == 100 and agent.current_task is None
        await conv.interrupt()  # after the response: nothing in progress to report
    assert not any(m.startswith("Interrupted during") for m in caplog.messages)


# -- ResumableAgent: "continue" resumes the interrupted topic -----------------------------------


class ReturnsAgent(ResumableAgent):
    """The seed's ResumableAgent with its "Normal response generation..." filled in."""

    async def generate_response(self) -> AsyncIterator[str]:
        resumed = False
        async for chunk in super().generate_response():
            resumed = True
            yield chunk
        if resumed:
            return
        self.last_topic = "our return policy"
        yield "Our return policy is simple. "
        yield "You have 30 days to return items."


resumable_setup = setup_with(ReturnsAgent)


async def test_resumable_agent_resumes_on_continue() -> None:
    async with Conversation(resumable_setup) as conv:
        agent = conv.node("resumable-agent")
        await conv.say("Tell me about returns")
        await conv.next(SDKAgentLLMResponseChunkEvent)
        await conv.interrupt()
        await conv.next(SDKAgentLLMResponseEndEvent)
        assert agent.interrupted_mid_response
        await conv.say("Sorry, please continue")
        assert await conv.response() == "Sure, back to our return policy. "
        assert not agent.interrupted_mid_response
        await conv.say("Can I continue to shop online?")  # not interrupted this time
        assert await conv.response() == (
            "Our return policy is simple. You have 30 days to return items."
        )


# -- ToolAgent: streams text, runs the tools in parallel, adds the tool messages -----------------

both_in_flight: asyncio.Barrier
tool_log: list[str] = []


@function_tool
async def get_balance(account: str) -> dict[str, Any]:
    """Look up the balance of one of the caller's accounts.

    Args:
        account: Which account: checking or savings.
    """
    tool_log.append(f"start {account}")
    # Passes only when both calls are in flight together: run one after the other, the first
    # would wait here forever (and the guard turns that into an error result).
    async with asyncio.timeout(10):
        await both_in_flight.wait()
    tool_log.append(f"end {account}")
    return {"account": account, "balance": {"checking": 120, "savings": 5000}[account]}


tool_registry.register(get_balance)


def make_tool_agent(client: OpenAIClient) -> ToolAgent:
    agent = ToolAgent(name="tool-agent")
    agent.llm = client  # type: ignore[attr-defined]
    agent.tool_registry = tool_registry  # type: ignore[attr-defined]
    agent.tool_schemas = tool_registry.get_schemas()  # type: ignore[attr-defined]
    return agent


async def test_tool_agent_streams_then_runs_tools_in_parallel(
    llm: OpenAIClient, openai_server: OpenAIServer
) -> None:
    global both_in_flight
    both_in_flight = asyncio.Barrier(2)
    tool_log.clear()
    openai_server.respond(
        Text("Let me check"),
        Text(" both accounts."),
        ToolCallStep("call_chk", "get_balance", '{"account": "checking"}', pieces=3),
        ToolCallStep("call_sav", "get_balance", '{"account": "savings"}'),
    )
    agent = make_tool_agent(llm)

    tool_setup = setup_with(lambda: agent)

    async with Conversation(tool_setup) as conv:
        await conv.say("What are my balances?")
        assert await conv.response() == "Let me check both accounts."
        assert tool_log[:2] == ["start checking", "start savings"]
        assert sorted(tool_log[2:]) == ["end checking", "end savings"]

        body = openai_server.requests[0].body
        assert body["stream"] is True
        assert body["tools"] == [
            {
                "type": "function",
                "function": {
                    "name": "get_balance",
                    "description": "Look up the balance of one of the caller's accounts.",
                    "parameters": {
                        "type": "object",
                        "properties": {
                            "account": {
                                "type": "string",
                                "description": "Which account: checking or savings.",
                            }
                        },
                        "required": ["account"],
                    },
                },
            }
        ]
        messages = agent.context.messages
        assert messages[0] == {"role": "user", "content": "What are my balances?"}
        assert messages[1] == {"role": "assistant", "content": "Let me check both accounts."}
        assert messages[2]["role"] == "assistant" and messages[2]["content"] == ""
        assert [c["id"] for c in messages[2]["tool_calls"]] == ["call_chk", "call_sav"]
        assert json.loads(messages[2]["tool_calls"][0]["function"]["arguments"]) == {
            "account": "checking"
        }
        assert messages[3] == {
            "role": "tool",
            "tool_call_id": "call_chk",
            "content": '{"account": "checking", "balance": 120}',
        }
        assert messages[4]["tool_call_id"] == "call_sav"
        assert json.loads(messages[4]["content"]) == {"account": "savings", "balance": 5000}

        # The next turn sends the tool results back; the server checks each tool message
        # answers the assistant's tool_calls (a 400 would surface as an agent.error).
        openai_server.respond(Text("Checking has 120 dollars and savings 5000."))
        await conv.say("Thanks, so?")
        assert await conv.response() == "Checking has 120 dollars and savings 5000."
        assert not any(isinstance(e, SDKAgentErrorEvent) for e in conv.seen)
        sent = openai_server.requests[1].body["messages"]
        assert [m["role"] for m in sent] == ["user", "assistant", "assistant", "tool", "tool", "user"]


async def test_tool_agent_interrupt_cancels_unfinished_tools(
    llm: OpenAIClient, openai_server: OpenAIServer
) -> None:
    started = asyncio.Event()
    cancelled: list[str] = []

    @function_tool
    async def slow_lookup(query: str) -> str:
        """Look something up slowly.

        Args:
            query: What to look up.
        """
        started.set()
        try:
            await asyncio.Event().wait()  # never finishes on its own
        except asyncio.CancelledError:
            cancelled.append(query)
            raise
        return "unreachable"

    registry = ToolRegistry()
    registry.register(slow_lookup)
    openai_server.respond(Text("One moment."), ToolCallStep("call_1", "slow_lookup", '{"query": "x"}'))
    agent = make_tool_agent(llm)
    agent.tool_registry = registry  # type: ignore[attr-defined]
    agent.tool_schemas = registry.get_schemas()  # type: ignore[attr-defined]

    tool_setup = setup_with(lambda: agent)

    async with Conversation(tool_setup) as conv:
        await conv.say("Look it up")
        await conv.next(SDKAgentLLMResponseChunkEvent)
        await guard(started.wait())
        await conv.interrupt()
        assert cancelled == ["x"]
        await conv.next(SDKAgentLLMResponseEndEvent)
    assert [m["role"] for m in agent.context.messages] == ["user", "assistant"]
