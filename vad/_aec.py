"""An echo canceller in front of the VAD: WebRTC's AEC3, one per call, on the playout clock.

Why: the echo gate (``vad/_echo.py``) predicts the echo's *level* from what the bot played, so
until it has learnt the echo path it must assume the worst (a loud echo at any delay) and a
caller quieter than that worst case is not heard; a path that changes mid-call needs it to
learn again. WebRTC's AEC3 (through the ``livekit`` wheel's ``AudioProcessingModule``) removes
the echo itself, from the first syllable: on synthetic echo of the dev set's bot voice at 8 kHz
it took 21-44 dB off in the first second at delays 0-450 ms and 6-20 dB echo return loss, and
13-33 dB off clipped echo (``docs/bargein.md``). speexdsp and a numpy frequency-domain NLMS
were tried earlier and did not get there.

Three rules make it work on a phone line:

* **The reference is the bot's audio when the caller hears it**, not when it is sent. The
  gateway sends up to its playback lead (240 ms) ahead; AEC3's delay estimator would spend that
  much of its range on our own buffering. So the bot's audio is kept in a ring indexed by the
  inbound sample at which it plays (the playout clock of ``gateway/playback.py``), and each
  10 ms of inbound audio is processed right after the 10 ms of bot audio that played with it.
  A ``clear`` empties the ring from the clear point on.
* **Off when no bot audio can be echoing.** A call whose bot has been silent for longer than
  the longest echo delay plus the echo's tail (``hold_ms``) pays nothing: its frames go to the
  VAD untouched and AEC3 is not called (it keeps what it learnt for the next turn: the render
  and capture streams skip the same stretch of time, so their alignment holds).
* **AEC only.** Noise suppression and the delay hint made barge-in worse in the first look
  (issue #12): the first attenuates quiet callers, the second fights the ring's alignment.

The canceller does no socket I/O and keeps no clock of its own: the call controller tells it
where each frame sits on the inbound track.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from audio import TELEPHONY_RATE

from ._silero import VadError

__all__ = ["AecMode", "EchoCanceller", "EchoCancellerSettings", "EchoCancellerUnavailable",
           "warm_up"]

FRAME: Final = 80  # samples per AEC3 frame: exactly 10 ms at 8 kHz, as the module requires
RATE: Final = TELEPHONY_RATE
_RING: Final = 1 << 15  # reference samples kept (4.1 s): the lead ahead plus the hold behind
_MASK: Final = _RING - 1
_SCALE: Final = 32767.0


class EchoCancellerUnavailable(VadError):
    """The echo canceller was asked for but its package cannot be loaded."""


class AecMode(enum.Enum):
    """Which echo canceller runs in front of the VAD (``barge_in.echo_canceller``)."""

    OFF = "off"  # none: the echo gate alone (the decision before issue #12)
    AEC3 = "aec3"  # WebRTC AEC3 through livekit's AudioProcessingModule


@dataclass(frozen=True, slots=True)
class EchoCancellerSettings:
    """When the echo canceller runs."""

    hold_ms: float = 720.0
    """After the bot's last audible sample, keep cancelling this long: the longest echo delay
    the gate considers (520 ms) plus 200 ms of reverberant tail. Past it no bot audio can be
    echoing, and the canceller is off."""
    active_dbfs: float = -60.0
    """Bot audio quieter than this (10 ms mean) counts as silence for ``hold_ms``."""


def _load_module() -> Any:
    try:
        from livekit import rtc
    except Exception as exc:  # ImportError, or its native library failing to load
        raise EchoCancellerUnavailable(
            f"barge_in.echo_canceller: aec3 needs the livekit package ({exc!r}); install it or "
            "set echo_canceller: off"
        ) from exc
    return rtc


class EchoCanceller:
    """One call's AEC3. Feed the bot's audio with :meth:`add_reference` (at its play position)
    and every inbound frame through :meth:`process`, in order. Not thread-safe."""

    def __init__(self, settings: EchoCancellerSettings | None = None) -> None:
        self.settings = s = settings or EchoCancellerSettings()
        self._rtc = _load_module()
        self._apm: Any = self._rtc.AudioProcessingModule(echo_cancellation=True)
        # One far-end and one near-end frame, reused: the module works on their buffers in
        # place (7 of 65 us per 10 ms saved against new frames each time).
        self._far_buf, self._near_buf = bytearray(2 * FRAME), bytearray(2 * FRAME)
        self._far = self._rtc.AudioFrame(self._far_buf, RATE, 1, FRAME)
        self._near = self._rtc.AudioFrame(self._near_buf, RATE, 1, FRAME)
        self._far_pcm = np.frombuffer(self._far_buf, dtype=np.int16)
        self._near_pcm = np.frombuffer(self._near_buf, dtype=np.int16)
        self._ring = np.zeros(_RING, dtype=np.int16)
        self._hold = int(round(s.hold_ms * RATE / 1000))
        self._active_e = (10 ** (s.active_dbfs / 20) * _SCALE) ** 2
        self._ref_lo = 0  # oldest sample the ring still holds for reading (the inbound clock)
        self._ref_hi = 0  # one past the last sample written
        # Stretches [lo, hi) of audible reference, in order, merged across gaps under hold_ms.
        self._audible: deque[list[int]] = deque()
        self.frames_processed = 0
        """10 ms frames that went through AEC3 (the rest passed untouched)."""
        self.frames_bypassed = 0

    # -- the reference: what the caller hears -----------------------------------------------
    def add_reference(self, start_sample: int, samples: npt.NDArray[np.floating]) -> None:
        """Bot audio that plays on the line from inbound sample ``start_sample`` on."""
        n = len(samples)
        if n == 0:
            return
        lo = max(start_sample, self._ref_lo)
        hi = min(start_sample + n, self._ref_lo + _RING)  # never overwrite what is still ahead
        if hi <= lo:
            return
        x = np.asarray(samples[lo - start_sample : hi - start_sample], dtype=np.float64)
        pcm = np.clip(np.round(x * _SCALE), -32768, 32767).astype(np.int16)
        self._write(lo, pcm, add=True)
        self._ref_hi = max(self._ref_hi, hi)
        # Audible: from the first to the last 10 ms block above the activity floor.
        e = pcm.astype(np.float64) ** 2
        nb = -(-len(e) // FRAME)
        blocks = np.add.reduceat(e, np.arange(0, nb * FRAME, FRAME)) / FRAME
        loud = np.flatnonzero(blocks > self._active_e)
        if len(loud):
            a = lo + int(loud[0]) * FRAME
            b = min(hi, lo + (int(loud[-1]) + 1) * FRAME)
            spans = self._audible
            if spans and a <= spans[-1][1] + self._hold:
                spans[-1][1] = max(spans[-1][1], b)
                spans[-1][0] = min(spans[-1][0], a)
            else:
                spans.append([a, b])

    def clear_reference_from(self, sample: int) -> None:
        """The bot's audio from inbound sample ``sample`` on was cancelled (a Twilio ``clear``)."""
        lo = max(sample, self._ref_lo)
        if lo < self._ref_hi:
            self._write(lo, np.zeros(self._ref_hi - lo, dtype=np.int16), add=False)
        self._ref_hi = min(self._ref_hi, max(sample, self._ref_lo))
        spans = self._audible
        while spans and spans[-1][0] >= sample:
            spans.pop()
        if spans:
            spans[-1][1] = min(spans[-1][1], sample)

    def _write(self, start: int, pcm: npt.NDArray[np.int16], *, add: bool) -> None:
        a = start & _MASK
        first = min(len(pcm), _RING - a)
        for dst, src in ((slice(a, a + first), pcm[:first]), (slice(0, len(pcm) - first),
                                                               pcm[first:])):
            if src.size:
                if add:  # overlapping sends of one stretch sum, as the line would play them
                    mixed = self._ring[dst].astype(np.int32) + src
                    self._ring[dst] = np.clip(mixed, -32768, 32767)
                else:
                    self._ring[dst] = src

    def _read(self, start: int, n: int) -> npt.NDArray[np.int16]:
        """The reference for inbound samples ``[start, start + n)``, zeroed behind it as read
        (the ring's next lap starts clean)."""
        a = start & _MASK
        if a + n <= _RING:
            out = self._ring[a : a + n].copy()
            self._ring[a : a + n] = 0
        else:
            k = _RING - a
            out = np.concatenate([self._ring[a:], self._ring[: n - k]])
            self._ring[a:] = 0
            self._ring[: n - k] = 0
        return out

    # -- the inbound track ------------------------------------------------------------------
    def active_at(self, sample: int, n: int = FRAME) -> bool:
        """Whether bot audio can be echoing in inbound samples ``[sample, sample + n)``: some
        audible bot audio plays before their end and ended at most ``hold_ms`` before them."""
        spans = self._audible
        while spans and spans[0][1] + self._hold <= sample:
            spans.popleft()  # over for good: the inbound clock only moves on
        return bool(spans) and spans[0][0] < sample + n

    def process(self, start_sample: int, samples: npt.NDArray[np.float32]
                ) -> npt.NDArray[np.float32]:
        """Inbound audio ``samples`` (float, [-1, 1]) that starts at inbound sample
        ``start_sample``, with the bot's echo removed where it can be echoing. Whole 10 ms
        frames go through AEC3; a remainder (Twilio sends 20 ms frames, so never in practice)
        passes untouched. Returns a new array, or ``samples`` itself where nothing ran."""
        n = len(samples)
        if start_sample < self._ref_lo:  # overlapping or reordered audio: never rewind
            return samples
        if start_sample > self._ref_lo:  # a gap (lost packets): drop the reference it covered
            skip = min(start_sample - self._ref_lo, _RING)
            self._read(self._ref_lo, skip)
        self._ref_lo = start_sample + n
        nf = n // FRAME
        if nf == 0 or not self.active_at(start_sample, n):
            if nf:
                self._read(start_sample, nf * FRAME)
            self.frames_bypassed += nf
            return samples
        ref = self._read(start_sample, nf * FRAME)
        x = np.clip(np.round(np.asarray(samples, dtype=np.float64) * _SCALE), -32768, 32767)
        pcm = x.astype(np.int16)
        out = samples.astype(np.float32, copy=True)
        apm, far, near, far_pcm, near_pcm = (self._apm, self._far, self._near, self._far_pcm,
                                             self._near_pcm)
        for k in range(nf):
            seg = slice(k * FRAME, (k + 1) * FRAME)
            far_pcm[:] = ref[seg]
            apm.process_reverse_stream(far)
            near_pcm[:] = pcm[seg]
            apm.process_stream(near)
            out[seg] = near_pcm * (1.0 / _SCALE)
        self.frames_processed += nf
        return out

    def close(self) -> None:
        """Release the native module (idempotent)."""
        apm, self._apm = self._apm, None
        handle = getattr(apm, "_ffi_handle", None)
        if handle is not None:
            handle.dispose()


def warm_up() -> None:
    """Load the native module and run one instance once, at startup: a gateway configured with
    ``echo_canceller: aec3`` that cannot run it fails there with the reason (not on its first
    call), and the first call does not pay for loading livekit's library on the event loop.

    Raises:
        EchoCancellerUnavailable: The package or its native library cannot be loaded or run.
    """
    aec = EchoCanceller()
    try:
        aec.add_reference(0, np.zeros(FRAME, dtype=np.float32) + 0.1)
        aec.process(0, np.zeros(2 * FRAME, dtype=np.float32))
    except Exception as exc:
        raise EchoCancellerUnavailable(f"barge_in.echo_canceller: aec3 does not run: {exc!r}"
                                       ) from exc
    finally:
        aec.close()
