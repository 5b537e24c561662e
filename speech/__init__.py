"""Speech in and out for the phone leg: speech to text and text to speech, offline or OpenAI.

* ``_stt``: the :class:`Transcriber` seam (one :class:`TranscriptionStream` per utterance),
  :class:`Transcript`, and :func:`make_transcriber`.
* ``_pocketsphinx``: :class:`PocketsphinxTranscriber`, offline, streamed while the caller speaks.
* ``_pocketsphinx_pool``: :class:`PocketsphinxPoolTranscriber`, the same in worker processes
  (what the gateway uses), with an optional keyphrase spotter beside the transcript.
* ``_openai_stt``: :class:`OpenAITranscriber`, the utterance uploaded as a WAV on ``finish()``,
  or streamed during the turn over a Realtime transcription session (``transport="realtime"``).
* ``_tts``: the :class:`Synthesizer` seam (same shape as ``nodes.Synthesizer``),
  :func:`split_sentences` and :func:`make_synthesizer`.
* ``_espeak``: :class:`EspeakSynthesizer`, offline, eSpeak NG through ctypes, per sentence.
* ``_openai_tts``: :class:`OpenAISynthesizer`, 24 kHz PCM streamed and converted as it arrives.

The stream converters they share (PCM16 at any rate to 8 kHz mu-law with a low-pass, and back
up) live in the ``audio`` package, below every other.

Audio in is 16-bit little-endian mono PCM (8 kHz on the phone leg); audio out is 8 kHz G.711
mu-law, one byte per sample, as Twilio Media Streams carry it.
"""

from ._errors import (
    ConfigurationError,
    EngineUnavailableError,
    SpeechError,
    StreamClosedError,
    StreamFinishedError,
    StreamStateError,
    SynthesisError,
    TranscriptionError,
)
from ._espeak import EspeakSynthesizer
from ._openai_stt import OpenAIRealtimeStream, OpenAIStream, OpenAITranscriber, SttTransport
from ._openai_tts import OpenAISynthesizer
from ._pocketsphinx import TELEPHONE_CMNINIT, PocketsphinxStream, PocketsphinxTranscriber
from ._pocketsphinx_pool import (
    KEYPHRASE_THRESHOLD,
    PocketsphinxPoolStream,
    PocketsphinxPoolTranscriber,
)
from ._stt import StreamState, Transcriber, Transcript, TranscriptionStream, make_transcriber
from ._tts import Synthesizer, make_synthesizer, split_sentences

__all__ = [
    "KEYPHRASE_THRESHOLD",
    "TELEPHONE_CMNINIT",
    "ConfigurationError",
    "EngineUnavailableError",
    "EspeakSynthesizer",
    "OpenAIRealtimeStream",
    "OpenAIStream",
    "OpenAISynthesizer",
    "OpenAITranscriber",
    "PocketsphinxPoolStream",
    "PocketsphinxPoolTranscriber",
    "PocketsphinxStream",
    "PocketsphinxTranscriber",
    "SpeechError",
    "StreamClosedError",
    "StreamFinishedError",
    "SttTransport",
    "StreamState",
    "StreamStateError",
    "SynthesisError",
    "Synthesizer",
    "Transcriber",
    "Transcript",
    "TranscriptionError",
    "TranscriptionStream",
    "make_synthesizer",
    "make_transcriber",
    "split_sentences",
]
