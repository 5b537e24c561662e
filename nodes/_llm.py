"""OpenAIClient: chat completions from OpenAI or any OpenAI-compatible server.

``chat(...)`` returns a call object that works both ways the smallestai documents use it::

    response = await llm.chat(messages=m, stream=True)   # then: async for chunk in response
    async for chunk in llm.chat(messages=m, stream=True): ...
    reply = await llm.chat(messages=m)                    # ChatResponse

A stream yields ``ChatChunk``s: one per text delta (``content``), and, when the model called
tools, a last chunk whose ``tool_calls`` holds the complete ``ToolCall``s (the streamed
deltas are accumulated per tool call index). Leaving the loop early, or cancelling the task
that reads it, closes the HTTP response, which stops the generation on the server.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Self, TypeVar, overload

import openai
from openai import AsyncOpenAI

from ._errors import LLMError

__all__ = ["ChatChunk", "ChatResponse", "ChatStream", "OpenAIClient", "ToolCall", "ToolResult"]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A function call requested by the model; ``arguments`` is the raw JSON string."""

    id: str
    name: str
    arguments: str = "{}"

    def parsed_arguments(self) -> dict[str, Any]:
        """``arguments`` decoded (an empty string counts as no arguments)."""
        if not self.arguments.strip():
            return {}
        value = json.loads(self.arguments)
        if not isinstance(value, dict):
            raise ValueError(f"tool arguments must be a JSON object, got {self.arguments!r}")
        return value


def tool_calls_message(calls: Iterable[ToolCall]) -> dict[str, Any]:
    """The assistant message that records the model's ``calls`` (before their results)."""
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ],
    }


@dataclass(frozen=True, slots=True)
class ToolResult:
    """The outcome of one tool call, ready to go back to the model."""

    tool_call_id: str
    name: str
    content: str
    is_error: bool = False

    def to_message(self) -> dict[str, Any]:
        """The ``role: tool`` message for this result."""
        return {"role": "tool", "tool_call_id": self.tool_call_id, "content": self.content}


@dataclass(frozen=True, slots=True)
class ChatChunk:
    """One piece of a streamed reply."""

    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    finish_reason: str | None = None


@dataclass(frozen=True, slots=True)
class ChatResponse:
    """A complete (non-streamed) reply."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    usage: dict[str, int] | None = None


@dataclass(frozen=True, slots=True)
class _ChatRequest:
    """One ``chat`` call's arguments, as ``_ChatClient.chat`` hands them to ``_chat``."""

    messages: list[dict[str, Any]]
    stream: bool
    tools: list[dict[str, Any]] | None
    overrides: dict[str, Any]


_StreamT = TypeVar("_StreamT")
_CallT = TypeVar("_CallT")


class _ChatClient(Generic[_StreamT, _CallT]):
    """What ``OpenAIClient`` and ``nodes.ScriptedLLM`` share: ``chat``, typed by ``stream`` (a
    ``_StreamT`` with ``stream=True``, else a ``_CallT``) and answered by the subclass's
    ``_chat``; and ``async with`` closing the client at its end."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Release what the client holds (here: nothing)."""

    @overload
    def chat(
        self,
        messages: Iterable[dict[str, Any]],
        stream: Literal[True],
        tools: list[dict[str, Any]] | None = None,
        **overrides: Any,
    ) -> _StreamT: ...

    @overload
    def chat(
        self,
        messages: Iterable[dict[str, Any]],
        stream: Literal[False] = False,
        tools: list[dict[str, Any]] | None = None,
        **overrides: Any,
    ) -> _CallT: ...

    def chat(
        self,
        messages: Iterable[dict[str, Any]],
        stream: bool = False,
        tools: list[dict[str, Any]] | None = None,
        **overrides: Any,
    ) -> _StreamT | _CallT:
        """Request a chat completion.

        Args:
            messages: OpenAI-format messages (copied when called).
            stream: Stream the reply as ``ChatChunk``s.
            tools: Tool schemas, e.g. ``ToolRegistry.get_schemas()``.
            **overrides: Request parameters for this call only.

        Returns:
            With ``stream=True`` a stream of ``ChatChunk``s (also awaitable, giving itself);
            otherwise an awaitable of ``ChatResponse``.
        """
        return self._chat(_ChatRequest(list(messages), stream, tools, overrides))

    def _chat(self, request: _ChatRequest) -> _StreamT | _CallT:
        raise NotImplementedError


class ChatStream:
    """A streamed chat completion: ``async for`` it (the request starts on first iteration)."""

    def __init__(self, client: OpenAIClient, params: dict[str, Any]) -> None:
        self._client = client
        self._params = params
        self._iterator: AsyncGenerator[ChatChunk, None] | None = None

    def __await__(self) -> Generator[Any, None, ChatStream]:
        # ``await llm.chat(..., stream=True)`` hands back the stream itself.
        async def itself() -> ChatStream:
            return self

        return itself().__await__()

    def __aiter__(self) -> AsyncIterator[ChatChunk]:
        if self._iterator is None:
            self._iterator = self._client._stream(self._params)
        return self._iterator

    async def aclose(self) -> None:
        """Stop reading and close the HTTP response."""
        if self._iterator is not None:
            await self._iterator.aclose()


