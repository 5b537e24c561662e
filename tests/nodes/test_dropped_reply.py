"""The gateway drops an utterance unheard with no interrupt of its own (the reply to a turn whose
reply it had cancelled, bus protocol 1.2): ``playback {state: interrupted, heard_ms: 0}`` alone.

The worker cuts it (no more audio, its text out of the node's context) and cancels its
generation, so the node does not wait for playback progress that never comes. The negatives:
a non-interruptible utterance plays on, one already cut by an interrupt keeps what was heard, and
a barge-in at heard 0 (its interrupt follows the playback report) goes as it always went.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from bus import Bus
from nodes import (
    HANGUP_TOOL,
    AgentSession,
    ChatChunk,
    ConfiguredLLMNode,
    Node,
    OutputAgentNode,
    SDKAgentEndCallEvent,
    SDKEvent,
    SDKSystemLLMRequestEvent,
    SessionWorker,
    ToneSynthesizer,
    ToolCall,
    ToolRegistry,
    function_tool,
)

from .conftest import Line, guard, open_line, running

MS_PER_CHAR = 10
CHUNK = "xxxxx " * 5  # 300 ms of audio a chunk
LOOKAHEAD_MS = 100.0


class Paced(OutputAgentNode):
    """Three chunks a response; notes each pull of its generator and how the generation ended."""

    def __init__(self, *, interruptible: bool = True) -> None:
        super().__init__(name="paced", is_interruptible=interruptible)
        self.pulls = 0
        self.endings: list[str] = []
        self.requests = 0  # requests to answer queued on this node
        self.next_queued = asyncio.Event()  # a second one is queued (behind the first)

    async def queue_event(self, event: SDKEvent) -> None:
        await super().queue_event(event)
        if isinstance(event, SDKSystemLLMRequestEvent):
            self.requests += 1
            if self.requests == 2:
                self.next_queued.set()

    async def generate_response(self) -> AsyncIterator[str]:
        ending = "cancelled"
        try:
            for _ in range(3):
                self.pulls += 1
                yield CHUNK
            ending = "done"
        finally:
            self.endings.append(ending)

    def assistant(self) -> list[str]:
        return [m["content"] for m in self.context.messages if m["role"] == "assistant"]


@contextlib.asynccontextmanager
async def paced_call(
    bus: Bus, sid: str, **node: Any
) -> AsyncIterator[tuple[SessionWorker, Line, list[Paced]]]:
    made: list[Paced] = []

    async def setup(session: AgentSession) -> None:
        made.append(Paced(**node))
        session.add_node(made[-1])
        await session.start()
        await session.wait_until_complete()

    async with running(bus, lambda call: setup, worker_id=f"w-{sid}",
                       synthesizer=ToneSynthesizer(MS_PER_CHAR),
                       lookahead_ms=LOOKAHEAD_MS) as worker:
        line = await open_line(bus, sid)
        yield worker, line, made


async def _first_reply(line: Line, text: str = "tell me") -> tuple[str, str]:
    """Publish a final transcript; returns its eid and the id of the reply, once the reply's
    first chunk is all on the downlink (the node then waits for playback progress)."""
    eid = await line.publish({"type": "transcript", "text": text, "final": True})
    start = await line.next("utterance_start")
    assert start["reply_to"] == eid
    uid = start["utterance_id"]
    while (await line.next("audio", utterance_id=uid))["audio_ms"] < len(CHUNK) * MS_PER_CHAR:
        pass
    return eid, uid


async def _dropped_then_next(line: Line, uid: str) -> None:
    """Read the dropped utterance's end (interrupted), then play the next reply to its end."""
    end = await line.next("utterance_end", utterance_id=uid)
    assert end["interrupted"] is True
    await _next_in_full(line, uid)


async def _next_in_full(line: Line, uid: str) -> None:
    """The next reply (not ``uid``) is heard and ends with all its text."""
    start = await line.next("utterance_start")
    assert start["utterance_id"] != uid
    await line.publish({"type": "playback", "state": "playing",
                        "utterance_id": start["utterance_id"], "heard_ms": 10_000.0})
    done = await line.next("utterance_end", utterance_id=start["utterance_id"])
    assert done["interrupted"] is False and done["text"] == CHUNK * 3


def _audio_text_ends(line: Line, uid: str) -> set[int]:
    return {e["text_end"] for e in line.of("audio") if e["utterance_id"] == uid}


