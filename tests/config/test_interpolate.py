"""``${VAR}`` interpolation: the function, and through the loader."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from config import ConfigError, load_config, parse_config
from config._interpolate import InterpolationError, interpolate, secret_reference_problem

ENV = {"HOST": "gw.example.com", "EMPTY": "", "PORT": "9000"}


@pytest.mark.parametrize(
    ("text", "expected", "variables"),
    [
        ("plain", "plain", ()),
        ("${HOST}", "gw.example.com", ("HOST",)),
        ("https://${HOST}:${PORT}", "https://gw.example.com:9000", ("HOST", "PORT")),
        ("${UNSET:-fallback}", "fallback", ("UNSET",)),
        ("${EMPTY:-fallback}", "fallback", ("EMPTY",)),
        ("${HOST:-fallback}", "gw.example.com", ("HOST",)),
        ("${UNSET:-}", "", ("UNSET",)),
        ("${EMPTY}", "", ("EMPTY",)),
        ("${UNSET:-http://localhost:8080}", "http://localhost:8080", ("UNSET",)),
        ("costs $5", "costs $5", ()),
        ("$${HOST}", "${HOST}", ()),
        ("a$$b", "a$b", ()),
    ],
)
def test_interpolate(text: str, expected: str, variables: tuple[str, ...]) -> None:
    result = interpolate(text, ENV)
    assert (result.value, result.variables) == (expected, variables)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("${UNSET}", "environment variable UNSET is not set (referenced as ${UNSET})"),
        ("x ${UNSET} y", "environment variable UNSET is not set"),
        ("${1BAD}", "malformed variable reference ${1BAD}"),
        ("${HOST:default}", "malformed variable reference"),
        ("${}", "malformed variable reference"),
        ("${HOST", "unclosed variable reference"),
    ],
)
def test_interpolate_errors(text: str, message: str) -> None:
    with pytest.raises(InterpolationError, match=None) as info:
        interpolate(text, ENV)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("raw", "ok"),
    [
        ("", True),
        ("${TOKEN}", True),
        ("${TOKEN:-}", True),
        (" ${TOKEN} ", True),
        ("${TOKEN:-s3cret}", False),
        ("s3cret", False),
        ("Bearer ${TOKEN}", False),
        ("${A}${B}", False),
    ],
)
def test_secret_reference_rule(raw: str, ok: bool) -> None:
    problem = secret_reference_problem(raw, "TOKEN")
    assert (problem is None) == ok
    if problem is not None:
        assert "s3cret" not in problem


def test_values_are_coerced_after_interpolation(tmp_path: Path) -> None:
    path = tmp_path / "a.yaml"
    path.write_text(
        textwrap.dedent(
            """\
            server:
              public_url: https://${HOST}
              port: ${PORT}
              max_calls: ${MAX_CALLS:-50}
            twilio:
              auth_token: ${TWILIO_AUTH_TOKEN}
              validate_signatures: ${VALIDATE:-false}
            bus:
              redis_url: ${REDIS_URL:-}
            default_agent: a
            agents:
              a:
                greeting: "Hello from ${HOST}, it costs $$5"
                llm: {provider: scripted}
                barge_in:
                  commit_ms: ${COMMIT_MS:-500.5}
            """
        ),
        encoding="utf-8",
    )
    env = {**ENV, "TWILIO_AUTH_TOKEN": "tok", "VALIDATE": "True"}
    cfg = load_config(path, env=env)
    assert cfg.server.public_url == "https://gw.example.com"
    assert (cfg.server.port, cfg.server.max_calls) == (9000, 50)
    assert cfg.twilio.auth_token is not None and cfg.twilio.auth_token.get_secret_value() == "tok"
    assert cfg.twilio.validate_signatures is True
    assert cfg.bus.redis_url is None
    assert cfg.agents["a"].greeting == "Hello from gw.example.com, it costs $5"
    assert cfg.agents["a"].barge_in.commit_ms == 500.5


def test_empty_secret_from_environment_means_absent() -> None:
    cfg = parse_config(
        "twilio: {auth_token: '${T:-}'}\ndefault_agent: a\nagents: {a: {llm: {provider: scripted}}}\n",
        env={},
    )
    assert cfg.twilio.auth_token is None


def test_unset_variables_are_all_reported(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(
            "server:\n  public_url: ${PUBLIC}\n  host: ${HOST_X}\ndefault_agent: a\n"
            "agents: {a: {llm: {provider: scripted}}}\n",
            source="x.yaml",
            env={},
        )
    assert [(e.line, e.field) for e in info.value.errors] == [
        (2, "server.public_url"),
        (3, "server.host"),
    ]
    assert "PUBLIC is not set" in info.value.errors[0].message
    assert "HOST_X is not set" in info.value.errors[1].message


def test_os_environ_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CALLGATE_TEST_GREETING", "hi there")
    cfg = parse_config(
        "default_agent: a\nagents: {a: {greeting: '${CALLGATE_TEST_GREETING}', llm: {provider: scripted}}}\n"
    )
    assert cfg.agents["a"].greeting == "hi there"
