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

import ctypes
import enum
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from audio import TELEPHONY_RATE

from ._silero import VadError

log = logging.getLogger("callgate.vad")

__all__ = ["AecMode", "EchoCanceller", "EchoCancellerSettings", "EchoCancellerUnavailable",
           "warm_up"]

FRAME: Final = 80  # samples per AEC3 frame: exactly 10 ms at 8 kHz, as the module requires
RATE: Final = TELEPHONY_RATE
_RING: Final = 1 << 15  # reference samples kept (4.1 s): the lead ahead plus the hold behind
_MASK: Final = _RING - 1
_SCALE: Final = 32767.0
_SLOTS: Final = 2  # 10 ms frames the module's buffers hold: one 20 ms Twilio frame


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


class _Module:
    """One ``AudioProcessingModule`` and the int16 buffers it works on: ``far`` and ``near``,
    ``slots`` 10 ms frames each. :meth:`run` gives it frames ``0..nf-1`` in order (each far frame
    right before its near frame) and leaves the cancelled audio in ``near``.

    Fast path: livekit's wrapper builds, serializes and parses a protobuf message and wraps the
    returned handle in an object per call; its request for a frame at a fixed buffer is the same
    bytes every time (the module's handle, the buffer's address, size, rate, channels). So each
    slot's two requests are serialized once here and sent to the same FFI entry point
    (``livekit_ffi_request``) directly; a response other than the empty success message is
    parsed and raised, as livekit does. Measured (one core, 10 ms frames of noise with echo,
    load 1.8): 29-35 -> 10.5 us per ``process_reverse_stream``, 137-142 -> 115 us per
    ``process_stream``, outputs equal bit for bit. Where the installed livekit lacks the internals
    this needs, the public methods run instead (``fast`` False; tests/vad/test_aec.py checks it is
    True for the pinned version)."""

    def __init__(self, rtc: Any, slots: int) -> None:
        self.apm: Any = rtc.AudioProcessingModule(echo_cancellation=True)
        self.slots = slots
        # The module works on the buffers in place: never resized (the requests hold their
        # addresses, and the numpy views pin them).
        self._far_buf, self._near_buf = bytearray(2 * FRAME * slots), bytearray(2 * FRAME * slots)
        self.far = np.frombuffer(self._far_buf, dtype=np.int16)
        self.near = np.frombuffer(self._near_buf, dtype=np.int16)
        self._ffi: tuple[Any, ...] | None = None
        try:
            self._ffi = self._fast_requests()
        except (ImportError, AttributeError, TypeError, ValueError):
            self._ffi = None  # another livekit layout: the public methods below
        if self._ffi is None:
            # livekit copies a sliced buffer: one 10 ms frame of its own each way, copied.
            bufs = bytearray(2 * FRAME), bytearray(2 * FRAME)
            self._frames = (rtc.AudioFrame(bufs[0], RATE, 1, FRAME),
                            rtc.AudioFrame(bufs[1], RATE, 1, FRAME),
                            np.frombuffer(bufs[0], dtype=np.int16),
                            np.frombuffer(bufs[1], dtype=np.int16))

    @property
    def fast(self) -> bool:
        """Whether frames go to the FFI with requests built once (else livekit's methods)."""
        return self._ffi is not None

    def _fast_requests(self) -> tuple[Any, ...]:
        from livekit.rtc._ffi_client import INVALID_HANDLE, FfiClient
        from livekit.rtc._proto import ffi_pb2

        client = FfiClient.instance
        lib = client._ffi_lib
        handle = int(self.apm._ffi_handle.handle)
        far0 = ctypes.addressof(ctypes.c_char.from_buffer(self._far_buf))
        near0 = ctypes.addressof(ctypes.c_char.from_buffer(self._near_buf))
        # Per slot, in the order they run: (request, its length, the success response, kind).
        reqs: list[list[tuple[Any, int, bytes, str]]] = []
        for k in range(self.slots):
            pair = []
            for kind, base in (("apm_process_reverse_stream", far0),
                               ("apm_process_stream", near0)):
                req = ffi_pb2.FfiRequest()
                body = getattr(req, kind)
                body.apm_handle = handle
                body.data_ptr = base + 2 * FRAME * k
                body.size = 2 * FRAME
                body.sample_rate = RATE
                body.num_channels = 1
                raw = req.SerializeToString()
                ok = ffi_pb2.FfiResponse()
                getattr(ok, kind).SetInParent()
                pair.append(((ctypes.c_ubyte * len(raw)).from_buffer_copy(raw), len(raw),
                             ok.SerializeToString(), kind))
            reqs.append(pair)
        out_ptr = ctypes.POINTER(ctypes.c_ubyte)()
        out_len = ctypes.c_size_t()
        return (lib.livekit_ffi_request, lib.livekit_ffi_drop_handle, reqs, out_ptr, out_len,
                ctypes.byref(out_ptr), ctypes.byref(out_len), INVALID_HANDLE, ffi_pb2.FfiResponse)

    def run(self, nf: int) -> None:
        """Frames ``0..nf-1`` (``nf <= slots``) of ``far`` then ``near`` through the module."""
        ffi = self._ffi
        if ffi is None:
            if self.apm is None:
                raise RuntimeError("the echo canceller was closed")
            far, near, far_pcm, near_pcm = self._frames
            for k in range(nf):
                seg = slice(k * FRAME, (k + 1) * FRAME)
                far_pcm[:] = self.far[seg]
                self.apm.process_reverse_stream(far)
                near_pcm[:] = self.near[seg]
                self.apm.process_stream(near)
                self.near[seg] = near_pcm
            return
        request, drop, reqs, out_ptr, out_len, out_ptr_ref, out_len_ref, invalid, _ = ffi
        string_at = ctypes.string_at
        for pair in reqs[:nf]:
            for req, size, ok, kind in pair:  # the far frame, then the near frame
                h = request(req, size, out_ptr_ref, out_len_ref)
                if h == invalid:
                    self._failed(None, kind)
                got = string_at(out_ptr, out_len.value)
                if not drop(h):  # livekit's own FfiHandle.dispose asserts this
                    raise RuntimeError(f"livekit {kind}: the FFI did not drop its response")
                if got != ok:
                    self._failed(got, kind)

    def _failed(self, got: bytes | None, kind: str) -> None:
        """A response other than plain success: its error, as livekit's methods raise it."""
        assert self._ffi is not None
        if got is None:  # livekit's own wrapper asserts here
            raise RuntimeError(f"livekit {kind}: the FFI refused the request (no response)")
        resp = self._ffi[-1]()
        resp.ParseFromString(got)
        if resp.WhichOneof("message") != kind:
            raise RuntimeError(f"livekit {kind}: unexpected response {resp.WhichOneof('message')}")
        error = getattr(resp, kind).error
        if error:
            raise RuntimeError(error)
        # Success in another encoding (a field a later livekit added): parsed each time, fine.

    def close(self) -> None:
        """Release the native module (idempotent)."""
        apm, self.apm = self.apm, None
        self._ffi = None
        handle = getattr(apm, "_ffi_handle", None)
        if handle is not None:
            handle.dispose()


