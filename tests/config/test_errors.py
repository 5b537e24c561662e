"""Broken files: every problem names the file, the line and column of the offending key, the
dotted field and what was expected. The offending line of each case carries a ``# <-`` marker."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from config import ConfigError, ConfigErrorItem, load_config


class PaymentNode:
    """A node class that a ``ref`` can name."""


NOT_CALLABLE = 42


def marked_line(text: str) -> int:
    """The 1-based line of the ``# <-`` marker."""
    return next(n for n, line in enumerate(text.splitlines(), 1) if "# <-" in line)


def load_bad(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> ConfigError:
    path = tmp_path / "agents.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path, env=env or {})
    return info.value


def only_error(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> ConfigErrorItem:
    """Load ``text``, expect exactly one problem, on the marked line; return it."""
    text = textwrap.dedent(text)
    error = load_bad(tmp_path, text, env)
    assert len(error.errors) == 1, str(error)
    item = error.errors[0]
    assert item.file == str(tmp_path / "agents.yaml")
    assert item.line == marked_line(text), str(error)
    # str() carries file:line:col: field: message
    assert str(error) == f"{item.file}:{item.line}:{item.col}: {item.field}: {item.message}" or (
        not item.field and str(error) == f"{item.file}:{item.line}:{item.col}: {item.message}"
    )
    return item


def test_wrong_type(tmp_path: Path) -> None:
    item = only_error(
        tmp_path,
        """\
        default_agent: support
        agents:
          support:
            llm: {provider: scripted}
            barge_in:
              commit_ms: soon   # <-
        """,
    )
    assert item.col == 7
    assert item.field == "agents.support.barge_in.commit_ms"
    assert item.message == "expected a number, got 'soon'"


def test_wrong_type_for_a_string_suggests_quoting(tmp_path: Path) -> None:
    item = only_error(
        tmp_path,
        """\
        default_agent: support
        agents:
          support:
            llm: {provider: scripted}
            stt:
              language: no   # <-
        """,
    )
    assert item.field == "agents.support.stt.language"
    assert item.message == "expected a string, got false; quote it if you meant the text"


def test_unknown_field_suggests_the_close_one(tmp_path: Path) -> None:
    item = only_error(
        tmp_path,
        """\
        default_agent: support
        agents:
          support:
            llm: {provider: scripted}
            barge_inn:          # <-
              commit_ms: 500
        """,
    )
    assert item.field == "agents.support.barge_inn"
    assert item.col == 5
    assert "unknown field 'barge_inn'" in item.message
    assert "did you mean 'barge_in'?" in item.message
    assert "expected one of: greeting, llm, stt, tts, barge_in" in item.message


def test_missing_required_field_points_at_the_parent(tmp_path: Path) -> None:
    item = only_error(
        tmp_path,
        """\
        default_agent: support
        agents:
          support:
            llm:        # <-
              model: gpt-4o-mini
        """,
    )
    assert item.field == "agents.support.llm.provider"
    assert item.message == "missing required field: expected one of 'openai', 'scripted'"


def test_missing_secret_env_var(tmp_path: Path) -> None:
    item = only_error(
        tmp_path,
        """\
        default_agent: support
        twilio:
          auth_token: ${TWILIO_AUTH_TOKEN}   # <-
        agents:
          support: {llm: {provider: scripted}}
        """,
    )
    assert item.field == "twilio.auth_token"
    assert "TWILIO_AUTH_TOKEN is not set" in item.message


@pytest.mark.parametrize(
    "value",
    ["sk-live-abcdef123456", "'12345'", "12345", "prefix-${OPENAI_API_KEY}"],
)
def test_literal_secret_is_rejected(tmp_path: Path, value: str) -> None:
    item = only_error(
        tmp_path,
        f"""\
        default_agent: support
        agents:
          support:
            llm:
              provider: openai
              model: gpt-4o-mini
              api_key: {value}   # <-
        """,
        env={"OPENAI_API_KEY": "x"},
    )
    assert item.field == "agents.support.llm.api_key"
    assert "literal secret" in item.message and "${OPENAI_API_KEY}" in item.message
    assert "abcdef" not in item.message and "12345" not in item.message


def test_secret_with_a_default_is_rejected(tmp_path: Path) -> None:
    item = only_error(
        tmp_path,
        """\
        default_agent: support
        twilio:
          auth_token: ${TWILIO_AUTH_TOKEN:-letmein}   # <-
        agents:
          support: {llm: {provider: scripted}}
        """,
    )
    assert item.field == "twilio.auth_token"
    assert "use ${TWILIO_AUTH_TOKEN} or ${TWILIO_AUTH_TOKEN:-}" in item.message


def test_literal_redis_password_is_rejected(tmp_path: Path) -> None:
    item = only_error(
        tmp_path,
        """\
        default_agent: support
        bus:
          redis_url: redis://:hunter2@localhost:6379/0   # <-
        agents:
          support: {llm: {provider: scripted}}
        """,
    )
    assert item.field == "bus.redis_url"
    assert "literal password" in item.message and "hunter2" not in item.message


def test_unknown_python_node_module(tmp_path: Path) -> None:
    item = only_error(
        tmp_path,
        """\
        default_agent: support
        agents:
          support:
            nodes:
              - kind: python
                name: pay
                ref: callgate_no_such_module.nodes:PaymentNode   # <-
        """,
    )
    assert item.field == "agents.support.nodes[0].ref"
    assert item.col == 9
    assert "no module named 'callgate_no_such_module'" in item.message


def test_unknown_python_node_attribute(tmp_path: Path) -> None:
    item = only_error(
        tmp_path,
        """\
        default_agent: support
        agents:
          support:
            nodes:
              - kind: python
                name: ok
                ref: tests.config.test_errors:PaymentNode
              - kind: python
                name: pay
                ref: tests.config.test_errors:PaymentNod   # <-
        """,
    )
    assert item.field == "agents.support.nodes[1].ref"
    assert "module 'tests.config.test_errors' has no attribute 'PaymentNod'" in item.message


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        ("tests.config.test_errors.PaymentNode", "expected 'module:attribute'"),
        ("tests.config.test_errors:", "expected 'module:attribute'"),
        ("tests.config.test_errors:NOT_CALLABLE", "is not a class or function"),
    ],
)
def test_malformed_python_node_ref(tmp_path: Path, ref: str, expected: str) -> None:
    item = only_error(
        tmp_path,
        f"""\
        default_agent: support
        agents:
          support:
            nodes:
              - {{kind: python, name: pay, ref: "{ref}"}}   # <-
        """,
    )
    assert item.field == "agents.support.nodes[0].ref"
    assert expected in item.message


