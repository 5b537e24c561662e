"""Call recordings that replay: a call that went wrong becomes a regression test.

Opt-in per agent (``recording:`` in the YAML: folder, ``keep_calls``, ``keep_days``).
RECORDINGS HOLD CALLERS' VOICES, and what they said and keyed in (card numbers over DTMF
included): record only where callers have been told and the law allows, and protect the folder.

Each recorded call gets a folder ``<folder>/<UTC time>-<CallSid>/`` whose files share its name
``NAME`` (the layout of ``../shared/recordings``, so the folder can be dropped next to them):

* ``NAME.twilio.jsonl``: every text frame the gateway received on the media socket, in order
  (``connected``, ``start`` without its call token, ``media``, ``dtmf``, ``mark`` echoes,
  ``stop``), as ``callgate replay`` and the scoring tool read them;
* ``NAME.downlink.jsonl``: every event the worker sent (utterances, their audio and text,
  hangup), each with the number of inbound frames received before it (``after``) and its
  media time;
* ``NAME.bot.wav``: what the bot said, on the inbound timeline: each utterance's audio from
  the time its first chunk was to play (8 kHz mu-law), whole even where the caller cut it
  off, as in the dev recordings (a replay of its turns cuts it at the same point);
* ``NAME.events.jsonl``: the call's timeline (the replay contract of docs/architecture.md);
* ``NAME.json``: a labels skeleton in the format of ``../shared/recordings``: the bot's turns
  from what was sent, the caller's speech as the gateway heard it (``unverified``), and
  ``expect`` prefilled from the gateway's own decisions, to be corrected by a person;
* ``NAME.call.json``: the call's SID, agent and the barge-in settings it ran with.

``callgate replay FOLDER`` (:func:`replay_folder`) runs the real :class:`CallSession` on the
recorded inbound frames and downlink events, interleaved as they were, with the recorded
settings: the same barge-in decisions at the same media times. ``callgate replay
FOLDER/NAME.twilio.jsonl --bot-script FOLDER/NAME.json`` replays it as the dev recordings are
(the bot's turns sliced from ``NAME.bot.wav``), which is what ``eval_bargein.py`` scores once
the labels are filled in.

Nothing is written during the call (its frames are kept in memory: ~15 KB per second of
call, for its first ``max_seconds``); the folder is written at the end, off the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
import logging
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar

from audio import write_wav_ulaw

from bus import EventDecodeError
from bus import protocol as bp

from .call import CallSettings
from .timeline import Timeline

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_Settings = TypeVar("_Settings", bound="DataclassInstance")

__all__ = ["CallRecorder", "RecorderState", "RecordingSettings", "load_call_settings", "prune",
           "replay_folder"]

log = logging.getLogger("callgate.recorder")

_FOLDER = re.compile(r"^\d{8}T\d{6}Z-CA[0-9A-Za-z]+$")
SILENCE = 0xFF  # mu-law zero


@dataclass(frozen=True, slots=True)
class RecordingSettings:
    """An agent's ``recording:`` section."""

    folder: Path
    """Each recorded call gets a folder under it."""
    keep_calls: int = 100
    """The newest this many recorded calls are kept; older ones are deleted."""
    keep_days: float = 7.0
    """Recorded calls older than this are deleted."""
    max_seconds: float = 3600.0
    """A call is recorded for its first this many seconds of media (counted in 20 ms inbound
    frames); the rest is not kept (the folder says where it was cut, a warning is logged, and
    its replay says so). A recorded call is held in memory until it ends (~15 KB per second of
    the caller's frames, about twice that while the bot talks: 54-110 MB an hour), so this is
    what bounds it."""


def _strip_token(line: str) -> str:
    """The ``start`` frame without its call token (a credential, useless in a replay)."""
    try:
        obj = json.loads(line)
    except ValueError:
        return line
    if not isinstance(obj, dict) or obj.get("event") != "start":
        return line
    start = obj.get("start")  # a malformed frame (``"start": 1``) is kept as it came
    params = start.get("customParameters") if isinstance(start, dict) else None
    if isinstance(params, dict) and "token" in params:
        params.pop("token")
        return json.dumps(obj, separators=(",", ":"))
    return line


class RecorderState(enum.Enum):
    UNDECIDED = "undecided"  # before `start`: the agent (and whether it records) is unknown
    RECORDING = "recording"  # the call's agent records: everything is kept
    FULL = "full"  # max_seconds reached: what was kept is written at the end, nothing more
    OFF = "off"  # it does not: nothing is kept


