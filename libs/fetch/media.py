"""Media URL fetching under limits: size, total time, redirects, schemes and addresses.

The address rule is enforced where the socket is opened: `_GuardedResolver` is the connector's
resolver, so the address checked is the address aiohttp connects to (a name that resolves to a
public address at check time and to 127.0.0.1 at connect time cannot slip past: there is no second
lookup). aiohttp never calls a resolver for an IP literal, so literals are checked on the URL.
Redirects are followed by hand, each hop's URL checked again and each hop's connection going
through the same resolver."""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import socket
from dataclasses import dataclass, field
from typing import Literal

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from yarl import URL

MiB = 1024 * 1024
Kind = Literal["invalid", "too_large", "forbidden", "unreachable", "timeout"]
KINDS: frozenset[str] = frozenset({"invalid", "too_large", "forbidden", "unreachable", "timeout"})
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_CHUNK = 64 * 1024
_DEFAULT_MIME = "application/octet-stream"


@dataclass(frozen=True)
class FetchLimits:
    """What one fetch may cost. `max_bytes` bounds a body and a decoded data URL alike;
    `timeout_s` bounds the whole fetch (every redirect hop, connect and body together)."""

    max_bytes: int = 20 * MiB
    timeout_s: float = 10.0
    max_redirects: int = 3
    schemes: frozenset[str] = frozenset({"http", "https"})
    allow_private: bool = False
    allow_data_urls: bool = True
    # CIDR networks fetched from even though private (say, an in-cluster media store); each is a
    # hole in the SSRF rule, so name the narrowest one that serves.
    allow_networks: frozenset[str] = frozenset()
    # Distinct URLs one request may fetch: with max_bytes, bounds the memory one request pins.
    max_urls: int = 64

    def __post_init__(self) -> None:
        if self.max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {self.max_bytes}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.max_redirects < 0:
            raise ValueError(f"max_redirects must be >= 0, got {self.max_redirects}")
        if self.max_urls <= 0:
            raise ValueError(f"max_urls must be positive, got {self.max_urls}")
        for network in self.allow_networks:
            try:
                ipaddress.ip_network(network)
            except ValueError as exc:
                raise ValueError(f"allow_networks: {network!r} is not a CIDR network: {exc}") from exc
        unknown = set(self.schemes) - {"http", "https"}
        if unknown:  # data: has its own switch; anything else has no fetcher here
            raise ValueError(f"schemes may hold only http and https, got {sorted(unknown)}")


class MediaFetchError(Exception):
    """A media URL that could not be used. `kind` is one of KINDS (docs/media-fetch.md maps each to
    an HTTP status); `field` names the request field holding the URL, set by the caller (empty
    until then)."""

    def __init__(self, kind: Kind, message: str, field: str = "") -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown MediaFetchError kind {kind!r}")
        super().__init__(message)
        self.kind: Kind = kind
        self.message = message
        self.field = field

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


@dataclass(frozen=True)
class Fetched:
    data: bytes
    mime_type: str


class _ForbiddenAddress(OSError):
    """Raised by the resolver; an OSError so that aiohttp wraps it (ClientConnectorDNSError) and
    keeps it as `os_error`, where `_classify` finds it."""


IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def address_forbidden(address: IPAddress) -> str | None:
    """Why `address` may not be fetched from without allow_private, or None if it may.

    Refused: anything not globally routable (loopback, private, link-local, unique-local, shared
    100.64/10, documentation, unspecified), multicast, reserved, IPv6 site-local, and IPv6 forms that
    embed an IPv4 address (mapped, 6to4, Teredo) judged by the address they embed."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is not None:
            reason = address_forbidden(embedded)
            return f"embeds {embedded}, which {reason}" if reason else None
        if address.teredo is not None:
            for inner in address.teredo:
                reason = address_forbidden(inner)
                if reason:
                    return f"embeds {inner}, which {reason}"
        if address.is_site_local:
            return "is site-local"
    for name in ("loopback", "link_local", "private", "unspecified", "multicast", "reserved"):
        if getattr(address, f"is_{name}"):
            return f"is {name.replace('_', '-')}"
    if not address.is_global:
        return "is not globally routable"
    return None


def _refusal(address: IPAddress, limits: FetchLimits) -> str | None:
    """Why the limits refuse `address`, or None."""
    if limits.allow_private:
        return None
    reason = address_forbidden(address)
    if reason and any(address in ipaddress.ip_network(net) for net in limits.allow_networks):
        return None
    return reason


class _GuardedResolver(AbstractResolver):
    """The connector's resolver: resolves, then keeps only the addresses the policy allows."""

    def __init__(self, limits: FetchLimits, dns: AbstractResolver | None) -> None:
        self._inner = dns or aiohttp.ThreadedResolver()
        self._limits = limits

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        if self._limits.allow_private or not results:  # no answer at all: aiohttp reports it
            return results
        allowed: list[ResolveResult] = []
        refused: list[tuple[str, str]] = []
        for result in results:
            reason = _refusal(ipaddress.ip_address(result["host"]), self._limits)
            if reason:
                refused.append((result["host"], reason))
            else:
                allowed.append(result)
        if not allowed:
            address, reason = refused[0]
            raise _ForbiddenAddress(f"{host} resolves to {address}, which {reason}")
        # Dropping the refused ones means aiohttp can never fall back to them on a failed connect.
        return allowed

    async def close(self) -> None:
        await self._inner.close()


def _check_url(raw: str, limits: FetchLimits) -> URL:
    """The URL, parsed, if its form is acceptable; the address rule for names is the resolver's."""
    try:
        url = URL(raw)
    except (ValueError, TypeError) as exc:
        raise MediaFetchError("invalid", f"not a URL: {exc}") from exc
    scheme = url.scheme.lower()
    if scheme not in limits.schemes:
        allowed = ", ".join(sorted(limits.schemes | ({"data"} if limits.allow_data_urls else set())))
        raise MediaFetchError("invalid", f"URL scheme {scheme or '(none)'!r} is not allowed (allowed: {allowed})")
    if not url.host:
        raise MediaFetchError("invalid", "URL has no host")
    if url.raw_user is not None or url.raw_password is not None:
        raise MediaFetchError("invalid", "URL carries credentials (user info); they are not allowed")
    try:
        literal: IPAddress | None = ipaddress.ip_address(url.host)
    except ValueError:
        literal = None  # a name: the resolver checks what it resolves to
    if literal is not None:
        reason = _refusal(literal, limits)
        if reason:
            raise MediaFetchError("forbidden", f"address {literal} {reason}")
    return url


