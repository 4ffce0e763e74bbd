"""Bounded, SSRF-safe fetching of media URLs named in a request (docs/media-fetch.md).

`FetchClient` owns one `aiohttp.ClientSession` for the process; `FetchClient.for_request()` gives a
`MediaFetcher` that memoises per request. Failures are `MediaFetchError` with a `kind` the HTTP door
maps to a status; `checked_media_type` holds the bytes to the kind the request names."""

from libs.fetch.media import (
    FetchClient,
    Fetched,
    FetchLimits,
    MediaFetcher,
    MediaFetchError,
    address_forbidden,
)
from libs.fetch.sniff import Sniffed, checked_media_type, sniff

__all__ = [
    "FetchClient",
    "FetchLimits",
    "Fetched",
    "MediaFetchError",
    "MediaFetcher",
    "Sniffed",
    "address_forbidden",
    "checked_media_type",
    "sniff",
]
