"""OpenAIClient against the local OpenAI-compatible server (real HTTP and SSE)."""

from __future__ import annotations

import asyncio

import pytest

from nodes import ChatChunk, LLMError, OpenAIClient, ToolCall

from ..openai_server import Mark, OpenAIServer, Text, ToolCallStep, Wait
from .conftest import guard

MESSAGES = [{"role": "user", "content": "hi"}]


async def test_streaming_both_call_styles(llm: OpenAIClient, openai_server: OpenAIServer) -> None:
    openai_server.respond(Text("Hel"), Text("lo"))
    openai_server.respond(Text("again"))
    awaited = [c async for c in await llm.chat(messages=MESSAGES, stream=True)]
    direct = [c async for c in llm.chat(messages=MESSAGES, stream=True)]
    assert [c.content for c in awaited if c.content] == ["Hel", "lo"]
    assert awaited[-1] == ChatChunk(content=None, tool_calls=None, finish_reason="stop")
    assert [c.content for c in direct if c.content] == ["again"]


async def test_tool_call_deltas_are_accumulated(
    llm: OpenAIClient, openai_server: OpenAIServer
) -> None:
    openai_server.respond(
        Text("Looking."),
        ToolCallStep("call_a", "lookup", '{"q": "first", "n": 1}', pieces=5),
        ToolCallStep("call_b", "lookup", '{"q": "second"}', pieces=1),
    )
    chunks = [c async for c in llm.chat(MESSAGES, stream=True, tools=[])]
    with_calls = [c for c in chunks if c.tool_calls]
    assert len(with_calls) == 1 and with_calls[0] is chunks[-1]
    assert with_calls[0].tool_calls == [
        ToolCall("call_a", "lookup", '{"q": "first", "n": 1}'),
        ToolCall("call_b", "lookup", '{"q": "second"}'),
    ]
    assert with_calls[0].finish_reason == "tool_calls"
    assert with_calls[0].tool_calls[0].parsed_arguments() == {"q": "first", "n": 1}


async def test_request_parameters(openai_server: OpenAIServer) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    openai_server.respond(Text("x"))
    async with OpenAIClient(
        "my-model",
        api_key="sk-test",
        base_url=openai_server.base_url,
        temperature=0.2,
        max_tokens=50,
        max_retries=0,
        top_p=0.9,
    ) as client:
        _ = [c async for c in client.chat(MESSAGES, stream=True, tools=tools, temperature=0.7)]
    request = openai_server.requests[0]
    assert request.path == "/v1/chat/completions"
    assert request.headers["Authorization"] == "Bearer sk-test"
    body = request.body
    assert body["model"] == "my-model"
    assert body["temperature"] == 0.7 and body["max_tokens"] == 50 and body["top_p"] == 0.9
    assert body["tools"] == tools
    assert body["stream_options"] == {"include_usage": True}


async def test_non_streaming(llm: OpenAIClient, openai_server: OpenAIServer) -> None:
    openai_server.respond(Text("Sure."), ToolCallStep("call_1", "f", '{"a": 1}'))
    reply = await llm.chat(MESSAGES)
    assert reply.content == "Sure."
    assert reply.tool_calls == [ToolCall("call_1", "f", '{"a": 1}')]
    assert reply.usage is not None and reply.usage["total_tokens"] > 0
    assert "stream" not in openai_server.requests[0].body


async def test_errors_become_llm_errors(llm: OpenAIClient, openai_server: OpenAIServer) -> None:
    openai_server.fail(503, "overloaded")
    with pytest.raises(LLMError, match="overloaded") as info:
        _ = [c async for c in llm.chat(MESSAGES, stream=True)]
    assert info.value.__cause__ is not None
    bad = [{"role": "tool", "tool_call_id": "nope", "content": "x"}]
    with pytest.raises(LLMError, match="must be a response to a preceding message"):
        await llm.chat(bad)


async def test_aclose_mid_stream_closes_the_http_response(
    llm: OpenAIClient, openai_server: OpenAIServer
) -> None:
    sent, gate = asyncio.Event(), asyncio.Event()
    reply = openai_server.respond(Text("one"), Mark(sent), Wait(gate), Text("two"))
    stream = await llm.chat(MESSAGES, stream=True)
    async for chunk in stream:
        if chunk.content == "one":
            break
    await stream.aclose()
    await guard(reply.disconnected.wait())
    assert not reply.finished.is_set()


def test_missing_api_key_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(LLMError, match="API key"):
        OpenAIClient()
