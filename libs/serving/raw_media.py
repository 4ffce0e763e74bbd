"""The P4 baseline only (docs/results/benchmarks.md): prefill given the raw media besides the metadata.

A metadata-only prefill never sees pixels. To measure what that saves, the router can forward each
item's raw media as an extra `media` part after its `encoded` part (`--forward-media`), and a
prefill started with `--accept-raw-media` takes those parts out, decodes and preprocesses each on
its engine thread to derive the layout (what a prefill without layout metadata would have to do),
checks it against the encoder's, and then serves the request as usual. Off by default; nothing
else uses it.
"""

from __future__ import annotations

from collections.abc import Sequence

from libs.contract.epd.v1 import chat_pb2, media_pb2
from libs.contract.errors import InvalidArgument
from libs.runtime.families.base import FamilyAdapter
from libs.runtime.media.limits import MediaLimits
from libs.serving import convert
from libs.serving.compute_thread import ComputeThread
from libs.telemetry.stages import stage


def take_raw_media(messages: Sequence[chat_pb2.ChatMessage]) -> list[tuple[media_pb2.MediaItem, int]]:
    """Remove the raw `media` parts (in place); each with the placeholder count of the `encoded`
    part it follows (-1 when it follows none)."""
    taken = []
    for message in messages:
        raw = []
        for i, part in enumerate(message.parts):
            if part.WhichOneof("kind") != "media":
                continue
            before = message.parts[i - 1] if i > 0 else None
            encoded = before is not None and before.WhichOneof("kind") == "encoded"
            item = media_pb2.MediaItem()
            item.CopyFrom(part.media)
            taken.append((item, before.encoded.layout.placeholder_token_count if encoded and before else -1))
            raw.append(i)
        for i in reversed(raw):
            del message.parts[i]
    return taken


def _derive(adapter: FamilyAdapter, items: list[tuple[media_pb2.MediaItem, int]], limits: MediaLimits) -> None:
    for index, (item, count) in enumerate(items):
        media = convert.media_input(item, index, item.data)
        prepared = adapter.preprocess(media, "", limits)
        if count >= 0 and prepared.layout.placeholder_token_count != count:
            raise InvalidArgument(
                f"raw media {index}", f"derives {prepared.layout.placeholder_token_count} tokens; encoder said {count}"
            )


async def preprocess_raw_media(
    engine: ComputeThread, adapter: FamilyAdapter, items: list[tuple[media_pb2.MediaItem, int]]
) -> None:
    """Decode and preprocess the raw items on the engine thread (where a non-metadata path would)."""
    if items:
        with stage("prefill.raw_media", "preprocess", items=len(items)):
            await engine.run(_derive, adapter, items, MediaLimits())
