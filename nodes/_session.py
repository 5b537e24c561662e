"""AgentSession: builds the node graph, feeds it the caller's events and collects its output.

The graph is a DAG. ``start()`` links the edges, hangs every node without parents off a root node
and feeds every node without children into a sink. Events from the platform go in through
``push_event`` (queued at a root node, which passes them on in order);
what the leaves emit comes out of ``output_events()``, in order. Pushing an interrupt returns once
the graph has handled it (the events pushed before it were passed on first, so an interruptible
node drops those still queued), i.e. once every interruptible node has cancelled its generation.

The sink applies backpressure to response chunks only: at most ``output_buffer`` chunks wait for
the consumer, so a node generates at the pace its words are taken (by the worker, which turns them
into audio). Control events (start, end, error, speak, ...) never wait.

Handlers registered with ``on_event("on_event_received")`` see every event pushed after they are
registered, in order, one at a time, in a task of their own; registering after ``start()`` works
(the seed documents do exactly that). ``wait_for_setup()`` lets the platform wait until the
agent's ``setup(session)`` has reached ``wait_until_complete()`` before it pushes the first event.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from . import _reactions
from ._errors import GraphCycleError, SessionStateError, UnknownEventHandlerError
from ._events import (
    SDKAgentLLMResponseChunkEvent,
    SDKAgentReadyEvent,
    SDKEvent,
    SDKSystemControlInterruptEvent,
    SDKSystemInitEvent,
)
from ._node import Node
from ._output_agent import OutputAgentNode, ResponsePacer

__all__ = ["AgentSession", "EventHandler", "SessionState"]

logger = logging.getLogger(__name__)

EventHandler = Callable[["AgentSession", SDKEvent], Awaitable[None] | None]
_H = TypeVar("_H", bound=Callable[..., Any])

_EVENT_NAMES = ("on_event_received",)


class SessionState(enum.Enum):
    """Lifecycle of an AgentSession."""

    NEW = "new"  # nodes and edges may be added
    RUNNING = "running"  # started: events flow
    STOPPED = "stopped"  # stopped: wait_until_complete() has returned


class _RootNode(Node):
    """Entry point: passes every event on to the parentless nodes, in the order pushed."""

    async def process_event(self, event: SDKEvent) -> None:
        await self.send_event(event)

    async def interrupt_now(self, event: SDKEvent) -> None:
        """Pass on what is still queued here, then hand ``event`` to the children at once.

        Passing an event on never waits (node queues are unbounded), so this keeps the pushed
        order without giving the loop a chance to run in between.
        """
        while not self._queue.empty():
            queued = self._queue.get_nowait()
            if queued is not None:
                await self.send_event(queued)
                _reactions.release(queued)
        await self.process_event(event)


class _OutputChannel:
    """FIFO from the sink to the consumer; response chunks wait when ``limit`` are pending."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._items: deque[SDKEvent] = deque()
        self._pending_chunks = 0
        self._closed = False
        self._cond = asyncio.Condition()

    async def put(self, event: SDKEvent) -> None:
        bounded = isinstance(event, SDKAgentLLMResponseChunkEvent) and self._limit > 0
        if _reactions.is_effect(event):
            _reactions.hold(event)  # released once the consumer is done with it (output_events)
        async with self._cond:
            if bounded:
                await self._cond.wait_for(
                    lambda: self._pending_chunks < self._limit or self._closed
                )
                self._pending_chunks += 1
            self._items.append(event)
            self._cond.notify_all()

    async def get(self) -> SDKEvent | None:
        async with self._cond:
            await self._cond.wait_for(lambda: bool(self._items) or self._closed)
            if not self._items:
                return None
            event = self._items.popleft()
            if isinstance(event, SDKAgentLLMResponseChunkEvent) and self._limit > 0:
                self._pending_chunks -= 1
            self._cond.notify_all()
            return event

    async def close(self) -> None:
        async with self._cond:
            self._closed = True
            self._cond.notify_all()


