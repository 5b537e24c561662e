"""Agents built from YAML, run by a SessionWorker on the embedded bus, driven by a fake gateway:
the shipped config/agents.yaml, handover to a non-interruptible node, Python node refs, an
``openai`` node against the local OpenAI-compatible server, and config reload between calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest

from bus import Bus, CallInfo, EmbeddedBus, Event
from config import DEFAULT_CONFIG, Config, ConfigHolder, load_config, parse_config
from nodes import (
    AgentLoadError,
    AgentSession,
    ConfiguredLLMNode,
    Node,
    OutputAgentNode,
    SessionWorker,
    SDKAgentTranscriptUpdateEvent,
    SDKEvent,
    SetupFn,
    ToneSynthesizer,
    agent_factory_from_config,
    function_tool,
    setup_from_config,
)

from ..openai_server import OpenAIServer, Text, ToolCallStep, Wait
from .conftest import Line, guard, open_line
from .conftest import running as running_worker

MS_PER_CHAR = 2
HERE = "tests.nodes.test_agents_from_config"


# -- what the YAML of these tests refers to ----------------------------------------------------


class EchoNode(OutputAgentNode):
    """Repeats the caller's last message after a prefix."""

    greeting = "Echo here."

    def __init__(self, prefix: str = "") -> None:
        super().__init__(name="echo-class")
        self.prefix = prefix

    async def generate_response(self) -> AsyncIterator[str]:
        said = [m["content"] for m in self.context.messages if m["role"] == "user"]
        yield self.prefix + (said[-1] if said else "")


async def echo_setup(session: AgentSession, prefix: str = "") -> None:
    """An agent as a setup function."""
    session.add_node(EchoNode(prefix))
    await session.start()
    await session.wait_until_complete()


class Counter(Node):
    """A plain node: it does not speak."""


class Spy(Node):
    """Tells the test when a caller's message has passed through its parent."""

    seen: ClassVar[dict[str, asyncio.Event]] = {}

    @classmethod
    def passed(cls, text: str) -> asyncio.Event:
        return cls.seen.setdefault(text, asyncio.Event())

    async def process_event(self, event: SDKEvent) -> None:
        await super().process_event(event)
        if isinstance(event, SDKAgentTranscriptUpdateEvent):
            self.passed(event.content).set()
        await self.send_event(event)


class NotANode:
    pass


class AlwaysFirm(EchoNode):
    @property
    def is_interruptible(self) -> bool:
        return False


def lookup_balance(account: str) -> str:
    """The balance of an account (a plain function: no @function_tool).

    Args:
        account: The account number.
    """
    return f"account {account}: $42.17"


@function_tool
def opening_hours() -> str:
    """Our opening hours."""
    return "nine to five"


# -- harness -----------------------------------------------------------------------------------


class HeldSynthesizer:
    """ToneSynthesizer that holds the synthesis of texts starting with a prefix until released."""

    def __init__(self) -> None:
        self._tone = ToneSynthesizer(MS_PER_CHAR)
        self._holds: dict[str, asyncio.Event] = {}

    def hold(self, prefix: str) -> asyncio.Event:
        release = self._holds[prefix] = asyncio.Event()
        return release

    async def synthesize(self, text: str) -> AsyncIterator[bytes]:
        for prefix, release in self._holds.items():
            if text.startswith(prefix):
                await release.wait()
        async for piece in self._tone.synthesize(text):
            yield piece


class AckedBus(EmbeddedBus):
    """An EmbeddedBus that tells when the worker has acked (handled) an uplink event."""

    def __init__(self) -> None:
        super().__init__()
        self._eids: dict[str, str] = {}
        self._acked: set[str] = set()
        self._changed = asyncio.Condition()

    async def uplink(self, call_sid: str, worker_id: str) -> AsyncIterator[Any]:
        async for message in super().uplink(call_sid, worker_id):
            self._eids[message.id] = str(message.event.get("eid"))
            yield message

    async def ack(self, call_sid: str, message_id: str) -> None:
        await super().ack(call_sid, message_id)
        async with self._changed:
            self._acked.add(self._eids.get(message_id, ""))
            self._changed.notify_all()

    async def wait_acked(self, eid: str) -> None:
        async with self._changed:
            await guard(self._changed.wait_for(lambda: eid in self._acked))