class _ChatCall:
    def __init__(self, client: OpenAIClient, params: dict[str, Any]) -> None:
        self._client = client
        self._params = params

    def __await__(self) -> Generator[Any, None, ChatResponse]:
        return self._client._complete(self._params).__await__()


class OpenAIClient(_ChatClient[ChatStream, _ChatCall]):
    """Chat client for OpenAI-compatible APIs, built on ``openai.AsyncOpenAI``.

    Args:
        model: Model name.
        api_key: API key; defaults to ``$OPENAI_API_KEY``.
        base_url: Base URL of an OpenAI-compatible API (``.../v1``).
        temperature: Default sampling temperature.
        max_tokens: Default completion token limit.
        client: Use this AsyncOpenAI instead of building one (it is then not closed by
            ``aclose``).
        max_retries: Passed to AsyncOpenAI; a voice turn rarely benefits from slow retries.
        timeout: Request timeout in seconds, passed to AsyncOpenAI.
        **default_params: Further request parameters sent with every call (``top_p``, ...).
    """

    def __init__(
        self,
        model: str = "gpt-4o-mini",
        api_key: str | None = None,
        base_url: str | None = None,
        temperature: float | None = None,
        max_tokens: int | None = None,
        *,
        client: AsyncOpenAI | None = None,
        max_retries: int = 1,
        timeout: float = 30.0,
        **default_params: Any,
    ) -> None:
        self.model = model
        self.temperature = temperature
        self.max_tokens = max_tokens
        self._defaults = default_params
        self._owns_client = client is None
        if client is None:
            key = api_key or os.environ.get("OPENAI_API_KEY")
            if not key:
                raise LLMError("no API key: pass api_key= or set OPENAI_API_KEY")
            client = AsyncOpenAI(
                api_key=key, base_url=base_url, max_retries=max_retries, timeout=timeout
            )
        self._client = client

    async def aclose(self) -> None:
        """Close the HTTP client (when this object built it)."""
        if self._owns_client:
            await self._client.close()

    def _chat(self, request: _ChatRequest) -> ChatStream | _ChatCall:
        params: dict[str, Any] = {"model": self.model, "messages": request.messages}
        if self.temperature is not None:
            params["temperature"] = self.temperature
        if self.max_tokens is not None:
            params["max_tokens"] = self.max_tokens
        if request.tools:
            params["tools"] = request.tools
        params.update(self._defaults)
        params.update({k: v for k, v in request.overrides.items() if v is not None})
        if request.stream:
            params["stream"] = True
            params.setdefault("stream_options", {"include_usage": True})
            return ChatStream(self, params)
        return _ChatCall(self, params)

    async def _complete(self, params: dict[str, Any]) -> ChatResponse:
        try:
            reply = await self._client.chat.completions.create(**params)
        except openai.OpenAIError as exc:
            raise LLMError(f"chat completion failed: {exc}") from exc
        usage = None
        if reply.usage is not None:
            usage = {
                "prompt_tokens": reply.usage.prompt_tokens,
                "completion_tokens": reply.usage.completion_tokens,
                "total_tokens": reply.usage.total_tokens,
            }
        if not reply.choices:
            return ChatResponse(content=None, usage=usage)
        message = reply.choices[0].message
        calls = [
            ToolCall(id=tc.id, name=tc.function.name, arguments=tc.function.arguments)
            for tc in (message.tool_calls or [])
            if tc.type == "function"
        ]
        return ChatResponse(content=message.content, tool_calls=calls, usage=usage)

    async def _stream(self, params: dict[str, Any]) -> AsyncGenerator[ChatChunk, None]:
        try:
            stream = await self._client.chat.completions.create(**params)
        except openai.OpenAIError as exc:
            raise LLMError(f"chat completion failed: {exc}") from exc
        # index -> [id, name, arguments]
        calls: dict[int, list[str]] = {}
        finish_reason: str | None = None
        try:
            async for chunk in stream:
                if not chunk.choices:
                    continue  # the usage chunk
                choice = chunk.choices[0]
                finish_reason = choice.finish_reason or finish_reason
                for delta in choice.delta.tool_calls or ():
                    acc = calls.setdefault(delta.index, ["", "", ""])
                    if delta.id:
                        acc[0] = delta.id
                    if delta.function is not None:
                        if delta.function.name:
                            acc[1] += delta.function.name
                        if delta.function.arguments:
                            acc[2] += delta.function.arguments
                if choice.delta.content or choice.finish_reason:
                    yield ChatChunk(
                        content=choice.delta.content or None, finish_reason=choice.finish_reason
                    )
        except openai.OpenAIError as exc:
            raise LLMError(f"chat completion stream failed: {exc}") from exc
        finally:
            await stream.close()
        if calls:
            yield ChatChunk(
                tool_calls=[
                    ToolCall(id=c[0], name=c[1], arguments=c[2] or "{}")
                    for _, c in sorted(calls.items())
                ],
                finish_reason=finish_reason,
            )
