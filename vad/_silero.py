"""Silero VAD at 8 kHz, natively, as a pure function of (audio, state) with a batch axis.

Silero v5/v6 at 8 kHz looks at 256-sample windows (32 ms). Each inference takes the window
prefixed with the last 32 samples of the previous window (the *context*): 288 samples per row.
The LSTM state is ``(2, B, 128)`` (h and c). Both packaged models compute the same function:

* ``silero_vad.onnx`` takes ``input`` (B, 288), ``state`` (2, B, 128) and ``sr`` (int64) and
  returns ``output`` (B, 1) and ``stateN`` (2, B, 128). ORT runs convolutions image by image, so
  a batch costs about the same per row from B=16 up (~32 us/row here).
* ``silero_vad.jit`` is a scripted wrapper whose ``forward(x, sr)`` keeps ``_state``/``_context``
  inside the module and silently resets them when the batch size changes, which makes it useless
  for a batch whose rows come and go. Its 8 kHz submodule ``_model_8k.forward(x, state)`` is the
  pure part: it takes the 288-sample rows (context already prepended) and the external state and
  returns ``(prob (B, 1), new_state (2, B, 128))``; the wrapper does nothing else at 8 kHz than
  prepend the context, call it and keep the last 32 samples (read from ``model.code``).
  :class:`TorchScriptSilero` calls that submodule directly, so the state lives in numpy with the
  caller, one row per stream, exactly as for ONNX. Tests check it against the wrapper's own
  streaming output.

Both runtimes implement :class:`SileroRuntime`; the engine never knows which one it drives.

Errors::

    VadError
     +-- RuntimeUnavailable     the model or its runtime library cannot be loaded
     +-- InvalidAudio           wrong dtype/shape for samples, rows or state (also a ValueError)
     +-- InferenceError         the runtime raised while running a batch (chained)
     +-- (engine errors, see vad/_engine.py)
"""

from __future__ import annotations

import importlib.resources
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from audio import TELEPHONY_RATE

if TYPE_CHECKING:
    import torch

__all__ = [
    "AdaptiveSilero",
    "CONTEXT_SAMPLES",
    "INPUT_SAMPLES",
    "SAMPLE_RATE",
    "STATE_SIZE",
    "WINDOW_SAMPLES",
    "InferenceError",
    "InvalidAudio",
    "OnnxSilero",
    "RuntimeName",
    "RuntimeUnavailable",
    "SileroRuntime",
    "TorchScriptSilero",
    "VadError",
    "import_runtime",
    "initial_state",
    "load_runtime",
    "model_path",
    "probabilities",
]

SAMPLE_RATE: Final = TELEPHONY_RATE
"""The only rate this module runs at: telephone audio, no resampling."""
WINDOW_SAMPLES: Final = 256
"""New samples per inference (32 ms at 8 kHz)."""
CONTEXT_SAMPLES: Final = 32
"""Samples of the previous window prepended to each inference row."""
INPUT_SAMPLES: Final = CONTEXT_SAMPLES + WINDOW_SAMPLES
"""Row length of one inference input (288)."""
STATE_SIZE: Final = 128
"""LSTM width; the recurrent state is ``(2, B, STATE_SIZE)``."""

RuntimeName = Literal["onnx", "torchscript", "auto"]

Float32Array = npt.NDArray[np.float32]


class VadError(Exception):
    """Base class of every error raised by ``vad``."""


class RuntimeUnavailable(VadError):
    """The Silero model file or the library that runs it cannot be loaded."""


class InvalidAudio(VadError, ValueError):
    """Samples, inference rows or state have the wrong dtype or shape."""


class InferenceError(VadError):
    """The runtime raised while running a batch; the original error is chained as ``__cause__``."""


@runtime_checkable
class SileroRuntime(Protocol):
    """One Silero model that scores a batch of 8 kHz rows, each with its own recurrent state.

    Implementations are pure in (x, state): they keep no per-stream data between calls, so a
    caller may put any rows in any order into a batch.
    """

    name: str
    """Short name for tables and logs (``"onnx"``, ``"torchscript"``)."""

    def infer(self, x: Float32Array, state: Float32Array) -> tuple[Float32Array, Float32Array]:
        """Score one batch.

        Args:
            x: ``(B, 288)`` float32: 32 context samples then 256 new samples per row.
            state: ``(2, B, 128)`` float32 recurrent state, row ``b`` belongs to ``x[b]``.

        Returns:
            ``(probs, new_state)``: speech probabilities ``(B,)`` and the state after each row.
        """
        ...