@contextlib.asynccontextmanager
async def running(
    bus: Bus, agent_factory: Callable[[CallInfo], SetupFn], synthesizer: Any = None
) -> AsyncIterator[SessionWorker]:
    async with running_worker(bus, agent_factory, worker_id="w-config",
                              synthesizer=synthesizer or ToneSynthesizer(MS_PER_CHAR)) as worker:
        yield worker


async def utterance(line: Line, **match: Any) -> tuple[Event, Event]:
    """The next utterance's start and end."""
    start = await line.next("utterance_start", **match)
    end = await line.next("utterance_end", utterance_id=start["utterance_id"])
    return start, end


def said(events: list[Event]) -> list[tuple[str, bool, str]]:
    """(node, interruptible, text) of every utterance on a whole downlink."""
    starts = {e["utterance_id"]: e for e in events if e["type"] == "utterance_start"}
    return [
        (starts[e["utterance_id"]]["node"], starts[e["utterance_id"]]["interruptible"], e["text"])
        for e in events
        if e["type"] == "utterance_end"
    ]


def audio_ms(line: Line, utterance_id: str) -> float:
    return sum(e["duration_ms"] for e in line.of("audio") if e["utterance_id"] == utterance_id)


@pytest.fixture
def shipped() -> Config:
    return load_config(DEFAULT_CONFIG, env={})


def rules(cfg: Config) -> dict[str, str]:
    """The support agent's rule replies by first keyword."""
    return {r.keywords[0]: r.reply or "" for r in cfg.agents["support"].script}


# -- the shipped config ------------------------------------------------------------------------


async def test_shipped_config_greets_then_answers_the_balance(bus: Bus, shipped: Config) -> None:
    agent = shipped.agents["support"]
    async with running(bus, lambda call: setup_from_config(agent)) as worker:
        line = await open_line(bus, "CA3001", agent="support", to_number="+14155550100")
        await line.publish({"type": "call_started", "agent": "support"})
        await line.publish({"type": "transcript", "text": "I want to check my balance",
                            "final": True})  # fmt: skip
        greeting, greeting_end = await utterance(line)
        assert greeting == {**greeting, "node": "main", "interruptible": True,
                            "text": agent.greeting}  # fmt: skip
        assert greeting_end["text"] == agent.greeting
        reply, reply_end = await utterance(line)
        assert reply["node"] == "main" and reply["interruptible"] is True
        assert reply_end == {**reply_end, "interrupted": False, "text": rules(shipped)["balance"]}
        # streamed in a few word chunks, each synthesized as it came
        uid = reply["utterance_id"]
        chunks = {e["text_start"] for e in line.of("audio") if e["utterance_id"] == uid}
        assert len(chunks) > 1
        assert audio_ms(line, reply["utterance_id"]) == len(reply_end["text"]) * MS_PER_CHAR
        events = await line.end(worker)
    assert said(events) == [
        ("main", True, agent.greeting),
        ("main", True, rules(shipped)["balance"]),
    ]
    saved = await bus.load_context("CA3001")
    assert saved is not None
    assert saved["nodes"]["main"] == [
        {"role": "assistant", "content": agent.greeting},
        {"role": "user", "content": "I want to check my balance"},
        {"role": "assistant", "content": rules(shipped)["balance"]},
    ]


