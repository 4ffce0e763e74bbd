"""The media fetcher's rules that need no socket: the address policy, URL forms, data URLs, the
resolver's filtering (with a fake DNS) and the error's shape."""

from __future__ import annotations

import asyncio
import base64
import ipaddress

import pytest

from libs.fetch import FetchClient, FetchLimits, MediaFetchError, address_forbidden
from libs.fetch.media import _ForbiddenAddress, _GuardedResolver
from tests.support.media_server import FakeDns

pytestmark = pytest.mark.unit


def _fetch(url: str, limits: FetchLimits | None = None) -> MediaFetchError | bytes:
    async def run() -> MediaFetchError | bytes:
        client = FetchClient(limits or FetchLimits())
        fetcher = client.for_request()
        try:
            return (await fetcher.fetch(url)).data
        except MediaFetchError as exc:
            return exc
        finally:
            await fetcher.close()
            await client.close()

    return asyncio.run(run())


def _error(url: str, limits: FetchLimits | None = None) -> MediaFetchError:
    outcome = _fetch(url, limits)
    assert isinstance(outcome, MediaFetchError), f"{url} was fetched"
    return outcome


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "127.255.0.9",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "169.254.169.254",  # the cloud metadata address
        "100.64.0.1",  # shared address space (CGNAT)
        "0.0.0.0",
        "224.0.0.1",
        "233.252.0.1",  # globally scoped multicast: still refused
        "240.0.0.1",
        "255.255.255.255",
        "::1",
        "::",
        "fe80::1",
        "fe80::1%2",
        "fc00::1",
        "fd12:3456::1",
        "fec0::1",
        "ff02::1",
        "::ffff:127.0.0.1",
        "::ffff:10.0.0.1",
        "::ffff:169.254.169.254",
        "2002:7f00:1::",  # 6to4 of 127.0.0.1
        "2002:a00:1::",  # 6to4 of 10.0.0.1
        "::7f00:1",  # IPv4-compatible (deprecated) form
        "2001:db8::1",
    ],
)
def test_non_public_addresses_are_refused(address: str) -> None:
    assert address_forbidden(ipaddress.ip_address(address)) is not None


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "::ffff:8.8.8.8", "2002:808:808::"])
def test_public_addresses_are_allowed(address: str) -> None:
    assert address_forbidden(ipaddress.ip_address(address)) is None


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1/a.png",
        "http://10.0.0.7:8080/a.png",
        "http://169.254.169.254/latest/meta-data/",
        "http://[::1]/a.png",
        "http://[::ffff:127.0.0.1]/a.png",
        "https://[fd00::5]/a.png",
        "http://0.0.0.0/",
    ],
)
def test_ip_literals_are_refused_before_any_connect(url: str) -> None:
    error = _error(url)
    assert error.kind == "forbidden", error


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://example.com/a.png", "gopher://example.com/", "a.png", ""])
def test_other_schemes_are_invalid(url: str) -> None:
    error = _error(url)
    assert error.kind == "invalid"
    assert "scheme" in error.message


def test_credentials_in_the_url_are_refused() -> None:
    for url in ("http://user:secret@example.com/a.png", "http://user@example.com/a.png"):
        error = _error(url)
        assert error.kind == "invalid" and "credentials" in error.message


def test_allow_private_and_allow_networks_open_literals() -> None:
    assert _refusal_of("127.0.0.1", FetchLimits(allow_private=True)) is None
    narrow = FetchLimits(allow_networks=frozenset({"10.1.0.0/16"}))
    assert _refusal_of("10.1.2.3", narrow) is None
    assert _refusal_of("10.2.0.1", narrow) is not None


def _refusal_of(address: str, limits: FetchLimits) -> str | None:
    from libs.fetch.media import _refusal

    return _refusal(ipaddress.ip_address(address), limits)


PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256))


