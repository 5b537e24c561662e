"""ScriptedLLM: an offline, deterministic stand-in for ``OpenAIClient`` that answers from keyword
rules (``config.ScriptRule``).

It has the same ``chat(messages, stream=..., tools=...)`` as ``OpenAIClient``, so a declarative
node runs the same with either. For each request it reads the conversation backwards to the
latest user message:

* the first rule whose ``matches(text)`` is true gives the reply, streamed in chunks of a few
  words (``ChatChunk.content``);
* no rule matches: the ``fallback`` (default: "Sorry, I didn't catch that. You can say ..." with
  the first keyword of each rule);
* no user message, or a ``system`` message after the latest one: an empty reply. A system
  message after the caller's turn is the platform's note that this node has just taken the
  conversation over (``ConfiguredLLMNode`` adds it to the request of a node that takes over
  without a greeting), so a scripted node that takes over says nothing until the caller speaks.
  Assistant and tool messages after the caller's turn do not matter: the reply of the node that
  handed over, or the new node's greeting, may come before the caller's turn reaches it.

A rule's actions come after its reply as tool calls, the way a real model asks for them:
``goto`` as ``callgate_handover {"node": ...}``, ``transfer_to`` as
``callgate_transfer {"to": ...}`` and ``hangup`` as ``callgate_hangup {}``, in that order.
``ConfiguredLLMNode`` (``nodes._agents``) carries them out once the reply has ended; they are
never sent to a tool registry. The ``tools`` argument is accepted and ignored: rules call no
other tools.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Generator, Sequence
from typing import Any

from config import ScriptRule

from ._llm import ChatChunk, ChatResponse, ToolCall, _ChatClient, _ChatRequest

__all__ = ["CONTROL_TOOLS", "HANDOVER_TOOL", "HANGUP_TOOL", "TRANSFER_TOOL", "ScriptedLLM"]

HANDOVER_TOOL = "callgate_handover"
"""Tool call of a rule with ``goto``: ``{"node": NAME}``."""
TRANSFER_TOOL = "callgate_transfer"
"""Tool call of a rule with ``transfer_to``: ``{"to": E164}``."""
HANGUP_TOOL = "callgate_hangup"
"""Tool call of a rule with ``hangup: true``: ``{}``."""
CONTROL_TOOLS = frozenset({HANDOVER_TOOL, TRANSFER_TOOL, HANGUP_TOOL})
"""Tool names that act on the call rather than run a function."""

_WORD = re.compile(r"\S+\s*")


def _default_fallback(rules: Sequence[ScriptRule]) -> str:
    """"Sorry, I didn't catch that." and, when there are rules, what the caller can say."""
    firsts = list(dict.fromkeys(rule.keywords[0].strip() for rule in rules))
    if not firsts:
        return "Sorry, I didn't catch that."
    if len(firsts) == 1:
        options = firsts[0]
    else:
        options = ", ".join(firsts[:-1]) + " or " + firsts[-1]
    return f"Sorry, I didn't catch that. You can say {options}."


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return " ".join(
            str(part.get("text", "")) for part in content if isinstance(part, dict)
        )
    return ""


class _ScriptedStream:
    """The streamed answer: ``async for`` it; ``await`` gives the stream itself."""

    def __init__(self, chunks: list[ChatChunk]) -> None:
        self._chunks = chunks

    def __await__(self) -> Generator[Any, None, _ScriptedStream]:
        async def itself() -> _ScriptedStream:
            return self

        return itself().__await__()

    def __aiter__(self) -> AsyncIterator[ChatChunk]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[ChatChunk]:
        for chunk in self._chunks:
            yield chunk

    async def aclose(self) -> None:
        """Nothing to release (kept for symmetry with ``ChatStream``)."""


class _ScriptedCall:
    def __init__(self, response: ChatResponse) -> None:
        self._response = response

    def __await__(self) -> Generator[Any, None, ChatResponse]:
        async def response() -> ChatResponse:
            return self._response

        return response().__await__()


class ScriptedLLM(_ChatClient[_ScriptedStream, _ScriptedCall]):
    """Answers from keyword rules, offline; a drop-in for ``OpenAIClient`` in declarative nodes.

    Args:
        rules: Tried in order; the first that matches the caller's latest message wins.
        fallback: The reply when no rule matches (default: "Sorry, I didn't catch that. You can
            say ..." and the first keyword of each rule).
        words_per_chunk: Words per streamed chunk.
    """

    def __init__(
        self,
        rules: Sequence[ScriptRule] = (),
        *,
        fallback: str | None = None,
        words_per_chunk: int = 4,
    ) -> None:
        if words_per_chunk < 1:
            raise ValueError(f"words_per_chunk must be at least 1, got {words_per_chunk}")
        self.rules: tuple[ScriptRule, ...] = tuple(rules)
        self.fallback = fallback if fallback is not None else _default_fallback(self.rules)
        self._words_per_chunk = words_per_chunk
        self._calls = 0

    def _chat(self, request: _ChatRequest) -> _ScriptedStream | _ScriptedCall:
        # ``tools`` and ``overrides`` are ignored: rules call only the control tools.
        reply, calls = self.answer(request.messages)
        if not request.stream:
            return _ScriptedCall(ChatResponse(content=reply or None, tool_calls=calls))
        chunks = [ChatChunk(content=piece) for piece in self._pieces(reply)]
        if calls:
            chunks.append(ChatChunk(tool_calls=calls, finish_reason="tool_calls"))
        else:
            chunks.append(ChatChunk(finish_reason="stop"))
        return _ScriptedStream(chunks)

    def answer(self, messages: Sequence[dict[str, Any]]) -> tuple[str, list[ToolCall]]:
        """The reply and the control tool calls for ``messages`` (see the module docstring)."""
        text: str | None = None
        for message in reversed(messages):
            role = message.get("role")
            if role == "user":
                text = _text_of(message.get("content"))
                break
            if role in ("system", "developer"):
                return "", []  # a note after the caller's turn: nothing to answer
        if text is None:
            return "", []
        rule = next((r for r in self.rules if r.matches(text)), None)
        if rule is None:
            return self.fallback, []
        calls: list[ToolCall] = []
        if rule.goto is not None:
            calls.append(self._call(HANDOVER_TOOL, {"node": rule.goto}))
        if rule.transfer_to is not None:
            calls.append(self._call(TRANSFER_TOOL, {"to": rule.transfer_to}))
        if rule.hangup:
            calls.append(self._call(HANGUP_TOOL, {}))
        return (rule.reply or "").strip(), calls

    def _call(self, name: str, arguments: dict[str, Any]) -> ToolCall:
        self._calls += 1
        return ToolCall(id=f"call_script_{self._calls}", name=name, arguments=json.dumps(arguments))

    def _pieces(self, text: str) -> list[str]:
        words = _WORD.findall(text.strip())
        n = self._words_per_chunk
        return ["".join(words[i : i + n]) for i in range(0, len(words), n)]