async def test_payment_handover_is_not_interruptible(shipped: Config) -> None:
    agent = shipped.agents["support"]
    payment = agent.node("payment")
    assert payment is not None and payment.greeting is not None
    synth = HeldSynthesizer()
    release = synth.hold(payment.greeting[:20])
    bus = AckedBus()
    try:
        async with running(bus, lambda call: setup_from_config(agent), synth) as worker:
            line = await open_line(bus, "CA3002", agent="support")
            await line.publish({"type": "call_started"})
            await utterance(line)  # the greeting
            await line.publish({"type": "transcript", "text": "I'd like to pay my bill"})
            sure, sure_end = await utterance(line)
            assert (sure["node"], sure_end["text"]) == ("main", rules(shipped)["pay"])

            # main handed over: the payment node speaks its disclosure at once, as itself
            disclosure = await line.next("utterance_start")
            uid = disclosure["utterance_id"]
            assert disclosure == {**disclosure, "node": "payment", "interruptible": False,
                                  "text": payment.greeting}  # fmt: skip
            # the caller talks over it (the gateway would not even send this) while the audio
            # is still being made: nothing is cut
            eid = await line.publish({"type": "interrupt", "utterance_id": uid, "heard_ms": 40,
                                      "node": "payment", "reason": "barge_in"})  # fmt: skip
            await bus.wait_acked(eid)
            release.set()
            end = await line.next("utterance_end", utterance_id=uid)
            assert end == {**end, "interrupted": False, "text": payment.greeting}
            assert audio_ms(line, uid) == len(payment.greeting) * MS_PER_CHAR
            node = worker.sessions["CA3002"].get_node("payment")
            assert isinstance(node, ConfiguredLLMNode)
            assert node.context.messages[-1] == {"role": "assistant", "content": payment.greeting}

            # the payment node has the conversation now: its own rules answer
            await line.publish({"type": "transcript", "text": "five five five five"})
            start, end = await utterance(line)
            assert (start["node"], start["interruptible"], end["text"]) == (
                "payment", False, payment.fallback)  # fmt: skip
            await line.publish({"type": "transcript", "text": "cancel"})
            start, end = await utterance(line)
            assert (start["node"], end["text"]) == ("payment", payment.script[0].reply)
            # ... which hands back to main (no greeting, nothing to say until the caller speaks)
            await line.publish({"type": "transcript", "text": "what do I owe"})
            start, end = await utterance(line)
            assert (start["node"], start["interruptible"], end["text"]) == (
                "main", True, rules(shipped)["balance"])  # fmt: skip
            events = await line.end(worker)
        assert [node for node, _, _ in said(events)] == [
            "main", "main", "payment", "payment", "payment", "main"]  # fmt: skip
    finally:
        await bus.aclose()


async def test_handover_in_the_first_turn_greets_once(bus: Bus, shipped: Config) -> None:
    """The payment node, downstream of main, sees the join only after main handed over."""
    agent = shipped.agents["support"]
    async with running(bus, lambda call: setup_from_config(agent)) as worker:
        line = await open_line(bus, "CA3005")
        await line.publish({"type": "call_started"})
        await line.publish({"type": "transcript", "text": "pay my bill"})
        for _ in range(3):
            await utterance(line)
        events = await line.end(worker)
    payment = agent.node("payment")
    assert payment is not None
    assert said(events) == [
        ("main", True, agent.greeting),
        ("main", True, rules(shipped)["pay"]),
        ("payment", False, payment.greeting),
    ]


async def test_an_interrupt_cuts_the_interruptible_main_node(shipped: Config) -> None:
    """The contrast to the payment node: the same interrupt cuts main's reply."""
    agent = shipped.agents["support"]
    synth = HeldSynthesizer()
    release = synth.hold("Your balance")
    bus = AckedBus()
    try:
        async with running(bus, lambda call: setup_from_config(agent), synth) as worker:
            line = await open_line(bus, "CA3003", agent="support")
            await line.publish({"type": "transcript", "text": "balance please"})
            start = await line.next("utterance_start")
            eid = await line.publish({"type": "interrupt", "utterance_id": start["utterance_id"],
                                      "heard_ms": 0})  # fmt: skip
            await bus.wait_acked(eid)
            release.set()
            end = await line.next("utterance_end", utterance_id=start["utterance_id"])
            assert end["interrupted"] is True
            assert audio_ms(line, start["utterance_id"]) == 0
            await line.end(worker)
    finally:
        await bus.aclose()