def initial_state(batch: int = 1) -> Float32Array:
    """Zero recurrent state for ``batch`` rows: what a fresh or reset stream starts from."""
    return np.zeros((2, batch, STATE_SIZE), dtype=np.float32)


def model_path(filename: str) -> Path:
    """Path of a model file shipped in the ``silero_vad.data`` package (never downloads).

    The package's ``__init__`` imports torch (1.2 s and ~220 MB RSS here), which an ONNX-only
    gateway does not need, so the data folder is found from the import spec without running the
    package; ``importlib.resources`` (which imports it) is the fallback for unusual installs.
    """
    spec = importlib.util.find_spec("silero_vad")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "data" / filename
            if candidate.is_file():
                return candidate
    try:
        resource = importlib.resources.files("silero_vad.data").joinpath(filename)
    except ModuleNotFoundError as exc:
        raise RuntimeUnavailable("the silero-vad package is not installed") from exc
    if not resource.is_file():
        raise RuntimeUnavailable(f"silero-vad ships no {filename!r}")
    return Path(str(resource))


def _check_batch(x: Float32Array, state: Float32Array) -> None:
    if x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != INPUT_SAMPLES:
        raise InvalidAudio(
            f"inference rows must be float32 (B, {INPUT_SAMPLES}), got {x.dtype} {x.shape}"
        )
    if state.dtype != np.float32 or state.shape != (2, x.shape[0], STATE_SIZE):
        raise InvalidAudio(
            f"state must be float32 (2, {x.shape[0]}, {STATE_SIZE}), "
            f"got {state.dtype} {state.shape}"
        )


class OnnxSilero:
    """``silero_vad.onnx`` on onnxruntime's CPU provider, one intra-op and one inter-op thread.

    One session serves every stream of the process (a session is ~10 MB; Pipecat opens one per
    call). ``run`` is called from one thread at a time by the engine.
    """

    name = "onnx"

    def __init__(self, *, path: str | Path | None = None, threads: int = 1) -> None:
        """Load the model.

        Args:
            path: An ONNX file with the Silero v5/v6 signature; default: the packaged one.
            threads: onnxruntime intra-op threads (1: one core per process, the unit we scale by).

        Raises:
            RuntimeUnavailable: onnxruntime or the model cannot be loaded.
        """
        try:
            import onnxruntime
        except ImportError as exc:
            raise RuntimeUnavailable("onnxruntime is not installed") from exc
        self.path = Path(path) if path is not None else model_path("silero_vad.onnx")
        opts = onnxruntime.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
        # Default log level 2 prints benign "removing initializer" warnings to stderr on load.
        opts.log_severity_level = 3
        try:
            self._session = onnxruntime.InferenceSession(
                str(self.path), sess_options=opts, providers=["CPUExecutionProvider"]
            )
        except Exception as exc:  # onnxruntime raises its own pybind11 types, no common base
            raise RuntimeUnavailable(f"cannot load {self.path}: {exc}") from exc
        self._sr = np.array(SAMPLE_RATE, dtype=np.int64)
        self._outputs = ["output", "stateN"]

    def infer(self, x: Float32Array, state: Float32Array) -> tuple[Float32Array, Float32Array]:
        """Score one batch; see :meth:`SileroRuntime.infer`."""
        _check_batch(x, state)
        try:
            out, new_state = self._session.run(
                self._outputs, {"input": x, "state": state, "sr": self._sr}
            )
        except Exception as exc:  # onnxruntime's pybind11 errors share no public base class
            raise InferenceError(f"onnxruntime failed on a batch of {x.shape[0]}: {exc}") from exc
        return out.reshape(-1), new_state

    def warm_up(self, batches: tuple[int, ...] = (1, 8, 16)) -> None:
        """Run silence through the model at these batch sizes (see :func:`warm_up`)."""
        warm_up(self, batches)

    def __repr__(self) -> str:
        return f"OnnxSilero(path={str(self.path)!r})"


