"""Preprocessing parity: for every family, modality and generated media case, the project's tower
inputs, grids, audio features and lengths, seconds per grid and prompt token ids equal what the
family's transformers processor produces (`tests/support/hf_reference.py`: the real classes when torchvision
imports, else the real family processor around transcribed torchvision parts). Items the reference
refuses must be refused by the project with a typed error."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from libs.model.types import Modality, ProcessorOptions
from tests.support import media_set
from tests.support.engines import FAMILIES, Engines
from tests.support.hf_reference import (
    RefItem,
    processor_composites_alpha,
    reference_batch,
    reference_image,
    reference_image_raw,
    reference_processor,
    reference_video,
    torchvision_ready,
)
from tests.support.hf_transcription import TranscribedQwen2VLImageProcessor, TranscribedVideoProcessor
from tests.support.parity import PROMPT_TEXT, Comparison, compare, project_item

pytestmark = pytest.mark.integration

CASES = [
    *[(f, Modality.IMAGE, c) for f in FAMILIES for c in media_set.images()],
    *[(f, Modality.VIDEO, c) for f in FAMILIES for c in media_set.videos()],
    *[("qwen2_5_omni", Modality.AUDIO, c) for c in media_set.audios()],
]
# Request options carried by the contract, each changing the outcome for some case below.
OPTION_CASES = [
    (Modality.IMAGE, "large_1500x1100", ProcessorOptions(max_pixels=28 * 28 * 40)),
    (Modality.IMAGE, "tiny_3x5", ProcessorOptions(min_pixels=100 * 100, max_pixels=120 * 120)),
    (Modality.VIDEO, "29.97fps_3.3s_96x54", ProcessorOptions(video_fps=4.0)),
    (Modality.VIDEO, "60fps_10s_capped_32x128", ProcessorOptions(video_max_frames=6)),
    (Modality.VIDEO, "7fps_2.3s_64x48", ProcessorOptions(min_pixels=28 * 28 * 8, max_pixels=28 * 28 * 20)),
]


def _case_data(modality: Modality, name: str) -> media_set.Case:
    pool = {Modality.IMAGE: media_set.images(), Modality.VIDEO: media_set.videos(), Modality.AUDIO: media_set.audios()}
    return next(c for c in pool[modality] if c.name == name)


def _run(
    engines: Callable[[str], Engines], family: str, modality: Modality, case: media_set.Case, **kw: Any
) -> Comparison:
    eng = engines(family)
    return compare(
        family, eng.path, eng.encoder.adapter, eng.runtime.tokenizer, modality, case.name, case.data, case.suffix, **kw
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("family", "modality", "case"), CASES, ids=lambda v: getattr(v, "name", None) or str(v))
def test_preprocessing_equals_reference(
    engines: Callable[[str], Engines], family: str, modality: Modality, case: media_set.Case
) -> None:
    result = _run(engines, family, modality, case)
    if case.name in media_set.REFUSED:
        assert result.error is not None, "the reference refuses this item; so must the project"
        return
    assert result.error is None
    assert result.equal, {name: value for name, value in result.fields.items() if not value[0]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("modality", "name", "options"), OPTION_CASES, ids=str)
def test_processor_options_keep_the_processors_meaning(
    engines: Callable[[str], Engines], family: str, modality: Modality, name: str, options: ProcessorOptions
) -> None:
    case = _case_data(modality, name)
    result = _run(engines, family, modality, case, options=options)
    assert result.error is None and result.equal, result.fields
    # The option is live: without it the project preprocesses the item differently.
    adapter = engines(family).encoder.adapter
    with_option = project_item(adapter, modality, case.data, options).layout
    without = project_item(adapter, modality, case.data, ProcessorOptions()).layout
    assert (with_option.image or with_option.video) != (without.image or without.video)


def test_reference_is_what_the_environment_allows(engines: Callable[[str], Engines]) -> None:
    """The real torchvision classes whenever they import; the transcription only otherwise."""
    processor = reference_processor(engines("qwen3_vl").path)
    transcribed = isinstance(processor.image_processor, TranscribedQwen2VLImageProcessor) and isinstance(
        processor.video_processor, TranscribedVideoProcessor
    )
    assert transcribed is not torchvision_ready()


@pytest.mark.timeout(120)
def test_documented_departures_are_real(engines: Callable[[str], Engines]) -> None:
    """Where the project follows a documented decision instead of the installed processor, the
    installed processor's raw output differs in exactly that respect."""
    eng = engines("qwen3_vl")
    video = next(c for c in media_set.videos() if c.name == "7fps_2.3s_64x48")
    item = RefItem(Modality.VIDEO, video.data, video.suffix)
    trained = reference_batch(eng.path, [item, PROMPT_TEXT])["input_ids"][0].tolist()
    raw = reference_batch(eng.path, [item, PROMPT_TEXT], trained_video_markers=False)["input_ids"][0].tolist()
    start, end = (eng.runtime.tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>"))
    # transformers 5.x keeps the template's outer pair around the per-frame sequence: removing one
    # vision_start and one vision_end from its ids gives the project's.
    i = next(k for k, (a, b) in enumerate(zip(raw, trained, strict=False)) if a != b)
    assert raw[i] == start
    rest = raw[:i] + raw[i + 1 :]
    j = next(k for k, (a, b) in enumerate(zip(rest, trained, strict=False)) if a != b)
    assert rest[j] == end and rest[:j] + rest[j + 1 :] == trained
    rgba = next(c for c in media_set.images() if c.name == "rgba")
    project = project_item(engines("qwen2_5_vl").encoder.adapter, Modality.IMAGE, rgba.data, ProcessorOptions())
    processor = reference_processor(engines("qwen2_5_vl").path)
    raw_pixels = processor.image_processor(images=[reference_image_raw(rgba.data)], return_tensors="pt")
    # 5.23 composites alpha onto white as the project does; 5.19 drops the alpha band.
    assert torch.equal(raw_pixels["pixel_values"], project.inputs["pixel_values"]) is processor_composites_alpha()


@pytest.mark.timeout(120)
@pytest.mark.skipif(not torchvision_ready(), reason="needs the real torchvision processors to compare with")
@pytest.mark.parametrize("family", FAMILIES)
def test_transcription_equals_the_real_processors(engines: Callable[[str], Engines], family: str) -> None:
    """The stand-ins used where torchvision does not import produce the real classes' outputs."""
    path = engines(family).path
    real, stand_in = reference_processor(path), reference_processor(path, transcribed=True)
    for case in (*media_set.images()[:4], *media_set.images()[7:9]):
        image = [reference_image(case.data)]
        a, b = real.image_processor(images=image, return_tensors="pt"), stand_in.image_processor(images=image)
        assert torch.equal(a["pixel_values"], b["pixel_values"]), case.name
        assert torch.equal(a["image_grid_thw"], b["image_grid_thw"]), case.name
    for case in media_set.videos():
        frames, meta = reference_video(case.data, case.suffix)
        kwargs = {"video_metadata": [meta], "do_sample_frames": True, "fps": 2.0, "return_metadata": True}
        a, b = real.video_processor([frames], **kwargs), stand_in.video_processor([frames], **kwargs)
        assert torch.equal(a["pixel_values_videos"], b["pixel_values_videos"]), case.name
        assert torch.equal(a["video_grid_thw"], b["video_grid_thw"]), case.name
        assert list(a["video_metadata"][0].frames_indices) == list(b["video_metadata"][0].frames_indices)
