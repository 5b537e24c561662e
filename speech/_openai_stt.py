"""Speech to text through OpenAI's transcription endpoint (or any compatible server).

The endpoint takes a whole file, so a stream only buffers: ``finish()`` uploads the utterance as
a 16-bit PCM WAV at the rate it was fed (8 kHz on the phone leg, 16 kB per second of speech)
to ``POST {base_url}/audio/transcriptions`` through ``openai.AsyncOpenAI`` and returns its text.
There are no interim results.
"""

from __future__ import annotations

import asyncio

import openai
from openai import AsyncOpenAI

from audio import TELEPHONY_RATE, check_sample_rate, encode_wav_pcm16

from ._errors import (
    StreamClosedError,
    TranscriptionError,
)
from ._openai_client import OpenAIClientOwner
from ._stt import StreamLifecycle, StreamState, Transcript

__all__ = ["OpenAIStream", "OpenAITranscriber"]


class OpenAITranscriber(OpenAIClientOwner):
    """Transcriber on ``audio.transcriptions.create`` (``gpt-4o-mini-transcribe``, ``whisper-1``).

    Args:
        model: Transcription model name.
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
        model: str = "gpt-4o-mini-transcribe",
        api_key: str | None = None,
        base_url: str | None = None,
        language: str | None = None,
        prompt: str | None = None,
        client: AsyncOpenAI | None = None,
        max_retries: int = 1,
        timeout: float = 30.0,
    ) -> None:
        self.model = model
        self.language = language
        self.prompt = prompt
        self._init_client(client, api_key=api_key, base_url=base_url, max_retries=max_retries,
                          timeout=timeout)

    def open_stream(self, *, sample_rate: int = TELEPHONY_RATE) -> OpenAIStream:
        """Start an utterance whose audio comes at ``sample_rate`` Hz.

        Raises:
            audio.AudioError: ``sample_rate`` is not a positive integer.
        """
        check_sample_rate("sample_rate", sample_rate)
        return OpenAIStream(self, sample_rate=sample_rate)

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
        await anyio.sleep(0)  # loads anyio's asyncio backend, which httpx's transport uses
        send, receive = anyio.create_memory_object_stream[bytes](1)
        send.close()
        receive.close()



class OpenAIStream(StreamLifecycle):
    """One utterance for :class:`OpenAITranscriber`: buffered, uploaded by :meth:`finish`."""

    def __init__(self, owner: OpenAITranscriber, *, sample_rate: int) -> None:
        self._owner = owner
        self.sample_rate = sample_rate
        self._audio = bytearray()
        self._state = StreamState.OPEN
        self._request: asyncio.Task[Transcript] | None = None

    def feed(self, pcm16: bytes) -> None:
        """Append audio (16-bit little-endian mono at the stream's rate).

        Raises:
            StreamFinishedError: ``finish()`` was already called.
            StreamClosedError: The stream is closed.
        """
        self._check_open()
        self._audio += pcm16

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
        self._check_open()
        self._state = StreamState.FINISHING
        audio = bytes(self._audio[: len(self._audio) & ~1])  # a dangling half sample is dropped
        self._audio = bytearray()
        if not audio:
            self._state = StreamState.FINISHED
            return Transcript("", final=True)
        wav = encode_wav_pcm16(audio, sample_rate=self.sample_rate)
        # A task, so close() can cancel the upload from outside.
        self._request = asyncio.ensure_future(self._owner.transcribe_wav(wav))
        try:
            transcript = await self._request
        except asyncio.CancelledError:
            if self._state is StreamState.CLOSED and not _current_task_cancelling():
                raise StreamClosedError("transcription stream closed during the request") from None
            raise
        finally:
            self._request = None
        if self._state is StreamState.FINISHING:
            self._state = StreamState.FINISHED
        return transcript

    def close(self) -> None:
        """Drop the audio and cancel an upload in flight; idempotent."""
        self._state = StreamState.CLOSED
        self._audio = bytearray()
        if self._request is not None:
            self._request.cancel()


def _current_task_cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
