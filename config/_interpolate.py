"""``${VAR}`` interpolation of string values, and the rule that secrets come only from there.

Forms (the shell's, as in docker compose files):

    ${VAR}              the value of VAR; an error names VAR when it is unset
    ${VAR:-default}     the value of VAR, or ``default`` when VAR is unset or empty
    $$                  a literal ``$``

A ``$`` not followed by ``{`` or ``$`` is kept as is (``"costs $5"``). The default may not contain
``}``; references do not nest.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["InterpolationError", "Interpolated", "interpolate", "secret_reference_problem"]

_TOKEN = re.compile(r"\$(?:(\$)|\{([^}]*)\}|(\{))")
_REFERENCE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?::-(.*))?", re.DOTALL)
_WHOLE_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class InterpolationError(ValueError):
    """A ``${...}`` reference is malformed or names an unset variable without a default."""


@dataclass(frozen=True, slots=True)
class Interpolated:
    """The expanded text and the names of the variables it referenced."""

    value: str
    variables: tuple[str, ...]


def interpolate(text: str, env: Mapping[str, str]) -> Interpolated:
    """Expand every ``${VAR}`` and ``${VAR:-default}`` in ``text`` from ``env``.

    Raises:
        InterpolationError: A reference is malformed, or names an unset variable with no default.
    """
    if "$" not in text:
        return Interpolated(text, ())
    out: list[str] = []
    names: list[str] = []
    pos = 0
    for match in _TOKEN.finditer(text):
        out.append(text[pos : match.start()])
        pos = match.end()
        escaped, inner, unclosed = match.groups()
        if escaped is not None:
            out.append("$")
            continue
        if unclosed is not None:
            raise InterpolationError(f"unclosed variable reference in {text!r}: expected ${{VAR}}")
        ref = _REFERENCE.fullmatch(inner)
        if ref is None:
            raise InterpolationError(
                f"malformed variable reference ${{{inner}}}: expected ${{VAR}} or ${{VAR:-default}}"
            )
        name, default = ref.group(1), ref.group(2)
        names.append(name)
        value = env.get(name)
        if default is not None and not value:
            out.append(default)
        elif value is None:
            raise InterpolationError(
                f"environment variable {name} is not set (referenced as ${{{name}}}); "
                f"set it, or give a default: ${{{name}:-value}}"
            )
        else:
            out.append(value)
    out.append(text[pos:])
    return Interpolated("".join(out), tuple(names))


def secret_reference_problem(raw: str, suggested_var: str) -> str | None:
    """Why ``raw`` may not stand in a secret field, or None when it is fine.

    A secret field holds nothing (empty) or exactly one reference, ``${VAR}`` or ``${VAR:-}``. A
    literal value, or a reference with a non-empty default, would put the secret in the file.
    """
    stripped = raw.strip()
    if not stripped:
        return None
    whole = _WHOLE_REFERENCE.fullmatch(stripped)
    if whole is None:
        return (
            "literal secret in the config file; secrets come only from the environment: "
            f"write ${{{suggested_var}}} (or another variable's name) and set that variable"
        )
    if whole.group(2):
        return (
            f"a secret's ${{{whole.group(1)}:-...}} default puts the secret in the file; "
            f"secrets come only from the environment: use ${{{whole.group(1)}}} "
            f"or ${{{whole.group(1)}:-}}"
        )
    return None
