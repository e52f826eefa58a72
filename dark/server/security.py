"""API-key checks, the websocket Origin check, and the per-connection rate limit."""
from __future__ import annotations

import base64
import binascii
import hmac
import time
from urllib.parse import urlsplit

from fastapi import HTTPException, Request, WebSocket

from .protocol import KEY_SUBPROTOCOL_PREFIX, SUBPROTOCOL
from .settings import ServerSettings

KEY_HINT = ("send the key as 'Authorization: Bearer <key>' (HTTP and scripts' websockets), or, from a browser, "
            f"as the websocket subprotocol '{KEY_SUBPROTOCOL_PREFIX}<base64url of the key>' next to '{SUBPROTOCOL}'")


def key_matches(expected: str, given: str | None) -> bool:
    return given is not None and hmac.compare_digest(expected.encode(), given.encode())


def bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def subprotocols(ws: WebSocket) -> list[str]:
    raw = ws.headers.get("sec-websocket-protocol", "")
    return [p.strip() for p in raw.split(",") if p.strip()]


def key_from_subprotocols(protocols: list[str]) -> str | None:
    for p in protocols:
        if p.startswith(KEY_SUBPROTOCOL_PREFIX):
            encoded = p[len(KEY_SUBPROTOCOL_PREFIX):]
            try:
                return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
            except (binascii.Error, ValueError, UnicodeDecodeError):
                return ""  # present but unreadable: a wrong key, not a missing one
    return None


def check_http_key(request: Request) -> None:
    """FastAPI dependency: with an API key configured, the request must carry it as a Bearer token."""
    settings: ServerSettings = request.app.state.dark.settings
    if settings.key is None:
        return
    given = bearer(request.headers.get("authorization"))
    if given is None:
        raise HTTPException(401, f"this server needs an API key: {KEY_HINT}", headers={"WWW-Authenticate": "Bearer"})
    if not key_matches(settings.key, given):
        raise HTTPException(401, "the API key is wrong", headers={"WWW-Authenticate": "Bearer"})


def websocket_key_problem(ws: WebSocket, settings: ServerSettings) -> str | None:
    """Why this websocket may not connect for lack of a key, or None when it may."""
    if settings.key is None:
        return None
    given = bearer(ws.headers.get("authorization"))
    if given is None:
        given = key_from_subprotocols(subprotocols(ws))
    if given is None:
        return f"this server needs an API key: {KEY_HINT}"
    if not key_matches(settings.key, given):
        return "the API key is wrong"
    return None


def _host_port(netloc_or_url: str, default_scheme: str) -> tuple[str, int | None]:
    parts = urlsplit(netloc_or_url if "//" in netloc_or_url else f"{default_scheme}://{netloc_or_url}")
    return (parts.hostname or "").lower(), parts.port


def origin_problem(ws: WebSocket, settings: ServerSettings) -> str | None:
    """Browsers send Origin; a page from another site must not drive this server with the user's key.

    No Origin header (scripts, curl) passes: the key, if any, guards those. Besides the allowed origins, the
    server's own origin passes: the Origin's host is the Host the request came to (and so is its port, when
    Host names one; behind a TLS proxy the Host often has none)."""
    origin = ws.headers.get("origin")
    if origin is None:
        return None
    allowed = settings.allowed_origins
    if "*" in allowed or origin.rstrip("/") in allowed:
        return None
    host = ws.headers.get("host", "")
    if host and origin.startswith(("http://", "https://")):
        o_host, o_port = _host_port(origin, "http")
        h_host, h_port = _host_port(host, "http")
        o_port = o_port or (443 if origin.startswith("https://") else 80)
        if o_host == h_host and (h_port is None or h_port == o_port):
            return None
    return (f"origin {origin!r:.100} may not open this websocket; start the server with --allowed-origins "
            f"(DARK_ALLOWED_ORIGINS) listing it")


class TokenBucket:
    """`rate` events per second on average, up to `burst` at once."""

    def __init__(self, rate: float, burst: int):
        self.rate, self.burst = rate, burst
        self.tokens = float(burst)
        self.last = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False