class TorchScriptSilero:
    """``silero_vad.jit`` (TorchScript) driven through its pure 8 kHz submodule ``_model_8k``.

    The wrapper's own ``forward(x, sr)`` keeps one hidden ``_state`` for the whole module and
    resets it whenever the batch size changes, so we never call it: ``_model_8k(x, state)`` takes
    the 288-sample rows and the state explicitly and returns the new state, which we hand back as
    numpy like :class:`OnnxSilero` does. Runs under ``torch.inference_mode`` with one thread.
    """

    name = "torchscript"

    def __init__(self, *, path: str | Path | None = None, threads: int = 1) -> None:
        """Load the model.

        Args:
            path: A TorchScript file with the silero-vad v5/v6 layout; default: the packaged one.
            threads: torch intra-op threads. torch keeps this per calling thread (OpenMP), so
                :meth:`infer` re-applies it in whichever thread it runs.

        Raises:
            RuntimeUnavailable: torch or the model cannot be loaded, or it has no 8 kHz submodule.
        """
        try:
            import torch
        except ImportError as exc:
            raise RuntimeUnavailable("torch is not installed") from exc
        self._torch = torch
        self.path = Path(path) if path is not None else model_path("silero_vad.jit")
        self._threads = threads
        torch.set_num_threads(threads)
        try:
            # torch.jit.load has no annotations (torch 2.13); it returns a ScriptModule.
            # (torch.jit.load carries no annotations.)
            module = torch.jit.load(str(self.path), map_location="cpu")  # type: ignore[no-untyped-call]
        except Exception as exc:  # torch.jit.load raises RuntimeError or pickle/zip errors
            raise RuntimeUnavailable(f"cannot load {self.path}: {exc}") from exc
        module.eval()
        model_8k = getattr(module, "_model_8k", None)
        if model_8k is None:
            raise RuntimeUnavailable(f"{self.path} has no _model_8k submodule (not silero v5/v6?)")
        self._module = module  # keeps the parent (and its constants) alive
        self._model: Any = model_8k

    def infer(self, x: Float32Array, state: Float32Array) -> tuple[Float32Array, Float32Array]:
        """Score one batch; see :meth:`SileroRuntime.infer`."""
        _check_batch(x, state)
        torch = self._torch
        if torch.get_num_threads() != self._threads:  # a thread other than the loading one
            torch.set_num_threads(self._threads)
        # from_numpy warns (an error under our test settings) on read-only arrays; copy those.
        xt = torch.from_numpy(x if x.flags.writeable else x.copy())
        st = torch.from_numpy(state if state.flags.writeable else state.copy())
        try:
            with torch.inference_mode():
                out, new_state = self._model(xt, st)
        except Exception as exc:  # TorchScript raises torch.jit.Error / RuntimeError
            raise InferenceError(f"torchscript failed on a batch of {x.shape[0]}: {exc}") from exc
        probs: Float32Array = _as_numpy(out).reshape(-1)
        return probs, _as_numpy(new_state)

    def warm_up(self, batches: tuple[int, ...] = (1, 24, 32, 48, 64, 96, 128)) -> None:
        """Run silence through the model at these batch sizes (see :func:`warm_up`)."""
        warm_up(self, batches)

    def __repr__(self) -> str:
        return f"TorchScriptSilero(path={str(self.path)!r})"


def _as_numpy(t: torch.Tensor) -> Float32Array:
    arr: Float32Array = t.numpy()
    return arr


