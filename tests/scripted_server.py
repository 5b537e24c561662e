"""What the scripted OpenAI-compatible test servers (``tests/openai_server.py``,
``tests/openai_audio_server.py``) share: the ``Wait``/``Mark`` stream steps, OpenAI's error body,
and the server's lifecycle (a free loopback port, handlers tracked so that closing the server
cancels the ones still streaming)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Self

from aiohttp import web

__all__ = ["Mark", "ScriptedServer", "Wait", "openai_error"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, slots=True)
class Wait:
    """Hold the stream until ``event`` is set."""

    event: asyncio.Event


@dataclass(frozen=True, slots=True)
class Mark:
    """Set ``event`` once everything before this step has been written."""

    event: asyncio.Event


def openai_error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    """An error answer with OpenAI's error body."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return web.json_response(body, status=status)


class ScriptedServer:
    """Base of the scripted servers; a subclass adds its routes in :meth:`_routes`."""

    client_max_size = 1024**2  # aiohttp's default request body limit

    def __init__(self, *, host: str = "127.0.0.1") -> None:
        self._host = host
        self._port = 0
        self._runner: web.AppRunner | None = None
        self._handlers: set[asyncio.Task[Any]] = set()
        self._closing = False

    def _routes(self, app: web.Application) -> None:
        raise NotImplementedError

    async def start(self) -> None:
        app = web.Application(client_max_size=self.client_max_size)
        self._routes(app)
        # handler_cancellation: a client that goes away cancels its handler, which is how an
        # abandoned stream becomes visible to the test (``disconnected`` on the reply).
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self._host, 0).start()
        self._port = self._runner.addresses[0][1]

    async def aclose(self) -> None:
        self._closing = True
        for task in list(self._handlers):
            task.cancel()
        if self._handlers:
            await asyncio.wait(list(self._handlers))
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def base_url(self) -> str:
        """What to pass as ``base_url`` to an OpenAI client."""
        return f"http://{self._host}:{self._port}/v1"

    def _tracked(self, handler: Handler) -> Handler:
        """``handler``, registered while it runs (so :meth:`aclose` can cancel it)."""

        async def tracked(request: web.Request) -> web.StreamResponse:
            task = asyncio.current_task()
            assert task is not None
            self._handlers.add(task)
            try:
                return await handler(request)
            finally:
                self._handlers.discard(task)

        return tracked
