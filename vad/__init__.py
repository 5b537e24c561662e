"""Voice activity and the barge-in decision.

* ``_silero``: Silero VAD at 8 kHz, ONNX or TorchScript behind one interface.
* ``_engine``: one engine per process; every call's windows batched into shared inferences.
* ``_aec``: WebRTC AEC3 in front of the VAD, one per call, on the playout clock.
* ``_echo``: every call's echo and noise gate (is the inbound louder than the bot's own echo?),
  as rows of a bank the engine reads a batch at a time.
* ``_features``: voicing and DTMF-likeness of a window.
* ``_policy``: :class:`BargeInPolicy`, the one place where barge-in is decided.
"""

from ._aec import (
    AecMode,
    EchoCanceller,
    EchoCancellerSettings,
    EchoCancellerUnavailable,
)
from ._aec import warm_up as warm_up_echo_canceller
from ._echo import EchoGate, EchoGateBank, EchoGateSettings, GateReading
from ._engine import (
    EngineClosed,
    EngineError,
    EngineNotStarted,
    EngineStats,
    StreamClosed,
    VadEngine,
    VadStream,
    WindowResult,
)
from ._features import WindowFeatures, window_features
from ._policy import (
    BargeInPolicy,
    BargeInSettings,
    BotState,
    BotView,
    CallerClassifier,
    CallerFeatures,
    Decision,
    DropReason,
    Effect,
    Interrupt,
    InterruptReason,
    OverUninterruptible,
    Pause,
    PolicyState,
    Resume,
    SpeechStarted,
    SpeechStopped,
    Suppressed,
    wants_features,
)
from ._silero import (
    AdaptiveSilero,
    InferenceError,
    InvalidAudio,
    OnnxSilero,
    RuntimeName,
    RuntimeUnavailable,
    SileroRuntime,
    TorchScriptSilero,
    VadError,
    load_runtime,
    probabilities,
)

__all__ = [
    "AecMode",
    "EchoCanceller",
    "EchoCancellerSettings",
    "EchoCancellerUnavailable",
    "AdaptiveSilero",
    "BargeInPolicy",
    "BargeInSettings",
    "BotState",
    "BotView",
    "CallerClassifier",
    "CallerFeatures",
    "Decision",
    "DropReason",
    "EchoGate",
    "EchoGateBank",
    "EchoGateSettings",
    "EngineClosed",
    "EngineError",
    "EngineNotStarted",
    "EngineStats",
    "Effect",
    "GateReading",
    "InferenceError",
    "Interrupt",
    "InterruptReason",
    "InvalidAudio",
    "OnnxSilero",
    "OverUninterruptible",
    "Pause",
    "PolicyState",
    "Resume",
    "RuntimeName",
    "RuntimeUnavailable",
    "SileroRuntime",
    "SpeechStarted",
    "SpeechStopped",
    "StreamClosed",
    "Suppressed",
    "TorchScriptSilero",
    "VadEngine",
    "VadError",
    "VadStream",
    "WindowFeatures",
    "WindowResult",
    "load_runtime",
    "probabilities",
    "wants_features",
    "warm_up_echo_canceller",
    "window_features",
]
