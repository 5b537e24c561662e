"""Both deployments give callgate's config every variable it reads, and a valid config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from config import load_config

from ._support import (
    AGENTS_YAML,
    COMPOSE,
    ENV_EXAMPLE,
    config_env_vars,
    k8s_object,
    load_yaml,
    parse_env_file,
)

# Read by the config but deliberately left at their defaults: the port is baked into EXPOSE,
# the probes and the Services; the host must stay 0.0.0.0 in a container.
LEFT_AT_DEFAULT = {"CALLGATE_HOST", "CALLGATE_PORT"}
# Not read through ${VAR} in the config, but by the code or the CLI.
READ_BY_CODE = {"CALLGATE_TOKEN_SECRET", "CALLGATE_CONFIG", "OPENAI_API_KEY"}
# What an operator must fill in (the examples leave every secret empty); placeholders, not real
# values. The optional ones (account SID, OpenAI key) stay empty: the config must load so.
FILLED_IN = {
    "TWILIO_AUTH_TOKEN": "placeholder-auth-token",
    "CALLGATE_TOKEN_SECRET": "placeholder-token-secret-of-32-bytes",
}


def _compose_env() -> dict[str, str]:
    gateway = load_yaml(COMPOSE)["services"]["gateway"]
    env = parse_env_file(ENV_EXAMPLE)
    env.update({k: str(v) for k, v in gateway["environment"].items()})
    return env


def _k8s_env() -> dict[str, str]:
    env = dict(k8s_object("ConfigMap", "callgate-env")["data"])
    env.update(k8s_object("Secret", "callgate-secrets")["stringData"])
    return {k: str(v) for k, v in env.items()}


DEPLOYMENTS = {"compose": _compose_env, "k8s": _k8s_env}


@pytest.mark.parametrize("deployment", sorted(DEPLOYMENTS))
def test_every_config_variable_is_provided(deployment: str) -> None:
    provided = set(DEPLOYMENTS[deployment]())
    wanted = set(config_env_vars(AGENTS_YAML.read_text(encoding="utf-8"))) - LEFT_AT_DEFAULT
    assert wanted - provided == set(), f"{deployment} does not set {sorted(wanted - provided)}"
    assert {"CALLGATE_TOKEN_SECRET"} <= provided
    assert not (LEFT_AT_DEFAULT & provided), "host and port stay at 0.0.0.0:8080"


def test_the_config_still_reads_what_deploy_sets() -> None:
    """A variable the deployments set that the config no longer reads is a stale setting."""
    read = set(config_env_vars(AGENTS_YAML.read_text(encoding="utf-8"))) | READ_BY_CODE
    for name, make in DEPLOYMENTS.items():
        stale = set(make()) - read
        assert not stale, f"{name} sets {sorted(stale)}, which nothing reads"


@pytest.mark.parametrize("deployment", sorted(DEPLOYMENTS))
def test_deployment_env_makes_a_production_config(deployment: str, tmp_path: Path) -> None:
    env = DEPLOYMENTS[deployment]()
    for key, value in FILLED_IN.items():
        assert env[key] == "", f"the {deployment} example must leave {key} empty"
        env[key] = value
    cfg: Any = load_config(AGENTS_YAML, env=env)
    assert cfg.twilio.validate_signatures is True
    assert cfg.twilio.auth_token is not None
    assert cfg.server.public_url.startswith("https://")
    assert cfg.server.port == 8080
    assert cfg.bus.redis_url is not None and cfg.bus.redis_url.startswith("redis://")
    # The gateway refuses secrets shorter than 16 bytes (gateway.security.CallTokens).
    assert len(env["CALLGATE_TOKEN_SECRET"].encode()) >= 16
