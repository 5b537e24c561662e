"""The ``callgate`` command line: ``serve``, ``worker``, ``replay``, ``call``, ``config check``.

A mistake on the command line or in what it names (a file that is not a WAV, an ``--events-out``
that cannot be written, an unknown ``--log-level``, a port in use) is one line on stderr naming
the command, and a non-zero exit: never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import Any

from linesim.cli import add_parser as add_simulate_parser

__all__ = ["main"]


def _agent_from_config(args: argparse.Namespace) -> dict[str, object]:
    """Without a bot script the configured agent runs: an in-process worker (process
    composition, as in `serve`: only the command-line layer, this module and
    :mod:`gateway.launch`, imports nodes/)."""
    from config import ConfigHolder
    from nodes import check_agents, run_worker

    from .server import TranscriberCache, call_settings_from

    holder = ConfigHolder(args.config, validate=check_agents)
    cfg = holder.current
    transcribers = TranscriberCache(holder)
    return {
        "agent": lambda bus, stop: run_worker(holder, bus, stop=stop),
        "transcriber_for": lambda info: transcribers(info.agent),
        "settings": call_settings_from(cfg.agents[cfg.default_agent].barge_in,
                                       cfg.agents[cfg.default_agent].turn),
    }


def _transcribers_from_config(args: argparse.Namespace) -> Any:
    """The configured agents' speech to text, for a replay's transcripts (close it after)."""
    from config import ConfigHolder

    from .server import TranscriberCache

    return TranscriberCache(ConfigHolder(args.config))


def _replay_recorded(args: argparse.Namespace) -> int:
    """``callgate replay FOLDER``: a call recorded by the gateway (gateway/recorder.py)."""
    from config import ConfigError

    from .recorder import replay_folder
    from .replay import ReplayError
    from .report import ReportCollector, inbound_audio

    report = ReportCollector()
    try:
        transcribers = _transcribers_from_config(args)
        out = open(args.events_out, "w") if args.events_out else None  # noqa: SIM115
        try:
            timeline = asyncio.run(replay_folder(
                args.recording, timeline=report.timeline(sink=out),
                transcriber_for=lambda info: transcribers(info.agent)))
        finally:
            if out is not None:
                out.close()
            transcribers.close()
        if args.html:
            report.write(args.html, title=f"callgate replay {args.recording}",
                         inbound=inbound_audio(args.recording))
    except (ReplayError, ConfigError, OSError) as exc:
        print(f"callgate replay: {exc}", file=sys.stderr)
        return 2
    counts: dict[str, int] = {}
    for e in timeline.events:
        counts[e["type"]] = counts.get(e["type"], 0) + 1
    print(f"replayed {args.recording}: " + " ".join(f"{k}={v}" for k, v in sorted(counts.items())))
    return 0


def _settings_from_config(args: argparse.Namespace) -> dict[str, Any]:
    """A bot-script replay with ``--config``: the default agent's barge-in settings apply (how
    two decisions are compared on the same recordings); without it, the built-in defaults."""
    if args.config is None:
        return {}
    from config import ConfigHolder

    from .server import call_settings_from

    cfg = ConfigHolder(args.config).current
    return {"settings": call_settings_from(cfg.agents[cfg.default_agent].barge_in)}


def _replay(args: argparse.Namespace) -> int:
    from audio import TELEPHONY_RATE, AudioError
    from config import ConfigError

    from .replay import ReplayError, load_bot_script, replay
    from .report import ReportCollector, inbound_audio

    if args.recording.is_dir() and args.bot_script is None:
        return _replay_recorded(args)
    report = ReportCollector()
    try:
        out = open(args.events_out, "w") if args.events_out else None  # noqa: SIM115
    except OSError as exc:
        print(f"callgate replay: cannot write --events-out {args.events_out}: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return 2
    try:
        turns = load_bot_script(args.bot_script) if args.bot_script else None
        extra = _settings_from_config(args) if turns is not None else _agent_from_config(args)
        try:
            timeline, playout = asyncio.run(
                replay(args.recording, bot_script=turns, realtime=args.realtime,
                       speed=args.speed, timeline=report.timeline(sink=out),
                       **extra)
            )
        finally:
            if out is not None:
                out.close()
        if args.html:
            report.write(args.html, title=f"callgate replay {args.recording}",
                         inbound=inbound_audio(args.recording))
    except (ReplayError, ConfigError, AudioError, OSError) as exc:
        if out is not None:
            out.close()
        print(f"callgate replay: {exc}", file=sys.stderr)
        return 2
    counts: dict[str, int] = {}
    for e in timeline.events:
        counts[e["type"]] = counts.get(e["type"], 0) + 1
    summary = " ".join(f"{k}={v}" for k, v in sorted(counts.items()))
    print(f"replayed {args.recording}: {summary}; bot audio played "
          f"{playout.stats.played_bytes / TELEPHONY_RATE:.2f} s, clears {playout.stats.clears}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from .launch import serve

    return serve(args)


def _worker(args: argparse.Namespace) -> int:
    from .launch import run_worker

    return run_worker(args)


def _call(args: argparse.Namespace) -> int:
    from audio import AudioError
    from .client import run_call

    try:
        return run_call(args)
    except AudioError as exc:  # read lazily, as the call plays
        print(f"callgate call: {exc}", file=sys.stderr)
        return 2


def _config_check(args: argparse.Namespace) -> int:
    from config import ConfigError, load_config
    from nodes import check_agents  # process composition: every agent graph must build

    try:
        cfg = load_config(args.path, validate=check_agents)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    print(cfg.summary())
    return 0


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is not in 0-65535")
    return port


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 <= seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} s is not a duration (0 or more)")
    return seconds


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="callgate", description=__doc__)
    p.add_argument("--log-level", default=os.environ.get("CALLGATE_LOG_LEVEL", "INFO"))
    p.add_argument("--log-json", action="store_true",
                   default=os.environ.get("CALLGATE_LOG_FORMAT", "").lower() == "json",
                   help="one JSON object per log line (also CALLGATE_LOG_FORMAT=json)")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the gateway (and, with the embedded bus, a worker)")
    s.add_argument("--host", default=None, help="default: server.host of the config")
    s.add_argument("--port", type=_port, default=None, help="default: server.port of the config")
    s.add_argument("--config", type=Path, default=None, help="YAML config (default: config/)")
    s.add_argument("--redis", default=None, help="redis:// URL (redis+cluster://h:p,h:p for a Redis Cluster); default: embedded bus")
    s.add_argument("--vad-runtime", choices=("auto", "torchscript", "onnx"), default="auto",
                   help="Silero runtime: auto = ONNX for batches under 32 calls, TorchScript above")
    s.add_argument("--vad-max-wait-ms", type=float, default=5.0,
                   help="longest a VAD window waits for other calls' windows to batch with "
                        "(5 ms: bigger batches, -8%% CPU per call against 2 ms and a lower p99 "
                        "frame lag at 75 calls per core, bench/load.py); scaled down below 64 VAD "
                        "streams (32 calls with the echo canceller, 64 without), where a wait "
                        "gathers few rows (vad/_engine.py)")
    s.add_argument("--no-worker", action="store_true",
                   help="gateway only (workers run as `callgate worker`)")
    s.set_defaults(fn=_serve)

    w = sub.add_parser("worker", help="run a session worker on a Redis bus")
    w.add_argument("--redis", required=True)
    w.add_argument("--config", type=Path, default=None)
    w.add_argument("--worker-id", default=None)
    w.add_argument("--metrics-port", type=_port, default=None,
                   help="serve GET /metrics and /healthz on this port (call claims, Redis "
                        "reconnects, buffered writes)")
    w.add_argument("--metrics-host", default="0.0.0.0")
    w.add_argument("--drain-timeout", type=_seconds, default=10.0, metavar="S",
                   help="on SIGTERM, how long the calls in progress may go on here before they "
                        "are handed back to the other workers (0: at once; default 10)")
    w.set_defaults(fn=_worker)

    r = sub.add_parser("replay", help="replay a recorded call through the gateway")
    r.add_argument("recording", type=Path,
                   help="NAME.twilio.jsonl, a WAV, or the folder of a recorded call")
    r.add_argument("--bot-script", type=Path,
                   help="labels whose bot_turns the bot speaks; without it the configured agent "
                        "runs (each frame waits for the agent's work)")
    r.add_argument("--config", type=Path, default=None, help="YAML config for the agent")
    r.add_argument("--events-out", type=Path, help="write the event timeline here (JSONL)")
    r.add_argument("--html", type=Path, default=None, metavar="REPORT.html",
                   help="also write the call's timeline as one static page (waveforms, "
                        "probability, decisions, transcripts)")
    r.add_argument("--realtime", action="store_true", help="pace at 1x instead of max speed")
    r.add_argument("--speed", type=float, default=1.0, help="with --realtime: pace at this many x")
    r.set_defaults(fn=_replay)

    c = sub.add_parser("call", help="play a recording into a running gateway, as Twilio would, "
                                    "and print the conversation")
    c.add_argument("recording", type=Path)
    c.add_argument("--url", default="ws://127.0.0.1:8080/twilio/media")
    c.add_argument("--token", default=None, help="call token (from the TwiML's <Parameter>)")
    c.add_argument("--call-sid", default=None, help="CallSid to announce (the token's call)")
    c.add_argument("--fast", action="store_true", help="do not pace at 1x")
    c.add_argument("--agent", default=None, help="the agent to call (default: the number's)")
    c.add_argument("--to", default=None, help="the number called (E.164): its agent answers")
    c.add_argument("--ops-token", default=None,
                   help="the gateway's ops token (default: $CALLGATE_OPS_TOKEN)")
    c.add_argument("--hold", type=float, default=10.0, metavar="S",
                   help="after the recording, stay on the line up to S seconds while the bot "
                        "answers (default 10; 0: hang up at once)")
    c.add_argument("--json", action="store_true",
                   help="print the call's raw events (one JSON object a line) instead")
    c.set_defaults(fn=_call)

    cfg = sub.add_parser("config", help="configuration tools")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True)
    chk = cfg_sub.add_parser("check", help="validate a config file and print a summary")
    chk.add_argument("path", nargs="?", type=Path, default=None)
    chk.set_defaults(fn=_config_check)
    add_simulate_parser(sub)
    return p


_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .logs import setup_logging

    level = str(args.log_level).upper()
    if level not in _LOG_LEVELS or not isinstance(logging.getLevelName(level), int):
        print(f"callgate: unknown --log-level {args.log_level!r} (or $CALLGATE_LOG_LEVEL); "
              f"expected one of {', '.join(_LOG_LEVELS)}", file=sys.stderr)
        return 2
    setup_logging(level, json_lines=args.log_json)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
