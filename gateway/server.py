"""The aiohttp application: Twilio's webhook, the Media Streams WebSocket, health.

Routes:

* ``POST /twilio/voice``: Twilio's voice webhook. Checks ``X-Twilio-Signature`` against the
  configured public URL, picks the agent of the dialled number, and answers TwiML
  ``<Connect><Stream url="wss://.../twilio/media">`` with a per-call token in ``<Parameter>``.
* ``GET /twilio/media``: the bidirectional Media Streams WebSocket. The upgrade's signature is
  checked against the ``wss://`` URL the TwiML named; the ``start`` message must carry the token
  issued for that call (a signature alone can be replayed: Twilio signs the same URL every time).
  One task per call runs its :class:`gateway.call.CallSession`.
* ``GET /healthz``: liveness; ``GET /readyz``: readiness (fails while draining, full or
  overloaded: the calls in progress fall behind their audio, see :mod:`gateway.overload`).

Signature checks can be switched off only explicitly (``validate_signatures: false``), with a
warning at start-up and on every call, for local development without a Twilio account.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
import time
import secrets
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from aiohttp import WSMsgType, web
from twilio.twiml.voice_response import Connect, Say, Stream, VoiceResponse

from bus import Bus, CallInfo
from vad import BargeInSettings, EchoGateSettings, VadEngine
from vad._turn import TurnSettings

from . import twilio_protocol as tp
from .call import CallRejected, CallSession, CallSettings
from .metrics import CONTENT_TYPE, GatewayMetrics, WorkerMetrics
from .overload import LagGuard
from .security import SIGNATURE_HEADER, CallTokens, InvalidToken, SignatureValidator
from .timeline import Timeline

__all__ = [
    "GATEWAY_KEY",
    "GatewayApp",
    "GatewaySettings",
    "build_app",
    "call_settings_from",
    "run_worker",
    "serve",
    "settings_from_config",
]

log = logging.getLogger("callgate.gateway")

VOICE_PATH = "/twilio/voice"
MEDIA_PATH = "/twilio/media"


@dataclass(slots=True)
class GatewaySettings:
    """What the HTTP layer needs; built from the YAML config by :func:`from_config`."""

    public_url: str | None = None
    """Base URL Twilio uses to reach us (``https://gw.example.com``); signatures are computed
    against it. None: derived from each request (development only)."""
    auth_token: str | None = None
    validate_signatures: bool = True
    token_secret: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    token_ttl_s: float = 600.0
    max_calls: int = 200
    overload_lag_ms: float | None = 50.0
    """New calls are refused while the p99 frame lag of the last 4-5 s is over this
    (:class:`gateway.overload.LagGuard`); None: only ``max_calls`` limits."""
    agent_for_number: Callable[[str | None], str] = lambda _to: "default"
    call_settings_for: Callable[[str], CallSettings] = lambda _agent: CallSettings()
    transcriber_for: Callable[[str], Any] | None = None
    """Agent name -> its speech to text (``speech.Transcriber``), or None for no transcripts."""

    def __post_init__(self) -> None:
        if self.validate_signatures and not self.auth_token:
            raise ValueError(
                "validate_signatures is on but no Twilio auth token is configured "
                "(set TWILIO_AUTH_TOKEN, or switch validation off explicitly for development)"
            )


def _public_urls(settings: GatewaySettings, request: web.Request) -> tuple[str, str]:
    """(webhook https URL, media wss URL) as Twilio sees them."""
    if settings.public_url:
        base = urlsplit(settings.public_url.rstrip("/"))
        scheme = base.scheme or "https"
        netloc, prefix = base.netloc, base.path
    else:
        scheme = request.headers.get("X-Forwarded-Proto", request.scheme)
        netloc = request.headers.get("X-Forwarded-Host", request.host)
        prefix = ""
    ws_scheme = "wss" if scheme == "https" else "ws"
    voice = urlunsplit((scheme, netloc, prefix + VOICE_PATH, "", ""))
    media = urlunsplit((ws_scheme, netloc, prefix + MEDIA_PATH, "", ""))
    return voice, media


class GatewayApp:
    """The gateway process's shared state: bus, VAD engine, calls in progress."""

    def __init__(self, settings: GatewaySettings, *, bus: Bus, vad: VadEngine) -> None:
        self.settings = settings
        self.bus = bus
        self.vad = vad
        self.tokens = CallTokens(settings.token_secret, ttl_s=settings.token_ttl_s)
        self.validator = SignatureValidator(settings.auth_token) if settings.auth_token else None
        self.calls: dict[str, CallSession] = {}
        self._calls_changed = asyncio.Event()
        self.completed: deque[dict[str, object]] = deque(maxlen=256)
        """Summaries of recently ended calls (for operators and tests)."""
        self.draining = False
        self.overload = LagGuard(settings.overload_lag_ms)
        self.metrics = GatewayMetrics(self._metrics_state)
        if not settings.validate_signatures:
            log.warning(
                "Twilio signature validation is OFF (validate_signatures: false): anyone who "
                "can reach this gateway can start calls. Never run it like this in production."
            )

    # -- routes ---------------------------------------------------------------------------
    def routes(self) -> list[web.RouteDef]:
        return [
            web.post(VOICE_PATH, self.voice_webhook),
            web.get(MEDIA_PATH, self.media_socket),
            web.get("/healthz", self.healthz),
            web.get("/readyz", self.readyz),
            web.get("/metrics", self.metrics_endpoint),
        ]

    def _metrics_state(self) -> dict[str, object]:
        stats = self.vad.stats
        return {
            "calls": len(self.calls),
            "draining": self.draining,
            "overloaded": self.overload.overloaded,
            "vad_batches": stats.batches,
            "vad_windows": stats.windows,
            "bus": self.bus.stats(),
        }

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        body = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def calls_changed(self, timeout: float = 1.0) -> None:
        """Wait until a call starts or ends (or ``timeout`` passes)."""
        self._calls_changed.clear()
        try:
            await asyncio.wait_for(self._calls_changed.wait(), timeout)
        except TimeoutError:
            pass

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "calls": len(self.calls)})

    def refusal(self) -> str | None:
        """Why a new call would be refused now, as counted in ``callgate_calls_refused_total``
        (None: it is welcome)."""
        if self.draining:
            return "draining"
        if len(self.calls) >= self.settings.max_calls:
            return "at_capacity"
        if self.overload.overloaded:
            return "overloaded"
        return None

    async def readyz(self, request: web.Request) -> web.Response:
        refusal = self.refusal()
        return web.json_response(
            {"ready": refusal is None, "draining": self.draining,
             "overloaded": self.overload.overloaded,
             "calls": len(self.calls), **({"reason": refusal} if refusal else {})},
            status=200 if refusal is None else 503,
        )

    def _signature_ok(self, url: str, signature: str | None, form: dict[str, str] | None) -> bool:
        if not self.settings.validate_signatures:
            return True
        assert self.validator is not None
        if form is None:
            return self.validator.validate_websocket(url, signature)
        return self.validator.validate_webhook(url, form, signature)

    async def voice_webhook(self, request: web.Request) -> web.Response:
        post = await request.post()
        form = {k: str(v) for k, v in post.items()}
        voice_url, media_url = _public_urls(self.settings, request)
        if request.query_string:
            voice_url = f"{voice_url}?{request.query_string}"
        if not self._signature_ok(voice_url, request.headers.get(SIGNATURE_HEADER), form):
            log.warning("webhook rejected: bad or missing X-Twilio-Signature for %s", voice_url)
            raise web.HTTPForbidden(text="invalid Twilio signature")
        call_sid = form.get("CallSid", "")
        if not call_sid.startswith("CA"):
            raise web.HTTPBadRequest(text="CallSid missing or malformed")
        response = VoiceResponse()
        reason = self.refusal()
        if reason is not None:
            log.warning("refusing call %s: gateway %s", call_sid, reason.replace("_", " "))
            self.metrics.refused(reason)
            response.append(Say("Sorry, all our lines are busy. Please call again in a moment."))
            response.hangup()
            return web.Response(text=str(response), content_type="application/xml")
        agent = self.settings.agent_for_number(form.get("To"))
        token = self.tokens.issue(call_sid, agent)
        stream = Stream(url=media_url)
        stream.parameter(name="token", value=token)
        stream.parameter(name="agent", value=agent)
        stream.parameter(name="from", value=form.get("From", ""))
        stream.parameter(name="to", value=form.get("To", ""))
        connect = Connect()
        connect.append(stream)
        response.append(connect)
        log.info("call %s to %s -> agent %s", call_sid, form.get("To"), agent)
        return web.Response(text=str(response), content_type="application/xml")

    async def _authorize(self, start: tp.Start) -> CallInfo:
        params = start.custom_parameters
        agent = params.get("agent", "default")
        if self.settings.validate_signatures:
            try:
                claims = self.tokens.verify(params.get("token", ""), call_sid=start.call_sid)
            except InvalidToken as exc:
                raise CallRejected(f"call token refused: {exc.reason}") from exc
            agent = claims.agent
        return CallInfo(
            call_sid=start.call_sid,
            stream_sid=start.stream_sid,
            agent=agent,
            from_number=params.get("from", ""),
            to_number=params.get("to", ""),
            params={k: v for k, v in params.items() if k != "token"},
        )

    async def media_socket(self, request: web.Request) -> web.StreamResponse:
        _, media_url = _public_urls(self.settings, request)
        if not self._signature_ok(media_url, request.headers.get(SIGNATURE_HEADER), None):
            log.warning("media socket rejected: bad or missing X-Twilio-Signature")
            raise web.HTTPForbidden(text="invalid Twilio signature")
        if len(self.calls) >= self.settings.max_calls + max(1, self.settings.max_calls // 10):
            # The webhook already refuses calls at max_calls; this guards the machine against
            # sockets that skipped it.
            self.metrics.refused("socket_over_capacity")
            raise web.HTTPServiceUnavailable(text="gateway at capacity")
        ws = web.WebSocketResponse(heartbeat=30.0, max_msg_size=1 << 20)
        await ws.prepare(request)
        session: CallSession | None = None
        downlink: asyncio.Task[None] | None = None
        clock_base: float | None = None
        media_ms = 0.0

        async def send(text: str) -> None:
            if not ws.closed:
                await ws.send_str(text)

        timeline = Timeline(keep=False)
        timeline.add_listener(self.metrics.observe_event)
        session = CallSession(
            send=send, bus=self.bus, vad=self.vad, timeline=timeline,
            authorize=self._authorize,
            settings_for=lambda info: self.settings.call_settings_for(info.agent),
            transcriber_for=(None if self.settings.transcriber_for is None
                             else lambda info: self.settings.transcriber_for(info.agent)),  # type: ignore[misc]
        )
        try:
            async for msg in ws:
                if msg.type is WSMsgType.TEXT:
                    received = time.perf_counter()
                    skipped = session.frames_skipped
                    try:
                        await session.handle_text(msg.data)
                    except CallRejected as exc:
                        self.metrics.refused("token")
                        log.warning("closing media socket: %s", exc)
                        await ws.close(code=1008, message=b"call token refused")
                        break
                    self.metrics.frames.inc()
                    self.metrics.frame_receive_to_done.observe(time.perf_counter() - received)
                    if session.now_ms > media_ms:
                        # Only media frames advance the clock; mark echoes arrive whenever
                        # Twilio sends them and would read as lag against the last frame.
                        media_ms = session.now_ms
                        # Lag behind the media clock: how much later than its audio's own time
                        # a frame is done, against the call's best (first, unloaded) frames.
                        # Unlike receive-to-done, it counts frames waiting in socket buffers.
                        offset = time.perf_counter() - session.now_ms / 1000
                        clock_base = offset if clock_base is None else min(clock_base, offset)
                        lag = offset - clock_base
                        self.metrics.frame_lag.observe(lag)
                        self.overload.observe(lag)
                    if session.frames_skipped != skipped:
                        self.metrics.frames_skipped.inc(session.frames_skipped - skipped)
                    if session.info is not None and downlink is None:
                        self.calls[session.info.call_sid] = session
                        self._calls_changed.set()
                        downlink = asyncio.create_task(session.run_downlink())
                    if session.ended:
                        break
                elif msg.type is WSMsgType.BINARY:
                    log.warning("skipped binary frame on media socket (%d bytes)", len(msg.data))
                elif msg.type is WSMsgType.ERROR:
                    log.warning("media socket error: %s", ws.exception())
                    break
        finally:
            await session.end("socket_closed")
            if downlink is not None:
                downlink.cancel()
                await asyncio.gather(downlink, return_exceptions=True)
            if session.info is not None:
                self.calls.pop(session.info.call_sid, None)
                self._calls_changed.set()
                self.completed.append({
                    "call_sid": session.info.call_sid, "media_ms": session.now_ms,
                    "frames_processed": session.frames_processed,
                    "frames_skipped": session.frames_skipped, "dtmf": session.dtmf_digits,
                })
            if not ws.closed:
                await ws.close()
        return ws


GATEWAY_KEY: web.AppKey[GatewayApp] = web.AppKey("gateway", GatewayApp)


def build_app(settings: GatewaySettings, *, bus: Bus, vad: VadEngine) -> web.Application:
    """The aiohttp application; bus and VAD engine are started and closed with it."""
    gateway = GatewayApp(settings, bus=bus, vad=vad)
    app = web.Application()
    app[GATEWAY_KEY] = gateway
    app.add_routes(gateway.routes())

    async def lifecycle(app: web.Application):  # type: ignore[no-untyped-def]
        await bus.start()
        await vad.start()
        yield
        await vad.aclose()
        await bus.aclose()

    app.cleanup_ctx.append(lifecycle)
    return app


def token_secret_from_env() -> bytes:
    """Gateways behind one load balancer must share it: Twilio's webhook and its WebSocket may
    reach different instances."""
    raw = os.environ.get("CALLGATE_TOKEN_SECRET")
    if raw:
        return raw.encode()
    return secrets.token_bytes(32)


# -- from the YAML config ---------------------------------------------------------------------
def call_settings_from(barge_in: Any, turn: Any = None) -> CallSettings:
    """Map an agent's ``barge_in`` section (config.BargeInConfig) and ``turn`` section
    (config.TurnConfig; None: the defaults) to the call's settings."""
    b = barge_in
    return CallSettings(
        turn=TurnSettings(**turn.model_dump()) if turn is not None else TurnSettings(),
        barge_in=BargeInSettings(p_on=b.p_on, p_off=b.p_off, start_windows=b.start_windows,
                                 stop_windows=b.stop_windows, commit_ms=b.commit_ms,
                                 resume_on_backchannel=b.resume_on_backchannel,
                                 band_snr_db=b.band_snr_db),
        echo=EchoGateSettings(echo_margin_db=b.echo_margin_db, noise_margin_db=b.noise_margin_db),
        playback_lead_ms=b.playback_lead_ms,
        chunk_ms=b.playback_chunk_ms,
        dtmf_interrupts=b.dtmf_interrupts,
        speech_over_uninterruptible=b.speech_over_uninterruptible,
    )


class TranscriberCache:
    """One transcriber per distinct STT configuration, shared by the agents that have it (a
    pocketsphinx transcriber pools its decoders across calls; an OpenAI one its connections); a
    reload that changes an agent's ``stt`` section makes a new one. Built and warmed up before
    the first call (:meth:`warm_up`): building one mid-call (an HTTP client loads its TLS
    trust store) or its first use (lazy imports) stalled every call's audio for 20-90 ms."""

    def __init__(self, holder: Any) -> None:
        self._holder = holder
        self._cache: dict[tuple[str, str], Any] = {}

    def agent_stt(self, agent: str) -> Any:
        return self._holder.current.agent(agent).stt

    def __call__(self, agent: str) -> Any:
        from speech import make_transcriber

        stt = self.agent_stt(agent)
        key = ("stt", stt.model_dump_json())  # an unknown agent gets the default's, shared
        if key not in self._cache:
            if stt.provider == "openai":
                opts: dict[str, Any] = {"language": stt.language.split("-")[0]}
                if stt.model:
                    opts["model"] = stt.model
                if stt.base_url:
                    opts["base_url"] = stt.base_url
                if stt.api_key is not None:
                    opts["api_key"] = stt.api_key.get_secret_value()
                self._cache[key] = make_transcriber("openai", **opts)
            else:
                # Decoding in worker processes: pocketsphinx holds the GIL while it decodes,
                # which in this process would stall every call's audio (bench/load.py).
                from speech import PocketsphinxPoolTranscriber

                self._cache[key] = PocketsphinxPoolTranscriber(workers=2)
        return self._cache[key]

    def close(self) -> None:
        for transcriber in self._cache.values():
            close = getattr(transcriber, "close", None)
            if close is not None:
                close()
        self._cache.clear()

    async def warm_up(self) -> None:
        """Build every agent's transcriber and warm it up before the first call (offline
        decoders hold the GIL ~0.3 s each while loading; the OpenAI client imports ~45 ms of
        modules on first use)."""
        for name in self._holder.current.agents:
            transcriber = self(name)
            warm = getattr(transcriber, "warm_up", None)
            if warm is not None:
                await warm(1)


def settings_from_config(holder: Any) -> GatewaySettings:
    """GatewaySettings that read ``holder.current`` per call, so a reload reaches new calls and
    leaves calls in progress alone."""
    cfg = holder.current
    token = cfg.twilio.auth_token.get_secret_value() if cfg.twilio.auth_token else None

    def agent_for_number(to: str | None) -> str:
        return str(holder.current.agent_for_number(to).name)

    def call_settings_for(agent: str) -> CallSettings:
        agent_config = holder.current.agent(agent)
        return call_settings_from(agent_config.barge_in, agent_config.turn)

    return GatewaySettings(
        public_url=cfg.server.public_url,
        auth_token=token or None,
        validate_signatures=cfg.twilio.validate_signatures,
        token_secret=token_secret_from_env(),
        max_calls=cfg.server.max_calls,
        overload_lag_ms=cfg.server.overload_lag_ms,
        agent_for_number=agent_for_number,
        call_settings_for=call_settings_for,
        transcriber_for=TranscriberCache(holder),
    )


def serve(args: argparse.Namespace) -> int:
    """``callgate serve``: the gateway, plus an in-process worker unless ``--no-worker``."""
    from bus import make_bus
    from config import ConfigError, ConfigHolder
    from nodes import check_agents  # process composition: a reload must build every agent

    try:
        holder = ConfigHolder(args.config, validate=check_agents)
    except ConfigError as exc:
        print(f"callgate serve: bad config:\n{exc}", file=sys.stderr)
        return 1
    cfg = holder.current
    try:
        settings = settings_from_config(holder)
    except ValueError as exc:
        print(f"callgate serve: {exc}", file=sys.stderr)
        return 1
    redis_url = args.redis or cfg.bus.redis_url
    bus = make_bus(redis_url)
    app = build_app(settings, bus=bus, vad=VadEngine(runtime=args.vad_runtime,
                                                     max_wait_ms=args.vad_max_wait_ms))
    run_worker_here = not args.no_worker

    async def background(app: web.Application):  # type: ignore[no-untyped-def]
        loop = asyncio.get_running_loop()
        holder.install_sighup(loop)
        watcher = asyncio.create_task(holder.watch(2.0))
        if isinstance(settings.transcriber_for, TranscriberCache):
            await settings.transcriber_for.warm_up()
        stop = asyncio.Event()
        worker: asyncio.Task[None] | None = None
        if run_worker_here:
            # Process composition only: the gateway itself never imports nodes/.
            from nodes import run_worker

            worker = asyncio.create_task(run_worker(holder, bus, stop=stop))
        yield
        stop.set()
        if worker is not None:
            await asyncio.wait({worker}, timeout=10)
            worker.cancel()
        watcher.cancel()
        await asyncio.gather(watcher, *( [worker] if worker else []), return_exceptions=True)
        if isinstance(settings.transcriber_for, TranscriberCache):
            settings.transcriber_for.close()

    app.cleanup_ctx.append(background)
    host = args.host or cfg.server.host
    port = args.port if args.port is not None else cfg.server.port
    asyncio.run(_serve_until_drained(app, host, port, cfg.server.drain_timeout_s,
                                     "redis" if redis_url else "embedded", run_worker_here))
    return 0


async def _serve_until_drained(app: web.Application, host: str, port: int, drain_s: float,
                               bus_kind: str, worker_here: bool) -> None:
    """Serve until SIGTERM/SIGINT, then drain: readiness fails and new calls get a polite
    TwiML answer while the socket stays open; calls in progress go on for up to ``drain_s``;
    then the app shuts down (remaining calls are closed) and the process exits 0."""
    gateway = app[GATEWAY_KEY]
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    # Everything loaded so far (torch, the model, aiohttp, config) lives as long as the process:
    # keep it out of the collector's full passes, which otherwise walk those ~10^5 objects and
    # stall every call's frames for 15-150 ms at a time (bench/load.py).
    gc.collect()
    gc.freeze()
    site = web.TCPSite(runner, host, port)
    await site.start()
    log.info("callgate gateway on http://%s:%d (bus: %s, worker: %s)", host, port, bus_kind,
             "in-process" if worker_here else "none")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        gateway.draining = True
        log.info("draining: %d call(s) in progress, up to %.0f s", len(gateway.calls), drain_s)
        deadline = loop.time() + drain_s
        while gateway.calls and loop.time() < deadline:
            await gateway.calls_changed()
        if gateway.calls:
            log.warning("drain timeout: closing %d call(s)", len(gateway.calls))
        else:
            log.info("drained: no call in progress")
    finally:
        await runner.cleanup()


def run_worker(args: argparse.Namespace) -> int:
    """``callgate worker --redis URL``: a session-worker process."""
    from bus import make_bus
    from config import ConfigError, ConfigHolder
    from nodes import check_agents, run_worker as run

    try:
        holder = ConfigHolder(args.config, validate=check_agents)
    except ConfigError as exc:
        print(f"callgate worker: bad config:\n{exc}", file=sys.stderr)
        return 1

    async def main() -> None:
        bus = make_bus(args.redis)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        holder.install_sighup(loop)
        async with bus:
            runner = None
            port = getattr(args, "metrics_port", None)
            if port is not None:
                runner = await _serve_worker_metrics(bus, args.metrics_host, port)
            try:
                await run(holder, bus, worker_id=args.worker_id, stop=stop)
            finally:
                if runner is not None:
                    await runner.cleanup()

    asyncio.run(main())
    return 0


async def _serve_worker_metrics(bus: Bus, host: str, port: int) -> web.AppRunner:
    """``GET /metrics`` (the bus's figures: call claims, Redis outages and reconnects, buffered
    writes) and ``GET /healthz`` for a worker process."""
    metrics = WorkerMetrics(bus.stats)

    async def render(request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "bus": bus.bus_id})

    app = web.Application()
    app.add_routes([web.get("/metrics", render), web.get("/healthz", healthz)])
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("worker metrics on http://%s:%d/metrics", host, port)
    return runner
