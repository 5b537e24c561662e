"""Telephone-leg audio, at the bottom of the project: every package may import it, and it
imports none of theirs.

* ``_codec``: G.711 mu-law, PCM16 and float32 conversions, stateful resampling, framing and the
  mu-law WAV files of the corpus, with the telephony constants (:data:`TELEPHONY_RATE`, 8 kHz
  mono mu-law: one byte per sample, :data:`ULAW_BYTES_PER_MS` per millisecond).
* ``_stream``: converters for audio that arrives in chunks of any size (:class:`PcmInput`:
  PCM16 at one rate to another; :class:`UlawEncoder`: PCM16 at any rate to 8 kHz mu-law, low-pass
  filtered first) and :func:`encode_wav_pcm16`.

Errors::

    AudioError (ValueError)         anything this package refuses
    ├── FrameAlignmentError         PCM16 data with an odd number of bytes
    └── AudioFormatError            a WAV file or buffer that cannot become 8 kHz mu-law
"""

from ._codec import (
    FRAME_BYTES,
    FRAME_MS,
    TELEPHONY_RATE,
    ULAW_BYTES_PER_MS,
    ULAW_SILENCE,
    AudioError,
    AudioFormatError,
    FrameAlignmentError,
    ResampleState,
    check_sample_rate,
    chunk_audio,
    decode_wav_ulaw,
    duration_ms,
    encode_wav_ulaw,
    float32_to_pcm16,
    pcm16_to_float32,
    pcm16_to_ulaw,
    read_wav_ulaw,
    resample_pcm16,
    ulaw_to_float32,
    ulaw_to_pcm16,
    write_wav_ulaw,
)
from ._stream import ByteOrder, PcmInput, UlawEncoder, encode_wav_pcm16

__all__ = [
    "FRAME_BYTES",
    "FRAME_MS",
    "TELEPHONY_RATE",
    "ULAW_BYTES_PER_MS",
    "ULAW_SILENCE",
    "AudioError",
    "AudioFormatError",
    "ByteOrder",
    "FrameAlignmentError",
    "PcmInput",
    "ResampleState",
    "UlawEncoder",
    "check_sample_rate",
    "chunk_audio",
    "decode_wav_ulaw",
    "duration_ms",
    "encode_wav_pcm16",
    "encode_wav_ulaw",
    "float32_to_pcm16",
    "pcm16_to_float32",
    "pcm16_to_ulaw",
    "read_wav_ulaw",
    "resample_pcm16",
    "ulaw_to_float32",
    "ulaw_to_pcm16",
    "write_wav_ulaw",
]
