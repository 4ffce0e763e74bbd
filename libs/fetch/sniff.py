"""What media bytes are, from their first bytes (magic numbers), and whether they may stand as the
modality a request part names.

A URL's or a server's media type is a claim; the bytes are what a decoder will read. The rule the
door applies (docs/openai-door.md, "Media"): bytes recognised as another kind than the part's are
refused whatever the claim; a data URL (the client's own claim) must also claim the part's kind;
within a kind the bytes' type is what travels on. Bytes not recognised here pass on their claim:
the encoder's decoder has the last word and refuses what it cannot read.
"""

from __future__ import annotations

from dataclasses import dataclass

from libs.fetch.media import Fetched, MediaFetchError

KINDS = ("image", "video", "audio")
# A claim that says nothing about the kind: the bytes decide.
_NO_CLAIM = frozenset({"application/octet-stream", "binary/octet-stream"})


@dataclass(frozen=True)
class Sniffed:
    mime_type: str
    kinds: frozenset[str]  # the modalities these bytes may be (a container may hold video or audio)


def _riff(data: bytes, form: bytes) -> bool:
    return data[:4] == b"RIFF" and data[8:12] == form


def sniff(data: bytes) -> Sniffed | None:
    """The type of `data` by its signature, or None when none is recognised."""
    image, video, audio = frozenset({"image"}), frozenset({"video"}), frozenset({"audio"})
    either = frozenset({"video", "audio"})
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return Sniffed("image/png", image)
    if data.startswith(b"\xff\xd8\xff"):
        return Sniffed("image/jpeg", image)
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return Sniffed("image/gif", image)
    if _riff(data, b"WEBP"):
        return Sniffed("image/webp", image)
    if data.startswith(b"BM") and len(data) >= 26 and data[6:10] == b"\0\0\0\0":  # reserved bytes are zero
        return Sniffed("image/bmp", image)
    if data[:4] in (b"II*\0", b"MM\0*"):
        return Sniffed("image/tiff", image)
    if _riff(data, b"WAVE"):
        return Sniffed("audio/wav", audio)
    if _riff(data, b"AVI "):
        return Sniffed("video/x-msvideo", video)
    if data.startswith(b"fLaC"):
        return Sniffed("audio/flac", audio)
    if data.startswith(b"ID3"):
        return Sniffed("audio/mpeg", audio)
    if data[4:8] == b"ftyp":
        brand = data[8:12]
        if brand in (b"M4A ", b"M4B ", b"M4P "):
            return Sniffed("audio/mp4", audio)
        return Sniffed("video/quicktime" if brand == b"qt  " else "video/mp4", either)
    if data.startswith(b"\x1a\x45\xdf\xa3"):
        return Sniffed("video/webm" if b"webm" in data[:64] else "video/x-matroska", either)
    if data.startswith(b"OggS"):
        return Sniffed("audio/ogg", either)
    return None


def checked_media_type(kind: str, fetched: Fetched, *, claimed_by_client: bool) -> str:
    """The media type to send on for `fetched` standing as a `kind` item (image, video, audio), or
    MediaFetchError("invalid") naming the contradiction. `claimed_by_client`: its type is the
    client's own (a data URL), not a server's Content-Type (often generic or wrong for media)."""
    if kind not in KINDS:
        raise ValueError(f"unknown media kind {kind!r}")
    claimed = fetched.mime_type.split(";")[0].strip().lower()
    shown = claimed if len(claimed) <= 64 else claimed[:64] + "..."
    named = {"image": "an image", "video": "a video", "audio": "audio"}[kind]
    if claimed_by_client and claimed not in _NO_CLAIM and claimed.partition("/")[0] != kind:
        raise MediaFetchError("invalid", f"the data URL says {shown}: not {named}")
    found = sniff(fetched.data)
    if found is None:
        return fetched.mime_type
    if kind not in found.kinds:
        where = "the data URL says" if claimed_by_client else "the server said"
        raise MediaFetchError("invalid", f"the bytes are {found.mime_type}, not {named} ({where} {shown})")
    family, _, subtype = found.mime_type.partition("/")
    return found.mime_type if family == kind else f"{kind}/{subtype}"  # a container holding this kind