def decode_data_url(raw: str, max_bytes: int) -> Fetched:
    """`data:<mime>;base64,<payload>`, decoded under `max_bytes` (the encoded length is checked first,
    so an oversized payload is never decoded)."""
    header, comma, payload = raw[len("data:") :].partition(",")
    if not comma:
        raise MediaFetchError("invalid", "data URL has no ',' before its payload")
    params = header.split(";")
    mime_type = params[0].strip().lower()
    if "base64" not in (p.strip().lower() for p in params[1:]):
        raise MediaFetchError("invalid", "data URL must be base64 (data:<mime>;base64,...)")
    if "/" not in mime_type:
        raise MediaFetchError("invalid", f"data URL needs a media type such as image/png, got {mime_type!r}")
    if len(payload) > 4 * ((max_bytes + 2) // 3):
        raise MediaFetchError("too_large", f"data URL payload decodes to more than the limit of {max_bytes} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaFetchError("invalid", f"data URL payload is not valid base64: {exc}") from exc
    if len(data) > max_bytes:
        raise MediaFetchError("too_large", f"data URL payload is {len(data)} bytes, over the limit of {max_bytes}")
    return Fetched(data=data, mime_type=mime_type)


def _classify(exc: BaseException) -> MediaFetchError:
    if isinstance(exc, aiohttp.ClientConnectorError) and isinstance(exc.os_error, _ForbiddenAddress):
        return MediaFetchError("forbidden", str(exc.os_error))
    if isinstance(exc, aiohttp.InvalidURL):
        return MediaFetchError("invalid", f"not a fetchable URL: {exc}")
    if isinstance(exc, aiohttp.ServerTimeoutError | TimeoutError):
        return MediaFetchError("timeout", "fetch timed out")
    return MediaFetchError("unreachable", f"fetch failed: {type(exc).__name__}: {exc}")


class FetchClient:
    """One per process: owns the `aiohttp.ClientSession` (made on first use, inside the loop) and
    hands out one `MediaFetcher` per request. `dns` replaces the name lookup (default: the
    system's, in a thread); its answers are checked all the same."""

    def __init__(self, limits: FetchLimits | None = None, dns: AbstractResolver | None = None) -> None:
        self.limits = limits or FetchLimits()
        self._dns = dns
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    def for_request(self) -> MediaFetcher:
        if self._closed:
            raise RuntimeError("FetchClient is closed")
        return MediaFetcher(self)

    def session(self) -> aiohttp.ClientSession:
        if self._closed:
            raise RuntimeError("FetchClient is closed")
        if self._session is None:
            connector = aiohttp.TCPConnector(
                resolver=_GuardedResolver(self.limits, self._dns),
                limit=100,  # sockets open at once across every request
                ttl_dns_cache=10,  # caches the resolver's already-filtered answers
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                trust_env=False,  # no HTTP(S)_PROXY / netrc: a proxy would connect where we did not check
                auto_decompress=False,  # we ask for identity; a compressed body could expand past max_bytes
                timeout=aiohttp.ClientTimeout(total=self.limits.timeout_s),
                headers={"User-Agent": "epd-media-fetch/1", "Accept-Encoding": "identity"},
            )
        return self._session

    async def close(self) -> None:
        self._closed = True
        if self._session is not None:
            await self._session.close()
            self._session = None


@dataclass
class MediaFetcher:
    """One request's fetches: each distinct URL is fetched once; concurrent asks for one URL share
    its fetch (a failure is shared too: the same URL fails the same way within a request)."""

    client: FetchClient
    _flights: dict[str, asyncio.Task[Fetched]] = field(default_factory=dict)

    async def fetch(self, url: str) -> Fetched:
        task = self._flights.get(url)
        if task is None:
            if len(self._flights) >= self.client.limits.max_urls:
                raise MediaFetchError(
                    "too_large", f"request names more than {self.client.limits.max_urls} distinct media URLs"
                )
            task = asyncio.ensure_future(self._fetch(url))
            self._flights[url] = task
        # shield: one caller cancelled (a client gone) must not cancel the fetch others wait on.
        return await asyncio.shield(task)

    async def close(self) -> None:
        """Cancels fetches still running and drops what was fetched."""
        tasks = list(self._flights.values())
        self._flights.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _fetch(self, raw: str) -> Fetched:
        limits = self.client.limits
        if raw[:5].lower() == "data:":
            if not limits.allow_data_urls:
                raise MediaFetchError("invalid", "data URLs are not allowed")
            return decode_data_url(raw, limits.max_bytes)
        url = _check_url(raw, limits)
        try:
            async with asyncio.timeout(limits.timeout_s):
                return await self._follow(url)
        except MediaFetchError:
            raise
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise _classify(exc) from exc

    async def _follow(self, url: URL) -> Fetched:
        limits = self.client.limits
        session = self.client.session()
        for _hop in range(limits.max_redirects + 1):
            async with session.get(url, allow_redirects=False) as response:
                if response.status in _REDIRECTS:
                    location = response.headers.get("Location")
                    if not location:
                        raise MediaFetchError("unreachable", f"redirect {response.status} without a Location")
                    url = _check_url(str(url.join(URL(location))), limits)
                    continue
                if response.status != 200:
                    raise MediaFetchError("unreachable", f"server answered HTTP {response.status} for {url}")
                return await _read_body(response, limits.max_bytes)
        raise MediaFetchError("unreachable", f"more than {limits.max_redirects} redirects")


async def _read_body(response: aiohttp.ClientResponse, max_bytes: int) -> Fetched:
    encoding = response.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise MediaFetchError("unreachable", f"server sent Content-Encoding {encoding!r} though asked for identity")
    if response.content_length is not None and response.content_length > max_bytes:
        raise MediaFetchError(
            "too_large", f"body is {response.content_length} bytes (Content-Length), over the limit of {max_bytes}"
        )
    body = bytearray()
    async for chunk in response.content.iter_chunked(_CHUNK):
        body += chunk
        if len(body) > max_bytes:  # chunked or lying Content-Length: stop reading at once
            raise MediaFetchError("too_large", f"body exceeds the limit of {max_bytes} bytes")
    mime_type = (response.content_type or _DEFAULT_MIME).lower()
    return Fetched(data=bytes(body), mime_type=mime_type)