class _SinkNode(Node):
    """Exit point: everything the leaves emit goes straight to the session's output."""

    def __init__(self, channel: _OutputChannel, name: str) -> None:
        super().__init__(name=name)
        self._channel = channel

    async def queue_event(self, event: SDKEvent) -> None:
        await self._channel.put(event)

    async def process_event(self, event: SDKEvent) -> None:
        await self._channel.put(event)


class AgentSession:
    """One conversation: a graph of nodes, its input and its output.

    Args:
        session_id: Identifies the session in logs (the worker uses the call SID).
        init_event: The ``system.init`` event handed to every node's ``start``.
        output_buffer: How many response chunks may wait for the output consumer before the
            generating node waits too; 0 means unbounded.
        pacer: When each output node's response may produce its next chunk (the session
            worker paces them on what the caller hears); None: as fast as they are taken.
    """

    def __init__(
        self,
        session_id: str = "session",
        *,
        init_event: SDKSystemInitEvent | None = None,
        output_buffer: int = 1,
        pacer: ResponsePacer | None = None,
    ) -> None:
        self.session_id = session_id
        self._pacer = pacer
        self.name = f"Session-{session_id}"
        self.init_event = init_event or SDKSystemInitEvent()
        self.nodes: list[Node] = []
        self.edges: list[tuple[Node, Node]] = []
        self._state = SessionState.NEW
        self._output = _OutputChannel(output_buffer)
        self._root = _RootNode(name=f"{self.name}::Root")
        self.root: Node = self._root
        self.sink: Node = _SinkNode(self._output, name=f"{self.name}::Sink")
        self._handlers: dict[str, list[EventHandler]] = {name: [] for name in _EVENT_NAMES}
        # each pushed event with the handlers registered when it was pushed
        self._handler_queue: asyncio.Queue[tuple[SDKEvent, tuple[EventHandler, ...]]] = (
            asyncio.Queue()
        )
        self._handler_task: asyncio.Task[None] | None = None
        self._waiting = asyncio.Event()
        self._complete = asyncio.Event()

    @property
    def state(self) -> SessionState:
        return self._state

    # -- building ---------------------------------------------------------------------------
    def add_node(self, node: Node) -> None:
        """Add a node to the graph (before ``start``)."""
        self._require(SessionState.NEW, "add_node")
        if node not in self.nodes:
            self.nodes.append(node)

    def add_edge(self, parent: Node, child: Node) -> None:
        """Make ``child`` receive what ``parent`` emits (before ``start``)."""
        self._require(SessionState.NEW, "add_edge")
        self.edges.append((parent, child))

    @property
    def output_nodes(self) -> list[OutputAgentNode]:
        """The graph's OutputAgentNodes, in the order they were added."""
        return [n for n in self.nodes if isinstance(n, OutputAgentNode)]

    def get_node(self, name: str) -> Node | None:
        """The node called ``name``, if any."""
        return next((n for n in self.nodes if n.name == name), None)

    def _build_graph(self) -> None:
        for parent, child in self.edges:
            for node in (parent, child):
                if node not in self.nodes:
                    self.nodes.append(node)
            parent.add_child(child)
        self._check_acyclic()
        for node in self.nodes:
            if not node.has_parents:
                self.root.add_child(node)
        for node in self.nodes:
            if not node.has_children:
                node.add_child(self.sink)

    def _check_acyclic(self) -> None:
        white, grey, black = 0, 1, 2
        colour = {node: white for node in self.nodes}

        def visit(node: Node, path: list[str]) -> None:
            colour[node] = grey
            for child in node.children:
                if colour.get(child, black) == grey:
                    cycle = " -> ".join([*path, node.name, child.name])
                    raise GraphCycleError(f"{self.name}: the node graph has a cycle: {cycle}")
                if colour.get(child) == white:
                    visit(child, [*path, node.name])
            colour[node] = black

        for node in self.nodes:
            if colour[node] == white:
                visit(node, [])

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        """Build the graph, start every node and emit ``agent.ready``."""
        self._require(SessionState.NEW, "start")
        self._build_graph()
        if self._pacer is not None:
            for output in self.output_nodes:
                output._pacer = self._pacer
        self._state = SessionState.RUNNING
        for node in [self.root, *self.nodes, self.sink]:
            await node.start(self.init_event)
        self._handler_task = asyncio.get_running_loop().create_task(
            self._dispatch_handlers(), name=f"{self.name}::event_handlers"
        )
        await self._output.put(SDKAgentReadyEvent())

    async def wait_until_complete(self) -> None:
        """Return once the session has stopped (the call ended)."""
        self._waiting.set()
        await self._complete.wait()

    async def wait_for_setup(self) -> None:
        """Return once the agent's setup awaits ``wait_until_complete()``."""
        await self._waiting.wait()

    async def stop(self) -> None:
        """Stop every node (cancelling generations) and the handlers, end the output."""
        if self._state is not SessionState.RUNNING:
            self._state = SessionState.STOPPED
            self._complete.set()
            await self._output.close()
            return
        self._state = SessionState.STOPPED
        for node in [self.root, *self.nodes, self.sink]:
            await node.stop()
        if self._handler_task is not None:
            # Cancelled, not drained: a handler stuck on I/O must not keep a finished call open.
            self._handler_task.cancel()
            await asyncio.wait({self._handler_task})
            self._handler_task = None
            while not self._handler_queue.empty():
                self._handler_queue.get_nowait()
                self._handler_queue.task_done()
        await self._output.close()
        self._complete.set()

    # -- input and output -------------------------------------------------------------------
    async def push_event(self, event: SDKEvent) -> None:
        """Feed an event from the platform into the graph and to ``on_event_received``.

        An interrupt is handled before this returns: every interruptible node has cancelled
        its generation and dropped the events queued before it. Other events are queued.
        """
        self._require(SessionState.RUNNING, "push_event")
        if isinstance(event, SDKSystemControlInterruptEvent):
            token = _reactions.CURRENT.set(event._reaction)
            try:
                await self._root.interrupt_now(event)
            finally:
                _reactions.CURRENT.reset(token)
        else:
            await self._root.queue_event(event)
        handlers = tuple(self._handlers["on_event_received"])
        if handlers:
            _reactions.hold(event)
            await self._handler_queue.put((event, handlers))

    async def output_events(self) -> AsyncIterator[SDKEvent]:
        """What the graph emits, in order, until the session stops (one consumer)."""
        while True:
            event = await self._output.get()
            if event is None:
                return
            yield event
            if _reactions.is_effect(event):
                _reactions.release(event)  # the consumer came back: done with it

    # -- handlers ---------------------------------------------------------------------------
    def on_event(self, event_name: str) -> Callable[[_H], _H]:
        """Decorator: register ``handler(session, event)`` for ``event_name``."""

        def decorator(handler: _H) -> _H:
            self.add_event_handler(event_name, handler)
            return handler

        return decorator

    def add_event_handler(self, event_name: str, handler: EventHandler) -> None:
        """Register ``handler(session, event)`` (sync or async) for ``event_name``."""
        if event_name not in self._handlers:
            raise UnknownEventHandlerError(
                f"no event {event_name!r}; a session emits {', '.join(_EVENT_NAMES)}"
            )
        self._handlers[event_name].append(handler)

    async def wait_for_event_handlers(self) -> None:
        """Return once the handlers have run for every event pushed so far (or the session
        stopped)."""
        await self._handler_queue.join()

    async def _dispatch_handlers(self) -> None:
        while True:
            event, handlers = await self._handler_queue.get()
            token = _reactions.CURRENT.set(event._reaction)
            try:
                for handler in handlers:
                    try:
                        result = handler(self, event)
                        if inspect.isawaitable(result):
                            await result
                    except Exception:
                        # A bug in one handler must not stop the others or the call.
                        logger.exception("[%s] on_event_received handler failed", self.name)
            finally:
                _reactions.CURRENT.reset(token)
                _reactions.release(event)
                self._handler_queue.task_done()

    def _require(self, state: SessionState, what: str) -> None:
        if self._state is not state:
            raise SessionStateError(
                f"{self.name}: {what}() needs a {state.value} session, this one is "
                f"{self._state.value}"
            )

    def __repr__(self) -> str:
        return f"<AgentSession: {self.name} ({len(self.nodes)} nodes, {self._state.value})>"
