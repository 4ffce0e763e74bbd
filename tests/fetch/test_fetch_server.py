"""The media fetcher against a real local HTTP server (aiohttp on 127.0.0.1): what is fetched, what
is refused (and that a refused fetch never reached the server), redirects, size and time limits,
and the per-request memo."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

from libs.fetch import FetchClient, Fetched, FetchLimits, MediaFetchError
from tests.support.media_server import BODY, FakeDns, MediaServer, media_server, silent_server

pytestmark = pytest.mark.integration

T = TypeVar("T")
OPEN = FetchLimits(allow_private=True)
# The test server is on loopback: open exactly 127.0.0.1, so every other private address stays shut.
ONLY_THE_SERVER = FetchLimits(allow_networks=frozenset({"127.0.0.1/32"}))


def _run(scenario: Callable[[MediaServer], Awaitable[T]]) -> T:
    async def run() -> T:
        async with media_server() as server:
            return await scenario(server)

    return asyncio.run(run())


async def _outcome(client: FetchClient, url: str) -> Fetched | MediaFetchError:
    fetcher = client.for_request()
    try:
        return await fetcher.fetch(url)
    except MediaFetchError as exc:
        return exc
    finally:
        await fetcher.close()


async def _once(limits: FetchLimits, url: str, dns: FakeDns | None = None) -> Fetched | MediaFetchError:
    client = FetchClient(limits, dns=dns)
    try:
        return await _outcome(client, url)
    finally:
        await client.close()


def _kind(outcome: Fetched | MediaFetchError) -> str:
    assert isinstance(outcome, MediaFetchError), "fetched"
    return outcome.kind


def test_a_private_server_is_fetched_when_allowed() -> None:
    async def scenario(server: MediaServer) -> Fetched | MediaFetchError:
        return await _once(OPEN, server.url("/media/a.png"))

    fetched = _run(scenario)
    assert fetched == Fetched(data=BODY, mime_type="image/png")


def test_loopback_is_refused_by_default_by_literal_and_by_name() -> None:
    async def scenario(server: MediaServer) -> list[Fetched | MediaFetchError]:
        outcomes = [
            await _once(FetchLimits(), server.url("/media/a.png")),
            await _once(FetchLimits(), server.url("/media/a.png", host="localhost")),
            await _once(FetchLimits(), server.url("/media/a.png", host="[::ffff:127.0.0.1]")),
        ]
        assert not server.hits, "a refused fetch reached the server"
        return outcomes

    literal, by_name, mapped = _run(scenario)
    assert _kind(literal) == _kind(by_name) == _kind(mapped) == "forbidden"
    assert isinstance(by_name, MediaFetchError) and "localhost resolves to" in by_name.message


def test_a_name_that_resolves_to_loopback_is_refused_where_it_connects() -> None:
    """The DNS answer chosen by an attacker: a public-looking name whose address is the server's."""

    async def scenario(server: MediaServer) -> Fetched | MediaFetchError:
        dns = FakeDns({"cdn.example": ["127.0.0.1"]})
        outcome = await _once(FetchLimits(), server.url("/media/a.png", host="cdn.example"), dns)
        assert dns.asked["cdn.example"] == 1 and not server.hits
        return outcome

    assert _kind(_run(scenario)) == "forbidden"


def test_a_redirect_to_a_private_address_is_refused() -> None:
    async def scenario(server: MediaServer) -> list[Fetched | MediaFetchError]:
        dns = FakeDns({"inside.example": ["10.0.0.7"]})
        targets = [
            "http://169.254.169.254/latest/meta-data/",
            "http://[::1]/a.png",
            f"http://127.0.0.2:{server.port}/media/a.png",  # loopback, but not the opened /32
            f"http://inside.example:{server.port}/media/a.png",  # a name: the resolver refuses the hop
        ]
        outcomes = [await _once(ONLY_THE_SERVER, server.url(f"/redirect?to={t}"), dns) for t in targets]
        assert server.hits["/redirect"] == len(targets) and not server.hits["/media/a.png"]
        return outcomes

    assert [_kind(o) for o in _run(scenario)] == ["forbidden"] * 4


def test_redirects_are_followed_up_to_the_limit() -> None:
    async def scenario(server: MediaServer) -> tuple[Fetched | MediaFetchError, Fetched | MediaFetchError]:
        limits = FetchLimits(allow_private=True, max_redirects=3)
        within = await _once(limits, server.url("/hop/2"))  # /hop/2, /hop/1, /hop/0 -> /media/hop: 3 redirects
        server.hits.clear()
        beyond = await _once(limits, server.url("/hop/3"))
        assert server.hits["/media/hop"] == 0 and sum(server.hits.values()) == 4  # the 4th hop is not taken
        return within, beyond

    within, beyond = _run(scenario)
    assert isinstance(within, Fetched) and within.data == BODY
    assert isinstance(beyond, MediaFetchError) and beyond.kind == "unreachable" and "redirects" in beyond.message


