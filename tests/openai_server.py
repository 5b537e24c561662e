"""A local OpenAI-compatible chat completions server for tests: real HTTP, real SSE.

``POST /v1/chat/completions`` answers from a queue of scripted responses, streamed in OpenAI's
exact chunk format (``chat.completion.chunk`` objects as ``data:`` lines, the role chunk first,
text deltas, tool call deltas, a finish chunk, the usage chunk when ``stream_options.include_usage``
asks for it, then ``data: [DONE]``), or as one ``chat.completion`` object when ``stream`` is off.
Every request is recorded.

A script is a list of steps::

    reply = server.respond(Text("Our hours are"), Wait(gate), Text(" nine to five."))
    reply = server.respond(Text("Checking."), ToolCallStep("call_1", "lookup", '{"q": "x"}'))

``Wait(event)`` holds the stream until the test sets the event; ``Mark(event)`` sets the event
once everything before it has been written to the socket. Each ``ScriptedResponse`` tells what
happened to it: ``started``, ``finished`` (sent to the end), ``disconnected`` (the client went
away mid-stream, e.g. because a barge-in cancelled the generation).

Requests are checked like OpenAI does for what the SDK relies on: a bearer token, a model, a list
of messages with roles, and every ``tool`` message answering a ``tool_calls`` id of the assistant
message before it; a violation is a 400 with OpenAI's error body.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from .scripted_server import Mark, ScriptedReply, ScriptedServer, Wait, openai_error

__all__ = [
    "Mark",
    "OpenAIServer",
    "RecordedRequest",
    "ScriptedResponse",
    "Text",
    "ToolCallStep",
    "Wait",
]

_CREATED = 1_700_000_000  # fixed, so recorded output is deterministic


@dataclass(frozen=True, slots=True)
class Text:
    """One text delta."""

    content: str


@dataclass(frozen=True, slots=True)
class ToolCallStep:
    """One tool call, streamed as a header delta and ``pieces`` argument deltas."""

    id: str
    name: str
    arguments: str = "{}"
    pieces: int = 2


Step = Text | ToolCallStep | Wait | Mark


@dataclass(slots=True)
class RecordedRequest:
    """A request as the server received it."""

    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass(eq=False, slots=True)
class ScriptedResponse(ScriptedReply):
    """One scripted answer and what became of it (``request``: a ``RecordedRequest``)."""

    steps: list[Step]
    finish_reason: str | None = None

    @property
    def text(self) -> str:
        """All the text this response streams."""
        return "".join(s.content for s in self.steps if isinstance(s, Text))




def _check_messages(messages: Any) -> str | None:
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty array"
    open_ids: set[str] = set()
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in (
            "system",
            "developer",
            "user",
            "assistant",
            "tool",
        ):
            return f"messages[{i}] has no valid role"
        role = message["role"]
        if role == "tool":
            if message.get("tool_call_id") not in open_ids:
                return (
                    f"messages[{i}]: a message with role 'tool' must be a response to a preceding "
                    "message with 'tool_calls'"
                )
            if not isinstance(message.get("content"), str):
                return f"messages[{i}].content must be a string"
            continue
        open_ids = set()
        if role == "assistant":
            for call in message.get("tool_calls") or ():
                try:
                    json.loads(call["function"]["arguments"])
                except (KeyError, TypeError, ValueError):
                    return f"messages[{i}].tool_calls has invalid function arguments"
                open_ids.add(call.get("id"))
    return None


class OpenAIServer(ScriptedServer):
    """The server; ``async with OpenAIServer() as server: ... server.base_url``.

    Args:
        model: The model name echoed in responses.
        host: Interface to listen on (a free port is picked).
    """

    def __init__(self, *, model: str = "gpt-test", host: str = "127.0.0.1") -> None:
        super().__init__(host=host)
        self.model = model
        self._queue: deque[ScriptedResponse] = deque()
        self.requests: list[RecordedRequest] = []
        self._counter = 0

    def _routes(self, app: web.Application) -> None:
        # A client that disconnects cancels its handler: ScriptedResponse.disconnected.
        app.router.add_post("/v1/chat/completions", self._tracked(self._serve))

    # -- scripting --------------------------------------------------------------------------
    def respond(self, *steps: Step, finish_reason: str | None = None) -> ScriptedResponse:
        """Queue the answer to the next request."""
        reply = ScriptedResponse(list(steps), finish_reason)
        self._queue.append(reply)
        return reply

    def fail(self, status: int, message: str) -> ScriptedResponse:
        """Queue an error answer (OpenAI's error body) for the next request."""
        reply = ScriptedResponse([], status=status, error_message=message)
        self._queue.append(reply)
        return reply

    @property
    def pending(self) -> int:
        """Scripted answers not yet used."""
        return len(self._queue)

    # -- serving ----------------------------------------------------------------------------
    async def _serve(self, request: web.Request) -> web.StreamResponse:
        if not request.headers.get("Authorization", "").startswith("Bearer "):
            return openai_error(401, "You didn't provide an API key.", "invalid_api_key")
        try:
            body = await request.json()
        except ValueError:
            return openai_error(400, "We could not parse the JSON body of your request.")
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            return openai_error(400, "you must provide a model parameter")
        problem = _check_messages(body.get("messages"))
        if problem:
            return openai_error(400, problem)
        recorded = RecordedRequest(request.path, dict(request.headers), body)
        self.requests.append(recorded)
        reply = self._start_reply(self._queue, recorded, "openai_server: no scripted response left")
        if isinstance(reply, web.Response):
            return reply
        self._counter += 1
        completion_id = f"chatcmpl-test{self._counter:06d}"
        if body.get("stream"):
            return await self._stream(request, body, reply, completion_id)
        return await self._complete(reply, completion_id)

    def _finish_reason(self, reply: ScriptedResponse) -> str:
        if reply.finish_reason:
            return reply.finish_reason
        return "tool_calls" if any(isinstance(s, ToolCallStep) for s in reply.steps) else "stop"

    async def _complete(self, reply: ScriptedResponse, completion_id: str) -> web.Response:
        for step in reply.steps:
            if isinstance(step, Wait):
                await step.event.wait()
            elif isinstance(step, Mark):
                step.event.set()
        calls = [s for s in reply.steps if isinstance(s, ToolCallStep)]
        message: dict[str, Any] = {
            "role": "assistant",
            "content": reply.text or None,
            "refusal": None,
            "annotations": [],
        }
        if calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in calls
            ]
        reply.finished.set()
        return web.json_response(
            {
                "id": completion_id,
                "object": "chat.completion",
                "created": _CREATED,
                "model": self.model,
                "system_fingerprint": "fp_test",
                "choices": [
                    {
                        "index": 0,
                        "message": message,
                        "logprobs": None,
                        "finish_reason": self._finish_reason(reply),
                    }
                ],
                "usage": self._usage(reply),
            }
        )

    @staticmethod
    def _usage(reply: ScriptedResponse) -> dict[str, int]:
        completion = max(1, len(reply.text) // 4)
        return {
            "prompt_tokens": 10,
            "completion_tokens": completion,
            "total_tokens": 10 + completion,
        }

    async def _stream(
        self,
        request: web.Request,
        body: dict[str, Any],
        reply: ScriptedResponse,
        completion_id: str,
    ) -> web.StreamResponse:
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)

        def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
            data: dict[str, Any] = {
                "id": completion_id,
                "object": "chat.completion.chunk",
                "created": _CREATED,
                "model": self.model,
                "system_fingerprint": "fp_test",
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
                ],
            }
            if include_usage:
                data["usage"] = None
            return data

        async def send(data: dict[str, Any] | str) -> None:
            text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
            await response.write(f"data: {text}\n\n".encode())

        with self._streaming(reply):
            await send(chunk({"role": "assistant", "content": "", "refusal": None}))
            call_index = 0
            for step in reply.steps:
                if isinstance(step, Text):
                    await send(chunk({"content": step.content}))
                elif isinstance(step, ToolCallStep):
                    header = {
                        "index": call_index,
                        "id": step.id,
                        "type": "function",
                        "function": {"name": step.name, "arguments": ""},
                    }
                    await send(chunk({"tool_calls": [header]}))
                    size = max(1, -(-len(step.arguments) // max(1, step.pieces)))
                    for start in range(0, len(step.arguments), size):
                        piece = step.arguments[start : start + size]
                        delta = {"index": call_index, "function": {"arguments": piece}}
                        await send(chunk({"tool_calls": [delta]}))
                    call_index += 1
                elif isinstance(step, Wait):
                    await step.event.wait()
                elif isinstance(step, Mark):
                    step.event.set()
            await send(chunk({}, self._finish_reason(reply)))
            if include_usage:
                await send(
                    {
                        "id": completion_id,
                        "object": "chat.completion.chunk",
                        "created": _CREATED,
                        "model": self.model,
                        "system_fingerprint": "fp_test",
                        "choices": [],
                        "usage": self._usage(reply),
                    }
                )
            await send("[DONE]")
            await response.write_eof()
        return response
