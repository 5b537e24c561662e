"""Offline speech to text with CMU PocketSphinx (the ``pocketsphinx`` 5.x wheel).

The wheel carries a US English model (``pocketsphinx.get_model_path()``: a 16 kHz continuous
acoustic model, a trigram language model and CMUdict). Telephone audio is 8 kHz, so it is
upsampled to 16 kHz before decoding. Running the model at 8 kHz instead (``samprate=8000``,
``nfft=256`` and ``upperf`` lowered in a copy of its ``feat.params``, which overrides the
decoder's options) garbles everything: the model was trained on 130-6800 Hz filter banks, and an
8 kHz front end gives it features it has never seen. On the corpus clip "go forward ten meters"
the 16 kHz route returned the words exactly (whole utterance at once) where the 8 kHz one
returned "definitely looking for".

Decoding is streamed: audio is decoded while the caller speaks, so ``finish()`` only has the
last piece and the end-of-utterance search left to do. Settings, measured as word error rate on
the 15 real utterances of the barge-in corpus (each decoded from a fresh normalisation):

* ``cmninit``: the initial cepstral mean. Upsampled telephone audio has no energy above 4 kHz,
  so its mean is far from the default (``40,3,-1``), which assumes wideband audio, and live
  normalisation spends the first seconds of every utterance adapting. Starting from the mean of
  upsampled telephone speech (:data:`TELEPHONE_CMNINIT`) took word error from 0.88 to 0.83.
* ``fwdflat=False``: the second, flat-lexicon pass runs in ``end_utt`` and holds the GIL for
  0.1-0.4 s on long turns, freezing the event loop; it bought about 2 points (0.81).
* ``bestpath`` stays on: its lattice search in ``end_utt`` holds the GIL for 0.05-0.3 s on long
  turns but is worth 6 points (0.89 without it). Set it off in ``decoder_options`` if the loop
  matters more.

Decoding the whole utterance at once (``full_utt=True``, batch normalisation) is more accurate
(0.68) but starts only when the turn ends, takes 0.4-0.7 x the utterance on one core, and holds
the GIL throughout: too slow for turn-taking, and it would stall every other call.

The GIL: ``Decoder.process_raw`` does not release it. A worker thread therefore feeds the
decoder in 20 ms pieces, so the event loop gets the interpreter back every few milliseconds.
A decoder costs about 90 MB and 0.3 s (GIL held) to load; idle ones are pooled and reused, and
:meth:`PocketsphinxTranscriber.warm_up` loads them before the first call.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from audio import TELEPHONY_RATE, PcmInput

from ._errors import (
    ConfigurationError,
    EngineUnavailableError,
    StreamClosedError,
    TranscriptionError,
)
from ._stt import StreamLifecycle, StreamState, Transcript

__all__ = ["TELEPHONE_CMNINIT", "PocketsphinxStream", "PocketsphinxTranscriber"]

MODEL_RATE: Final = 16000
"""Sample rate of the wheel's acoustic model."""

TELEPHONE_CMNINIT: Final = "35,0,-19,-10,-2,-33,-1,-14,-24,11,-31,8,-8"
"""Typical cepstral mean of 8 kHz telephone speech upsampled to 16 kHz (this model's front end).

The per-recording means of the corpus (batch normalisation over each whole call) cluster around
these values; the spread between callers is small next to their distance from the default.
"""

_PIECE_BYTES: Final = MODEL_RATE * 2 * 20 // 1000  # 20 ms at 16 kHz: ~5 ms of GIL per call

_DEFAULT_OPTIONS: Final[Mapping[str, str | int | float | bool]] = {
    "loglevel": "FATAL",  # the C library logs every model file it reads to stderr
    "fwdflat": False,
    "cmninit": TELEPHONE_CMNINIT,
}

DecoderOption = str | int | float | bool