def test_unknown_tool_module(tmp_path: Path) -> None:
    item = only_error(
        tmp_path,
        """\
        default_agent: support
        agents:
          support:
            llm:
              provider: scripted
              tools:
                - callgate_no_such_tools:lookup   # <-
        """,
    )
    assert item.field == "agents.support.llm.tools[0]"


def test_cycle_in_edges_is_named(tmp_path: Path) -> None:
    item = only_error(
        tmp_path,
        """\
        default_agent: support
        agents:
          support:
            llm: {provider: scripted}
            nodes:
              - {kind: llm, name: a}
              - {kind: llm, name: b}
              - {kind: llm, name: c}
            edges:
              - [a, b]
              - {from: b, to: c}
              - [c, a]     # <-
        """,
    )
    assert item.field == "agents.support.edges[2]"
    assert item.message == "edges form a cycle: a -> b -> c -> a"


def test_self_loop_is_a_cycle(tmp_path: Path) -> None:
    item = only_error(
        tmp_path,
        """\
        default_agent: support
        agents:
          support:
            llm: {provider: scripted}
            nodes: [{kind: llm, name: a}]
            edges:
              - [a, a]     # <-
        """,
    )
    assert item.message == "edges form a cycle: a -> a"


def test_edge_to_unknown_node(tmp_path: Path) -> None:
    item = only_error(
        tmp_path,
        """\
        default_agent: support
        agents:
          support:
            llm: {provider: scripted}
            nodes:
              - {kind: llm, name: main}
              - {kind: llm, name: payment}
            edges:
              - from: main      # <-
                to: paymnet
        """,
    )
    assert item.field == "agents.support.edges[0]"
    assert item.message == "edge refers to unknown node 'paymnet'; nodes: main, payment"


def test_malformed_edge(tmp_path: Path) -> None:
    item = only_error(
        tmp_path,
        """\
        default_agent: support
        agents:
          support:
            llm: {provider: scripted}
            nodes: [{kind: llm, name: a}, {kind: llm, name: b}]
            edges:
              - {from: a, too: b}     # <-
        """,
    )
    assert item.field == "agents.support.edges[0]"
    assert "expected an edge {from: NODE, to: NODE} or [NODE, NODE]" in item.message