class CallRecorder:
    """Records one media socket's call, if its agent records (decided at ``call_started``)."""

    def __init__(self, timeline: Timeline,
                 recording_for: Callable[[str], RecordingSettings | None]) -> None:
        self._recording_for = recording_for
        self._timeline = timeline
        self.settings: RecordingSettings | None = None
        self.state = RecorderState.UNDECIDED
        self._inbound: list[str] = []
        self._downlink: list[tuple[int, float, bp.DownlinkEvent]] = []  # (after, t_ms, event)
        self._events: list[dict[str, Any]] = []
        self._out: list[tuple[str, float, bytes, str]] = []  # ("audio", t, payload, uid)
        self._media_frames = 0  # inbound media frames kept (20 ms each)
        timeline.add_listener(self._on_event)
        timeline.add_downlink_listener(self._on_downlink)

    def inbound(self, text: str) -> None:
        """A text frame from the socket, before the call handles it."""
        if self.state is RecorderState.RECORDING:
            if '"media"' in text:  # cheap: a false hit only makes the cut a frame early
                self._media_frames += 1
                if self.settings is not None and \
                        self._media_frames * 20 > self.settings.max_seconds * 1000:
                    self._full()
                    return
            self._inbound.append(text)
        elif self.state is RecorderState.UNDECIDED:
            self._inbound.append(_strip_token(text))

    def _full(self) -> None:
        assert self.settings is not None
        self.state = RecorderState.FULL
        self._timeline.remove_sampler(self._on_sample)
        log.warning("call recording cut after %.0f s of media (recording.max_seconds); the "
                    "rest of the call is not recorded", self.settings.max_seconds)

    @property
    def truncated(self) -> bool:
        """The call went on past ``max_seconds``: its recording stops there."""
        return self.state is RecorderState.FULL

    def _on_downlink(self, t_ms: float, event: bp.DownlinkEvent) -> None:
        if self.state is RecorderState.RECORDING:
            self._downlink.append((len(self._inbound), t_ms, event))

    def _on_event(self, event: dict[str, Any]) -> None:
        if self.state is RecorderState.UNDECIDED and event["type"] == "call_started":
            self.settings = self._recording_for(str(event.get("agent", "")))
            if self.settings is not None:
                self.state = RecorderState.RECORDING
                self._timeline.add_sampler(self._on_sample)
            else:
                self.state = RecorderState.OFF
                self._inbound.clear()
        if self.state is not RecorderState.RECORDING:
            return
        self._events.append(event)

    def _on_sample(self, sample: dict[str, Any]) -> None:
        if sample["kind"] == "out":
            self._out.append(("audio", float(sample["t_ms"]), bytes(sample["payload"]),
                              str(sample.get("utterance_id", ""))))

    async def finish(self, call_settings: CallSettings) -> Path | None:
        """Write the call's folder (off the event loop) and apply retention; its path."""
        if self.state not in (RecorderState.RECORDING, RecorderState.FULL) or self.settings is None:
            return None
        if self.state is RecorderState.RECORDING:
            self._timeline.remove_sampler(self._on_sample)
        settings = self.settings
        try:
            folder = await asyncio.to_thread(self._write, settings, call_settings)
            await asyncio.to_thread(prune, settings)
        except OSError as exc:
            log.warning("could not write the call recording under %s: %s", settings.folder, exc)
            return None
        log.info("call recorded in %s", folder)
        return folder

    # -- the files -------------------------------------------------------------------------
    def _write(self, settings: RecordingSettings, call_settings: CallSettings) -> Path:
        started = self._events[0]
        call_sid = str(started.get("call_sid", "CA"))
        name = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + call_sid
        folder = settings.folder / name
        folder.mkdir(parents=True, exist_ok=False)
        (folder / f"{name}.twilio.jsonl").write_text("".join(f"{x}\n" for x in self._inbound))
        (folder / f"{name}.downlink.jsonl").write_text("".join(
            json.dumps({"after": after, "t_ms": t_ms, "event": bp.encode(event, text=True)},
                       separators=(",", ":")) + "\n"
            for after, t_ms, event in self._downlink))
        (folder / f"{name}.events.jsonl").write_text(
            "".join(json.dumps(x, separators=(",", ":")) + "\n" for x in self._events))
        duration = max((float(e["t_ms"]) for e in self._events), default=0.0)
        audio, turns = self._bot_audio(duration)
        write_wav_ulaw(folder / f"{name}.bot.wav", audio)
        (folder / f"{name}.json").write_text(json.dumps(
            self._labels(name, duration, turns), indent=1) + "\n")
        (folder / f"{name}.call.json").write_text(json.dumps({
            "call_sid": call_sid, "agent": started.get("agent"),
            "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "settings": dataclasses.asdict(call_settings),
            "truncated_after_s": settings.max_seconds if self.truncated else None,
        }, indent=1, default=_json_value) + "\n")
        return folder

    def _bot_audio(self, duration_ms: float) -> tuple[bytes, list[dict[str, Any]]]:
        """What the bot said on the inbound timeline, and each utterance's span in it: every
        utterance's whole audio (as the worker sent it) from the time its first chunk was to
        play, cut where the next one starts. A barge-in does not cut it here: the replay of the
        turns (``--bot-script``) cuts it again at the same point, as the live call did."""
        starts: dict[str, float] = {}
        for kind, t, _payload, uid in self._out:
            if kind == "audio":
                starts.setdefault(uid, t)
        audio: dict[str, bytearray] = {}
        for _after, _t, ev in self._downlink:
            if isinstance(ev, bp.Audio) and ev.utterance_id in starts:
                audio.setdefault(ev.utterance_id, bytearray()).extend(ev.payload)
        order = sorted(starts, key=lambda u: starts[u])
        spans: list[tuple[str, float, bytes]] = []
        for i, uid in enumerate(order):
            data = bytes(audio.get(uid, b""))
            if i + 1 < len(order):
                data = data[: max(0, int(round((starts[order[i + 1]] - starts[uid]) * 8)))]
            spans.append((uid, starts[uid], data))
        end = max([duration_ms] + [t + len(d) / 8 for _, t, d in spans])
        buf = bytearray([SILENCE]) * int(end * 8)
        info = {e["utterance_id"]: e for e in self._events
                if str(e["type"]).startswith("bot_utterance_")}
        turns = []
        for uid, t, data in spans:
            at = int(round(t * 8))
            buf[at:at + len(data)] = data
            if not data:
                continue
            e = info.get(uid, {})
            turns.append({"text": e.get("text", ""), "start_ms": round(t, 1),
                          "end_ms": round(t + len(data) / 8, 1),
                          "interruptible": e.get("interruptible", True),
                          "node": e.get("node", ""), "utterance_id": uid})
        return bytes(buf), turns

    def _labels(self, name: str, duration_ms: float,
                turns: list[dict[str, Any]]) -> dict[str, Any]:
        speech: list[dict[str, Any]] = []
        opened: float | None = None
        for e in self._events:
            if e["type"] == "speech_started":
                opened = float(e["t_ms"])
            elif e["type"] == "speech_stopped" and opened is not None:
                speech.append({"kind": "speech", "start_ms": opened, "end_ms": float(e["t_ms"]),
                               "text": "", "unverified": True})
                opened = None
            elif (e["type"] == "transcript" and e.get("final", True) and speech
                  and not speech[-1]["text"]):
                speech[-1]["text"] = e.get("text", "")
        clears = [e for e in self._events if e["type"] == "clear_sent" and "onset_ms" in e]
        stops = [e for e in self._events if e["type"] == "barge_in"]
        return {
            "name": name,
            "scenario": "recorded",
            "description": "A recorded call. The caller's speech below is what the gateway "
                           "heard (unverified) and `expect` what it decided: correct both "
                           "against the audio, then score with eval_bargein.py.",
            "duration_ms": round(duration_ms),
            "bot_turns": [{k: v for k, v in t.items() if k != "utterance_id"} for t in turns],
            "events": speech,
            "expect": {
                "barge_in": bool(clears or stops),
                "barge_in_onset_ms": round(float(clears[0]["onset_ms"])) if clears else None,
                "dtmf": "".join(str(e["digit"]) for e in self._events if e["type"] == "dtmf"),
            },
            "set": "recorded",
            "bot_wav": f"{name}.bot.wav",
        }


