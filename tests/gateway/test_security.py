"""Tests for gateway.security: Twilio signatures (signed by twilio's own code) and call tokens."""

from __future__ import annotations

import base64
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from twilio.request_validator import RequestValidator

import gateway.security as security
from gateway.security import (
    SIGNATURE_HEADER,
    CallTokens,
    ExpiredToken,
    InvalidToken,
    MalformedToken,
    ReusedToken,
    SecurityError,
    SignatureValidator,
    TamperedToken,
    TokenClaims,
    WrongCallToken,
)

from ..common import assert_exports_complete

AUTH_TOKEN = "12345678901234567890123456789012"
WS_URL = "wss://gw.example.com/twilio/media"
VOICE_URL = "https://gw.example.com/twilio/voice"
VOICE_FORM = {
    "AccountSid": "AC738f49fd34e1cc280e5a43c8eadc540c",
    "CallSid": "CA3062378f6d0862be2908223f581cd592",
    "From": "+15005550006",
    "To": "+15005550001",
    "CallStatus": "ringing",
    "Direction": "inbound",
    "CallerName": "Zoë O'Brien & Co",
}


def sign(url: str, params: dict[str, str] | None = None, token: str = AUTH_TOKEN) -> str:
    """Sign exactly as Twilio does, with Twilio's own helper."""
    return str(RequestValidator(token).compute_signature(url, params or {}))


@pytest.fixture
def validator() -> SignatureValidator:
    return SignatureValidator(AUTH_TOKEN)


def test_exports_are_complete() -> None:
    assert_exports_complete(security)
    assert SIGNATURE_HEADER == "X-Twilio-Signature"


# --- webhook ------------------------------------------------------------------------------------


def test_webhook_good_signature_passes(validator: SignatureValidator) -> None:
    assert validator.validate_webhook(VOICE_URL, VOICE_FORM, sign(VOICE_URL, VOICE_FORM))


def test_webhook_with_query_string_in_url(validator: SignatureValidator) -> None:
    url = VOICE_URL + "?agent=sales&lang=en-US"
    assert validator.validate_webhook(url, VOICE_FORM, sign(url, VOICE_FORM))
    assert not validator.validate_webhook(VOICE_URL, VOICE_FORM, sign(url, VOICE_FORM))


@pytest.mark.parametrize("signature", [None, ""])
def test_webhook_missing_signature_fails(validator: SignatureValidator, signature: None) -> None:
    assert not validator.validate_webhook(VOICE_URL, VOICE_FORM, signature)


def test_webhook_forged_signature_fails(validator: SignatureValidator) -> None:
    assert not validator.validate_webhook(
        VOICE_URL, VOICE_FORM, sign(VOICE_URL, VOICE_FORM, token="not-the-auth-token")
    )
    assert not validator.validate_webhook(
        VOICE_URL, VOICE_FORM, base64.b64encode(b"\x00" * 20).decode()
    )
    assert not validator.validate_webhook(VOICE_URL, VOICE_FORM, "garbage ünicode")


def test_webhook_tampered_params_fail(validator: SignatureValidator) -> None:
    signature = sign(VOICE_URL, VOICE_FORM)
    assert not validator.validate_webhook(VOICE_URL, {**VOICE_FORM, "From": "+1999"}, signature)
    assert not validator.validate_webhook(VOICE_URL, {**VOICE_FORM, "Extra": "1"}, signature)
    assert not validator.validate_webhook(VOICE_URL, {}, signature)


def test_webhook_signed_for_another_url_fails(validator: SignatureValidator) -> None:
    signature = sign("https://evil.example.com/twilio/voice", VOICE_FORM)
    assert not validator.validate_webhook(VOICE_URL, VOICE_FORM, signature)
    # The scheme is part of what Twilio signs.
    assert not validator.validate_webhook(
        VOICE_URL, VOICE_FORM, sign(VOICE_URL.replace("https", "http"), VOICE_FORM)
    )


def test_webhook_port_either_way(validator: SignatureValidator) -> None:
    with_port = "https://gw.example.com:443/twilio/voice"
    assert validator.validate_webhook(VOICE_URL, VOICE_FORM, sign(with_port, VOICE_FORM))
    assert validator.validate_webhook(with_port, VOICE_FORM, sign(VOICE_URL, VOICE_FORM))


