"""Agents for the fault tests, loaded by real ``callgate worker`` processes from a YAML config."""

from __future__ import annotations

from collections.abc import AsyncIterator

from nodes import OutputAgentNode, SDKEvent, SDKSystemUserDTMFEvent

__all__ = ["DtmfEcho"]


class DtmfEcho(OutputAgentNode):
    """Answers every key press with "You pressed <digit>" (one utterance per key press), so a
    key press handled twice is heard twice."""

    async def process_event(self, event: SDKEvent) -> None:
        if isinstance(event, SDKSystemUserDTMFEvent):
            await self.speak(f"You pressed {event.digit}")
        await super().process_event(event)

    async def generate_response(self) -> AsyncIterator[str]:
        yield "Press a key."