def prune(settings: RecordingSettings, *, now: float | None = None) -> list[Path]:
    """Delete recorded calls beyond ``keep_calls`` (oldest first) or older than
    ``keep_days``; only folders this module names are touched. Returns those deleted."""
    root = settings.folder
    if not root.is_dir():
        return []
    now = time.time() if now is None else now
    calls = sorted((p for p in root.iterdir() if p.is_dir() and _FOLDER.match(p.name)),
                   key=lambda p: p.name, reverse=True)
    doomed = calls[settings.keep_calls:]
    doomed += [p for p in calls[:settings.keep_calls]
               if now - p.stat().st_mtime > settings.keep_days * 86400]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def _json_value(obj: Any) -> Any:
    """Settings hold enums (``echo_canceller``): written as their value, read back by name."""
    if isinstance(obj, enum.Enum):
        return obj.value
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def load_call_settings(data: dict[str, Any]) -> CallSettings:
    """The settings of ``NAME.call.json`` back as a :class:`CallSettings`: nested settings
    records and enums rebuilt from the field types (a field the file lacks, from a gateway
    older than the field, keeps its default)."""
    return _settings_from(CallSettings, data)


def _settings_from(cls: type[_Settings], data: dict[str, Any]) -> _Settings:
    import typing

    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        value, kind = data[f.name], hints.get(f.name)
        if isinstance(kind, type) and dataclasses.is_dataclass(kind) and isinstance(value, dict):
            value = _settings_from(kind, value)
        elif isinstance(kind, type) and issubclass(kind, enum.Enum):
            value = kind(value)
        elif isinstance(value, list):
            value = tuple(value)  # JSON has no tuples; settings records keep theirs
        kwargs[f.name] = value
    return cls(**kwargs)


