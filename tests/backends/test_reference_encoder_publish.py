"""Where the reference encoder copies an item's embeddings into its registered pool: small items on
the event loop (a hop to the transfer threads costs more than the copy), larger ones on the
transfer threads. Real backend in-process: the tiny Qwen2.5-VL tower, a real NIXL agent and pool;
the transfer threads are held busy by the test, so which path an item took shows in whether its
Encode call finishes while they are held."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

import pytest

from libs.backends.reference import encoder as reference_encoder
from libs.backends.reference.encoder import ReferenceEncoder, start
from libs.backends.settings import EncoderBackendSettings
from libs.contract.epd.v1 import encoder_pb2, media_pb2, tensor_pb2
from libs.model.checkpoints.generate import ensure_checkpoint
from libs.model.media import synthetic

pytestmark = pytest.mark.integration


def _with_backend(body: Callable[[ReferenceEncoder], Awaitable[None]]) -> None:
    async def run() -> None:
        model = ensure_checkpoint("qwen2_5_vl", "tiny")
        encoder = await start(EncoderBackendSettings(model=model, cache_mib=0, pool_mib=16))
        encoder.serving_at("127.0.0.1:1")  # the address handles name; nobody reads them here
        try:
            await body(encoder)
        finally:
            await encoder.close()

    asyncio.run(run())


def _request(request_id: str, seed: int) -> encoder_pb2.EncodeRequest:
    image = media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=synthetic.png_bytes(64, 48, seed=seed))
    return encoder_pb2.EncodeRequest(
        request_id=request_id,
        items=[encoder_pb2.EncodeItem(item_index=0, media=image)],
        accepted_transports=[tensor_pb2.TRANSPORT_KIND_NIXL],
    )


async def _hold_transfer_threads(encoder: ReferenceEncoder, gate: threading.Event) -> list[asyncio.Future[bool]]:
    """Every transfer thread busy until `gate` is set; returns once each runs its holding job."""
    loop = asyncio.get_running_loop()
    running = threading.Semaphore(0)

    def hold() -> bool:
        running.release()
        return gate.wait()

    executor = encoder.transport._executor
    held = [loop.run_in_executor(executor, hold) for _ in range(executor._max_workers)]
    for _ in held:
        assert await asyncio.to_thread(running.acquire, True, 60), "a transfer thread never took its job"
    return held


async def _queued_on_transfer_threads(encoder: ReferenceEncoder) -> None:
    """Until a job waits for the (held) transfer threads; bounded by the caller's timeout."""
    while encoder.transport._executor._work_queue.qsize() == 0:
        await asyncio.sleep(0.005)


def _held_leases(encoder: ReferenceEncoder) -> int:
    assert encoder.transport.producer is not None
    return encoder.transport.producer.lease_stats().active


def test_a_small_item_is_published_without_the_transfer_threads() -> None:
    _with_backend(_small_item_on_the_loop)


def test_a_larger_item_is_published_on_the_transfer_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reference_encoder, "LOOP_PUT_BYTES", 0)  # every item counts as large
    _with_backend(_large_item_on_the_threads)


async def _small_item_on_the_loop(backend: ReferenceEncoder) -> None:
    gate = threading.Event()
    held = await _hold_transfer_threads(backend, gate)
    try:
        response = await asyncio.wait_for(backend.encode(_request("small", seed=1), None), timeout=60)
        (item,) = response.items
        assert item.embeddings.transport == tensor_pb2.TRANSPORT_KIND_NIXL
        assert item.embeddings.tensors[0].spec.nbytes <= reference_encoder.LOOP_PUT_BYTES
        assert _held_leases(backend) == 1  # in the pool, leased until a consumer reads it
    finally:
        gate.set()
        await asyncio.gather(*held)
    backend.transport.producer.release([item.embeddings.lease_id])  # type: ignore[union-attr]
    assert _held_leases(backend) == 0


async def _large_item_on_the_threads(backend: ReferenceEncoder) -> None:
    gate = threading.Event()
    held = await _hold_transfer_threads(backend, gate)
    call = asyncio.ensure_future(backend.encode(_request("large", seed=2), None))
    try:
        await asyncio.wait_for(_queued_on_transfer_threads(backend), timeout=60)
        assert not call.done()  # its copy waits for a transfer thread
        assert _held_leases(backend) == 0
    finally:
        gate.set()
        await asyncio.gather(*held)
    (item,) = (await call).items
    assert item.embeddings.transport == tensor_pb2.TRANSPORT_KIND_NIXL
    assert _held_leases(backend) == 1
    backend.transport.producer.release([item.embeddings.lease_id])  # type: ignore[union-attr]
