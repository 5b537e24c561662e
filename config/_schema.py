"""The config schema: typed settings per component, filled from YAML in one place.

Every model forbids unknown fields and is frozen: a config is a snapshot, and a reload
(:class:`config.ConfigHolder`) swaps the whole snapshot. Checks that span fields (an edge to an
unknown node, a number mapped to an unknown agent, a cycle) raise one ``callgate_config`` error
whose ``ctx["problems"]`` lists ``(sub_path, message)`` pairs, so that the loader can point each
problem at its own line.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

__all__ = [
    "AgentConfig",
    "BargeInConfig",
    "BusConfig",
    "Config",
    "LLMConfig",
    "LLMNodeConfig",
    "NodeConfig",
    "PythonNodeConfig",
    "ScriptRule",
    "ServerConfig",
    "STTConfig",
    "TTSConfig",
    "TwilioConfig",
    "PROBLEMS_ERROR_TYPE",
    "reference_problems",
]

PROBLEMS_ERROR_TYPE = "callgate_config"
"""Pydantic error type of a cross-field check; ``ctx["problems"]`` holds ``(sub_path, message)``."""

_E164 = re.compile(r"\+[1-9]\d{1,14}")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
_ACCOUNT_SID = re.compile(r"AC[0-9a-fA-F]{32}")

SubPath = tuple[str | int, ...]


def _raise_problems(problems: list[tuple[SubPath, str]]) -> None:
    if problems:
        summary = "; ".join(
            ".".join(str(p) for p in sub) + ": " + msg if sub else msg for sub, msg in problems
        )
        raise PydanticCustomError(
            PROBLEMS_ERROR_TYPE, "{summary}", {"summary": summary, "problems": problems}
        )


# -- field types -------------------------------------------------------------------------------


def _empty_to_none(value: Any) -> Any:
    # ``${VAR:-}`` expands to "": an unset optional setting, not an empty one.
    if isinstance(value, str) and not value.strip():
        return None
    return value


def _check_e164(value: str) -> str:
    if not _E164.fullmatch(value):
        raise ValueError(
            f"expected an E.164 phone number like +14155550100 (a '+', the country code, "
            f"up to 15 digits, no spaces or dashes), got {value!r}"
        )
    return value


def _check_name(value: str) -> str:
    if not _NAME.fullmatch(value):
        raise ValueError(
            f"expected a name of letters, digits, '_', '-' or '.', got {value!r}"
        )
    return value


def _import_ref(value: str) -> str:
    """Check that ``"module:attr"`` imports and names a callable; returns it unchanged."""
    module_name, sep, attr = value.partition(":")
    if not sep or not _DOTTED.fullmatch(module_name) or not _DOTTED.fullmatch(attr):
        raise ValueError(
            f"expected 'module:attribute' (e.g. 'mypackage.nodes:PaymentNode'), got {value!r}"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise ValueError(
                f"cannot import {value!r}: no module named {missing!r} "
                "(is it installed, or on PYTHONPATH?)"
            ) from exc
        raise ValueError(
            f"cannot import {value!r}: module {module_name!r} needs {missing!r}, "
            "which is not installed"
        ) from exc
    except Exception as exc:
        # The module is user code run at check time: any error it raises on import is a
        # problem with the config's reference, reported like the others (not a crash).
        raise ValueError(
            f"cannot import {value!r}: importing {module_name!r} raised "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(
                f"cannot import {value!r}: module {module_name!r} has no attribute {attr!r}"
            )
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{value!r} is not a class or function ({type(target).__name__})")
    return value


def _off_is_off(value: Any) -> Any:
    # YAML 1.1 reads a bare `off` as false: `echo_canceller: off` means what it says.
    return "off" if value is False else value


OptStr = Annotated[str | None, BeforeValidator(_empty_to_none)]
OptSecret = Annotated[SecretStr | None, BeforeValidator(_empty_to_none)]
E164 = Annotated[str, AfterValidator(_check_e164)]
Name = Annotated[str, AfterValidator(_check_name)]
Ref = Annotated[str, AfterValidator(_import_ref)]
"""``"module:attr"``, imported at load time so that a typo fails ``callgate config check``."""


def _edge(value: Any) -> Any:
    if isinstance(value, Mapping):
        keys = set(value)
        if keys != {"from", "to"}:
            raise ValueError(
                "expected an edge {from: NODE, to: NODE} or [NODE, NODE], got a mapping with "
                + (", ".join(sorted(map(str, keys))) or "no keys")
            )
        return (value["from"], value["to"])
    return value


Edge = Annotated[tuple[str, str], BeforeValidator(_edge)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# -- components --------------------------------------------------------------------------------


class ServerConfig(_Model):
    """The gateway's HTTP server."""

    public_url: OptStr = None
    """Base URL Twilio reaches the gateway at, e.g. ``https://gw.example.com``; no path."""
    host: str = "0.0.0.0"
    port: int = Field(8080, ge=0, le=65535)
    max_calls: int = Field(200, ge=1)
    """Calls one gateway takes at once; more are answered with a busy message."""
    overload_lag_ms: float | None = Field(50.0, gt=0)
    """New calls are also refused while the p99 frame lag of the last 4-5 s is over this (the
    calls in progress fall behind their audio); null: only ``max_calls`` limits."""
    drain_timeout_s: float = Field(30.0, ge=0)
    """On shutdown, how long calls in progress may go on before they are cut."""

    @field_validator("public_url")
    @classmethod
    def _check_public_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value.strip())
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"expected an http(s) URL like https://gw.example.com, got {value!r}")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError(
                f"expected a base URL without path or query, like https://gw.example.com, "
                f"got {value!r}"
            )
        return f"{parts.scheme}://{parts.netloc}"

    @property
    def voice_url(self) -> str | None:
        """The TwiML webhook Twilio POSTs to: ``{public_url}/twilio/voice``."""
        return f"{self.public_url}/twilio/voice" if self.public_url else None

    @property
    def media_url(self) -> str | None:
        """The Media Streams WebSocket: ``wss://host/twilio/media`` (``ws://`` for http)."""
        if not self.public_url:
            return None
        scheme, _, rest = self.public_url.partition("://")
        return f"{'wss' if scheme == 'https' else 'ws'}://{rest}/twilio/media"


