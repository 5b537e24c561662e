"""A local server speaking the OpenAI HTTP protocol with the latencies of hosted providers, for
``bench.turns``: real HTTP on loopback, the ``openai`` client on the other side.

* ``POST /v1/audio/transcriptions`` (multipart, as the SDK sends it): ``{"text": ...}`` after
  ``stt_ms`` (the file is read in full first, so the clock starts when the upload is done):
  always :attr:`OpenAIStub.TRANSCRIPT` (the stub LLM's reply does not read it; the gateway's
  turn detector does, when the upload, sent at ``turn_likely``, comes back during the wait: a
  callgate row run with ``--stt upload`` reads this stand-in, not the caller's words).
* ``GET /v1/realtime?intent=transcription`` (WebSocket, OpenAI's Realtime transcription
  protocol): the caller's own words, as a streaming model would hear them. The session's first
  100 ms of audio are found byte for byte in one of the recordings it was given
  (:class:`CallerSpeech`: the replay relays a recording's mu-law unchanged), which places the
  session in that recording; then each word said in it goes out as a ``...transcription.delta``
  once the audio appended reaches ``partial_lag_ms`` past the word's end, and the words heard
  (begun before the last audio appended) with ``...transcription.completed`` ``stt_ms`` after
  ``input_audio_buffer.commit``. A session in speech with no labelled words gets the fixed
  :attr:`OpenAIStub.TRANSCRIPT` as its final (no partials: the detector has prosody alone), one
  with no speech (noise the VAD took for the caller) an empty final; one not found in any
  recording the fixed sentence too, and is counted (:attr:`RealtimeSession.recording` None).
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
from aiohttp import WSMsgType, web

__all__ = ["CallerSpeech", "Latencies", "OpenAIStub", "RealtimeSession"]


@dataclass(frozen=True, slots=True)
class Latencies:
    """Provider latencies in ms (defaults close to hosted services)."""

    stt_ms: float = 150.0
    """Final transcript after the audio is uploaded."""
    llm_ms: float = 350.0
    """First streamed token after the request."""
    tts_ms: float = 200.0
    """First audio byte after the request."""
    partial_lag_ms: float = 250.0
    """Realtime transcription: a word's partial goes out once the audio received reaches this
    far past the word's end (a streaming recogniser's lag; bench.turn_end's ``FIT_LAG_MS``)."""


Word = tuple[str, float, float]
"""(word, start ms, end ms) in the recording."""

LOCATE_MS = 100.0
"""Audio a realtime session needs before it is looked up in the recordings (more, up to
``LOCATE_MAX_MS``, while the lookup finds more than one place)."""
LOCATE_MAX_MS = 1000.0


@dataclass(frozen=True, slots=True)
class CallerSpeech:
    """One recording's caller, as the realtime transcription hears it."""

    audio: bytes
    """The recording's mu-law as the gateway's realtime stream sends it (decoded to PCM16 and
    encoded again: the same bytes for every code but the two zeros), to find a session in."""
    words: Sequence[Word]
    """The words said, with their times (a forced alignment, or a labelled text spread over
    its speech event), in time order."""
    unlabelled: Sequence[tuple[float, float]] = ()
    """Speech events (start, end ms) with no text anywhere: a session in one of these is
    answered with the fixed sentence."""


@dataclass(slots=True)
class RealtimeSession:
    """What one realtime transcription session was found to be, and what it sent."""

    recording: str | None = None
    """The recording its audio was found in; None: in none (or in several) of them."""
    offset_ms: float = 0.0
    """Where its first audio sits in the recording."""
    partials: list[tuple[float, str]] = field(default_factory=list)
    """(ms of session audio received when sent, the text so far), per delta."""
    final: str | None = None
    """The completed transcript (None: never committed)."""


