"""Who may call what: mutual TLS between services, bearer tokens from clients.

Two kinds of server:
- **internal** (encoder, prefill, decode, PD; their Lease, Stats and ServiceInfo services): with
  TLS configured they accept only peers whose certificate the cluster CA signed (the TLS handshake
  refuses anyone else, so an unauthenticated peer never sees a producer's NIXL agent metadata),
  and only service certificates: a client certificate signed by the same CA gets
  PERMISSION_DENIED naming the role and the API.
- **public** (router, colocated): TLS with a server certificate (client certificates optional), and
  with tokens configured every `Generate` carries `authorization: Bearer <token>`, compared in
  constant time against each known token; missing or unknown -> UNAUTHENTICATED.
Health checking and reflection stay open to whoever completed the TLS handshake.

A certificate's role is its subject common name, `epd-<role>` (`libs/rpc/certs.py` issues them).
The process's TLS material is configured once at start-up (`configure`); every channel the process
opens (`libs.rpc.server.open_channel`, `sync_channel`) then uses it.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import grpc

from libs.contract.grpc_status import end_call

CN_PREFIX = "epd-"
CLIENT_ROLE = "client"
SERVICE_ROLES = frozenset({"router", "encoder", "prefill", "decode", "pd", "colocated"})
# Open to anyone past the TLS handshake (probes, tooling).
OPEN_SERVICES = ("grpc.health.v1.Health/", "grpc.reflection.")
# Callable without a token on a public server: what peers and probes read at first contact.
TOKENLESS_SERVICES = (*OPEN_SERVICES, "epd.v1.ServiceInfoService/")
AUTHORIZATION = "authorization"


@dataclass(frozen=True)
class TlsMaterial:
    """PEM bytes: the cluster CA, this process's certificate chain and private key."""

    ca: bytes
    cert: bytes
    key: bytes

    @classmethod
    def load(cls, ca: Path, cert: Path, key: Path) -> TlsMaterial:
        return cls(ca.read_bytes(), cert.read_bytes(), key.read_bytes())

    @classmethod
    def from_settings(cls, ca: Path | None, cert: Path | None, key: Path | None) -> TlsMaterial | None:
        """None when TLS is off (no file given); all three files or none (ValueError)."""
        given = [p for p in (ca, cert, key) if p is not None and str(p)]
        if not given:
            return None
        if len(given) != 3:
            raise ValueError("TLS needs --tls-ca, --tls-cert and --tls-key together (or none of them)")
        assert ca is not None and cert is not None and key is not None
        return cls.load(ca, cert, key)


_material: TlsMaterial | None = None


def configure(material: TlsMaterial | None) -> None:
    """Set this process's TLS material (None: plaintext), before any channel or server exists."""
    global _material
    _material = material


def material() -> TlsMaterial | None:
    return _material


def server_credentials(tls: TlsMaterial, *, require_client_cert: bool) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials(
        [(tls.key, tls.cert)], root_certificates=tls.ca, require_client_auth=require_client_cert
    )


def channel_credentials(tls: TlsMaterial) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert)


def client_credentials(ca: bytes) -> grpc.ChannelCredentials:
    """What a client of a public server needs: the CA that signed the server's certificate."""
    return grpc.ssl_channel_credentials(root_certificates=ca)


def load_tokens(path: Path | None, inline: Iterable[str] = ()) -> frozenset[str]:
    """Tokens from a file (one per line; blank lines and `#` comments ignored) and from `inline`."""
    tokens = {t.strip() for t in inline if t.strip()}
    if path is not None and str(path):
        for line in path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                tokens.add(line)
    short = [t for t in tokens if len(t) < 16]
    if short:
        raise ValueError(f"{len(short)} auth token(s) shorter than 16 characters; use long random tokens")
    return frozenset(tokens)


def _peer_role(context: grpc.aio.ServicerContext[Any, Any]) -> str | None:
    """The role in the peer certificate's common name; None without a certificate."""
    names = list(context.auth_context().get("x509_common_name") or ())
    if not names:
        return None
    name = bytes(names[0]).decode(errors="replace")
    return name[len(CN_PREFIX) :] if name.startswith(CN_PREFIX) else name


def _bearer(context: grpc.aio.ServicerContext[Any, Any]) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == AUTHORIZATION:
            text = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = text.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def _known(token: str, tokens: frozenset[str]) -> bool:
    """Constant time in the token's content: every known token is compared, whatever matches."""
    found = False
    for known in tokens:
        found |= hmac.compare_digest(token.encode(), known.encode())
    return found


@dataclass(frozen=True)
class AccessPolicy:
    """What a server requires of its callers (see the module docstring)."""

    public: bool
    tls: bool
    tokens: frozenset[str] = frozenset()

    def refusal(self, context: grpc.aio.ServicerContext[Any, Any], method: str) -> tuple[grpc.StatusCode, str] | None:
        """Why the caller may not make this call (UNAUTHENTICATED / PERMISSION_DENIED), or None."""
        if method.startswith(OPEN_SERVICES, 1):
            return None
        if self.public:
            if self.tokens and not method.startswith(TOKENLESS_SERVICES, 1):
                token = _bearer(context)
                if token is None:
                    return (
                        grpc.StatusCode.UNAUTHENTICATED,
                        f"{method}: missing credentials; send metadata 'authorization: Bearer <token>'",
                    )
                if not _known(token, self.tokens):
                    return grpc.StatusCode.UNAUTHENTICATED, f"{method}: unknown bearer token"
            return None
        if self.tls:
            role = _peer_role(context)
            if role not in SERVICE_ROLES:
                return (
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"{method} is an internal API; certificate role {role or 'none'!r} may not call it "
                    f"(service roles: {', '.join(sorted(SERVICE_ROLES))})",
                )
        return None


def _guard_unary(
    policy: AccessPolicy, method: str, fn: Callable[[Any, Any], Awaitable[Any]]
) -> Callable[[Any, Any], Awaitable[Any]]:
    async def handler(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        refusal = policy.refusal(context, method)
        if refusal is not None:
            end_call(context, *refusal)
            return None
        return await fn(request, context)

    return handler


def _guard_stream(
    policy: AccessPolicy, method: str, fn: Callable[[Any, Any], AsyncIterator[Any]]
) -> Callable[[Any, Any], AsyncIterator[Any]]:
    async def handler(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        refusal = policy.refusal(context, method)
        if refusal is not None:
            end_call(context, *refusal)
            return
        async for response in fn(request, context):
            yield response

    return handler


class AccessInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]  # generic only in stubs
    """Applies an `AccessPolicy` to every unary-unary and unary-stream call (all of EPD's APIs);
    health and reflection (whose Watch / reflection streams are the only others) are open."""

    def __init__(self, policy: AccessPolicy) -> None:
        self._policy = policy

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(OPEN_SERVICES, 1):
            return handler
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _guard_unary(self._policy, method, cast(Any, handler.unary_unary)),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _guard_stream(self._policy, method, cast(Any, handler.unary_stream)),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        raise TypeError(f"{method}: client-streaming APIs are not guarded by AccessInterceptor")
