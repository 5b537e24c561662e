"""``callgate replay``: a recorded call through the real call controller, on the media clock.

The replay stands in for Twilio on both sides of :class:`gateway.call.CallSession` (the code that
serves live calls): it feeds the recording's messages in order, plays the bot's audio on the
media clock, echoes each mark once its audio has played, and on ``clear`` echoes every pending
mark at once, as Twilio does (:class:`gateway.twilio_sim.TwilioPlayout`).

It runs lock-step, as fast as the CPU allows: frame *k* (media ``[t, t+20)``) is handed to the
controller only after the controller has finished with frame *k-1*, so event times depend on the
media clock alone, never on CPU speed. With an agent, "finished" includes the work the frame
started: its speech to text (awaited in the frame) and the session worker's reaction, down to
the gateway having queued the reply's audio (:class:`gateway.lockstep.Lockstep`), and the
agent's timers (the worker's pacing guard, an agent's sleep) run on the media clock
(:class:`gateway.lockstep.MediaClock`), so a loaded machine gives the same timeline as an idle
one. ``realtime=True`` paces it at 1x as well (timers on the wall clock).

``bot_script`` (the labels of a recording) makes the bot speak the labelled ``bot_turns`` at their
times, each with the slice ``[start_ms, end_ms)`` of ``bot_wav`` as its audio, so the echo in the
inbound track matches what the gateway sent. Each turn becomes a downlink utterance
(``turn-N``, node ``bot-script``, ``interruptible`` from the turn, default true).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from audio import TELEPHONY_RATE, ULAW_BYTES_PER_MS, chunk_audio, read_wav_ulaw
from bus import Bus, EmbeddedBus, EmbeddedHub
from bus import protocol as bp

from . import twilio_protocol as tp
from .call import CallSession, CallSettings
from .lockstep import Lockstep, MediaClock
from .timeline import Timeline
from .twilio_sim import TwilioPlayout

__all__ = ["BotTurn", "ReplayError", "load_bot_script", "recording_messages", "replay"]

FRAME_MS = 20
# Hang guard, in wall time, for the work one frame started (an agent stuck in a loop, a thread
# that never returns): reaching it fails the replay; an idle machine settles in milliseconds.
SETTLE_GUARD_S = 120.0


class ReplayError(Exception):
    """The recording or bot script cannot be replayed (the message says which file and why)."""


@dataclass(frozen=True, slots=True)
class BotTurn:
    utterance_id: str
    start_ms: float
    audio: bytes  # 8 kHz mu-law
    interruptible: bool = True
    text: str = ""
    node: str = "bot-script"


def _tone(duration_ms: float) -> bytes:
    """Stand-in bot audio when the labels name no ``bot_wav``: a voiced buzz at -20 dBFS."""
    from audio import float32_to_pcm16, pcm16_to_ulaw

    n = int(duration_ms * ULAW_BYTES_PER_MS)
    t = np.arange(n) / TELEPHONY_RATE
    x = np.zeros(n)
    for k, f in enumerate((140, 280, 420, 560), 1):
        x += np.sin(2 * np.pi * f * t) / k
    x = 0.1 * x / np.max(np.abs(x) + 1e-9) if n else x
    return pcm16_to_ulaw(float32_to_pcm16(np.asarray(x, dtype=np.float32)))


def load_bot_script(path: Path | str | dict[str, Any]) -> list[BotTurn]:
    """Turns of a labels file (or dict); relative ``bot_wav`` names resolve against its folder."""
    if isinstance(path, dict):
        labels, folder = path, Path.cwd()
    else:
        p = Path(path)
        try:
            labels = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ReplayError(f"{p}: cannot read bot script: {exc}") from exc
        folder = p.parent
    bot_audio: bytes | None = None
    if labels.get("bot_wav"):
        wav = Path(labels["bot_wav"])
        if not wav.is_absolute():
            wav = folder / wav
        try:
            bot_audio = read_wav_ulaw(wav)
        except OSError as exc:
            raise ReplayError(f"bot_wav {wav}: {exc}") from exc
    turns = []
    for i, turn in enumerate(labels.get("bot_turns", [])):
        try:
            start, end = float(turn["start_ms"]), float(turn["end_ms"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ReplayError(f"bot_turns[{i}]: needs numeric start_ms and end_ms") from exc
        if end <= start:
            raise ReplayError(f"bot_turns[{i}]: end_ms {end} is not after start_ms {start}")
        if bot_audio is not None:
            audio = bot_audio[int(start * 8) : int(end * 8)]
        else:
            audio = _tone(end - start)
        turns.append(BotTurn(f"turn-{i}", start, audio, bool(turn.get("interruptible", True)),
                             str(turn.get("text", ""))))
    return turns


def recording_messages(path: Path | str) -> Iterator[str]:
    """The Twilio messages of a recording: a ``.twilio.jsonl`` capture as is, or a WAV turned
    into the messages Twilio would have sent (connected, start, 20 ms media, stop)."""
    p = Path(path)
    if p.suffix == ".jsonl":
        try:
            with p.open() as f:
                for line in f:
                    if line.strip():
                        yield line.rstrip("\n")
        except OSError as exc:
            raise ReplayError(f"{p}: {exc}") from exc
        return
    try:
        ulaw = read_wav_ulaw(p)
    except OSError as exc:
        raise ReplayError(f"{p}: {exc}") from exc
    stem = p.name.split(".")[0]
    digest = hashlib.sha256(stem.encode()).hexdigest()
    stream_sid = f"MZ{digest[:32]}"
    call_sid = f"CA{digest[32:64]}"
    account_sid = "AC" + "0" * 32
    yield tp.build_connected()
    yield tp.build_start(sequence_number=1, stream_sid=stream_sid, account_sid=account_sid,
                         call_sid=call_sid, tracks=["inbound"])
    seq = 2
    for chunk, payload in enumerate(chunk_audio(ulaw, chunk_ms=FRAME_MS), 1):
        yield tp.build_media(sequence_number=seq, stream_sid=stream_sid, track="inbound",
                             chunk=chunk, timestamp_ms=(chunk - 1) * FRAME_MS, payload=payload)
        seq += 1
    yield tp.build_stop(sequence_number=seq, stream_sid=stream_sid, account_sid=account_sid,
                        call_sid=call_sid)


async def replay(
    recording: Path | str,
    *,
    bot_script: list[BotTurn] | None = None,
    events_out: IO[str] | None = None,
    settings: CallSettings | None = None,
    realtime: bool = False,
    speed: float = 1.0,
    bus: Bus | None = None,
    vad: Any = None,
    keep_audio: bool = False,
    timeline: Timeline | None = None,
    agent: Callable[[Bus, asyncio.Event], Coroutine[Any, Any, None]] | None = None,
    transcriber_for: Callable[[Any], Any] | None = None,
) -> tuple[Timeline, TwilioPlayout]:
    """Replay one recording; returns the timeline and what the simulated Twilio played.

    ``realtime`` paces frames on the media clock, ``speed`` times faster than 1x; otherwise the
    replay runs lock-step as fast as the CPU allows (the same timeline either way).

    ``agent``: instead of a bot script, a session worker runs on the same bus for the call
    (``agent(bus, stop)`` returns once ``stop`` is set and its calls are done); the gateway
    consumes the call's downlink as it does live. After each frame the replay waits until the
    worker and the gateway have done what the frame caused (:class:`~gateway.lockstep.Lockstep`:
    nothing left to run in the process, no thread work in flight), so the worker answers in
    no media time however loaded the machine is. An agent that waits on another process (an LLM
    across the network) answers in wall time: give it ``realtime``. ``transcriber_for`` gives the
    call its speech to text (``speech.make_transcriber``), as the live gateway does; each
    caller turn is transcribed before the next frame (lock-step), or, with ``realtime``, as the
    live gateway does it: alongside the frames that follow (the media clock goes on meanwhile).

    Raises:
        ReplayError: The recording cannot be read, or the work a frame started was still going
            on after ``SETTLE_GUARD_S`` of wall time.
    """
    from vad import VadEngine

    timeline = timeline or Timeline(sink=events_out)
    own_vad = vad is None
    # One call: batches of one, where ONNX is 2.7x cheaper than TorchScript (bench/vad_throughput).
    engine = VadEngine(runtime="onnx") if own_vad else vad
    own_bus = bus is None
    # A replay's own bus has its own hub: replaying the same recording twice (same call SID)
    # in one process must not meet the first replay's streams.
    the_bus = bus or EmbeddedBus(hub=EmbeddedHub())
    turns = sorted(bot_script or [], key=lambda t: t.start_ms)
    playout: TwilioPlayout | None = None
    stop_agent = asyncio.Event()
    agent_task: asyncio.Task[None] | None = None
    clock: MediaClock | None = None
    downlink_task: asyncio.Task[None] | None = None
    outbox: list[str] = []

    async def send(text: str) -> None:
        outbox.append(text)

    try:
        if own_vad:
            await engine.start()
        if own_bus:
            await the_bus.start()
        # Lock-step: transcribed in the frame that ends the caller's turn (the replay waits).
        session = CallSession(send=send, bus=the_bus, vad=engine, settings=settings,
                              timeline=timeline, transcriber_for=transcriber_for,
                              transcribe_inline=not realtime)
        lockstep = Lockstep.of() if agent is not None else None
        # Lock-step, the agent's timers (the worker's pacing guard among them) run on the
        # media clock: a loaded machine must not make them fire earlier in the call.
        clock = lockstep.media_clock() if lockstep is not None and not realtime else None
        if agent is not None:
            agent_task = asyncio.create_task(agent(the_bus, stop_agent),
                                             context=clock.context() if clock else None)
        t0 = time.monotonic()

        async def deliver(echoes: list[str]) -> None:
            """Hand Twilio's frames to the controller, then route what it sends back."""
            queue = list(echoes)
            while queue or outbox:
                while outbox:
                    if playout is not None:
                        queue.extend(playout.receive(outbox.pop(0), at_ms=session.now_ms))
                    else:
                        outbox.pop(0)
                if queue:
                    await session.handle_text(queue.pop(0))

        async def settle() -> None:
            """Route what the controller sent; with an agent, first let the work started by
            the frames so far finish (it may send more, and the echoes may start more)."""
            await deliver([])
            while lockstep is not None:
                try:
                    await asyncio.wait_for(lockstep.settled(), SETTLE_GUARD_S)
                except TimeoutError as exc:
                    raise ReplayError(
                        f"{recording}: the agent was still busy {SETTLE_GUARD_S:.0f} s after "
                        f"media time {session.now_ms:.0f} ms (a task that never waits?)"
                    ) from exc
                if not outbox:
                    return
                await deliver([])

        for line in recording_messages(recording):
            media_start: float | None = None
            try:
                obj = json.loads(line)
                if obj.get("event") == "media":
                    media_start = float(obj["media"]["timestamp"])
            except (ValueError, KeyError, TypeError, AttributeError):
                media_start = None
            if media_start is not None and clock is not None and clock.advance(media_start / 1000):
                await settle()  # what the agent's timers due by this frame started
            if media_start is not None and playout is not None:
                if realtime:
                    delay = t0 + media_start / 1000 / speed - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                # Marks whose audio has played by now, then bot turns due at this frame
                # boundary (the nearest one to the turn's start).
                await deliver(playout.advance(media_start))
                while turns and turns[0].start_ms <= media_start + FRAME_MS / 2:
                    await _speak(session, turns.pop(0))
                    await deliver([])
            await session.handle_text(line)
            # Let other calls' tasks run between frames, as a network would: replays sharing a
            # VAD engine then batch their windows like live calls do.
            await asyncio.sleep(0)
            if playout is None and session.stream_sid:
                playout = TwilioPlayout(stream_sid=session.stream_sid, keep_audio=keep_audio)
                if agent is not None:
                    downlink_task = asyncio.create_task(session.run_downlink())
            await settle()
            if session.ended:
                break
        if clock is not None:
            clock.close()  # the frames are over: the agent's timers left go to the wall clock
        await session.end("replay_finished")
        if downlink_task is not None:
            downlink_task.cancel()
            await asyncio.gather(downlink_task, return_exceptions=True)
        if agent_task is not None:
            stop_agent.set()
            await asyncio.wait_for(agent_task, 30)
    finally:
        if clock is not None:
            clock.close()
        for task in (downlink_task, agent_task):
            if task is not None and not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if own_bus:
            await the_bus.aclose()
        if own_vad:
            await engine.aclose()
    return timeline, playout or TwilioPlayout(stream_sid="")


async def _speak(session: CallSession, turn: BotTurn) -> None:
    await session.handle_downlink(bp.UtteranceStart(
        utterance_id=turn.utterance_id, node=turn.node, interruptible=turn.interruptible,
        text=turn.text))
    await session.handle_downlink(bp.Audio(utterance_id=turn.utterance_id, payload=turn.audio))
    await session.handle_downlink(bp.UtteranceEnd(utterance_id=turn.utterance_id))
