"""@function_tool schemas and ToolRegistry execution."""

from __future__ import annotations

import asyncio
import enum
import json
from typing import Annotated, Any, Literal

import pytest

from nodes import ToolCall, ToolNotDecoratedError, ToolRegistry, function_tool


class Unit(enum.Enum):
    CELSIUS = "celsius"
    FAHRENHEIT = "fahrenheit"


@function_tool
async def forecast(
    city: str,
    days: int,
    unit: Unit = Unit.CELSIUS,
    hourly: bool = False,
    tags: list[str] | None = None,
    detail: Literal["short", "long"] = "short",
    limit: Annotated[float, "upper bound in mm"] = 1.0,
) -> dict[str, Any]:
    """Get the weather forecast.

    Longer explanation that is part of the summary.

    Args:
        city: City and country,
            e.g. "Paris, France".
        days: How many days ahead.
        unit: Temperature unit.
        hourly: Hour by hour.
        tags: Labels.
        detail: How much to say.
        limit: Ignored, Annotated wins.

    Returns:
        The forecast.
    """
    return {"city": city, "days": days}


def test_schema_from_signature_and_docstring() -> None:
    registry = ToolRegistry()
    registry.register(forecast)
    (schema,) = registry.get_schemas()
    assert schema["type"] == "function"
    function = schema["function"]
    assert function["name"] == "forecast"
    assert function["description"] == (
        "Get the weather forecast. Longer explanation that is part of the summary."
    )
    params = function["parameters"]
    assert params["required"] == ["city", "days"]
    props = params["properties"]
    assert props["city"] == {
        "type": "string",
        "description": 'City and country, e.g. "Paris, France".',
    }
    assert props["days"] == {"type": "integer", "description": "How many days ahead."}
    assert props["unit"] == {
        "type": "string",
        "enum": ["celsius", "fahrenheit"],
        "description": "Temperature unit.",
    }
    assert props["hourly"]["type"] == "boolean"
    assert props["tags"] == {"type": "array", "items": {"type": "string"}, "description": "Labels."}
    assert props["detail"]["enum"] == ["short", "long"]
    assert props["limit"] == {"type": "number", "description": "upper bound in mm"}


def test_overrides_methods_and_discover() -> None:
    class Desk:
        def __init__(self) -> None:
            self.opened: list[str] = []

        @function_tool(name="open_ticket", description="Open a support ticket.")
        def open(self, subject: str) -> str:
            self.opened.append(subject)
            return f"ticket for {subject}"

        @property
        def explodes(self) -> None:
            raise AssertionError("discover must not evaluate properties")

    desk = Desk()
    registry = ToolRegistry()
    registry.discover(desk)
    assert registry.names == ["open_ticket"]
    (schema,) = registry.get_schemas()
    assert schema["function"]["description"] == "Open a support ticket."
    assert "self" not in schema["function"]["parameters"]["properties"]
    (result,) = asyncio.run(
        registry.execute([ToolCall("c1", "open_ticket", '{"subject": "router"}')])
    )
    assert (result.content, result.is_error) == ("ticket for router", False)
    assert desk.opened == ["router"]


def test_register_refuses_plain_functions() -> None:
    def plain(x: int) -> int:
        return x

    with pytest.raises(ToolNotDecoratedError, match="plain"):
        ToolRegistry().register(plain)


async def test_execute_turns_failures_into_error_results() -> None:
    @function_tool
    async def boom(reason: str) -> str:
        """Fail."""
        raise RuntimeError(reason)

    @function_tool
    def add(a: int, b: int) -> int:
        """Add."""
        return a + b

    registry = ToolRegistry()
    registry.register(boom)
    registry.register(add)
    results = await registry.execute(
        [
            ToolCall("1", "add", '{"a": 2, "b": 3, "ignored": true}'),
            ToolCall("2", "boom", '{"reason": "disk full"}'),
            ToolCall("3", "nope", "{}"),
            ToolCall("4", "add", "{not json"),
            ToolCall("5", "add", "[1, 2]"),
        ]
    )
    assert [r.tool_call_id for r in results] == ["1", "2", "3", "4", "5"]
    assert (results[0].content, results[0].is_error) == ("5", False)
    assert results[1].is_error and results[1].content == "RuntimeError: disk full"
    assert results[2].is_error and "unknown tool 'nope'" in results[2].content
    assert results[3].is_error and results[3].content.startswith("bad arguments")
    assert results[4].is_error
    assert results[0].to_message() == {"role": "tool", "tool_call_id": "1", "content": "5"}


async def test_parallel_runs_concurrently_sequential_does_not() -> None:
    running = 0
    peak = 0
    release = asyncio.Event()

    @function_tool
    async def work(n: int) -> dict[str, int]:
        """Work."""
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        if running == 3:
            release.set()
        async with asyncio.timeout(10):
            await release.wait()
        running -= 1
        return {"n": n}

    registry = ToolRegistry()
    registry.register(work)
    calls = [ToolCall(str(i), "work", json.dumps({"n": i})) for i in range(3)]
    results = await registry.execute(calls, parallel=True)
    assert peak == 3
    assert [json.loads(r.content) for r in results] == [{"n": 0}, {"n": 1}, {"n": 2}]

    peak = 0
    release.set()  # sequential calls would otherwise wait for a third that never comes
    await registry.execute(calls, parallel=False)
    assert peak == 1
