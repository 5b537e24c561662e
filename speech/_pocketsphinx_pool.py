"""PocketSphinx in worker processes: offline speech to text that never blocks the gateway.

``Decoder.process_raw`` holds Python's GIL. In the gateway's process even the streamed decoder
of :mod:`speech._pocketsphinx` starves the event loop once two or three callers talk at once
(bench/load.py: frame lag p99 81 ms at 2 calls, 966 ms at 4). Here each caller turn is collected
as audio while it is spoken and decoded whole, after ``speech_stopped``, by one of a few worker
processes that each keep a loaded decoder. The gateway's loop only appends bytes.

Whole-utterance decoding (batch cepstral normalisation) is also the most accurate mode measured
on the corpus: word error 0.68 against 0.83 streamed; "go forward ten meters" comes back exact.
The cost is latency after the turn: 0.4-0.7 x the utterance on one core.

Workers start with the ``spawn`` method (the gateway's process has threads: fork is not safe),
lazily or through :meth:`PocketsphinxPoolTranscriber.warm_up`.

Lifetime. A worker never outlives the process that started it: on Linux it asks the kernel for
SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``), elsewhere a thread watches the parent
pid; a gateway killed with ``kill -9`` used to leave its decoders running for 19+ minutes, 175 MB
each (issue 13). A worker ignores SIGHUP and SIGINT: closing the terminal (SIGHUP to the process
group) or Ctrl-C is for the gateway to act on, and used to kill every decoder, after which each
later turn failed with "process pool is not usable anymore". If the pool breaks anyway (a worker
killed), the next turn builds a new one and is decoded there.

The kernel's death signal follows the *thread* that started the worker: the pool starts workers
from the thread that submits to it, which is the event loop's thread here.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from audio import TELEPHONY_RATE, PcmInput

from ._errors import ConfigurationError, StreamClosedError, StreamFinishedError, TranscriptionError
from ._pocketsphinx import _DEFAULT_OPTIONS, MODEL_RATE, DecoderOption
from ._stt import StreamState, Transcript

__all__ = ["PocketsphinxPoolStream", "PocketsphinxPoolTranscriber"]

log = logging.getLogger("callgate.speech")

_decoder: Any = None  # one per worker process
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_PARENT_POLL_S = 1.0  # the fallback watcher's period, where prctl is not available


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


def _init_worker(options: dict[str, DecoderOption], parent_pid: int) -> None:
    global _decoder
    # First, before the slow decoder load: a SIGHUP from the terminal is the gateway's to handle.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent_pid)
    import pocketsphinx  # type: ignore[import-untyped]

    _decoder = pocketsphinx.Decoder(**options)


def _ready() -> bool:
    return _decoder is not None


def _decode(audio16k: bytes) -> str:
    """Worker process: one whole utterance at 16 kHz -> its hypothesis."""
    assert _decoder is not None
    _decoder.start_utt()
    _decoder.process_raw(audio16k, full_utt=True)
    _decoder.end_utt()
    hyp = _decoder.hyp()
    return str(hyp.hypstr) if hyp is not None else ""


class PocketsphinxPoolTranscriber:
    """Offline transcriber whose decoding runs in ``workers`` separate processes.

    Args:
        workers: Decoder processes (each ~90 MB); turns beyond them queue.
        decoder_options: PocketSphinx options over the defaults of :mod:`speech._pocketsphinx`.

    Raises:
        ConfigurationError: ``workers`` < 1.
    """

    def __init__(self, *, workers: int = 2,
                 decoder_options: Mapping[str, DecoderOption] | None = None) -> None:
        if workers < 1:
            raise ConfigurationError(f"workers must be >= 1, got {workers}")
        self._options = {**_DEFAULT_OPTIONS, **(decoder_options or {})}
        self._workers = workers
        self._pool: ProcessPoolExecutor | None = None
        self.rebuilds = 0
        """Pools replaced after breaking (a worker process died)."""

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                max_workers=self._workers, mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker, initargs=(dict(self._options), os.getpid()),
            )
        return self._pool

    def worker_pids(self) -> list[int]:
        """The pids of the decoder processes running now (for ops and tests)."""
        pool = self._pool
        processes = getattr(pool, "_processes", None) or {}
        return sorted(pid for pid, proc in processes.items() if proc.is_alive())

    def _rebuild(self, broken: ProcessPoolExecutor, exc: BaseException) -> None:
        """Replace ``broken`` (once, however many turns saw it break)."""
        if self._pool is not broken:
            return
        self.rebuilds += 1
        log.warning("speech to text pool broken (%s: %s); starting a new one (rebuild %d)",
                    type(exc).__name__, exc, self.rebuilds)
        self._pool = None
        broken.shutdown(wait=False, cancel_futures=True)

    def open_stream(self, *, sample_rate: int = TELEPHONY_RATE) -> PocketsphinxPoolStream:
        return PocketsphinxPoolStream(self, sample_rate=sample_rate)

    async def warm_up(self, count: int = 1) -> None:
        """Start the worker processes and load their decoders before the first call."""
        loop = asyncio.get_running_loop()
        pool = self._executor()
        await asyncio.gather(*[loop.run_in_executor(pool, _ready)
                               for _ in range(max(count, self._workers))])

    async def transcribe(self, audio16k: bytes) -> str:
        """Decode one turn. A broken pool is replaced and the turn decoded once more on the new
        one (decoding has no side effects); a second failure is a TranscriptionError."""
        loop = asyncio.get_running_loop()
        for attempt in (1, 2):
            pool = self._executor()
            try:
                return await loop.run_in_executor(pool, _decode, audio16k)
            except BrokenProcessPool as exc:
                self._rebuild(pool, exc)
                if attempt == 2:
                    raise TranscriptionError(f"pocketsphinx worker failed: {exc}") from exc
            except Exception as exc:
                raise TranscriptionError(f"pocketsphinx worker failed: {exc}") from exc
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __del__(self) -> None:
        if getattr(self, "_pool", None) is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)  # type: ignore[union-attr]


class PocketsphinxPoolStream:
    """One caller turn: ``feed`` collects (upsampled) audio; ``finish`` decodes it in a worker."""

    def __init__(self, owner: PocketsphinxPoolTranscriber, *, sample_rate: int) -> None:
        self._owner = owner
        self._input = PcmInput(from_rate=sample_rate, to_rate=MODEL_RATE)
        self._audio = bytearray()
        self._state = StreamState.OPEN

    @property
    def state(self) -> StreamState:
        return self._state

    def feed(self, pcm16: bytes) -> None:
        if self._state is StreamState.CLOSED:
            raise StreamClosedError("the transcription stream is closed")
        if self._state is not StreamState.OPEN:
            raise StreamFinishedError("the utterance is already finished")
        self._audio += self._input.push(pcm16)

    async def partial(self) -> Transcript | None:
        """Whole-utterance decoding has no interim text."""
        if self._state is StreamState.CLOSED:
            raise StreamClosedError("the transcription stream is closed")
        return None

    async def finish(self) -> Transcript:
        if self._state is StreamState.CLOSED:
            raise StreamClosedError("the transcription stream is closed")
        if self._state is not StreamState.OPEN:
            raise StreamFinishedError("the utterance is already finished")
        self._state = StreamState.FINISHING
        audio, self._audio = bytes(self._audio), bytearray()
        text = await self._owner.transcribe(audio) if audio else ""
        self._state = StreamState.FINISHED
        return Transcript(text, final=True)

    def close(self) -> None:
        self._state = StreamState.CLOSED
        self._audio = bytearray()
