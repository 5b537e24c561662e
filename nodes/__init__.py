"""The agent SDK of callgate and the session worker that runs it.

Agents are written against the names of smallestai 4.2-4.3's ``smallestai.atoms.agent``::

    from nodes import AgentSession, OutputAgentNode, SDKSystemControlInterruptEvent

    class MyAgent(OutputAgentNode):
        async def generate_response(self):
            yield "Hello!"

    async def setup(session: AgentSession):
        session.add_node(MyAgent())
        await session.start()
        await session.wait_until_complete()

``SessionWorker`` runs ``setup`` for every call it claims from the bus (see ``nodes._worker``
for the uplink and downlink events, and ``nodes._alignment`` for how a barge-in's ``heard_ms``
becomes the text kept in the conversation).
"""

from ._alignment import AlignedChunk, UtteranceAlignment
from ._call_control import CallControl, TwilioCallControl, transfer_twiml
from ._context import ContextManager
from ._errors import (
    AgentLoadError,
    CallControlError,
    GraphCycleError,
    GraphError,
    LLMError,
    NodesError,
    SessionStateError,
    ToolError,
    ToolNotDecoratedError,
    UnknownEventHandlerError,
)
from ._events import __all__ as __all__  # the SDK events; the rest are added below
from ._events import (
    ConversationType,
    EventType,
    OutputAgentSettings,
    SDKAgentControlInterruptEvent,
    SDKAgentControlMuteUserEvent,
    SDKAgentControlUnmuteUserEvent,
    SDKAgentEndCallEvent,
    SDKAgentErrorEvent,
    SDKAgentEvent,
    SDKAgentLLMResponseChunkEvent,
    SDKAgentLLMResponseEndEvent,
    SDKAgentLLMResponseStartEvent,
    SDKAgentReadyEvent,
    SDKAgentSpeakEvent,
    SDKAgentTranscriptUpdateEvent,
    SDKAgentTransferConversationEvent,
    SDKEvent,
    SDKSystemControlInterruptEvent,
    SDKSystemEvent,
    SDKSystemInitEvent,
    SDKSystemLLMRequestEvent,
    SDKSystemUpdateOutputAgentSettingsEvent,
    SDKSystemUserDTMFEvent,
    SDKSystemUserJoinedEvent,
    SDKSystemUserStartedSpeakingEvent,
    SDKSystemUserStoppedSpeakingEvent,
    SessionContext,
    TransferOption,
    TransferOptionType,
    parse_event,
)
from ._llm import ChatChunk, ChatResponse, ChatStream, OpenAIClient, ToolCall, ToolResult
from ._node import Node
from ._output_agent import OutputAgentNode, ResponsePacer
from ._session import AgentSession, EventHandler, SessionState
from ._tools import FunctionSchema, FunctionToolInfo, ToolRegistry, function_tool
from ._tts import SilenceSynthesizer, Synthesizer, ToneSynthesizer
from ._worker import AgentFactory, SessionWorker, SetupFn, load_agent
from ._scripted import CONTROL_TOOLS, HANDOVER_TOOL, HANGUP_TOOL, TRANSFER_TOOL, ScriptedLLM
from ._agents import (
    ROUTE_KEY,
    ChatLLM,
    ConfigAgentFactory,
    ConfiguredLLMNode,
    LLMFactory,
    ToolLoader,
    agent_factory_from_config,
    check_agents,
    default_llm_factory,
    setup_from_config,
)
from ._runner import run_worker, synthesizer_for

__all__ = [
    *__all__,  # the SDK events, named once in nodes._events
    "AgentFactory",
    "AgentLoadError",
    "AgentSession",
    "AlignedChunk",
    "CallControl",
    "CallControlError",
    "ChatChunk",
    "ChatResponse",
    "ChatStream",
    "ContextManager",
    "EventHandler",
    "FunctionSchema",
    "FunctionToolInfo",
    "GraphCycleError",
    "GraphError",
    "LLMError",
    "Node",
    "NodesError",
    "OpenAIClient",
    "OutputAgentNode",
    "ResponsePacer",
    "SessionState",
    "SessionStateError",
    "SessionWorker",
    "SetupFn",
    "SilenceSynthesizer",
    "Synthesizer",
    "ToneSynthesizer",
    "ToolCall",
    "ToolError",
    "ToolNotDecoratedError",
    "ToolRegistry",
    "ToolResult",
    "TwilioCallControl",
    "UnknownEventHandlerError",
    "UtteranceAlignment",
    "function_tool",
    "load_agent",
    "transfer_twiml",
    # agents from YAML, the scripted LLM, the worker process
    "CONTROL_TOOLS",
    "HANDOVER_TOOL",
    "HANGUP_TOOL",
    "ROUTE_KEY",
    "TRANSFER_TOOL",
    "ChatLLM",
    "ConfigAgentFactory",
    "ConfiguredLLMNode",
    "LLMFactory",
    "ScriptedLLM",
    "ToolLoader",
    "agent_factory_from_config",
    "check_agents",
    "default_llm_factory",
    "run_worker",
    "setup_from_config",
    "synthesizer_for",
]
