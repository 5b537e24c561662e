"""The package exports exactly what its ``__all__`` lists (httpx's export-list test)."""

from __future__ import annotations

import types

import config


def test_all_is_complete_and_exact() -> None:
    public = {
        name
        for name, value in vars(config).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public == set(config.__all__)


def test_public_api_names() -> None:
    for name in (
        "load_config",
        "Config",
        "AgentConfig",
        "BargeInConfig",
        "ConfigError",
        "ConfigHolder",
    ):
        assert name in config.__all__