async def test_transfer_and_hangup_follow_their_reply(bus: Bus, shipped: Config) -> None:
    agent = shipped.agents["support"]
    async with running(bus, lambda call: setup_from_config(agent)) as worker:
        line = await open_line(bus, "CA3004")
        await line.publish({"type": "transcript", "text": "can I talk to a human"})
        await line.next("transfer", to="+14155550199")
        await line.publish({"type": "transcript", "text": "ok bye"})
        await line.next("hangup")
        events = await line.end(worker)
    kinds = [e["type"] for e in events if e["type"] in ("utterance_end", "transfer", "hangup")]
    assert kinds == ["utterance_end", "transfer", "utterance_end", "hangup"]
    assert said(events) == [("main", True, rules(shipped)["agent"]),
                            ("main", True, rules(shipped)["bye"])]  # fmt: skip


# -- python nodes ------------------------------------------------------------------------------

PYTHON_AGENTS = f"""
default_agent: parrot
agents:
  parrot:
    greeting: "Hello from the class."
    nodes:
      - kind: python
        name: parrot
        ref: {HERE}:EchoNode
        interruptible: false
        args: {{prefix: "You said: "}}
  function:
    greeting: "Not used: the function is the agent."
    nodes:
      - kind: python
        name: whole-agent
        ref: {HERE}:echo_setup
        args: {{prefix: "Function heard: "}}
  mixed:
    greeting: "Mixed agent."
    llm: {{provider: scripted}}
    nodes:
      - {{kind: llm, name: main}}
      - kind: python
        name: card
        ref: {HERE}:EchoNode
        interruptible: false
        args: {{prefix: "Card desk heard: "}}
      - {{kind: python, name: counter, ref: "{HERE}:Counter"}}
    edges: [[main, card], [main, counter]]
    script:
      - keywords: [card]
        reply: "Passing you to the card desk."
        goto: card
    fallback: "Main does not know."
"""


async def talk(bus: Bus, setup: SetupFn, call_sid: str, *texts: str) -> list[Event]:
    """Join, say each text once the previous answer has ended; the whole downlink."""
    async with running(bus, lambda call: setup) as worker:
        line = await open_line(bus, call_sid)
        await line.publish({"type": "call_started"})
        await utterance(line)
        for text in texts:
            await line.publish({"type": "transcript", "text": text})
            await utterance(line)
        return await line.end(worker)


async def test_python_class_node(bus: Bus) -> None:
    agent = parse_config(PYTHON_AGENTS, env={}).agents["parrot"]
    events = await talk(bus, setup_from_config(agent), "CA3101", "hello")
    assert said(events) == [
        ("parrot", False, "Hello from the class."),  # the agent's greeting, the YAML's flag
        ("parrot", False, "You said: hello"),  # args, and the YAML's name
    ]


async def test_python_setup_function_is_the_agent(bus: Bus) -> None:
    agent = parse_config(PYTHON_AGENTS, env={}).agents["function"]
    events = await talk(bus, setup_from_config(agent), "CA3102", "hello")
    assert said(events) == [
        ("echo-class", True, "Echo here."),
        ("echo-class", True, "Function heard: hello"),
    ]


