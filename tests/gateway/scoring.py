"""Barge-in scoring with the rules of tools/eval_bargein.py: moved to :mod:`linesim.scoring`
(the bench scores simulated calls with it too); kept here as the tests' import path."""

from __future__ import annotations

from linesim.scoring import (
    DTMF_GRACE_MS,
    EARLY_SLACK_MS,
    LATE_LIMIT_MS,
    STOP_TYPES,
    bot_speaking,
    score,
    summary,
)

__all__ = ["DTMF_GRACE_MS", "EARLY_SLACK_MS", "LATE_LIMIT_MS", "STOP_TYPES", "bot_speaking",
           "score", "summary"]
