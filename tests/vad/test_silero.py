"""Silero runtimes: both compute upstream's streaming function, agree, and batch row by row."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt
import pytest

from vad._silero import (
    INPUT_SAMPLES,
    WINDOW_SAMPLES,
    InferenceError,
    InvalidAudio,
    OnnxSilero,
    RuntimeUnavailable,
    SileroRuntime,
    TorchScriptSilero,
    initial_state,
    load_runtime,
    model_path,
    probabilities,
)

from . import labels, recording

RUNTIMES = ["onnx", "torchscript"]


@pytest.fixture(scope="module")
def onnx() -> SileroRuntime:
    return load_runtime("onnx")


@pytest.fixture(scope="module")
def torchscript() -> SileroRuntime:
    return load_runtime("torchscript")


@pytest.fixture(scope="module", params=RUNTIMES)
def runtime(request: pytest.FixtureRequest) -> Iterator[SileroRuntime]:
    yield request.getfixturevalue(request.param)


def _windows(audio: npt.NDArray[np.float32], n: int) -> list[npt.NDArray[np.float32]]:
    return [audio[k * WINDOW_SAMPLES : (k + 1) * WINDOW_SAMPLES].copy() for k in range(n)]


def test_load_runtime_by_name(onnx: SileroRuntime, torchscript: SileroRuntime) -> None:
    assert isinstance(onnx, OnnxSilero) and onnx.name == "onnx"
    assert isinstance(torchscript, TorchScriptSilero) and torchscript.name == "torchscript"
    assert isinstance(onnx, SileroRuntime) and isinstance(torchscript, SileroRuntime)
    with pytest.raises(RuntimeUnavailable, match="unknown Silero runtime"):
        load_runtime("tflite")  # type: ignore[arg-type]


def test_model_files_come_from_the_package() -> None:
    for name in ("silero_vad.onnx", "silero_vad.jit"):
        path = model_path(name)
        assert path.is_file() and path.parent.name == "data"
    with pytest.raises(RuntimeUnavailable):
        model_path("no_such_model.onnx")


def test_onnx_runtime_does_not_import_torch() -> None:
    # An ONNX-only gateway should not pay torch's import (1.2 s, ~220 MB RSS).
    code = (
        "import sys\n"
        "from vad._silero import load_runtime\n"
        "load_runtime('onnx')\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_onnx_matches_upstream_wrapper(onnx: SileroRuntime) -> None:
    """Our explicit state/context handling reproduces silero_vad's own OnnxWrapper streaming."""
    import torch
    from silero_vad.utils_vad import OnnxWrapper

    audio = recording("barge_in_timit")
    n = 120  # 3.8 s: hiss, then the start of the speech at 2.85 s
    wrapper = OnnxWrapper(str(model_path("silero_vad.onnx")), force_onnx_cpu=True)
    upstream = [float(wrapper(torch.from_numpy(w), 8000).item()) for w in _windows(audio, n)]
    ours = probabilities(onnx, audio[: n * WINDOW_SAMPLES])
    np.testing.assert_allclose(ours, upstream, atol=1e-6)


def test_torchscript_matches_upstream_wrapper(torchscript: SileroRuntime) -> None:
    """Driving ``_model_8k`` with external state equals the JIT wrapper's hidden-state streaming."""
    import torch

    audio = recording("barge_in_timit")
    n = 120
    model = torch.jit.load(str(model_path("silero_vad.jit")))
    model.eval()
    with torch.inference_mode():
        upstream = [float(model(torch.from_numpy(w), 8000).item()) for w in _windows(audio, n)]
    np.testing.assert_allclose(
        probabilities(torchscript, audio[: n * WINDOW_SAMPLES]), upstream, atol=1e-6
    )


