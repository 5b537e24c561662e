"""Agents from YAML: ``setup_from_config`` turns a ``config.AgentConfig`` into the agent's
``setup(session)`` function, and ``agent_factory_from_config`` picks the agent of each call.

The graph
---------

Each YAML node becomes one SDK node, named as in the YAML (the name is what ``goto``, edges, the
downlink's ``node`` and the saved conversation know it by):

* ``kind: llm`` -> :class:`ConfiguredLLMNode`: the node's ``prompt`` (default: the agent's) as
  system message, its ``tools`` (default: the agent's; ``"module:function"``, with or without
  ``@function_tool``) in a ``ToolRegistry``, ``is_interruptible`` from ``interruptible``, and an
  LLM from ``llm_factory`` (default: ``OpenAIClient(model, api_key, base_url)`` for provider
  ``openai``, :class:`~nodes.ScriptedLLM` with the node's ``script``, else the agent's, for
  ``scripted``). An agent without ``nodes`` gets one such node called ``main``.
* ``kind: python`` with ``ref: "module:Class"`` (a ``Node`` subclass): ``Class(**args)``, renamed
  to the YAML name, ``is_interruptible`` overridden when the YAML sets ``interruptible``.
* ``kind: python`` with ``ref: "module:function"``: the function *is* the agent (a ``setup``
  coroutine function, called as ``function(session, **args)``); only allowed as the agent's single
  node, and the agent's other settings (greeting, llm) are then the function's business.

Every YAML edge becomes ``session.add_edge(parent, child)``. One more node, the router
(``callgate::router``), is the parent of every node that has no parent in the YAML, so every
event from the platform passes through it first.

The active node (handover)
--------------------------

One output node at a time has the conversation: the *active* node, at first the agent's first
output node. The router stamps each ``system.llm.request`` it passes on with the name of the node
active at that moment (``extra_params["callgate.node"]``); the request still travels the whole
graph, but only the node it names answers it. So the next caller turn always goes to the active
node, whatever the edges, and a node that receives a request through its parent does not answer
it a second time.

A handover (a ``goto`` rule; to the LLM it is the ``callgate_handover`` tool call) takes effect
once the handing node's reply has ended: the router makes the target active and queues an *entry*
request straight to it, so the target speaks at once: its ``greeting`` if it has one, else a reply
of its own to the conversation so far, asked for with a system note at the end of the request
("The conversation was handed over to you from main."; a scripted node says nothing there).
What the target says is its own utterance, so the downlink's ``utterance_start`` carries the
target's name and ``interruptible`` flag; a payment node with ``interruptible: false`` is
therefore never cut by the gateway. A request that was stamped for a node which has handed the
conversation over before getting to it is sent on to the node now active.

Python class nodes take part the same way: an ``OutputAgentNode`` subclass gets a gate in front
of its ``process_event`` that applies the router's stamp (and, on entry, speaks the node's own
``greeting``), so a class that knows nothing of routing answers only while active. Plain ``Node``
subclasses are not routed.

The conversation
----------------

The ``kind: llm`` nodes of one call share one conversation (``context``), so the node that takes
over knows what was said before. Each node adds what it says; a caller's message is added once,
by the node that was active when it arrived, in that node's order of events (after the reply it
may still be generating); the system prompt is not stored but sent first with each request of
the node that has it. Python class nodes keep their own context (every caller message reaches
them; of the replies, only their own). A rule's ``transfer_to`` and ``hangup`` (tools
``callgate_transfer``, ``callgate_hangup``) become ``agent.transfer_call`` and ``agent.end_call``
after the reply ended, so the gateway gets ``transfer`` / ``hangup`` after the reply's
``utterance_end``.

Greeting: when the caller joins, the first output node says the agent's ``greeting`` (else its
own); the others say nothing.

Limitation: the active node is not part of the snapshot the worker saves, so a call taken over by
another worker resumes with the agent's first node active.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import inspect
import logging
import os
from collections import OrderedDict, deque
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

from bus import CallInfo
from config import (
    AgentConfig,
    Config,
    ConfigHolder,
    ConfigProblem,
    LLMConfig,
    LLMNodeConfig,
    PythonNodeConfig,
    ScriptRule,
)

from . import _reactions
from ._context import ContextManager
from ._errors import AgentLoadError, ToolNotDecoratedError
from ._events import (
    SDKAgentEndCallEvent,
    SDKAgentTranscriptUpdateEvent,
    SDKAgentTransferConversationEvent,
    SDKEvent,
    SDKSystemControlInterruptEvent,
    SDKSystemLLMRequestEvent,
    SDKSystemUserJoinedEvent,
)
from ._llm import ChatChunk, OpenAIClient, ToolCall, tool_calls_message
from ._node import Node
from ._output_agent import OutputAgentNode
from ._scripted import CONTROL_TOOLS, HANDOVER_TOOL, HANGUP_TOOL, TRANSFER_TOOL, ScriptedLLM
from ._session import AgentSession
from ._tools import ToolRegistry, function_tool
from ._tts import Synthesizer
from ._worker import SetupFn, load_agent

__all__ = [
    "ROUTE_KEY",
    "ChatLLM",
    "ConfigAgentFactory",
    "ConfiguredLLMNode",
    "LLMFactory",
    "ToolLoader",
    "agent_factory_from_config",
    "check_agents",
    "default_llm_factory",
    "setup_from_config",
]

logger = logging.getLogger(__name__)

ROUTE_KEY = "callgate.node"
"""``extra_params`` key of a ``system.llm.request``: the node that is to answer it."""
_ENTRY_KEY = "callgate.handover_from"
"""``extra_params`` key of the request that tells a node it has just taken over (from whom)."""

_ROUTER_NAME = "callgate::router"  # ':' cannot occur in a YAML node name
_IMPLICIT_NODE = "main"  # the node of an agent that declares no nodes
_MAX_TOOL_ROUNDS = 5  # LLM calls per response: a model that keeps calling tools is cut off
_REMEMBERED_TRANSCRIPTS = 64
_T = TypeVar("_T")


class ChatLLM(Protocol):
    """What a declarative node needs of its LLM: ``OpenAIClient`` and ``ScriptedLLM`` have it."""

    def chat(
        self,
        messages: Iterable[dict[str, Any]],
        stream: Literal[True],
        tools: list[dict[str, Any]] | None = None,
    ) -> Awaitable[AsyncIterable[ChatChunk]]: ...


LLMFactory = Callable[[AgentConfig, LLMNodeConfig], ChatLLM]
"""``(agent, node) -> LLM``: builds the LLM of one ``kind: llm`` node for one call."""
ToolLoader = Callable[[str], Callable[..., Any]]
"""``"module:function" -> function``."""


def default_llm_factory(agent: AgentConfig, node: LLMNodeConfig) -> ChatLLM:
    """``OpenAIClient`` for provider ``openai``, ``ScriptedLLM`` for ``scripted``.

    Raises:
        AgentLoadError: the agent has no ``llm`` section.
        LLMError: provider ``openai`` without an API key (none in the YAML nor the environment).
    """
    llm = agent.llm
    if llm is None:
        raise AgentLoadError(f"agent {agent.name!r}: node {node.name!r} needs the agent's `llm`")
    if llm.provider == "scripted":
        return ScriptedLLM(node.script or agent.script, fallback=node.fallback or agent.fallback)
    return OpenAIClient(
        model=node.model or llm.model or "gpt-4o-mini",
        api_key=llm.api_key.get_secret_value() if llm.api_key is not None else None,
        base_url=llm.base_url,
        temperature=llm.temperature,
    )


def _load_tool(ref: str) -> Callable[..., Any]:
    return load_agent(ref)


# -- the conversation the llm nodes share -----------------------------------------------------


@dataclass(slots=True)
class _Transcript:
    event: SDKEvent
    owner: str | None  # the node active when the router passed it on
    added: bool = False


class _SharedContext(ContextManager):
    """One conversation for several nodes: a caller's message is added once, not once per node.

    It is added by the node that was active when the message arrived (``assign``), in that
    node's own order of events: after the reply that node was still generating, never in the
    middle of it, which is where a node with nothing to do would put it. A message for a node
    outside ``sharers`` (a Python class node) is added by the first sharer that sees it.
    """

    def __init__(self, sharers: Iterable[str]) -> None:
        super().__init__()
        self._sharers = frozenset(sharers)
        # The same event object reaches every node; recent ones are enough to recognise it.
        self._recent: deque[_Transcript] = deque(maxlen=_REMEMBERED_TRANSCRIPTS)

    def _entry(self, event: SDKEvent) -> _Transcript | None:
        return next((t for t in self._recent if t.event is event), None)

    def assign(self, event: SDKEvent, owner: str) -> None:
        if self._entry(event) is None:
            self._recent.append(_Transcript(event, owner))

    def claim(self, event: SDKEvent, node: str) -> bool:
        """Whether ``node`` is the one to add ``event``'s message (True once per message)."""
        entry = self._entry(event)
        if entry is None:
            entry = _Transcript(event, None)  # not routed: the first to see it adds it
            self._recent.append(entry)
        if entry.added or (entry.owner in self._sharers and entry.owner != node):
            return False
        entry.added = True
        return True


