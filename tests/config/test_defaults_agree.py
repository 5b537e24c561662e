"""Each barge-in and turn setting has one default: the settings records' (``vad.BargeInSettings``,
``vad.EchoGateSettings``, ``vad._turn.TurnSettings``, ``gateway.call.CallSettings``). The YAML
schema (``config.BargeInConfig``, ``config.TurnConfig``) declares its fields with their defaults
for validation and ``callgate config check``; these tests hold the two to the same values, and
every YAML field to a setting it reaches."""

from __future__ import annotations

from typing import Any

import pytest

from config import BargeInConfig
from config._schema import TurnConfig
from gateway.call import CallSettings
from gateway.server import call_settings_from

# A valid value other than the default, per YAML field.
BARGE_IN_CHANGES: dict[str, Any] = {
    "p_on": 0.6, "p_off": 0.2, "start_windows": 3, "stop_windows": 6, "commit_ms": 500.0,
    "resume_on_backchannel": False, "echo_margin_db": 9.0, "noise_margin_db": 7.0,
    "band_snr_db": 99.0, "playback_lead_ms": 300.0, "playback_chunk_ms": 80,
    "dtmf_interrupts": False, "echo_canceller": "off", "speech_over_uninterruptible": "drop",
    "classifier": "off",
}
TURN_CHANGES: dict[str, Any] = {
    "mode": "silence", "patience": 1.5, "min_wait_ms": 600.0, "max_wait_ms": 3000.0,
    "text_wait_ms": 1200.0, "silence_ms": 900.0, "early_ms": 0.0, "answer_wait_ms": 500.0,
    "speculate": True, "text_cues": "off",
}


def test_the_yaml_defaults_are_the_settings_defaults() -> None:
    assert call_settings_from(BargeInConfig(), TurnConfig()) == CallSettings()


def test_every_field_is_listed_here() -> None:
    assert set(BARGE_IN_CHANGES) == set(BargeInConfig.model_fields)
    assert set(TURN_CHANGES) == set(TurnConfig.model_fields)


@pytest.mark.parametrize("name", sorted(BARGE_IN_CHANGES))
def test_each_barge_in_field_reaches_the_call_settings(name: str) -> None:
    changed = BargeInConfig(**{name: BARGE_IN_CHANGES[name]})
    assert getattr(changed, name) != getattr(BargeInConfig(), name)
    assert call_settings_from(changed) != CallSettings(), f"barge_in.{name} reaches no setting"


@pytest.mark.parametrize("name", sorted(TURN_CHANGES))
def test_each_turn_field_reaches_the_call_settings(name: str) -> None:
    changed = TurnConfig(**{name: TURN_CHANGES[name]})
    assert getattr(changed, name) != getattr(TurnConfig(), name)
    assert call_settings_from(BargeInConfig(), changed) != CallSettings(), f"turn.{name}"


def test_the_fitted_classifier_is_the_files_thresholds() -> None:
    """``classifier: fitted`` (the default) turns on the thresholds bench.fit_classifier wrote
    beside the weights; YAML's bare ``off`` (false) is off."""
    import json

    from vad._policy import CLASSIFIER_FILE

    fitted = call_settings_from(BargeInConfig(classifier="fitted")).barge_in
    params = json.loads(CLASSIFIER_FILE.read_text())["params"]
    assert {f"barge_in.{k}": getattr(fitted, k) for k in
            ("classifier_on", "classifier_windows", "classifier_veto", "classifier_noise_db")} == params
    assert fitted.classifier_on is not None and fitted.classifier_veto is not None
    assert BargeInConfig(classifier=False).classifier == "off"  # type: ignore[arg-type]
    off = call_settings_from(BargeInConfig(classifier="off")).barge_in
    assert off.classifier_on is None and off.classifier_veto is None
    with pytest.raises(ValueError, match="classifier"):
        BargeInConfig(classifier="on")  # type: ignore[arg-type]