class AdaptiveSilero:
    """ONNX for small batches, TorchScript for large ones: the cheaper runtime per batch.

    Measured on one core (bench/vad_throughput.py): ONNX costs ~92 us for one row and ~31 us a
    row in large batches, TorchScript ~250 us for one row but ~16 us a row at 128. Both take
    the same state layout and score within 3e-6 of each other, so a stream's state may pass
    from one to the other between windows.
    """

    name = "auto"

    def __init__(self, *, threshold: int = 32) -> None:
        """``threshold``: the smallest batch given to TorchScript. Re-measured 2026-11-30 (one
        core, us per row, ONNX / TorchScript): 8 rows 38 / 92, 16 rows 31 / 52, 24 rows 30 / 37,
        32 rows 30 / 30, 48 rows 29 / 25, 128 rows 27 / 15."""
        self.threshold = threshold
        self._onnx = OnnxSilero()
        self._torch = TorchScriptSilero()

    def infer(self, x: Float32Array, state: Float32Array) -> tuple[Float32Array, Float32Array]:
        runtime = self._onnx if x.shape[0] < self.threshold else self._torch
        return runtime.infer(x, state)

    def warm_up(self) -> None:
        """Each runtime at the batch sizes it will serve (see :func:`warm_up`)."""
        self._onnx.warm_up((1, 8, self.threshold - 1))
        self._torch.warm_up((self.threshold, 32, 48, 64, 96, 128))


def warm_up(runtime: SileroRuntime, batches: tuple[int, ...]) -> None:
    """Run two batches of silence at each size, so the first calls' one-off costs land here,
    at load time, and not on a live call's frames: TorchScript's profiling executor spends
    ~50 ms on its first call and 3-5 ms on each new batch size (measured on this machine class;
    each stalls every call in the process)."""
    for b in batches:
        x = np.zeros((b, INPUT_SAMPLES), dtype=np.float32)
        for _ in range(2):
            runtime.infer(x, np.zeros((2, b, STATE_SIZE), dtype=np.float32))


def import_runtime(name: str) -> None:
    """Import the Python package behind a runtime (no model is loaded); unknown names pass."""
    try:
        if name in ("onnx", "auto"):
            import onnxruntime  # noqa: F401
        if name in ("torchscript", "auto"):
            import torch  # noqa: F401
    except ImportError as exc:
        raise RuntimeUnavailable(f"the {name} runtime's package cannot be imported: {exc}") from exc


def load_runtime(name: RuntimeName) -> SileroRuntime:
    """Load the packaged Silero model on the named runtime.

    Args:
        name: ``"onnx"`` (onnxruntime) or ``"torchscript"`` (torch.jit).

    Raises:
        RuntimeUnavailable: The name is unknown or the runtime cannot be loaded.
    """
    loaders: dict[str, type[OnnxSilero | TorchScriptSilero | AdaptiveSilero]] = {
        "onnx": OnnxSilero, "torchscript": TorchScriptSilero, "auto": AdaptiveSilero,
    }
    loader = loaders.get(name)
    if loader is None:
        raise RuntimeUnavailable(
            f"unknown Silero runtime {name!r}; use 'onnx', 'torchscript' or 'auto'"
        )
    runtime = loader()
    runtime.warm_up()  # first-call costs here, not on a live call
    return runtime


def probabilities(runtime: SileroRuntime, samples: npt.ArrayLike) -> Float32Array:
    """Speech probability of every complete 256-sample window of one signal, from a fresh state.

    A trailing partial window is not scored, as in a stream that ends there, so index ``k`` of the
    result is the engine's window ``k`` (ending at sample ``256 * (k + 1)``).

    Args:
        runtime: The model to run.
        samples: Mono 8 kHz audio, float in [-1, 1].

    Returns:
        float32 array of ``len(samples) // 256`` probabilities.
    """
    audio = np.asarray(samples)
    if audio.ndim != 1 or not np.issubdtype(audio.dtype, np.floating):
        raise InvalidAudio(f"samples must be a 1-D float array, got {audio.dtype} {audio.shape}")
    audio = audio.astype(np.float32, copy=False)
    n = audio.shape[0] // WINDOW_SAMPLES
    probs = np.empty(n, dtype=np.float32)
    state = initial_state(1)
    x = np.zeros((1, INPUT_SAMPLES), dtype=np.float32)
    for k in range(n):
        x[0, CONTEXT_SAMPLES:] = audio[k * WINDOW_SAMPLES : (k + 1) * WINDOW_SAMPLES]
        p, state = runtime.infer(x, state)
        probs[k] = p[0]
        x[0, :CONTEXT_SAMPLES] = x[0, -CONTEXT_SAMPLES:]
    return probs
