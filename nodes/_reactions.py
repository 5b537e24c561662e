"""Reaction: the work one input event caused in a session, and when all of it is done.

The session worker acks an uplink event only once what the agent did about it has been written
to the bus (a key press's spoken answer is synthesized, then sent, well after the node handled
the key: acked at once, a worker killed in between lost the answer). It tags the SDK events it
pushes with a ``Reaction``; the session counts every copy of a tagged event that waits in a
node's queue, in the handler queue or in the output channel, and every node still processing
one. An event a node emits while processing a tagged one (``speak``, a response's chunks) carries
the same reaction (``CURRENT``, a context variable of the node's loop task); in the output channel
only those count (``is_effect``), not the pushed events the leaves pass on, which the consumer
ignores. When the count falls to zero the reaction is done: every node has handled the event and
the worker has consumed everything they emitted for it.

The count only errs late: a tagged event dropped on a path that does not release it (a node's
own queue handling) leaves the reaction pending, so the event is acked at the call's end and a
takeover redelivers it, which ``next_id`` makes harmless (the same downlink ids again, dropped by
the gateway's downlink by ``eid``).
"""

from __future__ import annotations

import asyncio
import itertools
from contextvars import ContextVar
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._events import SDKEvent

__all__ = ["CURRENT", "Reaction", "hold", "is_effect", "release", "stamp", "tag"]


class Reaction:
    """The session's work caused by one input event, keyed by that event's id."""

    __slots__ = ("key", "sources", "_count", "_done", "_ids")

    def __init__(self, key: str) -> None:
        self.key = key
        self.sources: list[SDKEvent] = []
        """The events the platform pushed for the input event (``tag``)."""
        self._count = 0
        self._done = asyncio.Event()
        self._ids = itertools.count()

    def hold(self) -> None:
        self._count += 1
        self._done.clear()

    def release(self) -> None:
        self._count -= 1
        if self._count <= 0:
            self._done.set()

    @property
    def done(self) -> bool:
        """Nothing caused by the event is queued or running."""
        return self._done.is_set()

    async def wait(self) -> None:
        await self._done.wait()

    def next_id(self, kind: str) -> str:
        """``<kind>-<key>-<n>``: the n-th such id of this reaction. A worker that takes the call
        over and handles the same event again makes the same ids in the same order."""
        return f"{kind}-{self.key}-{next(self._ids)}"


CURRENT: ContextVar[Reaction | None] = ContextVar("callgate_reaction", default=None)
"""The reaction of the event the running node is processing (None: none, or untagged)."""


def tag(event: SDKEvent, reaction: Reaction) -> SDKEvent:
    """Make ``event``, pushed into a session for an input event, part of ``reaction``."""
    event._reaction = reaction
    reaction.sources.append(event)
    return event


def is_effect(event: SDKEvent) -> bool:
    """An event a node emitted for a tagged one (not a pushed event passed on to the output):
    what the consumer of the session's output must have acted on before the reaction is done."""
    reaction = event._reaction
    return reaction is not None and not any(event is s for s in reaction.sources)


def stamp(event: SDKEvent) -> None:
    """Give an event emitted while a tagged one is processed that event's reaction."""
    if event._reaction is None:
        event._reaction = CURRENT.get()


def hold(event: SDKEvent) -> None:
    reaction = event._reaction
    if reaction is not None:
        reaction.hold()


def release(event: SDKEvent | None) -> None:
    if event is None:
        return
    reaction = event._reaction
    if reaction is not None:
        reaction.release()
