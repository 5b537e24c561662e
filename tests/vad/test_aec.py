"""WebRTC AEC3 in front of the VAD (vad/_aec.py): it removes a strong echo of the bot's real
voice at 8 kHz, reads the bot's audio at its play position, and stays off when no bot audio can
be echoing."""

from __future__ import annotations

import builtins
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from audio import read_wav_ulaw, ulaw_to_float32
from vad import EchoCanceller, EchoCancellerSettings, EchoCancellerUnavailable

RECORDINGS = Path(__file__).resolve().parents[1] / "recordings"
LEAD = 1920  # samples of bot audio handed over ahead of their play position (the 240 ms lead)


def bot_voice() -> np.ndarray:
    """The bot's espeak voice of a dev recording (8 kHz float), from its first turn on."""
    x = ulaw_to_float32(read_wav_ulaw(RECORDINGS / "echo_only_short_delay.bot.wav"))
    return x[4800:4800 + 8000 * 6].astype(np.float64)


def db(x: np.ndarray) -> float:
    return float(10 * np.log10(np.mean(np.asarray(x, dtype=np.float64) ** 2) + 1e-12))


def run(aec: EchoCanceller, inbound: np.ndarray, bot: np.ndarray) -> np.ndarray:
    """Drive ``aec`` as the call controller does: bot audio a lead ahead, 20 ms inbound frames."""
    aec.add_reference(0, bot[:LEAD])
    out = []
    for i in range(0, len(inbound) - 159, 160):
        aec.add_reference(i + LEAD, bot[i + LEAD:i + LEAD + 160])
        out.append(aec.process(i, inbound[i:i + 160].astype(np.float32)))
    return np.concatenate(out)


@pytest.mark.parametrize(("delay_ms", "erl_db"), [(60, 6.0), (150, 6.0), (450, 9.0)])
def test_removes_a_strong_echo_from_the_first_second(delay_ms: int, erl_db: float) -> None:
    bot = bot_voice()
    rng = np.random.default_rng(1)
    d = delay_ms * 8
    echo = np.concatenate([np.zeros(d), bot])[: len(bot)] * 10 ** (-erl_db / 20)
    inbound = echo + rng.normal(0, 10 ** (-65 / 20), len(bot))
    aec = EchoCanceller()
    try:
        out = run(aec, inbound, bot)
    finally:
        aec.close()
    n = len(out)
    loud = np.convolve(echo[:n] ** 2, np.ones(256) / 256, "same") > 10 ** (-45 / 10)
    first, rest = slice(0, 8000), slice(8000, n)
    # Measured at these delays: 26-44 dB off in the first second, 30-37 dB after it (at 0 ms
    # delay, which no phone line has, 9.9 dB after it; at 500 ms 3.3 dB in the first 0.5 s).
    assert db(inbound[first][loud[first]]) - db(out[first][loud[first]]) > 15.0
    assert db(inbound[rest][loud[rest]]) - db(out[rest][loud[rest]]) > 15.0
    assert aec.frames_processed > 0


def test_off_while_no_bot_audio_can_echo() -> None:
    """No bot audio: nothing runs and the frame comes back as it was. Bot audio: frames run
    until hold_ms after its last audible sample, then the canceller is off again."""
    aec = EchoCanceller(EchoCancellerSettings(hold_ms=400.0))
    try:
        rng = np.random.default_rng(2)
        frame = rng.normal(0, 0.01, 160).astype(np.float32)
        for k in range(10):
            assert aec.process(k * 160, frame) is frame
        assert aec.frames_processed == 0 and aec.frames_bypassed == 20
        # 200 ms of bot audio that plays from sample 3200 (400 ms) on.
        aec.add_reference(3200, bot_voice()[:1600])
        assert aec.process(1600, frame) is frame  # before it plays and outside the hold: off
        assert not aec.active_at(1600) and aec.active_at(3200) and aec.active_at(4700)
        for k in range(11, 60):
            aec.process(k * 160, frame)
        # Ran from 400 ms (the audio's start) to 1000 ms (its end + 400 ms of hold), then off.
        assert aec.frames_processed == 2 * (1000 - 400) // 20
        assert not aec.active_at(59 * 160 + 160)
    finally:
        aec.close()


def test_a_clear_ends_the_reference_at_the_clear_point() -> None:
    aec = EchoCanceller(EchoCancellerSettings(hold_ms=100.0))
    try:
        aec.add_reference(0, bot_voice()[:8000])  # 1 s of bot audio queued
        assert aec.active_at(7000)
        aec.clear_reference_from(2400)  # cleared at 300 ms: nothing after it plays
        assert aec.active_at(2400 + 700) and not aec.active_at(2400 + 900)
    finally:
        aec.close()


def test_silent_bot_audio_does_not_switch_it_on() -> None:
    aec = EchoCanceller()
    try:
        aec.add_reference(0, np.full(1600, 1e-5))  # -100 dBFS: below active_dbfs
        assert not aec.active_at(0)
    finally:
        aec.close()


