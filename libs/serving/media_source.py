"""The bytes of a media item: inline data, a `data:` URI, or (when enabled) a `file://` URI under
an allowed directory. Everything else is refused with INVALID_ARGUMENT; sizes stay bounded."""

from __future__ import annotations

import base64
import binascii
import urllib.parse
from pathlib import Path

from libs.contract.epd.v1 import encoder_pb2, media_pb2
from libs.contract.errors import InvalidArgument
from libs.model import types as eng
from libs.serving.convert import media_input


def media_bytes(item: media_pb2.MediaItem, field: str, *, max_bytes: int, file_root: Path | None = None) -> bytes:
    """Resolve `item`'s source to bytes (at most `max_bytes`)."""
    if item.WhichOneof("source") == "data":
        return item.data
    uri = item.uri
    scheme = urllib.parse.urlsplit(uri).scheme
    if scheme == "data":
        header, _, payload = uri.partition(",")
        if not header.endswith(";base64"):
            raise InvalidArgument(f"{field}.uri", "data: URIs must be base64-encoded")
        if len(payload) * 3 // 4 > max_bytes:
            raise InvalidArgument(f"{field}.uri", f"decoded data exceeds {max_bytes} bytes")
        try:
            return base64.b64decode(payload, validate=True)
        except binascii.Error:
            raise InvalidArgument(f"{field}.uri", "data: URI payload is not valid base64") from None
    if scheme == "file":
        if file_root is None:
            raise InvalidArgument(f"{field}.uri", "file:// URIs are not enabled on this server")
        path = Path(urllib.parse.unquote(urllib.parse.urlsplit(uri).path)).resolve()
        root = file_root.resolve()
        if not path.is_relative_to(root):
            raise InvalidArgument(f"{field}.uri", f"path is outside the allowed directory {root}")
        try:
            size = path.stat().st_size
            if size > max_bytes:
                raise InvalidArgument(f"{field}.uri", f"file is {size} bytes; the limit is {max_bytes}")
            return path.read_bytes()
        except OSError as exc:
            raise InvalidArgument(f"{field}.uri", f"cannot read file: {exc.strerror}") from None
    raise InvalidArgument(f"{field}.uri", f"unsupported URI scheme {scheme!r} (use data: or file://)")


def job_media(
    request: encoder_pb2.EncodeRequest, *, max_bytes: int, file_root: Path | None = None
) -> list[eng.MediaInput]:
    """An Encode job's items as the engine's media inputs, each source resolved to bytes (a bad one
    refused naming `items[i].media`)."""
    return [
        media_input(
            item.media,
            item.item_index,
            media_bytes(item.media, f"items[{i}].media", max_bytes=max_bytes, file_root=file_root),
        )
        for i, item in enumerate(request.items)
    ]
