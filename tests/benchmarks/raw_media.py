"""The P4 baseline only (docs/results/experiments.md): prefill given the raw media besides the metadata.

A metadata-only prefill never sees pixels. To measure what that saves, the benchmark's stack runs
its router and prefill through this module (`StackSpec.run_through`), which wraps the unchanged
services from outside; no production module knows of it:

    python -m tests.benchmarks.raw_media --router services.router ARGS...
    python -m tests.benchmarks.raw_media --prefill services.prefill ARGS...

- `--router`: each `Prefill` the router sends carries every item's raw media as an extra `media`
  part after its `encoded` part, taken from the client's `Generate` request (what a router without
  metadata-only requests would re-serialise). Seams: the `GenerateService` servicer the router
  registers, and the `PrefillServiceStub` it builds its prefill calls on.
- `--prefill`: the servicer takes those parts out before the request is admitted and validated;
  prefill's fetch step (`libs.serving.generation.fetch_and_prefill`, given the compute thread and
  the runner) first decodes and preprocesses each item on the compute thread (a
  `prefill.raw_media` `preprocess` stage) to derive the layout, as a prefill without layout
  metadata would have to, checks it against the encoder's placeholder count, then serves the
  request as usual.
"""

from __future__ import annotations

import contextvars
import runpy
import sys
from collections.abc import AsyncIterator, Sequence
from typing import Any

from libs.contract.epd.v1 import (
    chat_pb2,
    generate_pb2,
    generate_pb2_grpc,
    media_pb2,
    prefill_pb2,
    prefill_pb2_grpc,
)
from libs.contract.errors import InvalidArgument

RawItems = list[tuple[media_pb2.MediaItem, int]]

# The client's request being served (router) / the raw items taken from the prefill request
# (prefill): per gRPC handler task.
_CLIENT_REQUEST: contextvars.ContextVar[generate_pb2.GenerateRequest | None] = contextvars.ContextVar(
    "raw_media_client_request", default=None
)
_RAW_ITEMS: contextvars.ContextVar[RawItems | None] = contextvars.ContextVar("raw_media_items", default=None)


# -- router side ---------------------------------------------------------------------------------


def with_raw_media(
    client: generate_pb2.GenerateRequest, request: prefill_pb2.PrefillRequest
) -> prefill_pb2.PrefillRequest:
    """A copy of `request` with each item's raw media (from the client's request) after its
    `encoded` part; `request` itself when its messages are not the client's, part for part."""
    if len(client.messages) != len(request.messages) or any(
        len(src.parts) != len(dst.parts) for src, dst in zip(client.messages, request.messages, strict=True)
    ):
        return request
    out = prefill_pb2.PrefillRequest()
    out.CopyFrom(request)
    for src, dst in zip(client.messages, out.messages, strict=True):
        rebuilt = chat_pb2.ChatMessage(role=dst.role)
        for original, part in zip(src.parts, dst.parts, strict=True):
            rebuilt.parts.add().CopyFrom(part)
            if original.WhichOneof("kind") == "media" and part.WhichOneof("kind") == "encoded":
                rebuilt.parts.add().media.CopyFrom(original.media)
        dst.CopyFrom(rebuilt)
    return out


class _RememberingGenerate(generate_pb2_grpc.GenerateServiceServicer):
    """The router's servicer, with the client's request remembered for the prefill call."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    async def Generate(self, request: generate_pb2.GenerateRequest, context: Any) -> AsyncIterator[Any]:
        _CLIENT_REQUEST.set(request)  # this handler's task: its prefill call runs in it
        async for response in self._inner.Generate(request, context):
            yield response


def _forwarding(stub_class: Any) -> Any:
    """`stub_class` whose `Prefill` calls carry the served client's raw media."""

    def stub(channel: Any) -> Any:
        made = stub_class(channel)
        prefill = made.Prefill

        def forwarding(request: prefill_pb2.PrefillRequest, *args: Any, **kwargs: Any) -> Any:
            client = _CLIENT_REQUEST.get()
            return prefill(request if client is None else with_raw_media(client, request), *args, **kwargs)

        made.Prefill = forwarding
        return made

    return stub


def forward_from_router() -> None:
    generated: Any = generate_pb2_grpc  # patched in place: the router looks both up at each use
    add = generated.add_GenerateServiceServicer_to_server
    generated.add_GenerateServiceServicer_to_server = lambda servicer, server: add(
        _RememberingGenerate(servicer), server
    )
    stubs: Any = prefill_pb2_grpc
    stubs.PrefillServiceStub = _forwarding(stubs.PrefillServiceStub)


# -- prefill side --------------------------------------------------------------------------------


def take_raw_media(messages: Sequence[chat_pb2.ChatMessage]) -> RawItems:
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


def derive_layouts(adapter: Any, items: RawItems) -> None:
    """Decode and preprocess each raw item with the model family's adapter (on the compute
    thread); an item whose layout disagrees with the encoder's is INVALID_ARGUMENT."""
    from libs.model.media.limits import MediaLimits
    from libs.serving import convert

    for index, (item, count) in enumerate(items):
        prepared = adapter.preprocess(convert.media_input(item, index, item.data), "", MediaLimits())
        if count >= 0 and prepared.layout.placeholder_token_count != count:
            raise InvalidArgument(
                f"raw media {index}", f"derives {prepared.layout.placeholder_token_count} tokens; encoder said {count}"
            )


class _TakingPrefill(prefill_pb2_grpc.PrefillServiceServicer):
    """Prefill's servicer, with the raw media taken out of each request before it is served."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: Any) -> Any:
        _RAW_ITEMS.set(take_raw_media(request.messages))  # this handler's task: its fetch runs in it
        return await self._inner.Prefill(request, context)


def take_at_prefill() -> None:
    import libs.serving.generation as generation
    from libs.telemetry.stages import stage

    generated: Any = prefill_pb2_grpc
    add = generated.add_PrefillServiceServicer_to_server
    generated.add_PrefillServiceServicer_to_server = lambda servicer, server: add(_TakingPrefill(servicer), server)
    # Patched before prefill's modules import it (the service runs after this, through runpy).
    fetching: Any = generation
    fetch = fetching.fetch_and_prefill

    async def preprocess_then_fetch(engine: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
        items = _RAW_ITEMS.get()
        if items:
            with stage("prefill.raw_media", "preprocess", items=len(items)):
                await engine.run(derive_layouts, runner.runtime.adapter, items)
        return await fetch(engine, runner, *args, **kwargs)

    fetching.fetch_and_prefill = preprocess_then_fetch


def main(argv: list[str]) -> None:
    side, module, *rest = argv[1:]
    if side == "--router":
        forward_from_router()
    elif side == "--prefill":
        take_at_prefill()
    else:
        raise SystemExit(f"usage: python -m tests.benchmarks.raw_media --router|--prefill MODULE ARGS...; not {side}")
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv)