async def test_a_reply_dropped_unheard_is_cut_and_its_generation_cancelled(bus: Bus) -> None:
    async with paced_call(bus, "CA8101") as (worker, line, made):
        _, uid = await _first_reply(line)
        await line.publish({"type": "playback", "state": "interrupted", "utterance_id": uid,
                            "heard_ms": 0.0})
        end = await line.next("utterance_end", utterance_id=uid)
        assert end["interrupted"] is True
        (node,) = made
        assert node.assistant() == []  # nothing of it was heard: it is out of the context
        assert node.pulls == 1 and node.endings == ["cancelled"]  # not run on to its end
        assert _audio_text_ends(line, uid) == {len(CHUNK)}  # the first chunk's audio only
        # The next turn is answered, in full, from a context without the dropped reply.
        await line.publish({"type": "transcript", "text": "and then", "final": True})
        await _next_in_full(line, uid)
        users = [m["content"] for m in node.context.messages if m["role"] == "user"]
        assert users == ["tell me", "and then"] and node.assistant() == [CHUNK * 3]
        downlink = await line.end(worker)
        assert not [e for e in downlink
                    if e.get("type") == "audio" and e["utterance_id"] == uid
                    and e["text_end"] > len(CHUNK)]


async def test_a_non_interruptible_reply_is_not_cut(bus: Bus) -> None:
    async with paced_call(bus, "CA8102", interruptible=False) as (worker, line, made):
        _, uid = await _first_reply(line)
        await line.publish({"type": "playback", "state": "interrupted", "utterance_id": uid,
                            "heard_ms": 0.0})
        await line.publish({"type": "playback", "state": "playing", "utterance_id": uid,
                            "heard_ms": 10_000.0})
        end = await line.next("utterance_end", utterance_id=uid)
        assert end["interrupted"] is False and end["text"] == CHUNK * 3
        (node,) = made
        assert node.assistant() == [CHUNK * 3] and node.endings == ["done"]
        await line.end(worker)


async def test_a_reply_cut_by_an_interrupt_keeps_what_was_heard(bus: Bus) -> None:
    async with paced_call(bus, "CA8103") as (worker, line, made):
        _, uid = await _first_reply(line)
        await line.publish({"type": "interrupt", "utterance_id": uid, "heard_ms": 200.0})
        end = await line.next("utterance_end", utterance_id=uid)
        assert end["interrupted"] is True
        (node,) = made
        kept = node.assistant()
        assert kept and kept[0] and CHUNK.startswith(kept[0])  # 200 ms: 20 characters, cut back
        # The late report of the same cut (heard 0: the gateway's own view) changes nothing.
        await line.publish({"type": "playback", "state": "interrupted", "utterance_id": uid,
                            "heard_ms": 0.0})
        await line.publish({"type": "transcript", "text": "and then", "final": True})
        nxt = await line.next("utterance_start")
        assert nxt["utterance_id"] != uid
        assert node.assistant()[:1] == kept
        await line.end(worker)


async def test_a_barge_in_at_heard_zero_goes_as_before(bus: Bus) -> None:
    """The gateway's barge-in before any of the reply was heard: ``playback {interrupted, 0}``
    then ``interrupt {heard_ms: 0}``. The reply is cut to nothing once, and the caller's words
    (the transcript after the interrupt) are answered."""
    async with paced_call(bus, "CA8104") as (worker, line, made):
        _, uid = await _first_reply(line)
        await line.publish({"type": "playback", "state": "interrupted", "utterance_id": uid,
                            "heard_ms": 0.0})
        await line.publish({"type": "interrupt", "utterance_id": uid, "heard_ms": 0.0,
                            "heard_text": ""})
        await line.publish({"type": "transcript", "text": "wait", "final": True})
        await _dropped_then_next(line, uid)
        (node,) = made
        assert [m["content"] for m in node.context.messages] == ["tell me", "wait", CHUNK * 3]
        assert node.endings == ["cancelled", "done"]
        downlink = await line.end(worker)
        assert len([e for e in downlink if e.get("type") == "utterance_end"
                    and e["utterance_id"] == uid]) == 1


