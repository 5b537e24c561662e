"""Agents for the fault tests, loaded by real ``callgate worker`` processes from a YAML config."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from nodes import OutputAgentNode, SDKEvent, SDKSystemUserDTMFEvent

__all__ = ["DTMF_AGENTS_YAML", "DtmfEcho", "Stubborn"]

# A config's agents for DtmfEcho; key presses do not interrupt the bot (an interrupt would drop
# a queued answer, which is not what the tests that count answers count).
DTMF_AGENTS_YAML = """\
default_agent: dtmf
agents:
  dtmf:
    barge_in:
      dtmf_interrupts: false
    nodes:
      - {kind: python, name: echo, ref: "tests.faults._agents:DtmfEcho"}
"""


class DtmfEcho(OutputAgentNode):
    """Answers every key press with "You pressed <digit>" (one utterance per key press), so a
    key press handled twice is heard twice."""

    async def process_event(self, event: SDKEvent) -> None:
        if isinstance(event, SDKSystemUserDTMFEvent):
            await self.speak(f"You pressed {event.digit}")
        await super().process_event(event)

    async def generate_response(self) -> AsyncIterator[str]:
        yield "Press a key."


class Stubborn(DtmfEcho):
    """Answers a key press, then ignores every cancellation for good (a bug in an agent): a
    worker told to stop must exit all the same, abandoning the call."""

    async def process_event(self, event: SDKEvent) -> None:
        if isinstance(event, SDKSystemUserDTMFEvent):
            await self.speak(f"You pressed {event.digit}")
            while True:
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    continue
        await OutputAgentNode.process_event(self, event)