class TwilioConfig(_Model):
    """Twilio credentials. Secrets only as ``${VAR}`` references."""

    account_sid: OptStr = None
    auth_token: OptSecret = None
    validate_signatures: bool = True
    """Reject webhooks and streams without a valid ``X-Twilio-Signature``. Production: true."""

    @field_validator("account_sid")
    @classmethod
    def _check_sid(cls, value: str | None) -> str | None:
        if value is not None and not _ACCOUNT_SID.fullmatch(value):
            raise ValueError(
                f"expected a Twilio account SID ('AC' and 32 hex digits), got {value!r}"
            )
        return value


class ConsoleConfig(_Model):
    """The browser softphone at ``/console`` and the ops event streams under ``/ops`` (live
    calls, each call's timeline). Both are behind ``auth_token`` when it is set."""

    enabled: bool = False
    """Serve ``/console`` and ``/ops``. Off unless a config turns it on (the shipped one does,
    for a laptop). A gateway that validates Twilio signatures serves them only with an
    ``auth_token``: without one it starts with them off and says so in its log."""
    auth_token: OptSecret = None
    """The ops token (``${VAR}`` only): ``Authorization: Bearer`` or ``?token=`` on every
    console and ops request. Without it they are open, which only a gateway with
    ``twilio.validate_signatures`` off (development) allows."""


