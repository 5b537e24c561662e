"""Text to speech through OpenAI's speech endpoint (or any compatible server).

``POST {base_url}/audio/speech`` with ``response_format="pcm"`` answers with raw 24 kHz 16-bit
little-endian mono PCM, sent as it is generated. It is read through
``audio.speech.with_streaming_response`` and each network chunk is converted to 8 kHz mu-law and
yielded at once, so playback starts with the first chunk. Leaving the ``async for`` early closes
the HTTP response, which stops the generation.

Some compatible servers answer with a WAV file whatever was asked, and ``response_format="wav"``
asks for one. A body that starts with a RIFF/WAVE header, or is labelled ``audio/wav``, is read
whole and converted with :func:`audio.decode_wav_ulaw` (any rate, PCM16 or G.711): it is
not streamed, so prefer ``pcm``.
"""

from __future__ import annotations

import importlib
from collections.abc import AsyncGenerator
from typing import Final, Literal

import openai
from openai import AsyncOpenAI

from audio import AudioFormatError, UlawEncoder, decode_wav_ulaw

from ._errors import ConfigurationError, SynthesisError
from ._openai_client import OpenAIClientOwner

__all__ = ["OpenAISynthesizer"]

OPENAI_PCM_RATE: Final = 24000
"""Sample rate of OpenAI's ``pcm`` response format."""

_SNIFF_BYTES: Final = 12  # "RIFF" size "WAVE"


def _http_error() -> type[Exception]:
    # The openai client wraps errors of sending a request, not of reading a streamed body: those
    # come straight from its HTTP library (httpx2 in openai 3, httpx before).
    for name in ("httpx2", "httpx"):
        try:
            error: type[Exception] = importlib.import_module(name).HTTPError
        except ImportError:
            continue
        return error
    return openai.OpenAIError


_TRANSPORT_ERRORS: Final = (openai.OpenAIError, _http_error())


class OpenAISynthesizer(OpenAIClientOwner):
    """Synthesizer on ``audio.speech`` (``gpt-4o-mini-tts``, ``tts-1``...), streamed as it arrives.

    Args:
        model: Speech model name.
        voice: Voice name (``"alloy"``, ``"verse"``...).
        api_key: API key; defaults to ``$OPENAI_API_KEY``.
        base_url: Base URL of an OpenAI-compatible API (``.../v1``); defaults to OpenAI's.
        instructions: Delivery instructions (tone, pace), for models that take them.
        speed: Speaking speed, 0.25-4.0, where the model supports it.
        response_format: ``"pcm"`` (streamed) or ``"wav"`` (converted when complete).
        pcm_sample_rate: Rate of the ``pcm`` format; 24000 for OpenAI, other servers may differ.
        client: Use this ``AsyncOpenAI`` instead of building one (then not closed by
            :meth:`aclose`).
        max_retries: Passed to ``AsyncOpenAI``.
        timeout: Request timeout in seconds.

    Raises:
        ConfigurationError: No API key, or a value out of range.
    """

    def __init__(
        self,
        *,
        model: str = "gpt-4o-mini-tts",
        voice: str = "alloy",
        api_key: str | None = None,
        base_url: str | None = None,
        instructions: str | None = None,
        speed: float | None = None,
        response_format: Literal["pcm", "wav"] = "pcm",
        pcm_sample_rate: int = OPENAI_PCM_RATE,
        client: AsyncOpenAI | None = None,
        max_retries: int = 1,
        timeout: float = 30.0,
    ) -> None:
        if response_format not in ("pcm", "wav"):
            raise ConfigurationError(
                f"response_format must be 'pcm' or 'wav', got {response_format!r}"
            )
        if speed is not None and not 0.25 <= speed <= 4.0:
            raise ConfigurationError(f"speed must be in [0.25, 4.0], got {speed!r}")
        if (
            isinstance(pcm_sample_rate, bool)
            or not isinstance(pcm_sample_rate, int)
            or pcm_sample_rate <= 0
        ):
            raise ConfigurationError(
                f"pcm_sample_rate must be a positive integer, got {pcm_sample_rate!r}"
            )
        self.model = model
        self.voice = voice
        self.instructions = instructions
        self.speed = speed
        self.response_format = response_format
        self.pcm_sample_rate = pcm_sample_rate
        self._init_client(client, api_key=api_key, base_url=base_url, max_retries=max_retries,
                          timeout=timeout)

    async def synthesize(self, text: str) -> AsyncGenerator[bytes, None]:
        """Yield the mu-law audio of ``text`` as the service sends it.

        Raises:
            SynthesisError: The request failed or the audio could not be decoded
                (``__cause__`` is the original error).
        """
        if not text.strip():
            return
        options: dict[str, str | float] = {}
        if self.instructions:
            options["instructions"] = self.instructions
        if self.speed is not None:
            options["speed"] = self.speed
        try:
            async with self._client.audio.speech.with_streaming_response.create(
                model=self.model,
                voice=self.voice,
                input=text,
                response_format=self.response_format,
                # Optional fields go in only when set; the SDK's sentinel for "not given" has
                # changed between releases (NOT_GIVEN, omit), leaving them out works with all.
                # (mypy cannot match a dict's values to the SDK's per-field types.)
                **options,  # type: ignore[arg-type]
            ) as response:
                content_type = response.headers.get("content-type", "").lower()
                # One iterator for the whole body; closing the response ends it.
                chunks = response.iter_bytes()
                head = b""
                async for chunk in chunks:  # collect enough to recognise a WAV header
                    head += chunk
                    if len(head) >= _SNIFF_BYTES:
                        break
                if "wav" in content_type or (head[:4] == b"RIFF" and head[8:12] == b"WAVE"):
                    body = bytearray(head)
                    async for chunk in chunks:
                        body += chunk
                    audio = decode_wav_ulaw(bytes(body), source="speech response")
                    if audio:
                        yield audio
                    return
                encoder = UlawEncoder(self.pcm_sample_rate, byteorder="little")
                audio = encoder.push(head)
                if audio:
                    yield audio
                async for chunk in chunks:
                    audio = encoder.push(chunk)
                    if audio:
                        yield audio
                audio = encoder.flush()
                if audio:
                    yield audio
        except _TRANSPORT_ERRORS as exc:
            raise SynthesisError(f"speech request failed: {exc}") from exc
        except AudioFormatError as exc:
            raise SynthesisError(f"speech response is not usable audio: {exc}") from exc

