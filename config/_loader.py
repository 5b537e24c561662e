"""Load a config file: YAML -> ``${VAR}`` expansion -> schema, every problem with file:line:col.

Pydantic reports a problem at a ``loc`` such as ``("agents", "support", "nodes", 1, "python",
"ref")``. The loader walks that ``loc`` down the plain data built from the YAML; parts that are
not in the data (``"python"`` is the discriminated union's tag, ``"[key]"`` a dict key's) are
skipped, and the deepest part found gives the line and column of the offending key. A missing
field is not in the data at all, so it points at its parent mapping.

A ``validate`` callable (``load_config(path, validate=...)``) checks what the schema cannot: the
command line passes ``nodes.check_agents``, which builds every agent graph (config/ itself never
imports nodes/). It returns :class:`ConfigProblem`s, located in the file the same way.
"""

from __future__ import annotations

import difflib
import os
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from ._errors import ConfigError, ConfigErrorItem, ConfigProblem
from ._schema import PROBLEMS_ERROR_TYPE, AgentConfig, Config, reference_problems
from ._yaml import SECRET_FIELDS, FieldPath, YamlSyntaxError, YamlTree, build_tree

__all__ = [
    "DEFAULT_CONFIG",
    "ENV_VAR",
    "Validator",
    "load_config",
    "parse_config",
    "resolve_config_path",
]

Validator = Callable[[Config], Iterable[ConfigProblem]]
"""Checks a config that matches the schema; every problem it returns makes the load fail."""

ENV_VAR = "CALLGATE_CONFIG"
"""Environment variable naming the config file used when no path is given."""

DEFAULT_CONFIG = Path(__file__).resolve().parent / "agents.yaml"
"""The shipped example, used when neither a path nor ``CALLGATE_CONFIG`` is given."""


def resolve_config_path(
    path: str | os.PathLike[str] | None = None, *, env: Mapping[str, str] | None = None
) -> Path:
    """The file :func:`load_config` reads: ``path``, else ``$CALLGATE_CONFIG``, else the example."""
    env = os.environ if env is None else env
    if path is not None:
        return Path(path)
    from_env = env.get(ENV_VAR)
    if from_env:
        return Path(from_env)
    return DEFAULT_CONFIG


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    validate: Validator | None = None,
) -> Config:
    """Load and check a config file.

    Args:
        path: The YAML file. None: ``$CALLGATE_CONFIG``, else this package's
            ``config/agents.yaml``.
        env: Where ``${VAR}`` references (and ``CALLGATE_CONFIG``) are looked up; default
            ``os.environ``.
        validate: Further checks of a config that matches the schema (e.g.
            ``nodes.check_agents``: every agent graph builds); its problems name file and line.

    Returns:
        The config, with ``source`` set to the file's absolute path.

    Raises:
        ConfigError: The file is missing or unreadable, is not YAML, or does not match the schema;
            ``.errors`` lists every problem.
    """
    env = os.environ if env is None else env
    file = resolve_config_path(path, env=env)
    shown = _display(file)
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise ConfigError([ConfigErrorItem(shown, None, None, "", "file not found")]) from exc
    except IsADirectoryError as exc:
        raise ConfigError(
            [ConfigErrorItem(shown, None, None, "", "is a directory; expected a YAML file")]
        ) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(
            [ConfigErrorItem(shown, None, None, "", f"not UTF-8 text ({exc.reason})")]
        ) from exc
    except OSError as exc:
        raise ConfigError(
            [ConfigErrorItem(shown, None, None, "", f"cannot read: {exc.strerror or exc}")]
        ) from exc
    return parse_config(text, source=file, env=env, validate=validate)


def parse_config(
    text: str,
    *,
    source: str | os.PathLike[str] = "<string>",
    env: Mapping[str, str] | None = None,
    validate: Validator | None = None,
) -> Config:
    """Check config ``text`` as if read from ``source`` (used in messages and ``Config.source``).

    Raises:
        ConfigError: As :func:`load_config`.
    """
    env = os.environ if env is None else env
    source_path = Path(source)
    shown = _display(source_path)
    try:
        tree = build_tree(text, env)
    except YamlSyntaxError as exc:
        line, col = (exc.mark.line, exc.mark.col) if exc.mark else (None, None)
        field = _dotted(exc.path)
        raise ConfigError([ConfigErrorItem(shown, line, col, field, exc.message)]) from exc

    items: list[ConfigErrorItem] = []
    for path, message in tree.problems:
        items.append(_item(shown, tree, path, message))
    if tree.data is None:
        empty = "the file is empty; expected a mapping with `agents` and `default_agent`"
        items.append(ConfigErrorItem(shown, 1, 1, "", empty))
        raise ConfigError(items)

    config: Config | None = None
    try:
        config = Config.model_validate(tree.data)
    except ValidationError as exc:
        bad_paths = [path for path, _ in tree.problems]
        errors = exc.errors(include_url=False)
        for error in errors:
            for path, message in _translate(error, tree):
                # A value that already failed in the YAML pass (an unset ${VAR}, say) would
                # only fail again here, less clearly.
                if any(path[: len(bad)] == bad for bad in bad_paths):
                    continue
                items.append(_item(shown, tree, path, message))
        if not any(e["type"] == PROBLEMS_ERROR_TYPE and not e["loc"] for e in errors):
            # Config's own cross-checks did not run (some field failed): run them on the raw data.
            for path, message in _raw_reference_problems(tree.data):
                items.append(_item(shown, tree, path, message))
    if items:
        items.sort(key=lambda item: (item.line or 0, item.col or 0))
        raise ConfigError(_unique(items))
    assert config is not None
    config._source = source_path.resolve() if not str(source).startswith("<") else source_path
    if validate is not None:
        found = [_item(shown, tree, tuple(p.path), p.message) for p in validate(config)]
        if found:
            found.sort(key=lambda item: (item.line or 0, item.col or 0))
            raise ConfigError(_unique(found))
    return config


