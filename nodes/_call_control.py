"""Acting on the phone call itself: hang up or transfer, through Twilio's REST API.

``TwilioCallControl`` wraps a ``twilio.rest.Client`` (or anything with the same
``client.calls(sid).update(...)`` shape, which is how tests inject a recording fake). The Twilio
client is synchronous, so each request runs in a worker thread and never blocks the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from twilio.base.exceptions import TwilioRestException
from twilio.twiml.voice_response import VoiceResponse

from ._errors import CallControlError

__all__ = ["CallControl", "TwilioCallControl", "transfer_twiml"]


class CallControl(Protocol):
    """What the worker needs to end or transfer a call."""

    async def end_call(self, call_sid: str) -> None: ...

    async def transfer_call(self, call_sid: str, to: str) -> None: ...


def transfer_twiml(to: str) -> str:
    """TwiML that connects the caller to ``to``: ``<Response><Dial>to</Dial></Response>``."""
    response = VoiceResponse()
    response.dial(to)
    return str(response)


class TwilioCallControl:
    """End or transfer calls with Twilio's REST API.

    Args:
        client: A ``twilio.rest.Client``.
    """

    def __init__(self, client: Any) -> None:
        self._client = client

    async def _update(self, call_sid: str, **fields: str) -> None:
        try:
            await asyncio.to_thread(lambda: self._client.calls(call_sid).update(**fields))
        except TwilioRestException as exc:
            raise CallControlError(f"Twilio refused to update call {call_sid}: {exc}") from exc

    async def end_call(self, call_sid: str) -> None:
        """``calls(sid).update(status="completed")``."""
        await self._update(call_sid, status="completed")

    async def transfer_call(self, call_sid: str, to: str) -> None:
        """``calls(sid).update(twiml=<Response><Dial>to</Dial></Response>)``."""
        await self._update(call_sid, twiml=transfer_twiml(to))
