"""Stand-in agents for the gateway's tests: they claim calls on a bus, see every uplink event
(acking each after it was handled) and say a canned utterance when asked to."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from bus import Bus, Event

React = Callable[[str, Event], Awaitable[None]]
"""``(call_sid, event)``: what a stand-in agent does with one uplink event."""


async def serve(bus: Bus, consumer: str, react: React, *, until_call_ended: bool = True) -> None:
    """Claim calls on ``bus`` as ``consumer`` and hand each uplink event to ``react``, then ack
    it; return after the first ``call_ended`` (or, with ``until_call_ended=False``, never)."""
    async for call in bus.claim_calls(consumer):
        async for m in bus.uplink(call.call_sid, consumer):
            await react(call.call_sid, m.event)
            await bus.ack(call.call_sid, m.id)
            if until_call_ended and m.event["type"] == "call_ended":
                return


def recording(into: list[Event]) -> React:
    """A reaction that keeps every event in ``into`` and does nothing else."""

    async def record(call_sid: str, event: Event) -> None:
        into.append(event)

    return record


async def say(
    bus: Bus,
    call_sid: str,
    *audio: dict[str, Any],
    utterance_id: str = "u1",
    node: str = "greeter",
    interruptible: bool = True,
) -> None:
    """One utterance on the downlink: its start, an ``audio`` event of each of ``audio``'s
    fields (``payload``, text spans), its end."""
    await bus.send(call_sid, {"type": "utterance_start", "utterance_id": utterance_id,
                              "node": node, "interruptible": interruptible})
    for fields in audio:
        await bus.send(call_sid, {"type": "audio", "utterance_id": utterance_id, **fields})
    await bus.send(call_sid, {"type": "utterance_end", "utterance_id": utterance_id})
