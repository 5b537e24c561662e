"""Function tools: ``@function_tool`` builds an OpenAI tool schema from a function's signature and
Google-style docstring; ``ToolRegistry`` hands the schemas to the LLM and runs the calls it makes.

``execute(tool_calls, parallel=True)`` runs the calls concurrently and returns their results in
the order of the calls. A failing tool (or bad arguments, or an unknown name) becomes a
``ToolResult`` with ``is_error=True`` and the error text as content, so the model can recover.
Cancelling ``execute`` (a barge-in) cancels every tool still running.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import json
import logging
import re
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints, overload

from ._errors import ToolNotDecoratedError
from ._llm import ToolCall, ToolResult

__all__ = ["FunctionSchema", "FunctionToolInfo", "ToolRegistry", "function_tool"]

logger = logging.getLogger(__name__)

_TOOL_ATTR = "__tool_info__"


@dataclass(frozen=True, slots=True)
class FunctionSchema:
    """The ``function`` part of an OpenAI tool schema."""

    name: str
    description: str
    parameters: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "parameters": self.parameters}


@dataclass(frozen=True, slots=True)
class FunctionToolInfo:
    """What ``@function_tool`` attaches to a function."""

    name: str
    description: str
    schema: FunctionSchema
    function: Callable[..., Any]


def _json_schema(hint: Any) -> dict[str, Any]:
    origin = get_origin(hint)
    if origin is Annotated:
        return _json_schema(get_args(hint)[0])
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        return _json_schema(args[0]) if len(args) == 1 else {}
    if origin is Literal:
        values = list(get_args(hint))
        schema = _json_schema(type(values[0])) if values else {}
        return {**schema, "enum": values}
    if origin in (list, tuple, set, frozenset):
        items = get_args(hint)
        return {"type": "array", "items": _json_schema(items[0])} if items else {"type": "array"}
    if origin is dict or hint is dict:
        return {"type": "object"}
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return {"type": "string", "enum": [m.value for m in hint]}
    simple = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array"}
    if hint in simple:
        return {"type": simple[hint]}
    return {}  # Any or an unknown type: no constraint


def _param_description(hint: Any) -> str | None:
    if get_origin(hint) is Annotated:
        for meta in get_args(hint)[1:]:
            if isinstance(meta, str):
                return meta
            description = getattr(meta, "description", None)  # pydantic Field(description=...)
            if isinstance(description, str):
                return description
    return None


_ARG_LINE = re.compile(r"^(\*{0,2}\w+)\s*(\([^)]*\))?\s*:\s*(.*)$")


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """Summary and per-argument descriptions of a Google-style docstring."""
    summary: list[str] = []
    params: dict[str, str] = {}
    section = "summary"
    current: str | None = None
    arg_indent: int | None = None
    for raw in inspect.cleandoc(doc).splitlines():
        line = raw.strip()
        indent = len(raw) - len(raw.lstrip())
        if line in ("Args:", "Arguments:", "Parameters:"):
            section, current, arg_indent = "args", None, None
            continue
        if re.fullmatch(r"[A-Z][A-Za-z ]*:", line):  # Returns:, Raises:, ...
            section, current = "other", None
            continue
        if section == "summary":
            if line:
                summary.append(line)
        elif section == "args":
            match = _ARG_LINE.match(line)
            if match and (arg_indent is None or indent <= arg_indent):
                arg_indent = indent
                current = match.group(1).lstrip("*")
                params[current] = match.group(3)
            elif current and line:
                params[current] = f"{params[current]} {line}".strip()
    return " ".join(summary), params


def _extract_schema(
    func: Callable[..., Any], name: str | None, description: str | None
) -> FunctionSchema:
    signature = inspect.signature(func)
    hints = get_type_hints(func, include_extras=True)
    summary, docs = _parse_docstring(func.__doc__ or "")
    properties: dict[str, Any] = {}
    required: list[str] = []
    for pname, param in signature.parameters.items():
        if pname in ("self", "cls") or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        hint = hints.get(pname, Any)
        prop = _json_schema(hint)
        text = _param_description(hint) or docs.get(pname)
        if text:
            prop["description"] = text
        properties[pname] = prop
        if param.default is inspect.Parameter.empty:
            required.append(pname)
    return FunctionSchema(
        name=name or func.__name__,
        description=description or summary,
        parameters={"type": "object", "properties": properties, "required": required},
    )


_F = Callable[..., Any]


@overload
def function_tool(name: _F, description: str | None = None) -> _F: ...


@overload
def function_tool(
    name: str | None = None, description: str | None = None
) -> Callable[[_F], _F]: ...


def function_tool(
    name: str | _F | None = None, description: str | None = None
) -> _F | Callable[[_F], _F]:
    """Mark a function (or method) as a tool the LLM may call.

    Use as ``@function_tool`` or ``@function_tool(name=..., description=...)``. The schema comes
    from the signature (type hints, defaults) and the docstring (summary and ``Args:``).
    """

    def decorate(func: _F) -> _F:
        tool_name = name if isinstance(name, str) else None
        schema = _extract_schema(func, tool_name, description)
        info = FunctionToolInfo(schema.name, schema.description, schema, func)
        setattr(func, _TOOL_ATTR, info)
        return func

    if callable(name):
        return decorate(name)
    return decorate


class ToolRegistry:
    """Tools the LLM may call, by name."""

    def __init__(self) -> None:
        self._tools: dict[str, FunctionToolInfo] = {}

    def register(self, func_or_info: Callable[..., Any] | FunctionToolInfo) -> None:
        """Register a ``@function_tool`` function or bound method.

        Raises:
            ToolNotDecoratedError: the function lacks ``@function_tool``.
        """
        if isinstance(func_or_info, FunctionToolInfo):
            self._tools[func_or_info.name] = func_or_info
            return
        info = getattr(func_or_info, _TOOL_ATTR, None)
        if not isinstance(info, FunctionToolInfo):
            raise ToolNotDecoratedError(
                f"{getattr(func_or_info, '__name__', func_or_info)!r} is not decorated with "
                "@function_tool"
            )
        if inspect.ismethod(func_or_info):
            info = FunctionToolInfo(info.name, info.description, info.schema, func_or_info)
        self._tools[info.name] = info

    def discover(self, obj: object) -> None:
        """Register every ``@function_tool`` method of ``obj``."""
        for attr in dir(type(obj)):
            static = inspect.getattr_static(obj, attr, None)
            func = getattr(static, "__func__", static)  # unwrap staticmethod/classmethod
            if isinstance(getattr(func, _TOOL_ATTR, None), FunctionToolInfo):
                self.register(getattr(obj, attr))

    def get_schemas(self) -> list[dict[str, Any]]:
        """OpenAI tool schemas of every registered tool."""
        return [{"type": "function", "function": t.schema.to_dict()} for t in self._tools.values()]

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    async def execute(
        self, tool_calls: Iterable[ToolCall], context: object | None = None, parallel: bool = True
    ) -> list[ToolResult]:
        """Run the calls; results come back in the order of ``tool_calls``.

        Args:
            tool_calls: What the model asked for.
            context: Accepted for smallestai compatibility; unused.
            parallel: Run the calls concurrently (else one after the other).
        """
        calls = list(tool_calls)
        if parallel:
            return list(await asyncio.gather(*(self._execute_one(c) for c in calls)))
        return [await self._execute_one(c) for c in calls]

    async def _execute_one(self, call: ToolCall) -> ToolResult:
        info = self._tools.get(call.name)
        if info is None:
            return ToolResult(call.id, call.name, f"unknown tool {call.name!r}", is_error=True)
        try:
            arguments = call.parsed_arguments()
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            return ToolResult(call.id, call.name, f"bad arguments: {exc}", is_error=True)
        accepted = inspect.signature(info.function).parameters
        kwargs = {k: v for k, v in arguments.items() if k in accepted}
        try:
            result = info.function(**kwargs)
            if inspect.isawaitable(result):
                result = await result
        except Exception as exc:
            # The model gets the error text and can apologise or retry; the log keeps the trace.
            logger.exception("tool %s failed", call.name)
            return ToolResult(call.id, call.name, f"{type(exc).__name__}: {exc}", is_error=True)
        if isinstance(result, str):
            content = result
        else:
            try:
                content = json.dumps(result)
            except TypeError:
                content = str(result)
        return ToolResult(call.id, call.name, content)
