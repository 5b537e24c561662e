"""The per-agent ``turn:`` section: checked with file/line/field, and it reaches the call."""

from __future__ import annotations

import pytest

from config import ConfigError, parse_config
from gateway.server import call_settings_from
from vad._turn import TurnSettings

BASE = "default_agent: support\nagents:\n  support:\n    llm: {provider: scripted}\n"


def test_turn_section_reaches_the_call_settings() -> None:
    cfg = parse_config(BASE + "    turn: {patience: 1.4, min_wait_ms: 300, max_wait_ms: 900}\n",
                       source="inline.yaml")
    agent = cfg.agents["support"]
    settings = call_settings_from(agent.barge_in, agent.turn)
    assert settings.turn.patience == 1.4
    assert (settings.turn.min_wait_ms, settings.turn.max_wait_ms) == (300.0, 900.0)
    assert settings.turn.mode == "prosody"
    # No section: the core's own defaults, the same as the schema's.
    plain = parse_config(BASE, source="inline.yaml").agents["support"].turn
    assert TurnSettings(**plain.model_dump()) == TurnSettings()
    assert call_settings_from(agent.barge_in).turn == TurnSettings()


@pytest.mark.parametrize(
    ("section", "field", "needle"),
    [
        ("{max_wait_ms: 200}", "agents.support.turn.max_wait_ms", "at least min_wait_ms"),
        ("{patience: 0}", "agents.support.turn.patience", "greater than 0"),
        ("{mode: timer}", "agents.support.turn.mode", "prosody"),
        ("{text_cues: german}", "agents.support.turn.text_cues", "'english' or 'off'"),
    ],
)
def test_bad_turn_settings_name_file_line_and_field(section: str, field: str, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(BASE + f"    turn: {section}\n", source="inline.yaml")
    text = str(err.value)
    assert "inline.yaml:5" in text and field in text and needle in text


def test_text_cues_off_reaches_the_detector_and_another_language_needs_it() -> None:
    """A bare YAML ``off`` is the string, not false; an agent whose speech to text is not in
    English must say ``text_cues: off`` (the word lists are English), and is told where."""
    german = BASE + "    stt: {provider: openai, language: de-DE}\n"
    agent = parse_config(german + "    turn: {text_cues: off}\n",
                         source="inline.yaml").agents["support"]
    assert agent.turn.text_cues == "off"
    assert call_settings_from(agent.barge_in, agent.turn).turn.text_cues == "off"
    assert TurnSettings().text_cues == "english"
    with pytest.raises(ConfigError) as err:
        parse_config(german + "    turn: {patience: 1.2}\n", source="inline.yaml")
    text = str(err.value)
    assert "inline.yaml:5" in text and "agents.support.stt.language" in text
    assert "'de-DE' is not English" in text and "text_cues: off" in text
    # English however it is written; none at all (the recogniser detects one) is asked for.
    for english in ("en-GB", "en_US", "' en-US'", "EN"):
        cfg = parse_config(BASE + f"    stt: {{provider: openai, language: {english}}}\n",
                           source="inline.yaml")
        assert cfg.agents["support"].turn.text_cues == "english", english
    with pytest.raises(ConfigError) as err:
        parse_config(BASE + "    stt: {provider: openai, language: ''}\n", source="inline.yaml")
    assert "agents.support.stt.language" in str(err.value) and "is empty" in str(err.value)
    # pocketsphinx's model is English whatever the language says: its words fit the lists.
    offline = parse_config(BASE + "    stt: {language: de-DE}\n", source="inline.yaml")
    assert offline.agents["support"].turn.text_cues == "english"
