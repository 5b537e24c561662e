"""callgate config: the YAML that ops edit (agents, numbers, barge-in thresholds) and its schema.

    cfg = load_config()                      # $CALLGATE_CONFIG, else config/agents.yaml
    agent = cfg.agent_for_number("+14155550100")

Modules:

* ``_schema``: the pydantic models (unknown fields are errors, every model frozen).
* ``_yaml``: YAML -> plain data with the line and column of every key; ``${VAR}`` expansion.
* ``_interpolate``: ``${VAR}`` / ``${VAR:-default}``, and the secrets-only-from-env rule.
* ``_loader``: ``load_config``; turns every problem into ``file:line:col: field: message``.
* ``_errors``: :class:`ConfigError`.
* ``_reload``: :class:`ConfigHolder`, reload on demand, SIGHUP or file change.
* ``_summary``: the text ``callgate config check`` prints.
"""

from ._errors import ConfigError, ConfigErrorItem, ConfigProblem
from ._loader import DEFAULT_CONFIG, Validator, load_config, parse_config, resolve_config_path
from ._reload import RESTART_REQUIRED, ConfigHolder, ReloadResult
from ._schema import (
    AgentConfig,
    BargeInConfig,
    BusConfig,
    Config,
    LLMConfig,
    LLMNodeConfig,
    NodeConfig,
    PythonNodeConfig,
    ScriptRule,
    ServerConfig,
    STTConfig,
    TTSConfig,
    TurnConfig,
    TwilioConfig,
)

__all__ = [
    "DEFAULT_CONFIG",
    "RESTART_REQUIRED",
    "AgentConfig",
    "BargeInConfig",
    "BusConfig",
    "Config",
    "ConfigError",
    "ConfigErrorItem",
    "ConfigProblem",
    "ConfigHolder",
    "LLMConfig",
    "LLMNodeConfig",
    "NodeConfig",
    "PythonNodeConfig",
    "ReloadResult",
    "STTConfig",
    "ScriptRule",
    "ServerConfig",
    "TTSConfig",
    "TurnConfig",
    "TwilioConfig",
    "Validator",
    "load_config",
    "parse_config",
    "resolve_config_path",
]
