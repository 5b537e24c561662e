"""Offline text to speech with eSpeak NG, through the ``espeakng-loader`` wheel.

The wheel ships ``libespeak-ng.so`` and its ``espeak-ng-data`` directory and nothing else
(``espeakng_loader.get_library_path()``, ``get_data_path()``), so the library is driven here
with :mod:`ctypes` through its classic ``speak_lib.h`` API:

* ``espeak_Initialize(AUDIO_OUTPUT_SYNCHRONOUS, 0, data_path, espeakINITIALIZE_DONT_EXIT)``
  once per process; it returns the output rate (22050 Hz). ``DONT_EXIT`` keeps a missing data
  file from calling ``exit()`` on the whole gateway.
* ``espeak_SetSynthCallback``: in synchronous mode ``espeak_Synth`` calls it with each block of
  16-bit native-order samples and returns when the text is done. Returning 1 from the callback
  aborts the synthesis, which is how a barge-in stops it.
* ``espeak_SetVoiceByName``, ``espeak_SetParameter`` (rate, pitch, volume) before each text.

The library keeps all of this in globals and is not re-entrant, so one lock serialises every
call into it in the process, whichever synthesizer makes it. Synthesis runs in a worker thread;
ctypes releases the GIL for the foreign call, so the event loop runs while eSpeak renders.
"""

from __future__ import annotations

import asyncio
import ctypes
import shutil
import sys
import tempfile
import threading
from _ctypes import dlclose as _ctypes_dlclose
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any, Final

from audio import UlawEncoder

from ._errors import ConfigurationError, EngineUnavailableError, SynthesisError
from ._tts import split_sentences

__all__ = ["EspeakSynthesizer"]

# speak_lib.h
_AUDIO_OUTPUT_SYNCHRONOUS: Final = 2
_INITIALIZE_DONT_EXIT: Final = 0x8000
_POS_CHARACTER: Final = 1
_CHARS_UTF8: Final = 1
_ENDPAUSE: Final = 0x1000
_RATE: Final = 1
_VOLUME: Final = 2
_PITCH: Final = 3
_EE_OK: Final = 0
_RANDOM_SEED: Final = 1
"""The seed of eSpeak NG's random generator before each text (see ``_Engine``)."""


class _Voice(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("languages", ctypes.c_void_p),  # (priority byte, NUL-terminated name)*, then NUL
        ("identifier", ctypes.c_char_p),
        ("gender", ctypes.c_ubyte),
        ("age", ctypes.c_ubyte),
        ("variant", ctypes.c_ubyte),
        ("xx1", ctypes.c_ubyte),
        ("score", ctypes.c_int),
        ("spare", ctypes.c_void_p),
    ]


def _languages(address: int) -> list[str]:
    names: list[str] = []
    while address and ctypes.c_ubyte.from_address(address).value:  # priority byte; 0 ends
        name = ctypes.string_at(address + 1)
        names.append(name.decode(errors="replace").lower())
        address += 2 + len(name)
    return names


_SynthCallback = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p
)


def _loader() -> Any:
    try:
        import espeakng_loader
    except ImportError as exc:
        raise EngineUnavailableError(
            "the 'espeakng-loader' package is not installed (pip install espeakng-loader)"
        ) from exc
    return espeakng_loader