def _to_pcm(x: npt.NDArray[np.float64], out: npt.NDArray[np.int16]) -> None:
    """``out[:] = clip(round(x * 32767))`` in place (``x`` is overwritten): what AEC3 gets of a
    float sample. Rounding half to even and clipping as ``np.clip(np.round(...))`` did, in
    preallocated buffers: 10-11 against 21-26 us per 20 ms frame (timeit, one core, load 2)."""
    np.multiply(x, _SCALE, out=x)
    np.rint(x, out=x)
    np.maximum(x, -32768.0, out=x)
    np.minimum(x, 32767.0, out=x)
    out[:] = x


class EchoCanceller:
    """One call's AEC3. Feed the bot's audio with :meth:`add_reference` (at its play position)
    and every inbound frame through :meth:`process`, in order. Not thread-safe."""

    def __init__(self, settings: EchoCancellerSettings | None = None) -> None:
        self.settings = s = settings or EchoCancellerSettings()
        self._rtc = _load_module()
        # The far-end and near-end buffers the module works on in place, reused (7 of 65 us
        # per 10 ms saved against new frames each time): two 10 ms frames, a Twilio frame.
        self._module = _Module(self._rtc, _SLOTS)
        self._x = np.empty(_SLOTS * FRAME)  # float64 scratch of the int16 conversion
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
        m = hi - lo
        nb = -(-m // FRAME)
        x = np.zeros(nb * FRAME)  # whole 10 ms blocks, the last one zero-padded
        x[:m] = samples[lo - start_sample : hi - start_sample]
        pcm = np.empty(nb * FRAME, dtype=np.int16)
        _to_pcm(x, pcm)  # x holds the same integers, as float64
        self._write(lo, pcm[:m], add=True)
        self._ref_hi = max(self._ref_hi, hi)
        # Audible: from the first to the last 10 ms block above the activity floor. The sums
        # are of squared int16s (below 2**37), exact in float64 whatever their order: the
        # padded blocks give what np.add.reduceat of the squares did, bit for bit.
        xb = x.reshape(nb, FRAME)
        blocks = np.einsum("ij,ij->i", xb, xb) / FRAME
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
                    mixed = self._ring[dst].astype(np.int32)
                    mixed += src
                    np.minimum(mixed, 32767, out=mixed)  # np.clip, without its wrapper
                    np.maximum(mixed, -32768, out=mixed)
                    self._ring[dst] = mixed
                else:
                    self._ring[dst] = src

    def _read(self, start: int, n: int, out: npt.NDArray[np.int16] | None = None) -> None:
        """The reference for inbound samples ``[start, start + n)`` into ``out`` (None: only
        dropped), zeroed behind it as read (the ring's next lap starts clean)."""
        a = start & _MASK
        ring = self._ring
        if a + n <= _RING:
            if out is not None:
                out[:n] = ring[a : a + n]
            ring[a : a + n] = 0
        else:
            k = _RING - a
            if out is not None:
                out[:k] = ring[a:]
                out[k:n] = ring[: n - k]
            ring[a:] = 0
            ring[: n - k] = 0

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
        module, x = self._module, self._x
        # A remainder passes untouched; the cast to float32 happens in the assignments below.
        out = (np.empty(n, dtype=np.float32) if n == nf * FRAME
               else samples.astype(np.float32, copy=True))
        for f0 in range(0, nf, _SLOTS):  # a Twilio frame: one pass
            k = min(_SLOTS, nf - f0)
            a, m = f0 * FRAME, k * FRAME
            self._read(start_sample + a, m, module.far)
            x[:m] = samples[a : a + m]
            _to_pcm(x[:m], module.near[:m])
            module.run(k)
            out[a : a + m] = module.near[:m] * (1.0 / _SCALE)
        self.frames_processed += nf
        return out

    def close(self) -> None:
        """Release the native module (idempotent)."""
        self._module.close()

    @property
    def fast_ffi(self) -> bool:
        """Whether AEC3 is driven through the FFI with requests built once (``_Module``)."""
        return self._module.fast


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
        if not aec.fast_ffi:  # works, only slower: said once, at startup
            log.warning("barge_in.echo_canceller: this livekit's internals differ from the tested "
                        "1.2.1: AEC3 runs through its public methods (~40 us more per 10 ms)")
    except Exception as exc:
        raise EchoCancellerUnavailable(f"barge_in.echo_canceller: aec3 does not run: {exc!r}"
                                       ) from exc
    finally:
        aec.close()
