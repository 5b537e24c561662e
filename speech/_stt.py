"""Speech to text: the ``Transcriber`` seam, its stream, its result, and the factory.

A transcriber opens one :class:`TranscriptionStream` per utterance. The call leg feeds it the
caller's audio as it arrives (``feed`` is cheap and never blocks the event loop), may ask for an
interim result, and calls ``finish`` when the turn ends::

    stream = transcriber.open_stream(sample_rate=8000)
    try:
        for chunk in chunks:
            stream.feed(chunk)            # 16-bit little-endian mono PCM, any chunk size
        transcript = await stream.finish()
    finally:
        stream.close()

A stream carries one utterance: after ``finish`` it takes no more audio. ``close`` releases its
resources at any point and is idempotent.

A streaming recogniser's stream may also offer ``partials()``, an async iterator of interim
:class:`Transcript` (``final=False``, each the words so far) as the service sends them
(:class:`~speech.OpenAIRealtimeStream`); the gateway publishes them as they come. Its
``degraded`` attribute, when set, says why ``finish`` had to fall back (the upload).
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from audio import TELEPHONY_RATE

from ._errors import ConfigurationError, StreamClosedError, StreamFinishedError

if TYPE_CHECKING:
    from ._openai_stt import OpenAITranscriber
    from ._pocketsphinx import PocketsphinxTranscriber

__all__ = [
    "StreamState",
    "Transcriber",
    "Transcript",
    "TranscriptionStream",
    "make_transcriber",
]


@dataclass(frozen=True, slots=True)
class Transcript:
    """What a transcriber heard.

    Attributes:
        text: The words, as the engine wrote them (may be empty).
        final: ``False`` for an interim result from ``partial()``.
        confidence: The engine's confidence in [0, 1], where it gives one.
        keyphrases: Phrases a keyphrase spotter heard beside ``text`` (in the order first
            heard), where the transcriber has one (:class:`~speech.PocketsphinxPoolTranscriber`
            with ``keyphrases``).
    """

    text: str
    final: bool = True
    confidence: float | None = None
    keyphrases: tuple[str, ...] = ()


@runtime_checkable
class TranscriptionStream(Protocol):
    """One utterance being transcribed."""

    def feed(self, pcm16: bytes) -> None:
        """Add audio: mono 16-bit little-endian PCM at the stream's rate, any chunk size.

        Call from the event loop's thread. Returns at once; decoding, if any, happens elsewhere.
        """
        ...

    async def partial(self) -> Transcript | None:
        """An interim result for the audio fed so far, or ``None`` if the engine has none."""
        ...

    async def finish(self) -> Transcript:
        """End the utterance and return the final transcript."""
        ...

    def close(self) -> None:
        """Release the stream's resources; idempotent. Pending awaits fail."""
        ...


@runtime_checkable
class Transcriber(Protocol):
    """Opens transcription streams."""

    def open_stream(self, *, sample_rate: int = TELEPHONY_RATE) -> TranscriptionStream:
        """Start a new utterance whose audio comes at ``sample_rate`` Hz."""
        ...


class StreamState(enum.Enum):
    """Lifecycle of a transcription stream (shared by the implementations)."""

    OPEN = "open"  # taking audio
    FINISHING = "finishing"  # finish() called, final result on its way
    FINISHED = "finished"  # final result delivered; no more audio
    CLOSED = "closed"  # resources released


class StreamLifecycle:
    """The lifecycle part every transcription stream shares: its :class:`StreamState` and the
    check that audio may still come."""

    _state: StreamState  # set by the stream as it goes

    @property
    def state(self) -> StreamState:
        """Where the stream is in its lifecycle."""
        return self._state

    def _check_open(self) -> None:
        if self._state is StreamState.CLOSED:
            raise StreamClosedError("transcription stream is closed")
        if self._state is not StreamState.OPEN:
            raise StreamFinishedError("the utterance is finished; open a new stream")


def make_transcriber(provider: str, **options: Any) -> PocketsphinxTranscriber | OpenAITranscriber:
    """Build a transcriber by provider name, e.g. from a YAML settings block.

    Args:
        provider: ``"pocketsphinx"`` (offline) or ``"openai"`` (any compatible server).
        **options: Keyword arguments of :class:`~speech.PocketsphinxTranscriber` or
            :class:`~speech.OpenAITranscriber`.

    Raises:
        ConfigurationError: Unknown provider or option, or an option the provider refuses.
        EngineUnavailableError: The offline engine cannot be loaded.
    """
    if provider == "pocketsphinx":
        from ._pocketsphinx import PocketsphinxTranscriber

        factory: type[PocketsphinxTranscriber | OpenAITranscriber] = PocketsphinxTranscriber
    elif provider == "openai":
        from ._openai_stt import OpenAITranscriber

        factory = OpenAITranscriber
    else:
        raise ConfigurationError(
            f"unknown transcription provider {provider!r}; use 'pocketsphinx' or 'openai'"
        )
    return factory(**_checked_options(factory, provider, options))


def _checked_options(
    factory: Callable[..., object], provider: str, options: dict[str, Any]
) -> dict[str, Any]:
    """Refuse unknown option names up front; a TypeError raised inside the constructor stays one."""
    try:
        inspect.signature(factory).bind(**options)
    except TypeError as exc:
        raise ConfigurationError(f"{provider}: {exc}") from exc
    return options