# -- routing -----------------------------------------------------------------------------------


class _Turn(enum.Enum):
    """What a node does with a ``system.llm.request``."""

    ANSWER = "answer"  # addressed to this node, which has the conversation
    ENTER = "enter"  # this node has just taken the conversation over: greet or answer
    REDISPATCH = "redispatch"  # addressed here, but this node has handed over since
    SKIP = "skip"  # for another node


class _Router(Node):
    """Parent of the agent's top nodes: stamps each request with the active node's name."""

    def __init__(
        self, active: str, *, join_greeting: str | None, conversation: _SharedContext | None
    ) -> None:
        super().__init__(name=_ROUTER_NAME, is_interruptible=False)
        self.first = self.active = active
        self.join_greeting = join_greeting
        self._conversation = conversation
        self._targets: dict[str, OutputAgentNode] = {}
        self.entry_greetings: dict[str, str | None] = {}

    def register(self, node: OutputAgentNode, entry_greeting: str | None) -> None:
        self._targets[node.name] = node
        self.entry_greetings[node.name] = entry_greeting

    async def process_event(self, event: SDKEvent) -> None:
        if isinstance(event, SDKSystemControlInterruptEvent):
            # As the session's root does: what was pushed before the interrupt reaches the nodes
            # first, so an interruptible node drops it along with its own queue.
            while not self._queue.empty():
                queued = self._queue.get_nowait()
                if queued is not None:
                    await self._pass_on(queued)
                    _reactions.release(queued)
        await self._pass_on(event)

    async def _pass_on(self, event: SDKEvent) -> None:
        if isinstance(event, SDKSystemLLMRequestEvent):
            event.extra_params.setdefault(ROUTE_KEY, self.active)
        elif isinstance(event, SDKAgentTranscriptUpdateEvent) and self._conversation is not None:
            self._conversation.assign(event, self.active)
        await self.send_event(event)

    def turn(self, name: str, event: SDKSystemLLMRequestEvent) -> _Turn:
        addressed = event.extra_params.get(ROUTE_KEY)
        if addressed is None:  # pushed past the router (a test, a node of the user's)
            return _Turn.ANSWER if name == self.active else _Turn.SKIP
        if addressed != name:
            return _Turn.SKIP
        if _ENTRY_KEY in event.extra_params:
            return _Turn.ENTER
        return _Turn.ANSWER if name == self.active else _Turn.REDISPATCH

    async def hand_over(self, source: str, target: str) -> None:
        """Make ``target`` active and have it speak at once."""
        node = self._targets.get(target)
        if node is None:
            logger.error("[%s] %s handed over to %r, which is no output node", self.name, source,
                         target)  # fmt: skip
            return
        logger.info("[%s] handover %s -> %s", self.name, source, target)
        self.active = target
        await node.queue_event(
            SDKSystemLLMRequestEvent(extra_params={ROUTE_KEY: target, _ENTRY_KEY: source})
        )

    async def redispatch(self) -> None:
        """Ask the active node for a response (to a request meant for a node before it)."""
        node = self._targets.get(self.active)
        if node is not None:
            await node.queue_event(SDKSystemLLMRequestEvent(extra_params={ROUTE_KEY: self.active}))