def test_webhook_repeated_keys_via_getall(validator: SignatureValidator) -> None:
    from multidict import MultiDict, MultiDictProxy

    form = MultiDictProxy(MultiDict([("CallSid", "CA1"), ("Digits", "1"), ("Digits", "2")]))
    signature = RequestValidator(AUTH_TOKEN).compute_signature(VOICE_URL, form)
    assert signature != sign(VOICE_URL, {"CallSid": "CA1", "Digits": "2"})
    assert validator.validate_webhook(VOICE_URL, form, signature)
    assert not validator.validate_webhook(VOICE_URL, {"CallSid": "CA1", "Digits": "1"}, signature)


def test_empty_auth_token_is_refused() -> None:
    with pytest.raises(ValueError):
        SignatureValidator("")


# --- websocket upgrade --------------------------------------------------------------------------


def test_websocket_good_signature_passes(validator: SignatureValidator) -> None:
    assert validator.validate_websocket(WS_URL, sign(WS_URL))


@pytest.mark.parametrize("signature", [None, ""])
def test_websocket_missing_signature_fails(validator: SignatureValidator, signature: None) -> None:
    assert not validator.validate_websocket(WS_URL, signature)


def test_websocket_forged_signature_fails(validator: SignatureValidator) -> None:
    assert not validator.validate_websocket(WS_URL, sign(WS_URL, token="wrong-token"))
    assert not validator.validate_websocket(WS_URL, "AAAA")


def test_websocket_signed_for_another_url_fails(validator: SignatureValidator) -> None:
    assert not validator.validate_websocket(WS_URL, sign("wss://gw.example.com/other"))
    assert not validator.validate_websocket(WS_URL, sign("wss://evil.example.com/twilio/media"))
    # Twilio signs the wss:// URL; the https:// form a framework reports is a different string.
    assert not validator.validate_websocket(WS_URL, sign(WS_URL.replace("wss", "https")))
    # The webhook's signature (URL plus form) is no good on the socket.
    assert not validator.validate_websocket(WS_URL, sign(WS_URL, {"CallSid": "CA1"}))


def test_websocket_default_port_either_way(validator: SignatureValidator) -> None:
    assert validator.validate_websocket(WS_URL, sign("wss://gw.example.com:443/twilio/media"))
    assert validator.validate_websocket("wss://gw.example.com:443/twilio/media", sign(WS_URL))
    # twilio's own validate() would try ":80" for wss; 80 is not wss's port.
    assert not validator.validate_websocket(WS_URL, sign("wss://gw.example.com:80/twilio/media"))


def test_websocket_with_query_accepts_both_signing_forms(validator: SignatureValidator) -> None:
    url = WS_URL + "?agent=sales"
    assert validator.validate_websocket(url, sign(url))  # URL with its query, no params
    assert validator.validate_websocket(url, sign(WS_URL, {"agent": "sales"}))  # query as params
    assert not validator.validate_websocket(url, sign(WS_URL))
    assert not validator.validate_websocket(url, sign(WS_URL, {"agent": "support"}))


def test_websocket_signature_is_the_same_for_every_call() -> None:
    # Nothing per-call is signed on the upgrade: this is why CallTokens exist.
    assert sign(WS_URL) == sign(WS_URL)


@given(st.text(max_size=200), st.one_of(st.none(), st.text(max_size=60)))
@settings(max_examples=300, database=None)
def test_validators_never_raise(url: str, signature: str | None) -> None:
    v = SignatureValidator(AUTH_TOKEN)
    assert v.validate_websocket(url, signature) in (True, False)
    assert v.validate_webhook(url, {"a": url}, signature) in (True, False)


# --- call tokens --------------------------------------------------------------------------------

SECRET = b"s" * 32
CALL = "CA3062378f6d0862be2908223f581cd592"


class FakeClock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def tokens(clock: FakeClock) -> CallTokens:
    return CallTokens(SECRET, ttl_s=600, clock=clock)


def test_token_round_trip(tokens: CallTokens, clock: FakeClock) -> None:
    token = tokens.issue(CALL, "sales")
    assert all(c.isalnum() or c in "-_." for c in token)  # URL-safe as is
    claims = tokens.verify(token, call_sid=CALL)
    assert claims == TokenClaims(call_sid=CALL, agent="sales", expires_at=clock.now + 600,
                                 token_id=token.rpartition(".")[2])


