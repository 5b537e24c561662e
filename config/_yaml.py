"""YAML text -> plain data, with the line and column of every key and list item.

PyYAML's ``compose`` gives a node tree with marks; this module builds the plain dicts and lists
the schema validates from that tree itself, so that it can:

* record where each field sits (``marks``, keyed by the path of keys and list indices), which is
  how a pydantic error's ``loc`` becomes ``file:line:col``;
* keep mapping keys as written: YAML 1.1 reads an unquoted ``+14155550100:`` as the integer
  14155550100, which would lose the ``+`` of an E.164 number;
* expand ``${VAR}`` in string values, and refuse literal secrets, with the same marks;
* report duplicate keys, which ``yaml.safe_load`` silently lets the last one win.

Problems found here are collected, not raised, so that they are reported together with the
schema's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from ._interpolate import InterpolationError, interpolate, secret_reference_problem

__all__ = ["FieldPath", "Mark", "SECRET_FIELDS", "YamlSyntaxError", "YamlTree", "build_tree"]

FieldPath = tuple[str | int, ...]

SECRET_FIELDS = frozenset({"auth_token", "api_key"})
"""Keys whose values are secrets: only ``${VAR}`` references may fill them."""

_STR_TAG = "tag:yaml.org,2002:str"
_MERGE_TAG = "tag:yaml.org,2002:merge"


@dataclass(frozen=True, slots=True)
class Mark:
    """1-based line and column."""

    line: int
    col: int


class YamlSyntaxError(Exception):
    """The text is not YAML (or not one document); carries the mark of the problem and the
    path of the field being read when the parser stopped (``()`` when it cannot tell)."""

    def __init__(self, message: str, mark: Mark | None, path: FieldPath = ()) -> None:
        super().__init__(message)
        self.message = message
        self.mark = mark
        self.path = path


@dataclass(slots=True)
class YamlTree:
    """Plain data plus where each part of it came from."""

    data: Any
    marks: dict[FieldPath, Mark] = field(default_factory=dict)
    """Mark of each mapping key (its key token) and each list item, by path; ``()`` is the root."""
    raw: dict[FieldPath, str] = field(default_factory=dict)
    """The text as written, for string values that ``${VAR}`` interpolation changed."""
    problems: list[tuple[FieldPath, str]] = field(default_factory=list)
    """Problems found while building: duplicate keys, bad references, literal secrets, bad tags."""

    def mark_for(self, path: FieldPath) -> Mark:
        """The mark of ``path``, or of its nearest recorded ancestor."""
        for end in range(len(path), -1, -1):
            mark = self.marks.get(path[:end])
            if mark is not None:
                return mark
        return Mark(1, 1)


def _mark(node: Node) -> Mark:
    return Mark(node.start_mark.line + 1, node.start_mark.column + 1)


def build_tree(text: str, env: Mapping[str, str]) -> YamlTree:
    """Parse ``text`` into a :class:`YamlTree`, expanding ``${VAR}`` from ``env``.

    Raises:
        YamlSyntaxError: The text is not a single YAML document.
    """
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = _yaml_mark(exc)
        message = _describe_yaml_error(exc)
        lines = text.splitlines()
        if mark is not None and 0 < mark.line <= len(lines) and "${" in lines[mark.line - 1]:
            message += "; quote values that use ${VAR} inside [...] or {...}"
        raise YamlSyntaxError(message, mark, _path_at_error(text)) from exc
    except yaml.YAMLError as exc:
        raise YamlSyntaxError(f"invalid YAML: {exc}", None) from exc
    if root is None:
        return YamlTree(data=None, marks={(): Mark(1, 1)})
    builder = _Builder(env)
    tree = YamlTree(data=None, marks=builder.marks, raw=builder.raw, problems=builder.problems)
    builder.marks[()] = _mark(root)
    tree.data = builder.build(root, ())
    return tree


def _path_at_error(text: str) -> FieldPath:
    """The field the parser was in when it failed: PyYAML's event stream runs up to the error,
    so following its mappings and sequences gives the exact path (``()`` at the top level)."""
    # A frame per open collection: [key or None, expecting a key] for a mapping, [index] for
    # a sequence.
    frames: list[list[Any]] = []

    def value_done() -> None:
        if frames:
            top = frames[-1]
            if len(top) == 2:
                top[1] = True  # the mapping's value is complete: a key comes next
            else:
                top[0] += 1

    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                frames.append([None, True] if isinstance(event, yaml.MappingStartEvent) else [0])
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                frames.pop()
                value_done()
            elif isinstance(event, (yaml.ScalarEvent, yaml.AliasEvent)):
                top = frames[-1] if frames else None
                if top is not None and len(top) == 2 and top[1]:
                    top[0] = event.value if isinstance(event, yaml.ScalarEvent) else "*"
                    top[1] = False
                else:
                    value_done()
    except yaml.YAMLError:
        pass
    path: list[str | int] = []
    for frame in frames:
        if len(frame) == 1:
            path.append(frame[0])
        elif frame[0] is not None:
            path.append(str(frame[0]))
            if frame[1]:
                break  # between this mapping's entries: the last key read is where it failed
    return tuple(path)


def _yaml_mark(exc: yaml.MarkedYAMLError) -> Mark | None:
    mark = exc.problem_mark or exc.context_mark
    if exc.context_mark is not None and "end of stream" in (exc.problem or ""):
        # An unclosed quote or bracket: where it was opened, not the end of the file.
        mark = exc.context_mark
    return Mark(mark.line + 1, mark.column + 1) if mark is not None else None


def _describe_yaml_error(exc: yaml.MarkedYAMLError) -> str:
    problem, context = exc.problem or "", exc.context or ""
    if problem.startswith("but ") and context:
        return f"invalid YAML: {context}, {problem}"
    message = f"invalid YAML: {problem or context or 'syntax error'}"
    if problem and context and exc.context_mark is not None:
        message += f" ({context} at line {exc.context_mark.line + 1})"
    return message


class _Builder:
    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env
        self.marks: dict[FieldPath, Mark] = {}
        self.raw: dict[FieldPath, str] = {}
        self.problems: list[tuple[FieldPath, str]] = []
        self._constructor = SafeConstructor()
        self._active: set[int] = set()  # nodes being built: an alias back into one is recursion

    def build(self, node: Node, path: FieldPath) -> Any:
        if id(node) in self._active:
            self.problems.append((path, "recursive YAML alias: an anchor may not contain itself"))
            return None
        self._active.add(id(node))
        try:
            if isinstance(node, MappingNode):
                return self._mapping(node, path)
            if isinstance(node, SequenceNode):
                return self._sequence(node, path)
            return self._scalar(node, path)
        finally:
            self._active.discard(id(node))

    def _scalar(self, node: Node, path: FieldPath) -> Any:
        assert isinstance(node, ScalarNode)
        secret = bool(path) and path[-1] in SECRET_FIELDS
        if node.tag != _STR_TAG:
            try:
                value = self._constructor.construct_object(node, deep=True)
            except yaml.constructor.ConstructorError as exc:
                self.problems.append((path, f"invalid YAML value: {exc.problem}"))
                return node.value
            if secret and value is not None:
                # Any non-string scalar (``api_key: 12345``) is a literal.
                problem = secret_reference_problem(str(value), _suggest_var(path))
                self.problems.append((path, problem or "expected a ${VAR} reference"))
            return value
        raw: str = node.value
        if secret:
            problem = secret_reference_problem(raw, _suggest_var(path))
            if problem is not None:
                self.problems.append((path, problem))
                return raw
        elif path and path[-1] == "redis_url" and "$" not in raw and urlsplit(raw).password:
            self.problems.append(
                (
                    path,
                    "literal password in redis_url; secrets come only from the environment: "
                    "write redis_url: ${CALLGATE_REDIS_URL} and set that variable",
                )
            )
            return raw
        try:
            expanded = interpolate(raw, self.env)
        except InterpolationError as exc:
            self.problems.append((path, str(exc)))
            return raw
        if expanded.variables:
            self.raw[path] = raw
        return expanded.value

    def _sequence(self, node: SequenceNode, path: FieldPath) -> list[Any]:
        items: list[Any] = []
        for index, child in enumerate(node.value):
            self.marks[(*path, index)] = _mark(child)
            items.append(self.build(child, (*path, index)))
        return items

    def _mapping(self, node: MappingNode, path: FieldPath) -> dict[str, Any]:
        result: dict[str, Any] = {}
        explicit: dict[str, Mark] = {}
        for key_node, value_node, merged in self._pairs(node, path):
            if not isinstance(key_node, ScalarNode):
                self.problems.append((path, f"expected a plain key at line {_mark(key_node).line}"))
                continue
            # The key as written: ``+14155550100`` stays a string, so do ``yes``/``1``.
            key = str(key_node.value)
            child_path = (*path, key)
            if not merged:
                if key in explicit:
                    self.marks[child_path] = _mark(key_node)
                    self.problems.append(
                        (child_path, f"duplicate key {key!r} (first at line {explicit[key].line})")
                    )
                    continue
                explicit[key] = _mark(key_node)
            elif key in result:
                continue  # an explicit key, or an earlier merge, wins over a later merge
            self.marks[child_path] = _mark(key_node)
            result[key] = self.build(value_node, child_path)
        return result

    def _pairs(self, node: MappingNode, path: FieldPath) -> list[tuple[Node, Node, bool]]:
        """Explicit pairs first, then pairs from ``<<`` merge keys (which never override)."""
        own: list[tuple[Node, Node, bool]] = []
        merged: list[tuple[Node, Node, bool]] = []
        for key_node, value_node in node.value:
            if key_node.tag != _MERGE_TAG:
                own.append((key_node, value_node, False))
                continue
            sources = value_node.value if isinstance(value_node, SequenceNode) else [value_node]
            for source in sources:
                if not isinstance(source, MappingNode):
                    self.problems.append((path, "expected a mapping (or a list of them) after <<"))
                    continue
                if id(source) in self._active:
                    self.problems.append((path, "recursive YAML merge: an anchor contains itself"))
                    continue
                self._active.add(id(source))
                try:
                    merged.extend((k, v, True) for k, v, _ in self._pairs(source, path))
                finally:
                    self._active.discard(id(source))
        return own + merged


def _suggest_var(path: FieldPath) -> str:
    if "twilio" in path:
        return "TWILIO_AUTH_TOKEN"
    return "OPENAI_API_KEY"
