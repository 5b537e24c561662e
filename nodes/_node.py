"""Node: the unit of an agent graph, with one event queue and one loop task.

Events travel parent -> child. ``send_event`` queues ordinary events on each child, but hands an
``SDKSystemControlInterruptEvent`` to each child's ``process_event`` at once, so a barge-in never
waits behind queued work. An interruptible node answers it with ``_handle_interrupt()``, which
cancels the node's loop task (and with it whatever the node was generating), waits for it to
finish, drops the events still queued (except the caller's own input: see
``_outlives_interrupt``) and starts a fresh loop. A node created with
``is_interruptible=False`` ignores the interrupt and keeps generating.
"""

from __future__ import annotations

import asyncio
import logging

from . import _reactions
from ._events import (
    SDKAgentTranscriptUpdateEvent,
    SDKEvent,
    SDKSystemControlInterruptEvent,
    SDKSystemInitEvent,
    SDKSystemUserDTMFEvent,
)

__all__ = ["Node"]

logger = logging.getLogger(__name__)


class Node:
    """Base class for the nodes of an agent graph.

    Args:
        name: Name of the node (defaults to the class name).
        is_interruptible: Whether a caller's barge-in cancels what this node is doing.
    """

    def __init__(self, name: str | None = None, is_interruptible: bool = False) -> None:
        self.name: str = name or type(self).__name__
        # dicts as insertion-ordered sets: events reach children in a stable order
        self._parents: dict[Node, None] = {}
        self._children: dict[Node, None] = {}
        self._queue: asyncio.Queue[SDKEvent | None] = asyncio.Queue()
        self._running = False
        self._loop_task: asyncio.Task[None] | None = None
        # Bumped on every interrupt and stop: a loop whose epoch is stale exits even if user
        # code swallowed its cancellation.
        self._epoch = 0
        self._is_interruptible = is_interruptible
        self.init_event: SDKSystemInitEvent | None = None
        self._processing: SDKEvent | None = None  # the event the loop is in (for the logs)

    # -- graph ------------------------------------------------------------------------------
    @property
    def is_interruptible(self) -> bool:
        """Whether a barge-in cancels this node's work."""
        return self._is_interruptible

    @property
    def is_running(self) -> bool:
        """Between ``start`` and ``stop``."""
        return self._running

    def add_child(self, child: Node) -> None:
        """Link ``self -> child``."""
        self._children[child] = None
        child._parents[self] = None

    def add_parent(self, parent: Node) -> None:
        """Link ``parent -> self``."""
        parent.add_child(self)

    @property
    def children(self) -> tuple[Node, ...]:
        """Child nodes, in the order they were linked."""
        return tuple(self._children)

    @property
    def parents(self) -> tuple[Node, ...]:
        """Parent nodes, in the order they were linked."""
        return tuple(self._parents)

    @property
    def has_parents(self) -> bool:
        return bool(self._parents)

    @property
    def has_children(self) -> bool:
        return bool(self._children)

    # -- events -----------------------------------------------------------------------------
    async def queue_event(self, event: SDKEvent) -> None:
        """Queue ``event`` for this node's loop."""
        _reactions.stamp(event)  # queued while a tagged event is processed: part of its work
        _reactions.hold(event)  # released once processed or dropped (nodes._reactions)
        await self._queue.put(event)

    async def send_event(self, event: SDKEvent) -> None:
        """Pass ``event`` to every child: interrupts at once, everything else queued."""
        _reactions.stamp(event)
        for child in tuple(self._children):
            if isinstance(event, SDKSystemControlInterruptEvent):
                await child.process_event(event)
            else:
                await child.queue_event(event)

    async def process_event(self, event: SDKEvent) -> None:
        """Handle one event; subclasses extend this and call ``super()`` first.

        The base class acts on interrupts only: an interruptible node runs
        ``_handle_interrupt()``.
        """
        if isinstance(event, SDKSystemControlInterruptEvent) and self.is_interruptible:
            await self._handle_interrupt()

    async def _handle_interrupt(self) -> None:
        """Cancel the loop task and its work, drop queued events, start a fresh loop.

        Subclasses override this to save or reset state, then ``await super()._handle_interrupt()``.
        """
        old = self._loop_task
        self._epoch += 1
        dropped, self._queue = self._queue, asyncio.Queue()
        gone: list[str] = []
        while not dropped.empty():
            event = dropped.get_nowait()
            if event is not None and _outlives_interrupt(event):
                self._queue.put_nowait(event)  # still held: the fresh loop takes it in
            else:
                if event is not None:
                    gone.append(event.type)
                _reactions.release(event)
        if gone:
            logger.debug("[%s] interrupt dropped queued %s", self.name, ", ".join(gone))
        if old is None or not self._running:
            return
        if self._processing is not None:
            # Cancelled part-way: what it had emitted stays (stale, see SDKEvent.is_stale).
            logger.debug("[%s] interrupt cancels the processing of %s", self.name,
                         self._processing.type)
            self._processing = None  # the fresh loop's own is set when it takes one in
        current = asyncio.current_task()  # (``old is current_task()`` widens ``old`` in mypy 2.4)
        if current is not None and current is old:
            # The node interrupted itself from inside its own loop: the CancelledError
            # surfaces at this task's next await; the fresh loop is already in place.
            self._loop_task = self._spawn_loop()
            old.cancel()
            return
        await self._restart_loop(old)
        logger.debug("[%s] interrupt handled", self.name)

    async def _restart_loop(self, old: asyncio.Task[None]) -> None:
        """Cancel the loop task ``old`` (not the current task) and wait for it to end; then,
        if it is still the node's loop, start a fresh one on the same queue."""
        old.cancel()
        await asyncio.wait({old})
        if self._running and self._loop_task is old:
            self._loop_task = self._spawn_loop()

    # -- lifecycle --------------------------------------------------------------------------
    def _spawn_loop(self) -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(
            self._run_loop(self._epoch), name=f"{self.name}::process_event_loop"
        )

    async def _run_loop(self, epoch: int) -> None:
        while self._running and epoch == self._epoch:
            queue = self._queue
            event = await queue.get()
            if event is None or epoch != self._epoch:
                _reactions.release(event)
                break
            token = _reactions.CURRENT.set(event._reaction)
            self._processing = event
            try:
                await self.process_event(event)
            except Exception:
                # One bad event (a bug in user code) must not leave the node deaf for the rest
                # of the call: log it with its traceback and take the next event.
                logger.exception("[%s] error while processing %s", self.name, event.type)
            finally:
                if epoch == self._epoch:  # (a fresh loop may be in its own event already)
                    self._processing = None
                _reactions.CURRENT.reset(token)
                _reactions.release(event)

    async def start(
        self, init_event: SDKSystemInitEvent | None = None, task_manager: object | None = None
    ) -> None:
        """Start the node's loop.

        Args:
            init_event: The session's ``system.init`` event, kept as ``self.init_event``.
            task_manager: Accepted for signature compatibility with smallestai; unused.
        """
        if self._running:
            logger.warning("[%s] already running", self.name)
            return
        self.init_event = init_event
        self._running = True
        self._loop_task = self._spawn_loop()

    async def stop(self) -> None:
        """Stop the loop, cancelling whatever the node is doing."""
        if not self._running:
            return
        self._running = False
        self._epoch += 1
        task, self._loop_task = self._loop_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            await asyncio.wait({task})

    def __repr__(self) -> str:
        return f"<{type(self).__name__}: {self.name}>"


def _outlives_interrupt(event: SDKEvent) -> bool:
    """What the caller said or keyed before the barge-in is not dropped with the bot's work: a
    key press queued behind a node's (paced) answer, then a barge-in, lost the key (bench.chaos:
    every key press it lost at the end of session 6 went this way), and a caller's words queued
    so were never in the conversation. The caller's messages are kept (the next answer, to the
    barge-in's own words, answers the whole turn); a queued request to answer is dropped."""
    return (isinstance(event, SDKSystemUserDTMFEvent)
            or isinstance(event, SDKAgentTranscriptUpdateEvent) and event.role == "user")