def test_a_token_starts_one_stream_only(tokens: CallTokens, clock: FakeClock) -> None:
    """redeem spends the token: the same token again is refused, another one for the same call
    (Twilio fetched the TwiML twice) is not; spent tokens are forgotten once expired."""
    first = tokens.issue(CALL, "sales")
    clock.now += 1
    second = tokens.issue(CALL, "sales")
    assert tokens.redeem(first, call_sid=CALL).agent == "sales"
    with pytest.raises(ReusedToken, match="already used"):
        tokens.redeem(first, call_sid=CALL)
    second_id = tokens.redeem(second, call_sid=CALL).token_id
    assert second_id != tokens.verify(first, call_sid=CALL).token_id
    with pytest.raises(ReusedToken):
        tokens.redeem(second, call_sid=CALL)
    clock.now += 601
    with pytest.raises(ExpiredToken):  # expired first: reuse of a dead token is moot
        tokens.redeem(first, call_sid=CALL)
    assert tokens.spent == 0  # purged: it holds no more than the tokens still alive


def test_token_carries_unicode_agent(tokens: CallTokens) -> None:
    assert tokens.verify(tokens.issue(CALL, "ventes-é"), call_sid=CALL).agent == "ventes-é"


def test_token_expires(tokens: CallTokens, clock: FakeClock) -> None:
    token = tokens.issue(CALL, "sales")
    clock.now += 599.999
    tokens.verify(token, call_sid=CALL)
    clock.now += 0.001
    with pytest.raises(ExpiredToken):
        tokens.verify(token, call_sid=CALL)


def test_token_for_another_call_is_refused(tokens: CallTokens) -> None:
    token = tokens.issue(CALL, "sales")
    with pytest.raises(WrongCallToken) as info:
        tokens.verify(token, call_sid="CA00000000000000000000000000000000")
    assert isinstance(info.value, InvalidToken) and isinstance(info.value, SecurityError)


def test_token_from_another_secret_is_tampered(clock: FakeClock) -> None:
    other = CallTokens(b"o" * 32, clock=clock)
    with pytest.raises(TamperedToken):
        CallTokens(SECRET, clock=clock).verify(other.issue(CALL, "sales"), call_sid=CALL)


def _forge_body(token: str, **changes: object) -> str:
    body, _, mac = token.partition(".")
    claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    claims.update(changes)
    new = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    return f"{new}.{mac}"


def test_edited_claims_are_tampered(tokens: CallTokens) -> None:
    token = tokens.issue(CALL, "sales")
    for forged in (
        _forge_body(token, a="admin"),
        _forge_body(token, e=9e18),
        _forge_body(token, c="CA1"),
    ):
        with pytest.raises(TamperedToken):
            tokens.verify(forged, call_sid=CALL)


def test_every_single_character_edit_is_refused(tokens: CallTokens) -> None:
    token = tokens.issue(CALL, "sales")
    for i, ch in enumerate(token):
        for repl in ("A", "-", "!"):
            if repl == ch:
                continue
            edited = token[:i] + repl + token[i + 1 :]
            with pytest.raises(InvalidToken):
                tokens.verify(edited, call_sid=CALL)
    with pytest.raises(InvalidToken):
        tokens.verify(token + "A", call_sid=CALL)
    with pytest.raises(InvalidToken):
        tokens.verify(token[:-1], call_sid=CALL)


@pytest.mark.parametrize(
    "garbage",
    ["", ".", "abc", "abc.", ".abc", "a.b.c", "abc.d ef", "é.é", "x" * 5000, "a=.b="],
)
def test_garbage_tokens_are_malformed_or_tampered(tokens: CallTokens, garbage: str) -> None:
    with pytest.raises((MalformedToken, TamperedToken)):
        tokens.verify(garbage, call_sid=CALL)


def test_non_string_token_is_malformed(tokens: CallTokens) -> None:
    with pytest.raises(MalformedToken):
        tokens.verify(None, call_sid=CALL)  # type: ignore[arg-type]


@given(st.text(max_size=300))
@settings(max_examples=300, database=None)
def test_verify_raises_only_invalid_token(garbage: str) -> None:
    t = CallTokens(SECRET, clock=FakeClock())
    with pytest.raises(InvalidToken):
        t.verify(garbage, call_sid=CALL)


@pytest.mark.parametrize(
    ("secret", "ttl"), [(b"short", 600.0), (SECRET, 0.0), (SECRET, -1.0), (SECRET, float("nan"))]
)
def test_bad_configuration_is_refused(secret: bytes, ttl: float) -> None:
    with pytest.raises(ValueError):
        CallTokens(secret, ttl_s=ttl)


def test_default_clock_is_real_time() -> None:
    t = CallTokens(SECRET, ttl_s=60)
    assert t.verify(t.issue(CALL, "a"), call_sid=CALL).agent == "a"


def test_token_errors_pickle() -> None:
    import pickle

    back = pickle.loads(pickle.dumps(ExpiredToken("token expired at 5")))
    assert isinstance(back, ExpiredToken) and back.reason == "token expired at 5"