def _reset(decoder: Any, cmninit: str) -> None:
    """Start ``decoder``'s next utterance from the state of a freshly loaded one.

    ``set_cmn`` alone is not enough: the live normalisation keeps its running sums across
    utterances, so a reused decoder heard the TIMIT clip as "he added up the good kill arturo
    year" after "go forward ..." and as "to add to that the great deal of toro year" fresh.
    ``reinit_feat`` (0.1 ms) makes a reused decoder give the fresh one's result exactly.
    """
    decoder.reinit_feat()
    decoder.set_cmn(cmninit)


@dataclass(slots=True)
class _Slot:
    """A decoder and whether it is inside an utterance (a stream closed mid-way leaves it so)."""

    decoder: Any
    in_utterance: bool = False


class PocketsphinxTranscriber:
    """Offline transcriber on the ``pocketsphinx`` wheel's US English model.

    Args:
        max_idle_decoders: Decoders kept loaded for the next streams once theirs are done.
        decoder_options: PocketSphinx configuration overriding the defaults above, by option
            name without the dash (``{"hmm": path, "lm": path, "dict": path, "beam": 1e-60}``).

    Raises:
        EngineUnavailableError: The ``pocketsphinx`` wheel is not installed.
        ConfigurationError: An unknown option name or a value of the wrong type.
    """

    def __init__(
        self,
        *,
        max_idle_decoders: int = 2,
        decoder_options: Mapping[str, DecoderOption] | None = None,
    ) -> None:
        try:
            import pocketsphinx
        except ImportError as exc:
            raise EngineUnavailableError(
                "the 'pocketsphinx' package is not installed (pip install pocketsphinx)"
            ) from exc
        if max_idle_decoders < 0:
            raise ConfigurationError(f"max_idle_decoders must be >= 0, got {max_idle_decoders}")
        options = {**_DEFAULT_OPTIONS, **(decoder_options or {})}
        try:
            pocketsphinx.Config(**options)  # cheap: checks names and types, loads nothing
        except (KeyError, ValueError, TypeError) as exc:
            raise ConfigurationError(f"pocketsphinx decoder options: {exc}") from exc
        self._decoder_class = pocketsphinx.Decoder
        self._options = options
        self._cmninit = str(options["cmninit"])
        self._max_idle = max_idle_decoders
        self._idle: list[_Slot] = []
        self._lock = threading.Lock()  # the pool is touched from worker threads

    def open_stream(self, *, sample_rate: int = TELEPHONY_RATE) -> PocketsphinxStream:
        """Start an utterance whose audio comes at ``sample_rate`` Hz (resampled to 16 kHz).

        Raises:
            audio.AudioError: ``sample_rate`` is not a positive integer.
        """
        return PocketsphinxStream(self, sample_rate=sample_rate)

    async def warm_up(self, count: int = 1) -> None:
        """Load decoders ahead of the first calls, until ``count`` are idle in the pool.

        Loading holds the GIL for about 0.3 s per decoder even in a thread, so do this at
        start-up rather than on a call's first words.

        Raises:
            TranscriptionError: The model could not be loaded.
        """
        while self.idle_decoders < min(count, self._max_idle):
            slot = await asyncio.to_thread(self._new_slot)
            self._release(slot)

    @property
    def idle_decoders(self) -> int:
        """Decoders loaded and waiting in the pool."""
        with self._lock:
            return len(self._idle)

    # -- pool (worker threads) ------------------------------------------------------------
    def _new_slot(self) -> _Slot:
        try:
            return _Slot(self._decoder_class(**self._options))
        except RuntimeError as exc:
            raise TranscriptionError(f"pocketsphinx could not load its model: {exc}") from exc

    def _acquire(self) -> _Slot:
        with self._lock:
            slot = self._idle.pop() if self._idle else None
        if slot is None:
            slot = self._new_slot()
        elif slot.in_utterance:
            slot.decoder.end_utt()
            slot.in_utterance = False
        _reset(slot.decoder, self._cmninit)
        return slot

    def _release(self, slot: _Slot) -> None:
        with self._lock:
            if len(self._idle) < self._max_idle:
                self._idle.append(slot)


