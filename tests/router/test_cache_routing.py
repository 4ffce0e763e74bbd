"""Cache-aware routing without sockets: which encoder an item goes to (affinity, load-bounded
rendezvous hashing) and the store short-circuit (CACHED_ONLY jobs after a store hit, falling back
to compute when the entry is gone). Live services: tests/services/test_encoder_cache.py."""

from __future__ import annotations

import asyncio

import pytest

from libs.cache.keys import wire_content_hash
from libs.contract.epd.v1 import encoder_pb2, media_pb2, service_info_pb2
from services.router.cache_lookup import CacheLookup, item_hash
from services.router.encoders import EncoderPool
from tests.support.cache import FakeStore
from tests.support.router_harness import Harness, distinct_image, image_request

pytestmark = pytest.mark.unit

PREFIX = "epd/enc/v1/" + "5e" * 16
CACHE_INFO = service_info_pb2.EncoderCacheInfo(key_prefix=PREFIX, shared_store=True)


def _key(seed: int) -> str:
    item = distinct_image(seed)
    return wire_content_hash(item, item.data)


def _policies(h: Harness) -> list[str]:
    return [
        encoder_pb2.CachePolicy.Name(r.cache_policy).removeprefix("CACHE_POLICY_")
        for e in h.encoders.values()
        for r in e.requests
    ]


# -- EncoderPool -------------------------------------------------------------------------------------


def test_an_item_follows_the_encoder_that_holds_it() -> None:
    pool = EncoderPool(["a", "b", "c"])
    pool.remember("k1", "c")
    pool.outstanding.update(a=0, b=0, c=9)  # affinity wins over load: joining costs less than computing
    assert pool.pick(key="k1") == "c"
    assert pool.pick(exclude={"c"}, key="k1") in {"a", "b"}  # unless that encoder failed this item


def test_routers_sharing_encoders_pick_the_same_one_for_a_new_item() -> None:
    routers = [EncoderPool(["a", "b", "c", "d"]), EncoderPool(["d", "c", "b", "a"])]
    picks = {key: {r.pick(key=key) for r in routers} for key in (f"item-{i}" for i in range(64))}
    assert all(len(chosen) == 1 for chosen in picks.values())
    assert {next(iter(c)) for c in picks.values()} == {"a", "b", "c", "d"}  # and spread over all


def test_hash_preference_is_bounded_by_load() -> None:
    pool = EncoderPool(["a", "b"], slack=2)
    key = next(k for k in (f"item-{i}" for i in range(100)) if pool.pick(key=k) == "a")
    pool.outstanding.update(a=2, b=0)
    assert pool.pick(key=key) == "a"  # within the slack
    pool.outstanding.update(a=3, b=0)
    assert pool.pick(key=key) == "b"  # beyond it


def test_items_without_a_hash_go_to_the_least_loaded_round_robin() -> None:
    pool = EncoderPool(["a", "b"])
    assert [pool.pick() for _ in range(4)] == ["a", "b", "a", "b"]
    pool.outstanding["a"] = 1
    assert pool.pick() == "b"


def test_affinity_is_bounded() -> None:
    pool = EncoderPool(["a"], affinity_entries=2)
    for key in ("k1", "k2", "k3"):
        pool.remember(key, "a")
    assert pool.holder("k1") is None and pool.holder("k3") == "a"


def test_item_hash_is_the_encoders_key_and_skips_what_the_router_cannot_read() -> None:
    item = distinct_image(3)
    assert asyncio.run(item_hash(item, 1 << 20)) == wire_content_hash(item, item.data)
    by_uri = media_pb2.MediaItem(modality=media_pb2.MODALITY_IMAGE, uri="file:///srv/cat.png")
    assert asyncio.run(item_hash(by_uri, 1 << 20)) is None


# -- Router + store ------------------------------------------------------------------------------------


def _harness(store: FakeStore, info: service_info_pb2.EncoderCacheInfo | None = CACHE_INFO) -> Harness:
    return Harness(cache=CacheLookup(store), encoder_cache=lambda address: info)


def test_a_store_hit_goes_as_cached_only_and_no_encoder_computes() -> None:
    store = FakeStore()
    store.data[f"{PREFIX}/{_key(0)}"] = b"entry"
    h = _harness(store)
    for encoder in h.encoders.values():
        encoder.cached.add(_key(0))
    assert asyncio.run(h.tokens(image_request(2))) == [7, 8, 9]
    assert sorted(_policies(h)) == ["CACHED_ONLY", "UNSPECIFIED"]  # item 0 cached, item 1 new
    assert ("exists", f"{PREFIX}/{_key(1)}") in store.calls
    assert h.leases.released == {}


def test_an_entry_gone_before_its_load_is_computed_by_the_same_encoder() -> None:
    store = FakeStore()
    store.data[f"{PREFIX}/{_key(0)}"] = b"entry"  # the store says yes, the encoder finds nothing
    h = _harness(store)
    assert asyncio.run(h.tokens(image_request(1))) == [7, 8, 9]
    assert _policies(h) == ["CACHED_ONLY", "UNSPECIFIED"]
    assert len({a for a, _ in h.log}) == 1 and h.leases.released == {}


@pytest.mark.parametrize(
    "info",
    [None, service_info_pb2.EncoderCacheInfo(key_prefix=PREFIX, shared_store=False)],
    ids=["no-cached-only-capability", "local-cache-only"],
)
def test_no_lookup_for_encoders_that_cannot_load_from_the_store(info: service_info_pb2.EncoderCacheInfo | None) -> None:
    store = FakeStore()
    store.data[f"{PREFIX}/{_key(0)}"] = b"entry"
    h = _harness(store, info)
    assert asyncio.run(h.tokens(image_request(1))) == [7, 8, 9]
    assert _policies(h) == ["UNSPECIFIED"] and store.calls == []


def test_a_store_that_is_down_is_a_miss() -> None:
    store = FakeStore()
    store.down = True
    h = _harness(store)
    assert asyncio.run(h.tokens(image_request(1))) == [7, 8, 9]
    assert _policies(h) == ["UNSPECIFIED"]


def test_concurrent_requests_for_one_item_meet_on_one_encoder() -> None:
    h = Harness(n_encoders=4)

    async def run() -> list[list[int]]:
        return list(await asyncio.gather(*(h.tokens(image_request(1, same=True)) for _ in range(12))))

    assert asyncio.run(run()) == [[7, 8, 9]] * 12
    assert len({a for a, _ in h.log}) == 1  # so that encoder's single-flight computes it once
    h.log.clear()
    assert asyncio.run(h.tokens(image_request(4))) == [7, 8, 9]
    assert len({a for a, _ in h.log}) == 4  # distinct items still spread
