"""PocketSphinx in worker processes: offline speech to text that never blocks the gateway.

``Decoder.process_raw`` holds Python's GIL. In the gateway's process even the streamed decoder
of :mod:`speech._pocketsphinx` starves the event loop once two or three callers talk at once
(bench/load.py: frame lag p99 81 ms at 2 calls, 966 ms at 4). Here the decoders live in a few
worker processes; the gateway's loop only sends them audio.

Whole turns, by default: the stream collects the turn's audio and ``finish`` has its worker
decode it at once, with batch normalisation (word error 0.69 on the 13 real utterances below).

Decoding as the audio arrives (``as_audio_arrives=True``): the turn is decoded while it is
spoken: ``feed`` sends the audio gathered since the last send to the stream's decoder in its
worker (``process_raw`` with live normalisation, in 20 ms pieces so the result does not depend
on how the audio was cut), and ``finish`` only sends the last piece and ends the utterance.
Measured with ``python -m bench.stt_stream --pace 0 --streamed`` (the 13 distinct real
utterances of the dev recordings, 1.0-8.0 s, each fed as fast as its decoder keeps up, as on a
gateway whose decoder has a core; the previous code, which decoded the whole turn after
``finish``, run right after on the same machine, shared by ~7 helpers at load 10-16 on 2 cores):
finish() to the final transcript p50 1,320 ms against 15,632 ms (0.39 against 5.9 x the turn;
ratio 0.084). On that machine a decoder got about 1/8 of a core (one costs 0.71-0.80 s of CPU
per second of speech either way), so both figures are ~8x what an idle core gives. The price is
accuracy: live normalisation has not seen the whole turn, word error 0.86 against 0.69 in the
same runs ("go forward ten meters" comes back "go forward and the ears", "yes" as "yet"). And in
the live gateway on that machine (``callgate serve`` + ``callgate call`` of the README's
example, two runs each, alternating with the whole-turn code, load 7-13) the transcript came
2,780 and 5,680 ms after the caller's speech ended, against 1,200 and 2,160 ms whole: there the
streamed decoder fell behind while the call was live, not measured further. Hence off by default
until it is measured on a quiet machine.

Each worker process is its own single-process executor (a *lane*): a stream's decoder state is
in one process, so all of a stream's audio goes to the lane it started on (the least busy one
when it started). A worker keeps a decoder per utterance it is decoding and up to
``_IDLE_DECODERS`` loaded for the next ones (~90 MB each).

Workers start with the ``spawn`` method (the gateway's process has threads: fork is not safe),
lazily or through :meth:`PocketsphinxPoolTranscriber.warm_up`.

Lifetime. A worker never outlives the process that started it: on Linux it asks the kernel for
SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``), elsewhere a thread watches the parent
pid; a gateway killed with ``kill -9`` used to leave its decoders running for 19+ minutes, 175 MB
each (issue 13). A worker ignores SIGHUP and SIGINT: closing the terminal (SIGHUP to the process
group) or Ctrl-C is for the gateway to act on, and used to kill every decoder, after which each
later turn failed with "process pool is not usable anymore". If a lane breaks anyway (its worker
killed), the next request on it builds a new one, and a stream that was decoding there sends its
whole turn so far to the new worker (the stream keeps the audio it sent: 32 kB a second).

The kernel's death signal follows the *thread* that started the worker: an executor starts its
worker from the thread that submits to it, which is the event loop's thread here.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import logging
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any, Final

from audio import TELEPHONY_RATE, PcmInput

from ._errors import ConfigurationError, TranscriptionError
from ._pocketsphinx import (
    _DEFAULT_OPTIONS,
    _PIECE_BYTES,
    DecoderOption,
    SerialDecodingStream,
    _reset,
)
from ._stt import Transcript

__all__ = [
    "KEYPHRASE_THRESHOLD",
    "MIN_KEYPHRASE_PHONES",
    "PocketsphinxPoolStream",
    "PocketsphinxPoolTranscriber",
    "spottable",
]

log = logging.getLogger("callgate.speech")

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_PARENT_POLL_S = 1.0  # the fallback watcher's period, where prctl is not available
_IDLE_DECODERS: Final = 2  # per worker, loaded for the next utterances

KEYPHRASE_THRESHOLD: Final = 1.0
"""The spotter's default threshold. ``python -m bench.keyphrases`` (the 13 distinct real
utterances of the dev recordings, none of which says one of the shipped agent's phrases but
"yes", plus 16 probe words of theirs): at 1e-20 it found 12 of 19 spoken phrases and made 158
false detections, an agent phrase in all 13 utterances; at 1.0, 6 of 19 and 11 false (in 6
utterances: "pay" 3, digits 7, "yes" 1); at 10, 5 of 19 and 9 false (in 5)."""

MIN_KEYPHRASE_PHONES: Final = 2
"""Shorter phrases are not spotted: "owe" and "oh" (one phone, OW) fired in 12 of the 13 clips
even at a threshold of 1e-2, and in 2 at 1e10."""


def spottable(phrases: Sequence[str], dictionary: str) -> tuple[str, ...]:
    """The distinct ``phrases`` (lower case, single-spaced) the spotter can listen for.

    Raises:
        ConfigurationError: A word of a phrase is not in ``dictionary`` (a pocketsphinx
            dictionary file: ``word PHONE PHONE ...`` per line).
    """
    wanted = list(dict.fromkeys(" ".join(p.lower().split()) for p in phrases if p.strip()))
    if not wanted:
        return ()
    words = {word for phrase in wanted for word in phrase.split()}
    phones: dict[str, int] = {}
    with open(dictionary, encoding="utf-8") as file:
        for line in file:
            word, _, pronunciation = line.partition(" ")
            if word in words and word not in phones:
                phones[word] = len(pronunciation.split())
    missing = sorted(words - phones.keys())
    if missing:
        raise ConfigurationError(f"keyphrases: not in the pocketsphinx dictionary: {missing}")
    kept = tuple(p for p in wanted if sum(phones[w] for w in p.split()) >= MIN_KEYPHRASE_PHONES)
    if len(kept) < len(wanted):
        log.warning("keyphrases too short to spot (under %d phones), left out: %s",
                    MIN_KEYPHRASE_PHONES, [p for p in wanted if p not in kept])
    return kept


def _default_dict() -> str:
    import pocketsphinx

    return str(pocketsphinx.Config()["dict"])


# -- the worker process -------------------------------------------------------------------------
@dataclass(slots=True)
class _Decoders:
    """Worker process: the open-vocabulary decoder and, with keyphrases, the spotter beside it."""

    decoder: Any
    spotter: Any | None


@dataclass(slots=True)
class _Utterance:
    """Worker process: one stream's decoders inside its utterance, and audio short of a piece."""

    decoders: _Decoders
    remainder: bytes = b""


