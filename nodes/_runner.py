"""The worker process: a ``SessionWorker`` running the agents of the YAML until told to stop.

::

    holder = ConfigHolder()
    async with make_bus(holder.current.bus.redis_url) as bus:
        await run_worker(holder, bus, stop=stop_event)

Each call gets the agent of the config in force when it starts (``agent_factory_from_config``).
On ``stop`` the worker claims no more calls, lets the calls in progress finish for up to
``drain_timeout_s`` (what each one still going was doing is logged then), then cancels the rest:
their conversation is saved and their unacked events stay pending, so once the bus closes (``EmbeddedBus`` and ``RedisBus`` hand the calls they own
back to the pool in ``aclose``) another worker claims them and goes on. The cancelling takes at
most ``SessionWorker.aclose``'s grace (5 s): a call that does not stop by then is abandoned and
logged with what it awaits. ``run_worker`` leaves the bus open: its owner closes it.

Text to speech: ``SessionWorker`` takes one synthesizer for all its calls, so the worker speaks
with the TTS of the config's ``default_agent`` (``synthesizer_for``).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import Callable
from typing import Any, cast

from bus import Bus
from config import AgentConfig, ConfigHolder

from ._agents import agent_factory_from_config
from ._tts import Synthesizer, ToneSynthesizer
from ._worker import SessionWorker

__all__ = ["run_worker", "synthesizer_for"]

logger = logging.getLogger(__name__)

# eSpeak NG's default rate and the range speech.EspeakSynthesizer accepts (words a minute)
_ESPEAK_WPM, _ESPEAK_MIN_WPM, _ESPEAK_MAX_WPM = 165, 80, 450


def _tts_options(agent_cfg: AgentConfig) -> dict[str, Any]:
    """The options of ``speech.make_synthesizer`` that the agent's ``tts`` section sets."""
    tts = agent_cfg.tts
    if tts.provider == "espeak":
        options: dict[str, Any] = {"voice": tts.voice}
        if tts.speed != 1.0:
            wpm = round(_ESPEAK_WPM * tts.speed)
            options["rate_wpm"] = min(_ESPEAK_MAX_WPM, max(_ESPEAK_MIN_WPM, wpm))
        ignored = [k for k in ("model", "base_url", "api_key") if getattr(tts, k) is not None]
        if ignored:
            logger.warning("agent %s: espeak takes no %s; ignored", agent_cfg.name,
                           ", ".join(ignored))  # fmt: skip
    else:
        options = {
            "model": tts.model,
            "voice": tts.voice,
            "api_key": tts.api_key.get_secret_value() if tts.api_key is not None else None,
            "base_url": tts.base_url,
        }
        if tts.speed != 1.0:
            options["speed"] = tts.speed
    return {key: value for key, value in options.items() if value is not None}


def synthesizer_for(agent_cfg: AgentConfig) -> Synthesizer:
    """The agent's text to speech: ``speech.make_synthesizer(tts.provider, **options)``.

    The options are those the YAML sets: for ``openai`` ``model``, ``voice``, ``api_key``,
    ``base_url`` and ``speed`` (when not 1); for ``espeak`` ``voice``, and ``speed`` as
    ``rate_wpm`` (eSpeak's 165 words a minute times ``speed``). Without a usable ``speech``
    package (not installed, or without ``make_synthesizer``) the agent speaks
    ``ToneSynthesizer`` test tones, with a warning.

    Raises:
        speech.SpeechError: the provider refuses the options or cannot be loaded.
    """
    tts = agent_cfg.tts
    try:
        speech: Any = importlib.import_module("speech")
    except ImportError as exc:
        logger.warning("agent %s: no speech package (%s); speaking test tones instead of %s TTS",
                       agent_cfg.name, exc, tts.provider)  # fmt: skip
        return ToneSynthesizer()
    make = getattr(speech, "make_synthesizer", None)
    if not callable(make):
        logger.warning("agent %s: the speech package has no make_synthesizer; speaking test "
                       "tones instead of %s TTS", agent_cfg.name, tts.provider)  # fmt: skip
        return ToneSynthesizer()
    return cast(Synthesizer, make(tts.provider, **_tts_options(agent_cfg)))