def _gate(node: OutputAgentNode, router: _Router) -> None:
    """Make a user's output node answer only the requests the router addresses to it."""
    inner = node.process_event

    async def process_event(event: SDKEvent) -> None:
        if isinstance(event, SDKSystemLLMRequestEvent):
            turn = router.turn(node.name, event)
            if turn is _Turn.SKIP or turn is _Turn.REDISPATCH:
                if turn is _Turn.REDISPATCH:
                    await router.redispatch()
                await node.send_event(event)
                return
            greeting = router.entry_greetings.get(node.name)
            if turn is _Turn.ENTER and greeting:
                await node.speak(greeting)
                await node.send_event(event)
                return
        await inner(event)

    # An instance attribute: the node's loop and its parents call ``node.process_event``.
    setattr(node, "process_event", process_event)  # noqa: B010 - mypy forbids assigning a method


# -- the declarative node ----------------------------------------------------------------------


class ConfiguredLLMNode(OutputAgentNode):
    """An output node driven by an LLM, as a YAML ``kind: llm`` node declares it.

    It streams the LLM's reply, runs the tools the LLM calls and asks it again with their
    results (up to a few rounds), and carries out the control tool calls (``callgate_handover``,
    ``callgate_transfer``, ``callgate_hangup``) once the reply has ended.

    Args:
        name: The node's name.
        llm: ``OpenAIClient``, ``ScriptedLLM`` or anything with the same streaming ``chat``.
        prompt: System prompt, sent first with each request (not stored in ``context``).
        tools: Function tools the LLM may call.
        is_interruptible: False: the caller hears everything this node says in full.
        greeting: Said when this node takes the conversation over; also when the caller joins if
            this is the agent's first node and the agent has no greeting of its own.
        context: The conversation; the configured nodes of one call share one.
        router: The agent's router; None for a node used on its own (it answers every request).
    """

    tool_registry: ToolRegistry  # always set here (``OutputAgentNode`` leaves it to the class)

    def __init__(
        self,
        name: str,
        *,
        llm: ChatLLM,
        prompt: str | None = None,
        tools: ToolRegistry | None = None,
        is_interruptible: bool = True,
        greeting: str | None = None,
        context: ContextManager | None = None,
        router: _Router | None = None,
    ) -> None:
        super().__init__(name, is_interruptible)
        self.llm = llm
        self.prompt = prompt
        self.tool_registry = tools if tools is not None else ToolRegistry()
        self.greeting = greeting
        if context is not None:
            self.context = context
        self._router = router
        self._actions: list[ToolCall] = []
        self._note: str | None = None

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        """OpenAI schemas of the node's tools."""
        return self.tool_registry.get_schemas()

    # -- events -----------------------------------------------------------------------------
    async def process_event(self, event: SDKEvent) -> None:
        if isinstance(event, SDKSystemLLMRequestEvent):
            turn = self._router.turn(self.name, event) if self._router else _Turn.ANSWER
            if turn is _Turn.ANSWER:
                await self._respond()
            elif turn is _Turn.ENTER:
                if self.greeting:
                    await self.speak(self.greeting)
                else:
                    source = event.extra_params.get(_ENTRY_KEY)
                    await self._respond(
                        f"The conversation was handed over to you from {source}."
                    )
            elif turn is _Turn.REDISPATCH and self._router is not None:
                await self._router.redispatch()
            await self.send_event(event)
        elif isinstance(event, SDKAgentTranscriptUpdateEvent):
            context = self.context
            if not isinstance(context, _SharedContext) or context.claim(event, self.name):
                context.add_message({"role": event.role, "content": event.content})
                # Only now may the worker ack the transcript (see nodes._worker).
                event._mark_applied()
            await self.send_event(event)
        elif isinstance(event, SDKSystemUserJoinedEvent):
            if self._router is None:
                greeting = self.greeting
            elif self._router.first == self.name:
                # The first node, not the active one: a node downstream may see the join only
                # after a handover.
                greeting = self._router.join_greeting or self.greeting
            else:
                greeting = None
            if greeting:
                await self.speak(greeting)
            await self.send_event(event)
        else:
            await super().process_event(event)

    async def _respond(self, note: str | None = None) -> None:
        """Generate a response; ``note``: a system message to end the first request with."""
        self._actions = []
        self._note = note
        try:
            await self._handle_llm_request()
        finally:
            self._note = None
        actions, self._actions = self._actions, []
        response = next(reversed(self._responses.values()), None)
        if actions and response is not None and response.frozen:
            # Cut before it ended (dropped unheard by the gateway, its generation run on): the
            # caller never heard the reply that asked for them.
            logger.info("[%s] %s of a reply cut before its end not carried out", self.name,
                        ", ".join(c.name for c in actions))  # fmt: skip
            return
        for call in actions:
            await self._act(call)

    async def _act(self, call: ToolCall) -> None:
        try:
            arguments = call.parsed_arguments()
        except ValueError:
            logger.warning("[%s] %s with bad arguments %r ignored", self.name, call.name,
                           call.arguments)  # fmt: skip
            return
        if call.name == HANDOVER_TOOL:
            target = arguments.get("node")
            if self._router is None or not isinstance(target, str):
                logger.warning("[%s] handover to %r: no router or no node", self.name, target)
                return
            await self._router.hand_over(self.name, target)
        elif call.name == TRANSFER_TOOL:
            to = arguments.get("to")
            if isinstance(to, str) and to:
                await self._emit(SDKAgentTransferConversationEvent(transfer_call_number=to))
            else:
                logger.warning("[%s] transfer without a number ignored", self.name)
        elif call.name == HANGUP_TOOL:
            await self._emit(SDKAgentEndCallEvent())

    # -- generation -------------------------------------------------------------------------
    async def generate_response(self) -> AsyncIterator[str]:
        """Stream the LLM's reply; run its tool calls and stream its answer to their results."""
        # (tool-call message, what was said before the call) of this response, oldest first
        said_before: list[tuple[dict[str, Any], str]] = []
        for _ in range(_MAX_TOOL_ROUNDS):
            said = ""
            calls: list[ToolCall] = []
            stream = await self.llm.chat(
                messages=self._request(said_before), stream=True, tools=self.tool_schemas or None
            )
            async with contextlib.aclosing(self._stream_reply(stream, calls)) as texts:
                async for text in texts:
                    said += text
                    yield text
            if self._generation_frozen():
                return  # cut: the caller hears no more of it; it calls no tool, acts on none
            self._actions.extend(c for c in calls if c.name in CONTROL_TOOLS)
            functions = [c for c in calls if c.name not in CONTROL_TOOLS]
            if not functions:
                return
            results = await self.tool_registry.execute(functions, parallel=True)
            if self._generation_frozen():
                self._actions.clear()
                return  # cut while its tools ran: their results stay out of the context
            request = tool_calls_message(functions)
            self._add_before_reply([request, *(r.to_message() for r in results)])
            said_before.append((request, said))
            if self._actions:
                return  # the call moves on (handover, transfer, hang-up)
        logger.warning("[%s] still calling tools after %d rounds; reply cut short", self.name,
                       _MAX_TOOL_ROUNDS)  # fmt: skip

    def _request(self, said_before: list[tuple[dict[str, Any], str]]) -> list[dict[str, Any]]:
        """The messages for the next LLM call: prompt, the conversation (this response's text so
        far shown in the tool-call messages it preceded), and in the first the handover note."""
        reply = self._reply_message()
        said = {id(message): text for message, text in said_before if text}
        messages: list[dict[str, Any]] = []
        if self.prompt:
            messages.append({"role": "system", "content": self.prompt})
        for message in self.context.messages:
            if message is reply:
                continue
            if id(message) in said:
                message = {**message, "content": said[id(message)]}
            messages.append(message)
        if self._note is not None and not said_before:
            messages.append({"role": "system", "content": self._note})
        return messages