class _Engine:
    """A loaded libespeak-ng, initialised once and used under one lock: the process's one
    (:func:`_get_engine`), or a private copy's for one isolated render (``library``)."""

    def __init__(self, library: str | None = None) -> None:
        espeakng_loader = _loader()
        try:
            lib = ctypes.CDLL(library or espeakng_loader.get_library_path())
            data_path = espeakng_loader.get_data_path()
        except (OSError, RuntimeError) as exc:
            raise EngineUnavailableError(f"cannot load libespeak-ng: {exc}") from exc
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_Initialize.restype = ctypes.c_int
        lib.espeak_SetSynthCallback.argtypes = [_SynthCallback]
        lib.espeak_SetSynthCallback.restype = None
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetVoiceByName.restype = ctypes.c_int
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.espeak_SetParameter.restype = ctypes.c_int
        lib.espeak_Synth.argtypes = [
            ctypes.c_char_p,  # text
            ctypes.c_size_t,  # size
            ctypes.c_uint,  # position
            ctypes.c_int,  # position_type
            ctypes.c_uint,  # end_position
            ctypes.c_uint,  # flags
            ctypes.c_void_p,  # unique_identifier
            ctypes.c_void_p,  # user_data
        ]
        lib.espeak_Synth.restype = ctypes.c_int
        lib.espeak_ListVoices.argtypes = [ctypes.c_void_p]
        lib.espeak_ListVoices.restype = ctypes.POINTER(ctypes.POINTER(_Voice))
        lib.espeak_Info.argtypes = [ctypes.c_void_p]
        lib.espeak_Info.restype = ctypes.c_char_p
        # The voices with breath noise (the ``breath`` line of variants f2, f3, f5) draw it from
        # the library's own random generator, which espeak_Initialize seeds with time(NULL):
        # the same text in the same voice rendered differently in every process, so the line
        # simulator's calls were not the same from one run to the next (five of its 24 voices;
        # two windows logs of its impacts grid, minutes apart: 2428 rows). Seeded before each text,
        # a render no longer depends on the clock. Other state still carries on from the
        # process's earlier texts (in the library's statics, which espeak_Initialize does not
        # reset: one text in one voice, 28215 bytes fresh, 28217 after two others): an
        # ``isolated`` synthesizer renders in a library state of its own. (eSpeak NG 1.52 has
        # the call; an older library renders as before.)
        self._seed = getattr(lib, "espeak_ng_SetRandSeed", None)
        if self._seed is not None:
            self._seed.argtypes = [ctypes.c_long]
            self._seed.restype = None
        rate = lib.espeak_Initialize(
            _AUDIO_OUTPUT_SYNCHRONOUS, 0, data_path.encode(), _INITIALIZE_DONT_EXIT
        )
        if rate <= 0:
            raise EngineUnavailableError(f"espeak_Initialize failed with data at {data_path}")
        self._lib = lib
        self.sample_rate: int = rate
        self.version: str = (lib.espeak_Info(None) or b"").decode()
        self.lock = threading.Lock()
        self._blocks: list[bytes] = []
        self._abort: threading.Event | None = None
        # Kept on self: ctypes does not keep the callback alive, and the library holds it.
        self._callback = _SynthCallback(self._on_audio)
        lib.espeak_SetSynthCallback(self._callback)

    def close(self) -> None:
        """Terminate the library and unload it (an isolated render's engine, used once)."""
        self._lib.espeak_Terminate()
        _ctypes_dlclose(self._lib._handle)

    def _on_audio(self, wav: Any, count: int, _events: Any) -> int:
        # Runs on the synthesizing thread, inside espeak_Synth. An exception here would be
        # printed and ignored by ctypes, so nothing in it may raise.
        if self._abort is not None and self._abort.is_set():
            return 1
        if wav and count > 0:
            self._blocks.append(ctypes.string_at(wav, count * 2))
        return 0

    def resolve_voice(self, voice: str) -> str | None:
        """The name ``espeak_SetVoiceByName`` takes for ``voice``, or ``None`` if there is none.

        Voice names and file names ("en-us", "en", "en-us+f3") are taken as they are. A language
        code that is neither ("en-gb" is the file ``gmw/en``) is looked up in the voice list,
        keeping any "+variant".
        """
        base, plus, variant = voice.partition("+")
        with self.lock:
            if self._lib.espeak_SetVoiceByName(voice.encode()) == _EE_OK:
                return voice
            voices = self._lib.espeak_ListVoices(None)
            index = 0
            while voices and voices[index]:
                entry = voices[index].contents
                index += 1
                identifier: bytes | None = entry.identifier
                if identifier and base.lower() in _languages(entry.languages or 0):
                    resolved = identifier.decode() + plus + variant
                    if self._lib.espeak_SetVoiceByName(resolved.encode()) == _EE_OK:
                        return resolved
        return None

    def render(
        self,
        text: str,
        *,
        voice: str,
        rate_wpm: int,
        pitch: int,
        volume: int,
        end_pause: bool,
        abort: threading.Event,
    ) -> bytes:
        """Synthesize ``text``: native-order PCM16 at :attr:`sample_rate` (empty if aborted)."""
        data = text.replace("\x00", " ").encode()
        flags = _CHARS_UTF8 | (_ENDPAUSE if end_pause else 0)
        with self.lock:
            if abort.is_set():
                return b""
            if self._lib.espeak_SetVoiceByName(voice.encode()) != _EE_OK:
                raise SynthesisError(f"eSpeak NG has no voice {voice!r}")
            for parameter, value in ((_RATE, rate_wpm), (_PITCH, pitch), (_VOLUME, volume)):
                if self._lib.espeak_SetParameter(parameter, value, 0) != _EE_OK:
                    raise SynthesisError(f"eSpeak NG refused parameter {parameter} = {value}")
            if self._seed is not None:
                self._seed(_RANDOM_SEED)
            self._blocks = []
            self._abort = abort
            try:
                error = self._lib.espeak_Synth(
                    data, len(data) + 1, 0, _POS_CHARACTER, 0, flags, None, None
                )
                blocks = self._blocks
            finally:
                self._blocks = []
                self._abort = None
        if abort.is_set():
            return b""
        if error != _EE_OK:
            raise SynthesisError(f"espeak_Synth failed with error {error}")
        return b"".join(blocks)


