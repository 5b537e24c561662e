"""Who may talk to the gateway: Twilio request signatures and per-call stream tokens.

Two independent checks, because neither is enough alone:

* :class:`SignatureValidator` checks ``X-Twilio-Signature`` on the voice webhook and on the
  Media Streams WebSocket upgrade, proving Twilio (holder of the auth token) sent them.
* :class:`CallTokens` mints a short-lived token in the webhook response (as a ``<Parameter>`` of
  ``<Stream>``) and checks it when the stream's ``start`` message arrives, binding the stream to
  the call the webhook saw and to the agent chosen for it.

Why the token as well: Twilio signs the WebSocket upgrade over the ``wss://`` URL of
``<Stream url>`` with no parameters, so for a bare URL that signature is the *same for every
call*: anyone who sees one upgrade request (a proxy log, say) can replay the header forever.
So the gateway puts the per-call token in the stream URL's *path*
(``wss://host/twilio/media/<token>``; Twilio does not support query strings there, error
31920): the signature then differs per call, and :meth:`CallTokens.redeem` spends the token at
the upgrade, so a replayed upgrade is refused before it holds a socket. The same token also
rides in ``start.customParameters``, which is what a stream on the bare URL is checked by.

Errors::

    SecurityError (Exception)
    └── InvalidToken               a stream token that must be refused (has .reason)
        ├── MalformedToken         not a token this module issued (garbage, truncated, wrong shape)
        ├── TamperedToken          the signature does not match (forged, edited, other secret)
        ├── WrongCallToken         valid, but issued for another call
        ├── ExpiredToken           valid, but past its expiry
        └── ReusedToken            valid, but a stream already started with it (single use)
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import math
import re
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Final
from urllib.parse import parse_qs, urlsplit, urlunsplit

from twilio.request_validator import RequestValidator

from bus import BusUnavailableError

from .logs import RateLimitedLog

__all__ = [
    "SIGNATURE_HEADER",
    "CallTokens",
    "SharedRecord",
    "ExpiredToken",
    "InvalidToken",
    "MalformedToken",
    "ReusedToken",
    "SecurityError",
    "SignatureValidator",
    "TamperedToken",
    "TokenClaims",
    "WrongCallToken",
]

SIGNATURE_HEADER: Final = "X-Twilio-Signature"
"""The HTTP header (webhook POST and WebSocket upgrade alike) that carries Twilio's signature."""

SharedRecord = Callable[[str, str, float], Awaitable[bool]]
"""``record(call_sid, token_id, ttl_s)``: record a spent token where every gateway sees it (the
Redis bus's ``record_once``); False when it was recorded before. May raise
``BusUnavailableError``."""

_log = logging.getLogger(__name__)
_SHARED_DOWN = RateLimitedLog(_log, "streams whose token was spent in this gateway only")

_DEFAULT_PORTS: Final = {"https": 443, "wss": 443, "http": 80, "ws": 80}


class SecurityError(Exception):
    """Base class of the errors this module raises."""