# -- building an agent -------------------------------------------------------------------------


SubPath = tuple[str | int, ...]
"""Keys and list indices below ``agents.<name>`` in the YAML."""


@dataclass(frozen=True, slots=True)
class _LLMPlan:
    config: LLMNodeConfig
    prompt: str | None
    tools: ToolRegistry
    where: SubPath  # the node in the agent's YAML


@dataclass(frozen=True, slots=True)
class _ClassPlan:
    config: PythonNodeConfig
    cls: type[Node]
    where: SubPath
    llm: LLMConfig | None = None  # the node's ``self.llm`` (its own ``llm``, else the agent's)
    tools: ToolRegistry | None = None  # its ``self.tool_registry`` (None: no tools declared)


@dataclass(frozen=True, slots=True)
class _Problem:
    """Why an agent cannot be built, at the field of its YAML that says so."""

    field: SubPath
    message: str


class _Unbuildable(AgentLoadError):
    """One problem, raised inside one check and collected by ``_AgentPlan`` (from a call's
    ``build``: the worker's reason for the failed setup)."""

    def __init__(self, field: SubPath, message: str) -> None:
        super().__init__(message)
        self.problem = _Problem(field, message)


def _check_args(target: Callable[..., Any], field: SubPath, *args: Any, **kwargs: Any) -> None:
    try:
        inspect.signature(target).bind(*args, **kwargs)
    except TypeError as exc:
        raise _Unbuildable(field, f"does not take these args: {exc}") from exc
    except ValueError:
        pass  # no signature to check (a builtin)