def test_missing_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_livekit(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("livekit"):
            raise ImportError("No module named 'livekit'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_livekit)
    with pytest.raises(EchoCancellerUnavailable, match="echo_canceller: off"):
        EchoCanceller()


def test_warm_up_runs_the_module_once() -> None:
    from vad import warm_up_echo_canceller

    warm_up_echo_canceller()  # raises EchoCancellerUnavailable when it cannot run


# -- the fast paths against what they replace (bit for bit) ------------------------------------
def call_like_drive(aec: EchoCanceller) -> np.ndarray:
    """A fixed, awkward drive: a loud bot (its int16 conversion clips), 20 ms frames and odd
    ones (remainders pass untouched), a gap, an overlapping and an odd-length reference, a
    clear and a silent stretch (the canceller goes off and back on). Every output, joined."""
    bot = bot_voice()[:8000 * 4]
    rng = np.random.default_rng(7)
    echo = np.concatenate([np.zeros(1200), bot])[: len(bot)] * 0.5
    inbound = (echo + rng.normal(0, 0.003, len(bot))).astype(np.float32)
    aec.add_reference(0, bot[:LEAD] * 1.7)
    sizes = [160] * 40 + [240, 80, 160, 100, 60, 320, 480]
    outs, i = [], 0
    for k in range(150):
        n = sizes[k % len(sizes)]
        if k % 37 == 5:
            aec.add_reference(i + LEAD, bot[i + LEAD:i + LEAD + 333].astype(np.float32))
            aec.add_reference(i + LEAD + 100, bot[i + LEAD + 100:i + LEAD + 260])
        elif k % 53 == 7:
            aec.clear_reference_from(i + 800)
        elif not 60 < k < 100:  # bot silent from 60 on: off after hold_ms
            aec.add_reference(i + LEAD, bot[i + LEAD:i + LEAD + n])
        if k == 20:
            i += 160  # a lost packet
        outs.append(np.array(aec.process(i, inbound[i:i + n]), dtype=np.float32))
        i += n
    return np.concatenate(outs)


def test_the_fast_ffi_path_gives_livekits_own_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests built once and sent to livekit's FFI entry point directly (vad/_aec.py
    ``_Module``) give what livekit's ``process_stream``/``process_reverse_stream`` give, sample
    for sample; the installed livekit has what the fast path needs."""
    from vad import _aec

    settings = EchoCancellerSettings(hold_ms=300.0)
    fast = EchoCanceller(settings)
    try:
        assert fast.fast_ffi
        got = call_like_drive(fast)
        assert fast.frames_processed > 200 and fast.frames_bypassed > 20
    finally:
        fast.close()

    def no_internals(self: Any) -> Any:
        raise AttributeError("no FfiClient here")

    monkeypatch.setattr(_aec._Module, "_fast_requests", no_internals)
    public = EchoCanceller(settings)
    try:
        assert not public.fast_ffi
        want = call_like_drive(public)
    finally:
        public.close()
    assert got.dtype == want.dtype and np.array_equal(got, want)
    assert np.abs(got).max() > 0.01  # not silence: the caller's and the echo's residual


def test_the_int16_conversion_is_np_clip_of_np_round() -> None:
    from vad._aec import _to_pcm

    rng = np.random.default_rng(3)
    halves = (np.arange(-40, 40) + 0.5) / 32767  # x * 32767 lands on .5: half to even
    x = np.concatenate([rng.uniform(-1.5, 1.5, 2000), halves, [0.0, -0.0, 1.0, -1.0, 2.0, -2.0]])
    want = np.clip(np.round(x * 32767.0), -32768, 32767).astype(np.int16)
    got = np.empty(len(x), dtype=np.int16)
    _to_pcm(x.copy(), got)
    assert np.array_equal(got, want)


def test_the_audible_spans_are_the_reduceat_blocks() -> None:
    """add_reference's 10 ms block energies (a padded reshape) mark the same audible stretches
    as np.add.reduceat of the squares did, odd lengths and a start inside a block included."""
    rng = np.random.default_rng(4)
    for length, start in ((333, 0), (160, 45), (81, 1000), (1000, 7), (79, 3)):
        x = rng.normal(0, 1e-3, length)
        x[length // 3 : length // 3 + 20] = 0.2  # one loud burst
        aec = EchoCanceller()
        try:
            aec.add_reference(start, x)
            pcm = np.clip(np.round(x * 32767.0), -32768, 32767).astype(np.int16)
            e = pcm.astype(np.float64) ** 2
            nb = -(-len(e) // 80)
            blocks = np.add.reduceat(e, np.arange(0, nb * 80, 80)) / 80
            loud = np.flatnonzero(blocks > (10 ** (-60 / 20) * 32767.0) ** 2)
            want = [[start + int(loud[0]) * 80, min(start + length, start + (int(loud[-1]) + 1) * 80)]]
            assert [list(span) for span in aec._audible] == want
        finally:
            aec.close()


def test_a_closed_canceller_says_so() -> None:
    aec = EchoCanceller()
    aec.add_reference(0, bot_voice()[:1600])
    aec.close()
    aec.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        aec.process(0, np.zeros(160, dtype=np.float32))


def test_the_fast_path_raises_what_the_ffi_refuses() -> None:
    """A module livekit no longer knows (its handle dropped underneath): the FFI answers no
    response, and the fast path raises it instead of passing the frame on untouched."""
    aec = EchoCanceller()
    try:
        assert aec.fast_ffi
        aec.add_reference(0, bot_voice()[:1600])
        aec._module.apm._ffi_handle.dispose()
        with pytest.raises(RuntimeError, match="refused"):
            aec.process(0, np.zeros(160, dtype=np.float32))
    finally:
        aec.close()