async def run_worker(
    holder: ConfigHolder,
    bus: Bus,
    *,
    worker_id: str | None = None,
    synthesizer_factory: Callable[[AgentConfig], Synthesizer] | None = None,
    twilio_client: Any = None,
    stop: asyncio.Event | None = None,
    drain_timeout_s: float | None = 10.0,
    started: asyncio.Event | None = None,
) -> None:
    """Run a ``SessionWorker`` for the agents of ``holder`` until ``stop`` is set.

    Args:
        holder: The config; each call uses the one in force when it starts.
        bus: The bus shared with the gateways (left open on return).
        worker_id: This worker's consumer name on the bus (default: host, pid, random).
        synthesizer_factory: ``agent -> Synthesizer`` (default: :func:`synthesizer_for`); the
            worker speaks with the default agent's.
        twilio_client: A ``twilio.rest.Client`` to end and transfer calls with.
        stop: Set it to stop; None: run until cancelled or the bus ends.
        drain_timeout_s: After ``stop``, how long the calls in progress may go on before they
            are handed back; None waits for them to end.
        started: Set once the worker is built (agents, speech) and claiming calls: a process
            that runs one can fail its start-up, not its first call, when it cannot be built.

    Raises:
        BusError: the bus failed (the worker is closed first).
    """
    factory = agent_factory_from_config(holder, synthesizer_factory=synthesizer_factory)
    cfg = holder.current
    synthesizer = factory.synthesizer_for_agent(cfg.agents[cfg.default_agent])
    worker = SessionWorker(
        bus,
        agent_factory=factory,
        worker_id=worker_id,
        synthesizer=synthesizer,
        synthesizer_factory=factory.synthesizer,
        twilio_client=twilio_client,
        lookahead_for=lambda call: factory.agent_for(call).tts.lookahead_ms,
    )
    logger.info("worker %s: serving agents %s", worker.worker_id, ", ".join(cfg.agents))
    loop = asyncio.get_running_loop()
    claiming = loop.create_task(worker.run(), name=f"worker:{worker.worker_id}")
    if started is not None:
        started.set()
    stopping = loop.create_task(stop.wait()) if stop is not None else None
    try:
        waiting = {claiming} if stopping is None else {claiming, stopping}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if claiming.done():
            claiming.result()  # the bus ended: raise what ended it
            return
        claiming.cancel()
        await asyncio.wait({claiming})
        await _drain(worker, drain_timeout_s)
    finally:
        for task in (claiming, stopping):
            if task is not None and not task.done():
                task.cancel()
                await asyncio.wait({task})
        # What is left: cancelled, its conversation saved; within a bounded grace whatever the
        # calls are doing (a call that will not stop is abandoned, logged with its stack).
        abandoned = await worker.aclose()
        if abandoned:
            logger.error("worker %s: stopped, abandoning %d calls that did not stop: %s",
                         worker.worker_id, len(abandoned), ", ".join(abandoned))  # fmt: skip
        else:
            logger.info("worker %s: stopped", worker.worker_id)


async def _drain(worker: SessionWorker, timeout_s: float | None) -> None:
    calls = list(worker.sessions)
    if not calls:
        return
    if timeout_s == 0:
        logger.info("worker %s: handing %d calls back", worker.worker_id, len(calls))
        return
    logger.info("worker %s: waiting for %d calls to end", worker.worker_id, len(calls))
    joins = {asyncio.get_running_loop().create_task(worker.join(sid)): sid for sid in calls}
    _, pending = await asyncio.wait(joins, timeout=timeout_s)
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending)
        logger.warning("worker %s: handing %d calls back", worker.worker_id, len(pending))
        # What each was doing when the drain ran out (a call that never ends, or a stuck one).
        doing = worker.describe_calls()
        for task in pending:
            sid = joins[task]
            logger.info("worker %s: call %s still going at the drain timeout: %s",
                        worker.worker_id, sid, doing.get(sid, "done"))  # fmt: skip
