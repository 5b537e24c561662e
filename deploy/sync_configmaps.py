"""Write deploy/k8s's file-carrying ConfigMaps from their sources, so the copies cannot drift.

    python deploy/sync_configmaps.py          # rewrite them
    python deploy/sync_configmaps.py --check  # exit 1 if one is out of date

* ``deploy/k8s/configmap.yaml``        <- ``config/agents.yaml``  (ConfigMap ``callgate-config``)
* ``deploy/k8s/redis-configmap.yaml``  <- ``deploy/redis.conf``   (ConfigMap ``callgate-redis-config``)

Kustomize's configMapGenerator cannot read files outside its folder, hence the copies;
tests/deploy checks that each one holds its source byte for byte. Standard library only.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Copy:
    """One ConfigMap that carries one file."""

    source: str  # relative to the repository root
    target: str
    name: str
    key: str
    component: str | None = None


COPIES = (
    Copy("config/agents.yaml", "deploy/k8s/configmap.yaml", "callgate-config", "agents.yaml"),
    Copy(
        "deploy/redis.conf",
        "deploy/k8s/redis-configmap.yaml",
        "callgate-redis-config",
        "redis.conf",
        component="redis",
    ),
)


def _block(text: str, indent: str, key_indent: str) -> str:
    """``text`` as a YAML literal block scalar (header and lines): the lines indented by
    ``indent``, under a key indented by ``key_indent``."""
    if "\t" in text or "\r" in text:
        raise ValueError("tabs and carriage returns do not survive a YAML block scalar")
    if text.endswith("\n\n"):
        chomp = "+"
    elif text.endswith("\n"):
        chomp = ""
    else:
        chomp = "-"
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    # An explicit indentation indicator (relative to the key) when the first line starts with a
    # space: YAML would otherwise take that line's indentation for the block's.
    relative = len(indent) - len(key_indent)
    header = "|" + (str(relative) if lines and lines[0].startswith(" ") else "") + chomp
    body = "".join(f"{indent}{line}\n" if line else "\n" for line in lines)
    return header + "\n" + body


def render(copy: Copy, root: Path = ROOT) -> str:
    """The ConfigMap manifest for ``copy``, as written to ``copy.target``."""
    text = (root / copy.source).read_text(encoding="utf-8")
    component = f"    app.kubernetes.io/component: {copy.component}\n" if copy.component else ""
    return (
        f"# GENERATED from {copy.source} by deploy/sync_configmaps.py: edit the source, then run\n"
        f"#     python deploy/sync_configmaps.py\n"
        f"# tests/deploy fails while this copy differs from its source.\n"
        f"apiVersion: v1\n"
        f"kind: ConfigMap\n"
        f"metadata:\n"
        f"  name: {copy.name}\n"
        f"  labels:\n"
        f"    app.kubernetes.io/name: callgate\n"
        f"{component}"
        f"    app.kubernetes.io/part-of: callgate\n"
        f"data:\n"
        f"  {copy.key}: {_block(text, '    ', '  ')}"
    )


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for copy in COPIES:
        want = render(copy)
        path = ROOT / copy.target
        have = path.read_text(encoding="utf-8") if path.exists() else None
        if have == want:
            continue
        stale.append(copy.target)
        if not check:
            path.write_text(want, encoding="utf-8")
            print(f"wrote {copy.target} from {copy.source}")
    if check and stale:
        print(
            "out of date (run python deploy/sync_configmaps.py): " + ", ".join(stale),
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
