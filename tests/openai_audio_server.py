"""A local OpenAI-compatible audio server for tests: real HTTP, real multipart, real chunked audio.

* ``POST /v1/audio/transcriptions`` takes OpenAI's multipart form (``file``, ``model``, and the
  optional fields), and answers ``{"text": ...}`` (or plain text for ``response_format=text``).
* ``POST /v1/audio/speech`` takes OpenAI's JSON body (``model``, ``input``, ``voice``,
  ``response_format``...) and streams scripted audio bytes with chunked transfer encoding.

Answers come from per-endpoint queues of scripts::

    server.transcribe("go forward ten meters")
    reply = server.speak(pcm[:4800], Wait(gate), pcm[4800:], content_type="audio/pcm")

A speech script is a list of steps: ``bytes`` (written as one chunk), ``Wait(event)`` (hold the
stream until the test sets it), ``Mark(event)`` (set it once everything before has been written).
Every request is recorded with its form fields, uploaded files or JSON body, and each reply tells
what became of it (``started``, ``finished``, ``disconnected``). Requests without a bearer token,
or missing what OpenAI requires, get a 4xx with OpenAI's error body.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from aiohttp import BodyPartReader, web

from .scripted_server import Mark, ScriptedServer, Wait, openai_error

__all__ = [
    "AudioServer",
    "Mark",
    "RecordedAudioRequest",
    "SpeechReply",
    "TranscriptionReply",
    "UploadedFile",
    "Wait",
]


SpeechStep = bytes | Wait | Mark


@dataclass(frozen=True, slots=True)
class UploadedFile:
    """A file part of a multipart request."""

    filename: str | None
    content_type: str
    data: bytes


@dataclass(slots=True)
class RecordedAudioRequest:
    """A request as the server received it."""

    path: str
    headers: dict[str, str]
    fields: dict[str, str] = field(default_factory=dict)  # multipart text fields
    files: dict[str, UploadedFile] = field(default_factory=dict)  # multipart file parts
    body: dict[str, Any] = field(default_factory=dict)  # JSON body


@dataclass(eq=False, slots=True)
class _Reply:
    status: int = 200
    error_message: str = ""
    request: RecordedAudioRequest | None = None
    started: asyncio.Event = field(default_factory=asyncio.Event)
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(eq=False, slots=True)
class TranscriptionReply(_Reply):
    """One scripted transcription answer."""

    text: str = ""
    wait: asyncio.Event | None = None


@dataclass(eq=False, slots=True)
class SpeechReply(_Reply):
    """One scripted speech answer and what became of it."""

    steps: list[SpeechStep] = field(default_factory=list)
    content_type: str = "audio/pcm"

    @property
    def audio(self) -> bytes:
        """All the bytes this answer streams."""
        return b"".join(s for s in self.steps if isinstance(s, bytes))




class AudioServer(ScriptedServer):
    """The server; ``async with AudioServer() as server: ... server.base_url``.

    Args:
        host: Interface to listen on (a free port is picked).
    """

    client_max_size = 64 * 1024 * 1024  # uploaded utterances

    def __init__(self, *, host: str = "127.0.0.1") -> None:
        super().__init__(host=host)
        self._transcriptions: deque[TranscriptionReply] = deque()
        self._speech: deque[SpeechReply] = deque()
        self.requests: list[RecordedAudioRequest] = []

    def _routes(self, app: web.Application) -> None:
        # A client that goes away cancels its handler: SpeechReply.disconnected.
        app.router.add_post("/v1/audio/transcriptions", self._track(self._transcription))
        app.router.add_post("/v1/audio/speech", self._track(self._speak))

    # -- scripting --------------------------------------------------------------------------
    def transcribe(self, text: str, *, wait: asyncio.Event | None = None) -> TranscriptionReply:
        """Queue the text of the next transcription request, held until ``wait`` is set if given."""
        reply = TranscriptionReply(text=text, wait=wait)
        self._transcriptions.append(reply)
        return reply

    def fail_transcription(self, status: int, message: str) -> TranscriptionReply:
        """Queue an error answer for the next transcription request."""
        reply = TranscriptionReply(status=status, error_message=message)
        self._transcriptions.append(reply)
        return reply

    def speak(self, *steps: SpeechStep, content_type: str = "audio/pcm") -> SpeechReply:
        """Queue the audio of the next speech request, streamed step by step."""
        reply = SpeechReply(steps=list(steps), content_type=content_type)
        self._speech.append(reply)
        return reply

    def fail_speech(self, status: int, message: str) -> SpeechReply:
        """Queue an error answer for the next speech request."""
        reply = SpeechReply(status=status, error_message=message)
        self._speech.append(reply)
        return reply

    @property
    def pending(self) -> int:
        """Scripted answers not yet used, both endpoints together."""
        return len(self._transcriptions) + len(self._speech)

    # -- serving ----------------------------------------------------------------------------
    def _track(self, handler: Any) -> Any:
        async def authorized(request: web.Request) -> web.StreamResponse:
            if not request.headers.get("Authorization", "").startswith("Bearer "):
                return openai_error(401, "You didn't provide an API key.", "invalid_api_key")
            response: web.StreamResponse = await handler(request)
            return response

        return self._tracked(authorized)

    async def _transcription(self, request: web.Request) -> web.StreamResponse:
        if not request.content_type.startswith("multipart/form-data"):
            return openai_error(400, "Invalid Content-Type header: expected multipart/form-data")
        recorded = RecordedAudioRequest(request.path, dict(request.headers))
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            assert isinstance(part, BodyPartReader)
            name = part.name or ""
            if part.filename is not None:
                content_type = part.headers.get("Content-Type", "application/octet-stream")
                recorded.files[name] = UploadedFile(part.filename, content_type, await part.read())
            else:
                recorded.fields[name] = await part.text()
        self.requests.append(recorded)
        if "file" not in recorded.files:
            return openai_error(400, "you must provide a file parameter")
        if not recorded.fields.get("model"):
            return openai_error(400, "you must provide a model parameter")
        if not self._transcriptions:
            return openai_error(
                500, "openai_audio_server: no scripted transcription left", "server_error"
            )
        reply = self._transcriptions.popleft()
        reply.request = recorded
        reply.started.set()
        if reply.wait is not None:
            try:
                await reply.wait.wait()
            except asyncio.CancelledError:
                if not self._closing:
                    reply.disconnected.set()
                raise
        reply.finished.set()
        if reply.status != 200:
            return openai_error(reply.status, reply.error_message, "server_error")
        if recorded.fields.get("response_format") == "text":
            return web.Response(text=reply.text)
        return web.json_response({"text": reply.text})

    async def _speak(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return openai_error(400, "We could not parse the JSON body of your request.")
        if not isinstance(body, dict):
            return openai_error(400, "the request body must be a JSON object")
        recorded = RecordedAudioRequest(request.path, dict(request.headers), body=body)
        self.requests.append(recorded)
        for name in ("model", "input", "voice"):
            if not isinstance(body.get(name), str) or not body[name]:
                return openai_error(400, f"you must provide a {name} parameter")
        if not self._speech:
            return openai_error(500, "openai_audio_server: no scripted speech left", "server_error")
        reply = self._speech.popleft()
        reply.request = recorded
        reply.started.set()
        if reply.status != 200:
            reply.finished.set()
            return openai_error(reply.status, reply.error_message, "server_error")
        response = web.StreamResponse(headers={"Content-Type": reply.content_type})
        response.enable_chunked_encoding()
        await response.prepare(request)
        try:
            for step in reply.steps:
                if isinstance(step, bytes):
                    await response.write(step)
                elif isinstance(step, Wait):
                    await step.event.wait()
                else:
                    step.event.set()
            await response.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            if not self._closing:
                reply.disconnected.set()
            raise
        reply.finished.set()
        return response
