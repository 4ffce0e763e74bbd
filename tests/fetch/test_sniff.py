"""Media bytes against the kind a request part names and the type a URL claims
(`libs/fetch/sniff.py`): the bytes decide, a data URL's claim must name the part's kind, a
server's claim is not trusted."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from libs.fetch import Fetched, MediaFetchError, checked_media_type, sniff

pytestmark = pytest.mark.unit


def _image(fmt: str) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (4, 4)).save(out, fmt)
    return out.getvalue()


WAV = b"RIFF\x24\0\0\0WAVEfmt " + b"\0" * 24
MP4 = b"\0\0\0\x18ftypisom" + b"\0" * 16
M4A = b"\0\0\0\x18ftypM4A " + b"\0" * 16


@pytest.mark.parametrize(
    ("data", "mime", "kinds"),
    [
        (_image("PNG"), "image/png", {"image"}),
        (_image("JPEG"), "image/jpeg", {"image"}),
        (_image("GIF"), "image/gif", {"image"}),
        (_image("WEBP"), "image/webp", {"image"}),
        (_image("BMP"), "image/bmp", {"image"}),
        (_image("TIFF"), "image/tiff", {"image"}),
        (WAV, "audio/wav", {"audio"}),
        (b"fLaC\0\0\0\x22", "audio/flac", {"audio"}),
        (b"ID3\x04\0\0\0\0\0\0", "audio/mpeg", {"audio"}),
        (M4A, "audio/mp4", {"audio"}),
        (MP4, "video/mp4", {"video", "audio"}),
        (b"\x1a\x45\xdf\xa3\x9f\x42\x82\x84webm", "video/webm", {"video", "audio"}),
        (b"OggS\0\x02", "audio/ogg", {"video", "audio"}),
        (b"RIFF\0\0\0\0AVI LIST", "video/x-msvideo", {"video"}),
    ],
)
def test_signatures(data: bytes, mime: str, kinds: set[str]) -> None:
    found = sniff(data)
    assert found is not None and (found.mime_type, set(found.kinds)) == (mime, kinds)


@pytest.mark.parametrize("data", [b"", b"plain text", b"RIFF\0\0\0\0XXXX", b"BM" + b"\x01" * 30, b"\0" * 64])
def test_unknown_bytes_are_not_recognised(data: bytes) -> None:
    assert sniff(data) is None


def _check(kind: str, mime: str, data: bytes, client: bool = True) -> str | MediaFetchError:
    try:
        return checked_media_type(kind, Fetched(data, mime), claimed_by_client=client)
    except MediaFetchError as exc:
        return exc


@pytest.mark.parametrize(
    ("kind", "mime", "data", "client", "outcome"),
    [
        # The bytes decide within a kind; a generic claim is no claim.
        ("image", "image/png", _image("PNG"), True, "image/png"),
        ("image", "image/jpeg", _image("PNG"), True, "image/png"),
        ("image", "application/octet-stream", _image("PNG"), True, "image/png"),
        ("audio", "audio/mpeg", WAV, True, "audio/wav"),
        ("audio", "audio/mp4", MP4, True, "audio/mp4"),  # a container: the part says which
        ("video", "video/mp4", MP4, True, "video/mp4"),
        # Unrecognised bytes keep their claim: the encoder's decoder has the last word.
        ("image", "image/heic", b"\0\0\0\0heic?", True, "image/heic"),
        # A data URL's claim of another kind is refused, whatever the bytes.
        ("image", "text/plain", _image("PNG"), True, "text/plain: not an image"),
        ("image", "audio/wav", _image("PNG"), True, "audio/wav: not an image"),
        ("image", "text/plain", b"hello", True, "text/plain: not an image"),
        # Bytes of another kind are refused, whatever the claim.
        ("audio", "audio/wav", _image("PNG"), True, "the bytes are image/png, not audio"),
        ("video", "video/mp4", WAV, True, "the bytes are audio/wav, not a video"),
        ("image", "application/octet-stream", WAV, True, "the bytes are audio/wav, not an image"),
        # A server's Content-Type is not trusted either way.
        ("image", "text/plain", _image("PNG"), False, "image/png"),
        ("image", "application/octet-stream", b"??", False, "application/octet-stream"),
        ("image", "image/png", WAV, False, "the bytes are audio/wav, not an image (the server said image/png)"),
    ],
)
def test_kind_claim_and_bytes(kind: str, mime: str, data: bytes, client: bool, outcome: str) -> None:
    got = _check(kind, mime, data, client)
    if isinstance(got, MediaFetchError):
        assert got.kind == "invalid" and outcome in str(got), got
    else:
        assert got == outcome


def test_a_long_claim_is_quoted_short() -> None:
    got = _check("image", "text/" + "x" * 10_000, b"hello")
    assert isinstance(got, MediaFetchError) and len(str(got)) < 200