async def test_handover_to_a_python_class_node(bus: Bus) -> None:
    agent = parse_config(PYTHON_AGENTS, env={}).agents["mixed"]
    async with running(bus, lambda call: setup_from_config(agent)) as worker:
        line = await open_line(bus, "CA3103")
        await line.publish({"type": "call_started"})
        await utterance(line)
        await line.publish({"type": "transcript", "text": "my card please"})
        await utterance(line)
        start, _ = await utterance(line)  # the class node takes over with its own greeting
        assert start["node"] == "card"
        await line.publish({"type": "transcript", "text": "1234"})
        await utterance(line)
        events = await line.end(worker)
    assert said(events) == [
        ("main", True, "Mixed agent."),
        ("main", True, "Passing you to the card desk."),
        ("card", False, "Echo here."),
        ("card", False, "Card desk heard: 1234"),  # main, no longer active, stays silent
    ]


@pytest.mark.parametrize(
    ("yaml_nodes", "message"),
    [
        (f"[{{kind: python, name: a, ref: '{HERE}:echo_setup'}}, {{kind: llm, name: b}}]",
         "setup function must be the agent's only node"),
        (f"[{{kind: python, name: a, ref: '{HERE}:NotANode'}}]", "not a nodes.Node subclass"),
        (f"[{{kind: python, name: a, ref: '{HERE}:EchoNode', args: {{colour: red}}}}]",
         "does not take these args"),
        (f"[{{kind: python, name: a, ref: '{HERE}:echo_setup', args: {{colour: red}}}}]",
         "does not take these args"),
        (f"[{{kind: python, name: a, ref: '{HERE}:echo_setup', interruptible: false}}]",
         "`interruptible` applies to a Node class"),
        (f"[{{kind: python, name: a, ref: '{HERE}:Counter'}}]", "no node speaks"),
        (f"[{{kind: python, name: a, ref: '{HERE}:AlwaysFirm', interruptible: true}}]",
         "defines is_interruptible itself"),
    ],
)  # fmt: skip
def test_bad_python_nodes_fail_when_the_agent_is_built(yaml_nodes: str, message: str) -> None:
    text = f"""
default_agent: a
agents:
  a:
    llm: {{provider: scripted}}
    nodes: {yaml_nodes}
"""
    agent = parse_config(text, env={}).agents["a"]
    with pytest.raises(AgentLoadError, match=message):
        setup_from_config(agent)


def test_goto_must_name_a_node_that_speaks() -> None:
    text = f"""
default_agent: a
agents:
  a:
    llm: {{provider: scripted}}
    nodes: [{{kind: llm, name: main}}, {{kind: python, name: count, ref: '{HERE}:Counter'}}]
    script: [{{keywords: [x], goto: count}}]
"""
    with pytest.raises(AgentLoadError, match="goto 'count' names a node that does not speak"):
        setup_from_config(parse_config(text, env={}).agents["a"])


# -- an openai node ----------------------------------------------------------------------------


def openai_agent(server: OpenAIServer) -> Config:
    text = f"""
default_agent: gpt
agents:
  gpt:
    greeting: "Hi, this is the model."
    llm:
      provider: openai
      model: gpt-test
      base_url: {server.base_url}
      api_key: ${{OPENAI_API_KEY}}
      prompt: "You are Acme's assistant."
      tools: ["{HERE}:lookup_balance", "{HERE}:opening_hours"]
"""
    return parse_config(text, env={"OPENAI_API_KEY": "sk-test"})


async def test_openai_node_streams_the_model_reply(
    bus: Bus, openai_server: OpenAIServer
) -> None:
    agent = openai_agent(openai_server).agents["gpt"]
    openai_server.respond(Text("We are open"), Text(" nine to five."))
    events = await talk(bus, setup_from_config(agent), "CA3201", "When are you open?")
    assert said(events) == [
        ("main", True, "Hi, this is the model."),
        ("main", True, "We are open nine to five."),
    ]
    body = openai_server.requests[0].body
    assert body["model"] == "gpt-test" and body["stream"] is True
    assert body["messages"] == [
        {"role": "system", "content": "You are Acme's assistant."},
        {"role": "assistant", "content": "Hi, this is the model."},
        {"role": "user", "content": "When are you open?"},
    ]
    assert [t["function"]["name"] for t in body["tools"]] == ["lookup_balance", "opening_hours"]
    assert openai_server.requests[0].headers["Authorization"] == "Bearer sk-test"