class BusConfig(_Model):
    """The event bus between gateways and workers."""

    redis_url: OptStr = None
    """``redis://`` or ``rediss://`` URL of one server, ``redis+cluster://host:port,host:port``
    (``rediss+cluster://``) of a Redis Cluster; empty, absent or ``embedded``: the in-process bus."""

    @field_validator("redis_url")
    @classmethod
    def _check_url(cls, value: str | None) -> str | None:
        if value is None or value.strip() == "embedded":
            return None  # ``bus.make_bus`` reads "embedded" the same way
        parts = urlsplit(value.strip())
        if parts.scheme not in ("redis", "rediss", "redis+cluster", "rediss+cluster") or not parts.netloc:
            # Never echo the URL: it may carry a password from the environment.
            raise ValueError(
                "expected a redis:// or rediss:// URL like redis://localhost:6379/0 (or nothing, "
                f"for the embedded bus), got a URL with scheme {parts.scheme!r}"
                if parts.scheme
                else "expected a redis:// or rediss:// URL like redis://localhost:6379/0 "
                "(or nothing, for the embedded bus)"
            )
        return value.strip()

    @property
    def embedded(self) -> bool:
        """True when no Redis is configured: the bus runs in-process."""
        return self.redis_url is None


class BargeInConfig(_Model):
    """Per-agent barge-in tuning; the defaults work on phone lines."""

    p_on: float = Field(0.5, gt=0, le=1)
    """Silero probability that makes a window speech."""
    p_off: float = Field(0.3, ge=0, lt=1)
    """Below this a window counts towards the end of speech; at most ``p_on``."""
    start_windows: int = Field(2, ge=1)
    """Speech windows (32 ms) in a row that start the caller's speech."""
    stop_windows: int = Field(5, ge=1)
    """Non-speech windows in a row that end it."""
    commit_ms: float = Field(640.0, ge=0)
    """Speech needed before an interrupt is committed to the agent."""
    resume_on_backchannel: bool = True
    """Resume the bot after a short "uh-huh" instead of giving up the turn."""
    echo_margin_db: float = Field(8.0, ge=0)
    """How far above the bot's own echo the caller must be to count."""
    noise_margin_db: float = Field(6.0, ge=0)
    """How far above the line's noise floor the caller must be to count."""
    band_snr_db: float = Field(10.0, ge=0)
    """On lines that carry no echo of the bot: a clearly voiced window this far over the noise
    floor in 1.5-3.4 kHz counts as the caller even when noise masks it broadband (speech in a
    kitchen). Raise it (e.g. 99) to turn that path off."""
    playback_lead_ms: float = Field(240.0, ge=0)
    """Audio sent ahead of the play-out point; what a ``clear`` can still cut."""
    playback_chunk_ms: int = Field(40, ge=20, le=200, multiple_of=20)
    """Bot audio per outbound media message, each followed by a mark: the precision of what the
    caller is known to have heard (``heard_ms``, the resume point). Longer chunks mean fewer
    WebSocket messages each way; at 75 calls per core 80 ms saved no CPU beyond run-to-run noise
    (``bench/load.py --chunk-ms``)."""
    dtmf_interrupts: bool = True
    """A key press interrupts an interruptible utterance like speech does."""
    echo_canceller: Annotated[Literal["aec3", "off"], BeforeValidator(_off_is_off)] = "aec3"
    """WebRTC AEC3 in front of the VAD while bot audio can be echoing (``vad/_aec.py``), or
    ``off``: the echo gate alone, the decision before issue #12 (docs/bargein.md compares
    them)."""
    speech_over_uninterruptible: Literal["keep", "drop"] = "keep"
    """What the caller said over a non-interruptible utterance: keep it as a turn, or drop it."""
    classifier: Annotated[Literal["off", "fitted"], BeforeValidator(_off_is_off)] = "fitted"
    """``fitted`` (the default): the caller classifier fitted on the line simulator's train
    split has a say while the echo canceller is on (vad/bargein_classifier.json: no false
    interrupt on the reserved split, fewer false stops on changing echo, TV and coughs or
    knocks; docs/bargein.md, "A fitted caller classifier"). ``off``: the hand-set paths
    alone."""

    @model_validator(mode="after")
    def _check_hysteresis(self) -> BargeInConfig:
        if self.p_off > self.p_on:
            message = f"expected at most p_on ({self.p_on}), got {self.p_off}"
            _raise_problems([(("p_off",), message)])
        return self


