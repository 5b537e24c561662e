"""SDK events: what flows between the session, the nodes and the worker.

Names and ``type`` strings follow smallestai 4.2-4.3 (``smallestai.atoms.agent.events``). Every
event is a pydantic model with a ``type`` literal and a ``timestamp``; ``parse_event`` turns a
JSON-able dict back into the right class.

Two extensions, both optional and absent from the wire format of the original SDK:

* agent response events (start, chunk, end, speak) carry ``request_id``, the id of the response
  they belong to, so the worker can tie audio it plays back to the text a node produced;
* ``SDKSystemUserDTMFEvent`` (``system.user.dtmf``) carries a keypad digit from the caller.

The emitting node is attached to agent events as a private attribute (``event.origin``); it is
not serialised.
"""

from __future__ import annotations

import asyncio
import enum
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

if TYPE_CHECKING:
    from ._node import Node

__all__ = [
    "ConversationType",
    "EventType",
    "OutputAgentSettings",
    "SDKAgentControlInterruptEvent",
    "SDKAgentControlMuteUserEvent",
    "SDKAgentControlUnmuteUserEvent",
    "SDKAgentEndCallEvent",
    "SDKAgentErrorEvent",
    "SDKAgentEvent",
    "SDKAgentLLMResponseChunkEvent",
    "SDKAgentLLMResponseEndEvent",
    "SDKAgentLLMResponseStartEvent",
    "SDKAgentReadyEvent",
    "SDKAgentSpeakEvent",
    "SDKAgentTranscriptUpdateEvent",
    "SDKAgentTransferConversationEvent",
    "SDKEvent",
    "SDKSystemControlInterruptEvent",
    "SDKSystemEvent",
    "SDKSystemInitEvent",
    "SDKSystemLLMRequestEvent",
    "SDKSystemUpdateOutputAgentSettingsEvent",
    "SDKSystemUserDTMFEvent",
    "SDKSystemUserJoinedEvent",
    "SDKSystemUserStartedSpeakingEvent",
    "SDKSystemUserStoppedSpeakingEvent",
    "SessionContext",
    "TransferOption",
    "TransferOptionType",
    "parse_event",
]


class EventType(str, enum.Enum):
    """The ``type`` strings of SDK events."""

    SYSTEM_INIT = "system.init"
    SYSTEM_LLM_REQUEST = "system.llm.request"
    SYSTEM_USER_STARTED_SPEAKING = "system.user.started_speaking"
    SYSTEM_USER_STOPPED_SPEAKING = "system.user.stopped_speaking"
    SYSTEM_CONTROL_INTERRUPT = "system.control.interrupt"
    SYSTEM_UPDATE_OUTPUT_AGENT_SETTINGS = "system.output_agent.update_settings"
    SYSTEM_USER_JOINED = "system.user.joined"
    SYSTEM_USER_DTMF = "system.user.dtmf"  # callgate extension

    AGENT_READY = "agent.ready"
    AGENT_ERROR = "agent.error"
    AGENT_LLM_RESPONSE_START = "agent.llm.response.start"
    AGENT_LLM_RESPONSE_CHUNK = "agent.llm.response.chunk"
    AGENT_LLM_RESPONSE_END = "agent.llm.response.end"
    AGENT_CONTROL_INTERRUPT = "agent.control.interrupt"
    AGENT_CONTROL_MUTE_USER = "agent.control.mute_user"
    AGENT_CONTROL_UNMUTE_USER = "agent.control.unmute_user"
    AGENT_TRANSCRIPT_UPDATE = "agent.transcript.update"
    AGENT_SPEAK = "agent.speak"
    AGENT_END_CALL = "agent.end_call"
    AGENT_TRANSFER_CONVERSATION = "agent.transfer_call"


class ConversationType(str, enum.Enum):
    """How the conversation reached the agent."""

    TELEPHONY_INBOUND = "telephonyInbound"
    TELEPHONY_OUTBOUND = "telephonyOutbound"
    CHAT = "chat"
    WEBCALL = "webcall"


class SessionContext(BaseModel):
    """Per-session facts handed to every node at start."""

    initial_variables: dict[str, Any] = Field(default_factory=dict)
    conversation_type: ConversationType = ConversationType.TELEPHONY_INBOUND


class OutputAgentSettings(BaseModel):
    """Settings of an output node that the platform may update mid-call."""

    model_config = ConfigDict(extra="allow")

    interruptible: bool = True


class TransferOptionType(str, enum.Enum):
    """Cold: connect the caller and leave. Warm: not supported by callgate (done as cold)."""

    COLD_TRANSFER = "cold_transfer"
    WARM_TRANSFER = "warm_transfer"


class TransferOption(BaseModel):
    """How to transfer a call."""

    type: TransferOptionType = TransferOptionType.COLD_TRANSFER


_REGISTRY: dict[str, type[SDKEvent]] = {}


