"""The softphone console: talk to an agent from a browser, and watch the call.

``GET /console`` serves a static page (``gateway/static/``: HTML and vanilla JS, no build step).
The page captures the microphone through an AudioWorklet, resamples it to 8 kHz, encodes
mu-law and speaks Twilio Media Streams over a WebSocket to the same ``/twilio/media`` handler
real calls use: ``connected``, ``start`` (with a call token issued for the console call),
``media`` every 20 ms, ``dtmf`` from its keypad, ``mark`` echoed once the page has played the
audio before it, ``stop`` on hang-up. ``clear`` drops the audio not yet played at once and
echoes its pending marks, as Twilio does. The call's timeline comes from the ops stream
(:mod:`gateway.ops`).

* ``GET /console/agents``: the agents and numbers a console call may choose.
* ``POST /console/call`` ``{"agent"?: name, "to"?: number}``: a new console call: ``call_sid``
  (``CA`` + 32 hex), ``stream_sid``, the agent, the call token for ``start``, and the paths of
  the media socket and of the call's ops stream.

A browser cannot send ``X-Twilio-Signature``: the media socket admits a console call without
one when its URL carries that call's token (``?console=TOKEN&call_sid=CA...``,
:meth:`Console.admits`); the ``start`` message must then carry the same token, as for any call.
Everything here is behind the ops token when one is configured (:func:`gateway.ops.authorized`).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from aiohttp import web

from .ops import OpsSettings, authorized
from .security import CallTokens, InvalidToken

__all__ = ["STATIC", "Console"]

STATIC = Path(str(resources.files("gateway") / "static"))
"""The page's files (package data)."""

_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}


class Console:
    """The console's routes on one gateway."""

    def __init__(self, settings: OpsSettings, tokens: CallTokens,
                 agent_for_number: Callable[[str | None], str]) -> None:
        self.settings = settings
        self.tokens = tokens
        self._agent_for_number = agent_for_number

    def admits(self, request: web.Request) -> bool:
        """A media socket opened by the console for a call it was issued (no Twilio
        signature: browsers cannot send one)."""
        token, call_sid = request.query.get("console"), request.query.get("call_sid", "")
        if not token:
            return False
        try:
            self.tokens.verify(token, call_sid=call_sid)
        except InvalidToken:
            return False
        return True

    def _check(self, request: web.Request) -> None:
        if not authorized(self.settings, request):
            raise web.HTTPUnauthorized(text="ops token required (Authorization: Bearer, or "
                                            "?token=)")

    async def page(self, request: web.Request) -> web.StreamResponse:
        self._check(request)
        return self._file("console.html")

    async def static(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if "/" in name or name.startswith(".") or Path(name).suffix not in _TYPES:
            raise web.HTTPNotFound()
        return self._file(name)

    @staticmethod
    def _file(name: str) -> web.Response:
        path = STATIC / name
        if not path.is_file():
            raise web.HTTPNotFound()
        return web.Response(body=path.read_bytes(), content_type=_TYPES[path.suffix],
                            headers={"Cache-Control": "no-cache"})

    async def agents(self, request: web.Request) -> web.Response:
        self._check(request)
        return web.json_response({"agents": self.settings.agents(),
                                  "numbers": self.settings.numbers()})

    async def call(self, request: web.Request) -> web.Response:
        self._check(request)
        try:
            body = await request.json() if request.can_read_body else {}
        except ValueError:
            raise web.HTTPBadRequest(text="expected a JSON object") from None
        if not isinstance(body, dict):
            raise web.HTTPBadRequest(text="expected a JSON object")
        agent, to = body.get("agent") or None, body.get("to") or None
        known = self.settings.agents()
        if agent is not None and agent not in known:
            raise web.HTTPBadRequest(text=f"unknown agent {agent!r}; agents: {', '.join(known)}")
        if agent is None:
            agent = self._agent_for_number(to)
        call_sid = "CA" + secrets.token_hex(16)
        token = self.tokens.issue(call_sid, agent)
        return web.json_response({
            "call_sid": call_sid, "stream_sid": "MZ" + secrets.token_hex(16),
            "account_sid": "AC" + "0" * 32, "agent": agent, "to": to or "",
            "from": "console", "token": token,
            "media_path": f"/twilio/media?console={token}&call_sid={call_sid}",
            "events_path": f"/ops/calls/{call_sid}/events",
        })

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/console", self.page), web.get("/console/static/{name}", self.static),
                web.get("/console/agents", self.agents), web.post("/console/call", self.call)]