class TurnConfig(_Model):
    """Per-agent turn taking: how long the caller may pause before the bot answers
    (vad/_turn.py, docs/turns.md). Every wait is silence after the caller's last speech."""

    mode: Literal["prosody", "silence"] = "prosody"
    """``prosody``: the wait follows how finished the turn sounded (pitch at its end, a short
    answer, a partial transcript ending on "and"/"um"); ``silence``: a fixed ``silence_ms``."""
    patience: float = Field(1.0, gt=0, le=5)
    """Scales every wait: below 1 answers sooner, above 1 lets slow talkers think."""
    min_wait_ms: float = Field(800.0, ge=0)
    """The wait after a turn that sounds clearly finished."""
    max_wait_ms: float = Field(2400.0, ge=0)
    """The wait after a turn that sounds clearly unfinished; at least ``min_wait_ms``."""
    text_wait_ms: float = Field(1500.0, ge=0)
    """The least wait when the partial transcript ends on a continuation word."""
    answer_wait_ms: float = Field(300.0, ge=0)
    """The most wait when the partial transcript is a complete short answer (yes, no, a digit
    string); partials come only from a streaming recogniser (``stt.transport: realtime``)."""
    silence_ms: float = Field(700.0, ge=0)
    """The fixed wait of ``mode: silence``."""
    early_ms: float = Field(200.0, ge=0)
    """Silence after which the transcript goes out so the agent starts its reply, held until the
    turn's end is confirmed (dropped if the caller goes on); 0: off."""
    speculate: bool = False
    """With ``stt.transport: realtime``: at ``early_ms`` send the partial transcript at once
    (the reply starts without waiting for the final); a final that differs drops the reply
    and makes it again from the final."""
    text_cues: Annotated[Literal["english", "off"], BeforeValidator(_off_is_off)] = "english"
    """How partial transcripts are read: ``english`` word lists (a trailing "and"/"um" waits,
    a bare "yes" or digits answer at once, any other last word shortens the wait), or ``off``:
    not read, the turn end from prosody alone. ``english`` needs an English ``stt.language``;
    set ``off`` for any other language."""

    @model_validator(mode="after")
    def _check_waits(self) -> TurnConfig:
        if self.max_wait_ms < self.min_wait_ms:
            message = f"expected at least min_wait_ms ({self.min_wait_ms}), got {self.max_wait_ms}"
            _raise_problems([(("max_wait_ms",), message)])
        return self


class LLMConfig(_Model):
    """The agent's language model (defaults for its ``llm`` nodes)."""

    provider: Literal["openai", "scripted"]
    """``scripted``: keyword rules (``script``), offline; ``openai``: an OpenAI-compatible API."""
    model: OptStr = None
    base_url: OptStr = None
    api_key: OptSecret = None
    prompt: OptStr = None
    """System prompt."""
    tools: list[Ref] = []
    """Function tools, each ``"module:function"``."""
    temperature: float = Field(0.7, ge=0, le=2)

    @model_validator(mode="after")
    def _check_model(self) -> LLMConfig:
        if self.provider == "openai" and self.model is None:
            _raise_problems([(("model",), "provider 'openai' needs a model, e.g. gpt-4o-mini")])
        return self


class STTConfig(_Model):
    """Speech to text."""

    provider: Literal["pocketsphinx", "openai"] = "pocketsphinx"
    model: OptStr = None
    base_url: OptStr = None
    api_key: OptSecret = None
    language: str = "en-US"
    transport: Literal["upload", "realtime"] = "upload"
    """``openai``: ``upload`` sends each turn as a WAV at its end; ``realtime`` streams the
    caller's audio during the turn over a Realtime transcription session (partial transcripts
    as the caller speaks, the final ready soon after the turn's end; model default
    ``gpt-live-transcribe``), and uploads the turn instead if the session fails."""