_engine: _Engine | None = None
_engine_lock = threading.Lock()


def _get_engine() -> _Engine:
    global _engine
    with _engine_lock:
        if _engine is None:
            _engine = _Engine()
        return _engine


_isolated_lock = threading.Lock()
_isolated_dir: tempfile.TemporaryDirectory[str] | None = None


def _render_isolated(text: str, **kwargs: Any) -> tuple[bytes, int]:
    """``text`` rendered (as :meth:`_Engine.render`) by a private copy of libespeak-ng loaded
    for this text alone, and its sample rate. A copy under another file name is a second
    instance of the library with statics of its own (the process's engine keeps its handle to
    the original, so that one is never unloaded); unloading the copy after each text throws its
    statics away, and the next text starts from the library's initial state (about 10 ms)."""
    global _isolated_dir
    with _isolated_lock:
        if _isolated_dir is None:
            _isolated_dir = tempfile.TemporaryDirectory(prefix="callgate-espeak-")
            shutil.copy(_loader().get_library_path(),
                        Path(_isolated_dir.name) / "libespeak-ng-isolated.so")
        engine = _Engine(str(Path(_isolated_dir.name) / "libespeak-ng-isolated.so"))
        try:
            return engine.render(text, **kwargs), engine.sample_rate
        finally:
            engine.close()


class EspeakSynthesizer:
    """Offline synthesizer on eSpeak NG; yields 8 kHz mu-law one sentence at a time.

    eSpeak renders a sentence in a few milliseconds, so the first audio is ready almost at once.
    Every sentence but the last ends with eSpeak's sentence pause; the last ends on its last
    sound, so the turn's end is not padded with silence.

    Args:
        voice: eSpeak NG voice name, optionally with a variant (``"en-us"``, ``"en-us+f3"``).
        rate_wpm: Speaking rate in words per minute (80-450).
        pitch: Base pitch, 0-100 (50 is the voice's normal).
        volume: Amplitude, 0-200 (100 is normal; above it may clip).
        isolated: Render each sentence in a fresh library state of its own. eSpeak NG carries
            state in its globals from one text to the next (its initialisation does not reset
            it), so a sentence's audio depends on what the process rendered before; isolated,
            the same sentence renders to the same bytes whatever came before (the line
            simulator's calls). About 10 ms more per sentence.

    Raises:
        ConfigurationError: A value out of range, or a voice eSpeak NG does not have.
        EngineUnavailableError: The ``espeakng-loader`` wheel or its library cannot be loaded.
    """

    def __init__(
        self,
        *,
        voice: str = "en-us",
        rate_wpm: int = 165,
        pitch: int = 50,
        volume: int = 100,
        isolated: bool = False,
    ) -> None:
        for name, value, low, high in (
            ("rate_wpm", rate_wpm, 80, 450),
            ("pitch", pitch, 0, 100),
            ("volume", volume, 0, 200),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ConfigurationError(
                    f"{name} must be an integer in [{low}, {high}], got {value!r}"
                )
        self._engine = _get_engine()
        resolved = self._engine.resolve_voice(voice) if voice else None
        if resolved is None:
            raise ConfigurationError(f"eSpeak NG has no voice {voice!r}")
        self.voice = voice
        self._voice_name = resolved
        self.rate_wpm = rate_wpm
        self.pitch = pitch
        self.volume = volume
        self.isolated = isolated

    @property
    def engine_version(self) -> str:
        """Version of the loaded libespeak-ng (``"1.52.0"``)."""
        return self._engine.version

    async def synthesize(self, text: str) -> AsyncGenerator[bytes, None]:
        """Yield the mu-law audio of each sentence of ``text`` as it is rendered.

        Raises:
            SynthesisError: eSpeak NG failed.
        """
        sentences = split_sentences(text)
        abort = threading.Event()
        try:
            for index, sentence in enumerate(sentences):
                end_pause = index < len(sentences) - 1
                audio = await asyncio.to_thread(self._render, sentence, end_pause, abort)
                if audio:
                    yield audio
        finally:
            # Left early (a barge-in) or cancelled: stop a rendering still running in its thread.
            abort.set()

    def _render(self, sentence: str, end_pause: bool, abort: threading.Event) -> bytes:
        kwargs: dict[str, Any] = {"voice": self._voice_name, "rate_wpm": self.rate_wpm,
                                  "pitch": self.pitch, "volume": self.volume,
                                  "end_pause": end_pause, "abort": abort}
        if self.isolated:
            pcm, rate = _render_isolated(sentence, **kwargs)
        else:
            pcm, rate = self._engine.render(sentence, **kwargs), self._engine.sample_rate
        encoder = UlawEncoder(rate, byteorder=sys.byteorder)
        return encoder.push(pcm) + encoder.flush()
