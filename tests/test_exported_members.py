"""Every package's public names exist, once, and the gateway's modules declare theirs."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

PACKAGES = ["audio", "gateway", "vad", "bus", "nodes", "config", "speech"]


@pytest.mark.parametrize("name", PACKAGES)
def test_package_exports_resolve(name: str) -> None:
    pkg = importlib.import_module(name)
    exported = getattr(pkg, "__all__", [])
    assert len(exported) == len(set(exported)), f"{name}.__all__ has duplicates"
    for attr in exported:
        assert hasattr(pkg, attr), f"{name}.__all__ names {attr!r}, which it lacks"


def test_gateway_modules_declare_their_public_api() -> None:
    import gateway

    for info in pkgutil.iter_modules(gateway.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"gateway.{info.name}")
        if info.name == "cli":
            assert module.__all__ == ["main"]
            continue
        exported = getattr(module, "__all__", None)
        assert exported, f"gateway.{info.name} has no __all__"
        for attr in exported:
            assert hasattr(module, attr), f"gateway.{info.name}.__all__ names missing {attr!r}"