@pytest.mark.parametrize("name", ["barge_in_timit", "echo_plus_barge_in", "noise_keyboard"])
def test_runtimes_agree_window_by_window(
    onnx: SileroRuntime, torchscript: SileroRuntime, name: str
) -> None:
    audio = recording(name)
    p_onnx = probabilities(onnx, audio)
    p_ts = probabilities(torchscript, audio)
    assert p_onnx.shape == p_ts.shape == (len(audio) // WINDOW_SAMPLES,)
    np.testing.assert_allclose(p_onnx, p_ts, atol=1e-3)
    # The same decision at any threshold used in practice, window by window.
    for threshold in (0.3, 0.5, 0.7):
        close = np.abs(p_onnx - threshold) < 1e-3
        assert np.array_equal((p_onnx > threshold)[~close], (p_ts > threshold)[~close])


def test_batched_rows_equal_each_row_alone(runtime: SileroRuntime) -> None:
    """Each row's probability and state after every window equal running that row by itself.

    onnxruntime convolves image by image and runs the LSTM row by row: bit-identical. TorchScript
    (oneDNN) blocks its GEMMs differently by batch size: equal within float32 rounding.
    """
    tol = 0.0 if runtime.name == "onnx" else 1e-5
    sources = [
        ("barge_in_timit", 20_000),
        ("barge_in_mid_jfk", 30_000),
        ("echo_plus_barge_in", 25_000),
        ("silence_quiet_caller", 0),
        ("hard_snr5_dishes_jfk", 33_000),
        ("barge_in_timit", 20_128),  # the same audio shifted by half a window
    ]
    n = 60
    signals = [recording(name)[off : off + n * WINDOW_SAMPLES] for name, off in sources]
    rows = len(signals)

    alone_probs = np.empty((rows, n), dtype=np.float32)
    alone_states = np.empty((rows, n, 2, 128), dtype=np.float32)
    for r, signal in enumerate(signals):
        state = initial_state(1)
        x = np.zeros((1, INPUT_SAMPLES), dtype=np.float32)
        for k, window in enumerate(_windows(signal, n)):
            x[0, 32:] = window
            p, state = runtime.infer(x, state)
            alone_probs[r, k], alone_states[r, k] = p[0], state[:, 0]
            x[0, :32] = window[-32:]

    state = initial_state(rows)
    x = np.zeros((rows, INPUT_SAMPLES), dtype=np.float32)
    for k in range(n):
        for r, signal in enumerate(signals):
            x[r, 32:] = signal[k * WINDOW_SAMPLES : (k + 1) * WINDOW_SAMPLES]
        p, state = runtime.infer(x, state)
        np.testing.assert_allclose(p, alone_probs[:, k], rtol=tol, atol=tol)
        # The LSTM cell state grows past 1 in speech, so allow float32 rounding relative to it.
        np.testing.assert_allclose(state.transpose(1, 0, 2), alone_states[:, k], rtol=tol, atol=tol)
        x[:, :32] = x[:, -32:]


def test_speech_scores_high_and_line_hiss_low(onnx: SileroRuntime) -> None:
    name = "barge_in_timit"
    probs = probabilities(onnx, recording(name))
    (speech,) = [e for e in labels(name)["events"] if e["kind"] == "speech"]
    first = speech["start_ms"] * 8 // WINDOW_SAMPLES + 1
    last = speech["end_ms"] * 8 // WINDOW_SAMPLES
    assert np.median(probs[first:last]) > 0.9
    assert np.mean(probs[first:last] > 0.5) > 0.8
    assert probs[: 2000 * 8 // WINDOW_SAMPLES].max() < 0.2  # room tone and hiss before it

    hiss = probabilities(onnx, recording("silence_quiet_caller"))  # line hiss only
    assert hiss.max() < 0.2


def test_probabilities_scores_complete_windows_only(onnx: SileroRuntime) -> None:
    audio = recording("barge_in_timit")[: 10 * WINDOW_SAMPLES + 100]
    probs = probabilities(onnx, audio)
    assert probs.shape == (10,) and probs.dtype == np.float32
    np.testing.assert_array_equal(probs, probabilities(onnx, audio[: 10 * WINDOW_SAMPLES]))
    assert probabilities(onnx, audio[:255]).shape == (0,)


def test_bad_input_is_refused(runtime: SileroRuntime) -> None:
    with pytest.raises(InvalidAudio):
        runtime.infer(np.zeros((2, 256), dtype=np.float32), initial_state(2))
    with pytest.raises(InvalidAudio):
        wrong_dtype = np.zeros((2, INPUT_SAMPLES), dtype=np.float64)
        runtime.infer(wrong_dtype, initial_state(2))  # type: ignore[arg-type]
    with pytest.raises(InvalidAudio):
        runtime.infer(np.zeros((2, INPUT_SAMPLES), dtype=np.float32), initial_state(3))
    with pytest.raises(InvalidAudio):
        probabilities(runtime, np.zeros(1024, dtype=np.int16))
    with pytest.raises(InvalidAudio):
        probabilities(runtime, np.zeros((2, 1024), dtype=np.float32))
    assert issubclass(InvalidAudio, ValueError)


def test_read_only_input_is_accepted(runtime: SileroRuntime) -> None:
    x = np.zeros((1, INPUT_SAMPLES), dtype=np.float32)
    state = initial_state(1)
    x.setflags(write=False)
    state.setflags(write=False)
    probs, new_state = runtime.infer(x, state)
    assert probs.shape == (1,) and new_state.shape == (2, 1, 128)


def test_torchscript_keeps_one_thread_in_any_calling_thread(torchscript: SileroRuntime) -> None:
    # torch's thread count is per OS thread; an engine may load in one thread and infer in another.
    import threading

    import torch

    seen: list[int] = []

    def work() -> None:
        torchscript.infer(np.zeros((4, INPUT_SAMPLES), dtype=np.float32), initial_state(4))
        seen.append(torch.get_num_threads())

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    assert seen == [1]


def test_errors_are_a_tree() -> None:
    from vad._silero import VadError

    for error in (RuntimeUnavailable, InvalidAudio, InferenceError):
        assert issubclass(error, VadError)


def test_adaptive_runtime_picks_by_batch_size_with_the_same_scores() -> None:
    import numpy as np

    from vad import AdaptiveSilero, load_runtime

    auto = load_runtime("auto")
    assert isinstance(auto, AdaptiveSilero)
    onnx, torch_rt = load_runtime("onnx"), load_runtime("torchscript")
    rng = np.random.default_rng(7)
    for batch in (1, auto.threshold - 1, auto.threshold, 64):
        x = (rng.standard_normal((batch, 288)) * 0.1).astype(np.float32)
        state = np.zeros((2, batch, 128), dtype=np.float32)
        p_auto, s_auto = auto.infer(x, state)
        ref = onnx if batch < auto.threshold else torch_rt
        p_ref, s_ref = ref.infer(x, state)
        np.testing.assert_array_equal(p_auto, p_ref)
        np.testing.assert_array_equal(s_auto, s_ref)
        p_other, _ = (torch_rt if ref is onnx else onnx).infer(x, state)
        assert np.max(np.abs(p_auto - p_other)) < 1e-4