class SerialDecodingStream(StreamLifecycle):
    """What the pocketsphinx streams share: one asyncio task (the *sender*) hands the decoder
    every request in turn, in the order made: the audio fed since the last one, interim results
    asked for, the end of the utterance. A subclass says how one request is decoded
    (:meth:`_request`) and what to give back when the stream is done (:meth:`_let_go`).
    """

    _engine = "pocketsphinx"  # names the engine in errors
    _eager = True  # decode audio as it is fed (False: only when finish() or partial() asks)

    def __init__(self, *, sample_rate: int) -> None:
        self._input = PcmInput(from_rate=sample_rate, to_rate=MODEL_RATE)
        self.sample_rate = sample_rate
        self._state = StreamState.OPEN
        self._pending = bytearray()  # 16 kHz audio not yet taken by the sender
        self._partials: list[asyncio.Future[Transcript | None]] = []
        self._final: asyncio.Future[Transcript] | None = None
        self._sender: asyncio.Task[None] | None = None
        self._failure: TranscriptionError | None = None

    def feed(self, pcm16: bytes) -> None:
        """Queue audio for decoding (see :meth:`speech.TranscriptionStream.feed`).

        Raises:
            StreamFinishedError: ``finish()`` was already called.
            StreamClosedError: The stream is closed.
            TranscriptionError: Decoding failed.
        """
        self._check_open()
        self._pending += self._input.push(pcm16)
        if self._eager and len(self._pending) >= _PIECE_BYTES:  # less would only be carried over
            self._kick()

    async def partial(self) -> Transcript | None:
        """The best hypothesis for the audio fed so far (``final=False``).

        Raises:
            StreamFinishedError: ``finish()`` was already called.
            StreamClosedError: The stream is closed, or was closed while waiting.
            TranscriptionError: Decoding failed.
        """
        self._check_open()
        future: asyncio.Future[Transcript | None] = asyncio.get_running_loop().create_future()
        self._partials.append(future)
        self._kick()
        return await future

    async def finish(self) -> Transcript:
        """End the utterance and return what was said.

        Raises:
            StreamFinishedError: Called twice.
            StreamClosedError: The stream is closed, or was closed while waiting.
            TranscriptionError: Decoding failed.
        """
        self._check_open()
        self._state = StreamState.FINISHING
        self._final = asyncio.get_running_loop().create_future()
        self._kick()
        return await self._final

    def close(self) -> None:
        """Give the decoder back (once the request in flight is done); idempotent."""
        if self._state is StreamState.CLOSED:
            return
        self._state = StreamState.CLOSED
        self._pending.clear()
        self._fail_waiters(StreamClosedError("transcription stream closed"))
        if self._sender is None:
            self._let_go()

    async def aclose(self) -> None:
        """Close, then wait until the request in flight is done and the decoder given back."""
        self.close()
        if self._sender is not None:
            await asyncio.wait([self._sender])

    # -- for subclasses ------------------------------------------------------------------------
    async def _request(self, audio: bytes, end: bool,
                       want_text: bool) -> tuple[str, tuple[str, ...]]:
        """Decode ``audio``, end the utterance if ``end``; the hypothesis (when asked for or at
        the end) and the keyphrases spotted so far."""
        raise NotImplementedError

    def _let_go(self) -> None:
        """The stream is done (finished, closed, or failed): give its decoder back."""
        raise NotImplementedError

    def _abandon(self) -> None:
        """The sender failed or was cancelled mid-request: the decoder is in an unknown state."""

    # -- internals -------------------------------------------------------------------------
    def _check_open(self) -> None:
        super()._check_open()
        if self._failure is not None:
            raise self._failure

    def _kick(self) -> None:
        if self._sender is not None or self._failure is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # fed outside a loop: the audio waits for partial() or finish()
        self._sender = loop.create_task(self._run())

    def _fail_waiters(self, error: Exception) -> None:
        waiters: list[asyncio.Future[Any]] = list(self._partials)
        if self._final is not None:
            waiters.append(self._final)
        for future in waiters:
            if not future.done():
                future.set_exception(error)
        self._partials = []

    async def _run(self) -> None:
        cancelled = False
        partials: list[asyncio.Future[Transcript | None]] = []  # answered by this round
        try:
            while self._state is not StreamState.CLOSED:
                audio = bytes(self._pending)
                self._pending.clear()
                partials, self._partials = self._partials, []
                ending = self._state is StreamState.FINISHING
                if not audio and not partials and not ending:
                    break
                text, spotted = await self._request(audio, ending, bool(partials))
                for future in partials:
                    if not future.done():
                        future.set_result(Transcript(text, final=False, keyphrases=spotted))
                if ending:
                    if self._state is StreamState.FINISHING:
                        self._state = StreamState.FINISHED
                    if self._final is not None and not self._final.done():
                        self._final.set_result(Transcript(text, final=True, keyphrases=spotted))
                    break
        except asyncio.CancelledError:
            # The loop is going away; a decoder call may still be running.
            cancelled = True
            self._abandon()
            raise
        except Exception as exc:
            if isinstance(exc, TranscriptionError):
                failure = exc
            else:
                failure = TranscriptionError(f"{self._engine} failed: {exc}")
                failure.__cause__ = exc
            self._failure = failure
            self._abandon()
            self._partials += partials
            self._fail_waiters(failure)
        finally:
            self._sender = None
            done = self._state in (StreamState.FINISHED, StreamState.CLOSED)
            if not cancelled and (done or self._failure is not None):
                self._let_go()


