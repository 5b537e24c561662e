"""EspeakSynthesizer through the real libespeak-ng of the espeakng-loader wheel; Silero listens."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from contextlib import aclosing

import numpy as np
import pytest

import vad
from audio import ulaw_to_float32, ulaw_to_pcm16
from speech import ConfigurationError, EspeakSynthesizer, Synthesizer, split_sentences

pytest.importorskip("espeakng_loader")

SENTENCE = "The quick brown fox jumps over the lazy dog."
THREE = (
    "Thank you for calling. Your appointment is on Tuesday at nine thirty. Is there anything else?"
)


@pytest.fixture(scope="module")
def silero() -> vad.SileroRuntime:
    return vad.load_runtime("onnx")


async def render(synthesizer: EspeakSynthesizer, text: str) -> list[bytes]:
    return [piece async for piece in synthesizer.synthesize(text)]


def speech_share(runtime: vad.SileroRuntime, ulaw: bytes) -> float:
    probabilities = vad.probabilities(runtime, ulaw_to_float32(ulaw))
    return float(np.mean(probabilities > 0.5))


def test_is_a_synthesizer() -> None:
    assert isinstance(EspeakSynthesizer(), Synthesizer)


async def test_a_sentence_sounds_like_speech(silero: vad.SileroRuntime) -> None:
    audio = b"".join(await render(EspeakSynthesizer(), SENTENCE))

    # 9 words at 165 words per minute is 3.3 s; eSpeak is a little quicker.
    assert 1.6 < len(audio) / 8000 < 4.9
    assert speech_share(silero, audio) > 0.6


async def test_each_sentence_is_its_own_piece(silero: vad.SileroRuntime) -> None:
    pieces = await render(EspeakSynthesizer(), THREE)

    assert len(pieces) == len(split_sentences(THREE)) == 3
    for piece in pieces:
        assert len(piece) > 4000  # over half a second each
        assert speech_share(silero, piece) > 0.6
    # The middle sentence is the longest one.
    assert len(pieces[1]) > max(len(pieces[0]), len(pieces[2]))


async def test_audio_is_telephone_band_mulaw() -> None:
    audio = b"".join(await render(EspeakSynthesizer(), SENTENCE))
    pcm = np.frombuffer(ulaw_to_pcm16(audio), dtype=np.int16).astype(np.float64)
    spectrum = np.abs(np.fft.rfft(pcm)) ** 2
    frequencies = np.fft.rfftfreq(len(pcm), 1 / 8000)
    # The low-pass before decimation leaves little energy at the top of the 8 kHz band.
    top = spectrum[frequencies > 3800].sum() / spectrum.sum()
    assert top < 0.01
    assert 8000 < np.abs(pcm).max() <= 32124  # audible, mu-law's full scale at most


async def test_rate_changes_duration() -> None:
    normal = b"".join(await render(EspeakSynthesizer(rate_wpm=165), SENTENCE))
    fast = b"".join(await render(EspeakSynthesizer(rate_wpm=330), SENTENCE))
    assert len(fast) < 0.75 * len(normal)


def median_f0(ulaw: bytes) -> float:
    """Median pitch of the loud voiced 40 ms frames, by autocorrelation (60-400 Hz)."""
    x = np.frombuffer(ulaw_to_pcm16(ulaw), dtype=np.int16).astype(np.float64)
    estimates = []
    for start in range(0, len(x) - 320, 160):
        frame = x[start : start + 320] - x[start : start + 320].mean()
        if np.sqrt(np.mean(frame**2)) < 1000:
            continue
        ac = np.correlate(frame, frame, "full")[319:]
        lag = 20 + int(np.argmax(ac[20:133]))
        if ac[lag] > 0.3 * ac[0]:
            estimates.append(8000 / lag)
    return float(np.median(estimates))


async def test_concurrent_synthesizers_keep_their_own_settings() -> None:
    # eSpeak's settings are process globals: each rendering must set its own under the lock.
    low = EspeakSynthesizer(voice="en-us+m3", pitch=20)
    high = EspeakSynthesizer(voice="en-us+f3", pitch=80, rate_wpm=250)
    alone = [b"".join(await render(s, THREE)) for s in (low, high)]

    together = [b"".join(p) for p in await asyncio.gather(render(low, THREE), render(high, THREE))]

    # eSpeak carries jitter state from one rendering to the next, so audio is not bit-exact.
    for solo, mixed in zip(alone, together, strict=True):
        assert len(mixed) == pytest.approx(len(solo), rel=0.03)
        assert median_f0(mixed) == pytest.approx(median_f0(solo), rel=0.15)
    assert median_f0(alone[1]) > 2 * median_f0(alone[0])
    assert len(alone[1]) < 0.8 * len(alone[0])


_FIRST_RENDER = """
import asyncio, ctypes, hashlib, sys
import espeakng_loader
from speech import EspeakSynthesizer
from speech._espeak import _get_engine