def test_duplicate_node_names(tmp_path: Path) -> None:
    item = only_error(
        tmp_path,
        """\
        default_agent: support
        agents:
          support:
            llm: {provider: scripted}
            nodes:
              - kind: llm
                name: main
              - kind: llm
                name: main     # <-
        """,
    )
    assert item.field == "agents.support.nodes[1].name"
    assert "duplicate node name 'main'" in item.message


def test_script_goto_unknown_node(tmp_path: Path) -> None:
    item = only_error(
        tmp_path,
        """\
        default_agent: support
        agents:
          support:
            llm: {provider: scripted}
            nodes: [{kind: llm, name: main}]
            script:
              - keywords: [pay]
                goto: payment    # <-
        """,
    )
    assert item.field == "agents.support.script[0].goto"


def test_bad_e164_number(tmp_path: Path) -> None:
    item = only_error(
        tmp_path,
        """\
        default_agent: support
        numbers:
          "+14155550100": support
          "415-555-0100": support   # <-
        agents:
          support: {llm: {provider: scripted}}
        """,
    )
    assert item.field == 'numbers["415-555-0100"]'
    assert item.col == 3
    assert "expected an E.164 phone number like +14155550100" in item.message


def test_number_mapped_to_unknown_agent(tmp_path: Path) -> None:
    item = only_error(
        tmp_path,
        """\
        default_agent: support
        numbers:
          "+14155550100": support
          "+14155550101": sales   # <-
        agents:
          support: {llm: {provider: scripted}}
        """,
    )
    assert item.field == 'numbers["+14155550101"]'
    assert item.message == "+14155550101 is mapped to unknown agent 'sales'; agents: support"


def test_default_agent_unknown(tmp_path: Path) -> None:
    item = only_error(
        tmp_path,
        """\
        agents:
          support: {llm: {provider: scripted}}
        default_agent: suport    # <-
        """,
    )
    assert (item.field, item.col) == ("default_agent", 1)
    assert item.message == "unknown agent 'suport'; agents: support"


def test_yaml_syntax_error_names_file_line_and_field(tmp_path: Path) -> None:
    item = only_error(
        tmp_path,
        """\
        default_agent: support
        agents:
          support:
            greeting: "unterminated   # <-
            llm: {provider: scripted}
        """,
    )
    assert item.field == "agents.support.greeting"  # where the unclosed quote opened
    assert item.message.startswith("invalid YAML: found unexpected end of stream")


def test_yaml_multiple_documents(tmp_path: Path) -> None:
    item = only_error(
        tmp_path,
        """\
        default_agent: support
        ---   # <-
        agents: {}
        """,
    )
    assert "expected a single document" in item.message


def test_yaml_flow_mapping_hint_for_unquoted_reference(tmp_path: Path) -> None:
    item = only_error(
        tmp_path,
        """\
        default_agent: support
        agents:
          support:
            llm: {provider: openai, model: x, api_key: ${OPENAI_API_KEY}}   # <-
        """,
    )
    assert item.message.endswith("quote values that use ${VAR} inside [...] or {...}")


def test_yaml_bad_indentation_points_at_the_line(tmp_path: Path) -> None:
    item = only_error(
        tmp_path,
        """\
        default_agent: support
        agents:
          support:
            llm: {provider: scripted}
           tts: {provider: espeak}   # <-
        """,
    )
    assert item.message.startswith("invalid YAML")


def test_bad_enum_value(tmp_path: Path) -> None:
    item = only_error(
        tmp_path,
        """\
        default_agent: support
        agents:
          support:
            llm: {provider: scripted}
            stt:
              provider: whisper   # <-
        """,
    )
    assert item.field == "agents.support.stt.provider"
    assert item.message == "expected 'pocketsphinx' or 'openai', got 'whisper'"


def test_bad_node_kind(tmp_path: Path) -> None:
    item = only_error(
        tmp_path,
        """\
        default_agent: support
        agents:
          support:
            llm: {provider: scripted}
            nodes:
              - name: x
                kind: lua    # <-
        """,
    )
    assert item.field == "agents.support.nodes[0].kind"
    assert item.message == "expected one of 'llm', 'python', got 'lua'"


def test_out_of_range(tmp_path: Path) -> None:
    item = only_error(
        tmp_path,
        """\
        default_agent: support
        agents:
          support:
            llm: {provider: scripted}
            barge_in:
              p_on: 1.5   # <-
        """,
    )
    assert item.message == "expected a number at most 1, got 1.5"


def test_duplicate_yaml_key(tmp_path: Path) -> None:
    item = only_error(
        tmp_path,
        """\
        default_agent: support
        agents:
          support:
            llm: {provider: scripted}
            greeting: hello
            greeting: hi again   # <-
        """,
    )
    assert item.field == "agents.support.greeting"
    assert item.message == "duplicate key 'greeting' (first at line 5)"


