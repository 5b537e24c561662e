"""Loading good files: the shipped example, path resolution, defaults, python node refs."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError

import config
from config import (
    AgentConfig,
    BargeInConfig,
    Config,
    ConfigError,
    LLMNodeConfig,
    PythonNodeConfig,
    load_config,
    parse_config,
)

SHIPPED = Path(config.__file__).resolve().parent / "agents.yaml"


class EchoNode:
    """A stand-in node class that ``ref`` can name (the test module is importable)."""


def setup_echo(session: object) -> None:
    """A stand-in setup function that ``ref`` can name."""


def write(tmp_path: Path, text: str, name: str = "agents.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


MINIMAL = """\
    default_agent: support
    agents:
      support:
        llm:
          provider: scripted
    """


# -- the shipped example -------------------------------------------------------------------------


def test_shipped_example_loads_with_an_empty_environment() -> None:
    cfg = load_config(env={})
    assert cfg.source == SHIPPED
    # No public URL: the gateway takes it from each request (so `serve --port P` is right).
    assert cfg.server.public_url is None
    assert cfg.server.voice_url is None and cfg.server.media_url is None
    assert (cfg.server.host, cfg.server.port, cfg.server.max_calls) == ("0.0.0.0", 8080, 200)
    assert cfg.twilio.auth_token is None
    assert cfg.twilio.account_sid is None
    assert cfg.twilio.validate_signatures is False
    assert cfg.bus.redis_url is None and cfg.bus.embedded
    assert cfg.default_agent == "support"
    assert cfg.numbers["+14155550100"] == "support"


def test_shipped_support_agent_is_offline_and_has_a_non_interruptible_payment_node() -> None:
    agent = load_config(env={}).agents["support"]
    assert agent.name == "support"
    assert agent.greeting
    assert agent.llm is not None and agent.llm.provider == "scripted"
    assert agent.stt.provider == "pocketsphinx"
    assert agent.tts.provider == "espeak"
    assert agent.barge_in == BargeInConfig()
    payment = agent.node("payment")
    assert isinstance(payment, LLMNodeConfig)
    assert payment.interruptible is False
    assert agent.node("main") is not None and agent.node("main").interruptible  # type: ignore[union-attr]
    assert agent.edges == [("main", "payment")]
    assert agent.fallback

    def rule_for(text: str) -> config.ScriptRule:
        return next(rule for rule in agent.script if rule.matches(text))

    assert "balance" in (rule_for("what's my Balance?").reply or "")
    assert rule_for("I want to pay my bill").goto == "payment"
    assert rule_for("get me a human").transfer_to == "+14155550199"
    assert rule_for("can I talk to an agent").transfer_to is not None
    assert not any(rule.matches("paying attention") for rule in agent.script[:2])


def test_shipped_example_for_production(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {
        "CALLGATE_PUBLIC_URL": "https://gw.example.com/",
        "CALLGATE_PORT": "9000",
        "CALLGATE_VALIDATE_SIGNATURES": "true",
        "TWILIO_AUTH_TOKEN": "tok-very-secret",
        "TWILIO_ACCOUNT_SID": "AC" + "0123456789abcdef" * 2,
        "CALLGATE_REDIS_URL": "redis://:hunter2@redis.internal:6379/0",
    }
    cfg = load_config(env=env)
    assert cfg.server.public_url == "https://gw.example.com"
    assert cfg.server.media_url == "wss://gw.example.com/twilio/media"
    assert cfg.server.port == 9000
    assert cfg.twilio.validate_signatures is True
    assert cfg.twilio.auth_token == SecretStr("tok-very-secret")
    assert cfg.bus.redis_url == "redis://:hunter2@redis.internal:6379/0"
    summary = cfg.summary()
    assert "tok-very-secret" not in summary and "tok-very-secret" not in repr(cfg)
    assert "hunter2" not in summary
    assert "auth token: present" in summary
    assert "redis://:***@redis.internal:6379/0" in summary


def test_summary_names_agents_numbers_nodes_bus_and_missing_secrets() -> None:
    summary = load_config(env={}).summary()
    for text in (
        str(SHIPPED),
        "+14155550100 -> support",
        "any other number -> support",
        "support (default)",
        "payment (llm, NOT interruptible)",
        "main -> payment",
        "embedded",
        "twilio.auth_token: MISSING",
        "signature validation: OFF",
    ):
        assert text in summary, text


def test_default_path_comes_from_callgate_config(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL, "other.yaml")
    cfg = load_config(env={"CALLGATE_CONFIG": str(path)})
    assert cfg.source == path.resolve()
    assert config.resolve_config_path(env={}) == SHIPPED


def test_explicit_path_wins_over_the_environment(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL)
    cfg = load_config(str(path), env={"CALLGATE_CONFIG": "/nonexistent.yaml"})
    assert cfg.source == path.resolve()


# -- defaults and helpers ------------------------------------------------------------------------


def test_minimal_file_gets_defaults(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, MINIMAL), env={})
    assert cfg.server.public_url is None and cfg.server.voice_url is None
    assert cfg.server.max_calls == 200
    assert cfg.twilio.validate_signatures is True
    assert cfg.bus.redis_url is None
    assert cfg.numbers == {}
    agent = cfg.agents["support"]
    assert agent.nodes == [] and agent.edges == [] and agent.script == []
    b = agent.barge_in
    assert (b.p_on, b.p_off, b.start_windows, b.stop_windows, b.commit_ms) == (0.5, 0.3, 2, 5, 640.0)
    assert (b.resume_on_backchannel, b.echo_margin_db, b.noise_margin_db) == (True, 8.0, 6.0)
    assert (b.playback_lead_ms, b.dtmf_interrupts, b.speech_over_uninterruptible) == (
        240.0,
        True,
        "keep",
    )
    assert b.band_snr_db == 10.0


def test_barge_in_section_reaches_the_call_settings() -> None:
    from gateway.server import call_settings_from
    from vad import BargeInSettings

    cfg = parse_config(
        "default_agent: support\nagents:\n  support:\n    llm: {provider: scripted}\n"
        "    barge_in: {band_snr_db: 99, echo_margin_db: 9, commit_ms: 500,\n"
        "               playback_chunk_ms: 80}\n",
        source="inline.yaml",
    )
    settings = call_settings_from(cfg.agents["support"].barge_in)
    assert settings.barge_in.band_snr_db == 99.0  # the band path off for this agent
    assert settings.barge_in.commit_ms == 500.0 and settings.echo.echo_margin_db == 9.0
    assert settings.chunk_ms == 80
    assert BargeInSettings().band_snr_db == 10.0


def test_agent_for_number_falls_back_to_the_default(tmp_path: Path) -> None:
    cfg = parse_config(
        textwrap.dedent(
            """\
            numbers:
              +14155550100: sales      # unquoted: still a string with its '+'
            default_agent: support
            agents:
              support: {llm: {provider: scripted}}
              sales: {llm: {provider: scripted}}
            """
        ),
        env={},
    )
    assert cfg.agent_for_number("+14155550100").name == "sales"
    assert cfg.agent_for_number("+14155550999").name == "support"
    assert cfg.agent_for_number(None).name == "support"
    assert cfg.agent_for_number("client:alice").name == "support"


def test_edges_as_pairs_or_mappings_and_python_nodes(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        default_agent: a
        agents:
          a:
            llm: {provider: openai, model: gpt-4o-mini, base_url: "http://127.0.0.1:9/v1"}
            nodes:
              - {kind: llm, name: main, model: gpt-4o}
              - kind: python
                name: pay
                ref: tests.config.test_load:EchoNode
                interruptible: false
                args: {currency: USD}
              - {kind: python, name: setup, ref: "tests.config.test_load:setup_echo"}
            edges:
              - [main, pay]
              - {from: main, to: setup}
        """,
    )
    agent = load_config(path, env={}).agents["a"]
    assert agent.edges == [("main", "pay"), ("main", "setup")]
    pay = agent.node("pay")
    assert isinstance(pay, PythonNodeConfig)
    assert (pay.ref, pay.interruptible, pay.args) == (
        "tests.config.test_load:EchoNode",
        False,
        {"currency": "USD"},
    )
    setup = agent.node("setup")
    assert isinstance(setup, PythonNodeConfig) and setup.interruptible is None


