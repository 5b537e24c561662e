"""A local OpenAI-compatible audio server for tests: real HTTP, real multipart, real chunked audio.

* ``POST /v1/audio/transcriptions`` takes OpenAI's multipart form (``file``, ``model``, and the
  optional fields), and answers ``{"text": ...}`` (or plain text for ``response_format=text``).
* ``POST /v1/audio/speech`` takes OpenAI's JSON body (``model``, ``input``, ``voice``,
  ``response_format``...) and streams scripted audio bytes with chunked transfer encoding.

* ``GET /v1/realtime?intent=transcription`` (WebSocket): a Realtime transcription session as
  OpenAI's GA protocol has it: ``session.created``; ``session.update`` (``type:
  transcription``, an ``audio/pcmu``/``pcma``/``pcm`` input format) -> ``session.updated``;
  ``input_audio_buffer.append`` (base64 audio) -> the scripted text's words as
  ``conversation.item.input_audio_transcription.delta``, one per ``delta_every_ms`` of audio
  received (a streaming model); ``input_audio_buffer.commit`` -> ``input_audio_buffer.committed``,
  then after ``final_ms`` the words left and ``...transcription.completed``. A script can fail
  the session (an ``error`` event, ``...transcription.failed``, or the socket closed) after so
  much audio.

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
import base64
import binascii
import itertools
import json
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import BodyPartReader, WSMsgType, web

from .scripted_server import Mark, ScriptedReply, ScriptedServer, Wait, openai_error

__all__ = [
    "AudioServer",
    "Mark",
    "RealtimeReply",
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
class TranscriptionReply(ScriptedReply):
    """One scripted transcription answer."""

    text: str = ""
    wait: asyncio.Event | None = None


@dataclass(eq=False, slots=True)
class SpeechReply(ScriptedReply):
    """One scripted speech answer and what became of it."""

    steps: list[SpeechStep] = field(default_factory=list)
    content_type: str = "audio/pcm"

    @property
    def audio(self) -> bytes:
        """All the bytes this answer streams."""
        return b"".join(s for s in self.steps if isinstance(s, bytes))


# Bytes per millisecond of each realtime input format.
_REALTIME_RATES = {"audio/pcmu": 8, "audio/pcma": 8, "audio/pcm": 48}


@dataclass(eq=False, slots=True)
class RealtimeReply:
    """One scripted realtime transcription session and what became of it."""

    text: str = ""
    delta_every_ms: float = 200.0
    """One word of ``text`` as a delta per this much audio received; 0: all after the commit."""
    final_ms: float = 0.0
    """The rest of the words and ``completed`` this long after the commit (the provider's
    latency)."""
    final_text: str | None = None
    """The completed transcript, when it differs from the deltas' words (a model that revised
    its guess at the commit)."""
    fail: Literal["error", "failed", "close"] | None = None
    """How the session fails: an ``error`` event, ``...transcription.failed`` at the commit, or
    the socket closed (code 1011)."""
    fail_after_ms: float = 0.0
    """``error``/``close``: once this much audio has been received."""
    query: dict[str, str] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    session: dict[str, Any] | None = None  # what session.update set
    audio: bytearray = field(default_factory=bytearray)  # as received, in the session's format
    deltas: list[str] = field(default_factory=list)  # sent
    connected: asyncio.Event = field(default_factory=asyncio.Event)
    committed: asyncio.Event = field(default_factory=asyncio.Event)
    completed: asyncio.Event = field(default_factory=asyncio.Event)
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    committed_at: float | None = None  # loop time
    completed_at: float | None = None

    @property
    def audio_ms(self) -> float:
        """Milliseconds of audio received."""
        fmt = ((self.session or {}).get("audio", {}).get("input", {}).get("format", {}))
        return len(self.audio) / _REALTIME_RATES.get(fmt.get("type", "audio/pcm"), 48)


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
        self._realtime: deque[RealtimeReply] = deque()
        self.requests: list[RecordedAudioRequest] = []
        self._ids = itertools.count(1)

    def _routes(self, app: web.Application) -> None:
        # A client that goes away cancels its handler: SpeechReply.disconnected.
        app.router.add_post("/v1/audio/transcriptions", self._track(self._transcription))
        app.router.add_post("/v1/audio/speech", self._track(self._speak))
        app.router.add_get("/v1/realtime", self._track(self._realtime_session))

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

    def realtime(self, text: str, **script: Any) -> RealtimeReply:
        """Queue the next realtime transcription session (fields of :class:`RealtimeReply`)."""
        reply = RealtimeReply(text=text, **script)
        self._realtime.append(reply)
        return reply

    @property
    def pending(self) -> int:
        """Scripted answers not yet used, all endpoints together."""
        return len(self._transcriptions) + len(self._speech) + len(self._realtime)

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
        with self._streaming(reply):
            if reply.wait is not None:
                await reply.wait.wait()
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
        reply = self._start_reply(
            self._speech, recorded, "openai_audio_server: no scripted speech left")
        if isinstance(reply, web.Response):
            return reply
        response = web.StreamResponse(headers={"Content-Type": reply.content_type})
        response.enable_chunked_encoding()
        await response.prepare(request)
        with self._streaming(reply):
            for step in reply.steps:
                if isinstance(step, bytes):
                    await response.write(step)
                elif isinstance(step, Wait):
                    await step.event.wait()
                else:
                    step.event.set()
            await response.write_eof()
        return response

    # -- the realtime transcription session ----------------------------------------------
    async def _realtime_session(self, request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        if request.query.get("intent") != "transcription":
            return await self._rt_refuse(
                ws, "invalid_request_error",
                "openai_audio_server: only ?intent=transcription is served")
        if not self._realtime:
            return await self._rt_refuse(
                ws, "server_error", "openai_audio_server: no scripted realtime session left")
        reply = self._realtime.popleft()
        reply.query = dict(request.query)
        reply.headers = dict(request.headers)
        reply.connected.set()
        item = f"item_{next(self._ids)}"
        words = reply.text.split()
        sent = 0  # words sent as deltas
        await self._rt_send(ws, "session.created", session={"type": "transcription"})
        try:
            async for msg in ws:
                if msg.type is not WSMsgType.TEXT:
                    continue
                event = json.loads(msg.data)
                kind = event.get("type")
                if kind == "session.update":
                    session = event.get("session") or {}
                    fmt = session.get("audio", {}).get("input", {}).get("format", {})
                    if (session.get("type") != "transcription"
                            or fmt.get("type") not in _REALTIME_RATES):
                        await self._rt_error(ws, "invalid_request_error",
                                             f"unsupported session: {session!r}")
                        continue
                    reply.session = session
                    await self._rt_send(ws, "session.updated", session=session)
                elif kind == "input_audio_buffer.append":
                    try:
                        reply.audio += base64.b64decode(event.get("audio", ""), validate=True)
                    except binascii.Error:
                        await self._rt_error(ws, "invalid_request_error", "audio is not base64")
                        continue
                    if reply.fail in ("error", "close") and reply.audio_ms >= reply.fail_after_ms:
                        if reply.fail == "close":
                            await ws.close(code=1011, message=b"scripted failure")
                            break
                        await self._rt_error(ws, "server_error", "scripted session failure")
                        reply.fail = None
                        continue
                    while (reply.delta_every_ms > 0 and sent < len(words)
                           and reply.audio_ms >= (sent + 1) * reply.delta_every_ms):
                        sent = await self._rt_delta(ws, reply, item, words, sent)
                elif kind == "input_audio_buffer.commit":
                    if not reply.audio:
                        await self._rt_error(ws, "invalid_request_error",
                                             "buffer too small: 0.00ms of audio")
                        continue
                    reply.committed_at = asyncio.get_running_loop().time()
                    reply.committed.set()
                    await self._rt_send(ws, "input_audio_buffer.committed", item_id=item,
                                        previous_item_id=None)
                    if reply.final_ms:
                        await asyncio.sleep(reply.final_ms / 1000)
                    if reply.fail == "failed":
                        await self._rt_send(
                            ws, "conversation.item.input_audio_transcription.failed",
                            item_id=item, content_index=0,
                            error={"type": "server_error", "code": None,
                                   "message": "scripted transcription failure", "param": None})
                        continue
                    while sent < len(words):
                        sent = await self._rt_delta(ws, reply, item, words, sent)
                    reply.completed_at = asyncio.get_running_loop().time()
                    await self._rt_send(ws, "conversation.item.input_audio_transcription.completed",
                                        item_id=item, content_index=0,
                                        transcript=reply.final_text or reply.text)
                    reply.completed.set()
        except asyncio.CancelledError:
            if not self._closing:
                reply.disconnected.set()
            raise
        reply.disconnected.set()
        return ws

    async def _rt_refuse(self, ws: web.WebSocketResponse, kind: str,
                         message: str) -> web.WebSocketResponse:
        """An ``error`` event, then the socket stays open (as OpenAI's does) until the client
        goes."""
        await self._rt_error(ws, kind, message)
        async for _ in ws:
            pass
        return ws

    async def _rt_delta(self, ws: web.WebSocketResponse, reply: RealtimeReply, item: str,
                        words: list[str], sent: int) -> int:
        delta = words[sent] if sent == 0 else " " + words[sent]
        reply.deltas.append(delta)
        await self._rt_send(ws, "conversation.item.input_audio_transcription.delta",
                            item_id=item, content_index=0, delta=delta)
        return sent + 1

    async def _rt_send(self, ws: web.WebSocketResponse, kind: str, **fields: Any) -> None:
        await ws.send_json({"type": kind, "event_id": f"event_{next(self._ids)}", **fields})

    async def _rt_error(self, ws: web.WebSocketResponse, kind: str, message: str) -> None:
        await self._rt_send(ws, "error", error={"type": kind, "code": None, "message": message,
                                                "param": None, "event_id": None})
