"""AgentSession, Node and OutputAgentNode semantics (no bus, no LLM)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from nodes import (
    AgentSession,
    GraphCycleError,
    Node,
    OutputAgentNode,
    SDKAgentErrorEvent,
    SDKAgentLLMResponseChunkEvent,
    SDKAgentLLMResponseEndEvent,
    SDKAgentLLMResponseStartEvent,
    SDKAgentReadyEvent,
    SDKAgentSpeakEvent,
    SDKAgentTranscriptUpdateEvent,
    SDKEvent,
    SDKSystemControlInterruptEvent,
    SDKSystemLLMRequestEvent,
    SDKSystemUpdateOutputAgentSettingsEvent,
    SDKSystemUserJoinedEvent,
    SDKSystemUserStartedSpeakingEvent,
    SessionState,
    SessionStateError,
    UnknownEventHandlerError,
    parse_event,
)
from nodes import _events

from .conftest import guard


class Echo(OutputAgentNode):
    def __init__(self, name: str, *, gate: asyncio.Event | None = None, **kw: bool) -> None:
        super().__init__(name=name, **kw)
        self.gate = gate
        self.requests = 0

    async def generate_response(self) -> AsyncIterator[str]:
        self.requests += 1
        yield f"{self.name}:{self.context.messages[-1]['content']}"
        if self.gate is not None:
            await self.gate.wait()
            yield " done"


async def started(
    *nodes: Node, edges: tuple[tuple[Node, Node], ...] = (), **kw: int
) -> AgentSession:
    session = AgentSession("unit", **kw)
    for node in nodes:
        session.add_node(node)
    for parent, child in edges:
        session.add_edge(parent, child)
    await session.start()
    return session


async def collect(session: AgentSession, until: int, cls: type[SDKEvent]) -> list[SDKEvent]:
    """Output events up to the ``until``-th event of class ``cls``."""
    seen: list[SDKEvent] = []
    count = 0
    async with asyncio.timeout(10):
        async for event in session.output_events():
            seen.append(event)
            if isinstance(event, cls):
                count += 1
                if count == until:
                    return seen
    raise AssertionError(f"output ended after {seen}")


async def test_dag_routing_and_origin() -> None:
    first, second = Echo("first"), Echo("second")
    session = await started(first, second, edges=((first, second),))
    assert second in first.children and not second.children.count(first)
    await session.push_event(SDKAgentTranscriptUpdateEvent(role="user", content="hi"))
    await session.push_event(SDKSystemLLMRequestEvent())
    events = await collect(session, 2, SDKAgentLLMResponseEndEvent)
    await session.stop()
    assert isinstance(events[0], SDKAgentReadyEvent)
    chunks = [e for e in events if isinstance(e, SDKAgentLLMResponseChunkEvent)]
    # second sees the request only after first forwards it, i.e. after first's response
    assert [(c.origin.name, c.text) for c in chunks] == [  # type: ignore[union-attr]
        ("first", "first:hi"),
        ("second", "second:hi"),
    ]
    starts = [e for e in events if isinstance(e, SDKAgentLLMResponseStartEvent)]
    assert [s.request_id for s in starts] == [c.request_id for c in chunks]
    assert first.context.messages == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "first:hi"},
    ]


async def test_cycles_are_refused() -> None:
    a, b, c = Echo("a"), Echo("b"), Echo("c")
    session = AgentSession("cyclic")
    for parent, child in ((a, b), (b, c), (c, a)):
        session.add_edge(parent, child)
    with pytest.raises(GraphCycleError, match="a -> b -> c -> a"):
        await session.start()


async def test_lifecycle_misuse() -> None:
    session = AgentSession("life")
    with pytest.raises(SessionStateError, match="push_event"):
        await session.push_event(SDKSystemLLMRequestEvent())
    with pytest.raises(UnknownEventHandlerError, match="on_event_received"):
        session.add_event_handler("on_bogus", lambda s, e: None)
    await session.start()
    with pytest.raises(SessionStateError, match="add_node"):
        session.add_node(Echo("late"))
    with pytest.raises(SessionStateError, match="start"):
        await session.start()
    await session.stop()
    assert session.state is SessionState.STOPPED
    await guard(session.wait_until_complete())


async def test_late_handlers_see_later_events_in_order() -> None:
    session = await started(Echo("a"))
    await session.push_event(SDKSystemUserJoinedEvent())
    seen: list[str] = []

    @session.on_event("on_event_received")
    def sync_handler(session: AgentSession, event: SDKEvent) -> None:
        seen.append(f"sync {event.type}")

    @session.on_event("on_event_received")
    async def failing(session: AgentSession, event: SDKEvent) -> None:
        raise RuntimeError("handler bug")

    async def async_handler(session: AgentSession, event: SDKEvent) -> None:
        seen.append(f"async {event.type}")

    session.add_event_handler("on_event_received", async_handler)
    await session.push_event(SDKSystemUserStartedSpeakingEvent())
    await session.push_event(SDKSystemControlInterruptEvent())
    await session.wait_for_event_handlers()
    await session.stop()
    assert seen == [
        "sync system.user.started_speaking",
        "async system.user.started_speaking",
        "sync system.control.interrupt",
        "async system.control.interrupt",
    ]


async def test_interrupt_cancels_and_drops_queued_events() -> None:
    gate = asyncio.Event()
    node = Echo("busy", gate=gate)
    session = await started(node)
    await session.push_event(SDKAgentTranscriptUpdateEvent(role="user", content="one"))
    await session.push_event(SDKSystemLLMRequestEvent())
    await collect(session, 1, SDKAgentLLMResponseChunkEvent)
    await session.push_event(SDKSystemLLMRequestEvent())  # queued behind the busy response
    await session.push_event(SDKSystemControlInterruptEvent())
    events = await collect(session, 1, SDKAgentLLMResponseEndEvent)
    gate.set()
    # the session still works after the interrupt; the queued request was dropped
    await session.push_event(SDKAgentTranscriptUpdateEvent(role="user", content="two"))
    await session.push_event(SDKSystemLLMRequestEvent())
    events += await collect(session, 1, SDKAgentLLMResponseEndEvent)
    await session.stop()
    assert node.requests == 2
    texts = [e.text for e in events if isinstance(e, SDKAgentLLMResponseChunkEvent)]
    assert texts == ["busy:two", " done"]


async def test_non_interruptible_node_keeps_going() -> None:
    gate = asyncio.Event()
    node = Echo("steady", gate=gate, is_interruptible=False)
    session = await started(node)
    await session.push_event(SDKAgentTranscriptUpdateEvent(role="user", content="x"))
    await session.push_event(SDKSystemLLMRequestEvent())
    await collect(session, 1, SDKAgentLLMResponseChunkEvent)
    await session.push_event(SDKSystemControlInterruptEvent())
    gate.set()
    events = await collect(session, 1, SDKAgentLLMResponseEndEvent)
    await session.stop()
    assert [e.text for e in events if isinstance(e, SDKAgentLLMResponseChunkEvent)] == [" done"]
    assert node.context.messages[-1]["content"] == "steady:x done"


async def test_generation_errors_become_error_events() -> None:
    class Broken(OutputAgentNode):
        async def generate_response(self) -> AsyncIterator[str]:
            yield "partial"
            raise ValueError("model exploded")

    class Missing(OutputAgentNode):
        pass

    session = await started(Broken(), Missing())
    await session.push_event(SDKSystemLLMRequestEvent())
    events = await collect(session, 2, SDKAgentLLMResponseEndEvent)
    await session.stop()
    errors = {
        e.origin.name: e.message  # type: ignore[union-attr]
        for e in events
        if isinstance(e, SDKAgentErrorEvent)
    }
    assert errors["Broken"] == "model exploded"
    assert "Missing must implement generate_response()" in errors["Missing"]


async def test_speak_greeting_and_settings() -> None:
    class Greeter(OutputAgentNode):
        greeting = "Welcome to callgate."

    node = Greeter(name="greeter")
    session = await started(node)
    await session.push_event(SDKSystemUpdateOutputAgentSettingsEvent(settings={"voice": "x"}))
    await session.push_event(SDKSystemUserJoinedEvent())
    events = await collect(session, 1, SDKAgentSpeakEvent)
    (event,) = [e for e in events if isinstance(e, SDKAgentSpeakEvent)]
    await session.stop()
    assert event.text == "Welcome to callgate." and event.request_id
    assert node.context.messages == [{"role": "assistant", "content": "Welcome to callgate."}]
    assert node.settings.voice == "x"  # type: ignore[attr-defined]
    assert node._truncate_response(event.request_id, "Welcome")
    assert node.context.messages == [{"role": "assistant", "content": "Welcome"}]
    assert node._truncate_response(event.request_id, "")
    assert node.context.messages == []
    assert not node._truncate_response("unknown", "x")


async def test_a_node_may_interrupt_itself() -> None:
    class Restless(OutputAgentNode):
        def __init__(self) -> None:
            super().__init__(name="restless")
            self.trace: list[str] = []
            self.interrupted = asyncio.Event()

        async def process_event(self, event: SDKEvent) -> None:
            if isinstance(event, SDKSystemUserStartedSpeakingEvent):
                await self._handle_interrupt()  # from inside its own loop task
                self.trace.append("runs on until the next await")
                self.interrupted.set()
                await asyncio.sleep(0)
                self.trace.append("never: cancelled at that await")
            await super().process_event(event)

        async def generate_response(self) -> AsyncIterator[str]:
            yield "still alive"

    node = Restless()
    session = await started(node)
    await session.push_event(SDKSystemUserStartedSpeakingEvent())
    await guard(node.interrupted.wait())
    await session.push_event(SDKSystemLLMRequestEvent())  # served by the fresh loop
    events = await collect(session, 1, SDKAgentLLMResponseEndEvent)
    await session.stop()
    assert node.trace == ["runs on until the next await"]
    assert [e.text for e in events if isinstance(e, SDKAgentLLMResponseChunkEvent)] == [
        "still alive"
    ]


def test_events_round_trip_through_json() -> None:
    assert len(_events._REGISTRY) == 20
    for kind, cls in _events._REGISTRY.items():
        required = {
            name: ("1" if name == "digit" else "+1555" if name == "transfer_call_number" else "x")
            for name, field in cls.model_fields.items()
            if field.is_required()
        }
        if "role" in required:
            required["role"] = "user"
        event = cls(**required)
        assert event.type == kind
        again = parse_event(event.model_dump(mode="json"))
        assert type(again) is cls and again == event
    with pytest.raises(ValueError, match="unknown SDK event type"):
        parse_event({"type": "nope"})
