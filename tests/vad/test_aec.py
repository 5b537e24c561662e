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