async def test_a_dropped_reply_with_the_next_turn_queued_is_cancelled_and_the_turn_kept(
    bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    """A takeover's case: the next turn is already queued behind the dropped reply. Only the
    dropped generation is cancelled (``_cancel_generation``): the queued request stays and the
    next turn is answered in full; no stall guard fires."""
    async with paced_call(bus, "CA8105") as (worker, line, made):
        _, uid = await _first_reply(line)
        await line.publish({"type": "transcript", "text": "and then", "final": True})
        (node,) = made
        await guard(node.next_queued.wait())  # on the node's queue, behind the dropped reply
        await line.publish({"type": "playback", "state": "interrupted", "utterance_id": uid,
                            "heard_ms": 0.0})
        await _dropped_then_next(line, uid)
        assert _audio_text_ends(line, uid) == {len(CHUNK)}
        assert node.pulls == 4 and node.endings == ["cancelled", "done"]
        assert node.assistant() == [CHUNK * 3]  # the dropped reply left the context
        assert not [m for m in caplog.messages if "no playback progress" in m]
        await line.end(worker)


# -- a frozen response does not act (issue #17) ------------------------------------------------

class _Recorder(Node):
    """A child that keeps what the node emits."""

    def __init__(self) -> None:
        super().__init__(name="recorder", is_interruptible=False)
        self.events: list[SDKEvent] = []

    async def queue_event(self, event: SDKEvent) -> None:
        self.events.append(event)


class _CutMidReplyLLM:
    """Streams "bye for now", then asks for a function tool and ``callgate_hangup``; between
    the text and the calls the worker's cut lands (``_truncate_response(rid, "")``), as a drop
    by the gateway does while the generation runs on."""

    def __init__(self) -> None:
        self.node: ConfiguredLLMNode | None = None
        self.requests = 0

    async def chat(self, messages: list[dict[str, Any]], stream: bool = True,
                   tools: Any = None) -> AsyncIterator[ChatChunk]:
        self.requests += 1
        return self._stream()

    async def _stream(self) -> AsyncIterator[ChatChunk]:
        node = self.node
        assert node is not None and node._generation is not None
        yield ChatChunk(content="bye for now")
        assert node._truncate_response(node._generation.request_id, "")
        yield ChatChunk(tool_calls=[ToolCall(id="c1", name="note_it", arguments="{}"),
                                    ToolCall(id="c2", name=HANGUP_TOOL, arguments="{}")],
                        finish_reason="tool_calls")


def _tool_node(llm: _CutMidReplyLLM) -> tuple[ConfiguredLLMNode, _Recorder, list[str]]:
    ran: list[str] = []

    @function_tool
    def note_it() -> str:
        """Note the call."""
        ran.append("note_it")
        return "noted"

    tools = ToolRegistry()
    tools.register(note_it)
    node = ConfiguredLLMNode("agent", llm=llm, tools=tools)  # type: ignore[arg-type]
    llm.node = node
    recorder = _Recorder()
    node.add_child(recorder)
    return node, recorder, ran


async def test_a_reply_cut_while_it_runs_on_calls_no_tool_and_does_not_hang_up() -> None:
    llm = _CutMidReplyLLM()
    node, recorder, ran = _tool_node(llm)
    node.context.add_message({"role": "user", "content": "that's all"})
    await node._respond()
    assert ran == []  # the function tool did not run
    assert llm.requests == 1  # no second round with tool results
    assert [m["role"] for m in node.context.messages] == ["user"]  # no tool message, no reply
    assert not [e for e in recorder.events if isinstance(e, SDKAgentEndCallEvent)]
    assert node._generation is None


async def test_a_reply_not_cut_does_hang_up() -> None:
    """The positive: the same reply, heard, runs its tool and hangs up."""

    class Heard(_CutMidReplyLLM):
        async def _stream(self) -> AsyncIterator[ChatChunk]:
            if self.requests > 1:
                yield ChatChunk(content="done", finish_reason="stop")
                return
            yield ChatChunk(content="bye for now")
            yield ChatChunk(tool_calls=[ToolCall(id="c1", name="note_it", arguments="{}"),
                                        ToolCall(id="c2", name=HANGUP_TOOL, arguments="{}")],
                            finish_reason="tool_calls")

    llm = Heard()
    node, recorder, ran = _tool_node(llm)
    node.context.add_message({"role": "user", "content": "that's all"})
    await node._respond()
    assert ran == ["note_it"]
    assert "tool" in [m["role"] for m in node.context.messages]
    assert [e for e in recorder.events if isinstance(e, SDKAgentEndCallEvent)]


class _Slow(Paced):
    """Awaits ``gate`` in ``process_event`` before it starts its second response: the window
    in which the loop is in a request but not yet generating it."""

    def __init__(self) -> None:
        super().__init__()
        self.handled = 0
        self.gate = asyncio.Event()
        self.waiting = asyncio.Event()
        self.both_done = asyncio.Event()

    async def process_event(self, event: SDKEvent) -> None:
        if isinstance(event, SDKSystemLLMRequestEvent):
            self.handled += 1
            if self.handled == 2:
                self.waiting.set()
                await self.gate.wait()
        await super().process_event(event)

    async def generate_response(self) -> AsyncIterator[str]:
        async for chunk in super().generate_response():
            yield chunk
        if self.endings == ["done", "done"]:
            self.both_done.set()


async def test_a_drop_in_the_window_before_the_next_response_cancels_nothing() -> None:
    """The node's loop is in the next turn's request (awaiting before ``super()``) when the
    previous response's id comes to be cancelled: ``_cancel_generation`` compares the id the
    node is generating (none yet), cancels nothing, and the next response is made in full."""
    node = _Slow()
    recorder = _Recorder()
    node.add_child(recorder)
    await node.start()
    try:
        await node.queue_event(SDKSystemLLMRequestEvent())
        await node.queue_event(SDKSystemLLMRequestEvent())
        await guard(node.waiting.wait())
        assert isinstance(node._processing, SDKSystemLLMRequestEvent)  # the old check's "in it"
        first = next(reversed(node._responses))
        assert node._generation is None
        assert await node._cancel_generation(first) is False
        node.gate.set()
        await guard(node.both_done.wait())
        assert node.pulls == 6 and node.endings == ["done", "done"]
    finally:
        await node.stop()
