"""The batched engine: many concurrent streams get exactly what each would get alone."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import FrozenInstanceError
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from vad._engine import (
    EngineClosed,
    EngineNotStarted,
    StreamClosed,
    VadEngine,
    VadStream,
    WindowResult,
)
from vad._silero import (
    WINDOW_SAMPLES,
    InferenceError,
    InvalidAudio,
    SileroRuntime,
    load_runtime,
    probabilities,
)

from . import caller_recordings, recording

FRAME = 160  # one 20 ms Twilio media frame at 8 kHz
# Guards against a hang only (a bug would otherwise stall the suite); never a timing assertion.
GUARD_S = 60.0

Audio = npt.NDArray[np.float32]


@pytest.fixture(scope="module")
def onnx() -> SileroRuntime:
    return load_runtime("onnx")


@pytest.fixture(scope="module")
def torchscript() -> SileroRuntime:
    return load_runtime("torchscript")


@pytest.fixture(scope="module", params=["onnx", "torchscript"])
def runtime(request: pytest.FixtureRequest) -> Iterator[SileroRuntime]:
    yield request.getfixturevalue(request.param)


@pytest.fixture
async def engine(onnx: SileroRuntime) -> AsyncIterator[VadEngine]:
    async with VadEngine(runtime=onnx) as eng:
        yield eng


def _tolerance(runtime: SileroRuntime) -> float:
    # onnxruntime scores rows bit-identically whatever the batch; TorchScript within rounding.
    return 0.0 if runtime.name == "onnx" else 1e-5


def _signals(count: int, seconds: float) -> list[Audio]:
    """``count`` different excerpts: every recording at several offsets."""
    names = caller_recordings()
    length = int(seconds * 8000)
    out = []
    for i in range(count):
        audio = recording(names[i % len(names)])
        offset = (i // len(names)) * 8000 + 37 * i  # whole seconds apart, plus a sample skew
        out.append(np.array(audio[offset : offset + length]))
    return out


def _frames(audio: Audio, size: int = FRAME) -> list[Audio]:
    return [audio[i : i + size] for i in range(0, len(audio), size)]


async def _feed(stream: VadStream, frames: list[Audio]) -> list[WindowResult]:
    results: list[WindowResult] = []
    for frame in frames:
        results.extend(await stream.process(frame))
    return results


def _assert_matches_alone(
    results: list[WindowResult], alone: npt.NDArray[np.float32], tol: float, first: int = 0
) -> None:
    assert [r.index for r in results] == list(range(first, first + len(alone)))
    indices = range(first, first + len(alone))
    assert [r.end_sample for r in results] == [(k + 1) * WINDOW_SAMPLES for k in indices]
    np.testing.assert_allclose([r.prob for r in results], alone, rtol=0, atol=tol)


async def test_single_stream_in_twilio_frames_equals_probabilities(onnx: SileroRuntime) -> None:
    audio = recording("barge_in_timit")
    async with VadEngine(runtime=onnx) as engine, engine.open_stream() as stream:
        results = await _feed(stream, _frames(audio))
    _assert_matches_alone(results, probabilities(onnx, audio), 0.0)


@pytest.mark.parametrize("size", [1, 100, 255, 256, 257, 999, 4096])
async def test_any_chunk_size_gives_the_same_windows(
    engine: VadEngine, onnx: SileroRuntime, size: int
) -> None:
    audio = recording("barge_in_command_goforward")[: 40 * WINDOW_SAMPLES + 77]
    async with engine.open_stream() as stream:
        results = await _feed(stream, _frames(audio, size))
    _assert_matches_alone(results, probabilities(onnx, audio), 0.0)


async def test_process_now_equals_process(runtime: SileroRuntime) -> None:
    audio = recording("echo_plus_barge_in")[: 8000 * 4]
    async with VadEngine(runtime=runtime) as engine:
        async with engine.open_stream() as a, engine.open_stream() as b:
            # a and b run in shared batches; c below runs alone, synchronously.
            got_a, got_b = await asyncio.gather(_feed(a, _frames(audio)), _feed(b, _frames(audio)))
        async with engine.open_stream() as c:
            got_c = [r for frame in _frames(audio, 333) for r in c.process_now(frame)]
    assert got_c == [WindowResult(k, (k + 1) * WINDOW_SAMPLES, r.prob) for k, r in enumerate(got_c)]
    assert len(got_a) == len(got_b) == len(got_c) == len(audio) // WINDOW_SAMPLES
    tol = _tolerance(runtime)
    for got in (got_a, got_b):
        np.testing.assert_allclose([r.prob for r in got], [r.prob for r in got_c], rtol=0, atol=tol)


@pytest.mark.parametrize(
    ("max_batch", "max_wait_ms", "idle_streams"),
    [
        (128, 2.0, 0),  # every open stream ready -> one batch of 50 per window
        (16, 2.0, 0),  # full batches of 16, the rest in order
        (128, 1.0, 3),  # idle open streams: only the max_wait timer releases batches
    ],
)
async def test_fifty_concurrent_streams_equal_each_alone(
    runtime: SileroRuntime, max_batch: int, max_wait_ms: float, idle_streams: int
) -> None:
    signals = _signals(50, seconds=3.0)
    alone = [probabilities(runtime, s) for s in signals]
    async with VadEngine(runtime=runtime, max_batch=max_batch, max_wait_ms=max_wait_ms) as engine:
        idle = [engine.open_stream() for _ in range(idle_streams)]
        streams = [engine.open_stream() for _ in signals]
        # Uneven frames on a few streams so windows do not complete in lockstep.
        sizes = [FRAME if i % 5 else (80, 240, 1000, 160, 37)[i // 5 % 5] for i in range(50)]
        calls = [
            _feed(stream, _frames(signal, size))
            for stream, signal, size in zip(streams, signals, sizes, strict=True)
        ]
        results = await asyncio.wait_for(asyncio.gather(*calls), GUARD_S)
        stats = engine.stats
        for stream in (*streams, *idle):
            stream.close()
    tol = _tolerance(runtime)
    for got, want in zip(results, alone, strict=True):
        _assert_matches_alone(got, want, tol)
    assert stats.windows == sum(len(a) for a in alone)  # every window run exactly once
    assert stats.open_streams == 50 + idle_streams
    if idle_streams == 0 and max_batch == 128:
        assert stats.windows / stats.batches > 25  # real batching, not one call at a time
    if max_batch == 16:
        assert stats.batches >= stats.windows / 16


async def test_streams_opening_and_closing_midway_do_not_disturb_others(
    runtime: SileroRuntime,
) -> None:
    long_signals = _signals(20, seconds=4.0)
    short_signals = _signals(60, seconds=1.5)[20:]
    alone = [probabilities(runtime, s) for s in long_signals]

    async with VadEngine(runtime=runtime, max_wait_ms=1.0) as engine:
        closed_midway: list[int] = []

        async def long_call(signal: Audio) -> list[WindowResult]:
            async with engine.open_stream() as stream:
                return await _feed(stream, _frames(signal))

        async def short_call(i: int, signal: Audio, start_after: asyncio.Event) -> None:
            await start_after.wait()
            stream = engine.open_stream()
            frames = _frames(signal)
            await _feed(stream, frames[: len(frames) // 2])
            if i % 3 == 0:
                stream.push(frames[len(frames) // 2])  # leave samples (maybe a window) pending
            stream.close()  # hang up mid-way
            closed_midway.append(i)

        # Short calls come in waves, keyed to how far the long calls have got.
        waves = [asyncio.Event() for _ in range(4)]

        async def conductor(stream_probe: VadStream, signal: Audio) -> list[WindowResult]:
            results: list[WindowResult] = []
            frames = _frames(signal)
            for n, frame in enumerate(frames):
                results.extend(await stream_probe.process(frame))
                if n % 40 == 10 and n // 40 < len(waves):
                    waves[n // 40].set()
            stream_probe.close()
            return results

        probe = engine.open_stream()
        tasks = [long_call(s) for s in long_signals[1:]]
        shorts = [short_call(i, s, waves[i % len(waves)]) for i, s in enumerate(short_signals)]
        outcome = await asyncio.wait_for(
            asyncio.gather(conductor(probe, long_signals[0]), *tasks, *shorts), GUARD_S
        )
        assert engine.stats.open_streams == 0
    assert sorted(closed_midway) == list(range(len(short_signals)))
    tol = _tolerance(runtime)
    for got, want in zip(outcome[: len(long_signals)], alone, strict=True):
        _assert_matches_alone(got, want, tol)


async def test_backlog_pushed_at_once_runs_in_order(engine: VadEngine, onnx: SileroRuntime) -> None:
    audio = recording("long_turn_librivox")[: 8000 * 5]
    busy = engine.open_stream()
    idle = engine.open_stream()  # keeps "every stream ready" false: only age releases batches
    results = await asyncio.wait_for(busy.process(audio), GUARD_S)
    _assert_matches_alone(results, probabilities(onnx, audio), 0.0)
    assert engine.stats.batches == len(results)  # one row per batch: busy is alone
    busy.close()
    idle.close()


async def test_windows_pushed_without_process_come_with_the_next_call(
    engine: VadEngine, onnx: SileroRuntime
) -> None:
    audio = recording("barge_in_timit")[: 20 * WINDOW_SAMPLES]
    async with engine.open_stream() as stream:
        for frame in _frames(audio[: 10 * WINDOW_SAMPLES]):
            stream.push(frame)
        assert stream.windows_available == 10
        first = await stream.process(np.empty(0, dtype=np.float32))
        rest = stream.process_now(audio[10 * WINDOW_SAMPLES :])
    _assert_matches_alone(first + rest, probabilities(onnx, audio), 0.0)


async def test_reset_starts_from_zero_state(engine: VadEngine, onnx: SileroRuntime) -> None:
    audio = recording("barge_in_mid_jfk")
    head, tail = audio[: 100 * WINDOW_SAMPLES], audio[100 * WINDOW_SAMPLES : 160 * WINDOW_SAMPLES]
    async with engine.open_stream() as stream:
        await _feed(stream, _frames(head))
        stream.reset()
        results = await _feed(stream, _frames(tail))
    # Same as a fresh stream on the tail, numbered from where the stream was.
    _assert_matches_alone(results, probabilities(onnx, tail), 0.0, first=100)


async def test_closing_the_last_idle_stream_releases_the_batch(onnx: SileroRuntime) -> None:
    # A wait long enough that only the "every open stream is ready" rule can release the batch.
    async with VadEngine(runtime=onnx, max_wait_ms=3_600_000) as engine:
        a, idle = engine.open_stream(), engine.open_stream()
        a.push(recording("barge_in_timit")[:WINDOW_SAMPLES])
        assert a.windows_available == 1 and engine.stats.windows == 0  # waiting for idle
        idle.close()
        assert engine.stats.windows == 1
        (result,) = await a.process(np.empty(0, dtype=np.float32))
        assert result.index == 0
        a.close()


async def test_few_open_streams_wait_less_for_a_batch(onnx: SileroRuntime) -> None:
    # 2 of full_wait_streams=64 open: a ready window waits 64 s * 2/64 = 2 s for the idle
    # stream, not the whole 64 s (the timer's deadline, on the loop's clock: no sleep).
    async with VadEngine(runtime=onnx, max_wait_ms=64_000, full_wait_streams=64) as engine:
        loop = asyncio.get_running_loop()
        a, idle = engine.open_stream(), engine.open_stream()
        before = loop.time()
        a.push(recording("barge_in_timit")[:WINDOW_SAMPLES])
        after = loop.time()
        assert engine.stats.windows == 0 and engine._timer is not None
        assert before + 2.0 <= engine._timer_at <= after + 2.0
        # A third stream opening does not move the armed deadline later (no later than due).
        b = engine.open_stream()
        b.push(recording("barge_in_timit")[:WINDOW_SAMPLES])
        assert engine._timer_at <= after + 2.0
        idle.close()  # every open stream is ready now: the batch runs at once
        assert engine.stats.windows == 2 and engine._timer is None
        (result,) = await a.process(np.empty(0, dtype=np.float32))
        assert result.index == 0
        # 4 open, one ready: 4/64 of the wait. The ready one closing leaves nothing waiting and
        # no timer armed for 4 streams; the next window waits for the 3 left (3/64).
        c, d = engine.open_stream(), engine.open_stream()
        before = loop.time()
        a.push(recording("barge_in_timit")[WINDOW_SAMPLES:2 * WINDOW_SAMPLES])
        assert before + 4.0 <= engine._timer_at <= loop.time() + 4.0
        a.close()
        assert engine._timer is None
        before = loop.time()
        b.push(recording("barge_in_timit")[WINDOW_SAMPLES:2 * WINDOW_SAMPLES])
        assert before + 3.0 <= engine._timer_at <= loop.time() + 3.0
        for s in (b, c, d):
            s.close()
    with pytest.raises(ValueError, match="full_wait_streams"):
        VadEngine(full_wait_streams=0)


async def _close_after_park(
    process: Coroutine[Any, Any, list[WindowResult]], close: Callable[[], object]
) -> BaseException | list[WindowResult]:
    """Run ``process`` until it parks on its result, then ``close``; return what it ended with.

    gather() starts its tasks in the order given, so ``process`` pushes its samples and parks
    on its future before ``closer`` runs: no sleep involved.
    """

    async def closer() -> None:
        result = close()
        if inspect.isawaitable(result):
            await result

    both = asyncio.gather(process, closer(), return_exceptions=True)
    outcome, _ = await asyncio.wait_for(both, GUARD_S)
    assert isinstance(outcome, (BaseException, list))
    return outcome


async def test_close_fails_pending_process(onnx: SileroRuntime) -> None:
    window = np.zeros(WINDOW_SAMPLES, dtype=np.float32)
    async with VadEngine(runtime=onnx, max_wait_ms=3_600_000) as engine:
        a, idle, other = engine.open_stream(), engine.open_stream(), engine.open_stream()
        outcome = await _close_after_park(a.process(window), a.close)
        assert isinstance(outcome, StreamClosed)
        a.close()  # idempotent
        with pytest.raises(StreamClosed):
            a.push(np.zeros(10, dtype=np.float32))
        with pytest.raises(StreamClosed):
            a.reset()
        assert a.closed and not idle.closed
        # aclose() fails what is still waiting.
        outcome = await _close_after_park(idle.process(window), engine.aclose)
        assert isinstance(outcome, StreamClosed) and "VadEngine was closed" in str(outcome)
        assert idle.closed and other.closed


async def test_engine_lifecycle_errors(onnx: SileroRuntime) -> None:
    engine = VadEngine(runtime=onnx)
    with pytest.raises(EngineNotStarted):
        engine.open_stream()
    await engine.start()
    await engine.start()  # idempotent
    stream = engine.open_stream()
    await engine.aclose()
    await engine.aclose()  # idempotent
    assert stream.closed
    with pytest.raises(EngineClosed):
        engine.open_stream()
    with pytest.raises(EngineClosed):
        await engine.start()
    with pytest.raises(ValueError):
        VadEngine(max_batch=0)
    with pytest.raises(ValueError):
        VadEngine(max_wait_ms=-1)


@pytest.mark.parametrize(("runtime_name", "expected"), [(None, "torchscript"), ("onnx", "onnx")])
async def test_engine_loads_runtime_by_name(runtime_name: str | None, expected: str) -> None:
    engine = VadEngine() if runtime_name is None else VadEngine(runtime="onnx")
    with pytest.raises(EngineNotStarted):
        engine.runtime  # noqa: B018 - the property raises before start()
    async with engine:
        assert engine.runtime.name == expected
        async with engine.open_stream() as stream:
            assert stream.process_now(np.zeros(3 * WINDOW_SAMPLES, dtype=np.float32))[2].index == 2


async def test_bad_samples_are_refused_and_lose_nothing(
    engine: VadEngine, onnx: SileroRuntime
) -> None:
    audio = recording("barge_in_timit")[: 4 * WINDOW_SAMPLES]
    async with engine.open_stream() as stream:
        wrong_dtype = np.zeros(160, dtype=np.int16)
        wrong_shape = np.zeros((2, 80), dtype=np.float32)
        for bad in (wrong_dtype, wrong_shape, [0.0] * 160):
            with pytest.raises(InvalidAudio):
                stream.push(bad)  # type: ignore[arg-type]
        results = await stream.process(audio.astype(np.float64))
    _assert_matches_alone(results, probabilities(onnx, audio), 1e-7)


class _FailOnNaN:
    """A runtime seam: the real ONNX model, except that a row containing NaN makes it raise."""

    name = "fail-on-nan"

    def __init__(self, inner: SileroRuntime) -> None:
        self.inner = inner

    def infer(self, x: Audio, state: Audio) -> tuple[Audio, Audio]:
        if np.isnan(x).any():
            raise RuntimeError("NaN in input")
        return self.inner.infer(x, state)


async def test_failed_inference_closes_only_the_streams_of_that_batch(onnx: SileroRuntime) -> None:
    audio = recording("barge_in_timit")[: 8 * WINDOW_SAMPLES]
    async with VadEngine(runtime=_FailOnNaN(onnx)) as engine:
        bad, good = engine.open_stream(), engine.open_stream()
        with pytest.raises(StreamClosed) as info:
            bad.process_now(np.full(WINDOW_SAMPLES, np.nan, dtype=np.float32))
        assert isinstance(info.value.__cause__, InferenceError)
        assert isinstance(info.value.__cause__.__cause__, RuntimeError)
        assert bad.closed and not good.closed
        results = await asyncio.wait_for(good.process(audio), GUARD_S)
        _assert_matches_alone(results, probabilities(onnx, audio), 0.0)

        # The same through a batch: both rows of the failed batch are closed, with the cause.
        a, b = engine.open_stream(), engine.open_stream()
        good.close()
        fut_a = asyncio.ensure_future(a.process(np.full(WINDOW_SAMPLES, np.nan, dtype=np.float32)))
        fut_b = asyncio.ensure_future(b.process(audio[:WINDOW_SAMPLES]))
        for fut in (fut_a, fut_b):
            with pytest.raises(StreamClosed) as info:
                await asyncio.wait_for(fut, GUARD_S)
            assert isinstance(info.value.__cause__, InferenceError)
        assert engine.stats.open_streams == 0


async def test_window_result_is_frozen() -> None:
    result = WindowResult(index=3, end_sample=1024, prob=0.5)
    with pytest.raises(FrozenInstanceError):
        result.prob = 1.0  # type: ignore[misc]