def _raw_reference_problems(data: Any) -> list[tuple[FieldPath, str]]:
    if not isinstance(data, dict) or not isinstance(data.get("agents"), dict):
        return []
    numbers = data.get("numbers")
    return reference_problems(
        list(data["agents"]),
        numbers if isinstance(numbers, dict) else {},
        data.get("default_agent"),
    )


# -- error translation -------------------------------------------------------------------------


def _display(path: Path) -> str:
    if not path.is_absolute():
        return str(path)
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _unique(items: list[ConfigErrorItem]) -> list[ConfigErrorItem]:
    # dict: ordered set. The same problem can come from the schema and the raw-data checks.
    return list(dict.fromkeys(items))


def _item(shown: str, tree: YamlTree, path: FieldPath, message: str) -> ConfigErrorItem:
    resolved, _ = _resolve(tree.data, path)
    mark = tree.mark_for(resolved)
    return ConfigErrorItem(shown, mark.line, mark.col, _dotted(path), message)


_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")


def _dotted(path: FieldPath) -> str:
    """``("agents", "support", "nodes", 1)`` -> ``agents.support.nodes[1]``."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _PLAIN_KEY.fullmatch(part):
            out += f".{part}" if out else part
        else:
            out += f'["{part}"]'
    return out


def _resolve(data: Any, loc: tuple[Any, ...]) -> tuple[FieldPath, FieldPath]:
    """Follow ``loc`` down ``data``: (the parts found, the field names after the last one found).

    The second part names what the file lacks: a missing field, or a field left at its default
    that a cross-field check complains about.
    """
    found: list[str | int] = []
    last = -1
    current = data
    tags: set[int] = set()
    for index, part in enumerate(loc):
        if isinstance(current, dict) and isinstance(part, str) and part in current:
            current = current[part]
        elif isinstance(current, dict) and part == current.get("kind"):
            tags.add(index)  # the discriminated union's tag: pydantic's, not the file's
            continue
        elif (
            isinstance(current, list)
            and isinstance(part, int)
            and not isinstance(part, bool)
            and 0 <= part < len(current)
        ):
            current = current[part]
        else:
            continue  # a union tag, "[key]", or a part the file lacks
        found.append(part)
        last = index
    tail = tuple(
        part
        for index, part in enumerate(loc)
        if index > last and index not in tags and isinstance(part, str) and part.isidentifier()
    )
    return tuple(found), tail


def _translate(error: Any, tree: YamlTree) -> list[tuple[FieldPath, str]]:
    loc = tuple(error["loc"])
    kind: str = error["type"]
    ctx: dict[str, Any] = error.get("ctx") or {}
    if kind == PROBLEMS_ERROR_TYPE:
        out = []
        for sub, message in ctx["problems"]:
            path, tail = _resolve(tree.data, (*loc, *sub))
            out.append(((*path, *tail), message))
        return out
    path, tail = _resolve(tree.data, loc)
    if kind == "missing":
        expected = _expectation(loc)
        message = "missing required field" + (f": expected {expected}" if expected else "")
        return [((*path, *tail), message)]
    if kind == "extra_forbidden":
        return [(path, _unknown_field(str(loc[-1]), loc))]
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        return [_union_tag(path, loc, ctx, error)]
    return [(path, _message(kind, error, ctx, path, tree))]


def _union_tag(
    path: FieldPath, loc: tuple[Any, ...], ctx: dict[str, Any], error: Any
) -> tuple[FieldPath, str]:
    expected = ctx.get("expected_tags", "")
    field = str(ctx.get("discriminator", "'kind'")).strip("'")
    if error["type"] == "union_tag_not_found":
        if not isinstance(error.get("input"), dict):
            return path, f"expected a mapping with `{field}`, got {_show(error.get('input'))}"
        return (*path, field), f"missing required field: expected one of {_expected_tags(loc)}"
    return (*path, field), f"expected one of {expected}, got {ctx.get('tag')!r}"


def _expected_tags(loc: tuple[Any, ...]) -> str:
    union = _unwrap(_schema_type_at(loc))
    tags = [
        repr(tag)
        for member in typing.get_args(union)
        if isinstance(member, type)
        and issubclass(member, BaseModel)
        and "kind" in member.model_fields
        for tag in typing.get_args(member.model_fields["kind"].annotation)
    ]
    return ", ".join(tags) or "the documented kinds"


def _show(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return type(value).__name__


_EXPECTED = {
    "int_type": "a whole number",
    "int_parsing": "a whole number",
    "int_from_float": "a whole number",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "tuple_type": "a list",
    "dict_type": "a mapping",
    "mapping_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
}

_BOUNDS = {
    "greater_than": ("gt", "greater than"),
    "greater_than_equal": ("ge", "at least"),
    "less_than": ("lt", "less than"),
    "less_than_equal": ("le", "at most"),
}


def _message(kind: str, error: Any, ctx: dict[str, Any], path: FieldPath, tree: YamlTree) -> str:
    value = error.get("input")
    secret = bool(path) and path[-1] in SECRET_FIELDS
    got = "a value (hidden: it is a secret)" if secret else _show(value)
    raw = tree.raw.get(path)
    if raw is not None and not secret:
        got += f" (from {raw})"
    if kind in _EXPECTED:
        message = f"expected {_EXPECTED[kind]}, got {got}"
        if kind == "string_type" and isinstance(value, (bool, int, float)):
            message += "; quote it if you meant the text"
        if kind in ("model_type", "dict_type") and not path:
            message = f"expected a mapping of settings at the top of the file, got {got}"
        return message
    if kind in _BOUNDS:
        key, words = _BOUNDS[kind]
        bound = ctx.get(key)
        shown_bound = f"{bound:g}" if isinstance(bound, float) else str(bound)
        return f"expected a number {words} {shown_bound}, got {got}"
    if kind in ("literal_error", "enum"):
        return f"expected {ctx.get('expected')}, got {got}"
    if kind in ("too_short", "too_long"):
        bound = "at least" if kind == "too_short" else "at most"
        limit = ctx.get("min_length" if kind == "too_short" else "max_length")
        return f"expected {bound} {limit} item(s), got {ctx.get('actual_length')}"
    if kind == "string_too_short":
        return "expected a non-empty string" if ctx.get("min_length") == 1 else str(error["msg"])
    if kind in ("value_error", "assertion_error"):
        return str(ctx.get("error", error["msg"]))
    return f"{error['msg']}, got {got}"


def _unknown_field(name: str, loc: tuple[Any, ...]) -> str:
    allowed = _fields_at(loc[:-1])
    message = f"unknown field {name!r}"
    if allowed:
        close = difflib.get_close_matches(name, allowed, n=1)
        if close:
            message += f" (did you mean {close[0]!r}?)"
        message += "; expected one of: " + ", ".join(allowed)
    return message


def _fields_at(loc: tuple[Any, ...]) -> list[str]:
    """The field names the schema allows at ``loc`` (empty when it cannot tell)."""
    tp = _unwrap(_schema_type_at(loc))
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        # An agent's name is its key, never written as a field.
        return [name for name in tp.model_fields if not (tp is AgentConfig and name == "name")]
    return []


def _schema_type_at(loc: tuple[Any, ...]) -> Any:
    """The annotation the schema has at ``loc`` (None when it cannot tell)."""
    tp: Any = Config
    for part in loc:
        tp = _unwrap(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            field = tp.model_fields.get(str(part))
            if field is None:
                return None
            tp = field.annotation
            continue
        origin = typing.get_origin(tp)
        args = typing.get_args(tp)
        if origin is dict and len(args) == 2:
            tp = args[1]
        elif origin in (list, tuple) and args:
            tp = args[0]
        elif origin in (typing.Union, types.UnionType):
            tp = _union_member(args, part)
            if tp is None:
                return None
        else:
            return None
    return tp


def _expectation(loc: tuple[Any, ...]) -> str:
    """What a missing field at ``loc`` should hold, as words ("" when it cannot tell)."""
    tp = _unwrap(_schema_type_at(loc))
    if typing.get_origin(tp) is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return "a mapping"
    origin = typing.get_origin(tp)
    if origin is dict:
        return "a mapping"
    if origin is list:
        return "a list"
    return {str: "a string", int: "a whole number", float: "a number", bool: "true or false"}.get(
        tp, ""
    )


def _unwrap(tp: Any) -> Any:
    while True:
        if typing.get_origin(tp) is typing.Annotated:
            tp = typing.get_args(tp)[0]
            continue
        args = typing.get_args(tp)
        if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
            rest = [a for a in args if a is not type(None)]
            if len(rest) == 1:
                tp = rest[0]
                continue
        return tp


def _union_member(args: tuple[Any, ...], tag: Any) -> Any:
    for member in args:
        member = _unwrap(member)
        if isinstance(member, type) and issubclass(member, BaseModel):
            kind = member.model_fields.get("kind")
            if kind is not None and tag in typing.get_args(kind.annotation):
                return member
    return None