async def test_openai_node_runs_tools_and_answers_with_their_results(
    bus: Bus, openai_server: OpenAIServer
) -> None:
    agent = openai_agent(openai_server).agents["gpt"]
    openai_server.respond(
        Text("Let me look. "), ToolCallStep("call_1", "lookup_balance", '{"account": "7"}')
    )
    openai_server.respond(Text("You owe"), Text(" 42 dollars."))
    events = await talk(bus, setup_from_config(agent), "CA3202", "What do I owe?")
    assert said(events)[-1] == ("main", True, "Let me look. You owe 42 dollars.")
    second = openai_server.requests[1].body["messages"]
    assert second[2:] == [
        {"role": "user", "content": "What do I owe?"},
        {
            "role": "assistant",
            "content": "Let me look. ",
            "tool_calls": [{"id": "call_1", "type": "function",
                            "function": {"name": "lookup_balance",
                                         "arguments": json.dumps({"account": "7"})}}],
        },  # fmt: skip
        {"role": "tool", "tool_call_id": "call_1", "content": "account 7: $42.17"},
    ]
    saved = await bus.load_context("CA3202")
    assert saved is not None
    assert [m["role"] for m in saved["nodes"]["main"]] == [
        "assistant", "user", "assistant", "tool", "assistant"]  # fmt: skip
    assert saved["nodes"]["main"][-1]["content"] == "Let me look. You owe 42 dollars."


async def test_openai_node_hands_over_when_the_model_calls_the_handover_tool(
    bus: Bus, openai_server: OpenAIServer
) -> None:
    cfg = parse_config(
        f"""
default_agent: desk
agents:
  desk:
    llm: {{provider: openai, model: gpt-test, base_url: {openai_server.base_url},
           api_key: "${{OPENAI_API_KEY}}", prompt: "You are the front desk."}}
    nodes:
      - {{kind: llm, name: main}}
      - {{kind: llm, name: billing, prompt: "You are billing.", model: gpt-billing}}
""",
        env={"OPENAI_API_KEY": "sk-test"},
    )
    openai_server.respond(
        Text("Let me get billing."), ToolCallStep("c1", "callgate_handover", '{"node": "billing"}')
    )
    openai_server.respond(Text("Billing here. Which invoice?"))
    openai_server.respond(Text("Fixed."))
    async with running(bus, lambda call: setup_from_config(cfg.agents["desk"])) as worker:
        line = await open_line(bus, "CA3204")
        await line.publish({"type": "transcript", "text": "my invoice is wrong"})
        await utterance(line)
        await utterance(line)  # billing, without a greeting, answers at once
        await line.publish({"type": "transcript", "text": "number 12"})
        await utterance(line)
        events = await line.end(worker)
    assert said(events) == [
        ("main", True, "Let me get billing."),
        ("billing", True, "Billing here. Which invoice?"),
        ("billing", True, "Fixed."),
    ]
    entry, after = openai_server.requests[1].body, openai_server.requests[2].body
    assert entry["model"] == "gpt-billing"
    assert entry["messages"] == [
        {"role": "system", "content": "You are billing."},
        {"role": "user", "content": "my invoice is wrong"},
        {"role": "assistant", "content": "Let me get billing."},
        {"role": "system", "content": "The conversation was handed over to you from main."},
    ]
    assert after["messages"][0] == {"role": "system", "content": "You are billing."}
    assert after["messages"][-1] == {"role": "user", "content": "number 12"}
    saved = await bus.load_context("CA3204")
    assert saved is not None  # the handover call is no message; the note is not kept
    assert [m["role"] for m in saved["nodes"]["billing"]] == [
        "user", "assistant", "assistant", "user", "assistant"]  # fmt: skip


