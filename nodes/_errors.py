"""Errors raised by the agent SDK and the session worker.

    NodesError
    ├── GraphError                  the node graph is malformed
    │   └── GraphCycleError         ... it has a cycle
    ├── SessionStateError           a session method called in the wrong lifecycle state
    ├── UnknownEventHandlerError    ``on_event`` with a name the session does not emit
    ├── ToolError
    │   └── ToolNotDecoratedError   ``ToolRegistry.register`` of a plain function
    ├── LLMError                    the LLM request failed (wraps the ``openai`` error)
    ├── AgentLoadError              ``load_agent("module:function")`` could not load it
    └── CallControlError            the telephony REST API refused to end or transfer a call
"""

from __future__ import annotations

__all__ = [
    "AgentLoadError",
    "CallControlError",
    "GraphCycleError",
    "GraphError",
    "LLMError",
    "NodesError",
    "SessionStateError",
    "ToolError",
    "ToolNotDecoratedError",
    "UnknownEventHandlerError",
]


class NodesError(Exception):
    """Base of every error raised by ``nodes``."""


class GraphError(NodesError):
    """The node graph is malformed."""


class GraphCycleError(GraphError):
    """The edges of the node graph form a cycle."""


class SessionStateError(NodesError):
    """A session method was called in a state that does not allow it."""


class UnknownEventHandlerError(NodesError):
    """An event handler was registered under a name the session never emits."""


class ToolError(NodesError):
    """Base of tool registration errors (tool *execution* errors become ToolResults)."""


class ToolNotDecoratedError(ToolError):
    """A function was registered as a tool without ``@function_tool``."""


class LLMError(NodesError):
    """The LLM request failed; ``__cause__`` is the client library's error."""


class AgentLoadError(NodesError):
    """An agent named ``module:function`` could not be imported."""


class CallControlError(NodesError):
    """The telephony provider refused to act on the call."""
