"""One Silero engine per process: every call's VAD windows, batched into shared inferences.

Each call opens a :class:`VadStream` and pushes its 8 kHz samples (a 20 ms Twilio frame is 160
samples; any length works). Every 256 samples complete a window. The engine keeps one recurrent
state row and one 32-sample context row per stream in a slot table and runs the ready windows of
many streams as one ``(B, 288)`` batch: Silero costs ~92 us (ONNX) for one row but ~31 us (ONNX)
or ~16 us (TorchScript) per row in a batch of 128, on one core (bench/vad_throughput.py).

Batching rules:

* A stream contributes at most one window per batch (window k+1 needs the state after window k);
  a stream with a backlog contributes its windows in order across consecutive batches.
* A batch runs when it is full (``max_batch`` streams ready), when every open stream has a window
  ready, or when the oldest ready window has waited ``max_wait_ms`` since it was pushed, scaled
  down below ``full_wait_streams`` open streams (few streams gather few rows in a wait). That
  bounds the latency batching adds; a backlog whose windows are already older than that runs at
  once, batch after batch.

A stream opened with echo settings (``open_stream(echo=...)``, as every gateway call is) also
owns a row of the engine's :class:`~vad._echo.EchoGateBank` for those settings. The batch that
scores its window then reads its echo/noise gate and, where the gate passes, the window's
voicing and DTMF features, for all such streams at once; :class:`WindowResult` carries both.
Done one call at a time these cost more per window than Silero does; batched, the media path
with the bot talking is 3.7-5.2x cheaper (bench/vad_throughput.py, (c2)).

Inference runs inline on the event loop, synchronously, inside the ``push``/``process``/timer that
completes the batch. Measured on this machine class (one core, onnxruntime): handing a batch to a
single worker thread and back costs 55-150 us of CPU per batch (future, thread wake-up, GIL
hand-over), more than a whole batch-of-1 inference (94 us), and buys no throughput since the
process is meant to own one core; inline, a full batch of 128 holds the loop for 2-4 ms, which is
a bounded stall well under one 20 ms frame. So: no thread.

Per-stream state lives in engine-wide arrays indexed by slot (``state[:, slots]`` gathers a batch,
``state[:, slots] = new`` scatters it back): 30 us per batch of 128, against 136-160 us for
stacking and splitting per-stream arrays in a Python loop. Closing a stream just frees its slot;
the other rows are never touched.

Errors::

    VadError                        (vad/_silero.py)
     +-- RuntimeUnavailable, InvalidAudio, InferenceError   (vad/_silero.py)
     +-- EngineError
     |    +-- EngineNotStarted      open_stream() before start()
     |    +-- EngineClosed          start() or open_stream() after aclose()
     +-- StreamClosed               push/process on a closed stream (also after its engine closed,
                                    or after an inference on its batch failed: see __cause__)
"""

from __future__ import annotations

import asyncio
import enum
import warnings
from collections import deque
from dataclasses import dataclass
from itertools import islice
from types import TracebackType
from typing import Final

import numpy as np
import numpy.typing as npt

from ._echo import EchoGateBank, EchoGateSettings, GateReading
from ._features import WindowFeatures, features_batch, hann_power
from ._policy import wants_features
from ._silero import (
    CONTEXT_SAMPLES,
    INPUT_SAMPLES,
    STATE_SIZE,
    WINDOW_SAMPLES,
    InferenceError,
    InvalidAudio,
    RuntimeName,
    SileroRuntime,
    VadError,
    import_runtime,
    load_runtime,
)

__all__ = [
    "EngineClosed",
    "EngineError",
    "EngineNotStarted",
    "EngineStats",
    "StreamClosed",
    "VadEngine",
    "VadStream",
    "WindowResult",
]

_INITIAL_SLOTS: Final = 16
_INITIAL_BUFFER: Final = 2048
_TAIL: Final = 128  # samples of the previous window the voicing feature looks back over
_NO_FEATURES: Final = WindowFeatures(voicing=0.0, dtmf=0.0)


class EngineError(VadError):
    """The engine is used outside its running lifetime."""


class EngineNotStarted(EngineError):
    """``open_stream`` was called before ``start``."""


