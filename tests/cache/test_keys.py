from __future__ import annotations

import dataclasses

import pytest

from libs.cache.keys import OPTION_FIELDS, CacheKey, Namespace, client_id_hash, wire_content_hash
from libs.contract.epd.v1 import media_pb2
from libs.contract.version import CONTRACT_MAJOR, CONTRACT_MINOR
from libs.model.content import content_hash
from libs.model.types import MediaInput, Modality, ProcessorOptions
from tests.support.cache import NS

pytestmark = pytest.mark.unit


def test_content_hash_is_the_engines_media_hash() -> None:
    from libs.model.content import media_hash

    for modality in Modality:
        for options in (ProcessorOptions(), ProcessorOptions(max_pixels=256 * 28 * 28, video_fps=1.0)):
            media = MediaInput(modality, b"\x00bytes\xff", options=options)
            assert content_hash(modality, options, media.data) == media_hash(media)


def test_options_hash_as_their_dataclass_dict_so_keys_stay_stable() -> None:
    """The hashes read the options through `as_dict` (no deep copy): the same dict as
    `dataclasses.asdict`, so every content hash, and every store key, is the one it was."""
    every = ProcessorOptions(min_pixels=3136, max_pixels=12544, video_fps=2.0, video_max_frames=8)
    for options in (ProcessorOptions(), every):
        assert options.as_dict() == dataclasses.asdict(options)


def test_the_routers_wire_hash_is_the_encoders_hash() -> None:
    """The router hashes wire items to find them in the store; the encoder hashes engine inputs
    (`convert.media_input`). Equal for every modality, with and without each option."""
    from libs.model.content import media_hash
    from libs.serving.convert import media_input

    assert set(OPTION_FIELDS) == {f.name for f in dataclasses.fields(ProcessorOptions)}
    option_sets = [
        media_pb2.ProcessorOptions(),
        media_pb2.ProcessorOptions(min_pixels=3136, max_pixels=256 * 28 * 28),
        media_pb2.ProcessorOptions(video_fps=1.5, video_max_frames=8),
        media_pb2.ProcessorOptions(audio_window_start_frame=0),  # the first window: as if unset
        media_pb2.ProcessorOptions(audio_window_start_frame=2948),  # contract 1.4: a later window
    ]
    for modality in (media_pb2.MODALITY_IMAGE, media_pb2.MODALITY_VIDEO, media_pb2.MODALITY_AUDIO):
        for options in option_sets:
            item = media_pb2.MediaItem(modality=modality, data=b"\x00bytes\xff", processor_options=options)
            assert wire_content_hash(item, item.data) == media_hash(media_input(item, 0, item.data))
    audio = media_pb2.MediaItem(modality=media_pb2.MODALITY_AUDIO, data=b"pcm")
    later = media_pb2.MediaItem(modality=media_pb2.MODALITY_AUDIO, data=b"pcm")
    later.processor_options.audio_window_start_frame = 2948
    assert wire_content_hash(audio, b"pcm") != wire_content_hash(later, b"pcm")  # windows never share an entry


def test_options_and_modality_change_the_hash() -> None:
    base = content_hash(Modality.IMAGE, ProcessorOptions(), b"x")
    assert content_hash(Modality.IMAGE, ProcessorOptions(max_pixels=1000), b"x") != base
    assert content_hash(Modality.VIDEO, ProcessorOptions(), b"x") != base
    assert content_hash(Modality.IMAGE, ProcessorOptions(), b"y") != base


def test_store_keys_sit_under_the_namespace_prefix() -> None:
    key = CacheKey(NS, "ab" * 32)
    assert key.store_key == f"{NS.key_prefix}/{'ab' * 32}"
    assert NS.key_prefix.startswith("epd/enc/v1/") and NS.token in NS.key_prefix


def test_client_ids_are_hashed_with_the_options() -> None:
    plain = client_id_hash(Modality.IMAGE, ProcessorOptions(), "cat.png")
    resized = client_id_hash(Modality.IMAGE, ProcessorOptions(max_pixels=1000), "cat.png")
    assert plain != resized
    assert "cat.png" not in plain and len(plain) == 64
    # An id can never alias the content hash of bytes equal to it.
    assert plain != content_hash(Modality.IMAGE, ProcessorOptions(), b"cat.png")
    with pytest.raises(ValueError):
        client_id_hash(Modality.IMAGE, ProcessorOptions(), "")


def test_namespace_defaults_to_this_contract_and_every_field_changes_the_token() -> None:
    assert NS.contract == f"{CONTRACT_MAJOR}.{CONTRACT_MINOR}"
    tokens = {NS.token}
    for field in dataclasses.fields(Namespace):
        tokens.add(dataclasses.replace(NS, **{field.name: "other"}).token)
    assert len(tokens) == 1 + len(dataclasses.fields(Namespace))
    with pytest.raises(ValueError):
        dataclasses.replace(NS, weights_digest="")


def test_store_key_is_namespaced_and_validated() -> None:
    mm_hash = content_hash(Modality.AUDIO, ProcessorOptions(), b"a")
    key = CacheKey(NS, mm_hash)
    other = CacheKey(dataclasses.replace(NS, revision="r2"), mm_hash)
    assert key.store_key.startswith("epd/enc/v1/") and key.store_key.endswith(mm_hash)
    assert key.store_key != other.store_key
    for bad in ("", "ABC", mm_hash.upper(), mm_hash[:-1], "../" + mm_hash[3:]):
        with pytest.raises(ValueError):
            CacheKey(NS, bad)
