"""One simulated call: a :class:`Condition` and a seed in, the corpus's files out.

A call is laid out as the development recordings are (../shared/recordings/README.md): the bot
speaks one to three turns (eSpeak NG prompts at -16 dBFS), its echo comes back through the
call's :class:`~linesim._echo.EchoPath`, the caller (a real voice where the split has one, else
eSpeak, labelled as such) talks over it the way the condition's ``behaviour`` says, a background
plays, and the sum goes through line hiss, the telephone band, hard limiting and mu-law.

Everything random is drawn from one ``numpy`` generator seeded by ``(seed, index, split,
condition name)``, so the same arguments give the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np

from . import _noise
from ._dsp import (
    RATE,
    Floats,
    active_level_dbfs,
    band_limit,
    encode_ulaw,
    fit_to_frames,
    set_level,
)
from ._echo import EchoPath, Nonlinearity, impulse_response
from ._sources import (
    BACKCHANNEL_WORDS,
    BOT_PROMPTS,
    CALLER_PHRASES,
    SHORT_WORDS,
    Clip,
    Split,
    VoiceLibrary,
    espeak_clip,
    espeak_voices,
    synthetic_split,
)

__all__ = ["Behaviour", "Background", "Change", "Condition", "ConditionError", "SimCall",
           "simulate_call"]

Change = Literal["none", "level", "delay"]
Background = Literal["quiet", "room_loud", "babble", "tv", "music", "transients", "impacts",
                     "dtmf"]
Behaviour = Literal["barge_in", "early", "second_turn", "short_word", "quiet_caller",
                    "backchannel", "echo_only"]

BOT_LEVEL_DBFS = -16.0
SYNTHETIC_VARIANTS = 16  # variants per synthetic kind; v % 4 == 3 are the check split's


class ConditionError(ValueError):
    """A condition name or value that cannot be simulated (the message says which part)."""


@dataclass(frozen=True, slots=True)
class Condition:
    """One point of the simulator's grid. Its :attr:`name` is its full spec
    (``erl20-d150-none-none-quiet-barge_in``), and :meth:`parse` reads it back."""

    erl_db: float = 20.0
    """Echo return loss (dB): the echo sits this far under the bot's -16 dBFS."""
    delay_ms: float = 150.0
    """Echo path bulk delay (ms)."""
    change: Change = "none"
    """Mid-call path change: ``level`` (ERL 12 dB lower, or higher where that would go under
    6 dB), ``delay`` (250 ms longer, or shorter where that would pass 500 ms)."""
    nonlinearity: Nonlinearity = "none"
    """Loudspeaker: linear, ``tanh`` saturation or hard ``clip``."""
    background: Background = "quiet"
    """``quiet`` (room tone and hiss), ``room_loud`` (-50..-40 dBFS), ``babble`` (5 eSpeak voices,
    10-18 dB under the caller), ``tv`` (a second real talker 15-25 dB under), ``music`` (hold
    music 15-25 dB under), ``transients`` (coughs, laughs, breaths, clicks at -34..-24 dBFS),
    ``impacts`` (the same and knocks or a door at -32..-20 dBFS, in every bot turn), ``dtmf``
    (keys)."""
    behaviour: Behaviour = "barge_in"
    """``barge_in`` anywhere in turn 1, ``early`` (first 200 ms of turn 1), ``second_turn`` (turn 2
    or 3), ``short_word`` ("no", a first word cut out of a real utterance), ``quiet_caller`` (-35
    dBFS), ``backchannel`` (no barge-in), ``echo_only`` (no caller speech at all)."""

    def __post_init__(self) -> None:
        for num in ("erl_db", "delay_ms"):  # 6 and 6.0 are one grid point
            object.__setattr__(self, num, float(getattr(self, num)))
        for f, allowed in (("change", Change), ("nonlinearity", Nonlinearity),
                           ("background", Background), ("behaviour", Behaviour)):
            if getattr(self, f) not in get_args(allowed):
                raise ConditionError(f"{f} must be one of {', '.join(get_args(allowed))}, "
                                     f"got {getattr(self, f)!r}")
        if not 0 <= self.delay_ms <= 500:
            raise ConditionError(f"delay_ms must be in [0, 500], got {self.delay_ms}")
        if not 0 <= self.erl_db <= 60:
            raise ConditionError(f"erl_db must be in [0, 60], got {self.erl_db}")

    @property
    def name(self) -> str:
        return (f"erl{self.erl_db:g}-d{self.delay_ms:g}-{self.change}-{self.nonlinearity}-"
                f"{self.background}-{self.behaviour}")

    @property
    def echo_only(self) -> bool:
        return self.behaviour == "echo_only"

    @classmethod
    def parse(cls, name: str) -> Condition:
        """The condition named ``name`` (as :attr:`name` writes it)."""
        parts = name.split("-")
        if len(parts) != 6 or not parts[0].startswith("erl") or not parts[1].startswith("d"):
            raise ConditionError(
                f"condition {name!r}: expected erl<dB>-d<ms>-<change>-<nonlinearity>-"
                f"<background>-<behaviour>, e.g. erl20-d150-none-none-quiet-barge_in")
        try:
            erl, delay = float(parts[0][3:]), float(parts[1][1:])
        except ValueError:
            raise ConditionError(f"condition {name!r}: erl and delay must be numbers") from None
        # The name's other parts are the fields' literals; __post_init__ checks each against
        # its allowed values (mypy cannot see through the split).
        return cls(erl, delay, *parts[2:])  # type: ignore[arg-type]

    def describe(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class SimCall:
    """A simulated call: its labels and both tracks (8 kHz mu-law)."""

    name: str
    labels: dict[str, Any] = field(repr=False)
    inbound: bytes = field(repr=False)
    bot: bytes = field(repr=False)
    account_sid: str = field(repr=False, default="")
    rest: Floats | None = field(repr=False, default=None, compare=False)
    """Everything on the caller's track but the echo (band-limited, float), for closed-loop
    replays (``bench.robustness``), where the echo follows what the gateway actually played."""
    echo_path: EchoPath | None = field(repr=False, default=None, compare=False)

    def messages(self) -> list[str]:
        """The call as the WebSocket messages Twilio sends (README: connected, start, one media
        per 20 ms, each ``dtmf`` right after the media message whose chunk holds its tone's end,
        stop; ``sequenceNumber`` counts every message after ``connected``)."""
        from gateway import twilio_protocol as tp

        digest = hashlib.sha256(self.name.encode()).hexdigest()
        stream_sid, call_sid = f"MZ{digest[:32]}", f"CA{digest[32:64]}"
        dtmf_after: dict[int, list[str]] = {}
        for ev in self.labels["events"]:
            if ev["kind"] == "dtmf":
                chunk = (int(round(ev["end_ms"] * 8)) - 1) // 160 + 1
                dtmf_after.setdefault(chunk, []).append(ev["digit"])
        out = [tp.build_connected(),
               tp.build_start(sequence_number=1, stream_sid=stream_sid,
                              account_sid=self.account_sid, call_sid=call_sid,
                              tracks=["inbound"])]
        seq = 2
        for c in range(1, len(self.inbound) // 160 + 1):
            out.append(tp.build_media(sequence_number=seq, stream_sid=stream_sid, chunk=c,
                                      timestamp_ms=(c - 1) * 20,
                                      payload=self.inbound[(c - 1) * 160 : c * 160]))
            seq += 1
            for digit in dtmf_after.get(c, []):
                out.append(tp.build_dtmf(sequence_number=seq, stream_sid=stream_sid,
                                         digit=digit))
                seq += 1
        out.append(tp.build_stop(sequence_number=seq, stream_sid=stream_sid,
                                 account_sid=self.account_sid, call_sid=call_sid))
        return out

    def write(self, folder: Path) -> list[Path]:
        """NAME.wav, NAME.bot.wav, NAME.json, NAME.twilio.jsonl in ``folder``."""
        from audio import encode_wav_ulaw

        folder.mkdir(parents=True, exist_ok=True)
        paths = [folder / f"{self.name}{ext}" for ext in (".wav", ".bot.wav", ".json",
                                                          ".twilio.jsonl")]
        paths[0].write_bytes(encode_wav_ulaw(self.inbound))
        paths[1].write_bytes(encode_wav_ulaw(self.bot))
        paths[2].write_text(json.dumps(self.labels, indent=1) + "\n")
        paths[3].write_text("\n".join(self.messages()) + "\n")
        return paths


def _ms(samples: int) -> float:
    return round(samples / 8, 3)


def _loop(x: Floats, n: int, rng: np.random.Generator) -> Floats:
    """``x`` repeated to ``n`` samples from a random offset, joined with 100 ms cross-fades."""
    if len(x) < 1600:
        x = np.tile(x, 1600 // max(1, len(x)) + 1)
    fade = 800
    out = np.zeros(n + len(x))
    start = int(rng.integers(0, len(x)))
    seq = np.concatenate([x[start:], x[:start]])
    pos = 0
    ramp = np.linspace(0.0, 1.0, fade)
    while pos < n:
        seg = seq.copy()
        if pos:
            seg[:fade] *= ramp
        seg[-fade:] *= ramp[::-1]
        out[pos : pos + len(seg)] += seg
        pos += len(seg) - fade
    return out[:n]


class _Mix:
    """The call being assembled: components on one timeline, and its labels."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.caller = np.zeros(n)
        self.background = np.zeros(n)
        self.events: list[dict[str, Any]] = []

    def grow(self, n: int) -> None:
        if n > self.n:
            self.caller = np.concatenate([self.caller, np.zeros(n - self.n)])
            self.background = np.concatenate([self.background, np.zeros(n - self.n)])
            self.n = n

    def place(self, track: Floats, x: Floats, at: int) -> None:
        a, b = max(0, at), min(self.n, at + len(x))
        if b > a:
            track[a:b] += x[a - at : b - at]


def _bot_turns(cond: Condition, split: Split, rng: np.random.Generator
               ) -> tuple[str, list[tuple[int, Clip]]]:
    voice = str(rng.choice(espeak_voices("bot", split)))
    n_turns = {"second_turn": int(rng.integers(2, 4)), "echo_only": int(rng.integers(1, 4))
               }.get(cond.behaviour, int(rng.integers(1, 3)))
    prompts = rng.permutation(len(BOT_PROMPTS))[:n_turns]
    t = int(rng.uniform(400, 900)) * 8  # turns start on a whole ms
    turns = []
    for p in prompts:
        clip = espeak_clip(voice, BOT_PROMPTS[int(p)])
        turns.append((t - clip.onset, clip))
        t += (clip.end - clip.onset) // 8 * 8 + int(rng.uniform(1200, 2500)) * 8
    return voice, turns


def _caller_clip(cond: Condition, split: Split, lib: VoiceLibrary, rng: np.random.Generator
                 ) -> Clip:
    real = lib.speech[split]
    if cond.behaviour == "short_word":
        if real and rng.random() < 0.7:
            return lib.short_cut(real[int(rng.integers(len(real)))])
        return espeak_clip(str(rng.choice(espeak_voices("caller", split))),
                           str(rng.choice(SHORT_WORDS)))
    if real and rng.random() < 0.75:
        return real[int(rng.integers(len(real)))]
    return espeak_clip(str(rng.choice(espeak_voices("caller", split))),
                       str(rng.choice(CALLER_PHRASES)))


def _speech_event(kind: str, clip: Clip, at: int, gain_db: float) -> dict[str, Any]:
    ev: dict[str, Any] = {
        "kind": kind, "start_ms": _ms(at + clip.onset), "end_ms": _ms(at + clip.end),
        "core_onset_ms": _ms(at + clip.core_onset),
    }
    if clip.text:
        ev["text"] = clip.text
    ev.update({"source": clip.source, "voice": clip.voice,
               "level_dbfs": round(clip.level_dbfs + gain_db, 1)})
    if clip.cut_from:
        ev["cut_from"] = clip.cut_from
    if clip.segments:
        ev["segments_ms"] = [[_ms(at + a), _ms(at + b)] for a, b in clip.segments]
    return ev


def simulate_call(cond: Condition, *, split: Split, seed: int, index: int,
                  library: VoiceLibrary | None = None, name: str | None = None) -> SimCall:
    """Call ``index`` of ``(split, seed)`` under ``cond``; the same arguments, the same bytes."""
    if split not in ("train", "check"):
        raise ConditionError(f"split must be train or check, got {split!r}")
    lib = library or VoiceLibrary()
    key = zlib.crc32(cond.name.encode())
    rng = np.random.default_rng([seed, index, 0 if split == "train" else 1, key])
    name = name or f"sim_{split}_s{seed}_{index:05d}"

    # The bot's turns on the timeline, at -16 dBFS.
    bot_voice, turns = _bot_turns(cond, split, rng)
    last = turns[-1][0] + len(turns[-1][1].samples)
    mix = _Mix(last + 4 * RATE)
    bot = np.zeros(mix.n)
    bot_labels: list[dict[str, Any]] = []
    for at, clip in turns:
        y = set_level(clip.samples, BOT_LEVEL_DBFS)
        bot[at : at + len(y)] += y
        bot_labels.append({"text": clip.text, "start_ms": _ms(at + clip.onset),
                           "end_ms": _ms(at + clip.end), "voice": clip.source})

    # The caller.
    caller_level = -35.0 if cond.behaviour == "quiet_caller" else float(rng.uniform(-25, -19))
    bed: Clip | None = None
    bed_gain_db = 0.0
    speech_spans: list[tuple[int, int]] = []
    if cond.behaviour not in ("echo_only", "backchannel"):
        clip = _caller_clip(cond, split, lib, rng)
        if cond.behaviour == "second_turn":
            turn_i = int(rng.integers(1, len(turns)))
        else:
            turn_i = 0
        t_start = int(bot_labels[turn_i]["start_ms"] * 8)
        t_end = int(bot_labels[turn_i]["end_ms"] * 8)
        if cond.behaviour == "early":
            onset = t_start + int(rng.uniform(0, 200) * 8)
        else:
            onset = int(rng.uniform(t_start, max(t_start + 1, t_end - 400 * 8)))
        onset = onset // 8 * 8  # on an exact ms
        at = onset - clip.onset
        gain_db = caller_level - clip.level_dbfs
        mix.grow(at + len(clip.samples) + RATE)
        mix.place(mix.caller, clip.samples * 10 ** (gain_db / 20), at)
        mix.events.append(_speech_event("speech", clip, at, gain_db))
        if clip.bed is not None:  # a real clip: its own room tone comes with it
            speech_spans.append((at, at + len(clip.samples)))
            bed, bed_gain_db = clip, gain_db
    elif cond.behaviour == "backchannel":
        for turn_i in range(len(turns)):
            if turn_i > 0 and rng.random() < 0.5:
                continue
            real = lib.backchannel[split]
            if real and rng.random() < 0.5:
                clip = real[int(rng.integers(len(real)))]
            else:
                clip = espeak_clip(str(rng.choice(espeak_voices("caller", split))),
                                   str(rng.choice(BACKCHANNEL_WORDS)))
            t_start = int(bot_labels[turn_i]["start_ms"] * 8)
            t_end = int(bot_labels[turn_i]["end_ms"] * 8)
            onset = int(rng.uniform(t_start + 800 * 8, max(t_start + 801 * 8, t_end - 800 * 8)))
            onset = onset // 8 * 8
            at = onset - clip.onset
            gain_db = caller_level - clip.level_dbfs
            mix.place(mix.caller, clip.samples * 10 ** (gain_db / 20), at)
            mix.events.append(_speech_event("backchannel", clip, at, gain_db))
            if clip.bed is not None:
                speech_spans.append((at, at + len(clip.samples)))
                if bed is None:
                    bed, bed_gain_db = clip, gain_db

    # Duration: the bot's turns, their last echo and the caller, plus a little, in whole 20 ms
    # frames (background bursts and keys are placed inside bot turns).
    ends = [int(b["end_ms"] * 8) for b in bot_labels] + [int(e["end_ms"] * 8) for e in mix.events]
    delay_max = max(cond.delay_ms, _changed(cond)[1])
    n = fit_to_frames(max(ends) + int((delay_max + 700) * 8))
    mix.grow(n)
    bot = np.concatenate([bot, np.zeros(max(0, mix.n - len(bot)))])[:n]

    # The caller's room: the real clip's own room tone, else one of the split's room tones.
    rooms = lib.room_tone[split]
    if bed is not None and bed.bed is not None:
        tone, tone_gain, tone_src = bed.bed, bed_gain_db, (bed.source, bed.voice)
    elif rooms:
        r = rooms[int(rng.integers(len(rooms)))]
        tone, tone_gain, tone_src = r.samples, 0.0, (r.source, r.voice)
    else:
        tone = None
    if tone is not None:
        y = _loop(tone, mix.n, rng) * 10 ** (tone_gain / 20)
        keep = np.ones(mix.n)
        # Real clips carry their own room tone: the bed fades out under them (no doubling, no
        # step); eSpeak clips are silent around the voice and get the bed throughout.
        for a, b in speech_spans:
            a, b = max(0, a), min(mix.n, b)
            keep[a:b] = 0.0
            ramp = min(240, (b - a) // 2)
            keep[a : a + ramp] = np.linspace(1.0, 0.0, ramp)
            keep[b - ramp : b] = np.linspace(0.0, 1.0, ramp)
        mix.background += y * keep
        mix.events.append({"kind": "noise", "noise_type": "caller_room_tone", "start_ms": 0.0,
                           "end_ms": _ms(n), "source": tone_src[0], "voice": tone_src[1],
                           "level_dbfs": round(active_level_dbfs(y[:n]), 1)})

    _background(cond, split, lib, rng, mix, bot_labels, caller_level, n)

    # The echo path.
    change_ms = None
    if cond.change != "none":
        turn0 = bot_labels[0]
        if len(bot_labels) > 1 and rng.random() < 0.5:  # between turns 1 and 2
            change_ms = round((turn0["end_ms"] + bot_labels[1]["start_ms"]) / 2)
        else:  # in the middle of turn 1
            change_ms = round(float(rng.uniform(turn0["start_ms"] + 1500,
                                                max(turn0["start_ms"] + 1501,
                                                    turn0["end_ms"] - 1000))))
    erl_after, delay_after = _changed(cond)
    path = EchoPath(
        erl_db=cond.erl_db, delay_ms=cond.delay_ms, nonlinearity=cond.nonlinearity,
        drive_db=float(rng.uniform(6, 12)), ir=tuple(impulse_response(rng)),
        change_ms=change_ms, erl_after_db=erl_after if change_ms is not None else None,
        delay_after_ms=delay_after if change_ms is not None else None)
    echo = path.render(bot)
    for label in bot_labels:
        ev: dict[str, Any] = {
            "kind": "echo", "start_ms": round(label["start_ms"] + cond.delay_ms, 3),
            "end_ms": round(label["end_ms"] + (delay_after if change_ms is not None else
                                               cond.delay_ms), 3),
            "source": label["voice"], "delay_ms": cond.delay_ms, "erl_db": cond.erl_db,
            "level_dbfs": round(BOT_LEVEL_DBFS - cond.erl_db, 1), "text": label["text"],
            "nonlinearity": cond.nonlinearity,
        }
        if change_ms is not None:
            ev["path_change"] = {"t_ms": float(change_ms), "delay_ms": delay_after,
                                 "erl_db": erl_after}
        mix.events.append(ev)

    # Line hiss, the band, mu-law.
    hiss_db = float(rng.uniform(-69, -63))
    hiss = rng.standard_normal(n)
    hiss = band_limit(hiss)
    hiss *= 10 ** (hiss_db / 20) / (np.sqrt(np.mean(hiss**2)) + 1e-12)
    rest = band_limit(mix.caller[:n] + mix.background[:n]) + hiss
    line = rest + band_limit(echo)
    inbound = encode_ulaw(line)
    outbound = encode_ulaw(bot)

    events = sorted(mix.events, key=lambda e: (e["start_ms"], e["kind"]))
    speech = [e for e in events if e["kind"] == "speech"]
    barge = [e["start_ms"] for e in speech
             if any(b["start_ms"] <= e["start_ms"] < b["end_ms"] for b in bot_labels)]
    digits = "".join(e["digit"] for e in events if e["kind"] == "dtmf")
    scenario = {"echo_only": "echo", "backchannel": "backchannel"}.get(cond.behaviour,
                                                                        "barge_in")
    labels = {
        "name": name,
        "scenario": scenario,
        "description": f"Simulated call, condition {cond.name}.",
        "duration_ms": n // 8,
        "bot_turns": bot_labels,
        "events": events,
        "expect": {"barge_in": bool(barge), "barge_in_onset_ms": min(barge) if barge else None,
                   "dtmf": digits},
        "line_noise_dbfs": round(hiss_db, 1),
        "set": split,
        "bot_wav": f"{name}.bot.wav",
        "condition": cond.name,
        "condition_params": cond.describe(),
        "simulator": {"seed": seed, "index": index, "bot_voice": f"espeak-ng:{bot_voice}"},
    }
    account = "AC" + hashlib.sha256(f"linesim:{seed}".encode()).hexdigest()[:32]
    return SimCall(name=name, labels=labels, inbound=inbound, bot=outbound, account_sid=account,
                   rest=rest, echo_path=path)


def _changed(cond: Condition) -> tuple[float, float]:
    """ERL and delay after the condition's path change (the same when there is none)."""
    erl, delay = cond.erl_db, cond.delay_ms
    if cond.change == "level":
        erl = erl - 12 if erl - 12 >= 6 else erl + 12
    elif cond.change == "delay":
        delay = delay + 250 if delay + 250 <= 500 else delay - 250
    return erl, delay


def _synthetic_variant(kind: str, split: Split, rng: np.random.Generator) -> int:
    choices = [v for v in range(SYNTHETIC_VARIANTS) if synthetic_split(v) == split]
    return int(rng.choice(choices))


def _bursts(mix: _Mix, turn: dict[str, Any], count: int, kinds: list[str],
            levels: tuple[float, float], split: Split, rng: np.random.Generator) -> None:
    """``count`` synthetic bursts of ``kinds`` somewhere in the bot's ``turn``, each at an active
    level in ``levels`` (a breath in the 8 dB under them), labelled with its extent and peak."""
    for _ in range(count):
        kind = str(rng.choice(kinds))
        v = _synthetic_variant(kind, split, rng)
        level = float(rng.uniform(*levels)) if kind != "breath" else float(
            rng.uniform(levels[0] - 8, levels[0]))
        x = set_level(_noise.synthetic(kind, v), level)
        lo = int(turn["start_ms"] * 8)
        at = int(rng.uniform(lo, max(lo + 1, int(turn["end_ms"] * 8) - len(x))))
        mix.place(mix.background, x, at)
        a, b = _noise.burst_extent(x)
        peak = 20 * np.log10(max(float(np.max(np.abs(x))), 1e-9))
        mix.events.append({"kind": "noise", "noise_type": kind, "start_ms": _ms(at + a),
                           "end_ms": _ms(at + b), "source": f"synthetic:{kind}#{v}",
                           "peak_dbfs": round(float(peak), 1)})


def _background(cond: Condition, split: Split, lib: VoiceLibrary, rng: np.random.Generator,
                mix: _Mix, bot_labels: list[dict[str, Any]], caller_level: float, n: int) -> None:
    bg = cond.background
    if bg == "quiet":
        return
    if bg == "room_loud":
        v = _synthetic_variant("room", split, rng)
        level = float(rng.uniform(-50, -40))
        y = set_level(_loop(_noise.synthetic("room", v, 6000), n, rng), level)
        mix.background[:n] += y
        mix.events.append({"kind": "noise", "noise_type": "room", "start_ms": 0.0,
                           "end_ms": _ms(n), "source": f"synthetic:room#{v}",
                           "level_dbfs": round(level, 1)})
    elif bg == "babble":
        voices = [str(name) for name in rng.permutation(espeak_voices("babble", split))[:5]]
        y = np.zeros(n)
        for talker in voices:
            text = " ".join(BOT_PROMPTS[int(i)] for i in rng.permutation(len(BOT_PROMPTS))[:2])
            clip = espeak_clip(talker, text, rate_wpm=int(rng.integers(150, 190)))
            y += _loop(set_level(clip.samples, -20.0), n, rng)
        snr = float(rng.uniform(10, 18))
        level = caller_level - snr
        y = set_level(y, level)
        mix.background[:n] += y
        mix.events.append({"kind": "noise", "noise_type": "babble", "start_ms": 0.0,
                           "end_ms": _ms(n), "source": "espeak-ng:" + ",".join(voices),
                           "level_dbfs": round(level, 1), "snr_db": round(snr, 1)})
    elif bg in ("tv", "music"):
        under = float(rng.uniform(15, 25))
        level = caller_level - under
        if bg == "tv":
            caller_voices = {e.get("voice") for e in mix.events if e["kind"] == "speech"}
            pool = [c for c in lib.speech[split] if c.voice not in caller_voices]
            if pool:
                c = pool[int(rng.integers(len(pool)))]
                x, src, voice = c.samples, c.source, c.voice
            else:
                talker = str(rng.choice(espeak_voices("babble", split)))
                c = espeak_clip(talker, " ".join(CALLER_PHRASES))
                x, src, voice = c.samples, c.source, c.voice
            y = set_level(_loop(x, n, rng), level)
            ev = {"kind": "noise", "noise_type": "second_talker", "start_ms": 0.0,
                  "end_ms": _ms(n), "source": src, "voice": voice}
        else:
            v = _synthetic_variant("music", split, rng)
            y = set_level(_loop(_noise.synthetic("music", v, 8000), n, rng), level)
            ev = {"kind": "noise", "noise_type": "music", "start_ms": 0.0, "end_ms": _ms(n),
                  "source": f"synthetic:music#{v}"}
        mix.background[:n] += y
        ev.update({"level_dbfs": round(level, 1), "under_caller_db": round(under, 1)})
        mix.events.append(ev)
    elif bg == "transients":
        _bursts(mix, bot_labels[0], int(rng.integers(2, 5)), ["cough", "laugh", "breath", "click"],
                (-34, -24), split, rng)
    elif bg == "impacts":
        # Bursts in every bot turn, knocks and a door among them, up to 4 dB louder than
        # ``transients`` (the development set's cough and door slam: -26.5 and -22.9 dBFS
        # active, peaks -8 and -6): on a weak echo they stand 20-30 dB over it, as a caller does.
        for turn in bot_labels:
            _bursts(mix, turn, int(rng.integers(1, 4)), ["cough", "laugh", "knock", "click",
                                                         "breath"], (-32, -20), split, rng)
    elif bg == "dtmf":
        turn = bot_labels[int(rng.integers(len(bot_labels)))]
        count = int(rng.choice([1, 1, 2, 4]))
        lo = int((turn["start_ms"] + 300) * 8)
        at = int(rng.uniform(lo, max(lo + 1, int((turn["end_ms"] - 1500) * 8))))
        at = at // 8 * 8
        for _ in range(count):
            digit = str(rng.choice(list("0123456789*#")))
            dur = float(rng.choice([70, 100, 120]))
            x = _noise.dtmf_tone(digit, dur)
            mix.place(mix.background, x, at)
            mix.events.append({"kind": "dtmf", "digit": digit, "start_ms": _ms(at),
                               "end_ms": _ms(at + len(x)), "source": "synthetic"})
            at += len(x) + int(rng.uniform(70, 250)) * 8