def test_a_data_url_decodes_with_its_media_type() -> None:
    url = "data:image/PNG;base64," + base64.b64encode(PNG).decode()

    async def run() -> tuple[bytes, str]:
        client = FetchClient()
        fetched = await client.for_request().fetch(url)
        await client.close()
        return fetched.data, fetched.mime_type

    assert asyncio.run(run()) == (PNG, "image/png")


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("data:image/png;base64,abc$def", "base64"),
        ("data:image/png;base64,abcde", "base64"),  # bad padding
        ("data:image/png,rawbytes", "base64"),
        ("data:;base64,AAAA", "media type"),
        ("data:image/png;base64", "','"),
    ],
)
def test_bad_data_urls_are_invalid(url: str, words: str) -> None:
    error = _error(url)
    assert error.kind == "invalid" and words in error.message, error


def test_a_data_url_over_the_limit_is_refused_before_decoding() -> None:
    limits = FetchLimits(max_bytes=30)
    exact = "data:audio/wav;base64," + base64.b64encode(b"x" * 30).decode()
    assert _fetch(exact, limits) == b"x" * 30
    over = "data:audio/wav;base64," + base64.b64encode(b"x" * 31).decode()
    assert _error(over, limits).kind == "too_large"
    # Not base64 at all, but longer than any payload under the limit: refused on length, not decoded.
    assert _error("data:audio/wav;base64," + "!" * 100, limits).kind == "too_large"


def test_data_urls_can_be_switched_off() -> None:
    error = _error("data:image/png;base64,AAAA", FetchLimits(allow_data_urls=False))
    assert error.kind == "invalid" and "data URLs" in error.message


def test_the_error_names_its_field_once_the_caller_sets_it() -> None:
    error = _error("ftp://example.com/a.png")
    assert error.field == ""
    error.field = "messages[0].content[1].image_url.url"
    assert str(error).startswith("messages[0].content[1].image_url.url: URL scheme 'ftp'")
    with pytest.raises(ValueError, match="kind"):
        MediaFetchError("nope", "x")  # type: ignore[arg-type]


def test_limits_refuse_nonsense() -> None:
    for bad in ({"max_bytes": 0}, {"timeout_s": 0}, {"max_redirects": -1}, {"max_urls": 0}):
        with pytest.raises(ValueError):
            FetchLimits(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="schemes"):
        FetchLimits(schemes=frozenset({"http", "file"}))
    with pytest.raises(ValueError, match="allow_networks"):
        FetchLimits(allow_networks=frozenset({"10.0.0.0/33"}))


def test_the_resolver_drops_non_public_answers_and_refuses_a_name_with_none_left() -> None:
    dns = FakeDns({"mixed.example": ["10.0.0.1", "93.184.216.34", "::1"], "inside.example": ["127.0.0.1", "::1"]})
    resolver = _GuardedResolver(FetchLimits(), dns)

    async def run() -> tuple[list[str], str]:
        kept = [r["host"] for r in await resolver.resolve("mixed.example", 80)]
        try:
            await resolver.resolve("inside.example", 80)
        except _ForbiddenAddress as exc:
            return kept, str(exc)
        raise AssertionError("inside.example resolved")

    kept, refusal = asyncio.run(run())
    assert kept == ["93.184.216.34"]  # aiohttp can never fall back to a refused address
    assert refusal == "inside.example resolves to 127.0.0.1, which is loopback"


def test_a_name_resolving_to_a_private_address_is_forbidden_at_connect() -> None:
    async def run() -> MediaFetchError:
        client = FetchClient(FetchLimits(), dns=FakeDns({"rebind.example": ["169.254.169.254"]}))
        try:
            await client.for_request().fetch("http://rebind.example/latest/meta-data/")
        except MediaFetchError as exc:
            return exc
        finally:
            await client.close()
        raise AssertionError("fetched")

    error = asyncio.run(run())
    assert error.kind == "forbidden"
    assert "169.254.169.254" in error.message


def test_a_request_fetches_a_bounded_number_of_urls() -> None:
    async def run() -> MediaFetchError:
        client = FetchClient(FetchLimits(max_urls=2))
        fetcher = client.for_request()
        png = base64.b64encode(PNG).decode()
        for i in range(2):
            await fetcher.fetch(f"data:image/png;base64,{png}" + "A" * (4 * i))
        try:
            await fetcher.fetch("data:image/png;base64,AAAA")
        except MediaFetchError as exc:
            return exc
        finally:
            await client.close()
        raise AssertionError("a third URL was fetched")

    error = asyncio.run(run())
    assert error.kind == "too_large" and "distinct media URLs" in error.message
