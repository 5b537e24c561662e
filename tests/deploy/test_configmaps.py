"""The ConfigMaps in deploy/k8s that carry files are exact copies of their sources."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from ._support import AGENTS_YAML, DEPLOY, K8S, REDIS_CONF, ROOT, load_yaml


def _sync() -> ModuleType:
    name = "_callgate_deploy_sync_configmaps"
    spec = importlib.util.spec_from_file_location(name, DEPLOY / "sync_configmaps.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


SYNC = _sync()
FIX = "run `python deploy/sync_configmaps.py` and commit the result"


@pytest.mark.parametrize(
    ("manifest", "key", "source"),
    [
        ("configmap.yaml", "agents.yaml", AGENTS_YAML),
        ("redis-configmap.yaml", "redis.conf", REDIS_CONF),
    ],
)
def test_configmap_carries_its_source_byte_for_byte(manifest: str, key: str, source: Path) -> None:
    data = load_yaml(K8S / manifest)["data"]
    assert list(data) == [key]
    assert data[key] == source.read_text(encoding="utf-8"), (
        f"deploy/k8s/{manifest} differs from {source.relative_to(ROOT)}: {FIX}"
    )


def test_configmaps_are_what_the_generator_writes() -> None:
    for copy in SYNC.COPIES:
        have = (ROOT / copy.target).read_text(encoding="utf-8")
        assert have == SYNC.render(copy), f"{copy.target} is stale: {FIX}"


def test_mounted_names_match() -> None:
    """The gateway reads /etc/callgate/agents.yaml; Redis /etc/redis/redis.conf."""
    assert load_yaml(K8S / "configmap.yaml")["metadata"]["name"] == "callgate-config"
    assert load_yaml(K8S / "redis-configmap.yaml")["metadata"]["name"] == "callgate-redis-config"


@pytest.mark.parametrize(
    "text",
    [
        "a: 1\n",
        "a: 1",  # no final newline
        "a: 1\n\n\n",  # several
        "  indented first line\nb\n",
        "x\n\n  y  \n# comment\n\nz\n",
        "",
    ],
)
def test_block_scalar_round_trips(text: str, tmp_path: Path) -> None:
    (tmp_path / "src.txt").write_text(text, encoding="utf-8")
    copy = SYNC.Copy("src.txt", "out.yaml", "cm", "file")
    rendered = SYNC.render(copy, root=tmp_path)
    assert yaml.safe_load(rendered)["data"]["file"] == text


def test_check_mode_reports_staleness(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "agents.yaml").write_text("a: 1\n", encoding="utf-8")
    (tmp_path / "deploy" / "k8s").mkdir(parents=True)
    (tmp_path / "deploy" / "redis.conf").write_text("port 6379\n", encoding="utf-8")
    monkeypatch.setattr(SYNC, "ROOT", tmp_path)
    assert SYNC.main(["--check"]) == 1
    assert SYNC.main([]) == 0
    assert SYNC.main(["--check"]) == 0
