"""SessionWorker: runs the agent of every call this worker claims from the bus.

For each call the worker builds an ``AgentSession``, runs the agent's ``setup(session)`` in a task,
and once setup awaits ``session.wait_until_complete()`` it restores any saved conversation and
starts two loops: uplink events become SDK events, and the graph's output becomes downlink
utterances.

The events and their fields are the records of ``bus.protocol``; each uplink message is decoded
there, and one that does not decode (malformed, of an unknown type or another major version) is
logged and acked, never fed to the graph. Uplink (gateway -> worker):

* ``CallStarted`` -> ``system.user.joined`` (an output node with ``greeting`` speaks it)
* ``Transcript`` with ``final`` -> ``agent.transcript.update`` (role user; each output node adds
  it to its context) and ``system.llm.request``; ``replaces_previous`` drops the last user turn
* ``Interrupt`` -> the cut described below, then ``SDKSystemControlInterruptEvent``
* ``SpeechStarted`` / ``SpeechStopped`` -> ``system.user.started_speaking`` / ``stopped_speaking``
* ``Dtmf`` -> ``system.user.dtmf`` (``SDKSystemUserDTMFEvent``)
* ``Playback``: what the caller has heard of an utterance; with a lookahead it paces the
  responses (below); ``interrupted`` with nothing heard cuts an interruptible utterance the
  worker has not cut yet (one the gateway dropped as the answer to a turn it had cancelled)
  and cancels its generation when its node is still in it with nothing queued
* ``CallEnded`` -> the session stops; ``InterruptSuppressed`` is acked only.

A call lost to another worker (this one stalled past its lease and the bus says
``OwnershipLostError``) stops here: the session is stopped, logged, and nothing more is sent,
acked or saved for it; Twilio REST effects are done only while ``bus.holds(call_sid)``.

Each message is acked once what the agent did about it is on the downlink (its ``Reaction``,
``nodes._reactions``: a key press once its spoken answer is sent); an ``eid`` seen before is
acked and dropped. An utterance an uplink event caused is named after its eid and its downlink
events after the utterance, so a worker that takes the call over and answers an unacked event
again re-sends the same eids, which the gateway's downlink drops. A final transcript is acked
only once its answer is out; once an output node has put the user message into its context the
conversation is saved with the transcript listed as ``answering``, and a worker that takes the
call over with that transcript unacked takes the turn out of the context (with what it holds of
the old answer) and handles it again.

Downlink (worker -> gateway), one utterance per response (or ``speak``) of an output node:
``UtteranceStart`` (``text`` only for ``speak``, where the whole text is known up front;
``reply_to``, the eid of the uplink event whose reaction made it), an
``Audio`` per synthesized piece (with the chunk of text it speaks and where), ``UtteranceEnd``
(with everything synthesized); ``Hangup`` and ``Transfer`` when a node emits ``agent.end_call``
or ``agent.transfer_call``, and the worker also ends or redirects the call through Twilio's REST
API when it was given a Twilio client.

Barge-in: for an ``interrupt`` naming an utterance of an interruptible node, the worker stops
sending that utterance's audio, cuts the assistant message the node keeps in its context to what
the caller heard, cuts later interruptible utterances (queued behind it, never heard) to nothing,
pushes ``SDKSystemControlInterruptEvent`` into the graph, which cancels the node's generation (its
LLM stream and unfinished tools included), and saves the conversation. Output that an interrupted
node emitted before the interrupt but that has not started playing (a response queued behind the
interrupted one) is dropped and cut from the context too. ``heard_ms`` maps to
text as described in ``nodes._alignment``: by the audio duration of each chunk, proportionally by
characters within a chunk, cut back to a word boundary. The gateway's ``heard_text`` (the same
rule on the text spans of the ``audio`` events it got) is used only without ``heard_ms``; with
neither, everything sent counts as heard. An ``interrupt`` naming an
utterance of a node with ``is_interruptible=False`` (the gateway sends ``interrupt_suppressed``
instead, so this is a gateway bug) is logged and dropped: nothing is cancelled or cut, and the
graph never sees it. An ``interrupt`` naming an unknown utterance still cancels the interruptible
generations but cuts nothing.

Pacing (``lookahead_ms``, per agent ``tts.lookahead_ms`` in YAML): a node never runs ahead of
what the caller hears. The first chunk of a response is pulled at once; each next one (the
generator's code after its last ``yield``) only once the previous chunks have been spoken and
the audio sent for the utterance is at most ``lookahead_ms`` ahead of the ``heard_ms`` the
gateway reported, so at a barge-in the node's state is that of the chunk the caller was hearing
(or, in the last ``lookahead_ms`` of it, of the next).

Persistence: after every response ends, after every cut and after each applied transcript, the
worker saves ``{"version": 1, "nodes": {name: messages}, "last_eid", "through", "handled_eids",
"answering"}``
with ``bus.save_context(call_sid, snapshot, through=...)``, ``through`` being the last uplink
message id up to which every message is reflected in the snapshot (a transcript not yet applied
holds it back); a worker that claims a call with a saved conversation restores each output
node's context by node name and skips the handled eids.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import importlib
import itertools
import logging
import os
import socket
import uuid
import weakref
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, cast

from audio import ULAW_BYTES_PER_MS
from bus import Bus, BusUnavailableError, CallInfo, Event, EventDecodeError, OwnershipLostError
from bus import protocol as bp

from ._alignment import UtteranceAlignment
from ._call_control import CallControl, TwilioCallControl
from ._errors import AgentLoadError, CallControlError
from ._events import (
    ConversationType,
    SDKAgentEndCallEvent,
    SDKAgentErrorEvent,
    SDKAgentLLMResponseChunkEvent,
    SDKAgentLLMResponseEndEvent,
    SDKAgentSpeakEvent,
    SDKAgentTranscriptUpdateEvent,
    SDKAgentTransferConversationEvent,
    SDKEvent,
    SDKSystemControlInterruptEvent,
    SDKSystemInitEvent,
    SDKSystemLLMRequestEvent,
    SDKSystemUserDTMFEvent,
    SDKSystemUserJoinedEvent,
    SDKSystemUserStartedSpeakingEvent,
    SDKSystemUserStoppedSpeakingEvent,
    SessionContext,
)
from ._node import Node
from ._output_agent import OutputAgentNode
from ._session import AgentSession, SessionState
from ._stacks import await_chain
from ._reactions import Reaction, tag
from ._tts import Synthesizer, ToneSynthesizer
from ._turns import drop_last_user_turn

__all__ = ["AgentFactory", "SessionWorker", "SetupFn", "load_agent"]

logger = logging.getLogger(__name__)

SetupFn = Callable[[AgentSession], Awaitable[None]]
AgentFactory = Callable[[CallInfo], SetupFn]

SNAPSHOT_VERSION = 1
# Pacing's way out when the gateway stops reporting progress (one too old to send ``playing``,
# reports lost to a bus outage): the next chunk is pulled anyway this long after the audio
# still unheard would have played, twice over, with a warning, so the call goes on with a gap
# instead of in silence.
_STALL_GRACE_S = 2.0

# How long ``aclose`` waits for the calls it cancelled before it abandons them, and how often
# it cancels again one whose cancellation was swallowed before its clean-up began.
STOP_GRACE_S = 5.0
_RECANCEL_S = 0.05

# Handled eids kept in a snapshot: redeliveries reach back only over the unacked messages.
_KEPT_EIDS = 1000
# ... and in memory: a call's state must not grow with its length (an hour of playback
# reports is ~90,000 events). Older ones were acked long ago and are never redelivered; the
# unapplied ones (still unacked) are always kept.
_HANDLED_IN_MEMORY = 4 * _KEPT_EIDS
# Ended utterances kept per call (an interrupt or a playback report names a recent one; a
# late chunk finds its ended utterance and is not spoken as a new one).
_KEPT_UTTERANCES = 64


def _forget_oldest(handled: dict[str, None], n: int, *, keep: dict[str, str]) -> None:
    """Drop up to ``n`` of the oldest eids from ``handled``, never one in ``keep``."""
    for eid in list(itertools.islice(handled, n + len(keep))):
        if n <= 0:
            return
        if eid not in keep:
            del handled[eid]
            n -= 1


def _eid_of(event: SDKEvent, kind: str) -> str | None:
    """A deterministic ``eid`` for a downlink event an uplink event caused (see
    ``_start_utterance``); None (the bus stamps one) otherwise."""
    reaction = event._reaction
    return reaction.next_id(kind) if isinstance(reaction, Reaction) else None


def load_agent(spec: str) -> SetupFn:
    """The setup function named ``"package.module:function"``.

    Raises:
        AgentLoadError: malformed name, module not importable, or no such callable.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise AgentLoadError(f"agent {spec!r}: expected 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise AgentLoadError(f"agent {spec!r}: cannot import {module_name!r}: {exc}") from exc
    target: Any = module
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as exc:
            raise AgentLoadError(f"agent {spec!r}: {module_name} has no {attr!r}") from exc
    if not callable(target):
        raise AgentLoadError(f"agent {spec!r}: {attr!r} is not callable")
    return cast(SetupFn, target)


@dataclass(slots=True)
class _Utterance:
    utterance_id: str
    seq: int
    node: Node | None
    request_id: str | None
    interruptible: bool
    alignment: UtteranceAlignment = field(default_factory=UtteranceAlignment)
    interrupted: bool = False
    # cut on the gateway's ``playback {interrupted, heard_ms 0}`` with no interrupt of its own
    # (the reply to a turn the gateway had cancelled): no cancellation of the graph follows
    dropped: bool = False
    ended: bool = False
    heard_ms: float = 0.0  # what the caller has heard of it (the gateway's ``playback``)
    sent: int = 0  # downlink events sent for it (each one's eid: ``<utterance_id>.<n>``)


@dataclass(slots=True)
class _Call:
    info: CallInfo
    session: AgentSession
    utterances: dict[str, _Utterance] = field(default_factory=dict)
    by_request: dict[str, _Utterance] = field(default_factory=dict)
    handled: dict[str, None] = field(default_factory=dict)  # eids, in handling order
    # eid -> bus message id of events handled whose effects may not all be out yet (a
    # transcript not yet in a node's context or not yet answered, a key press not yet
    # answered); they stay unacked and outside the snapshot's handled eids until then
    unapplied: dict[str, str] = field(default_factory=dict)
    # transcripts in a node's context whose answer is not yet all on the downlink (saved, so
    # that the next owner answers one again without adding the user message twice)
    answering: dict[str, None] = field(default_factory=dict)
    restored_answering: set[str] = field(default_factory=set)  # the last owner's
    # bus message ids in delivery order since ``covered``, the last id whose message and all
    # before it are reflected in the conversation (what ``save_context(through=)`` takes)
    order: deque[str] = field(default_factory=deque)
    covered: str | None = None
    ack_tasks: set[asyncio.Task[None]] = field(default_factory=set)
    last_eid: str | None = None
    seq: int = 0
    synth: Synthesizer | None = None  # this call's agent's TTS (None: the worker's default)
    lookahead_ms: float | None = None  # None: responses are not paced on playback
    chunks_done: dict[str, int] = field(default_factory=dict)  # request id -> chunks handled
    progress: asyncio.Condition = field(default_factory=asyncio.Condition)

    def through(self) -> str | None:
        waiting = set(self.unapplied.values())
        while self.order and self.order[0] not in waiting:
            self.covered = self.order.popleft()
        return self.covered

    @property
    def sid(self) -> str:
        return self.info.call_sid


class SessionWorker:
    """Claims calls from the bus and runs an agent session for each.

    Args:
        bus: The bus shared with the gateways.
        agent_factory: Maps a call to its agent's ``setup(session)`` coroutine function, e.g.
            ``lambda call: load_agent("myagents.support:setup")``.
        worker_id: This worker's consumer name on the bus (default: host, pid and a random id).
        synthesizer: Text to mu-law 8 kHz audio (default: ``ToneSynthesizer()``, a test double).
        twilio_client: A ``twilio.rest.Client`` used to end and transfer calls.
        call_control: Instead of ``twilio_client``, any ``CallControl``.
        output_buffer: Response chunks a node may generate ahead of synthesis (see AgentSession).
        lookahead_ms: Pace every response on what the caller hears: a node's next chunk is
            pulled from ``generate_response`` only once the audio sent for the response is at
            most this far ahead of what the gateway reports heard (``playback`` events), so a
            node's state at a barge-in is where the caller was. None: chunks are pulled as
            fast as text to speech takes them (a gateway that reports no progress).
        lookahead_for: Instead of ``lookahead_ms``, the lookahead of each call's agent.
    """

    def __init__(
        self,
        bus: Bus,
        *,
        agent_factory: AgentFactory,
        worker_id: str | None = None,
        synthesizer: Synthesizer | None = None,
        twilio_client: Any = None,
        call_control: CallControl | None = None,
        output_buffer: int = 1,
        synthesizer_factory: Callable[[CallInfo], Synthesizer] | None = None,
        lookahead_ms: float | None = None,
        lookahead_for: Callable[[CallInfo], float | None] | None = None,
    ) -> None:
        self._bus = bus
        self._lookahead_ms = lookahead_ms
        self._lookahead_for = lookahead_for
        self._synthesizer_factory = synthesizer_factory
        self._agent_factory = agent_factory
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._synth: Synthesizer = synthesizer or ToneSynthesizer()
        if call_control is None and twilio_client is not None:
            call_control = TwilioCallControl(twilio_client)
        self._call_control = call_control
        self._output_buffer = output_buffer
        self._calls: dict[str, _Call] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        # call tasks in their clean-up (``_finish``): a cancellation reached them
        self._finishing: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()

    # -- public -----------------------------------------------------------------------------
    @property
    def sessions(self) -> dict[str, AgentSession]:
        """The sessions of the calls in progress, by call SID."""
        return {sid: call.session for sid, call in self._calls.items()}

    async def run(self) -> None:
        """Handle every call claimed from the bus, each in its own task, until the bus ends."""
        async for call in self._bus.claim_calls(self.worker_id):
            # A call claimed again while its old session is still stopping (this worker lost
            # it, then took it back as an orphan) starts once the old one is done; dropping the
            # claim would leave the call owned here and handled by nobody.
            previous = self._tasks.get(call.call_sid)
            task = asyncio.get_running_loop().create_task(
                self._handle_after(previous, call), name=f"call:{call.call_sid}"
            )
            self._tasks[call.call_sid] = task
            task.add_done_callback(functools.partial(self._call_done, call.call_sid))

    async def _handle_after(self, previous: asyncio.Task[None] | None, call: CallInfo) -> None:
        if previous is not None:
            try:
                await asyncio.wait({previous})
            except asyncio.CancelledError:
                previous.cancel()
                raise
        await self.handle_call(call)

    def _call_done(self, sid: str, task: asyncio.Task[None]) -> None:
        if self._tasks.get(sid) is task:
            self._tasks.pop(sid)
        if not task.cancelled() and task.exception() is not None:
            logger.error("call %s failed", sid, exc_info=task.exception())

    async def join(self, call_sid: str) -> None:
        """Wait until this worker is done with the call (if it is handling it)."""
        task = self._tasks.get(call_sid)
        if task is not None:
            await asyncio.wait({task})

    async def aclose(self, grace_s: float = STOP_GRACE_S) -> list[str]:
        """Cancel the calls in progress (their state stays saved for another worker).

        Returns within about ``grace_s`` whatever the calls are doing: a call task whose
        cancellation was swallowed before it reached its clean-up (Python 3.11's
        ``asyncio.wait_for``, in a library or an agent, returns a result that came with the
        cancellation) is cancelled again; one still running at the end of the grace (its
        clean-up stuck on an agent that ignores cancellation) is abandoned, and logged with
        what it awaits. Returns the SIDs of the calls abandoned.
        """
        tasks = dict(self._tasks)
        for task in tasks.values():
            task.cancel()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        pending = set(tasks.values())
        while pending:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            _, pending = await asyncio.wait(pending, timeout=min(_RECANCEL_S, remaining))
            for task in pending:
                if task not in self._finishing:
                    task.cancel()  # the last one was swallowed: the call went on
        abandoned = [sid for sid, task in tasks.items() if task in pending]
        for sid in abandoned:
            logger.error(
                "worker %s: call %s abandoned: still running %.1f s after it was told to stop "
                "(%s); awaiting: %s", self.worker_id, sid, grace_s,
                "in its clean-up" if tasks[sid] in self._finishing else "its cancellation lost",
                await_chain(tasks[sid]),
            )  # fmt: skip
        return abandoned

    def describe_calls(self) -> dict[str, str]:
        """What each call's task is awaiting now (call SID -> its await chain), for logs."""
        return {sid: await_chain(task) for sid, task in self._tasks.items()}

    async def handle_call(self, call: CallInfo) -> None:
        """Run one call from claim to ``call_ended``."""
        lookahead = self._lookahead_ms
        if self._lookahead_for is not None:
            lookahead = self._lookahead_for(call)
        holder: list[_Call] = []

        async def pace(request_id: str, emitted: int) -> None:
            await self._pace(holder[0], request_id, emitted)

        session = AgentSession(
            call.call_sid,
            init_event=self._init_event(call),
            output_buffer=self._output_buffer,
            pacer=pace if lookahead is not None else None,
        )
        state = _Call(call, session, lookahead_ms=lookahead)
        holder.append(state)
        self._calls[call.call_sid] = state
        setup_task = asyncio.get_running_loop().create_task(
            self._run_setup(call, session), name=f"setup:{call.call_sid}"
        )
        pump_task: asyncio.Task[None] | None = None
        ended_normally = False
        try:
            if await self._setup_ready(session, setup_task):
                if self._synthesizer_factory is not None:
                    try:
                        state.synth = self._synthesizer_factory(call)
                    except Exception:  # a broken TTS config must not lose the call
                        logger.exception("call %s: agent TTS unavailable, using the default",
                                         call.call_sid)
                await self._restore(state)
                pump_task = asyncio.get_running_loop().create_task(
                    self._pump(state), name=f"output:{call.call_sid}"
                )
            else:
                await self._send(state, bp.Hangup())
                await self._control(state, "end")
            await self._consume_uplink(state)
            ended_normally = True
        except OwnershipLostError:
            # This worker stalled past its lease (a long pause, SIGSTOP) and another took the
            # call over: stop here without a trace on the call. The bus already refuses our
            # writes; nothing is saved or acked, the new owner has the conversation.
            logger.warning(
                "call %s: lost to another worker while this one was not renewing its lease; "
                "session stopped here, nothing more is sent, acked or saved", call.call_sid,
            )
        finally:
            current = asyncio.current_task()
            if current is not None:
                self._finishing.add(current)
            await self._finish(state, setup_task, pump_task, ended_normally)

    # -- setup ------------------------------------------------------------------------------
    @staticmethod
    def _init_event(call: CallInfo) -> SDKSystemInitEvent:
        variables: dict[str, Any] = {
            "call_sid": call.call_sid,
            "from_number": call.from_number,
            "to_number": call.to_number,
            "agent": call.agent,
            **call.params,
        }
        return SDKSystemInitEvent(
            session_context=SessionContext(
                initial_variables=variables, conversation_type=ConversationType.TELEPHONY_INBOUND
            )
        )

    async def _run_setup(self, call: CallInfo, session: AgentSession) -> None:
        setup = self._agent_factory(call)  # a factory that fails is a failed setup
        await setup(session)

    @staticmethod
    async def _setup_ready(session: AgentSession, setup_task: asyncio.Task[None]) -> bool:
        ready = asyncio.get_running_loop().create_task(session.wait_for_setup())
        try:
            await asyncio.wait({ready, setup_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
            await asyncio.wait({ready})
        if setup_task.done() and not setup_task.cancelled() and setup_task.exception():
            logger.error(
                "agent setup for %s failed", session.session_id, exc_info=setup_task.exception()
            )
            return False
        if session.state is not SessionState.RUNNING:
            logger.error("agent setup for %s did not start the session", session.session_id)
            return False
        return True

    async def _restore(self, state: _Call) -> None:
        saved = await self._load_context(state.sid)
        if not saved:
            return
        if saved.get("version") != SNAPSHOT_VERSION:
            logger.warning(
                "call %s: ignoring saved context of version %r", state.sid, saved.get("version")
            )
            return
        contexts = saved.get("nodes") or {}
        for node in state.session.output_nodes:
            messages = contexts.get(node.name)
            if isinstance(messages, list):
                node.context.replace_messages(messages)
        state.handled = dict.fromkeys(str(e) for e in saved.get("handled_eids") or ())
        state.restored_answering = {str(e) for e in saved.get("answering") or ()}
        last = saved.get("last_eid")
        state.last_eid = str(last) if last is not None else None
        logger.info("call %s resumed with %d handled events", state.sid, len(state.handled))

    async def _load_context(self, sid: str) -> dict[str, Any] | None:
        """The call's saved context, retried while the bus is down: a call claimed (or taken
        over) just as Redis went away would otherwise fail here and stay owned, its lease renewed
        by the heartbeat, with nobody serving it. The bus's own retries end in seconds; an
        outage can last longer, and the caller waits either way."""
        delay = 0.1
        while True:
            try:
                return await self._bus.load_context(sid)
            except BusUnavailableError as exc:
                if delay == 0.1:
                    logger.warning("call %s: the bus is down; loading its saved context again until "
                                   "it is back (%s)", sid, exc)
                await asyncio.sleep(delay)  # a back-off between attempts, not a wait for an event
                delay = min(delay * 2, 2.0)

    async def _finish(
        self,
        state: _Call,
        setup_task: asyncio.Task[None],
        pump_task: asyncio.Task[None] | None,
        ended_normally: bool,
    ) -> None:
        ack_tasks = list(state.ack_tasks)
        for ack in ack_tasks:
            ack.cancel()
        if ack_tasks:
            await asyncio.wait(ack_tasks)
        await state.session.stop()
        for task in (pump_task, setup_task):
            if task is None:
                continue
            if not ended_normally:
                task.cancel()
            await asyncio.wait({task})
            if not task.cancelled() and task.exception() is not None and task is pump_task:
                logger.error("call %s: output failed", state.sid, exc_info=task.exception())
        if setup_task.done() and not setup_task.cancelled():
            setup_task.exception()  # retrieved (and logged in _setup_ready) on failure
        if ended_normally:
            # The call is over: everything handled counts, nothing needs redelivery.
            pending = list(state.unapplied.values())
            state.unapplied.clear()
            state.answering.clear()
            await self._save(state)
            for msg_id in pending:
                await self._bus.ack(state.sid, msg_id)
        self._calls.pop(state.sid, None)

    # -- uplink -----------------------------------------------------------------------------
    async def _consume_uplink(self, state: _Call) -> None:
        async for message in self._bus.uplink(state.sid, self.worker_id):
            event = message.event
            eid = str(event.get("eid") or message.id)
            if eid in state.handled:
                await self._bus.ack(state.sid, message.id)
                continue
            record = self._decode(state, event)
            # What the agent does about the event (a key press's spoken answer, a greeting) is
            # written to the downlink later, by the output pump: the event is acked only once
            # all of it is, or a worker killed in between loses the answer (nodes._reactions).
            reaction = Reaction(eid)
            reaction.hold()
            applied = (None if record is None
                       else await self._on_uplink(state, record, reaction))
            reaction.release()
            state.handled[eid] = None
            if len(state.handled) > _HANDLED_IN_MEMORY:
                _forget_oldest(state.handled, len(state.handled) - _HANDLED_IN_MEMORY,
                               keep=state.unapplied)
            state.order.append(message.id)
            if applied is None and reaction.done:
                state.last_eid = eid
                if isinstance(record, bp.Interrupt):
                    await self._save(state)  # the cut, before the ack
                await self._bus.ack(state.sid, message.id)
            else:
                state.unapplied[eid] = message.id
                task = asyncio.get_running_loop().create_task(
                    self._ack_when_applied(
                        state, eid, message.id, applied, reaction,
                        save=isinstance(record, bp.Interrupt),
                    )
                )
                state.ack_tasks.add(task)
                task.add_done_callback(state.ack_tasks.discard)
            if isinstance(record, bp.CallEnded):
                return

    @staticmethod
    def _decode(state: _Call, event: Event) -> bp.UplinkEvent | None:
        """The record of an uplink message; None (logged, then acked) when it has none."""
        try:
            record = bp.decode(event)
        except EventDecodeError as exc:
            logger.warning("call %s: uplink event skipped: %s", state.sid, exc)
            return None
        if not isinstance(record, bp.UplinkEvent):
            logger.warning("call %s: downlink event %r on the uplink skipped", state.sid,
                           record.type)
            return None
        return record

    async def _ack_when_applied(
        self,
        state: _Call,
        eid: str,
        message_id: str,
        applied: asyncio.Event | None,
        reaction: Reaction,
        *,
        save: bool,
    ) -> None:
        if applied is not None and await self._applied_or_dropped(applied, reaction):
            state.answering[eid] = None  # a transcript: in a node's context, its answer owed
            await self._save(state)
        await reaction.wait()  # everything: once its effects are on the downlink
        if self._answered(state, eid) and (applied is not None or save):
            await self._save(state)
        await self._bus.ack(state.sid, message_id)

    @staticmethod
    async def _applied_or_dropped(applied: asyncio.Event, reaction: Reaction) -> bool:
        """True once a node applied the transcript; False when its reactions all ended first (an
        interrupt dropped it from a node's queue before any node took it in): then no answer is
        owed, and waiting for ``applied`` alone would hold its ack, and every later one, for the
        rest of the call."""
        waits = {asyncio.ensure_future(applied.wait()), asyncio.ensure_future(reaction.wait())}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
            await asyncio.wait(waits)
        return applied.is_set()

    @staticmethod
    def _answered(state: _Call, eid: str) -> bool:
        """The event's effects are out: it counts as handled in the next snapshot. False when
        that was done already (a transcript's answer ended: ``_on_response_end``)."""
        if state.unapplied.pop(eid, None) is None:
            return False
        state.answering.pop(eid, None)
        state.last_eid = eid
        return True

    async def _on_uplink(
        self, state: _Call, event: bp.UplinkEvent, reaction: Reaction
    ) -> asyncio.Event | None:
        """Turn one uplink event into SDK events, tagged with ``reaction`` (``reaction.key``
        is the event's eid); returns what else to wait for before acking (a transcript: its
        user message in a node's context)."""
        session = state.session
        if session.state is not SessionState.RUNNING:
            return None  # the agent never started: nothing to feed

        async def push(sdk_event: SDKEvent) -> None:
            await session.push_event(tag(sdk_event, reaction))

        match event:
            case bp.CallStarted():
                await push(SDKSystemUserJoinedEvent())
            case bp.SpeechStarted():
                await push(SDKSystemUserStartedSpeakingEvent())
            case bp.SpeechStopped():
                await push(SDKSystemUserStoppedSpeakingEvent())
            case bp.Transcript():
                if not event.text.strip() or not event.final:
                    return None
                if reaction.key in state.restored_answering:
                    # The last owner put it into the context (saved) but died before its answer
                    # was all out: the turn (with what the context has of that answer) goes out
                    # and in again, and is answered again under the same downlink ids.
                    state.restored_answering.discard(reaction.key)
                    drop_last_user_turn(session.output_nodes, event.text)
                elif event.replaces_previous:  # the caller resumed: one message per turn
                    drop_last_user_turn(session.output_nodes)
                message = SDKAgentTranscriptUpdateEvent(role="user", content=event.text)
                applied = asyncio.Event()
                message._applied = applied
                await push(message)
                await push(SDKSystemLLMRequestEvent())
                return applied
            case bp.Interrupt():
                await self._on_interrupt(state, event, reaction)
            case bp.Dtmf():
                if event.digit:
                    await push(SDKSystemUserDTMFEvent(digit=event.digit))
                else:
                    logger.warning("call %s: dtmf without a digit skipped", state.sid)
            case bp.Playback():
                await self._on_playback(state, event)
            case bp.InterruptSuppressed() | bp.CallEnded():
                pass
        return None

    async def _on_playback(self, state: _Call, event: bp.Playback) -> None:
        utterance = state.utterances.get(event.utterance_id)
        if utterance is None:
            return
        utterance.heard_ms = max(utterance.heard_ms, event.heard_ms)
        if (event.state == "interrupted" and event.heard_ms == 0 and utterance.interruptible
                and not utterance.interrupted):
            # Dropped unheard: either the reply to a turn the gateway had cancelled, made before
            # this worker read that interrupt (a takeover answering that turn again), with no
            # interrupt of its own to follow; or a barge-in before anything was heard, whose
            # interrupt follows (the gateway reports the playback first). Either way its audio
            # stops here, its text leaves the context (the whole turn's transcript replaces the
            # turn too) and its generation stops (_cancel_response); a barge-in's interrupt then
            # goes on as ever.
            self._cut(utterance, "")
            utterance.dropped = True
            await self._cancel_response(state, utterance)
        await self._progressed(state)

    @staticmethod
    async def _cancel_response(state: _Call, utterance: _Utterance) -> None:
        """Stop the generation of ``utterance``'s response, dropped by the gateway unheard: else
        its node would wait in ``_pace`` for playback progress that never comes (the stall
        guard, >= 2 s a chunk) with its LLM stream open, and the next turn's answer would wait
        behind it. Only that response is cancelled, when the node is generating it
        (``OutputAgentNode._generation``, not merely in the same event: a node's
        ``process_event`` may await before it starts the next turn's response); the node's
        queue (the next turn's request) stays, and no ``_handle_interrupt`` of the user's runs.
        Otherwise it has ended or not begun: ``_pace`` lets what is left run on at once, nothing
        more of it synthesized or recorded (``_cut`` froze it), and a frozen response calls no
        tool and carries out no hang-up, transfer or handover (nodes._agents)."""
        node = utterance.node
        rid = utterance.request_id
        if not isinstance(node, OutputAgentNode) or rid is None or utterance.ended:
            return
        if await node._cancel_generation(rid):
            logger.info("call %s: response %s of node %s dropped by the gateway unheard: its "
                        "generation is cancelled", state.sid, rid, node.name)
        else:
            logger.info("call %s: response %s of node %s dropped by the gateway runs on "
                        "unpaced (the node is not generating it)", state.sid, rid, node.name)

    # -- pacing -----------------------------------------------------------------------------
    async def _progressed(self, state: _Call) -> None:
        if state.lookahead_ms is None:
            return
        async with state.progress:
            state.progress.notify_all()

    async def _pace(self, state: _Call, request_id: str, emitted: int) -> None:
        """Return when response ``request_id`` may produce its next chunk: every chunk it
        emitted has been spoken and the caller is within ``lookahead_ms`` of its end."""
        lookahead = state.lookahead_ms
        assert lookahead is not None

        def ready() -> bool:
            if state.chunks_done.get(request_id, 0) < emitted:
                return False  # the last chunk is still being synthesized
            utterance = state.by_request.get(request_id)
            if utterance is None or utterance.ended:
                return True  # nothing audible yet (empty chunks) or nothing more to say
            if utterance.interrupted:
                # A barge-in's cancellation is on its way; none follows a drop by the gateway
                # (_cancel_response): nothing more of it is said, so it may run on at once.
                return utterance.dropped
            return utterance.alignment.audio_ms - utterance.heard_ms <= lookahead

        def stall_s() -> float:
            # From what is unheard now, not when the wait began: then the chunk is often still
            # being synthesized (nothing unheard yet), and a guard fixed at that moment fired
            # after 2 s on a chunk of 2.4 s (hT, session 6: it pulled chunks early).
            utterance = state.by_request.get(request_id)
            unheard_ms = 0.0
            if utterance is not None:
                unheard_ms = max(0.0, utterance.alignment.audio_ms - utterance.heard_ms)
            return 2 * unheard_ms / 1000 + _STALL_GRACE_S

        async with state.progress:
            while not ready():
                waited = stall_s()
                try:
                    async with asyncio.timeout(waited):  # restarted by every progress report
                        await state.progress.wait()
                except TimeoutError:
                    logger.warning(
                        "call %s: no playback progress from the gateway for %.1f s; the next "
                        "chunk is pulled without it (the node may run ahead of the caller)",
                        state.sid, waited,
                    )
                    return

    async def _on_interrupt(self, state: _Call, event: bp.Interrupt, reaction: Reaction) -> None:
        utterance = state.utterances.get(event.utterance_id) if event.utterance_id else None
        if utterance is not None and not utterance.interruptible:
            logger.warning(
                "call %s: interrupt for non-interruptible utterance %s (node %s) ignored",
                state.sid,
                utterance.utterance_id,
                utterance.node.name if utterance.node else None,
            )
            return
        if utterance is None:
            logger.info(
                "call %s: interrupt for unknown utterance %r", state.sid, event.utterance_id
            )
        else:
            heard = self._heard_text(utterance, event)
            self._cut(utterance, heard)
            # Interruptible utterances queued behind it were dropped by the gateway unheard.
            for later in state.utterances.values():
                if later.seq > utterance.seq and later.interruptible and not later.interrupted:
                    self._cut(later, "")
        # Returns once every interruptible node has cancelled its generation.
        await state.session.push_event(tag(SDKSystemControlInterruptEvent(), reaction))

    @staticmethod
    def _heard_text(utterance: _Utterance, event: bp.Interrupt) -> str:
        if event.heard_ms is not None:
            return utterance.alignment.heard_text(event.heard_ms)
        if event.heard_text is not None:
            return event.heard_text
        return utterance.alignment.text

    @staticmethod
    def _cut(utterance: _Utterance, heard: str) -> None:
        utterance.interrupted = True
        node = utterance.node
        if isinstance(node, OutputAgentNode) and utterance.request_id is not None:
            node._truncate_response(utterance.request_id, heard)

    # -- output -----------------------------------------------------------------------------
    async def _pump(self, state: _Call) -> None:
        async for event in state.session.output_events():
            if isinstance(event, SDKAgentLLMResponseChunkEvent):
                await self._on_chunk(state, event)
            elif isinstance(event, SDKAgentLLMResponseEndEvent):
                await self._on_response_end(state, event)
            elif isinstance(event, SDKAgentSpeakEvent):
                await self._on_speak(state, event)
            elif isinstance(event, SDKAgentEndCallEvent):
                await self._send(state, bp.Hangup(), eid=_eid_of(event, "hangup"))
                await self._control(state, "end")
            elif isinstance(event, SDKAgentTransferConversationEvent):
                await self._send(state, bp.Transfer(to=event.transfer_call_number),
                                 eid=_eid_of(event, "transfer"))
                await self._control(state, "transfer", event.transfer_call_number)
            elif isinstance(event, SDKAgentErrorEvent):
                node = event.origin.name if event.origin else "?"
                logger.warning(
                    "call %s: node %s reported an error: %s", state.sid, node, event.message
                )

    async def _start_utterance(
        self,
        state: _Call,
        cause: SDKEvent,
        request_id: str | None,
        text: str | None = None,
    ) -> _Utterance:
        origin = cause.origin
        state.seq += 1
        # An utterance caused by an uplink event is named after it, and its downlink events
        # after the utterance: a worker that took the call over and answers the same unacked
        # event again re-sends the same eids, and the gateway drops what it already had.
        reaction = cause._reaction
        utterance = _Utterance(
            utterance_id=(reaction.next_id("utt") if isinstance(reaction, Reaction)
                          else f"utt-{uuid.uuid4().hex[:12]}"),
            seq=state.seq,
            node=origin,
            request_id=request_id,
            interruptible=origin.is_interruptible if origin is not None else True,
        )
        state.utterances[utterance.utterance_id] = utterance
        if request_id is not None:
            state.by_request[request_id] = utterance
        if len(state.utterances) > 2 * _KEPT_UTTERANCES:
            ended = [u for u in state.utterances.values() if u.ended]
            for old in ended[: len(ended) - _KEPT_UTTERANCES]:
                del state.utterances[old.utterance_id]
                if old.request_id is not None and state.by_request.get(old.request_id) is old:
                    del state.by_request[old.request_id]
        await self._send_utterance(state, utterance, bp.UtteranceStart(
            utterance_id=utterance.utterance_id,
            node=origin.name if origin is not None else "",
            interruptible=utterance.interruptible,
            text=text,
            # The turn it answers: a gateway that cancelled that turn's reply (the caller
            # resumed) drops it, as it was made before this worker read the interrupt.
            reply_to=reaction.key if isinstance(reaction, Reaction) else None,
        ))
        return utterance

    async def _speak_chunk(self, state: _Call, utterance: _Utterance, text: str) -> None:
        if utterance.interrupted or utterance.ended or not text:
            return
        synth = state.synth or self._synth
        pieces = [piece async for piece in synth.synthesize(text)]
        if utterance.interrupted:
            return  # the caller barged in while this chunk was synthesized
        duration = sum(len(p) for p in pieces) / ULAW_BYTES_PER_MS
        chunk = utterance.alignment.add(text, duration)
        audio_ms = chunk.start_ms
        for piece in pieces:
            if utterance.interrupted:
                return
            piece_ms = len(piece) / ULAW_BYTES_PER_MS
            audio_ms += piece_ms
            await self._send_utterance(state, utterance, bp.Audio(
                utterance_id=utterance.utterance_id,
                payload=piece,
                text=text,
                text_start=chunk.text_start,
                text_end=chunk.text_end,
                audio_ms=audio_ms,
                duration_ms=piece_ms,
            ))

    async def _end_utterance(self, state: _Call, utterance: _Utterance) -> None:
        if utterance.ended:
            return
        utterance.ended = True
        await self._send_utterance(state, utterance, bp.UtteranceEnd(
            utterance_id=utterance.utterance_id,
            interrupted=utterance.interrupted,
            text=utterance.alignment.text,
        ))

    async def _drop_stale(
        self, state: _Call, event: SDKAgentLLMResponseChunkEvent | SDKAgentSpeakEvent
    ) -> bool:
        """A response the caller barged in on before any of it was played: never play it, but
        put it on the downlink as an utterance interrupted before its first audio (its
        ``utterance_start``, then ``utterance_end`` with ``interrupted``), as it would be had its
        uplink event come live. Live, a key press's answer is on the downlink ~50 ms after the
        press, queued behind the audio the caller then talks over, and that barge-in cuts it to
        nothing; when the press and the interrupt are read together (the backlog of a Redis
        outage) the node answered before the interrupt reached it and the answer was still in
        the session's output. It was dropped here without a trace (bench.chaos, session 6: 23
        key presses of 23,529 "lost", all on calls live across an outage)."""
        if not event.is_stale:
            return False
        node = event.origin
        if isinstance(node, OutputAgentNode) and event.request_id is not None:
            node._truncate_response(event.request_id, "")
        text = event.text if isinstance(event, SDKAgentSpeakEvent) else None
        utterance = await self._start_utterance(state, event, event.request_id, text)
        utterance.interrupted = True
        await self._end_utterance(state, utterance)
        logger.info(
            "call %s: %s of node %s cut by a barge-in before it played (utterance %s, on the "
            "downlink as interrupted, no audio)", state.sid,
            "speak" if text is not None else "response", node.name if node else "?",
            utterance.utterance_id,
        )  # fmt: skip
        return True

    async def _on_chunk(self, state: _Call, event: SDKAgentLLMResponseChunkEvent) -> None:
        try:
            await self._handle_chunk(state, event)
        finally:
            rid = event.request_id
            if rid is not None:
                state.chunks_done[rid] = state.chunks_done.get(rid, 0) + 1
            await self._progressed(state)

    async def _handle_chunk(self, state: _Call, event: SDKAgentLLMResponseChunkEvent) -> None:
        if not event.text:
            return
        utterance = state.by_request.get(event.request_id) if event.request_id else None
        if utterance is None:
            if await self._drop_stale(state, event):
                return
            utterance = await self._start_utterance(state, event, event.request_id)
        await self._speak_chunk(state, utterance, event.text)

    async def _on_response_end(self, state: _Call, event: SDKAgentLLMResponseEndEvent) -> None:
        utterance = state.by_request.get(event.request_id) if event.request_id else None
        if utterance is not None:
            await self._end_utterance(state, utterance)
        if event.request_id is not None:
            state.chunks_done.pop(event.request_id, None)
        reaction = event._reaction
        if isinstance(reaction, Reaction) and reaction.key in state.answering:
            self._answered(state, reaction.key)  # the transcript's answer is out: saved so
        await self._save(state)  # end of a turn

    async def _on_speak(self, state: _Call, event: SDKAgentSpeakEvent) -> None:
        if await self._drop_stale(state, event):
            await self._save(state)
            return
        utterance = await self._start_utterance(state, event, event.request_id, event.text)
        await self._speak_chunk(state, utterance, event.text)
        await self._end_utterance(state, utterance)
        await self._save(state)

    # -- effects ----------------------------------------------------------------------------
    async def _send(self, state: _Call, event: bp.DownlinkEvent, *, eid: str | None = None) -> None:
        await self._bus.send(state.sid, bp.encode(event, eid=eid))

    async def _send_utterance(
        self, state: _Call, utterance: _Utterance, event: bp.DownlinkEvent
    ) -> None:
        utterance.sent += 1
        await self._send(state, event, eid=f"{utterance.utterance_id}.{utterance.sent}")

    async def _control(self, state: _Call, action: str, to: str = "") -> None:
        if not await self._bus.holds(state.sid):
            logger.warning("call %s: %s not done: another worker owns the call now", state.sid, action)
            return
        if self._call_control is None:
            logger.info(
                "call %s: no Twilio client; %s sent on the downlink only", state.sid, action
            )
            return
        try:
            if action == "end":
                await self._call_control.end_call(state.sid)
            else:
                await self._call_control.transfer_call(state.sid, to)
        except CallControlError:
            logger.exception("call %s: %s failed", state.sid, action)

    def _snapshot(self, state: _Call) -> dict[str, Any]:
        return {
            "version": SNAPSHOT_VERSION,
            "nodes": {
                node.name: copy.deepcopy(node.context.messages)
                for node in state.session.output_nodes
            },
            "last_eid": state.last_eid,
            "through": state.covered,
            "handled_eids": [e for e in state.handled if e not in state.unapplied][-_KEPT_EIDS:],
            "answering": list(state.answering),
        }

    async def _save(self, state: _Call) -> None:
        through = state.through()
        if through is None and state.unapplied:
            return  # nothing is covered yet; the save after the transcript applies covers all
        snapshot = self._snapshot(state)
        try:
            await self._bus.save_context(state.sid, snapshot, through=through)
        except Exception:
            # Losing one snapshot only matters if this worker also dies before the next one;
            # failing the call here would hang up on the caller for sure.
            logger.exception("call %s: saving the conversation failed", state.sid)