class EngineClosed(EngineError):
    """The engine was closed with ``aclose``; it cannot be restarted."""


class StreamClosed(VadError):
    """The stream was closed (by ``close``, by its engine's ``aclose``, or by a failed batch)."""


@dataclass(frozen=True, slots=True)
class WindowResult:
    """Speech probability of one 256-sample window of a stream.

    Attributes:
        index: Window number in the stream, from 0.
        end_sample: Absolute index, in the stream, of the sample just after the window:
            ``256 * (index + 1)``. At 8 kHz it is ``end_sample / 8`` ms of audio.
        prob: Silero's speech probability in [0, 1].
        gate: The echo and noise gate's reading of the window, for a stream opened with
            ``echo`` settings (else None).
        features: Voicing and DTMF-likeness of the window, computed only where the policy reads
            them: windows the gate passes, and voiced-band candidates on echo-free lines
            (:func:`vad._policy.wants_features`); elsewhere zeros. None without a gate.
        ghost: The gate's reading of the window against the bot's audio as a line deaf to the
            clear plays it (:meth:`VadStream.fork_ghost`); None where no such copy is kept.
    """

    index: int
    end_sample: int
    prob: float
    gate: GateReading | None = None
    features: WindowFeatures | None = None
    ghost: GateReading | None = None


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Counters since start: ``windows / batches`` is the mean batch size."""

    batches: int
    windows: int
    open_streams: int


class _EngineState(enum.Enum):
    NEW = "new"  # constructed; start() not called yet
    RUNNING = "running"  # runtime loaded; streams may be opened
    CLOSED = "closed"  # aclose() called; terminal


class _StreamState(enum.Enum):
    OPEN = "open"  # accepting samples
    CLOSED = "closed"  # close(), engine aclose() or failed batch; terminal


class VadEngine:
    """Batched streaming Silero VAD shared by every call in the process.

    Not thread-safe: use it, and its streams, from the thread of the loop that started it.

    Example::

        async with VadEngine() as engine:
            async with engine.open_stream() as stream:
                for result in await stream.process(frame):  # frame: float32 8 kHz samples
                    ...
    """

    def __init__(
        self,
        *,
        runtime: RuntimeName | SileroRuntime = "torchscript",
        max_batch: int = 128,
        max_wait_ms: float = 2.0,
        full_wait_streams: int = 64,
    ) -> None:
        """Configure the engine; nothing is loaded until :meth:`start`.

        Args:
            runtime: ``"torchscript"`` or ``"onnx"`` to load the packaged model, or a loaded
                :class:`~vad._silero.SileroRuntime` (shared, never closed by the engine).
                TorchScript is the default because it serves the most calls per core once
                batches are large (16 vs 31 us per row at 128; 1250 vs 820 calls/core through
                the engine, bench/vad_throughput.py), which is when CPU is the limit; its
                probabilities match ONNX within 3e-6. ONNX is cheaper for small batches
                (< ~32 rows) and does not import torch (1.2 s, ~220 MB RSS).
            max_batch: Most rows (streams) per inference.
            max_wait_ms: Longest a ready window waits for a batch to fill, from its push.
            full_wait_streams: Open streams (a gateway call opens two with the echo canceller
                on, one with it off) from which a window waits all of ``max_wait_ms``;
                with fewer, it waits ``max_wait_ms * streams / full_wait_streams``. A wait
                gathers about ``streams * wait / 32 ms`` rows, and a row batched saves ~60 us
                of Silero (92 -> 31 us, ONNX): at 64 streams (32 calls, two streams each) 5 ms
                gathers ~10 rows, at 6 streams (3 calls) ~1, for a 5 ms wait. h16b's trace of
                the live gateway at 3 calls (SCHED_FIFO, so no other process on its core): the
                5 ms wait was most of the receive-to-done tail (the slowest 1% of frames 3.8 ms
                of CPU + 4.9 ms waiting for the batch; p99 9.8 ms, 3.0 ms with no wait) with a
                mean batch of 2.3 rows.
        """
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if not max_wait_ms >= 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms}")
        if full_wait_streams < 1:
            raise ValueError(f"full_wait_streams must be >= 1, got {full_wait_streams}")
        self._runtime_spec = runtime
        self._runtime: SileroRuntime | None = None if isinstance(runtime, str) else runtime
        self.max_batch: Final = max_batch
        self.max_wait_ms: Final = max_wait_ms
        self._max_wait_s = max_wait_ms / 1000.0
        self.full_wait_streams: Final = full_wait_streams
        self._lifecycle = _EngineState.NEW
        self._loop: asyncio.AbstractEventLoop | None = None
        # Slot table: row s of _state/_context belongs to the stream holding slot s.
        self._state = np.zeros((2, _INITIAL_SLOTS, STATE_SIZE), dtype=np.float32)
        self._context = np.zeros((_INITIAL_SLOTS, CONTEXT_SAMPLES), dtype=np.float32)
        self._tail = np.zeros((_INITIAL_SLOTS, _TAIL), dtype=np.float32)
        self._banks: dict[EchoGateSettings, EchoGateBank] = {}
        self._free_slots: list[int] = list(range(_INITIAL_SLOTS - 1, -1, -1))
        self._streams: set[VadStream] = set()
        # Streams with at least one window not yet run, in the order they became ready.
        self._ready: dict[VadStream, None] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._flushing = False
        self._batches = 0
        self._windows = 0

    # -- lifecycle ------------------------------------------------------------------------------
    @property
    def runtime(self) -> SileroRuntime:
        """The loaded runtime (after :meth:`start`)."""
        if self._runtime is None:
            raise EngineNotStarted("the runtime is loaded by start()")
        return self._runtime

    @property
    def stats(self) -> EngineStats:
        """Batches and windows run so far, and the number of open streams."""
        return EngineStats(self._batches, self._windows, len(self._streams))

    async def start(self) -> None:
        """Load the runtime (if given by name) and accept streams; a second call does nothing.

        A model given by name loads in a worker thread, so a loop that already serves other
        things is not stalled (importing torch takes ~1.2 s, loading the model 0.1-0.3 s).

        Raises:
            EngineClosed: The engine was closed.
            RuntimeUnavailable: The model cannot be loaded.
        """
        if self._lifecycle is _EngineState.CLOSED:
            raise EngineClosed("a closed VadEngine cannot be restarted; create a new one")
        if self._lifecycle is _EngineState.RUNNING:
            return
        loop = asyncio.get_running_loop()
        if self._runtime is None:
            assert isinstance(self._runtime_spec, str)
            # Import the runtime's Python package here, on the loop's thread: CPython 3.11's
            # compiler is not safe to run in two threads at once ("AST constructor recursion
            # depth mismatch"), and an import compiles. Only the model load goes to a thread.
            import_runtime(self._runtime_spec)
            runtime = await asyncio.to_thread(load_runtime, self._runtime_spec)
            if self._lifecycle is not _EngineState.NEW:  # closed (or started) meanwhile
                if self._lifecycle is _EngineState.CLOSED:
                    raise EngineClosed("the VadEngine was closed while it was starting")
                return
            self._runtime = runtime
        self._loop = loop
        self._lifecycle = _EngineState.RUNNING

    async def aclose(self) -> None:
        """Close every open stream (their pending ``process`` calls raise
        :class:`StreamClosed`) and stop; idempotent."""
        if self._lifecycle is _EngineState.CLOSED:
            return
        self._lifecycle = _EngineState.CLOSED
        self._cancel_timer()
        for stream in list(self._streams):
            stream._close(StreamClosed("the VadEngine was closed"))
        self._ready.clear()

    async def __aenter__(self) -> VadEngine:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __del__(self) -> None:
        if getattr(self, "_lifecycle", None) is _EngineState.RUNNING:
            warnings.warn(
                f"unclosed {self!r}; use 'async with VadEngine()' or await aclose()",
                ResourceWarning,
                stacklevel=1,
            )

    def __repr__(self) -> str:
        name = self._runtime.name if self._runtime is not None else self._runtime_spec
        return (
            f"<VadEngine {self._lifecycle.value} runtime={name!r} max_batch={self.max_batch} "
            f"max_wait_ms={self.max_wait_ms} streams={len(self._streams)}>"
        )

    def open_stream(self, *, echo: EchoGateSettings | None = None) -> VadStream:
        """Open a stream for one call, starting from zero state and context.

        With ``echo`` settings the stream also carries the call's echo and noise gate (a row of
        the engine's :class:`~vad._echo.EchoGateBank` for those settings): give it the bot's
        audio with :meth:`VadStream.add_reference`, and every window's result comes with the
        gate's reading and the window's features, computed for the whole batch at once.

        Raises:
            EngineNotStarted: :meth:`start` has not run.
            EngineClosed: The engine was closed.
        """
        if self._lifecycle is _EngineState.NEW:
            raise EngineNotStarted("await VadEngine.start() (or use 'async with') first")
        if self._lifecycle is _EngineState.CLOSED:
            raise EngineClosed("the VadEngine is closed")
        if not self._free_slots:
            self._grow()
        bank, row = None, -1
        if echo is not None:
            bank = self._banks.get(echo)
            if bank is None:
                bank = self._banks[echo] = EchoGateBank(echo)
            row = bank.open_row()
        stream = VadStream(self, self._free_slots.pop(), bank, row)
        self._streams.add(stream)
        return stream

    # -- slot table -----------------------------------------------------------------------------
    def _grow(self) -> None:
        old = self._context.shape[0]
        new = old * 2
        state = np.zeros((2, new, STATE_SIZE), dtype=np.float32)
        state[:, :old] = self._state
        context = np.zeros((new, CONTEXT_SAMPLES), dtype=np.float32)
        context[:old] = self._context
        tail = np.zeros((new, _TAIL), dtype=np.float32)
        tail[:old] = self._tail
        self._state, self._context, self._tail = state, context, tail
        self._free_slots.extend(range(new - 1, old - 1, -1))

    def _zero_slot(self, slot: int) -> None:
        self._state[:, slot] = 0.0
        self._context[slot] = 0.0
        self._tail[slot] = 0.0

    def _release(self, stream: VadStream) -> None:
        """Forget a closing stream; may release a batch that was waiting only for it."""
        self._streams.discard(stream)
        self._ready.pop(stream, None)
        self._zero_slot(stream._slot)
        self._free_slots.append(stream._slot)
        bank = stream._bank
        if bank is not None:
            stream.end_ghost()
            bank.close_row(stream._gate_row)
            if bank.open_rows == 0 and self._banks.get(bank.settings) is bank:
                del self._banks[bank.settings]  # settings no call uses any more (a reload)
        if self._lifecycle is _EngineState.RUNNING and self._ready:
            self._flush()
        elif not self._ready:
            # Nothing waits: a timer left armed was due for more open streams, and the fast
            # path of _on_windows would trust it for the next window (a longer wait than the
            # fewer streams now call for).
            self._cancel_timer()

    # -- scheduling -----------------------------------------------------------------------------
    def _on_windows(self, stream: VadStream) -> None:
        """``stream`` has new complete windows (called by push, on every window: keep it cheap)."""
        ready = self._ready
        if stream not in ready:
            ready[stream] = None
        # With a timer armed, it is due no later than this new window's deadline, and the batch
        # is neither full nor complete: nothing to do. No timer means this window is the oldest.
        if self._timer is None or len(ready) >= self.max_batch or len(ready) >= len(self._streams):
            self._flush()

    def _flush(self) -> None:
        """Run batches while a flush rule holds, then arm the timer for the oldest waiter."""
        if self._flushing:  # re-entered when a failed batch closes its streams (_release)
            return
        loop = self._loop
        assert loop is not None
        self._flushing = True
        try:
            while self._ready:
                ready = self._ready
                open_streams = len(self._streams)
                if len(ready) < self.max_batch and len(ready) < open_streams:
                    oldest = min(s._pending_since() for s in ready)
                    wait = self._max_wait_s * min(1.0, open_streams / self.full_wait_streams)
                    if oldest + wait > loop.time():
                        self._arm_timer(oldest + wait)
                        return
                batch = list(islice(ready, self.max_batch))  # oldest first
                for stream in batch:
                    del ready[stream]
                self._run_batch(batch)
                for stream in batch:
                    if stream._has_window():
                        ready[stream] = None
            self._cancel_timer()
        finally:
            self._flushing = False

    def _arm_timer(self, when: float) -> None:
        if self._timer is not None:
            if self._timer_at <= when:
                return
            self._timer.cancel()
        assert self._loop is not None
        self._timer_at = when
        self._timer = self._loop.call_at(when, self._on_timer)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        self._timer = None
        if self._lifecycle is _EngineState.RUNNING:
            self._flush()

    def _run_batch(self, batch: list[VadStream]) -> None:
        """Run one window of each stream in ``batch`` (distinct streams, each with a window)."""
        runtime = self._runtime
        assert runtime is not None
        n = len(batch)
        slots = np.fromiter((s._slot for s in batch), dtype=np.intp, count=n)
        x = np.empty((n, INPUT_SAMPLES), dtype=np.float32)
        x[:, :CONTEXT_SAMPLES] = self._context[slots]
        for row, stream in enumerate(batch):
            x[row, CONTEXT_SAMPLES:] = stream._take_window()
        try:
            probs, new_state = runtime.infer(x, self._state[:, slots])
        except Exception as exc:  # a runtime passed in may raise anything: fail only this batch
            error = exc if isinstance(exc, InferenceError) else InferenceError(repr(exc))
            if error is not exc:
                error.__cause__ = exc
            # These streams' windows are lost and their state is unknown: close them (the
            # cause is chained) rather than go on from a state that skipped a window.
            for stream in batch:
                failed = StreamClosed("a Silero inference on this stream's batch failed")
                stream._close(failed, error)
            return
        self._state[:, slots] = new_state
        self._context[slots] = x[:, -CONTEXT_SAMPLES:]
        self._batches += 1
        self._windows += n
        gates, feats, ghosts = self._hear(batch, slots, x)
        for stream, prob, gate, feat, ghost in zip(batch, probs.tolist(), gates, feats, ghosts,
                                                   strict=True):
            stream._deliver(prob, gate, feat, ghost)

    def _hear(self, batch: list[VadStream], slots: npt.NDArray[np.intp], x: npt.NDArray[np.float32]
              ) -> tuple[list[GateReading | None], list[WindowFeatures | None],
                         list[GateReading | None]]:
        """Echo/noise gates and features of the batch's gated streams, a bank at a time, and
        the readings of their ghost rows (:meth:`VadStream.fork_ghost`) in the same pass."""
        n = len(batch)
        gates: list[GateReading | None] = [None] * n
        feats: list[WindowFeatures | None] = [None] * n
        ghosts: list[GateReading | None] = [None] * n
        if not self._banks:
            return gates, feats, ghosts
        by_bank: dict[EchoGateBank, list[int]] = {}
        for i, stream in enumerate(batch):
            if stream._bank is not None:
                by_bank.setdefault(stream._bank, []).append(i)
        if not by_bank:
            return gates, feats, ghosts
        windows = x[:, CONTEXT_SAMPLES:]
        wide = windows.astype(np.float64)  # the precision gate and features compute in, once
        # One transform per window, read by the band floor and by the DTMF feature.
        spectrum = np.zeros((n, WINDOW_SAMPLES // 2 + 1))
        passing: list[int] = []
        for bank, idx in by_bank.items():
            members = [batch[i] for i in idx]
            rows = np.fromiter((s._gate_row for s in members), dtype=np.intp, count=len(idx))
            adapt = np.fromiter((s.gate_adapt for s in members), dtype=np.bool_, count=len(idx))
            sel = np.asarray(idx, dtype=np.intp) if len(idx) < n else slice(None)
            mine = wide[sel]
            spectrum[sel] = power = hann_power(mine)
            floor = bank.settings.min_level_dbfs
            haunted = [k for k, s in enumerate(members) if s._ghost_row >= 0]
            if haunted:  # the ghost rows hear the same windows and never learn from them
                h = np.asarray(haunted, dtype=np.intp)
                ghost_rows = np.fromiter((members[k]._ghost_row for k in haunted),
                                         dtype=np.intp, count=len(haunted))
                readings = bank.process(np.concatenate([rows, ghost_rows]),
                                        np.concatenate([mine, mine[h]]),
                                        np.concatenate([adapt, np.zeros(len(h), np.bool_)]),
                                        np.concatenate([power, power[h]]))
                for k, reading in zip(haunted, readings[len(idx):], strict=True):
                    ghosts[idx[k]] = reading
                readings = readings[: len(idx)]
            else:
                readings = bank.process(rows, mine, adapt, power)
            for i, reading in zip(idx, readings, strict=True):
                gates[i] = reading
                feats[i] = _NO_FEATURES
                if wants_features(reading, floor):  # the policy's rule (vad/_policy.py)
                    passing.append(i)
        if passing:
            p = np.asarray(passing, dtype=np.intp)
            got = features_batch(wide[p], self._tail[slots[p]], spectrum=spectrum[p])
            for i, f in zip(passing, got, strict=True):
                feats[i] = f
        self._tail[slots] = windows[:, -_TAIL:]
        return gates, feats, ghosts


class VadStream:
    """The VAD of one call: push 8 kHz samples, get one probability per 256-sample window.

    Obtain with :meth:`VadEngine.open_stream`; close with :meth:`close` or ``async with``.
    Results come back in window order. Every window is scored exactly once: windows completed
    by :meth:`push` are returned by the next :meth:`process` or :meth:`process_now`.
    """

    __slots__ = (
        "__weakref__",
        "_bank",
        "_buf",
        "_claimed",
        "_closed_error",
        "_done",
        "_engine",
        "_gate_row",
        "_ghost_row",
        "_lifecycle",
        "_push_times",
        "_rd",
        "_res_base",
        "_results",
        "_slot",
        "_total",
        "_waiters",
        "_wr",
        "gate_adapt",
    )

    def __init__(self, engine: VadEngine, slot: int, bank: EchoGateBank | None = None,
                 gate_row: int = -1) -> None:
        self._engine = engine
        self._slot = slot
        self._bank = bank
        self._gate_row = gate_row
        self._ghost_row = -1  # a copy of the gate's row kept through a pause (fork_ghost)
        self.gate_adapt = True
        """Whether the gate may learn from the next windows (echo gain, noise floor): set it
        False while the caller is known to be talking, so their voice is not learnt as echo."""
        self._lifecycle = _StreamState.OPEN
        self._closed_error: StreamClosed | None = None
        # Samples not yet run: _buf[_rd:_wr]; _total counts every sample pushed.
        self._buf = np.empty(_INITIAL_BUFFER, dtype=np.float32)
        self._rd = 0
        self._wr = 0
        self._total = 0
        self._done = 0  # windows run so far
        self._claimed = 0  # windows promised to a process()/process_now() call
        # (prob, gate, features, ghost) of windows _res_base, _res_base + 1, ...
        self._results: list[tuple[float, GateReading | None, WindowFeatures | None,
                                  GateReading | None]] = []
        self._res_base = 0
        self._waiters: deque[tuple[int, int, asyncio.Future[list[WindowResult]]]] = deque()
        # (window count after a push, loop time of that push): when the oldest pending window came.
        self._push_times: deque[tuple[int, float]] = deque()

    # -- public API -----------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether the stream is closed."""
        return self._lifecycle is _StreamState.CLOSED

    @property
    def windows_available(self) -> int:
        """Complete windows pushed so far (run or not)."""
        return self._total // WINDOW_SAMPLES

    def push(self, samples: npt.NDArray[np.floating]) -> None:
        """Buffer samples; complete windows are queued for the next batch.

        The batch may run right here, synchronously, when this push completes it.

        Args:
            samples: 1-D float 8 kHz audio in [-1, 1], any length (a Twilio frame is 160).

        Raises:
            StreamClosed: The stream is closed.
            InvalidAudio: ``samples`` is not a 1-D float array.
        """
        if self._append(samples):
            loop = self._engine._loop
            assert loop is not None
            self._push_times.append((self.windows_available, loop.time()))
            self._engine._on_windows(self)

    async def process(self, samples: npt.NDArray[np.floating]) -> list[WindowResult]:
        """Push ``samples``, then wait for every complete window not yet returned.

        If this call is cancelled, the windows it was waiting for are still run (the stream's
        state stays consistent) but their results are dropped.

        Returns:
            The new windows' results in order (empty when no window completed).

        Raises:
            StreamClosed: The stream is or gets closed; a failed inference is the ``__cause__``.
            InvalidAudio: ``samples`` is not a 1-D float array.
        """
        self.push(samples)
        self._check_open()  # the batch run by this push may have failed and closed us
        start, target = self._claimed, self.windows_available
        if target == start:
            return []
        self._claimed = target
        if self._done >= target:
            return self._collect(start, target)
        assert self._engine._loop is not None
        future: asyncio.Future[list[WindowResult]] = self._engine._loop.create_future()
        self._waiters.append((start, target, future))
        return await future

    def process_now(self, samples: npt.NDArray[np.floating]) -> list[WindowResult]:
        """Buffer ``samples`` and run all of this stream's pending windows now, as batches of 1.

        Same results as :meth:`process` (the runtimes score rows independently of the batch;
        ONNX bit for bit, TorchScript within ~3e-6), for offline analysis and tests.

        Raises:
            StreamClosed: The stream is closed, or an inference failed (``__cause__``).
            InvalidAudio: ``samples`` is not a 1-D float array.
        """
        self._append(samples)
        engine = self._engine
        engine._ready.pop(self, None)
        if not engine._ready:
            engine._cancel_timer()  # nothing waits (see _release)
        while self._has_window():
            engine._run_batch([self])
            self._check_open()  # a failed inference closes the stream
        self._push_times.clear()
        start, target = self._claimed, self._done
        if target == start:
            return []
        self._claimed = target
        return self._collect(start, target)

    def add_reference(self, start_sample: int, samples: npt.NDArray[np.floating]) -> None:
        """The bot's audio that plays on this call's line from inbound sample ``start_sample``
        on (the echo gate predicts its echo from it). Ignored on a closed or gate-less stream."""
        if self._bank is not None and self._lifecycle is _StreamState.OPEN:
            self._bank.add_reference(self._gate_row, start_sample, samples)

    def clear_reference_from(self, sample: int) -> None:
        """The bot's audio from inbound sample ``sample`` on was cancelled (a Twilio ``clear``)."""
        if self._bank is not None and self._lifecycle is _StreamState.OPEN:
            self._bank.clear_reference_from(self._gate_row, sample)

    @property
    def lag_hops(self) -> int | None:
        """The echo delay the gate has locked, in 8 ms hops (None: none, or no gate)."""
        return None if self._bank is None else self._bank.lag_hops(self._gate_row)

    def fork_ghost(self) -> None:
        """Keep a copy of the gate as it is now (the bot's audio already sent included) before
        a ``clear`` takes that audio off the real one, and read every next window on both
        (``WindowResult.ghost``) until :meth:`end_ghost`. Feed the copy the audio a line deaf
        to the clear plays with :meth:`add_ghost_reference`: the barge-in policy asks of it
        whether the line still carries the bot that way (``BargeInSettings.pause_echo_corr``,
        ``deaf_echo_corr``). A second fork replaces the first. Ignored on a closed or
        gate-less stream."""
        if self._bank is None or self._lifecycle is not _StreamState.OPEN:
            return
        self.end_ghost()
        self._ghost_row = self._bank.fork_row(self._gate_row)

    def add_ghost_reference(self, start_sample: int, samples: npt.NDArray[np.floating]) -> None:
        """Audio a line deaf to the clear plays from inbound sample ``start_sample`` on: for the
        ghost copy only. Ignored without one."""
        if self._bank is not None and self._ghost_row >= 0:
            self._bank.add_reference(self._ghost_row, start_sample, samples)

    @property
    def haunted(self) -> bool:
        """Whether a ghost copy of the gate is being read (:meth:`fork_ghost`)."""
        return self._ghost_row >= 0

    def end_ghost(self) -> None:
        """Stop reading the ghost copy and free its row. Idempotent."""
        if self._bank is not None and self._ghost_row >= 0:
            self._bank.close_row(self._ghost_row)
        self._ghost_row = -1

    def reset(self) -> None:
        """Zero the recurrent state and context, as for a new call.

        Samples already pushed but not yet run stay queued and are scored from the fresh state;
        window numbering and ``end_sample`` keep counting from the start of the stream.

        Raises:
            StreamClosed: The stream is closed.
        """
        self._check_open()
        self._engine._zero_slot(self._slot)

    def close(self) -> None:
        """Release the stream's slot; pending :meth:`process` calls raise :class:`StreamClosed`.

        Idempotent. Other streams' state is not touched.
        """
        self._close(StreamClosed("the stream was closed"))

    async def __aenter__(self) -> VadStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<VadStream {self._lifecycle.value} slot={self._slot} windows={self._done}/"
            f"{self.windows_available}>"
        )

    # -- engine side ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._lifecycle is _StreamState.CLOSED:
            assert self._closed_error is not None
            raise StreamClosed(str(self._closed_error)) from self._closed_error.__cause__

    def _append(self, samples: npt.NDArray[np.floating]) -> bool:
        """Buffer samples; True when they complete at least one window."""
        self._check_open()
        if not isinstance(samples, np.ndarray) or samples.ndim != 1:
            raise InvalidAudio(
                f"samples must be a 1-D numpy float array, got {type(samples).__name__}"
                + (f" of shape {samples.shape}" if isinstance(samples, np.ndarray) else "")
            )
        if samples.dtype.kind != "f":
            raise InvalidAudio(f"samples must be float (8 kHz, [-1, 1]), got {samples.dtype}")
        n = samples.shape[0]
        if n == 0:
            return False
        if self._wr + n > self._buf.shape[0]:
            pending = self._wr - self._rd
            if pending + n > self._buf.shape[0]:
                grown = np.empty(max(2 * self._buf.shape[0], pending + n), dtype=np.float32)
                grown[:pending] = self._buf[self._rd : self._wr]
                self._buf = grown
            else:
                self._buf[:pending] = self._buf[self._rd : self._wr]
            self._rd, self._wr = 0, pending
        self._buf[self._wr : self._wr + n] = samples
        self._wr += n
        before = self._total // WINDOW_SAMPLES
        self._total += n
        return self._total // WINDOW_SAMPLES > before

    def _has_window(self) -> bool:
        return self._wr - self._rd >= WINDOW_SAMPLES and self._lifecycle is _StreamState.OPEN

    def _take_window(self) -> npt.NDArray[np.float32]:
        """View of the next window's samples (valid until the next push)."""
        rd = self._rd
        self._rd = rd + WINDOW_SAMPLES
        return self._buf[rd : rd + WINDOW_SAMPLES]

    def _pending_since(self) -> float:
        return self._push_times[0][1]

    def _deliver(self, prob: float, gate: GateReading | None = None,
                 features: WindowFeatures | None = None, ghost: GateReading | None = None
                 ) -> None:
        """The next window was run; record it and wake the ``process`` calls it completes."""
        self._results.append((prob, gate, features, ghost))
        done = self._done = self._done + 1
        times = self._push_times
        while times and times[0][0] <= done:
            times.popleft()
        waiters = self._waiters
        while waiters and waiters[0][1] <= done:
            start, target, future = waiters.popleft()
            results = self._collect(start, target)
            if not future.done():  # a cancelled process(): the results are dropped
                future.set_result(results)

    def _collect(self, start: int, target: int) -> list[WindowResult]:
        base = self._res_base
        got = self._results[start - base : target - base]
        del self._results[: target - base]
        self._res_base = target
        return [WindowResult(k, (k + 1) * WINDOW_SAMPLES, p, g, f, h)
                for k, (p, g, f, h) in enumerate(got, start)]

    def _close(self, error: StreamClosed, cause: BaseException | None = None) -> None:
        if self._lifecycle is _StreamState.CLOSED:
            return
        if cause is not None:
            error.__cause__ = cause
        self._lifecycle = _StreamState.CLOSED
        self._closed_error = error
        self._push_times.clear()
        waiters, self._waiters = self._waiters, deque()
        for _start, _target, future in waiters:
            if not future.done():
                waiter_error = StreamClosed(str(error))
                waiter_error.__cause__ = cause
                future.set_exception(waiter_error)
        self._engine._release(self)
