"""Shared helpers for tests/deploy: paths, YAML loading, a small Dockerfile reader."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DOCKERFILE = DEPLOY / "Dockerfile"
DOCKERIGNORE = DEPLOY / "Dockerfile.dockerignore"
COMPOSE = DEPLOY / "compose.yaml"
REDIS_CONF = DEPLOY / "redis.conf"
ENV_EXAMPLE = DEPLOY / ".env.example"
AGENTS_YAML = ROOT / "config" / "agents.yaml"
PYPROJECT = ROOT / "pyproject.toml"

K8S_VERSION = "1.30"
"""The Kubernetes version whose schemas the manifests are checked against (strict)."""

EXAMPLE_MANIFESTS = frozenset({"secret.example.yaml", "ingress.example.yaml"})
"""Manifests that are examples to copy and fill in: validated, but not in kustomization.yaml."""


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def k8s_manifest_files() -> list[Path]:
    """Every Kubernetes manifest in deploy/k8s (kustomization.yaml is kustomize's, not one)."""
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def k8s_documents() -> list[tuple[Path, dict[str, Any]]]:
    """(file, document) for every non-empty YAML document of every manifest."""
    out = []
    for path in k8s_manifest_files():
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if doc is not None:
                out.append((path, doc))
    return out


def k8s_object(kind: str, name: str) -> dict[str, Any]:
    """The one manifest object of ``kind`` named ``name``."""
    found = [d for _, d in k8s_documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name!r} in deploy/k8s, found {len(found)}"
    return found[0]


def config_env_vars(text: str) -> dict[str, str | None]:
    """``${VAR}`` / ``${VAR:-default}`` references in a config file's values (not its comments):
    name -> default (None: no default). ``$$`` is a literal dollar and starts no reference."""
    out: dict[str, str | None] = {}

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(key)
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, str):
            for m in re.finditer(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}", node):
                if m.group(1):
                    out[m.group(1)] = m.group(2)

    walk(yaml.safe_load(text))
    return out


def parse_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of a compose env file (comments and blank lines skipped)."""
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not KEY=VALUE: {line!r}"
        out[key.strip()] = value.strip()
    return out


def parse_redis_conf(path: Path) -> dict[str, list[str]]:
    """Directive -> its arguments (the last occurrence wins, as in Redis)."""
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        words = shlex.split(line)
        out[words[0].lower()] = words[1:]
    return out


def size_bytes(value: str) -> int:
    """Binary sizes as the files here spell them -> bytes: Redis ``640mb``, compose ``1g``,
    Kubernetes ``1Gi`` / ``512Mi`` (all powers of 1024)."""
    m = re.fullmatch(r"(\d+)\s*(kb|mb|gb|k|m|g|ki|mi|gi)?", value.strip().lower())
    assert m, f"not a binary size: {value!r}"
    number, unit = m.groups()
    power = " kmg".index(unit[0]) if unit else 0
    return int(number) << (10 * power)


@dataclass(frozen=True)
class Instruction:
    """One Dockerfile instruction: line of its first physical line, keyword, raw arguments."""

    line: int
    keyword: str
    args: str
    stage: int  # index of the FROM it belongs to (0-based); -1 before the first FROM


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions of a Dockerfile: continuation lines joined, comment lines dropped
    (inside a continuation too, as Docker does). Enough for the checks here, not a full parser."""
    out: list[Instruction] = []
    stage = -1
    buf: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):
            continue
        if not buf:
            start = number
        if stripped.endswith("\\"):
            buf.append(stripped[:-1].rstrip())
            continue
        buf.append(stripped)
        joined = " ".join(part for part in buf if part)
        buf = []
        keyword, _, args = joined.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        out.append(Instruction(start, keyword, args.strip(), stage))
    assert not buf, "Dockerfile ends inside a line continuation"
    return out
