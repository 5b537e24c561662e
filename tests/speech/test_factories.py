"""make_transcriber / make_synthesizer, the protocols, and the package's export list."""

from __future__ import annotations

import importlib
from typing import Any

import pytest

import speech
from speech import (
    ConfigurationError,
    EspeakSynthesizer,
    OpenAISynthesizer,
    OpenAITranscriber,
    PocketsphinxTranscriber,
    Synthesizer,
    Transcriber,
    make_synthesizer,
    make_transcriber,
)

SUBMODULES = [
    "_errors",
    "_espeak",
    "_openai_stt",
    "_openai_tts",
    "_pocketsphinx",
    "_stt",
    "_tts",
]


def test_every_public_name_is_exported() -> None:
    exported = set(speech.__all__)
    assert len(exported) == len(speech.__all__)
    for name in SUBMODULES:
        module = importlib.import_module(f"speech.{name}")
        for member in module.__all__:
            assert member in exported, f"speech.{name}.{member} is not re-exported"
            assert getattr(speech, member) is getattr(module, member)
    for member in exported:
        assert hasattr(speech, member)


def test_transcribers_by_name() -> None:
    pocketsphinx = make_transcriber("pocketsphinx", max_idle_decoders=1)
    assert isinstance(pocketsphinx, PocketsphinxTranscriber)
    assert isinstance(pocketsphinx, Transcriber)
    assert pocketsphinx.idle_decoders == 0  # nothing loaded until a stream needs it


async def test_openai_transcriber_by_name() -> None:
    transcriber = make_transcriber(
        "openai", model="whisper-1", api_key="sk-test", base_url="http://127.0.0.1:9/v1"
    )
    assert isinstance(transcriber, OpenAITranscriber)
    assert isinstance(transcriber, Transcriber)
    assert transcriber.model == "whisper-1"
    await transcriber.aclose()


async def test_synthesizers_by_name() -> None:
    espeak = make_synthesizer("espeak", voice="en-us+f3", rate_wpm=180)
    assert isinstance(espeak, EspeakSynthesizer) and isinstance(espeak, Synthesizer)
    assert (espeak.voice, espeak.rate_wpm) == ("en-us+f3", 180)
    assert espeak.engine_version.startswith("1.")
    openai = make_synthesizer(
        "openai", voice="verse", api_key="sk-test", base_url="http://127.0.0.1:9/v1"
    )
    assert isinstance(openai, OpenAISynthesizer) and isinstance(openai, Synthesizer)
    assert openai.voice == "verse"
    await openai.aclose()


def test_nodes_accepts_these_synthesizers() -> None:
    nodes_tts = pytest.importorskip("nodes._tts")
    assert isinstance(EspeakSynthesizer(), nodes_tts.Synthesizer)
    assert isinstance(OpenAISynthesizer(api_key="sk-test"), nodes_tts.Synthesizer)


@pytest.mark.parametrize(
    ("factory", "provider", "options"),
    [
        (make_transcriber, "vosk", {}),
        (make_transcriber, "pocketsphinx", {"bogus": 1}),
        (make_transcriber, "openai", {"api_key": "k", "voice": "alloy"}),
        (make_synthesizer, "festival", {}),
        (make_synthesizer, "espeak", {"speed": 1.0}),
        (make_synthesizer, "espeak", {"voice": "xx-nowhere"}),
    ],
)
def test_bad_configuration_is_refused(factory: Any, provider: str, options: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        factory(provider, **options)