_get_engine()  # espeak_Initialize seeds the library's generator with the time
if sys.argv[1] == "elsewhere":  # a process started at another time
    ctypes.CDLL(espeakng_loader.get_library_path()).espeak_ng_SetRandSeed(987654321)

async def main():
    return b"".join([p async for p in EspeakSynthesizer(voice="en-us+f5").synthesize(sys.argv[2])])

print(hashlib.sha256(asyncio.run(main())).hexdigest())
"""


def test_a_breathy_voice_renders_the_same_in_every_process() -> None:
    """eSpeak NG seeds its random generator with the time at start-up, and the voices with
    breath noise (``+f2``, ``+f3``, ``+f5``) draw from it: without a seed of our own before
    each text, two processes rendered the same sentence differently, and the line simulator's
    calls changed from one run to the next. Each process here renders the sentence first
    thing; one of them as if it had started at another time."""

    def first_render(when: str) -> str:
        done = subprocess.run([sys.executable, "-c", _FIRST_RENDER, when, SENTENCE],
                              capture_output=True, text=True, timeout=120, check=True)
        return done.stdout.strip()

    assert first_render("now") == first_render("elsewhere")


async def test_an_isolated_synthesizer_renders_a_sentence_the_same_whatever_came_before() -> None:
    """eSpeak NG carries state in its globals from one text to the next (its initialisation
    does not reset it), so the process's engine renders a sentence a little differently after
    other texts; an ``isolated`` synthesizer renders each sentence in a library state of its
    own, so the line simulator's calls do not depend on the calls generated before them. An
    isolated render does not disturb the process's engine either."""
    isolated = EspeakSynthesizer(voice="en-gb+m2", isolated=True)
    first = b"".join(await render(isolated, SENTENCE))
    shared = b"".join(await render(EspeakSynthesizer(voice="en-us+f3"), THREE))
    await render(EspeakSynthesizer(voice="en-gb+f2", isolated=True), "Which would you like?")
    assert b"".join(await render(isolated, SENTENCE)) == first
    assert len(first) > 4000
    # The process's engine goes on from where it was: the same text after the same history
    # (an isolated render in between is not part of it) is as long as before, to 3 %.
    again = b"".join(await render(EspeakSynthesizer(voice="en-us+f3"), THREE))
    assert len(again) == pytest.approx(len(shared), rel=0.03)


async def test_leaving_early_frees_the_engine() -> None:
    synthesizer = EspeakSynthesizer()
    async with aclosing(synthesizer.synthesize(THREE)) as pieces:
        first = await anext(pieces)
    assert len(first) > 4000
    # The engine's lock was let go and its abort flag does not leak into the next text.
    assert len(await render(synthesizer, THREE)) == 3


async def test_blank_text_yields_nothing() -> None:
    assert await render(EspeakSynthesizer(), "  \n ") == []


def test_language_codes_and_variants_resolve() -> None:
    EspeakSynthesizer(voice="en-gb")  # the file is gmw/en; found through its language list
    EspeakSynthesizer(voice="en-gb+m3")
    EspeakSynthesizer(voice="en-us+f3")


@pytest.mark.parametrize(
    "options",
    [
        {"voice": "xx-nowhere"},
        {"voice": ""},
        {"rate_wpm": 10},
        {"pitch": 101},
        {"volume": -1},
        {"rate_wpm": 165.0},
    ],
)
def test_bad_settings_are_refused(options: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError):
        EspeakSynthesizer(**options)  # type: ignore[arg-type]
