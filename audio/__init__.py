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

from . import _codec, _stream
from ._codec import *  # noqa: F403 - each module's __all__ is the package's
from ._stream import *  # noqa: F403

__all__ = [*_codec.__all__, *_stream.__all__]