async def test_a_caller_message_joins_the_conversation_after_the_reply_in_progress(
    bus: Bus, openai_server: OpenAIServer
) -> None:
    """Two sibling nodes: the idle one sees the caller's next message while the active one is
    still waiting for its first token; the message still goes after the active node's reply."""
    cfg = parse_config(
        f"""
default_agent: duo
agents:
  duo:
    llm: {{provider: openai, model: gpt-test, base_url: {openai_server.base_url},
           api_key: "${{OPENAI_API_KEY}}"}}
    nodes:
      - {{kind: llm, name: main}}
      - {{kind: llm, name: side}}
      - {{kind: python, name: spy, ref: "{HERE}:Spy"}}
    edges: [[side, spy]]
""",
        env={"OPENAI_API_KEY": "sk-test"},
    )
    gate = asyncio.Event()
    first = openai_server.respond(Wait(gate), Text("First answer."))
    openai_server.respond(Text("Second answer."))
    second_passed = Spy.passed("second (CA3203)")
    async with running(bus, lambda call: setup_from_config(cfg.agents["duo"])) as worker:
        line = await open_line(bus, "CA3203")
        await line.publish({"type": "transcript", "text": "first"})
        await guard(first.started.wait())
        await line.publish({"type": "transcript", "text": "second (CA3203)"})
        await guard(second_passed.wait())  # the idle node has handled it
        gate.set()
        await utterance(line)
        await utterance(line)
        events = await line.end(worker)
    assert said(events) == [("main", True, "First answer."), ("main", True, "Second answer.")]
    assert openai_server.requests[1].body["messages"] == [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "First answer."},
        {"role": "user", "content": "second (CA3203)"},
    ]


# -- the agent of each call, and reload --------------------------------------------------------

RELOADED = """
default_agent: desk
numbers: {{"+14155550123": other}}
agents:
  desk:
    greeting: "{greeting}"
    llm: {{provider: scripted}}
    script: [{{keywords: [balance], reply: "{reply}"}}]
  other:
    greeting: "The other agent."
    llm: {{provider: scripted}}
"""


def write_config(path: Path, greeting: str, reply: str) -> None:
    path.write_text(RELOADED.format(greeting=greeting, reply=reply), encoding="utf-8")


async def test_reload_applies_to_the_next_call_only(bus: Bus, tmp_path: Path) -> None:
    path = tmp_path / "agents.yaml"
    write_config(path, "Old greeting.", "Old balance.")
    holder = ConfigHolder(path, env={})
    async with running(bus, agent_factory_from_config(holder)) as worker:
        first = await open_line(bus, "CA3301", agent="desk")
        await first.publish({"type": "call_started"})
        _, end = await utterance(first)
        assert end["text"] == "Old greeting."

        write_config(path, "New greeting.", "New balance.")
        assert holder.reload()
        second = await open_line(bus, "CA3302", agent="desk")
        await second.publish({"type": "call_started"})
        _, end = await utterance(second)
        assert end["text"] == "New greeting."

        await first.publish({"type": "transcript", "text": "balance"})
        _, end = await utterance(first)
        assert end["text"] == "Old balance."
        await second.publish({"type": "transcript", "text": "balance"})
        _, end = await utterance(second)
        assert end["text"] == "New balance."
        await first.end(worker)
        await second.end(worker)


async def test_the_agent_comes_from_the_call_else_from_the_number(
    bus: Bus, tmp_path: Path
) -> None:
    path = tmp_path / "agents.yaml"
    write_config(path, "Desk.", "x")
    factory = agent_factory_from_config(ConfigHolder(path, env={}))
    assert factory.agent_for(CallInfo("CA1", agent="other")).name == "other"
    assert factory.agent_for(CallInfo("CA2", to_number="+14155550123")).name == "other"
    assert factory.agent_for(CallInfo("CA3", agent="nobody", to_number="+1999")).name == "desk"
    assert factory(CallInfo("CA4", agent="desk")) is factory(CallInfo("CA5", agent="desk"))