class _AgentPlan:
    """What ``setup_from_config`` checks once; ``build`` makes the nodes of one call.

    Every problem is collected in ``problems`` (with the field of the YAML it is about), not
    raised: ``config check`` reports them all at once.
    """

    def __init__(
        self, agent: AgentConfig, llm_factory: LLMFactory, tool_loader: ToolLoader
    ) -> None:
        self.agent = agent
        self._llm_factory = llm_factory
        self.plans: list[_LLMPlan | _ClassPlan] = []
        self.problems: list[_Problem] = []
        declared: list[tuple[SubPath, LLMNodeConfig | PythonNodeConfig]] = [
            (("nodes", index), node) for index, node in enumerate(agent.nodes)
        ] or [(("llm",), LLMNodeConfig(kind="llm", name=_IMPLICIT_NODE))]
        for where, node in declared:
            try:
                if isinstance(node, LLMNodeConfig):
                    self.plans.append(self._llm_plan(node, where, tool_loader))
                else:
                    self.plans.append(self._class_plan(node, where, tool_loader))
            except _Unbuildable as exc:
                self.problems.append(exc.problem)
        if self.problems:
            return  # what speaks, and where a goto may go, is known once every node loads
        outputs = [p.config.name for p in self.plans if self._is_output(p)]
        if not outputs:
            self.problems.append(
                _Problem(("nodes",), "no node speaks (no llm node, no OutputAgentNode class)")
            )
            return
        self.first = outputs[0]
        self._check_gotos(set(outputs))

    def error(self) -> AgentLoadError | None:
        """The problems as one error (None when there are none)."""
        if not self.problems:
            return None
        return AgentLoadError("\n".join(self.describe(p) for p in self.problems))

    def describe(self, problem: _Problem) -> str:
        where = f"agent {self.agent.name!r}"
        if len(problem.field) >= 2 and problem.field[0] == "nodes":
            index = problem.field[1]
            assert isinstance(index, int)
            node = self.agent.nodes[index]
            where += f", node {node.name!r}"
            if isinstance(node, PythonNodeConfig):
                where += f" ({node.ref})"
        return f"{where}: {problem.message}"

    @staticmethod
    def _is_output(plan: _LLMPlan | _ClassPlan) -> bool:
        return isinstance(plan, _LLMPlan) or issubclass(plan.cls, OutputAgentNode)

    def _llm_plan(self, node: LLMNodeConfig, where: SubPath, tool_loader: ToolLoader) -> _LLMPlan:
        llm = self.agent.llm
        refs, tools_at = (node.tools, (*where, "tools")) if node.tools else (
            llm.tools if llm is not None else [], ("llm", "tools"))  # fmt: skip
        registry = self._tools(refs, tools_at, tool_loader)
        prompt = node.prompt or (llm.prompt if llm is not None else None)
        return _LLMPlan(node, prompt, registry, where)

    @staticmethod
    def _tools(refs: list[str], tools_at: SubPath, tool_loader: ToolLoader) -> ToolRegistry:
        registry = ToolRegistry()
        for index, ref in enumerate(refs):
            try:
                function = tool_loader(ref)
                try:
                    registry.register(function)
                except ToolNotDecoratedError:
                    registry.register(function_tool(function))
            except Exception as exc:  # user code: an import or a signature that fails
                raise _Unbuildable((*tools_at, index), f"tool {ref!r}: {exc}") from exc
        return registry

    def _class_plan(
        self, node: PythonNodeConfig, where: SubPath, tool_loader: ToolLoader
    ) -> _ClassPlan:
        try:
            target = load_agent(node.ref)
        except AgentLoadError as exc:
            raise _Unbuildable((*where, "ref"), str(exc)) from exc
        if not inspect.isclass(target):
            raise _Unbuildable(
                (*where, "ref"),
                "a setup function must be the agent's only node; in a graph, ref a Node subclass",
            )
        if not issubclass(target, Node):
            raise _Unbuildable((*where, "ref"), f"{target.__name__} is not a nodes.Node subclass")
        _check_args(target, (*where, "args"), **node.args)
        property_ = inspect.getattr_static(target, "is_interruptible", None)
        if node.interruptible is not None and property_ is not Node.__dict__["is_interruptible"]:
            raise _Unbuildable(
                (*where, "interruptible"),
                f"{target.__name__} defines is_interruptible itself, so the YAML cannot set "
                "`interruptible`",
            )
        if not issubclass(target, OutputAgentNode):
            return _ClassPlan(node, target, where)
        # What the seed's code uses of a node: self.llm, self.tool_schemas, self.tool_registry.
        llm = node.llm or self.agent.llm
        if node.tools:
            refs, tools_at = node.tools, (*where, "tools")
        elif node.llm is not None:
            refs, tools_at = node.llm.tools, (*where, "llm", "tools")
        else:
            refs, tools_at = (llm.tools if llm is not None else []), ("llm", "tools")
        tools = self._tools(refs, tools_at, tool_loader) if refs else None
        return _ClassPlan(node, target, where, llm, tools)

    def _check_gotos(self, outputs: set[str]) -> None:
        rules: list[tuple[SubPath, list[ScriptRule]]] = [(("script",), list(self.agent.script))]
        for plan in self.plans:
            if isinstance(plan, _LLMPlan) and plan.where[0] == "nodes":
                rules.append(((*plan.where, "script"), list(plan.config.script)))
        for at, script in rules:
            for index, rule in enumerate(script):
                if rule.goto is not None and rule.goto not in outputs:
                    self.problems.append(_Problem(
                        (*at, index, "goto"),
                        f"goto {rule.goto!r} names a node that does not speak; output nodes: "
                        f"{', '.join(sorted(outputs))}",
                    ))  # fmt: skip

    def build(self, session: AgentSession, llms: list[ChatLLM]) -> None:
        """Add the agent's nodes and edges to ``session``; the LLMs made go into ``llms``."""
        agent = self.agent
        first_greeting = next(
            (p.config.greeting for p in self.plans if isinstance(p, _LLMPlan)
             and p.config.name == self.first),
            None,
        )  # fmt: skip
        shared = _SharedContext(p.config.name for p in self.plans if isinstance(p, _LLMPlan))
        router = _Router(
            self.first, join_greeting=agent.greeting or first_greeting, conversation=shared
        )
        nodes: dict[str, Node] = {}
        for plan in self.plans:
            name = plan.config.name
            if isinstance(plan, _LLMPlan):
                llm = self._located(plan, self._llm_factory, agent, plan.config)
                llms.append(llm)
                configured = ConfiguredLLMNode(
                    name,
                    llm=llm,
                    prompt=plan.prompt,
                    tools=plan.tools,
                    is_interruptible=plan.config.interruptible,
                    greeting=plan.config.greeting,
                    context=shared,
                    router=router,
                )
                router.register(configured, plan.config.greeting)
                nodes[name] = configured
            else:
                nodes[name] = self._located(plan, self._make, plan, router, llms)
        session.add_node(router)
        for node in nodes.values():
            session.add_node(node)
        children = {child for _, child in agent.edges}
        for name, node in nodes.items():
            if name not in children:
                session.add_edge(router, node)
        for parent, child in agent.edges:
            session.add_edge(nodes[parent], nodes[child])

    def _make(self, plan: _ClassPlan, router: _Router, llms: list[ChatLLM]) -> Node:
        cfg = plan.config
        node = plan.cls(**cfg.args)
        node.name = cfg.name
        if cfg.interruptible is not None:
            node._is_interruptible = cfg.interruptible
        if isinstance(node, OutputAgentNode):
            # What the class sets itself (as smallestai's examples do) is kept.
            if node.llm is None and plan.llm is not None:
                agent = self.agent
                if cfg.llm is not None:
                    agent = agent.model_copy(update={"llm": cfg.llm})
                node.llm = self._llm_factory(agent, LLMNodeConfig(kind="llm", name=cfg.name))
                node._llm_prompt = plan.llm.prompt
                llms.append(node.llm)
            if node.tool_registry is None and plan.tools is not None:
                node.tool_registry = plan.tools
            if node.tool_schemas is None and node.tool_registry is not None:
                node.tool_schemas = node.tool_registry.get_schemas()
            default = type(node).generate_response is OutputAgentNode.generate_response
            if node.llm is None and default:
                raise _Unbuildable(
                    (*plan.where, "ref"),
                    f"{plan.cls.__name__} defines no generate_response, so it answers with its "
                    "LLM: give the node or the agent an `llm` section",
                )
            own = node.greeting
            # The SDK greets on join with ``greeting``: only the first node may.
            node.greeting = (self.agent.greeting or own) if cfg.name == self.first else None
            router.register(node, own)
            _gate(node, router)
        return node

    @staticmethod
    def _located(plan: _LLMPlan | _ClassPlan, make: Callable[..., _T], *args: Any) -> _T:
        """``make(*args)``; what it raises becomes a problem at ``plan``'s node."""
        try:
            return make(*args)
        except _Unbuildable:
            raise
        except Exception as exc:  # user code or the LLM's settings: located, never a crash
            field = plan.where
            if isinstance(plan, _ClassPlan):
                field = (*field, "args" if plan.config.args else "ref")
            raise _Unbuildable(field, _raised(exc)) from exc

    def trial_build(self) -> None:
        """Build the graph of one call as ``setup`` does, without starting it: a node class
        whose constructor fails, or an LLM that cannot be made, becomes a problem."""
        try:
            self.build(AgentSession(f"check-{self.agent.name}"), [])
        except _Unbuildable as exc:
            self.problems.append(exc.problem)


