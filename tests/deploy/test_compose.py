"""deploy/compose.yaml against the Compose specification schema, then what callgate needs."""

from __future__ import annotations

import copy
import importlib.resources
import json
from typing import Any

import jsonschema
import pytest

from ._support import (
    AGENTS_YAML,
    COMPOSE,
    DEPLOY,
    ENV_EXAMPLE,
    REDIS_CONF,
    load_yaml,
    parse_env_file,
    parse_redis_conf,
    size_bytes,
)

REDIS_URL = "redis://redis:6379/0"
CONFIG_PATH = "/etc/callgate/agents.yaml"


@pytest.fixture(scope="module")
def compose_schema() -> dict[str, Any]:
    """The official Compose specification schema (compose-spec.json), as vendored by the
    `check-jsonschema` package (builtin_schemas/vendor/compose-spec.json)."""
    ref = importlib.resources.files("check_jsonschema").joinpath(
        "builtin_schemas/vendor/compose-spec.json"
    )
    schema: dict[str, Any] = json.loads(ref.read_text(encoding="utf-8"))
    assert schema.get("title") == "Compose Specification", schema.get("title")
    return schema


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data: dict[str, Any] = load_yaml(COMPOSE)
    return data


def _errors(schema: dict[str, Any], doc: Any) -> list[str]:
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return [f"{e.json_path}: {e.message}" for e in cls(schema).iter_errors(doc)]


def test_matches_the_compose_specification(
    compose_schema: dict[str, Any], compose: dict[str, Any]
) -> None:
    assert _errors(compose_schema, compose) == []


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d["services"]["gateway"].update(helthcheck={}),  # a typo
        # (a string would pass: the specification allows ${VAR} interpolation everywhere)
        lambda d: d["services"]["worker"]["deploy"].update(replicas=[2]),
        lambda d: d["services"]["redis"].update(depends_on=7),
    ],
    ids=["unknown-key", "bad-type", "bad-shape"],
)
def test_schema_rejects_broken_files(
    compose_schema: dict[str, Any], compose: dict[str, Any], mutate: Any
) -> None:
    """The validation above is live: the schema refuses typical mistakes."""
    doc = copy.deepcopy(compose)
    mutate(doc)
    assert _errors(compose_schema, doc)


