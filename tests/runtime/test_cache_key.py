"""The encoder-cache key covers everything that changes an item's tower inputs: the item's bytes and
every processor option (content hash), and the preprocessing itself (namespace)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from libs.cache.keys import OPTION_FIELDS, Namespace
from libs.model.content import content_hash, media_hash
from libs.model.types import MediaInput, Modality, ProcessorOptions
from libs.runtime.encoder_runner import EncoderRunner
from tests.support import media_set
from tests.support.engines import Engines
from tests.support.parity import project_item

pytestmark = pytest.mark.integration

# One live change per option: each alters the tiny checkpoints' preprocessing of the item.
LIVE_OPTIONS = [
    (Modality.IMAGE, "large_1500x1100", ProcessorOptions(max_pixels=28 * 28 * 40)),
    (Modality.IMAGE, "tiny_3x5", ProcessorOptions(min_pixels=100 * 100, max_pixels=120 * 120)),
    (Modality.VIDEO, "29.97fps_3.3s_96x54", ProcessorOptions(video_fps=4.0)),
    (Modality.VIDEO, "60fps_10s_capped_32x128", ProcessorOptions(video_max_frames=6)),
]


def test_every_processor_option_is_part_of_the_key() -> None:
    # A new ProcessorOptions field that the wire hash would not see fails here.
    assert {f.name for f in dataclasses.fields(ProcessorOptions)} == set(OPTION_FIELDS)
    options = ProcessorOptions(min_pixels=1, max_pixels=2, video_fps=0.5, video_max_frames=3)
    media = MediaInput(Modality.VIDEO, b"bytes", options=options)
    assert content_hash(media.modality, options, media.data) == media_hash(media)


@pytest.mark.parametrize("family", ["qwen2_5_omni", "qwen3_vl"])
@pytest.mark.parametrize(("modality", "name", "options"), LIVE_OPTIONS, ids=str)
def test_an_option_that_changes_the_inputs_changes_the_key(
    engines: Callable[[str], Engines], family: str, modality: Modality, name: str, options: ProcessorOptions
) -> None:
    pool = media_set.images() if modality is Modality.IMAGE else media_set.videos()
    data = next(c.data for c in pool if c.name == name)
    adapter = engines(family).encoder.adapter
    with_option = project_item(adapter, modality, data, options)
    without = project_item(adapter, modality, data, ProcessorOptions())
    assert with_option.layout.mm_hash != without.layout.mm_hash
    assert (with_option.layout.image or with_option.layout.video) != (without.layout.image or without.layout.video)


@pytest.mark.timeout(120)
def test_processor_config_changes_the_namespace(engines: Callable[[str], Engines], tmp_path: Path) -> None:
    """Same bytes, same options, same weights: a checkpoint whose processor config differs encodes
    the item differently, so its encoders must not share cache entries."""
    original = engines("qwen2_5_vl").path
    edited = tmp_path / "edited"
    shutil.copytree(original, edited)
    config = json.loads((edited / "preprocessor_config.json").read_text())
    config["max_pixels"] = config["max_pixels"] * 4
    (edited / "preprocessor_config.json").write_text(json.dumps(config))
    runners = [engines("qwen2_5_vl").encoder, EncoderRunner(edited)]
    image = next(c.data for c in media_set.images() if c.name == "large_1500x1100")
    items = [runner.encode([MediaInput(Modality.IMAGE, image)])[0] for runner in runners]
    assert items[0].layout.mm_hash == items[1].layout.mm_hash  # the content hash alone cannot tell them apart
    assert items[0].layout.image != items[1].layout.image
    assert runners[0].weights_digest == runners[1].weights_digest
    namespaces = [
        Namespace("m", "r", runner.weights_digest, "float32", preprocessing=runner.preprocessing_digest)
        for runner in runners
    ]
    assert namespaces[0].key_prefix != namespaces[1].key_prefix