def _raised(exc: BaseException) -> str:
    return f"building it raised {type(exc).__name__}: {exc}"


async def _aclose_all(llms: list[ChatLLM]) -> None:
    for llm in llms:
        aclose = getattr(llm, "aclose", None)
        if aclose is not None:
            try:
                await aclose()
            except Exception:
                logger.exception("closing the LLM client %r failed", llm)


def _function_plan(node: PythonNodeConfig, target: SetupFn) -> _Problem | None:
    where: SubPath = ("nodes", 0)
    if node.interruptible is not None:
        return _Problem(
            (*where, "interruptible"),
            "`interruptible` applies to a Node class; a setup function sets it on the nodes it "
            "makes",
        )
    try:
        _check_args(target, (*where, "args"), None, **node.args)
    except _Unbuildable as exc:
        return exc.problem
    return None


def _function_setup(agent: AgentConfig, node: PythonNodeConfig, target: SetupFn) -> SetupFn:
    problem = _function_plan(node, target)
    if problem is not None:
        raise AgentLoadError(f"agent {agent.name!r}, node {node.name!r} ({node.ref}): "
                             f"{problem.message}")  # fmt: skip
    if agent.greeting:
        logger.info("agent %r, node %r (%s): the setup function is the agent; the agent's "
                    "greeting is not used", agent.name, node.name, node.ref)  # fmt: skip
    if not node.args:
        return target
    return functools.partial(target, **node.args)


