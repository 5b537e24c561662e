"""deploy/prometheus/alerts.yaml: a well-formed Prometheus rule file whose every metric and refusal
reason is one the gateway and worker really expose (so a rename cannot silently blind an alert)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bus import RedisBus
from gateway.metrics import REFUSAL_REASONS, GatewayMetrics, WorkerMetrics

from ._support import DEPLOY, load_yaml

ALERTS = DEPLOY / "prometheus" / "alerts.yaml"
_DURATION = re.compile(r"^\d+(ms|s|m|h|d)$")
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
             "gauge": ("",), "summary": ("_sum", "_count", "")}


def _rules() -> list[dict[str, Any]]:
    doc = load_yaml(ALERTS)
    assert set(doc) == {"groups"}
    rules = []
    names = set()
    for group in doc["groups"]:
        assert set(group) == {"name", "rules"} and group["name"] not in names
        names.add(group["name"])
        rules.extend(group["rules"])
    return rules


def _state() -> dict[str, Any]:
    """What GatewayApp._metrics_state gives, with a Redis bus (it reports before it connects)."""
    return {"calls": 0, "draining": False, "overloaded": False, "vad_batches": 0,
            "vad_windows": 0, "bus": RedisBus("redis://127.0.0.1:1/0").stats()}


def _exposed_samples() -> set[str]:
    """Every sample name the gateway's and a worker's /metrics can show."""
    bus = RedisBus("redis://127.0.0.1:1/0")
    text = GatewayMetrics(_state).render().decode()
    text += WorkerMetrics(bus.stats).render().decode()
    samples = set()
    for family in text_string_to_metric_families(text):
        for suffix in _SUFFIXES[family.type]:
            samples.add(family.name + suffix)
    return samples


def test_every_rule_is_complete() -> None:
    rules = _rules()
    assert len(rules) >= 8
    seen = set()
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
        assert rule["alert"] not in seen and re.fullmatch(r"Callgate[A-Za-z]+", rule["alert"])
        seen.add(rule["alert"])
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        if "for" in rule:
            assert _DURATION.match(rule["for"]), rule["for"]
        expr = rule["expr"]
        assert expr.count("(") == expr.count(")") and expr.count("[") == expr.count("]")
        for window in re.findall(r"\[([^\]]+)\]", expr):
            assert _DURATION.match(window), (rule["alert"], window)


@pytest.mark.parametrize("rule", _rules(), ids=lambda r: r["alert"])
def test_alerts_name_metrics_the_code_exposes(rule: dict[str, Any]) -> None:
    exposed = _exposed_samples()
    used = re.findall(r"\b(callgate_[a-z_]+)", rule["expr"])
    assert used, rule["alert"]
    missing = [name for name in used if name not in exposed]
    assert not missing, f"{rule['alert']}: {missing} not exposed"


def test_refusal_reasons_in_alerts_are_the_gateways() -> None:
    """The gateway counts refusals only under REFUSAL_REASONS (GatewayMetrics.refused refuses
    any other), and every reason an alert names is one of them."""
    reasons = set()
    for rule in _rules():
        for values in re.findall(r'reason=~?"([^"]+)"', rule["expr"]):
            reasons.update(values.split("|"))
    assert reasons >= {"at_capacity", "overloaded", "token"}
    assert reasons <= set(REFUSAL_REASONS)
    metrics = GatewayMetrics(_state)
    with pytest.raises(ValueError, match="unknown refusal reason"):
        metrics.refused("at capacity")
    text = metrics.render().decode()
    for reason in REFUSAL_REASONS:  # every series exists at 0 before the first refusal
        assert f'callgate_calls_refused_total{{reason="{reason}"}} 0.0' in text