class TTSConfig(_Model):
    """Text to speech."""

    provider: Literal["espeak", "openai"] = "espeak"
    voice: OptStr = None
    model: OptStr = None
    base_url: OptStr = None
    api_key: OptSecret = None
    speed: float = Field(1.0, gt=0, le=4)
    lookahead_ms: float | None = Field(800.0, ge=0)
    """How far the audio of a response may run ahead of what the caller has heard before the
    node's next chunk is pulled from ``generate_response``: it must cover synthesizing one
    chunk plus the gateway's progress reports (every 200 ms), or the caller hears a gap. eSpeak
    NG took 14-41 ms for a 48-character sentence (2.8 s of audio) on a loaded 2-core machine;
    800 leaves ~500 ms for a network TTS. ``null`` pulls chunks as fast as they are synthesized
    (the node runs ahead of the caller)."""


class ScriptRule(_Model):
    """A keyword rule of the ``scripted`` LLM: the first rule whose keyword the caller said wins."""

    keywords: list[Annotated[str, Field(min_length=1)]] = Field(min_length=1)
    """Matched case-insensitively as whole words (or phrases) in the caller's transcript."""
    reply: OptStr = None
    """What the agent says."""
    goto: OptStr = None
    """Name of a node of this agent that takes over the conversation (after ``reply``)."""
    transfer_to: E164 | None = None
    """Transfer the call to this number (after ``reply``)."""
    hangup: bool = False
    """End the call (after ``reply``)."""

    @model_validator(mode="after")
    def _check_action(self) -> ScriptRule:
        actions = (self.reply, self.goto, self.transfer_to)
        if all(a is None for a in actions) and not self.hangup:
            _raise_problems([((), "a rule needs at least one of reply, goto, transfer_to, hangup")])
        return self

    def matches(self, text: str) -> bool:
        """Whether ``text`` contains one of the keywords as whole words, ignoring case."""
        return any(
            re.search(rf"(?<!\w){re.escape(keyword.strip())}(?!\w)", text, re.IGNORECASE)
            for keyword in self.keywords
        )


class LLMNodeConfig(_Model):
    """A declarative node driven by the agent's LLM, with per-node overrides."""

    kind: Literal["llm"]
    name: Name
    prompt: OptStr = None
    """System prompt of this node (default: the agent's)."""
    tools: list[Ref] = []
    interruptible: bool = True
    """False: the caller hears everything this node says in full (payments, disclosures)."""
    model: OptStr = None
    """Model override (default: the agent's)."""
    greeting: OptStr = None
    """Said when the node takes over the conversation."""
    script: list[ScriptRule] = []
    """Rules for the ``scripted`` provider while this node has the conversation."""
    fallback: OptStr = None
    """Reply of the ``scripted`` provider when no rule matches (default: the agent's)."""


class PythonNodeConfig(_Model):
    """A node written in Python against the ``nodes`` SDK."""

    kind: Literal["python"]
    name: Name
    ref: Ref
    """``"module:Class"`` (a Node subclass) or ``"module:setup_function"``; imported on load."""
    interruptible: bool | None = None
    """Override of the node's ``is_interruptible``; None keeps the class's own."""
    args: dict[str, Any] = {}
    """Keyword arguments for the class or function."""
    llm: LLMConfig | None = None
    """The node's ``self.llm`` (when the class sets none itself); default: the agent's ``llm``.
    A node class without ``generate_response`` answers with it."""
    tools: list[Ref] = []
    """Function tools, each ``"module:function"``: the node's ``self.tool_registry`` and
    ``self.tool_schemas`` (default: its ``llm.tools``, else the agent's ``llm.tools``)."""


NodeConfig = Annotated[LLMNodeConfig | PythonNodeConfig, Field(discriminator="kind")]


class RecordingConfig(_Model):
    """Call recordings that replay (``gateway/recorder.py``). RECORDINGS HOLD CALLERS' VOICES
    (and what they said and keyed in): turn them on only where callers have been told and
    the law allows, keep them no longer than needed, and protect the folder."""

    folder: str
    """Where each call gets its folder (relative paths: from the gateway's working dir)."""
    keep_calls: int = Field(100, ge=1)
    """The newest this many recorded calls are kept; older ones are deleted."""
    keep_days: float = Field(7.0, gt=0)
    """Recorded calls older than this are deleted."""
    max_seconds: float = Field(3600.0, gt=0)
    """A call is recorded for its first this many seconds of media (it is held in memory
    until it ends, ~15 KB per second); the rest is not kept, and the folder says so."""


