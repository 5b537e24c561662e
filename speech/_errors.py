"""Errors raised by the speech package.

::

    SpeechError
    ├── ConfigurationError (ValueError)  unknown provider, refused option, unknown voice, no key
    ├── EngineUnavailableError           a local engine's wheel, library or model will not load
    ├── StreamStateError                 a TranscriptionStream used in a state that forbids it
    │   ├── StreamFinishedError          ... fed or finished again after ``finish()``
    │   └── StreamClosedError            ... used after ``close()``
    ├── TranscriptionError               the engine or service failed to transcribe (chained)
    └── SynthesisError                   the engine or service failed to synthesize (chained)
"""

from __future__ import annotations

__all__ = [
    "ConfigurationError",
    "EngineUnavailableError",
    "SpeechError",
    "StreamClosedError",
    "StreamFinishedError",
    "StreamStateError",
    "SynthesisError",
    "TranscriptionError",
]


class SpeechError(Exception):
    """Base of every error raised by ``speech``."""


class ConfigurationError(SpeechError, ValueError):
    """A factory or constructor was given something it cannot use.

    An unknown provider name, an option the provider does not take, a value out of range, a
    voice the engine does not have, or no API key for a service.
    """


class EngineUnavailableError(SpeechError):
    """A local engine cannot be loaded: its wheel is missing or its library or model is broken."""


class StreamStateError(SpeechError):
    """A :class:`~speech.TranscriptionStream` method was called in a state that forbids it."""


class StreamFinishedError(StreamStateError):
    """``feed()`` or ``finish()`` after the utterance was already finished (one per stream)."""


class StreamClosedError(StreamStateError):
    """A stream was used after ``close()``, or closed while a caller awaited it."""


class TranscriptionError(SpeechError):
    """The engine or the service failed to transcribe; ``__cause__`` is the original error."""


class SynthesisError(SpeechError):
    """The engine or the service failed to synthesize; ``__cause__`` is the original error."""
