"""Text to speech: the ``Synthesizer`` seam, sentence splitting, and the factory.

``Synthesizer`` has the same shape as ``nodes.Synthesizer`` (structural typing: neither package
imports the other). Audio is 8 kHz G.711 mu-law, one byte per sample, yielded in pieces as soon as
they are ready, so the call leg can start playing the first sentence while later ones render.
Leaving the ``async for`` early (a barge-in) stops the rendering.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Final, Protocol, runtime_checkable

from ._errors import ConfigurationError
from ._stt import _checked_options

if TYPE_CHECKING:
    from ._espeak import EspeakSynthesizer
    from ._openai_tts import OpenAISynthesizer

__all__ = ["Synthesizer", "make_synthesizer", "split_sentences"]


@runtime_checkable
class Synthesizer(Protocol):
    """Text to mu-law 8 kHz audio."""

    def synthesize(self, text: str) -> AsyncIterator[bytes]:
        """Yield the audio of ``text`` in pieces, in order."""
        ...


# Words whose trailing period does not end a sentence ("Dr. Smith", "e.g. this").
_ABBREVIATIONS: Final = frozenset(
    {"mr", "mrs", "ms", "dr", "prof", "st", "jr", "sr", "vs", "etc", "e.g", "i.e", "approx"}
)
_BOUNDARY: Final = re.compile(r"[.!?…]+[\"')\]]*(?=\s)|(?=\n\s*\n)|(?=\n\s*[-*•]\s)")


def split_sentences(text: str) -> list[str]:
    """Cut text into sentences for piecewise synthesis; whitespace-only pieces are dropped.

    A boundary is sentence-final punctuation followed by whitespace, a blank line, or a line
    starting a list item. A period after a common abbreviation or a single letter (an initial)
    is not a boundary. Decimal numbers and times ("3.5", "9:30") have no space after the
    punctuation, so they stay whole.
    """
    sentences: list[str] = []
    current = ""
    pos = 0
    for match in _BOUNDARY.finditer(text):
        piece = text[pos : match.end()]
        pos = match.end()
        current += piece
        last_word = current.rstrip("\"')]").rsplit(maxsplit=1)[-1] if current.strip() else ""
        stem = last_word.rstrip(".").lower()
        if last_word.endswith(".") and (
            stem in _ABBREVIATIONS or (len(stem) == 1 and stem.isalpha())
        ):
            continue
        if current.strip():
            sentences.append(current.strip())
        current = ""
    tail = text[pos:]
    current += tail
    if current.strip():
        sentences.append(current.strip())
    return sentences


def make_synthesizer(provider: str, **options: Any) -> EspeakSynthesizer | OpenAISynthesizer:
    """Build a synthesizer by provider name, e.g. from a YAML settings block.

    Args:
        provider: ``"espeak"`` (offline, eSpeak NG) or ``"openai"`` (any compatible server).
        **options: Keyword arguments of :class:`~speech.EspeakSynthesizer` or
            :class:`~speech.OpenAISynthesizer`.

    Raises:
        ConfigurationError: Unknown provider or option, or a value the provider refuses.
        EngineUnavailableError: The offline engine cannot be loaded.
    """
    if provider == "espeak":
        from ._espeak import EspeakSynthesizer

        factory: type[EspeakSynthesizer | OpenAISynthesizer] = EspeakSynthesizer
    elif provider == "openai":
        from ._openai_tts import OpenAISynthesizer

        factory = OpenAISynthesizer
    else:
        raise ConfigurationError(
            f"unknown synthesis provider {provider!r}; use 'espeak' or 'openai'"
        )
    return factory(**_checked_options(factory, provider, options))
