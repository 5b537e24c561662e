"""A local server speaking the OpenAI HTTP protocol with the latencies of hosted providers, for
``bench.turns``: real HTTP on loopback, the ``openai`` client on the other side.

* ``POST /v1/audio/transcriptions`` (multipart, as the SDK sends it): ``{"text": ...}`` after
  ``stt_ms`` (the file is read in full first, so the clock starts when the upload is done).
* ``GET /v1/realtime?intent=transcription`` (WebSocket, OpenAI's Realtime transcription
  protocol): a word of the transcript as a ``...transcription.delta`` per ``delta_every_ms``
  of audio appended (a streaming model hears the turn as it is spoken), and the rest with
  ``...transcription.completed`` ``stt_ms`` after ``input_audio_buffer.commit``.
* ``POST /v1/chat/completions`` with ``stream: true``: server-sent events, the first content
  token after ``llm_ms``, the rest right behind it.
* ``POST /v1/audio/speech`` (``response_format: pcm``): 24 kHz 16-bit PCM, chunked, the first
  byte after ``tts_ms``: a voiced buzz as long as the text at ~65 ms per character, capped.

bench/ may not import tests/, so this is the bench's own small server.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from aiohttp import WSMsgType, web

__all__ = ["Latencies", "OpenAIStub"]


@dataclass(frozen=True, slots=True)
class Latencies:
    """Provider latencies in ms (defaults close to hosted services)."""

    stt_ms: float = 150.0
    """Final transcript after the audio is uploaded."""
    llm_ms: float = 350.0
    """First streamed token after the request."""
    tts_ms: float = 200.0
    """First audio byte after the request."""
    delta_every_ms: float = 250.0
    """Realtime transcription: a partial word per this much audio received."""


class OpenAIStub:
    """``async with OpenAIStub(latencies) as stub: stub.base_url`` -> ``http://127.0.0.1:P/v1``."""

    REPLY = "Sure, I can help you with that."
    TRANSCRIPT = "I would like to check my balance please"

    def __init__(self, latencies: Latencies | None = None) -> None:
        self.latencies = latencies or Latencies()
        self.requests: list[tuple[str, float]] = []  # (path, perf_counter at arrival)
        self._runner: web.AppRunner | None = None
        self.base_url = ""

    async def __aenter__(self) -> OpenAIStub:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/audio/transcriptions", self._transcribe)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/audio/speech", self._speech)
        app.router.add_get("/v1/realtime", self._realtime)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.base_url = f"http://127.0.0.1:{port}/v1"
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _transcribe(self, request: web.Request) -> web.Response:
        await request.post()  # the whole multipart upload
        self.requests.append((request.path, time.perf_counter()))
        await asyncio.sleep(self.latencies.stt_ms / 1000)
        return _closing(web.json_response({"text": self.TRANSCRIPT}))

    async def _realtime(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        self.requests.append((request.path, time.perf_counter()))
        words, sent, received = self.TRANSCRIPT.split(" "), 0, 0
        ids = iter(range(1, 1 << 30))

        async def send(kind: str, **fields: object) -> None:
            await ws.send_json({"type": kind, "event_id": f"event_{next(ids)}", **fields})

        async def delta() -> None:
            nonlocal sent
            await send("conversation.item.input_audio_transcription.delta", item_id="item_1",
                       content_index=0, delta=words[sent] if sent == 0 else " " + words[sent])
            sent += 1

        await send("session.created", session={"type": "transcription"})
        async for msg in ws:
            if msg.type is not WSMsgType.TEXT:
                continue
            event = json.loads(msg.data)
            kind = event.get("type")
            if kind == "session.update":
                await send("session.updated", session=event.get("session"))
            elif kind == "input_audio_buffer.append":
                received += len(base64.b64decode(event.get("audio", ""))) // 8  # mu-law: ms
                while sent < len(words) and received >= (sent + 1) * self.latencies.delta_every_ms:
                    await delta()
            elif kind == "input_audio_buffer.commit":
                await send("input_audio_buffer.committed", item_id="item_1",
                           previous_item_id=None)
                await asyncio.sleep(self.latencies.stt_ms / 1000)
                while sent < len(words):
                    await delta()
                await send("conversation.item.input_audio_transcription.completed",
                           item_id="item_1", content_index=0, transcript=self.TRANSCRIPT)
        return ws

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append((request.path, time.perf_counter()))
        words = self.REPLY.split(" ")
        await asyncio.sleep(self.latencies.llm_ms / 1000)
        if not body.get("stream"):
            return _closing(web.json_response(_completion(self.REPLY, body.get("model", "stub"))))
        resp = _closing(web.StreamResponse(headers={"Content-Type": "text/event-stream"}))
        try:  # the gateway cancels a reply the caller did not wait for: the client goes away
            await resp.prepare(request)
            for i, word in enumerate(words):
                piece = word if i == 0 else " " + word
                await resp.write(_sse(_chunk(piece, body.get("model", "stub"))))
            await resp.write(_sse(_chunk(None, body.get("model", "stub"), finish="stop")))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            pass
        return resp

    async def _speech(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append((request.path, time.perf_counter()))
        await asyncio.sleep(self.latencies.tts_ms / 1000)
        seconds = min(3.0, 0.065 * len(str(body.get("input", ""))))
        pcm = _buzz(seconds)
        resp = _closing(web.StreamResponse(headers={"Content-Type": "audio/pcm"}))
        try:
            await resp.prepare(request)
            step = 4800  # 100 ms at 24 kHz, 16-bit
            for i in range(0, len(pcm), step):
                await resp.write(pcm[i:i + step])
            await resp.write_eof()
        except ConnectionResetError:
            pass
        return resp


_R = TypeVar("_R", bound=web.StreamResponse)


def _closing(resp: _R) -> _R:
    """No keep-alive: the clients of the gateway and worker pool their connections, and a pooled
    connection to a stub that is gone is a transport nobody closes."""
    resp.force_close()
    return resp


def _buzz(seconds: float) -> bytes:
    t = np.arange(int(24000 * seconds)) / 24000
    x = np.zeros(len(t))
    for k in range(1, 10):
        x += np.sin(2 * np.pi * 140 * k * t) / k
    x = 0.2 * x / np.max(np.abs(x)) if len(x) else x
    return (np.asarray(x) * 32767).astype("<i2").tobytes()


def _sse(obj: dict[str, object]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _chunk(content: str | None, model: str, finish: str | None = None) -> dict[str, object]:
    delta: dict[str, object] = {} if content is None else {"role": "assistant", "content": content}
    return {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "created": 0,
            "model": model, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def _completion(text: str, model: str) -> dict[str, object]:
    return {"id": "chatcmpl-stub", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