def test_no_redirects_when_the_limit_is_zero() -> None:
    async def scenario(server: MediaServer) -> Fetched | MediaFetchError:
        return await _once(FetchLimits(allow_private=True, max_redirects=0), server.url("/hop/0"))

    assert _kind(_run(scenario)) == "unreachable"


def test_a_body_over_the_limit_is_refused_on_its_content_length() -> None:
    async def scenario(server: MediaServer) -> list[Fetched | MediaFetchError]:
        limits = FetchLimits(allow_private=True, max_bytes=1000)
        return [await _once(limits, server.url("/sized/1000")), await _once(limits, server.url("/sized/1001"))]

    exact, over = _run(scenario)
    assert isinstance(exact, Fetched) and len(exact.data) == 1000
    assert isinstance(over, MediaFetchError) and over.kind == "too_large" and "Content-Length" in over.message


def test_a_chunked_body_without_a_length_is_cut_off_at_the_limit() -> None:
    async def scenario(server: MediaServer) -> tuple[Fetched | MediaFetchError, int]:
        outcome = await _once(FetchLimits(allow_private=True, max_bytes=256 * 1024), server.url("/endless"))
        await asyncio.wait_for(server.endless_ended.wait(), 10)  # the fetcher hung up: the server's write failed
        return outcome, server.endless_bytes

    outcome, sent = _run(scenario)
    assert isinstance(outcome, MediaFetchError) and outcome.kind == "too_large"
    assert "exceeds" in outcome.message
    assert sent < 64 * 1024 * 1024  # it stopped: the stream would never have ended by itself


def test_a_server_that_never_answers_times_out_on_the_limit() -> None:
    async def run() -> tuple[Fetched | MediaFetchError, bool, float]:
        async with silent_server() as (port, accepted):
            loop = asyncio.get_running_loop()
            start = loop.time()
            outcome = await _once(FetchLimits(allow_private=True, timeout_s=0.3), f"http://127.0.0.1:{port}/a.png")
            return outcome, accepted.is_set(), loop.time() - start

    outcome, accepted, elapsed = asyncio.run(run())
    assert accepted, "the fetch never connected"
    assert _kind(outcome) == "timeout"
    assert 0.3 <= elapsed < 5


def test_a_compressed_body_and_an_error_status_are_unreachable() -> None:
    async def scenario(server: MediaServer) -> list[Fetched | MediaFetchError]:
        return [await _once(OPEN, server.url("/gzip")), await _once(OPEN, server.url("/missing"))]

    compressed, missing = _run(scenario)
    assert isinstance(compressed, MediaFetchError) and "Content-Encoding" in compressed.message
    assert isinstance(missing, MediaFetchError) and missing.kind == "unreachable" and "404" in missing.message


def test_nothing_listening_is_unreachable() -> None:
    with socket.socket() as probe:  # a port just freed: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    outcome = asyncio.run(_once(OPEN, f"http://127.0.0.1:{port}/a.png"))
    assert _kind(outcome) == "unreachable"


def test_one_request_fetches_a_url_once_and_another_request_fetches_it_again() -> None:
    async def scenario(server: MediaServer) -> list[int]:
        client = FetchClient(OPEN)
        try:
            url = server.url("/media/memo.png")
            first = client.for_request()
            together = await asyncio.gather(first.fetch(url), first.fetch(url))  # concurrent: one flight
            again = await first.fetch(url)
            assert together[0] is together[1] is again
            after_one = server.hits["/media/memo.png"]
            await first.close()
            second = client.for_request()
            await second.fetch(url)
            await second.close()
            return [after_one, server.hits["/media/memo.png"]]
        finally:
            await client.close()

    assert _run(scenario) == [1, 2]


def test_a_cancelled_asker_does_not_cancel_the_shared_fetch() -> None:
    async def run() -> tuple[Fetched, bool]:
        async with media_server() as server:
            client = FetchClient(OPEN)
            fetcher = client.for_request()
            url = server.url("/media/shared.png")
            leaver = asyncio.ensure_future(fetcher.fetch(url))
            stayer = asyncio.ensure_future(fetcher.fetch(url))
            await asyncio.sleep(0)  # one loop turn, not a wait: both tasks run up to the shared flight
            leaver.cancel()
            fetched = await stayer
            await fetcher.close()
            await client.close()
            return fetched, leaver.cancelled()

    fetched, cancelled = asyncio.run(run())
    assert fetched.data == BODY and cancelled