def _recorded(folder: Path) -> tuple[str, Path]:
    found = sorted(folder.glob("*.downlink.jsonl"))
    if not found:
        from .replay import ReplayError

        raise ReplayError(f"{folder}: not a recorded call (no NAME.downlink.jsonl)")
    name = found[0].name.removesuffix(".downlink.jsonl")
    return name, folder


async def replay_folder(folder: Path | str, *, events_out: IO[str] | None = None,
                        vad: Any = None, timeline: Timeline | None = None,
                        transcriber_for: Callable[[Any], Any] | None = None) -> Timeline:
    """Replay a recorded call: its inbound frames and the worker's events, interleaved as they
    were, through a real :class:`CallSession` with the call's own settings.
    ``transcriber_for``: speech to text for the caller's turns (inline, so the transcripts
    land on the media clock; they do not change a decision)."""
    from bus import EmbeddedBus, EmbeddedHub
    from vad import VadEngine

    from .call import CallSession
    from .replay import ReplayError

    name, root = _recorded(Path(folder))
    try:
        inbound = (root / f"{name}.twilio.jsonl").read_text().splitlines()
        downlink = [json.loads(x) for x in
                    (root / f"{name}.downlink.jsonl").read_text().splitlines() if x.strip()]
        meta = json.loads((root / f"{name}.call.json").read_text())
        settings = load_call_settings(meta["settings"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ReplayError(f"{root}: cannot read the recorded call: {exc}") from exc
    if meta.get("truncated_after_s") is not None:
        log.warning("%s: the call was recorded for its first %.0f s only (recording.max_seconds); "
                    "the replay ends there", root, float(meta["truncated_after_s"]))
    timeline = timeline or Timeline(sink=events_out)
    engine = vad or VadEngine(runtime="onnx")
    bus = EmbeddedBus(hub=EmbeddedHub())

    async def discard(_text: str) -> None:
        return None

    if vad is None:
        await engine.start()
    await bus.start()
    try:
        session = CallSession(send=discard, bus=bus, vad=engine, settings=settings,
                              timeline=timeline, transcriber_for=transcriber_for,
                              transcribe_inline=True)
        pending = iter(downlink)
        nxt = next(pending, None)
        for n, line in enumerate(inbound, 1):
            if line.strip():
                await session.handle_text(line)
            while nxt is not None and int(nxt["after"]) <= n:
                try:
                    event = bp.decode_downlink(nxt["event"])
                except EventDecodeError as exc:  # a recording from before the protocol
                    log.warning("replay: recorded downlink event skipped: %s", exc)
                else:
                    await session.handle_downlink(event)
                nxt = next(pending, None)
            if session.ended:
                break
        await session.end("replay_finished")
    finally:
        await bus.aclose()
        if vad is None:
            await engine.aclose()
    return timeline