@dataclass(slots=True)
class _WorkerState:
    options: dict[str, DecoderOption]
    keyphrase_file: str | None  # the spotter's list, in pocketsphinx's kws format
    idle: list[_Decoders] = field(default_factory=list)
    utterances: dict[int, _Utterance] = field(default_factory=dict)


_worker: _WorkerState | None = None  # one per worker process


def _die_with_parent(parent_pid: int) -> None:
    """Worker process: be killed when ``parent_pid`` goes, however it goes."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    else:
        def watch() -> None:
            while os.getppid() == parent_pid:
                time.sleep(_PARENT_POLL_S)
            os._exit(1)

        threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    if os.getppid() != parent_pid:  # the parent died before the death signal was armed
        os._exit(1)


def _init_worker(options: dict[str, DecoderOption], keyphrases: str, parent_pid: int) -> None:
    global _worker
    # First, before the slow decoder load: a SIGHUP from the terminal is the gateway's to handle.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent_pid)
    keyphrase_file = None
    if keyphrases:
        with tempfile.NamedTemporaryFile("w", prefix="callgate-kws-", suffix=".txt",
                                         delete=False) as file:
            file.write(keyphrases)
        keyphrase_file = file.name
    _worker = _WorkerState(dict(options), keyphrase_file)
    _worker.idle.append(_new_decoders(_worker))


def _new_decoders(state: _WorkerState) -> _Decoders:
    import pocketsphinx

    spotter = None
    if state.keyphrase_file is not None:
        spotter = pocketsphinx.Decoder(**{**state.options, "lm": None,
                                          "kws": state.keyphrase_file})
    return _Decoders(pocketsphinx.Decoder(**state.options), spotter)


def _ready() -> bool:
    return _worker is not None and bool(_worker.idle or _worker.utterances)


def _decode(stream_id: int, audio16k: bytes, end: bool, want_text: bool,
            whole: bool = False) -> tuple[str, tuple[str, ...]]:
    """Worker process: decode ``audio16k`` of stream ``stream_id`` (a new utterance when the
    stream has none here) and end the utterance if ``end``; ``whole``: it is the whole
    utterance, normalised as one batch. Returns the hypothesis (if asked for or at the end,
    else "") and the keyphrases spotted so far, in the order heard."""
    state = _worker
    assert state is not None
    utterance = state.utterances.get(stream_id)
    if utterance is None:
        decoders = state.idle.pop() if state.idle else _new_decoders(state)
        for decoder in _each(decoders):
            _reset(decoder, str(state.options["cmninit"]))
            decoder.start_utt()
        utterance = state.utterances[stream_id] = _Utterance(decoders)
    data = utterance.remainder + audio16k
    cut = len(data) - len(data) % _PIECE_BYTES
    pieces = [data[start : start + _PIECE_BYTES] for start in range(0, cut, _PIECE_BYTES)]
    utterance.remainder = data[cut:]
    if end and utterance.remainder:
        pieces.append(utterance.remainder)
    for decoder in _each(utterance.decoders):
        if whole:
            decoder.process_raw(data, no_search=False, full_utt=True)
        else:
            for piece in pieces:
                decoder.process_raw(piece, no_search=False, full_utt=False)
        if end:
            decoder.end_utt()
    text = ""
    if want_text or end:
        hypothesis = utterance.decoders.decoder.hyp()
        text = str(hypothesis.hypstr) if hypothesis is not None else ""
    spotted: tuple[str, ...] = ()
    if utterance.decoders.spotter is not None:
        segments = utterance.decoders.spotter.seg() or []
        spotted = tuple(dict.fromkeys(segment.word.strip() for segment in segments))
    if end:
        del state.utterances[stream_id]
        if len(state.idle) < _IDLE_DECODERS:
            state.idle.append(utterance.decoders)
    return text, spotted


def _each(decoders: _Decoders) -> list[Any]:
    return [decoders.decoder] if decoders.spotter is None else [decoders.decoder,
                                                                 decoders.spotter]


def _drop(stream_id: int) -> None:
    """Worker process: a stream closed before its end: end its utterance, keep the decoders."""
    state = _worker
    assert state is not None
    utterance = state.utterances.pop(stream_id, None)
    if utterance is None:
        return
    for decoder in _each(utterance.decoders):
        decoder.end_utt()
    if len(state.idle) < _IDLE_DECODERS:
        state.idle.append(utterance.decoders)


# -- the gateway's side -------------------------------------------------------------------------
class _Lane:
    """One worker process (a single-process executor), rebuilt when it breaks."""

    def __init__(self, options: dict[str, DecoderOption], keyphrases: str) -> None:
        self._options = options
        self._keyphrases = keyphrases
        self.executor: ProcessPoolExecutor | None = None
        self.streams = 0
        """Streams decoding here now (a new stream takes the lane with the fewest)."""

    def get(self) -> ProcessPoolExecutor:
        if self.executor is None:
            self.executor = ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker,
                initargs=(dict(self._options), self._keyphrases, os.getpid()),
            )
        return self.executor

    def pids(self) -> list[int]:
        processes = getattr(self.executor, "_processes", None) or {}
        return [pid for pid, proc in processes.items() if proc.is_alive()]

    def shutdown(self, *, wait: bool) -> None:
        executor, self.executor = self.executor, None
        if executor is not None:
            executor.shutdown(wait=wait, cancel_futures=True)


class PocketsphinxPoolTranscriber:
    """Offline transcriber whose decoding runs in ``workers`` separate processes, as the audio
    arrives.

    Args:
        workers: Decoder processes (each ~90 MB a decoder); a stream stays on the one it
            started on, and concurrent streams on one share its core.
        decoder_options: PocketSphinx options over the defaults of :mod:`speech._pocketsphinx`.
        keyphrases: Phrases to spot beside the open-vocabulary transcript (pocketsphinx's
            keyphrase search, a second decoder on the same audio): each transcript's
            ``keyphrases`` are those heard. Words must be in the model's dictionary; phrases of
            fewer than :data:`MIN_KEYPHRASE_PHONES` phones are left out (logged).
        keyphrase_threshold: The spotter's detection threshold for every phrase (higher: fewer
            detections; see :mod:`bench.keyphrases` for what it buys on real speech).
        as_audio_arrives: Decode each turn while it is spoken (``finish`` has only the last
            piece left) instead of whole at ``finish`` (batch normalisation, no interim
            results). Off by default: in the live gateway on a loaded machine it was the slower
            of the two (module docstring), and its word error is higher.

    Raises:
        ConfigurationError: ``workers`` < 1, or a keyphrase word the dictionary lacks.
    """

    def __init__(self, *, workers: int = 2,
                 decoder_options: Mapping[str, DecoderOption] | None = None,
                 keyphrases: Sequence[str] = (),
                 keyphrase_threshold: float = KEYPHRASE_THRESHOLD,
                 as_audio_arrives: bool = False) -> None:
        if workers < 1:
            raise ConfigurationError(f"workers must be >= 1, got {workers}")
        self.as_audio_arrives = as_audio_arrives
        """Decode while the caller speaks; False: the whole turn at ``finish`` (see above)."""
        options = {**_DEFAULT_OPTIONS, **(decoder_options or {})}
        self.keyphrases = spottable(keyphrases, str(options.get("dict") or _default_dict()))
        """The phrases the spotter listens for (the spottable ones of ``keyphrases``)."""
        kws = "".join(f"{phrase} /{keyphrase_threshold:g}/\n" for phrase in self.keyphrases)
        self._lanes = [_Lane(options, kws) for _ in range(workers)]
        self._ids = itertools.count(1)
        self.rebuilds = 0
        """Worker processes replaced after breaking (killed)."""

    def worker_pids(self) -> list[int]:
        """The pids of the decoder processes running now (for ops and tests)."""
        return sorted(pid for lane in self._lanes for pid in lane.pids())

    def open_stream(self, *, sample_rate: int = TELEPHONY_RATE) -> PocketsphinxPoolStream:
        """Start an utterance whose audio comes at ``sample_rate`` Hz (resampled to 16 kHz)."""
        return PocketsphinxPoolStream(self, sample_rate=sample_rate)

    async def warm_up(self, count: int = 1) -> None:
        """Start every worker process and load its first decoder before the first call."""
        del count  # every worker loads one decoder at start
        loop = asyncio.get_running_loop()
        await asyncio.gather(*[loop.run_in_executor(lane.get(), _ready) for lane in self._lanes])

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        for lane in self._lanes:
            lane.shutdown(wait=True)

    def __del__(self) -> None:
        for lane in getattr(self, "_lanes", ()):
            lane.shutdown(wait=False)

    # -- for the streams ------------------------------------------------------------------------
    def _take_lane(self) -> _Lane:
        lane = min(self._lanes, key=lambda candidate: candidate.streams)
        lane.streams += 1
        return lane

    def _rebuild(self, lane: _Lane, broken: ProcessPoolExecutor, exc: BaseException) -> None:
        """Replace ``broken`` (once, however many streams saw it break)."""
        if lane.executor is not broken:
            return
        self.rebuilds += 1
        log.warning("speech to text worker broken (%s: %s); starting a new one (rebuild %d)",
                    type(exc).__name__, exc, self.rebuilds)
        lane.shutdown(wait=False)


class PocketsphinxPoolStream(SerialDecodingStream):
    """One caller turn, decoded in a worker process as ``feed`` brings its audio.

    The sender sends the audio gathered so far, interim requests and the end of the utterance to
    the stream's worker, one request at a time, in order; audio fed while one is in flight goes
    with the next.
    """

    _engine = "pocketsphinx worker"

    def __init__(self, owner: PocketsphinxPoolTranscriber, *, sample_rate: int) -> None:
        super().__init__(sample_rate=sample_rate)
        self._owner = owner
        self._eager = owner.as_audio_arrives
        self._id = next(owner._ids)
        self._sent = bytearray()  # the turn so far, for a worker that replaces a broken one
        self._lane: _Lane | None = None  # taken with the first audio
        self._executor: ProcessPoolExecutor | None = None  # the worker holding the utterance

    def _let_go(self) -> None:
        """Free the stream's lane, and drop its utterance there if it never ended."""
        lane, self._lane = self._lane, None
        executor, self._executor = self._executor, None
        self._sent = bytearray()
        if lane is None:
            return
        lane.streams -= 1
        if executor is not None and lane.executor is executor:
            try:
                executor.submit(_drop, self._id)
            except (RuntimeError, BrokenProcessPool):
                pass  # shut down or broken: the utterance went with the worker

    async def partial(self) -> Transcript | None:
        """The best hypothesis so far when decoding as the audio arrives; else ``None``.

        Raises:
            StreamFinishedError: ``finish()`` was already called.
            StreamClosedError: The stream is closed, or was closed while waiting.
            TranscriptionError: Decoding failed.
        """
        if not self._eager:
            self._check_open()
            return None
        return await super().partial()

    async def _request(self, audio: bytes, end: bool,
                       want_text: bool) -> tuple[str, tuple[str, ...]]:
        """Send ``audio`` (and the end) to the stream's worker. A broken worker is replaced and
        the whole turn so far sent to the new one (decoding has no side effects); a second
        failure is a TranscriptionError."""
        if self._lane is None:
            if not audio and not self._sent:
                return "", ()  # nothing was ever said: no worker needed
            self._lane = self._owner._take_lane()
        loop = asyncio.get_running_loop()
        for attempt in (1, 2):
            executor = self._lane.get()
            if executor is not self._executor:  # a new worker: it has none of the turn yet
                audio, self._sent = bytes(self._sent) + audio, bytearray()
                self._executor = executor
            try:
                whole = end and not self._eager and not self._sent
                result = await loop.run_in_executor(executor, _decode, self._id, audio, end,
                                                    want_text, whole)
            except BrokenProcessPool as exc:
                self._owner._rebuild(self._lane, executor, exc)
                self._sent += audio
                if attempt == 2:
                    raise TranscriptionError(f"pocketsphinx worker failed: {exc}") from exc
                audio = b""
                continue
            self._sent += audio
            if end:
                self._executor = None  # the worker ended the utterance itself
            return result
        raise AssertionError("unreachable")
