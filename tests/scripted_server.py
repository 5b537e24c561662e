"""What the scripted OpenAI-compatible test servers (``tests/openai_server.py``,
``tests/openai_audio_server.py``) share: the ``Wait``/``Mark`` stream steps, OpenAI's error body,
and the server's lifecycle (a free loopback port, handlers tracked so that closing the server
cancels the ones still streaming)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Self

from aiohttp import web

__all__ = ["Mark", "ScriptedReply", "ScriptedServer", "Wait", "openai_error"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, slots=True)
class Wait:
    """Hold the stream until ``event`` is set."""

    event: asyncio.Event


@dataclass(frozen=True, slots=True)
class Mark:
    """Set ``event`` once everything before this step has been written."""

    event: asyncio.Event


@dataclass(eq=False, slots=True, kw_only=True)
class ScriptedReply:
    """What every scripted answer has: an error to answer with instead (``status`` other than
    200), the request it answered, and what became of it."""

    status: int = 200
    error_message: str = ""
    request: Any = None
    started: asyncio.Event = field(default_factory=asyncio.Event)
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)


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

    @staticmethod
    def _start_reply(queue: deque[Any], recorded: Any, none_left: str) -> Any:
        """The next scripted reply of ``queue``, started for the ``recorded`` request; or the
        answer to send instead: a 500 saying ``none_left`` when the queue is empty, the scripted
        error (the reply finished at once) when the reply is one."""
        if not queue:
            return openai_error(500, none_left, "server_error")
        reply = queue.popleft()
        reply.request = recorded
        reply.started.set()
        if reply.status != 200:
            reply.finished.set()
            return openai_error(reply.status, reply.error_message, "server_error")
        return reply

    @contextlib.contextmanager
    def _streaming(self, reply: ScriptedReply) -> Iterator[None]:
        """Around sending ``reply``: ``disconnected`` when the client goes away meanwhile (not
        when the server is closing), ``finished`` when all of it was sent."""
        try:
            yield
        except (asyncio.CancelledError, ConnectionResetError):
            if not self._closing:
                reply.disconnected.set()
            raise
        reply.finished.set()