class SDKEvent(BaseModel):
    """Base of all SDK events."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    type: str = "base"
    timestamp: datetime = Field(default_factory=datetime.now)

    # The emitting node; Any because pydantic must not try to validate or resolve it.
    _origin: Any = PrivateAttr(default=None)
    # The emitting node's interrupt epoch at emission: an event from before the node's latest
    # interrupt is stale (the caller barged in before it could be played).
    _epoch: int | None = PrivateAttr(default=None)
    # The input event's work this event is part of (``nodes._reactions``): the worker acks an
    # uplink event once its reaction is done.
    _reaction: Any = PrivateAttr(default=None)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        default = cls.model_fields["type"].default
        if isinstance(default, str) and default not in ("base", "system.base", "agent.base"):
            _REGISTRY[default] = cls

    @property
    def origin(self) -> Node | None:
        """The node that emitted this event, when a node did."""
        return cast("Node | None", self._origin)

    @property
    def is_stale(self) -> bool:
        """Emitted by an interruptible node that has been interrupted since."""
        node = self.origin
        return (
            node is not None
            and node.is_interruptible
            and self._epoch is not None
            and self._epoch != node._epoch
        )


class SDKSystemEvent(SDKEvent):
    """Events from the platform (the caller's side) into the graph."""

    type: str = "system.base"


class SDKAgentEvent(SDKEvent):
    """Events from nodes out of the graph."""

    type: str = "agent.base"


# -- system events ------------------------------------------------------------------------


class SDKSystemInitEvent(SDKSystemEvent):
    """Handed to every node's ``start``."""

    type: Literal["system.init"] = "system.init"
    version: str = "1.0.0"
    session_context: SessionContext = Field(default_factory=SessionContext)
    output_agent_settings: OutputAgentSettings | None = None


class SDKSystemLLMRequestEvent(SDKSystemEvent):
    """Ask the output nodes for a response."""

    type: Literal["system.llm.request"] = "system.llm.request"
    extra_params: dict[str, Any] = Field(default_factory=dict)


class SDKSystemControlInterruptEvent(SDKSystemEvent):
    """The caller barged in: interruptible nodes stop generating."""

    type: Literal["system.control.interrupt"] = "system.control.interrupt"


class SDKSystemUserStartedSpeakingEvent(SDKSystemEvent):
    type: Literal["system.user.started_speaking"] = "system.user.started_speaking"


class SDKSystemUserStoppedSpeakingEvent(SDKSystemEvent):
    type: Literal["system.user.stopped_speaking"] = "system.user.stopped_speaking"


class SDKSystemUserJoinedEvent(SDKSystemEvent):
    type: Literal["system.user.joined"] = "system.user.joined"


class SDKSystemUserDTMFEvent(SDKSystemEvent):
    """A keypad digit from the caller (callgate extension)."""

    type: Literal["system.user.dtmf"] = "system.user.dtmf"
    digit: str


class SDKSystemUpdateOutputAgentSettingsEvent(SDKSystemEvent):
    type: Literal["system.output_agent.update_settings"] = "system.output_agent.update_settings"
    settings: dict[str, Any] = Field(default_factory=dict)


# -- agent events -------------------------------------------------------------------------


class SDKAgentReadyEvent(SDKAgentEvent):
    type: Literal["agent.ready"] = "agent.ready"


class SDKAgentErrorEvent(SDKAgentEvent):
    type: Literal["agent.error"] = "agent.error"
    message: str


class SDKAgentLLMResponseStartEvent(SDKAgentEvent):
    """A node started a response."""

    type: Literal["agent.llm.response.start"] = "agent.llm.response.start"
    request_id: str | None = None


class SDKAgentLLMResponseChunkEvent(SDKAgentEvent):
    """One piece of text a node yielded."""

    type: Literal["agent.llm.response.chunk"] = "agent.llm.response.chunk"
    text: str
    request_id: str | None = None


class SDKAgentLLMResponseEndEvent(SDKAgentEvent):
    """A node's response ended (completed, failed or cancelled)."""

    type: Literal["agent.llm.response.end"] = "agent.llm.response.end"
    request_id: str | None = None


class SDKAgentControlInterruptEvent(SDKAgentEvent):
    type: Literal["agent.control.interrupt"] = "agent.control.interrupt"


class SDKAgentControlMuteUserEvent(SDKAgentEvent):
    type: Literal["agent.control.mute_user"] = "agent.control.mute_user"


class SDKAgentControlUnmuteUserEvent(SDKAgentEvent):
    type: Literal["agent.control.unmute_user"] = "agent.control.unmute_user"


class SDKAgentTranscriptUpdateEvent(SDKAgentEvent):
    """A message for the conversation; output nodes add it to their context."""

    type: Literal["agent.transcript.update"] = "agent.transcript.update"
    role: Literal["user", "assistant"]
    content: str

    # Set once a node has added the message to its context (the worker acks the uplink
    # transcript only then, so a crash in between redelivers it).
    _applied: Any = PrivateAttr(default=None)

    def _mark_applied(self) -> None:
        if isinstance(self._applied, asyncio.Event):
            self._applied.set()


class SDKAgentSpeakEvent(SDKAgentEvent):
    """Say this text as one utterance."""

    type: Literal["agent.speak"] = "agent.speak"
    text: str
    request_id: str | None = None


class SDKAgentEndCallEvent(SDKAgentEvent):
    type: Literal["agent.end_call"] = "agent.end_call"


class SDKAgentTransferConversationEvent(SDKAgentEvent):
    """Transfer the caller to ``transfer_call_number``."""

    type: Literal["agent.transfer_call"] = "agent.transfer_call"
    transfer_call_number: str
    transfer_options: TransferOption = Field(default_factory=TransferOption)
    on_hold_music: Literal["ringtone", "relaxing_sound", "uplifting_beats", "none"] | None = None


def parse_event(data: dict[str, Any]) -> SDKEvent:
    """Build the event class named by ``data["type"]``.

    Raises:
        ValueError: no ``type`` or an unknown one.
        pydantic.ValidationError: the fields do not fit the class.
    """
    kind = data.get("type")
    if not isinstance(kind, str):
        raise ValueError("an SDK event needs a string 'type'")
    cls = _REGISTRY.get(kind)
    if cls is None:
        raise ValueError(f"unknown SDK event type {kind!r}")
    return cls.model_validate(data)