class InvalidToken(SecurityError):
    """A per-call stream token that must be refused.

    Attributes:
        reason: why, in words, for the log line; never echo it to the peer.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class MalformedToken(InvalidToken):
    """Not shaped like a token this module issues: garbage, truncated, wrong type."""


class TamperedToken(InvalidToken):
    """Well-shaped, but the HMAC does not match: forged, edited, or signed with another secret."""


class WrongCallToken(InvalidToken):
    """Genuine, but issued for a different call than the stream claims to carry."""


class ExpiredToken(InvalidToken):
    """Genuine, but its lifetime is over (the stream opened too long after the webhook)."""


class ReusedToken(InvalidToken):
    """Genuine, but already spent: a stream started with it before (tokens are single-use)."""


# --- Twilio signatures --------------------------------------------------------------------------


def _url_variants(url: str) -> list[str]:
    """The URL as given, without its port, and with the scheme's default port.

    Twilio's back end is inconsistent about ports (its own validator tries with and without).
    ``twilio.request_validator.add_port`` assumes port 80 for anything that is not ``https``,
    wrong for ``wss``, so the default ports are worked out here.
    """
    variants = [url]
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:  # unparsable port: only the literal URL can match
        return variants
    # Edit the netloc as text: .hostname would lower-case the host, changing the signed string.
    if port is not None:
        variants.append(urlunsplit(parts._replace(netloc=parts.netloc.rsplit(":", 1)[0])))
    else:
        default = _DEFAULT_PORTS.get(parts.scheme.lower())
        if default is not None and parts.netloc:
            variants.append(urlunsplit(parts._replace(netloc=f"{parts.netloc}:{default}")))
    return variants


class SignatureValidator:
    """Checks ``X-Twilio-Signature`` with the account's auth token.

    Twilio's scheme: base64(HMAC-SHA1(auth_token, URL + each POST parameter name and value,
    sorted by name)). The URL must be the one Twilio requested, exactly as configured: scheme,
    host, port, path and query string, *not* the URL a reverse proxy hands the app (which will
    say ``http``, an internal host, or ``https`` instead of ``wss``). Reconstructing it from
    the public base URL is the handler's job.

    Signing is delegated to :class:`twilio.request_validator.RequestValidator` so the scheme
    stays Twilio's; the comparison uses :func:`hmac.compare_digest`.
    """

    def __init__(self, auth_token: str) -> None:
        """Create a validator.

        Args:
            auth_token: the Twilio account's (primary) auth token.

        Raises:
            ValueError: ``auth_token`` is empty, which would make every signature forgeable.
        """
        if not auth_token:
            raise ValueError("auth_token must not be empty")
        self._validator = RequestValidator(auth_token)

    def _matches(self, url: str, params: Mapping[str, str], signature: str | None) -> bool:
        if not signature:
            return False
        got = signature.encode("utf-8")
        ok = False
        for candidate in _url_variants(url):
            expected = self._validator.compute_signature(candidate, params).encode("utf-8")
            ok |= hmac.compare_digest(expected, got)  # no early exit: constant work
        return ok

    def validate_webhook(self, url: str, form: Mapping[str, str], signature: str | None) -> bool:
        """Check a webhook (e.g. the voice POST) signed over its URL and form parameters.

        Args:
            url: the full URL Twilio requested, including any query string.
            form: every POST parameter received, not just the ones the app uses (Twilio adds
                parameters without notice). A multi-dict with ``getall`` (aiohttp's
                ``MultiDictProxy``) is handled the way Twilio signs repeated keys.
            signature: the ``X-Twilio-Signature`` header, or ``None`` when absent.

        Returns:
            True only if the signature matches; a missing or empty one is False.
        """
        return self._matches(url, form, signature)

    def validate_websocket(self, url: str, signature: str | None) -> bool:
        """Check the ``X-Twilio-Signature`` header of a Media Streams WebSocket upgrade.

        What Twilio does (as found in its documentation and its own code, 2026-11):

        * The upgrade request carries ``X-Twilio-Signature``, computed like any webhook's with
          the ``wss://`` URL from ``<Stream url>`` and *no* parameters (a GET has no body).
          Twilio's Media Streams firewall guide tells apps to validate it; ConversationRelay's
          onboarding guide says the same and to "use your auth token and the request URL".
        * The scheme signed is ``wss``: validating the ``https://`` URL a framework reports
          fails (twilio-labs/twilio-aspnet issue #162).
        * ``<Stream url>`` does not support query strings (Twilio error 31920); per-call data
          belongs in ``<Parameter>``. Should a URL have a query anyway, both the URL-with-query
          form and the form Twilio's own ``twilio-agent-connect-python`` validates (bare URL,
          query pairs as signed parameters) are accepted.

        Because no per-request data is signed, a valid signature only shows that Twilio made
        *some* request to this URL; pair it with :class:`CallTokens`.

        Args:
            url: the public ``wss://`` URL exactly as written in the TwiML.
            signature: the ``X-Twilio-Signature`` header, or ``None`` when absent.

        Returns:
            True only if the signature matches; a missing or empty one is False.
        """
        if self._matches(url, {}, signature):
            return True
        parts = urlsplit(url)
        if not parts.query:
            return False
        bare = urlunsplit(parts._replace(query=""))
        params = {k: v[0] for k, v in parse_qs(parts.query).items()}
        return self._matches(bare, params, signature)


# --- per-call tokens ----------------------------------------------------------------------------

_TOKEN_VERSION: Final = 1
_DOMAIN: Final = b"callgate.call-token.v1\x00"  # never valid as any other HMAC in the system
_B64URL: Final = re.compile(r"[A-Za-z0-9_-]+")
_MAX_TOKEN_CHARS: Final = 4096
_MIN_SECRET_BYTES: Final = 16


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64url(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True, slots=True)
class TokenClaims:
    """What a verified token says.

    Attributes:
        call_sid: the call the token was issued for (``CA...``).
        agent: the agent the webhook routed the call to.
        expires_at: Unix time (seconds, as the injected clock counts) after which it is refused.
        token_id: what identifies this one token among those issued (its MAC): the key under
            which :meth:`CallTokens.redeem` records it as spent.
    """

    call_sid: str
    agent: str
    expires_at: float
    token_id: str = ""


class CallTokens:
    """Issues and verifies short-lived, HMAC-SHA256-signed per-call stream tokens.

    A token is ``base64url(JSON claims) "." base64url(HMAC-SHA256(secret, domain + claims))``:
    opaque to Twilio, URL-safe, and small enough for a TwiML ``<Parameter>``. It is signed,
    not encrypted: the call SID and agent name inside are readable by whoever holds it, which
    is Twilio and us.

    All gateways behind one webhook must share ``secret``.
    """

    def __init__(
        self,
        secret: bytes,
        *,
        ttl_s: float = 600.0,
        clock: Callable[[], float] = time.time,
        shared: SharedRecord | None = None,
    ) -> None:
        """Create an issuer/verifier.

        Args:
            secret: HMAC key, at least 16 bytes (32 random bytes recommended).
            ttl_s: lifetime of an issued token in seconds: how long Twilio may take between
                fetching the TwiML and sending ``start``.
            clock: Unix-time source, injectable so tests move time without sleeping.
            shared: where :meth:`spend` also records spent tokens for every gateway behind
                the same webhook (the Redis bus); None: this process's record only.

        Raises:
            ValueError: ``secret`` too short, or ``ttl_s`` not a positive finite number.
        """
        if len(secret) < _MIN_SECRET_BYTES:
            raise ValueError(f"secret must be at least {_MIN_SECRET_BYTES} bytes")
        if not (math.isfinite(ttl_s) and ttl_s > 0):
            raise ValueError(f"ttl_s must be a positive number of seconds, got {ttl_s!r}")
        self._secret = bytes(secret)
        self._ttl_s = float(ttl_s)
        self._clock = clock
        self._shared = shared
        # token_id -> expiry of every token a stream started with; an entry is useless once
        # the token has expired (verify refuses it anyway), so the map holds at most the
        # tokens redeemed in the last ttl_s.
        self._spent: dict[str, float] = {}
        self._next_purge = 0.0

    @property
    def spent(self) -> int:
        """Spent tokens remembered (those redeemed, until they expire)."""
        return len(self._spent)

    @property
    def ttl_s(self) -> float:
        """Lifetime of an issued token, seconds."""
        return self._ttl_s

    def _mac(self, body: str) -> str:
        digest = hmac.new(self._secret, _DOMAIN + body.encode("ascii"), hashlib.sha256).digest()
        return _b64url(digest)

    def issue(self, call_sid: str, agent: str) -> str:
        """Mint a token for ``call_sid`` routed to ``agent``, valid for ``ttl_s`` from now."""
        claims = {
            "v": _TOKEN_VERSION,
            "c": call_sid,
            "a": agent,
            "e": self._clock() + self._ttl_s,
        }
        body = _b64url(json.dumps(claims, separators=(",", ":")).encode("utf-8"))
        return f"{body}.{self._mac(body)}"

    def verify(self, token: str, *, call_sid: str | None) -> TokenClaims:
        """Check a token (from the stream URL's path or ``start.customParameters``).

        The signature is checked before anything inside the token is parsed, so unsigned
        input never reaches the JSON decoder.

        Args:
            token: the token as received.
            call_sid: the call SID from the ``start`` message carrying it; None at the
                WebSocket upgrade, before any message (the caller then checks the claims'
                call against the ``start`` that follows).

        Returns:
            The token's claims.

        Raises:
            MalformedToken: not a token at all.
            TamperedToken: the signature does not match.
            WrongCallToken: issued for another call.
            ExpiredToken: past its expiry.
        """
        if not isinstance(token, str) or not token:
            raise MalformedToken("token is empty or not a string")
        if len(token) > _MAX_TOKEN_CHARS:
            raise MalformedToken(f"token is longer than {_MAX_TOKEN_CHARS} characters")
        body, dot, mac = token.partition(".")
        if not dot or not _B64URL.fullmatch(body) or not _B64URL.fullmatch(mac):
            raise MalformedToken("token is not two base64url parts joined by '.'")
        if not hmac.compare_digest(self._mac(body).encode("ascii"), mac.encode("ascii")):
            raise TamperedToken("token signature does not match")
        try:
            claims = json.loads(_unb64url(body))
        except (binascii.Error, ValueError, RecursionError) as exc:
            raise MalformedToken("signed token body is not JSON") from exc
        if not isinstance(claims, dict) or claims.get("v") != _TOKEN_VERSION:
            raise MalformedToken("signed token has an unknown version")
        tok_call, agent, expires = claims.get("c"), claims.get("a"), claims.get("e")
        if (
            not isinstance(tok_call, str)
            or not isinstance(agent, str)
            or isinstance(expires, bool)
            or not isinstance(expires, (int, float))
        ):
            raise MalformedToken("signed token lacks call, agent or expiry")
        if call_sid is not None and not hmac.compare_digest(tok_call.encode("utf-8"),
                                                            call_sid.encode("utf-8")):
            raise WrongCallToken(f"token was issued for call {tok_call}, not {call_sid}")
        if self._clock() >= expires:
            raise ExpiredToken(f"token expired at {expires:.0f}")
        return TokenClaims(call_sid=tok_call, agent=agent, expires_at=float(expires),
                           token_id=mac)

    def redeem(self, token: str, *, call_sid: str | None) -> TokenClaims:
        """:meth:`verify` the token and spend it: a stream may start with a token once.

        Twilio opens one stream per ``<Stream>`` it fetched, so a second ``start`` carrying
        the same token is a replay (or a copy of the first stream's traffic), never Twilio.
        Spent tokens are remembered until they expire, in this process; :meth:`spend` also
        records them for every gateway behind the same webhook.

        Raises:
            InvalidToken: every refusal of :meth:`verify`, and :class:`ReusedToken`.
        """
        now = self._clock()
        if now >= self._next_purge:
            self._spent = {k: e for k, e in self._spent.items() if e > now}
            self._next_purge = now + min(self._ttl_s, 60.0)
        claims = self.verify(token, call_sid=call_sid)
        if claims.token_id in self._spent:
            raise ReusedToken(f"token for call {call_sid} was already used by another stream")
        self._spent[claims.token_id] = claims.expires_at
        return claims

    async def spend(self, token: str, *, call_sid: str | None) -> TokenClaims:
        """:meth:`redeem`, then spend the token for every gateway too (``shared``): a copy of
        the upgrade or ``start`` sent to another gateway within the token's lifetime is a
        :class:`ReusedToken` there. The shared record expires with the token.

        With the shared record unreachable (Redis down) the token is still spent here, and
        the refusal elsewhere is not guaranteed for that while (logged): refusing every new
        call during an outage would be worse than the replay window it closes.

        Raises:
            InvalidToken: every refusal of :meth:`redeem`; :class:`ReusedToken` also when
                another gateway spent the token.
        """
        claims = self.redeem(token, call_sid=call_sid)
        if self._shared is None:
            return claims
        ttl_s = max(0.001, claims.expires_at - self._clock())
        try:
            first = await self._shared(claims.call_sid, claims.token_id, ttl_s)
        except BusUnavailableError as exc:
            _SHARED_DOWN.warning("stream token of call %s spent in this gateway only: the shared "
                                 "record is unavailable (%s)", claims.call_sid, exc)
            return claims
        if not first:
            raise ReusedToken(f"token for call {claims.call_sid} was already used by a stream "
                              "on another gateway")
        return claims