class AgentConfig(_Model):
    """One agent: what answers a call."""

    name: Name
    """The agent's key under ``agents`` (filled in from it)."""
    greeting: OptStr = None
    """Said when the call connects."""
    llm: LLMConfig | None = None
    stt: STTConfig = STTConfig()
    tts: TTSConfig = TTSConfig()
    barge_in: BargeInConfig = BargeInConfig()
    turn: TurnConfig = TurnConfig()
    """When the caller's turn is over and the bot may answer."""
    nodes: list[NodeConfig] = []
    """The node graph; empty: one interruptible node driven by ``llm``."""
    edges: list[Edge] = []
    """``[parent, child]`` or ``{from: parent, to: child}``; must form a DAG."""
    script: list[ScriptRule] = []
    """Rules of the ``scripted`` LLM provider, first match wins."""
    fallback: OptStr = None
    """Reply of the ``scripted`` provider when no rule matches."""
    recording: RecordingConfig | None = None
    """Record this agent's calls for replay (off when absent). They hold callers' voices."""

    def node(self, name: str) -> LLMNodeConfig | PythonNodeConfig | None:
        """The node called ``name``, or None."""
        return next((n for n in self.nodes if n.name == name), None)

    @model_validator(mode="after")
    def _check_graph(self) -> AgentConfig:
        problems: list[tuple[SubPath, str]] = []
        if self.llm is None and not self.nodes:
            problems.append(((), "an agent needs an `llm` section or at least one node"))
        seen: dict[str, int] = {}
        for index, node in enumerate(self.nodes):
            if node.name in seen:
                problems.append(
                    (
                        ("nodes", index, "name"),
                        f"duplicate node name {node.name!r} (also nodes[{seen[node.name]}]); "
                        "node names must be unique within an agent",
                    )
                )
            else:
                seen[node.name] = index
            if isinstance(node, LLMNodeConfig) and self.llm is None:
                problems.append(
                    (("nodes", index, "kind"), "an llm node needs the agent's `llm` section")
                )
        known = ", ".join(seen) or "none"
        valid_edges: list[tuple[int, str, str]] = []
        for index, (parent, child) in enumerate(self.edges):
            bad = [n for n in (parent, child) if n not in seen]
            for name in bad:
                problems.append(
                    (("edges", index), f"edge refers to unknown node {name!r}; nodes: {known}")
                )
            if not bad:
                valid_edges.append((index, parent, child))
        cycle = _find_cycle(seen, valid_edges)
        if cycle is not None:
            index, path = cycle
            problems.append((("edges", index), "edges form a cycle: " + " -> ".join(path)))
        for where, rules in self._scripts():
            for index, rule in enumerate(rules):
                if rule.goto is not None and rule.goto not in seen:
                    problems.append(
                        (
                            (*where, index, "goto"),
                            f"goto names unknown node {rule.goto!r}; nodes: {known}",
                        )
                    )
        _raise_problems(problems)
        return self

    @model_validator(mode="after")
    def _check_text_cues(self) -> AgentConfig:
        # The turn detector's word lists are English (vad/_turn.py). pocketsphinx's model is
        # English whatever `language` says, so only a recogniser told another language (or
        # none: it detects one) can feed them words they misread.
        if self.turn.text_cues != "english" or self.stt.provider == "pocketsphinx":
            return self
        language = self.stt.language.strip()
        if not language:
            message = ("is empty (the recogniser detects the language), and turn.text_cues "
                       "reads English word lists: name an English language (en-US) or set "
                       "turn.text_cues: off (the turn end from prosody alone)")
        elif re.split(r"[-_]", language)[0].lower() != "en":
            message = (f"{language!r} is not English, and turn.text_cues reads English word "
                       "lists: set turn.text_cues: off (the turn end from prosody alone)")
        else:
            return self
        _raise_problems([(("stt", "language"), message)])
        return self

    def _scripts(self) -> Iterable[tuple[SubPath, list[ScriptRule]]]:
        yield ("script",), self.script
        for index, node in enumerate(self.nodes):
            if isinstance(node, LLMNodeConfig):
                yield ("nodes", index, "script"), node.script


