"""The aiohttp application: Twilio's webhook, the Media Streams WebSocket, health.

Routes:

* ``POST /twilio/voice``: Twilio's voice webhook. Checks ``X-Twilio-Signature`` against the
  configured public URL, picks the agent of the dialled number, and answers TwiML
  ``<Connect><Stream url="wss://.../twilio/media">`` with a per-call token in ``<Parameter>``.
* ``GET /twilio/media``: the bidirectional Media Streams WebSocket. The upgrade's signature is
  checked against the ``wss://`` URL the TwiML named; the ``start`` message must come within
  ``start_timeout_s`` and carry the token issued for that call, unused (a signature alone can be
  replayed: Twilio signs the same URL every time). One task per call runs its
  :class:`gateway.call.CallSession`.
* ``GET /healthz``: liveness; ``GET /readyz``: readiness (fails while draining, full,
  overloaded (the gateway itself runs late, see :mod:`gateway.overload`) or unhealthy (a part
  it needs, such as the in-process worker, has died)).

Admission counts a call from its webhook: the webhook reserves a place for ``reservation_s``,
the stream's ``start`` takes it, so calls whose webhooks arrive together cannot overshoot
``max_calls`` (40 webhooks in one instant all got ``<Connect>`` when only started streams were
counted). A second stream for a call that has a live one is refused, whatever it carries.

Draining (SIGTERM, SIGINT): readiness fails at once, webhooks get the busy message (with
``X-Callgate-Refused: draining``) and streams without a reservation here are refused; the calls
in progress, and streams of webhooks answered before the drain, go on until they end or
``server.drain_timeout_s`` passes; then the process exits.

Signature checks can be switched off only explicitly (``validate_signatures: false``), with a
warning at start-up and on every call, for local development without a Twilio account.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import time
import secrets
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from aiohttp import WSMsgType, web
from twilio.twiml.voice_response import Connect, Say, Stream, VoiceResponse

from bus import Bus, CallInfo
from vad import AecMode, BargeInSettings, EchoGateSettings, OverUninterruptible, VadEngine
from vad._turn import TurnSettings

from . import twilio_protocol as tp
from .call import CallRejected, CallSession, CallSettings
from .console import Console
from .logs import RateLimitedLog
from .metrics import CONTENT_TYPE, GatewayMetrics
from .ops import OpsHub, OpsSettings, ops_routes
from .overload import OverloadGuard
from .recorder import CallRecorder, RecordingSettings
from .security import (
    SIGNATURE_HEADER,
    CallTokens,
    InvalidToken,
    SignatureValidator,
    TokenClaims,
)
from .timeline import Timeline

__all__ = [
    "GATEWAY_KEY",
    "GatewayApp",
    "GatewaySettings",
    "REFUSED_HEADER",
    "StreamRefused",
    "build_app",
    "call_settings_from",
    "check_security",
    "follow_reloads",
    "settings_from_config",
]

log = logging.getLogger("callgate.gateway")
# What a peer can make happen at will is logged at most once per 10 s, with a count.
_CLOSING: set[asyncio.Future[Any]] = set()
_BINARY_FRAMES = RateLimitedLog(log, "binary frames skipped", interval_s=10.0)
_NO_START = RateLimitedLog(log, "media sockets closed without a valid start", interval_s=10.0)
_SOCKETS_REFUSED = RateLimitedLog(log, "media upgrades refused", interval_s=10.0)
_WEBHOOKS_REFUSED = RateLimitedLog(log, "webhooks with bad signatures", interval_s=10.0)

VOICE_PATH = "/twilio/voice"
MEDIA_PATH = "/twilio/media"
REFUSED_HEADER = "X-Callgate-Refused"
"""On a webhook answered with the busy message: why (draining, at_capacity, overloaded, ...)."""


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """What the HTTP layer needs; built from the YAML config by :func:`settings_from_config`
    (the security settings, ``max_calls`` and ``overload_lag_ms`` follow reloads through
    :func:`follow_reloads`)."""

    public_url: str | None = None
    """Base URL Twilio uses to reach us (``https://gw.example.com``); signatures are computed
    against it. None: derived from each request (development only)."""
    auth_token: str | None = None
    validate_signatures: bool = True
    token_secret: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    token_ttl_s: float = 60.0
    """How long after the webhook a stream may start with its token (Twilio opens it within a
    second or two); a token is also good for one stream only."""
    max_calls: int = 200
    """Calls at once, counted from the webhook (a reservation) to the stream's end."""
    reservation_s: float = 15.0
    """How long the webhook's reservation holds a place for the stream that should follow; a
    call whose stream never comes (the caller hung up first) frees it after this."""
    start_timeout_s: float = 10.0
    """An upgraded media socket without a valid ``start`` after this long is closed (1008)."""
    max_pending_sockets: int | None = None
    """Media sockets at once that have not sent a valid ``start`` yet; more get 503. None: a
    quarter of ``max_calls``, at least 50. Twilio's own sockets spend milliseconds in this
    state (upgrade, ``connected``, ``start``), so 50 is 50 calls opening in the same instant;
    what holds a place longer is a socket that will never start."""
    overload_lag_ms: float | None = 50.0
    """New calls are refused while the gateway itself runs later than this: the p99 of its
    frames' processing time, or the p95 of its event loop's lag, over the last 4-5 s
    (:class:`gateway.overload.OverloadGuard`); None: only ``max_calls`` limits."""
    agent_for_number: Callable[[str | None], str] = lambda _to: "default"
    call_settings_for: Callable[[str], CallSettings] = lambda _agent: CallSettings()
    transcriber_for: Callable[[str], Any] | None = None
    """Agent name -> its speech to text (``speech.Transcriber``), or None for no transcripts."""
    ops: OpsSettings = field(default_factory=OpsSettings)
    """The console (``/console``) and ops streams (``/ops``): on or off, and their token."""
    recording_for: Callable[[str], RecordingSettings | None] | None = None
    """Agent name -> where its calls are recorded (``recording:``), None: not recorded."""

    def __post_init__(self) -> None:
        check_security(self.validate_signatures, self.auth_token)

    def pending_cap(self) -> int:
        """:attr:`max_pending_sockets`, resolved."""
        if self.max_pending_sockets is not None:
            return self.max_pending_sockets
        return max(50, self.max_calls // 4)


def check_security(validate_signatures: bool, auth_token: str | None) -> None:
    """Refuse validation without a token to validate with (at start and on reload)."""
    if validate_signatures and not auth_token:
        raise ValueError(
            "validate_signatures is on but no Twilio auth token is configured "
            "(set TWILIO_AUTH_TOKEN, or switch validation off explicitly for development)"
        )


class StreamRefused(CallRejected):
    """A ``start`` the gateway turns away; ``reason`` is its label in
    ``callgate_calls_refused_total`` and ``close_message`` what the peer is told."""

    def __init__(self, message: str, *, reason: str, close_message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.close_message = close_message


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

    def __init__(self, settings: GatewaySettings, *, bus: Bus, vad: VadEngine,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: monotonic seconds for reservations, injectable so tests move time."""
        self.settings = settings
        self._clock = clock
        self.bus = bus
        self.vad = vad
        # Spent tokens are recorded on the bus too: behind several gateways on one Redis, a
        # token spent on one is refused on all (an embedded bus records nothing more).
        self.tokens = CallTokens(settings.token_secret, ttl_s=settings.token_ttl_s,
                                 shared=bus.record_once)
        self.validator = SignatureValidator(settings.auth_token) if settings.auth_token else None
        self.calls: dict[str, CallSession] = {}
        self._calls_changed = asyncio.Event()
        self.completed: deque[dict[str, object]] = deque(maxlen=256)
        """Summaries of recently ended calls (for operators and tests)."""
        self.draining = False
        self.overload = OverloadGuard(settings.overload_lag_ms)
        self._reservations: dict[str, float] = {}
        """call SID -> monotonic deadline: webhooks answered whose stream has not started."""
        self._live: set[str] = set()
        """Call SIDs with an authorised stream (from its ``start`` to its end)."""
        self.sockets_open = 0
        """Media sockets upgraded and not yet closed."""
        self.sockets_pending = 0
        """... of which have no valid ``start`` yet."""
        self.problems: dict[str, str] = {}
        """Part -> why it cannot work (e.g. ``worker``): readiness fails while any is here."""
        self.metrics = GatewayMetrics(self._metrics_state)
        self.ops = OpsHub()
        self.console = (Console(settings.ops, self.tokens, settings.agent_for_number)
                        if settings.ops.enabled else None)
        if not settings.validate_signatures:
            log.warning(
                "Twilio signature validation is OFF (validate_signatures: false): anyone who "
                "can reach this gateway can start calls. Never run it like this in production."
            )

    # -- settings and health ----------------------------------------------------------------
    def reconfigure(self, *, public_url: str | None, auth_token: str | None,
                    validate_signatures: bool, max_calls: int,
                    overload_lag_ms: float | None) -> list[str]:
        """Apply reloaded settings to new requests; returns the names of those that changed.

        Raises:
            ValueError: validation on without an auth token (nothing is changed).
        """
        new = dataclasses.replace(  # checks them (__post_init__) before anything changes
            self.settings, public_url=public_url, auth_token=auth_token,
            validate_signatures=validate_signatures, max_calls=max_calls,
            overload_lag_ms=overload_lag_ms)
        changed = [f for f in ("public_url", "auth_token", "validate_signatures", "max_calls",
                               "overload_lag_ms")
                   if getattr(self.settings, f) != getattr(new, f)]
        self.settings = new
        self.validator = SignatureValidator(auth_token) if auth_token else None
        if "overload_lag_ms" in changed:
            self.overload.set_limit(overload_lag_ms)
        if "validate_signatures" in changed and not validate_signatures:
            log.warning("Twilio signature validation switched OFF by a config reload")
        return changed

    def set_problem(self, part: str, reason: str | None) -> None:
        """Mark ``part`` broken (readiness fails, new calls refused) or, with None, fixed."""
        if reason is None:
            self.problems.pop(part, None)
        else:
            self.problems[part] = reason

    # -- admission -------------------------------------------------------------------------
    def occupancy(self) -> int:
        """Calls counted against ``max_calls``: live streams and unexpired reservations."""
        return len(self._live) + self.reserved

    @property
    def reserved(self) -> int:
        """Webhooks answered whose stream has not started, reservation unexpired."""
        now = self._clock()
        expired = [sid for sid, deadline in self._reservations.items() if deadline <= now]
        for sid in expired:
            del self._reservations[sid]
        return len(self._reservations)

    def _reserve(self, call_sid: str) -> None:
        self._reservations[call_sid] = self._clock() + self.settings.reservation_s

    # -- routes ---------------------------------------------------------------------------
    def routes(self) -> list[web.RouteDef]:
        return [
            web.post(VOICE_PATH, self.voice_webhook),
            web.get(MEDIA_PATH, self.media_socket),
            web.get(MEDIA_PATH + "/{key}", self.media_socket),
            web.get("/healthz", self.healthz),
            web.get("/readyz", self.readyz),
            web.get("/metrics", self.metrics_endpoint),
            *(ops_routes(self.ops, self.settings.ops) if self.console is not None else []),
            *(self.console.routes() if self.console is not None else []),
        ]

    def _metrics_state(self) -> dict[str, object]:
        stats = self.vad.stats
        return {
            "calls": len(self.calls),
            "reserved": self.reserved,
            "sockets_pending": self.sockets_pending,
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

    def refusal(self, call_sid: str | None = None) -> str | None:
        """Why a new call would be refused now, as counted in ``callgate_calls_refused_total``
        (None: it is welcome). ``call_sid``: a webhook Twilio retries for a call it already
        holds a place for is not counted twice."""
        if self.draining:
            return "draining"
        if self.problems:
            return "unhealthy"
        occupancy = self.occupancy()  # first: it drops expired reservations
        held = 1 if call_sid is not None and call_sid in self._reservations else 0
        if occupancy - held >= self.settings.max_calls:
            return "at_capacity"
        if self.overload.overloaded:
            return "overloaded"
        return None

    async def readyz(self, request: web.Request) -> web.Response:
        refusal = self.refusal()
        extra: dict[str, object] = {}
        if refusal:
            extra["reason"] = refusal
        if refusal == "overloaded":
            extra["late"] = self.overload.reason
        if self.problems:
            extra["problems"] = dict(self.problems)
        return web.json_response(
            {"ready": refusal is None, "draining": self.draining,
             "overloaded": self.overload.overloaded,
             "calls": len(self.calls), "reserved": self.reserved, **extra},
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
            self.metrics.refused("signature")
            _WEBHOOKS_REFUSED.warning("webhook rejected: bad or missing X-Twilio-Signature "
                                      "for %s", voice_url)
            raise web.HTTPForbidden(text="invalid Twilio signature")
        call_sid = form.get("CallSid", "")
        if not call_sid.startswith("CA"):
            raise web.HTTPBadRequest(text="CallSid missing or malformed")
        response = VoiceResponse()
        # No await from the check to the reservation: webhooks arriving together are counted
        # one after the other, so they cannot all see the same free place.
        reason = self.refusal(call_sid)
        if reason is not None:
            log.warning("refusing call %s: gateway %s", call_sid, reason.replace("_", " "))
            self.metrics.refused(reason)
            response.append(Say("Sorry, all our lines are busy. Please call again in a moment."))
            response.hangup()
            # Twilio needs a 200 to play the TwiML; the header says why to whoever else looks.
            return web.Response(text=str(response), content_type="application/xml",
                                headers={REFUSED_HEADER: reason})
        if call_sid not in self._live:  # a retried webhook of a live call holds no second place
            self._reserve(call_sid)
        agent = self.settings.agent_for_number(form.get("To"))
        token = self.tokens.issue(call_sid, agent)
        # The token in the path makes the upgrade's signature differ per call (Twilio signs
        # the URL, and only the URL): a replayed upgrade is refused at once (media_socket).
        stream = Stream(url=f"{media_url}/{token}")
        stream.parameter(name="token", value=token)
        stream.parameter(name="agent", value=agent)
        stream.parameter(name="from", value=form.get("From", ""))
        stream.parameter(name="to", value=form.get("To", ""))
        connect = Connect()
        connect.append(stream)
        response.append(connect)
        log.info("call %s to %s -> agent %s", call_sid, form.get("To"), agent)
        return web.Response(text=str(response), content_type="application/xml")

    async def _authorize(self, start: tp.Start, key: TokenClaims | None = None) -> CallInfo:
        """Admit a stream's ``start``: one live stream per call, its token unused, and a place
        (the webhook's reservation, or a free one). ``key``: the claims of the token the
        upgrade's URL carried (spent there), which the ``start`` must match; without one the
        ``token`` parameter is checked and spent here. The one await (the shared record of
        spent tokens) holds the call's place among the live ones, so two starts racing for one
        call cannot both pass."""
        params = start.custom_parameters
        agent = params.get("agent", "default")
        sid = start.call_sid
        if sid in self._live:
            # A copy of a live call's stream would get the bot's audio, make the agent greet
            # again, and end the real call with its `stop`.
            raise StreamRefused(f"call {sid} already has a live stream",
                                reason="duplicate_stream", close_message="call already streaming")
        if self.settings.validate_signatures:
            if key is not None:
                if key.call_sid != sid:
                    raise StreamRefused(f"stream URL was issued for call {key.call_sid}, not "
                                        f"{sid}", reason="token",
                                        close_message="call token refused")
                claims = key
            else:
                self._live.add(sid)  # a start racing this one while the record is written
                try:
                    claims = await self.tokens.spend(params.get("token", ""), call_sid=sid)
                except InvalidToken as exc:
                    raise StreamRefused(f"call token refused: {exc.reason}", reason="token",
                                        close_message="call token refused") from exc
                finally:
                    self._live.discard(sid)
            agent = claims.agent
        reserved = self._reservations.pop(sid, None) is not None
        if not reserved and self.draining:
            # A stream whose webhook this gateway did not answer (another one did, or the
            # reservation lapsed) is a new call: a draining gateway takes none.
            raise StreamRefused(f"call {sid} has no reservation and the gateway is draining",
                                reason="draining", close_message="gateway draining")
        if not reserved and self.occupancy() >= self.settings.max_calls:
            # No webhook here reserved it (it expired, or another gateway answered the
            # webhook): it needs a free place like any new call.
            raise StreamRefused(f"call {sid} has no reservation and the gateway is full",
                                reason="at_capacity", close_message="gateway at capacity")
        self._live.add(sid)
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
        key = request.match_info.get("key")
        if key is not None:
            media_url = f"{media_url}/{key}"
        if not self._signature_ok(media_url, request.headers.get(SIGNATURE_HEADER), None) and not (
            self.console is not None and self.console.admits(request)
        ):
            self.metrics.refused("signature")
            _SOCKETS_REFUSED.warning("media socket rejected: bad or missing X-Twilio-Signature")
            raise web.HTTPForbidden(text="invalid Twilio signature")
        claims: TokenClaims | None = None
        if key is not None and self.settings.validate_signatures:
            try:
                # Spent here: the same URL and signature again (a replay) is refused now,
                # before it holds a socket.
                claims = await self.tokens.spend(key, call_sid=None)
            except InvalidToken as exc:
                self.metrics.refused("stream_key")
                _SOCKETS_REFUSED.warning("media upgrade refused: stream URL key: %s", exc.reason)
                raise web.HTTPForbidden(text="stream URL refused") from exc
        cap = self.settings.max_calls + max(1, self.settings.max_calls // 10)
        if self.sockets_open >= cap:
            # The webhook already refuses calls at max_calls; this guards the machine against
            # sockets that skipped it (every open socket counts, started or not).
            self.metrics.refused("socket_over_capacity")
            _SOCKETS_REFUSED.warning("media upgrade refused: %d sockets open", self.sockets_open)
            raise web.HTTPServiceUnavailable(text="gateway at capacity")
        if self.sockets_pending >= self.settings.pending_cap():
            self.metrics.refused("pending_sockets")
            _SOCKETS_REFUSED.warning("media upgrade refused: %d sockets waiting for start",
                                     self.sockets_pending)
            raise web.HTTPServiceUnavailable(text="too many streams starting")
        # Counted before the first await, so upgrades arriving together see each other.
        self.sockets_open += 1
        self.sockets_pending += 1
        pending = [True]

        def started() -> None:
            if pending[0]:
                pending[0] = False
                self.sockets_pending -= 1

        try:
            return await self._run_media_socket(request, started, claims)
        finally:
            self.sockets_open -= 1
            started()

    async def _run_media_socket(self, request: web.Request, started: Callable[[], None],
                                key: TokenClaims | None) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(heartbeat=30.0, max_msg_size=1 << 20)
        await ws.prepare(request)
        session: CallSession | None = None
        downlink: asyncio.Task[None] | None = None
        clock_base: float | None = None
        media_ms = 0.0
        loop = asyncio.get_running_loop()
        start_deadline = loop.time() + self.settings.start_timeout_s

        async def send(text: str) -> None:
            if not ws.closed:
                await ws.send_str(text)

        timeline = Timeline(keep=False)
        timeline.add_listener(self.metrics.observe_event)
        if self.console is not None:
            self.ops.watch(timeline)
        recorder = (CallRecorder(timeline, self.settings.recording_for)
                    if self.settings.recording_for is not None else None)
        transcriber_for = self.settings.transcriber_for
        session = CallSession(
            send=send, bus=self.bus, vad=self.vad, timeline=timeline,
            authorize=lambda start: self._authorize(start, key),
            settings_for=lambda info: self.settings.call_settings_for(info.agent),
            transcriber_for=(None if transcriber_for is None
                             else lambda info: transcriber_for(info.agent)),
        )
        try:
            while True:
                if session.info is None:
                    # Until a valid `start`, the socket holds a place among the pending ones
                    # and may hold it only so long (a replayed upgrade buys nothing more).
                    remaining = start_deadline - loop.time()
                    try:
                        if remaining <= 0:
                            raise TimeoutError
                        msg = await ws.receive(timeout=remaining)
                    except TimeoutError:
                        self.metrics.refused("start_timeout")
                        _NO_START.warning("closing media socket: no valid start within %g s",
                                          self.settings.start_timeout_s)
                        await ws.close(code=1008, message=b"no start")
                        break
                else:
                    msg = await ws.receive()
                if msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
                    break
                if msg.type is WSMsgType.TEXT:
                    if recorder is not None:
                        recorder.inbound(msg.data)
                    received = time.perf_counter()
                    skipped = session.frames_skipped
                    try:
                        await session.handle_text(msg.data)
                    except CallRejected as exc:
                        reason = exc.reason if isinstance(exc, StreamRefused) else "token"
                        close = (exc.close_message if isinstance(exc, StreamRefused)
                                 else "call token refused")
                        self.metrics.refused(reason)
                        _NO_START.warning("closing media socket: %s", exc)
                        await ws.close(code=1008, message=close.encode())
                        break
                    processing = time.perf_counter() - received
                    self.metrics.frames.inc()
                    self.metrics.frame_receive_to_done.observe(processing)
                    if session.now_ms > media_ms:
                        # Only media frames advance the clock; mark echoes arrive whenever
                        # Twilio sends them and would read as lag against the last frame.
                        media_ms = session.now_ms
                        # Lag behind the media clock: how much later than its audio's own time
                        # a frame is done, against the call's best (first, unloaded) frames.
                        # Unlike receive-to-done, it counts frames waiting in socket buffers,
                        # and the caller's network too: a metric, not the overload guard's
                        # input (gateway/overload.py).
                        offset = time.perf_counter() - session.now_ms / 1000
                        clock_base = offset if clock_base is None else min(clock_base, offset)
                        self.metrics.frame_lag.observe(offset - clock_base)
                        self.overload.observe_frame(processing)
                    if session.frames_skipped != skipped:
                        self.metrics.frames_skipped.inc(session.frames_skipped - skipped)
                    if session.info is not None and downlink is None:
                        started()
                        self.calls[session.info.call_sid] = session
                        self._calls_changed.set()
                        downlink = asyncio.create_task(session.run_downlink())
                        downlink.add_done_callback(
                            functools.partial(self._downlink_done, session.info.call_sid, ws))
                    if session.ended:
                        break
                elif msg.type is WSMsgType.BINARY:
                    self.metrics.frames_skipped.inc()
                    _BINARY_FRAMES.warning("skipped binary frame on media socket (%d bytes)",
                                           len(msg.data))
                elif msg.type is WSMsgType.ERROR:
                    log.warning("media socket error: %s", ws.exception())
                    break
        finally:
            # Shielded: a peer that drops the connection cancels this handler (aiohttp does
            # with handler_cancellation, as its TestServer runs), and a call left half-ended
            # would hold its place (and its live-stream slot) forever.
            await asyncio.shield(self._end_stream(session, downlink, ws, recorder))
        return ws

    def _downlink_done(self, call_sid: str, ws: web.WebSocketResponse, task: asyncio.Task[None]) -> None:
        """A call's downlink pump ended. Failed (a bus error, a socket write that raised), the
        call would go on hearing the caller with the bot mute and nothing said: log it and end
        the call by closing its socket (the handler's ``finally`` then ends the session)."""
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        log.error("call %s: its downlink failed (%r); ending the call", call_sid, exc,
                  exc_info=(type(exc), exc, exc.__traceback__) if exc is not None else None)
        if not ws.closed:
            closing = asyncio.ensure_future(ws.close(code=1011, message=b"downlink failed"))
            _CLOSING.add(closing)  # held until done: the loop keeps only weak references
            closing.add_done_callback(_CLOSING.discard)

    async def _end_stream(self, session: CallSession, downlink: asyncio.Task[None] | None,
                          ws: web.WebSocketResponse,
                          recorder: CallRecorder | None = None) -> None:
        try:
            await session.end("socket_closed")
        finally:
            if downlink is not None:
                downlink.cancel()
                await asyncio.gather(downlink, return_exceptions=True)
            if session.info is not None:
                sid = session.info.call_sid
                self._live.discard(sid)
                if self.calls.get(sid) is session:
                    del self.calls[sid]
                self._calls_changed.set()
                self.completed.append({
                    "call_sid": sid, "media_ms": session.now_ms,
                    "frames_processed": session.frames_processed,
                    "frames_skipped": session.frames_skipped, "dtmf": session.dtmf_digits,
                })
            if not ws.closed:
                await ws.close()
            if recorder is not None:
                await recorder.finish(session.settings)  # written off the event loop


GATEWAY_KEY: web.AppKey[GatewayApp] = web.AppKey("gateway", GatewayApp)


def build_app(settings: GatewaySettings, *, bus: Bus, vad: VadEngine,
              clock: Callable[[], float] = time.monotonic) -> web.Application:
    """The aiohttp application; bus and VAD engine are started and closed with it, and the
    event-loop lag probe of the overload guard runs as long as it does."""
    gateway = GatewayApp(settings, bus=bus, vad=vad, clock=clock)
    app = web.Application()
    app[GATEWAY_KEY] = gateway
    app.add_routes(gateway.routes())

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await bus.start()
        await vad.start()
        probe = asyncio.create_task(gateway.overload.probe(gateway.metrics.loop_lag.observe),
                                    name="event-loop-lag-probe")
        yield
        probe.cancel()
        await asyncio.gather(probe, return_exceptions=True)
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
def recording_settings_from(r: Any) -> RecordingSettings:
    """An agent's ``recording:`` section (``config.RecordingConfig``) as the recorder's settings."""
    return RecordingSettings(Path(r.folder), keep_calls=r.keep_calls, keep_days=r.keep_days,
                             max_seconds=r.max_seconds)


def call_settings_from(barge_in: Any, turn: Any = None) -> CallSettings:
    """Map an agent's ``barge_in`` section (config.BargeInConfig) and ``turn`` section
    (config.TurnConfig; None: the defaults) to the call's settings."""
    b = barge_in
    decision = BargeInSettings(p_on=b.p_on, p_off=b.p_off, start_windows=b.start_windows,
                               stop_windows=b.stop_windows, commit_ms=b.commit_ms,
                               resume_on_backchannel=b.resume_on_backchannel,
                               band_snr_db=b.band_snr_db, dtmf_interrupts=b.dtmf_interrupts,
                               speech_over_uninterruptible=OverUninterruptible(
                                   b.speech_over_uninterruptible))
    return CallSettings(
        turn=TurnSettings(**turn.model_dump()) if turn is not None else TurnSettings(),
        barge_in=(decision.with_fitted_classifier() if b.classifier == "fitted"
                  else decision.without_classifier()),
        echo=EchoGateSettings(echo_margin_db=b.echo_margin_db, noise_margin_db=b.noise_margin_db),
        echo_canceller=AecMode(b.echo_canceller),
        playback_lead_ms=b.playback_lead_ms,
        chunk_ms=b.playback_chunk_ms,
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
                opts: dict[str, Any] = {"language": stt.language.split("-")[0],
                                        "transport": stt.transport}
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

    console = cfg.console
    ops_token = console.auth_token.get_secret_value() if console.auth_token else None
    ops_on = console.enabled
    if ops_on and ops_token is None and cfg.twilio.validate_signatures:
        log.warning("console and ops streams OFF: console.enabled is set on a gateway that "
                    "validates Twilio signatures, but no ops token (console.auth_token: "
                    "${CALLGATE_OPS_TOKEN}) is configured; they are never served open here")
        ops_on = False
    ops = OpsSettings(enabled=ops_on, token=ops_token,
                      agents=lambda: list(holder.current.agents),
                      numbers=lambda: dict(holder.current.numbers))

    def recording_for(agent: str) -> RecordingSettings | None:
        r = holder.current.agent(agent).recording
        return None if r is None else recording_settings_from(r)

    return GatewaySettings(
        ops=ops,
        recording_for=recording_for,
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


def _security_from(cfg: Any) -> dict[str, Any]:
    """The gateway settings a config carries, as :meth:`GatewayApp.reconfigure` takes them."""
    token = cfg.twilio.auth_token.get_secret_value() if cfg.twilio.auth_token else None
    return {"public_url": cfg.server.public_url, "auth_token": token or None,
            "validate_signatures": cfg.twilio.validate_signatures,
            "max_calls": cfg.server.max_calls, "overload_lag_ms": cfg.server.overload_lag_ms}


def follow_reloads(holder: Any, gateway: GatewayApp) -> Callable[[], None]:
    """Apply every reload of ``holder`` to ``gateway`` (signature validation, auth token,
    public URL, ``max_calls``, ``overload_lag_ms``; agents and speech are read per call
    anyway). A config the gateway cannot apply (validation on, no token) is refused before
    it switches. Returns a function that stops following."""

    def check(cfg: Any) -> None:
        sec = _security_from(cfg)
        check_security(sec["validate_signatures"], sec["auth_token"])

    def apply(cfg: Any) -> None:
        changed = gateway.reconfigure(**_security_from(cfg))
        if changed:
            log.info("gateway settings reloaded: %s", ", ".join(changed))

    removers = [holder.add_check(check), holder.on_change(apply)]

    def unfollow() -> None:
        for remove in removers:
            remove()

    return unfollow
