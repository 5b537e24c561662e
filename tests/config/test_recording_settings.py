"""An agent's ``recording:`` YAML section reaches the recorder whole, with one set of defaults
(``config.RecordingConfig`` for validation, ``gateway.recorder.RecordingSettings`` for use)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from config._schema import RecordingConfig
from gateway.recorder import RecordingSettings
from gateway.server import recording_settings_from

CHANGES: dict[str, Any] = {"keep_calls": 5, "keep_days": 1.5, "max_seconds": 600.0}


def test_the_yaml_defaults_are_the_recorder_defaults() -> None:
    assert recording_settings_from(RecordingConfig(folder="rec")) == RecordingSettings(Path("rec"))


@pytest.mark.parametrize("name", sorted(CHANGES))
def test_each_field_reaches_the_recorder(name: str) -> None:
    assert set(CHANGES) | {"folder"} == set(RecordingConfig.model_fields)
    changed = recording_settings_from(RecordingConfig(folder="rec", **{name: CHANGES[name]}))
    assert getattr(changed, name) == CHANGES[name] != getattr(RecordingSettings(Path("rec")), name)


def test_a_recording_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_seconds"):
        RecordingConfig(folder="rec", max_seconds=0)