def _find_cycle(
    nodes: Iterable[str], edges: list[tuple[int, str, str]]
) -> tuple[int, list[str]] | None:
    """A cycle as (index of the edge that closes it, [a, b, ..., a]), or None."""
    children: dict[str, list[tuple[int, str]]] = {name: [] for name in nodes}
    for index, parent, child in edges:
        children[parent].append((index, child))
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(name: str) -> tuple[int, list[str]] | None:
        state[name] = 1
        stack.append(name)
        for index, child in children[name]:
            if state.get(child) == 1:
                return index, [*stack[stack.index(child) :], child]
            if child not in state:
                found = visit(child)
                if found is not None:
                    return found
        stack.pop()
        state[name] = 2
        return None

    for name in children:
        if name not in state:
            found = visit(name)
            if found is not None:
                return found
    return None


def reference_problems(
    agents: list[str], numbers: Mapping[Any, Any], default_agent: Any
) -> list[tuple[SubPath, str]]:
    """Numbers and ``default_agent`` naming agents that do not exist.

    Also run by the loader on the raw data when the agents themselves fail validation, so that
    these problems are reported in the same pass.
    """
    problems: list[tuple[SubPath, str]] = []
    known = ", ".join(agents) or "none"
    for number, agent_name in numbers.items():
        if isinstance(agent_name, str) and agent_name not in agents:
            problems.append(
                (
                    ("numbers", number),
                    f"{number} is mapped to unknown agent {agent_name!r}; agents: {known}",
                )
            )
    if isinstance(default_agent, str) and default_agent not in agents:
        problems.append((("default_agent",), f"unknown agent {default_agent!r}; agents: {known}"))
    return problems


# -- the whole file ----------------------------------------------------------------------------


class Config(_Model):
    """A whole config file. Build it with :func:`config.load_config`."""

    server: ServerConfig = ServerConfig()
    twilio: TwilioConfig = TwilioConfig()
    bus: BusConfig = BusConfig()
    console: ConsoleConfig = ConsoleConfig()
    agents: dict[Name, AgentConfig] = Field(min_length=1)
    numbers: dict[E164, str] = {}
    """E.164 number called -> agent name."""
    default_agent: str
    """The agent for numbers not in ``numbers``."""

    _source: Path = PrivateAttr(default_factory=lambda: Path("<memory>"))

    @property
    def source(self) -> Path:
        """The file this config was loaded from (absolute)."""
        return self._source

    @field_validator("agents", mode="before")
    @classmethod
    def _name_agents(cls, value: Any) -> Any:
        # The key is the agent's name; fill it in so that AgentConfig.name is never out of step.
        if isinstance(value, Mapping):
            return {
                key: {**agent, "name": key}
                if isinstance(agent, Mapping) and "name" not in agent
                else agent
                for key, agent in value.items()
            }
        return value

    @model_validator(mode="after")
    def _check_references(self) -> Config:
        problems: list[tuple[SubPath, str]] = []
        for key, agent in self.agents.items():
            if agent.name != key:
                message = f"expected the agent's key {key!r}, got {agent.name!r}"
                problems.append((("agents", key, "name"), message))
        problems += reference_problems(list(self.agents), self.numbers, self.default_agent)
        _raise_problems(problems)
        return self

    def agent(self, name: str) -> AgentConfig:
        """Agent ``name``; ``default_agent`` for a name the config does not know."""
        return self.agents.get(name) or self.agents[self.default_agent]

    def agent_for_number(self, to: str | None) -> AgentConfig:
        """The agent for calls to ``to`` (Twilio's ``To``); ``default_agent`` when unmapped."""
        name = self.numbers.get(to.strip()) if to else None
        return self.agents[name or self.default_agent]

    def summary(self) -> str:
        """A human summary for ``callgate config check``; secrets only as present or missing."""
        from ._summary import render_summary

        return render_summary(self)