def _setup_function_of(agent: AgentConfig) -> tuple[PythonNodeConfig, SetupFn] | None:
    """The agent's setup function, when its only node refs one."""
    if len(agent.nodes) == 1 and isinstance(agent.nodes[0], PythonNodeConfig):
        only = agent.nodes[0]
        target = load_agent(only.ref)
        if not inspect.isclass(target):
            return only, target
    return None


def setup_from_config(
    agent: AgentConfig,
    *,
    llm_factory: LLMFactory | None = None,
    tool_loader: ToolLoader | None = None,
) -> SetupFn:
    """The ``setup(session)`` coroutine function of ``agent`` (see the module docstring).

    References (node classes, functions, tools) are imported and checked here, once; each call
    that runs the returned function gets fresh nodes and LLM clients, closed when the call ends.

    Args:
        agent: The agent's YAML.
        llm_factory: ``(agent, node) -> LLM`` for each ``kind: llm`` node of each call
            (default: :func:`default_llm_factory`).
        tool_loader: ``"module:function" -> function`` for the tools (default: import it).

    Raises:
        AgentLoadError: a reference does not import or is of the wrong kind, a setup function
            alongside other nodes, ``args`` the class or function does not take, a ``goto`` to a
            node that does not speak (every problem, one per line).
    """
    function = _setup_function_of(agent)
    if function is not None:
        return _function_setup(agent, *function)
    plan = _AgentPlan(agent, llm_factory or default_llm_factory, tool_loader or _load_tool)
    error = plan.error()
    if error is not None:
        raise error

    async def setup(session: AgentSession) -> None:
        llms: list[ChatLLM] = []
        try:
            plan.build(session, llms)
            await session.start()
            await session.wait_until_complete()
        finally:
            await _aclose_all(llms)

    setup.__qualname__ = setup.__name__ = f"setup_{agent.name}"
    return setup


# -- checking a whole config -------------------------------------------------------------------


class _UnusedLLM:
    """Stands in for an ``openai`` node's client while a graph is only being checked: building
    the real one needs nothing but the key (checked), and must not open a connection pool."""

    async def chat(self, *args: Any, **kwargs: Any) -> AsyncIterable[ChatChunk]:
        raise AssertionError("a config check never runs the graph")


def _checking_llm_factory(agent: AgentConfig, node: LLMNodeConfig) -> ChatLLM:
    llm = agent.llm
    if llm is not None and llm.provider == "openai":
        key = llm.api_key.get_secret_value() if llm.api_key is not None else None
        if not (key or os.environ.get("OPENAI_API_KEY")):
            raise _Unbuildable(
                ("llm", "api_key"),
                "provider 'openai' needs an API key: api_key: ${OPENAI_API_KEY}, with that "
                "variable set (none is set in this environment)",
            )
        return _UnusedLLM()
    return default_llm_factory(agent, node)


_TTS_FIELDS = ("voice", "model", "speed", "base_url", "api_key")


def _tts_problem(agent: AgentConfig, exc: Exception) -> _Problem:
    """The TTS field a synthesizer's refusal is about (the ``tts`` section when it says none)."""
    text = str(exc).lower()
    named = [f for f in _TTS_FIELDS if getattr(agent.tts, f) is not None and f.replace("_", " ")
             in text.replace("_", " ")]  # fmt: skip
    field: SubPath = ("tts", named[0]) if named else ("tts",)
    return _Problem(field, f"{agent.tts.provider} text to speech: {exc}")


def check_agents(
    config: Config,
    *,
    synthesizer_factory: Callable[[AgentConfig], Synthesizer] | None = None,
    llm_factory: LLMFactory | None = None,
    tool_loader: ToolLoader | None = None,
) -> list[ConfigProblem]:
    """Why each agent of ``config`` cannot be built, as ``config.load_config(validate=)`` takes.

    For each agent this does what a call does before it speaks, without any network call: it
    loads its references (node classes, setup functions, tools), checks them against the YAML
    (``args`` the class or function takes, ``interruptible`` only where it applies, a setup
    function only as the single node, every ``goto`` to a node that speaks), builds one call's
    graph (constructing each node class with its ``args``; an ``openai`` node's client is not
    made, but its API key must be there) and builds its text to speech (an unknown voice fails
    here, not in every call).

    Args:
        config: A config that matches the schema.
        synthesizer_factory: ``agent -> Synthesizer`` (default: ``nodes.synthesizer_for``, what
            the worker uses).
        llm_factory: ``(agent, node) -> LLM`` for the ``kind: llm`` nodes (default: the
            scripted model as the worker makes it; for ``openai``, the key is checked only).
        tool_loader: ``"module:function" -> function`` (default: import it).

    Returns:
        Every problem, with the path of the field it is about; empty when every agent builds.
    """
    if synthesizer_factory is None:
        from ._runner import synthesizer_for

        synthesizer_factory = synthesizer_for
    problems: list[ConfigProblem] = []
    for name, agent in config.agents.items():
        found = _agent_problems(agent, llm_factory or _checking_llm_factory,
                                tool_loader or _load_tool)  # fmt: skip
        try:
            synthesizer_factory(agent)
        except Exception as exc:  # the worker would fail the same way in every call
            found.append(_tts_problem(agent, exc))
        problems += [ConfigProblem(("agents", name, *p.field), p.message) for p in found]
    return problems


