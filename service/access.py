"""Who may use the server: API keys for every front that has them (gRPC and HTTP/WebSocket), and the
browser rules of the HTTP front (the Origin of state-changing requests, CORS, the Host header).

* **API keys** (`Access.api_keys`): a request must carry `authorization: Bearer KEY` (gRPC metadata; the
  HTTP header, as the OpenAI and Fish Audio SDKs send it). Every key is compared in constant time
  (`hmac.compare_digest`), and all of them every time, so neither the time to refuse nor to admit tells
  which key came close. No keys: everything is open (and `tts serve` warns when it listens beyond loopback).
  gRPC: `service.grpc_front.AuthInterceptor`, a server interceptor, so every method of every service,
  present and future, is covered; the health service and reflection stay open (balancers and probes call
  them without a key).
  HTTP: `AccessMiddleware`, ASGI middleware around the whole app, so routes added later are covered
  without code of their own; open without a key are `/health`, the playground's static page and assets
  (`/`, `/favicon.ico`, `/static/...`), the API's description (`/docs`, `/docs/...`, `/openapi.json`) and,
  unless `Access.metrics_auth`, `/metrics` and `/load`.
* **Origin** (HTTP): a browser sends a page's "simple" requests (a form, a `text/plain` fetch) to any
  site without asking it first (no CORS preflight), and says where they come from in `Origin`. A
  state-changing request (any method but GET, HEAD, OPTIONS; a WebSocket handshake too) whose `Origin` is
  neither the server's own (the `Host` it was sent to) nor one of `Access.cors_origins` is refused (403),
  before the app sees it.
* **CORS** is off unless `Access.cors_origins` names origins: then those origins' pages may call the API
  (their preflights are answered, and the X-* headers are exposed to them).
* **Host** (DNS rebinding: a hostile name that resolves to 127.0.0.1 lets a page reach a loopback-only
  server as "same origin"): a server bound to a loopback address accepts only the `Host` names of
  loopback (`localhost`, `127.0.0.1`, `::1`) and `Access.allowed_hosts` (`*`: any); a request naming
  another host is refused (421). A server bound elsewhere does not check Host (it is reached by names
  this process does not know; its keys protect it).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

# Methods a browser may send without side effects by the web's own rules (no Origin check needed).
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# gRPC services any client may call without a key: health (balancers, probes) and reflection.
OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
# HTTP paths open without a key (exact, and prefixes); `/metrics` and `/load` unless metrics_auth.
OPEN_PATHS = frozenset({"/health", "/", "/favicon.ico", "/docs", "/openapi.json"})
OPEN_PREFIXES = ("/static/", "/docs/")
METRICS_PATHS = frozenset({"/metrics", "/load"})
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
# The environment variable of `tts serve`'s keys (comma-separated).
KEYS_ENV = "TTS_API_KEYS"


@dataclass
class Access:
    """Who may call the server (see the module's docstring).

    api_keys: the accepted bearer keys (empty: no key needed).
    metrics_auth: `/metrics` and `/load` need a key too (default: open, like `/health`).
    cors_origins: origins (`https://app.example`) whose pages may call the HTTP API, and whose
        state-changing requests are accepted; `*` allows any origin.
    allowed_hosts: `Host` names accepted besides loopback's when bound to loopback (`*`: any).
    tls_cert, tls_key: PEM files: serve gRPC and HTTP over TLS (both or neither)."""

    api_keys: tuple[str, ...] = ()
    metrics_auth: bool = False
    cors_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    tls_cert: str | None = None
    tls_key: str | None = None
    _encoded: tuple[bytes, ...] = field(default=(), init=False, repr=False)

    def __post_init__(self) -> None:
        self._encoded = tuple(k.encode() for k in self.api_keys)

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def key_ok(self, authorization: str | None) -> bool:
        """Whether an `Authorization` value (`Bearer KEY`) carries an accepted key; True when no keys are
        configured. Compares against every key in constant time."""
        if not self._encoded:
            return True
        if not authorization:
            return False
        scheme, _, presented = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            return False
        token = presented.strip().encode()
        found = False
        for key in self._encoded:  # (no early exit: the time does not depend on which key matched)
            found |= hmac.compare_digest(token, key)
        return found


def parse_keys(values: Iterable[str], env: str | None = None, files: Iterable[str] = ()) -> tuple[str, ...]:
    """The API keys of `--api-key` values, the environment's TTS_API_KEYS (comma-separated) and
    `--api-key-file` files (one key a line; blank lines and `#` comments skipped), in that order and
    without repeats. Raises ValueError for a key with whitespace or a file that cannot be read."""
    keys: list[str] = list(values)
    if env:
        keys += [k.strip() for k in env.split(",") if k.strip()]
    for name in files:
        try:
            text = Path(name).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--api-key-file {name}: {getattr(exc, 'strerror', None) or exc}") from exc
        keys += [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    for key in keys:
        if not key or any(c.isspace() for c in key) or not key.isprintable():
            raise ValueError("an API key must be printable, without spaces")
    return tuple(dict.fromkeys(keys))


def keys_from_env() -> str | None:
    return os.environ.get(KEYS_ENV)


def is_loopback(host: str) -> bool:
    """Whether a listen address reaches only this machine (`127.0.0.1`, `::1`, `localhost`)."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# gRPC: the interceptor is service.grpc_front.AuthInterceptor (this module imports no gRPC: the HTTP front
# runs without it).
UNAUTHENTICATED_MESSAGE = "missing or wrong API key: send the metadata 'authorization: Bearer KEY'"


# ---- HTTP (ASGI) ----


def _host_name(host_header: str) -> str:
    """The name part of a Host header (`[::1]:8000` -> `::1`, `Example.com:80` -> `example.com`)."""
    value = host_header.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _netloc(value: str, scheme: str) -> str:
    """host:port with the scheme's default port made explicit, for comparing an Origin with a Host."""
    parts = urlsplit(f"{scheme}://{value}")
    try:
        port = parts.port
    except ValueError:
        port = None
    port = port or (443 if scheme in ("https", "wss") else 80)
    return f"{(parts.hostname or '').lower()}:{port}"


class AccessMiddleware:
    """ASGI middleware applying an `Access` to every HTTP request and WebSocket handshake of an app:
    the Host check, the Origin check of state-changing requests, then the API key (see the module's
    docstring). Refusals are OpenAI-style JSON errors (`{"error": {"message", "type", "code"}}`)."""

    def __init__(self, app, access: Access, check_host: bool):
        self.app = app
        self.access = access
        self.check_host = check_host
        self.hosts = LOOPBACK_NAMES | {h.lower().strip("[]") for h in access.allowed_hosts}
        self.any_host = "*" in access.allowed_hosts
        self.origins = {o.rstrip("/").lower() for o in access.cors_origins}
        self.any_origin = "*" in access.cors_origins

    def _needs_key(self, path: str) -> bool:
        if path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
            return False
        return not (path in METRICS_PATHS and not self.access.metrics_auth)

    def refusal(self, scope) -> tuple[int, str, str] | None:
        """(status, message, code) of a request this middleware refuses, or None."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        host = headers.get("host")
        if self.check_host and host is not None and not self.any_host and _host_name(host) not in self.hosts:
            return (
                421,
                f"Host {host!r} is not a name of this server (a server on loopback answers only "
                "localhost, 127.0.0.1 and ::1; allow more with --allowed-host)",
                "host_not_allowed",
            )
        method = scope.get("method", "GET") if scope["type"] == "http" else "WEBSOCKET"
        origin = headers.get("origin")
        if method not in SAFE_METHODS and origin is not None and not self._origin_ok(origin, host, scope):
            return (
                403,
                f"cross-origin request from {origin} refused (allow that origin with --cors-origin)",
                "origin_not_allowed",
            )
        if method != "OPTIONS" and self._needs_key(scope.get("path", "")):
            if not self.access.key_ok(headers.get("authorization")):
                return (
                    401,
                    "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                    "unauthorized",
                )
        return None

    def _origin_ok(self, origin: str, host: str | None, scope) -> bool:
        origin = origin.rstrip("/").lower()
        if self.any_origin or origin in self.origins:
            return True
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or host is None:  # ("null": a sandboxed page, a file)
            return False
        return _netloc(origin.split("://", 1)[1], parts.scheme) == _netloc(host, parts.scheme)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        refused = self.refusal(scope)
        if refused is None:
            await self.app(scope, receive, send)
            return
        status, message, code = refused
        if scope["type"] == "websocket":  # (closing before accept: the server answers the handshake 403)
            await send({"type": "websocket.close", "code": 1008, "reason": message[:120]})
            return
        body = json.dumps(
            {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
        ).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b'Bearer realm="tts"'))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