def test_interpolated_value_of_the_wrong_type_names_its_source(tmp_path: Path) -> None:
    item = only_error(
        tmp_path,
        """\
        default_agent: support
        server:
          port: ${CALLGATE_PORT:-eighty}   # <-
        agents:
          support: {llm: {provider: scripted}}
        """,
    )
    assert item.message == "expected a whole number, got 'eighty' (from ${CALLGATE_PORT:-eighty})"


def test_every_problem_is_reported_in_file_order(tmp_path: Path) -> None:
    text = textwrap.dedent(
        """\
        server:
          port: http
        twilio:
          auth_token: plain-text-token
        numbers:
          "+14155550100": nobody
        default_agent: support
        agents:
          support:
            llm: {provider: scripted}
            barge_in: {commit_ms: soon, start_windows: 0}
            nodes:
              - {kind: python, name: x, ref: "callgate_no_such_module:X"}
        """
    )
    error = load_bad(tmp_path, text)
    got = [(item.line, item.field) for item in error.errors]
    assert got == [
        (2, "server.port"),
        (4, "twilio.auth_token"),
        (6, 'numbers["+14155550100"]'),
        (11, "agents.support.barge_in.commit_ms"),
        (11, "agents.support.barge_in.start_windows"),
        (13, "agents.support.nodes[0].ref"),
    ]
    lines = str(error).splitlines()
    assert len(lines) == 6
    assert all(line.startswith(str(tmp_path / "agents.yaml") + ":") for line in lines)
    assert "plain-text-token" not in str(error)


def scripted(extra: str = "", top: str = "") -> str:
    """A one-agent file; ``extra`` goes into agent x's flow mapping, ``top`` at the top level."""
    return f"default_agent: x\n{top}agents:\n  x: {{llm: {{provider: scripted}}{extra}}}\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "the file is empty"),
        ("- a\n- b\n", "expected a mapping of settings at the top of the file, got a list"),
        ("agents: {}\ndefault_agent: x\n", "expected at least 1 item(s), got 0"),
        ("default_agent: x\nagents: {x: {}}\n", "an agent needs an `llm` section or at least one node"),
        ("default_agent: x\nagents: {x: {nodes: [{kind: llm, name: a}]}}\n", "needs the agent's `llm`"),
        ("default_agent: x\nagents: {x: {llm: {provider: openai}}}\n", "needs a model"),
        (scripted(top="server: {public_url: 'gw.example.com'}\n"), "expected an http(s) URL"),
        (scripted(top="server: {public_url: 'https://gw/x'}\n"), "without path"),
        (scripted(top="bus: {redis_url: 'http://r'}\n"), "expected a redis://"),
        (scripted(top="twilio: {account_sid: 'ACnope'}\n"), "expected a Twilio account SID"),
        (scripted(", barge_in: {p_on: 0.2}"), "expected at most p_on (0.2)"),
        (scripted(", script: [{keywords: [hi]}]"), "a rule needs at least one of"),
        (scripted(", script: [{keywords: [hi], transfer_to: '911'}]"), "expected an E.164"),
        (scripted(", greeting: !env HOME"), "invalid YAML value"),
        (scripted(", name: y"), "expected the agent's key 'x', got 'y'"),
    ],
)
def test_other_problems(tmp_path: Path, text: str, message: str) -> None:
    error = load_bad(tmp_path, text)
    assert any(message in item.message for item in error.errors), str(error)
    assert all(item.line is not None for item in error.errors)


def test_missing_file() -> None:
    with pytest.raises(ConfigError) as info:
        load_config("/nonexistent/agents.yaml", env={})
    assert str(info.value) == "/nonexistent/agents.yaml: file not found"
    assert info.value.errors == [
        ConfigErrorItem("/nonexistent/agents.yaml", None, None, "", "file not found")
    ]


def test_relative_path_is_shown_as_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "a.yaml").write_text("default_agent: x\nagents: {}\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config("conf/a.yaml", env={})
    assert "conf/a.yaml:2:1: agents: expected at least 1 item(s), got 0" in str(info.value).splitlines()


def test_config_error_pickles_with_its_items() -> None:
    import pickle

    error = ConfigError([ConfigErrorItem("a.yaml", 3, 5, "server.port", "expected a whole number")])
    copy = pickle.loads(pickle.dumps(error))
    assert copy.errors == error.errors
    assert str(copy) == "a.yaml:3:5: server.port: expected a whole number"
