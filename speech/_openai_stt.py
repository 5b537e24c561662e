"""Speech to text through OpenAI (or any compatible server), two transports.

``transport="upload"``: the transcription endpoint takes a whole file, so a stream only buffers:
``finish()`` uploads the utterance as a 16-bit PCM WAV at the rate it was fed (8 kHz on the
phone leg, 16 kB per second of speech) to ``POST {base_url}/audio/transcriptions`` and returns
its text. No interim results: the final comes one whole request after the turn's end.

``transport="realtime"``: a Realtime transcription session per utterance over WebSocket
(``{base_url}/realtime?intent=transcription`` through ``AsyncOpenAI.realtime.connect``). The
connection opens when the stream does (the caller's first words), ``session.update`` sets
``type: transcription`` with G.711 mu-law input (``audio/pcmu``: what the phone line carries, 8
kB per second), the given model, and no server turn detection (the gateway decides the turn);
audio goes out as ``input_audio_buffer.append`` while the caller speaks; ``partials()`` yields
the ``conversation.item.input_audio_transcription.delta`` text as it grows; ``finish()`` sends
``input_audio_buffer.commit`` and returns the ``...transcription.completed`` transcript, which a
streaming model (``gpt-live-transcribe``, ``gpt-realtime-whisper``) has nearly ready by then.
The audio is also kept: if the session fails (connection refused or lost, an ``error`` or
``...transcription.failed`` event, no final within ``final_timeout``), ``finish()`` uploads it
as above and the stream's ``degraded`` says why, so a turn is never lost to the WebSocket.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import enum
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import openai
from openai import AsyncOpenAI

from audio import TELEPHONY_RATE, UlawEncoder, check_sample_rate, encode_wav_pcm16

from ._errors import (
    ConfigurationError,
    StreamClosedError,
    TranscriptionError,
)
from ._openai_client import OpenAIClientOwner
from ._stt import StreamLifecycle, StreamState, Transcript

__all__ = ["OpenAIRealtimeStream", "OpenAIStream", "OpenAITranscriber", "SttTransport"]

log = logging.getLogger(__name__)

REALTIME_MODEL = "gpt-live-transcribe"
"""The realtime transport's model when none is given: OpenAI's recommended streaming one."""


class SttTransport(enum.Enum):
    """How audio reaches the service."""

    UPLOAD = "upload"  # one WAV per utterance, on finish()
    REALTIME = "realtime"  # a Realtime transcription session, audio streamed as it comes


class OpenAITranscriber(OpenAIClientOwner):
    """Transcriber on ``audio.transcriptions.create`` (``gpt-4o-mini-transcribe``, ``whisper-1``).

    Args:
        model: Transcription model name (``realtime``: defaults to ``gpt-live-transcribe``).
        transport: ``"upload"`` (a WAV per utterance on ``finish``) or ``"realtime"`` (audio
            streamed over a Realtime transcription session during the turn).
        final_timeout: ``realtime``: seconds to wait after the commit for the final transcript
            before the utterance is uploaded instead.
        api_key: API key; defaults to ``$OPENAI_API_KEY``.
        base_url: Base URL of an OpenAI-compatible API (``.../v1``); defaults to OpenAI's.
        language: ISO-639-1 language of the speech (``"en"``), which helps short utterances.
        prompt: Text to steer the model (names, jargon, the bot's last question).
        client: Use this ``AsyncOpenAI`` instead of building one (then not closed by
            :meth:`aclose`).
        max_retries: Passed to ``AsyncOpenAI``; a caller waiting for an answer rarely
            benefits from slow retries.
        timeout: Request timeout in seconds.

    Raises:
        ConfigurationError: No API key was given or found in the environment.
    """

    def __init__(
        self,
        *,
        model: str | None = None,
        transport: str | SttTransport = SttTransport.UPLOAD,
        final_timeout: float = 3.0,
        api_key: str | None = None,
        base_url: str | None = None,
        language: str | None = None,
        prompt: str | None = None,
        client: AsyncOpenAI | None = None,
        max_retries: int = 1,
        timeout: float = 30.0,
    ) -> None:
        try:
            self.transport = SttTransport(transport)
        except ValueError:
            raise ConfigurationError(
                f"unknown transport {transport!r}; use 'upload' or 'realtime'") from None
        if self.transport is SttTransport.REALTIME:
            self.model = model or REALTIME_MODEL
        else:
            self.model = model or "gpt-4o-mini-transcribe"
        self.final_timeout = final_timeout
        self.language = language
        self.prompt = prompt
        self._init_client(client, api_key=api_key, base_url=base_url, max_retries=max_retries,
                          timeout=timeout)

    def open_stream(
        self, *, sample_rate: int = TELEPHONY_RATE
    ) -> OpenAIStream | OpenAIRealtimeStream:
        """Start an utterance whose audio comes at ``sample_rate`` Hz (``realtime``: from a
        running event loop; the session's connection starts now).

        Raises:
            audio.AudioError: ``sample_rate`` is not a positive integer.
        """
        check_sample_rate("sample_rate", sample_rate)
        if self.transport is SttTransport.REALTIME:
            return OpenAIRealtimeStream(self, sample_rate=sample_rate)
        return OpenAIStream(self, sample_rate=sample_rate)

    def session_config(self) -> dict[str, Any]:
        """The ``session`` of the realtime transport's ``session.update``."""
        transcription: dict[str, Any] = {"model": self.model}
        if self.language:
            transcription["language"] = self.language
        if self.prompt:
            transcription["prompt"] = self.prompt
        return {
            "type": "transcription",
            "audio": {"input": {"format": {"type": "audio/pcmu"},
                                "transcription": transcription,
                                "turn_detection": None}},
        }

    def realtime_connect(self) -> Any:
        """The SDK's connection manager for one transcription session."""
        return self._client.realtime.connect(extra_query={"intent": "transcription"})

    async def transcribe_wav(self, wav: bytes) -> Transcript:
        """Transcribe one WAV file's bytes.

        Raises:
            TranscriptionError: The request failed (``__cause__`` is the ``openai`` error).
        """
        options: dict[str, str] = {}
        if self.language:
            options["language"] = self.language
        if self.prompt:
            options["prompt"] = self.prompt
        try:
            result = await self._client.audio.transcriptions.create(
                file=("utterance.wav", wav, "audio/wav"),
                model=self.model,
                response_format="json",
                # Optional fields go in only when set: the SDK's "not given" sentinel has
                # changed between releases (NOT_GIVEN, omit); leaving them out works with all.
                # (mypy cannot match a dict's values to the SDK's per-field overloads.)
                **options,  # type: ignore[call-overload]
            )
        except openai.OpenAIError as exc:
            raise TranscriptionError(f"transcription request failed: {exc}") from exc
        return Transcript(result.text.strip(), final=True)

    async def warm_up(self, streams: int = 1) -> None:
        """Load now what the SDK loads on its first request: its audio resources and types and
        the async backend under its HTTP client (~45 ms of imports, here and on this machine
        class, that would otherwise stall every call's audio during the first transcription).
        Makes no request; ``streams`` is accepted for the transcriber protocol's sake."""
        import concurrent.futures.thread  # noqa: F401  (the loop's resolver executor)

        import anyio
        import anyio.abc  # noqa: F401

        _ = self._client.audio.transcriptions  # the SDK's lazily imported resource tree
        if self.transport is SttTransport.REALTIME:
            import websockets.asyncio.client  # noqa: F401  (the SDK imports it on connect)

            _ = self._client.realtime
        await anyio.sleep(0)  # loads anyio's asyncio backend, which httpx's transport uses
        send, receive = anyio.create_memory_object_stream[bytes](1)
        send.close()
        receive.close()



class _UploadableStream(StreamLifecycle):
    """What both streams of :class:`OpenAITranscriber` share: the audio fed, kept for an
    upload of the whole utterance, and that upload (a task :meth:`close` cancels)."""

    def __init__(self, owner: OpenAITranscriber, *, sample_rate: int) -> None:
        self._owner = owner
        self.sample_rate = sample_rate
        self._audio = bytearray()  # PCM16 as fed
        self._state = StreamState.OPEN
        self._request: asyncio.Task[Transcript] | None = None

    def feed(self, pcm16: bytes) -> None:
        """Append audio (16-bit little-endian mono at the stream's rate); a realtime stream
        also queues it for its session.

        Raises:
            StreamFinishedError: ``finish()`` was already called.
            StreamClosedError: The stream is closed.
        """
        self._check_open()
        self._audio += pcm16
        self._fed(pcm16)

    def _fed(self, pcm16: bytes) -> None:
        """After ``feed`` kept ``pcm16``: nothing more for an upload-only stream."""

    def _start_finishing(self) -> bytes:
        """``finish()`` begins: the audio fed, handed over once (a dangling half sample is
        dropped)."""
        self._check_open()
        self._state = StreamState.FINISHING
        audio = bytes(self._audio[: len(self._audio) & ~1])
        self._audio = bytearray()
        return audio

    async def _upload(self, audio: bytes) -> Transcript:
        """Transcribe ``audio`` by the file endpoint; a task, so close() can cancel the upload
        from outside (the caller clears ``_request`` when it is over)."""
        wav = encode_wav_pcm16(audio, sample_rate=self.sample_rate)
        self._request = asyncio.ensure_future(self._owner.transcribe_wav(wav))
        return await self._request

    @contextlib.contextmanager
    def _closed_meanwhile(self, when: str) -> Iterator[None]:
        """Around what ``finish()`` waits for: a cancellation by :meth:`close` (not of the
        caller's task) is ``StreamClosedError("transcription stream closed " + when)``; the
        upload, if one was made, is over after it."""
        try:
            yield
        except asyncio.CancelledError:
            if self._state is StreamState.CLOSED and not _current_task_cancelling():
                raise StreamClosedError(f"transcription stream closed {when}") from None
            raise
        finally:
            self._request = None

    def _finished(self, transcript: Transcript) -> Transcript:
        """``finish()`` ends with ``transcript`` (unless the stream was closed meanwhile)."""
        if self._state is StreamState.FINISHING:
            self._state = StreamState.FINISHED
        return transcript

    def close(self) -> None:
        """Drop the audio and cancel an upload in flight; idempotent."""
        self._state = StreamState.CLOSED
        self._audio = bytearray()
        if self._request is not None:
            self._request.cancel()


class OpenAIStream(_UploadableStream):
    """One utterance for :class:`OpenAITranscriber`: buffered, uploaded by :meth:`finish`."""

    async def partial(self) -> Transcript | None:
        """Always ``None``: the endpoint only transcribes whole files.

        Raises:
            StreamFinishedError: ``finish()`` was already called.
            StreamClosedError: The stream is closed.
        """
        self._check_open()
        return None

    async def finish(self) -> Transcript:
        """Upload the utterance and return its transcript (empty, without a request, if silent).

        Raises:
            StreamFinishedError: Called twice.
            StreamClosedError: The stream is closed, or was closed during the request.
            TranscriptionError: The request failed.
        """
        audio = self._start_finishing()
        if not audio:
            self._state = StreamState.FINISHED
            return Transcript("", final=True)
        with self._closed_meanwhile("during the request"):
            transcript = await self._upload(audio)
        return self._finished(transcript)


class OpenAIRealtimeStream(_UploadableStream):
    """One utterance for :class:`OpenAITranscriber` with ``transport="realtime"``: its audio
    streamed over a Realtime transcription session as it is fed (module docstring).

    Attributes:
        degraded: Why the realtime session failed, when ``finish()`` had to upload the
            utterance instead (``None`` while it works).
    """

    def __init__(self, owner: OpenAITranscriber, *, sample_rate: int) -> None:
        super().__init__(owner, sample_rate=sample_rate)  # the audio: the upload fallback's
        self._encoder = UlawEncoder(sample_rate)
        self._outbox: asyncio.Queue[bytes | None] = asyncio.Queue()  # mu-law; None: commit
        self._text = ""  # the deltas so far
        self._changed = asyncio.Event()  # the text grew, or the session ended
        self._final: str | None = None
        self._failure: TranscriptionError | None = None
        self._ended = asyncio.Event()  # final or failure
        self.degraded: TranscriptionError | None = None
        self._session = asyncio.ensure_future(self._run())

    # -- the stream ---------------------------------------------------------------------
    def _fed(self, pcm16: bytes) -> None:
        ulaw = self._encoder.push(pcm16)
        if ulaw and not self._ended.is_set():
            self._outbox.put_nowait(ulaw)

    async def partial(self) -> Transcript | None:
        """The text of the deltas received so far (``None`` before the first).

        Raises:
            StreamFinishedError: ``finish()`` was already called.
            StreamClosedError: The stream is closed.
        """
        self._check_open()
        return Transcript(self._text, final=False) if self._text else None

    async def partials(self) -> AsyncIterator[Transcript]:
        """Interim transcripts as the deltas arrive, each the whole text so far
        (``final=False``); ends when the final transcript is in or the stream is closed.

        Raises:
            TranscriptionError: The session failed (``finish()`` still answers, by upload).
        """
        seen = ""
        while True:
            if self._text != seen:
                seen = self._text
                yield Transcript(seen, final=False)
                continue
            if self._failure is not None:
                raise self._failure
            if self._ended.is_set() or self._state is StreamState.CLOSED:
                return
            self._changed.clear()
            await self._changed.wait()

    async def finish(self) -> Transcript:
        """Commit the utterance and return the session's final transcript (empty, without a
        commit, if no audio came); the upload fallback if the session failed.

        Raises:
            StreamFinishedError: Called twice.
            StreamClosedError: The stream is closed, or was closed while waiting.
            TranscriptionError: The session failed and so did the upload.
        """
        audio = self._start_finishing()
        tail = self._encoder.flush()
        if not audio:
            self._session.cancel()
            self._state = StreamState.FINISHED
            return Transcript("", final=True)
        if tail:
            self._outbox.put_nowait(tail)
        self._outbox.put_nowait(None)
        with self._closed_meanwhile("while waiting"):
            try:
                try:
                    await asyncio.wait_for(self._ended.wait(), self._owner.final_timeout)
                except TimeoutError:
                    self._fail(TranscriptionError(
                        f"no final transcript {self._owner.final_timeout:g} s after the commit"))
                if self._state is StreamState.CLOSED:
                    raise StreamClosedError("transcription stream closed while waiting")
                if self._final is not None:
                    transcript = Transcript(self._final.strip(), final=True)
                else:
                    assert self._failure is not None
                    self.degraded = self._failure
                    log.warning("realtime transcription failed (%s); uploading the utterance",
                                self._failure)
                    transcript = await self._upload(audio)
            finally:
                self._session.cancel()
        return self._finished(transcript)

    def close(self) -> None:
        """Drop the audio, end the session and cancel a wait in progress; idempotent."""
        super().close()
        self._session.cancel()
        self._changed.set()
        self._ended.set()  # a finish() waiting wakes, sees CLOSED

    # -- the session --------------------------------------------------------------------
    def _fail(self, error: TranscriptionError) -> None:
        if not self._ended.is_set():
            self._failure = error
            self._ended.set()
            self._changed.set()

    async def _run(self) -> None:
        try:
            async with self._owner.realtime_connect() as conn:
                await conn.session.update(session=self._owner.session_config())
                sender = asyncio.ensure_future(self._send(conn))
                try:
                    async for event in conn:
                        failed = sender.exception() if sender.done() else None
                        if failed is not None:
                            raise failed
                        if self._on_event(event):
                            return
                finally:
                    sender.cancel()
                    await asyncio.wait({sender})  # not left running behind a closed session
                    if not sender.cancelled():
                        sender.exception()  # retrieved: raised above where it mattered
                raise TranscriptionError(
                    "the realtime session closed before the final transcript")
        except TranscriptionError as exc:
            self._fail(exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # openai.OpenAIError, the websockets errors, OSError
            error = TranscriptionError(f"realtime transcription session failed: {exc}")
            error.__cause__ = exc
            self._fail(error)

    def _on_event(self, event: Any) -> bool:
        """One server event; True once the final transcript is in."""
        kind = getattr(event, "type", None)
        if kind == "conversation.item.input_audio_transcription.delta":
            if event.delta:
                self._text += event.delta
                self._changed.set()
        elif kind == "conversation.item.input_audio_transcription.completed":
            self._final = event.transcript or ""
            self._ended.set()
            self._changed.set()
            return True
        elif kind in ("conversation.item.input_audio_transcription.failed", "error"):
            error = getattr(event, "error", None)
            message = getattr(error, "message", None) or "no message"
            raise TranscriptionError(f"realtime transcription {kind}: {message}")
        return False

    async def _send(self, conn: Any) -> None:
        """Audio out as it comes: what queued up meanwhile goes as one append; then the commit."""
        while True:
            chunks = [await self._outbox.get()]
            while chunks[-1] is not None and not self._outbox.empty():
                chunks.append(self._outbox.get_nowait())
            commit = chunks[-1] is None
            audio = b"".join(c for c in chunks if c is not None)
            if audio:
                await conn.input_audio_buffer.append(audio=base64.b64encode(audio).decode())
            if commit:
                await conn.input_audio_buffer.commit()
                return


def _current_task_cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