def test_services(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == {"redis", "gateway", "worker", "gateway-2", "worker-3"}
    default = {name for name, svc in compose["services"].items() if not svc.get("profiles")}
    assert default == {"redis", "gateway", "worker"}


def _replicas(svc: dict[str, Any]) -> int:
    return int(svc.get("deploy", {}).get("replicas", 1))


def test_fleet_profile_adds_a_gateway_and_a_worker(compose: dict[str, Any]) -> None:
    """``--profile fleet``: two gateways and three workers on one Redis, as tests/fleet runs."""
    services = compose["services"]
    fleet = {name: svc for name, svc in services.items() if "fleet" in svc.get("profiles", [])}
    assert set(fleet) == {"gateway-2", "worker-3"}
    running = {name: svc for name, svc in services.items()
               if not svc.get("profiles") or "fleet" in svc["profiles"]}
    gateways = [s for s in running.values() if s["command"][0] == "serve"]
    workers = [s for s in running.values() if s["command"][0] == "worker"]
    assert len(gateways) == 2 and sum(_replicas(w) for w in workers) == 3
    gw, gw2 = services["gateway"], services["gateway-2"]
    for key in ("command", "healthcheck", "stop_grace_period", "environment", "volumes"):
        assert gw2[key] == gw[key], key
    assert "8081:8080" in [str(p) for p in gw2["ports"]]
    assert "8080:8080" not in [str(p) for p in gw2["ports"]], "each gateway its own host port"
    assert services["worker-3"]["command"] == services["worker"]["command"]


def test_gateway(compose: dict[str, Any]) -> None:
    gw = compose["services"]["gateway"]
    assert gw["command"] == ["serve", "--redis", REDIS_URL, "--no-worker"]
    assert "8080:8080" in [str(p) for p in gw["ports"]]
    check = " ".join(gw["healthcheck"]["test"])
    assert "/healthz" in check and "127.0.0.1:8080" in check
    assert gw["depends_on"]["redis"]["condition"] == "service_healthy"


def test_two_workers_with_metrics_and_healthcheck(compose: dict[str, Any]) -> None:
    from gateway.cli import build_parser

    worker = compose["services"]["worker"]
    assert worker["command"] == ["worker", "--redis", REDIS_URL, "--metrics-port", "9090",
                                 "--drain-timeout", "10"]
    args = build_parser().parse_args(worker["command"])  # the CLI takes exactly this
    assert args.metrics_port == 9090 and args.redis == REDIS_URL and args.drain_timeout == 10
    assert worker["deploy"]["replicas"] == 2
    assert "http://127.0.0.1:9090/healthz" in " ".join(worker["healthcheck"]["test"])
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"


@pytest.mark.parametrize("service", ["gateway", "worker"])
def test_config_mounted_read_only(compose: dict[str, Any], service: str) -> None:
    svc = compose["services"][service]
    assert svc["environment"]["CALLGATE_CONFIG"] == CONFIG_PATH
    mounts = [v for v in svc["volumes"] if isinstance(v, dict) and v.get("target") == CONFIG_PATH]
    assert len(mounts) == 1
    mount = mounts[0]
    assert mount["type"] == "bind" and mount["read_only"] is True
    assert (DEPLOY / mount["source"]).resolve() == AGENTS_YAML.resolve()


@pytest.mark.parametrize("service", ["gateway", "worker"])
def test_secrets_come_from_the_env_file(compose: dict[str, Any], service: str) -> None:
    files = compose["services"][service]["env_file"]
    paths = [f["path"] if isinstance(f, dict) else f for f in files]
    assert paths == [".env"]
    assert ENV_EXAMPLE.is_file()
    ignored = (DEPLOY / ".gitignore").read_text(encoding="utf-8").split()
    assert ".env" in ignored, "deploy/.env holds secrets: deploy/.gitignore must list it"
    for secret in ("TWILIO_AUTH_TOKEN", "CALLGATE_TOKEN_SECRET", "OPENAI_API_KEY"):
        assert secret not in compose["services"][service].get("environment", {})


def test_env_example_holds_no_secret() -> None:
    env = parse_env_file(ENV_EXAMPLE)
    for key in (
        "TWILIO_ACCOUNT_SID",
        "TWILIO_AUTH_TOKEN",
        "CALLGATE_TOKEN_SECRET",
        "OPENAI_API_KEY",
    ):
        assert key in env, f".env.example should name {key}"
        assert env[key] == "", f".env.example must not carry a value for {key}"
    assert env["CALLGATE_VALIDATE_SIGNATURES"] == "true"
    assert env["CALLGATE_PUBLIC_URL"].startswith("https://")


def test_redis(compose: dict[str, Any]) -> None:
    redis = compose["services"]["redis"]
    image, _, tag = redis["image"].partition(":")
    assert image == "redis" and tag.startswith("7.") and tag.endswith("-alpine"), redis["image"]
    conf = [v for v in redis["volumes"] if v.get("target") == redis["command"][1]]
    assert len(conf) == 1 and conf[0]["read_only"] is True
    assert (DEPLOY / conf[0]["source"]).resolve() == REDIS_CONF.resolve()
    data = [v for v in redis["volumes"] if v.get("target") == "/data"]
    assert data and data[0]["type"] == "volume" and data[0]["source"] in compose["volumes"]
    assert "redis-cli ping" in " ".join(redis["healthcheck"]["test"])
    assert "ports" not in redis, "Redis stays on the compose network"
    maxmemory = size_bytes(parse_redis_conf(REDIS_CONF)["maxmemory"][0])
    assert maxmemory < 0.8 * size_bytes(redis["mem_limit"]), "room for an AOF-rewrite fork"


def test_stop_grace_covers_the_drain(compose: dict[str, Any]) -> None:
    drain = float(load_yaml(AGENTS_YAML)["server"]["drain_timeout_s"])
    grace = compose["services"]["gateway"]["stop_grace_period"]
    assert grace.endswith("s") and float(grace[:-1]) > drain, (grace, drain)


def test_worker_stop_grace_covers_its_drain(compose: dict[str, Any]) -> None:
    from gateway.cli import build_parser

    for name in ("worker", "worker-3"):
        svc = compose["services"][name]
        drain = build_parser().parse_args(svc["command"]).drain_timeout
        grace = svc["stop_grace_period"]
        assert grace.endswith("s") and float(grace[:-1]) > drain + 5, (name, grace, drain)
