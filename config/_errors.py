"""Errors raised while loading a config file.

    ConfigError             the file is missing, unreadable, not YAML, or does not match the schema,
                            or a validator passed to the loader found problems (``.errors`` holds
                            one ConfigErrorItem per problem, all of them)

A validator (``load_config(..., validate=)``) reports :class:`ConfigProblem`s: a field path and a
message, which the loader turns into ConfigErrorItems with the file, line and column of that field.

Every problem names the file, the line and column of the offending key (or of the enclosing mapping
for a missing field), the dotted field path and what was expected, e.g.::

    config/agents.yaml:14:7: agents.support.barge_in.commit_ms: expected a number, got 'soon'
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

__all__ = ["ConfigError", "ConfigErrorItem", "ConfigProblem"]


class ConfigProblem(NamedTuple):
    """A problem a validator found in a loaded config, before it is located in the file."""

    path: tuple[str | int, ...]
    """Keys and list indices from the top of the file, e.g. ``("agents", "support", "nodes", 1,
    "args")``; the loader points at the deepest part the file has."""
    message: str
    """What is wrong and what was expected."""


class ConfigErrorItem(NamedTuple):
    """One problem in a config file."""

    file: str
    """The file as shown to the user (relative to the working directory when inside it)."""
    line: int | None
    """1-based line of the offending key; None when the problem is the file itself."""
    col: int | None
    """1-based column of the offending key; None when unknown."""
    field: str
    """Dotted path of the field, e.g. ``agents.support.nodes[1].ref``; empty for the whole file."""
    message: str
    """What is wrong and what was expected."""

    def __str__(self) -> str:
        where = self.file
        if self.line is not None:
            where += f":{self.line}"
            if self.col is not None:
                where += f":{self.col}"
        if self.field:
            return f"{where}: {self.field}: {self.message}"
        return f"{where}: {self.message}"


class ConfigError(Exception):
    """A config file could not be loaded; ``str()`` lists every problem, one per line.

    Args:
        errors: The problems, in file order.
    """

    def __init__(self, errors: Iterable[ConfigErrorItem]) -> None:
        self.errors: list[ConfigErrorItem] = list(errors)
        super().__init__("\n".join(str(item) for item in self.errors))

    def __reduce__(self) -> tuple[type[ConfigError], tuple[list[ConfigErrorItem]]]:
        return (type(self), (self.errors,))
