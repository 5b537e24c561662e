"""The summary that ``callgate config check`` prints. Secrets appear only as present/missing."""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from pydantic import SecretStr

if TYPE_CHECKING:
    from ._schema import AgentConfig, BargeInConfig, Config, LLMConfig, STTConfig, TTSConfig

__all__ = ["render_summary"]


def _hide_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host += f":{parts.port}"
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def _secret(value: SecretStr | None) -> str:
    return "present" if value is not None and value.get_secret_value() else "MISSING"


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _barge_in(b: BargeInConfig) -> str:
    return (
        f"p_on {b.p_on}, p_off {b.p_off}, start {b.start_windows} / stop {b.stop_windows} windows, "
        f"commit {b.commit_ms:g} ms, resume on backchannel {_yes(b.resume_on_backchannel)}, "
        f"echo margin {b.echo_margin_db:g} dB, noise margin {b.noise_margin_db:g} dB, "
        f"playback lead {b.playback_lead_ms:g} ms, DTMF interrupts {_yes(b.dtmf_interrupts)}, "
        f"speech over non-interruptible: {b.speech_over_uninterruptible}"
    )


def _agent_lines(agent: AgentConfig, default: bool) -> list[str]:
    lines = [f"  {agent.name}{' (default)' if default else ''}"]
    if agent.greeting:
        lines.append(f"    greeting: {agent.greeting!r}")
    if agent.llm is not None:
        llm = agent.llm
        what = f"{llm.provider}"
        if llm.model:
            what += f" {llm.model}"
        if llm.base_url:
            what += f" at {llm.base_url}"
        if llm.tools:
            what += f", tools: {', '.join(llm.tools)}"
        lines.append(f"    llm: {what}")
    stt = f"{agent.stt.provider}" + (f" {agent.stt.model}" if agent.stt.model else "")
    tts = f"{agent.tts.provider}" + (f" voice {agent.tts.voice}" if agent.tts.voice else "")
    lines.append(f"    stt: {stt} ({agent.stt.language}); tts: {tts}, speed {agent.tts.speed:g}")
    if agent.script or agent.fallback:
        lines.append(
            f"    script: {len(agent.script)} rule(s)"
            + (", with a fallback reply" if agent.fallback else ", no fallback reply")
        )
    if agent.nodes:
        lines.append("    nodes:")
        for node in agent.nodes:
            if node.kind == "llm":
                flag = "interruptible" if node.interruptible else "NOT interruptible"
                lines.append(f"      {node.name} (llm, {flag})")
            else:
                if node.interruptible is None:
                    flag = "interruptible as the class says"
                else:
                    flag = "interruptible" if node.interruptible else "NOT interruptible"
                lines.append(f"      {node.name} (python {node.ref}, {flag})")
    else:
        lines.append("    nodes: one interruptible llm node")
    if agent.edges:
        lines.append("    edges: " + ", ".join(f"{a} -> {b}" for a, b in agent.edges))
    lines.append(f"    barge-in: {_barge_in(agent.barge_in)}")
    return lines


def render_summary(cfg: Config) -> str:
    """The summary of ``cfg``, several lines, no trailing newline."""
    server = cfg.server
    lines = [f"config: {cfg.source}", "server:"]
    lines.append(f"  listen: {server.host}:{server.port}, max {server.max_calls} calls, "
                 f"drain timeout {server.drain_timeout_s:g} s")
    if server.public_url:
        lines.append(f"  public URL: {server.public_url}")
        lines.append(f"  Twilio voice webhook: {server.voice_url}")
        lines.append(f"  Twilio media stream: {server.media_url}")
    else:
        lines.append("  public URL: not set (the gateway derives it from each request's Host)")

    twilio = cfg.twilio
    lines.append("twilio:")
    lines.append(f"  account SID: {twilio.account_sid or 'not set'}")
    lines.append(f"  auth token: {_secret(twilio.auth_token)}")
    if twilio.validate_signatures:
        lines.append("  signature validation: ON")
    else:
        lines.append(
            "  signature validation: OFF -- anyone can reach the webhooks; "
            "set validate_signatures true in production"
        )

    lines.append("bus:")
    if cfg.bus.redis_url is None:
        lines.append("  embedded (in-process; set bus.redis_url for Redis)")
    else:
        lines.append(f"  redis: {_hide_password(cfg.bus.redis_url)}")

    lines.append("numbers:")
    for number, agent_name in cfg.numbers.items():
        lines.append(f"  {number} -> {agent_name}")
    lines.append(f"  any other number -> {cfg.default_agent}")

    lines.append("agents:")
    for agent in cfg.agents.values():
        lines.extend(_agent_lines(agent, agent.name == cfg.default_agent))

    lines.append("secrets:")
    lines.append(f"  twilio.auth_token: {_secret(twilio.auth_token)}")
    for agent in cfg.agents.values():
        for part_name in ("llm", "stt", "tts"):
            part: LLMConfig | STTConfig | TTSConfig | None = getattr(agent, part_name)
            if part is None:
                continue
            needed = part.provider == "openai"
            if needed or part.api_key is not None:
                lines.append(f"  agents.{agent.name}.{part_name}.api_key: {_secret(part.api_key)}")

    warnings = _warnings(cfg)
    if warnings:
        lines.append("warnings:")
        lines.extend(f"  {w}" for w in warnings)
    return "\n".join(lines)


def _warnings(cfg: Config) -> list[str]:
    out: list[str] = []
    if not cfg.twilio.validate_signatures:
        out.append("twilio.validate_signatures is off: do not run like this in production")
    elif cfg.twilio.auth_token is None:
        out.append(
            "twilio.validate_signatures is on but twilio.auth_token is missing: "
            "every Twilio request will be rejected"
        )
    for agent in cfg.agents.values():
        for part_name in ("llm", "stt", "tts"):
            part: LLMConfig | STTConfig | TTSConfig | None = getattr(agent, part_name)
            if part is not None and part.provider == "openai" and part.api_key is None:
                out.append(
                    f"agents.{agent.name}.{part_name}: provider openai without api_key "
                    "(fine only for a server that needs none)"
                )
    return out