class OpenAIStub:
    """``async with OpenAIStub(latencies) as stub: stub.base_url`` -> ``http://127.0.0.1:P/v1``."""

    REPLY = "Sure, I can help you with that."
    TRANSCRIPT = "I would like to check my balance please"

    def __init__(self, latencies: Latencies | None = None,
                 callers: Mapping[str, CallerSpeech] | None = None) -> None:
        self.latencies = latencies or Latencies()
        self.callers = dict(callers or {})
        """Per recording name, its caller (the realtime sessions are found in these)."""
        self.requests: list[tuple[str, float]] = []  # (path, perf_counter at arrival)
        self.sessions: list[RealtimeSession] = []
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
        session = RealtimeSession()
        self.sessions.append(session)
        audio = bytearray()
        script: list[tuple[float, float, str]] | None = None  # (start, due, word): session ms
        sent = 0
        ids = iter(range(1, 1 << 30))

        async def send(kind: str, **fields: object) -> None:
            await ws.send_json({"type": kind, "event_id": f"event_{next(ids)}", **fields})

        async def deltas(until: int) -> None:
            nonlocal sent
            assert script is not None
            for _, _, word in script[sent:until]:
                await send("conversation.item.input_audio_transcription.delta",
                           item_id="item_1", content_index=0,
                           delta=word if sent == 0 else " " + word)
                sent += 1
                session.partials.append((len(audio) / 8, " ".join(w for _, _, w in
                                                                  script[:sent])))

        await send("session.created", session={"type": "transcription"})
        async for msg in ws:
            if msg.type is not WSMsgType.TEXT:
                continue
            event = json.loads(msg.data)
            kind = event.get("type")
            if kind == "session.update":
                await send("session.updated", session=event.get("session"))
            elif kind == "input_audio_buffer.append":
                audio += base64.b64decode(event.get("audio", ""))
                received = len(audio) / 8  # mu-law: 8 bytes per ms
                if script is None and received >= LOCATE_MS:
                    script = self._locate(session, bytes(audio), final=received >= LOCATE_MAX_MS)
                if script:
                    # Words go out in order, each once it is due (a word overlapping the one
                    # before it waits for it).
                    due = sent
                    while due < len(script) and script[due][1] <= received:
                        due += 1
                    await deltas(due)
            elif kind == "input_audio_buffer.commit":
                await send("input_audio_buffer.committed", item_id="item_1",
                           previous_item_id=None)
                if script is None:
                    script = self._locate(session, bytes(audio), final=True)
                await asyncio.sleep(self.latencies.stt_ms / 1000)
                heard = [w for w in script or () if w[0] < len(audio) / 8]
                await deltas(len(heard))
                session.final = (" ".join(w for _, _, w in heard) if heard
                                 else self._no_words(session, len(audio) / 8))
                await send("conversation.item.input_audio_transcription.completed",
                           item_id="item_1", content_index=0, transcript=session.final)
        return ws

    def _locate(self, session: RealtimeSession, audio: bytes,
                final: bool) -> list[tuple[float, float, str]] | None:
        """Find the session's audio in the callers' recordings; its words as (start, due,
        word) in session ms. None: not found in exactly one place yet (``final``: for good,
        an empty script)."""
        hits: list[tuple[str, int]] = []
        for name, caller in self.callers.items():
            at = caller.audio.find(audio)
            while at >= 0 and len(hits) < 2:
                hits.append((name, at))
                at = caller.audio.find(audio, at + 1)
        if len(hits) != 1:
            return [] if final else None
        name, at = hits[0]
        session.recording, session.offset_ms = name, at / 8
        lag = self.latencies.partial_lag_ms
        off = session.offset_ms
        return [(s0 - off, s1 - off + lag, w) for w, s0, s1 in self.callers[name].words
                if s0 >= off]

    def _no_words(self, session: RealtimeSession, received_ms: float) -> str:
        """The final of a session that heard no labelled word: the fixed sentence for speech
        without a text (and for a session found nowhere), nothing for noise."""
        if session.recording is None:
            return self.TRANSCRIPT
        a, b = session.offset_ms, session.offset_ms + received_ms
        spans = self.callers[session.recording].unlabelled
        return self.TRANSCRIPT if any(s0 < b and s1 > a for s0, s1 in spans) else ""

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