def test_yaml_anchors_and_merge_keys(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        default_agent: a
        agents:
          a:
            llm: &llm {provider: scripted}
            barge_in: &patient {commit_ms: 900, stop_windows: 8}
          b:
            llm: *llm
            barge_in:
              <<: *patient
              commit_ms: 500
        """,
    )
    cfg = load_config(path, env={})
    assert cfg.agents["a"].barge_in.commit_ms == 900
    assert (cfg.agents["b"].barge_in.commit_ms, cfg.agents["b"].barge_in.stop_windows) == (500, 8)


def test_config_is_frozen_and_validates_when_built_in_code() -> None:
    agent = AgentConfig.model_validate({"name": "x", "llm": {"provider": "scripted"}})
    cfg = Config(agents={"x": agent}, default_agent="x")
    assert cfg.agent_for_number("+14155550100") is agent
    with pytest.raises(ValidationError):
        cfg.default_agent = "y"  # type: ignore[misc]
    with pytest.raises(ValidationError, match="unknown agent 'nope'"):
        Config.model_validate({"agents": {"x": {"llm": {"provider": "scripted"}}}, "default_agent": "nope"})


def test_parse_config_reports_the_given_source() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config("default_agent: [\n", source="inline.yaml", env={})
    assert info.value.errors[0].file == "inline.yaml"
