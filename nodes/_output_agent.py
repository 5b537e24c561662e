"""OutputAgentNode: a node whose words reach the caller.

On ``system.llm.request`` the node runs ``generate_response()`` inside its loop task and emits
``agent.llm.response.start``, one ``agent.llm.response.chunk`` per yielded string and
``agent.llm.response.end`` (also when the generation fails or is cancelled by a barge-in; a failure
additionally emits ``agent.error``).

The node keeps the conversation in ``self.context``: user messages arrive as
``agent.transcript.update`` events, and the node records what it says itself: the text it yields
becomes one assistant message (created at the first non-empty chunk, so an LLM call made before
it does not see an empty assistant turn), and ``speak(text)`` adds one too. Do not add your own
assistant text message. When the caller barges in, the session worker cuts that message to what
the caller actually heard (``_truncate_response``); a node with ``is_interruptible=False`` is never
cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ._context import ContextManager
from ._events import (
    OutputAgentSettings,
    SDKAgentErrorEvent,
    SDKAgentLLMResponseChunkEvent,
    SDKAgentLLMResponseEndEvent,
    SDKAgentLLMResponseStartEvent,
    SDKAgentSpeakEvent,
    SDKAgentTranscriptUpdateEvent,
    SDKEvent,
    SDKSystemLLMRequestEvent,
    SDKSystemUpdateOutputAgentSettingsEvent,
    SDKSystemUserJoinedEvent,
)
from ._llm import tool_calls_message
from ._node import Node

__all__ = ["OutputAgentNode", "ResponsePacer"]

ResponsePacer = Callable[[str, int], Awaitable[None]]
"""``pacer(request_id, emitted)``: returns when the response ``request_id``, which has emitted
``emitted`` chunks, may produce its next one (the session worker: when the caller is about to
hear the last of them). Awaited before every chunk but the first."""

logger = logging.getLogger(__name__)

# LLM calls of one default response: a model that keeps calling tools is cut off after this many.
_MAX_TOOL_ROUNDS = 4

# Responses remembered for a later cut: a barge-in can arrive long after the text was generated,
# while the gateway is still playing it.
_REMEMBERED_RESPONSES = 64


@dataclass(slots=True)
class _Response:
    request_id: str
    message: dict[str, Any] | None = None
    frozen: bool = False  # cut by an interrupt: later chunks no longer reach the context


class OutputAgentNode(Node):
    """Base class for agents that talk to the caller.

    Subclasses implement ``generate_response()``, an async generator of text chunks.

    Args:
        name: Node name (defaults to the class name).
        is_interruptible: False for messages the caller must hear in full (payments, legal
            disclosures): a barge-in neither cancels nor cuts them.

    Attributes:
        context: The conversation (OpenAI-format messages).
        settings: Output settings the platform may update.
        greeting: If set, spoken when the caller joins (``system.user.joined``).
        llm: The node's LLM (``OpenAIClient`` or anything with its streaming ``chat``). As in
            smallestai, a node sets it itself; a node declared in YAML (``kind: python``) that
            does not gets the one of its ``llm`` (default: the agent's).
        tool_registry: Its ``ToolRegistry``; from YAML, the node's ``tools`` (``module:function``).
        tool_schemas: ``tool_registry.get_schemas()`` (JSON schema from signature and docstring).
    """

    greeting: str | None = None
    llm: Any = None
    tool_registry: Any = None
    tool_schemas: Any = None
    _llm_prompt: str | None = None  # the YAML ``llm.prompt``, for the default generate_response

    def __init__(self, name: str | None = None, is_interruptible: bool = True) -> None:
        super().__init__(name, is_interruptible)
        self.settings = OutputAgentSettings()
        self.context = ContextManager()
        self._responses: OrderedDict[str, _Response] = OrderedDict()
        # The response ``_handle_llm_request`` is generating (None between responses): what
        # the worker compares a dropped reply's id with (``_cancel_generation``).
        self._generation: _Response | None = None
        # Set by the AgentSession at start: None generates as fast as the chunks are taken.
        self._pacer: ResponsePacer | None = None

    async def process_event(self, event: SDKEvent) -> None:
        """Act on the event, then pass it on to the children."""
        await super().process_event(event)
        if isinstance(event, SDKSystemLLMRequestEvent):
            await self._handle_llm_request()
        elif isinstance(event, SDKAgentTranscriptUpdateEvent):
            self.context.add_message({"role": event.role, "content": event.content})
            event._mark_applied()
        elif isinstance(event, SDKSystemUpdateOutputAgentSettingsEvent):
            await self._update_settings(event.settings)
        elif isinstance(event, SDKSystemUserJoinedEvent) and self.greeting:
            await self.speak(self.greeting)
        await self.send_event(event)

    async def _update_settings(self, settings: dict[str, Any]) -> None:
        for key, value in settings.items():
            setattr(self.settings, key, value)

    async def speak(self, text: str) -> None:
        """Say ``text`` as one utterance (also recorded as an assistant message)."""
        if not self.is_running:
            logger.warning("[%s] not running, cannot speak", self.name)
            return
        response = self._new_response()
        self._record(response, text)
        await self._emit(SDKAgentSpeakEvent(text=text, request_id=response.request_id))

    async def generate_response(self) -> AsyncIterator[str]:
        """Yield the response's text chunks; read the conversation from ``self.context``.

        This default (for a node that defines none, e.g. the seed's ``MyAgent`` declared in
        YAML) answers with ``self.llm`` and the conversation (after ``llm.prompt`` as the system
        prompt), runs the tools of ``self.tool_registry`` the model calls and streams its answer
        to their results. Without ``self.llm`` it raises ``NotImplementedError``.
        """
        llm = self.llm
        if llm is None:
            raise NotImplementedError(
                f"{type(self).__name__} must implement generate_response() or have an llm"
            )
        for _ in range(_MAX_TOOL_ROUNDS):
            messages = list(self.context.messages)
            if self._llm_prompt:
                messages.insert(0, {"role": "system", "content": self._llm_prompt})
            calls: list[Any] = []
            stream = await llm.chat(messages=messages, stream=True,
                                    tools=self.tool_schemas or None)
            async with contextlib.aclosing(self._stream_reply(stream, calls)) as texts:
                async for text in texts:
                    yield text
            if not calls or self.tool_registry is None or self._generation_frozen():
                return  # (frozen: the caller hears no more of it; its tools do not run)
            results = await self.tool_registry.execute(calls, parallel=True)
            if self._generation_frozen():
                return  # cut while its tools ran: their results stay out of the context
            self._add_before_reply([tool_calls_message(calls), *(r.to_message() for r in results)])
        logger.warning("[%s] still calling tools after %d rounds; reply cut short", self.name,
                       _MAX_TOOL_ROUNDS)

    @staticmethod
    async def _stream_reply(stream: Any, calls: list[Any]) -> AsyncGenerator[str, None]:
        """The text of one streamed LLM answer; the tool calls it asks for go into ``calls``.
        The stream is closed however the loop ends (a barge-in cancels the generation: this
        stops its HTTP stream)."""
        try:
            async for chunk in stream:
                if chunk.content:
                    yield chunk.content
                if chunk.tool_calls:
                    calls.extend(chunk.tool_calls)
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

    def _reply_message(self) -> dict[str, Any] | None:
        """The assistant message of the response being generated (None before its first text)."""
        if not self._responses:
            return None
        return next(reversed(self._responses.values())).message

    def _add_before_reply(self, messages: list[dict[str, Any]]) -> None:
        # The response keeps one assistant message (the one a barge-in cuts to what was heard),
        # so tool messages go before it: the stored conversation stays valid for the API.
        reply = self._reply_message()
        stored = self.context.messages
        index = next((i for i, m in enumerate(stored) if m is reply), len(stored))
        stored[index:index] = messages

    def _generation_frozen(self) -> bool:
        """The response being generated was cut (a barge-in, or dropped unheard by the
        gateway): nothing more of it is heard, so it must not act (tools, tool messages,
        hang-up, transfer, handover)."""
        return self._generation is not None and self._generation.frozen

    async def _cancel_generation(self, request_id: str) -> bool:
        """Cancel the loop's work if it is generating response ``request_id``; queued events
        stay queued (unlike ``_handle_interrupt``, which a user's node may override for
        barge-ins). Returns False, changing nothing, when it is not (it has not begun, it has
        ended, or the loop is in another event)."""
        response = self._generation
        old = self._loop_task
        if (response is None or response.request_id != request_id or old is None
                or not self._running or old is asyncio.current_task()):
            return False
        self._epoch += 1  # what it emitted from now on is stale (SDKEvent.is_stale)
        self._processing = None
        await self._restart_loop(old)
        return True

    # -- internals --------------------------------------------------------------------------
    def _new_response(self) -> _Response:
        response = _Response(request_id=uuid.uuid4().hex[:16])
        self._responses[response.request_id] = response
        while len(self._responses) > _REMEMBERED_RESPONSES:
            self._responses.popitem(last=False)
        return response

    def _record(self, response: _Response, text: str) -> None:
        if response.frozen or not text:
            return
        if response.message is None:
            response.message = {"role": "assistant", "content": text}
            self.context.add_message(response.message)
        else:
            response.message["content"] += text

    def _unrecord(self, response: _Response, text: str) -> None:
        message = response.message
        if response.frozen or not text or message is None:
            return
        content = message["content"]
        if content.endswith(text):
            message["content"] = content[: len(content) - len(text)]
        if not message["content"]:
            self.context.remove_message(message)
            response.message = None

    def _truncate_response(self, request_id: str, text: str) -> bool:
        """Cut the assistant message of response ``request_id`` to ``text`` (what was heard).

        Later chunks of that response are no longer recorded. An empty ``text`` removes the
        message. Returns False when the response is unknown (too old).
        """
        response = self._responses.get(request_id)
        if response is None:
            return False
        response.frozen = True
        if response.message is not None:
            if text:
                response.message["content"] = text
            else:
                self.context.remove_message(response.message)
                response.message = None
        return True

    async def _emit(self, event: SDKEvent) -> None:
        event._origin = self
        event._epoch = self._epoch
        await self.send_event(event)

    async def _handle_llm_request(self) -> None:
        response = self._new_response()
        rid = response.request_id
        self._generation = response
        await self._emit(SDKAgentLLMResponseStartEvent(request_id=rid))
        chunks = self.generate_response()
        emitted = 0
        try:
            while True:
                # The generator runs on (its code after a ``yield``) only once the pacer says
                # the caller is about to hear what it yielded last: a node's state at a
                # barge-in is where the caller was, not where text to speech was.
                if emitted and self._pacer is not None:
                    await self._pacer(rid, emitted)
                try:
                    chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    break
                emitted += 1
                text = "" if chunk is None else str(chunk)
                self._record(response, text)
                try:
                    await self._emit(SDKAgentLLMResponseChunkEvent(text=text, request_id=rid))
                except asyncio.CancelledError:
                    # Cancelled while waiting to hand the chunk over: it was never said.
                    self._unrecord(response, text)
                    raise
        except Exception as exc:
            logger.exception("[%s] error during generation", self.name)
            await self._emit(SDKAgentErrorEvent(message=str(exc) or type(exc).__name__))
        finally:
            # Close the generator here, not at garbage collection: that is what stops an LLM
            # stream (and its HTTP request) that a barge-in cancelled.
            try:
                aclose = getattr(chunks, "aclose", None)
                if aclose is not None:
                    await aclose()
            finally:
                if self._generation is response:
                    self._generation = None
                await self._emit(SDKAgentLLMResponseEndEvent(request_id=rid))