class PocketsphinxStream(SerialDecodingStream):
    """One utterance on a :class:`PocketsphinxTranscriber` (a :class:`~speech.TranscriptionStream`).

    The sender runs every decoder call in a thread. Audio is cut into fixed 20 ms pieces there,
    so the result does not depend on the chunk sizes given to :meth:`feed` or on when the sender
    ran.
    """

    def __init__(self, owner: PocketsphinxTranscriber, *, sample_rate: int) -> None:
        super().__init__(sample_rate=sample_rate)
        self._owner = owner
        # Touched by the sender's thread while the sender runs, else by the loop's thread.
        self._slot: _Slot | None = None
        self._remainder = b""  # less than one piece, waiting for more

    async def _request(self, audio: bytes, end: bool,
                       want_text: bool) -> tuple[str, tuple[str, ...]]:
        return await asyncio.to_thread(self._decode, audio, end, want_text or end), ()

    def _let_go(self) -> None:
        slot, self._slot = self._slot, None
        if slot is not None:
            self._owner._release(slot)

    def _abandon(self) -> None:
        self._slot = None  # a thread may still be in it, or it is in an unknown state

    def _decode(self, audio: bytes, end: bool, want_text: bool) -> str:
        """Worker thread: decode ``audio``, optionally end the utterance, return the hypothesis."""
        data = self._remainder + audio
        slot = self._slot
        if slot is None:
            if not data:
                return ""  # nothing was ever said: no decoder needed
            slot = self._slot = self._owner._acquire()
        decoder = slot.decoder
        if not slot.in_utterance:
            decoder.start_utt()
            slot.in_utterance = True
        whole = len(data) - len(data) % _PIECE_BYTES
        for start in range(0, whole, _PIECE_BYTES):
            decoder.process_raw(data[start : start + _PIECE_BYTES])
        self._remainder = data[whole:]
        if end:
            if self._remainder:
                decoder.process_raw(self._remainder)
                self._remainder = b""
            decoder.end_utt()
            slot.in_utterance = False
        if not want_text:
            return ""
        hypothesis = decoder.hyp()
        return hypothesis.hypstr if hypothesis is not None else ""
