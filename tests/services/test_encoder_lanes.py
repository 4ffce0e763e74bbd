"""A CACHED_ONLY hit never waits behind compute: with an encoder's compute lane full (one large
image encoding on its engine thread, two more waiting for the one running slot), a cache-only job
for an item it holds is answered before the running encode has finished. The running encode holds
the engine thread until the test has its answer (tests/support/gated.py), on any host."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from libs.contract.epd.v1 import (
    encoder_pb2,
    encoder_pb2_grpc,
    lease_pb2,
    lease_pb2_grpc,
    media_pb2,
    stats_pb2,
    stats_pb2_grpc,
    tensor_pb2,
)
from libs.launch.process import ServiceProcess
from libs.model.media import synthetic
from libs.rpc.server import channel_options

pytestmark = pytest.mark.integration


def _job(request_id: str, image: media_pb2.MediaItem, policy: int) -> encoder_pb2.EncodeRequest:
    return encoder_pb2.EncodeRequest(
        request_id=request_id,
        items=[encoder_pb2.EncodeItem(item_index=0, media=image)],
        accepted_transports=[tensor_pb2.TRANSPORT_KIND_NIXL],
        cache_policy=policy,  # type: ignore[arg-type]
    )


def _large(seed: int) -> media_pb2.MediaItem:
    """An image the tower takes a while over: ~2 Mpx kept (not the checkpoint's small default)."""
    image = media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=synthetic.png_bytes(1400, 1400, seed=seed))
    image.processor_options.max_pixels = 2 << 20
    image.processor_options.min_pixels = 1 << 20
    return image


HELD = "large-"  # encode jobs that take the engine thread and keep it until the gate exists


@pytest.mark.slow  # an encoder of its own, and ~4 s of tower work
@pytest.mark.timeout(240)
def test_a_cached_only_hit_never_waits_behind_compute(model_path: Path, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    encoder = ServiceProcess(
        "encoder",
        "tests.support.gated",
        [
            *("--encodes", HELD, str(gate), "services.encoder"),
            *("--model", str(model_path), "--max-running", "1", "--pool-mib", "64"),
        ],
        log_path=tmp_path / "encoder.log",
    )
    encoder.start()
    try:
        encoder.wait_ready(120)
        first, cached, large, still_running = asyncio.run(_scenario(encoder.address, gate))
    finally:
        assert encoder.stop() == 0
    assert still_running == [True, True, True]  # answered while the first large encode was running
    assert cached.layout == first.layout  # the item computed at the start, from the cache
    assert cached.embeddings.lease_id != first.embeddings.lease_id  # in a slot of its own
    assert all(item.layout.placeholder_token_count > 1000 for item in large)


async def _scenario(
    address: str,
    gate: Path,
) -> tuple[object, object, list[object], list[bool]]:
    small = media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, data=synthetic.png_bytes(64, 48, seed=5))
    async with grpc.aio.insecure_channel(address, options=channel_options()) as channel:
        stub = encoder_pb2_grpc.EncoderServiceStub(channel)
        stats = stats_pb2_grpc.StatsServiceStub(channel)
        compute, cached_only = encoder_pb2.CACHE_POLICY_UNSPECIFIED, encoder_pb2.CACHE_POLICY_CACHED_ONLY
        (first,) = (await stub.Encode(_job("small", small, compute), timeout=60)).items  # now cached
        large = [
            asyncio.ensure_future(stub.Encode(_job(f"{HELD}{i}", _large(i), compute), timeout=120)) for i in range(3)
        ]
        for _ in range(6000):  # one running on the tower, two waiting for its slot (bounded: 60 s)
            if (await stats.GetStats(stats_pb2.GetStatsRequest(), timeout=10)).requests_in_flight == 3:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the large encodes never filled the compute lane")
        (cached,) = (await stub.Encode(_job("cached", small, cached_only), timeout=60)).items
        still_running = [not job.done() for job in large]
        gate.touch()  # the running encode goes on to the tower
        large_items = [(await job).items[0] for job in large]
        leases = [item.embeddings.lease_id for item in (first, cached, *large_items)]
        released = await lease_pb2_grpc.LeaseServiceStub(channel).ReleaseLeases(
            lease_pb2.ReleaseLeasesRequest(lease_ids=leases, reason=lease_pb2.RELEASE_REASON_ABANDONED), timeout=10
        )
        assert released.released_count == len(leases)
    return first, cached, large_items, still_running