def _agent_problems(
    agent: AgentConfig, llm_factory: LLMFactory, tool_loader: ToolLoader
) -> list[_Problem]:
    try:
        function = _setup_function_of(agent)
    except AgentLoadError as exc:
        return [_Problem(("nodes", 0, "ref"), str(exc))]
    if function is not None:
        problem = _function_plan(*function)
        return [problem] if problem is not None else []
    plan = _AgentPlan(agent, llm_factory, tool_loader)
    if not plan.problems:
        plan.trial_build()
    return plan.problems


# -- per call ----------------------------------------------------------------------------------


class ConfigAgentFactory:
    """``CallInfo -> setup``: the agent of each call, from the config in force when it starts.

    A reload of ``holder`` applies to the calls that start after it, never to calls in progress
    (their setup has already built their nodes). Build it with :func:`agent_factory_from_config`.
    """

    _REMEMBERED_CALLS = 256

    def __init__(
        self,
        holder: ConfigHolder,
        *,
        synthesizer_factory: Callable[[AgentConfig], Synthesizer] | None = None,
        llm_factory: LLMFactory | None = None,
        tool_loader: ToolLoader | None = None,
    ) -> None:
        self._holder = holder
        self._synthesizer_factory = synthesizer_factory
        self._llm_factory = llm_factory
        self._tool_loader = tool_loader
        # agent name -> (the agent's config it was built from, its setup)
        self._setups: dict[str, tuple[AgentConfig, SetupFn]] = {}
        self._synths: dict[str, tuple[AgentConfig, Synthesizer]] = {}
        # call SID -> its agent, so that its setup and its synthesizer come from one snapshot
        self._calls: OrderedDict[str, AgentConfig] = OrderedDict()

    def agent_for(self, call: CallInfo) -> AgentConfig:
        """The call's agent: ``agents[call.agent]``, else the one for the number called."""
        agent = self._calls.get(call.call_sid)
        if agent is not None:
            return agent
        cfg = self._holder.current
        agent = cfg.agents.get(call.agent)
        if agent is None:
            agent = cfg.agent_for_number(call.to_number or None)
            if call.agent not in ("", "default"):
                logger.warning("call %s: no agent %r; %s answers it (number %s)", call.call_sid,
                               call.agent, agent.name, call.to_number)  # fmt: skip
        self._calls[call.call_sid] = agent
        while len(self._calls) > self._REMEMBERED_CALLS:
            self._calls.popitem(last=False)
        return agent

    def __call__(self, call: CallInfo) -> SetupFn:
        """The setup function of ``call``'s agent."""
        agent = self.agent_for(call)
        cached = self._setups.get(agent.name)
        if cached is None or cached[0] is not agent:
            setup = setup_from_config(
                agent, llm_factory=self._llm_factory, tool_loader=self._tool_loader
            )
            cached = self._setups[agent.name] = (agent, setup)
        return cached[1]

    def synthesizer(self, call: CallInfo) -> Synthesizer:
        """The TTS of ``call``'s agent (for a worker that takes one synthesizer per call)."""
        return self.synthesizer_for_agent(self.agent_for(call))

    def synthesizer_for_agent(self, agent: AgentConfig) -> Synthesizer:
        """The TTS of ``agent``, made once per agent and TTS setting."""
        cached = self._synths.get(agent.name)
        if cached is not None and cached[0].tts == agent.tts:
            return cached[1]
        factory = self._synthesizer_factory
        if factory is None:
            from ._runner import synthesizer_for

            factory = synthesizer_for
        synth = factory(agent)
        self._synths[agent.name] = (agent, synth)
        return synth


def agent_factory_from_config(
    holder: ConfigHolder,
    *,
    synthesizer_factory: Callable[[AgentConfig], Synthesizer] | None = None,
    llm_factory: LLMFactory | None = None,
    tool_loader: ToolLoader | None = None,
) -> ConfigAgentFactory:
    """An ``AgentFactory`` for ``SessionWorker`` from a config holder.

    Each call gets ``cfg.agents[call.agent]`` (else ``cfg.agent_for_number(call.to_number)``)
    of ``holder.current`` at the moment the call starts.

    Args:
        holder: The config in force (reloaded elsewhere).
        synthesizer_factory: ``agent -> Synthesizer`` behind ``.synthesizer(call)`` (default:
            ``nodes.synthesizer_for``).
        llm_factory: See :func:`setup_from_config`.
        tool_loader: See :func:`setup_from_config`.
    """
    return ConfigAgentFactory(
        holder,
        synthesizer_factory=synthesizer_factory,
        llm_factory=llm_factory,
        tool_loader=tool_loader,
    )
