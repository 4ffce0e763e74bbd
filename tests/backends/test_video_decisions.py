"""vLLM's metadata-only video input with the project's temporal step
(libs/backends/vllm/video_decisions.py): vLLM's own parser drops a video's `second_per_grid_ts`
(its M-RoPE then takes 1.0 s per grid); with the project's field config it reaches the item's
fields that M-RoPE reads. The prompt side is in test_vllm_requests.py, the tokens through real
engines in test_vllm_pd.py / test_vllm_split.py / test_vllm_encoder.py (`video_4fps`)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from libs.backends.vllm.video_decisions import accept_second_per_grid_ts, without_outer_video_markers

pytestmark = pytest.mark.vllm  # imports vLLM (no engine starts)


@pytest.fixture
def shipped_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's own `_parse_video_data` for the test, whatever this process installed before (the
    install is process-wide; the plugin makes it wherever vLLM builds an engine's arguments); the
    method as it was is back after the test."""
    from vllm.model_executor.models.qwen2_vl import Qwen2VLMultiModalDataParser

    parse = Qwen2VLMultiModalDataParser._parse_video_data
    monkeypatch.setattr(Qwen2VLMultiModalDataParser, "_parse_video_data", getattr(parse, "__wrapped__", parse))


def _parsed_video(grid: list[int], seconds: float) -> dict[str, Any]:
    """What vLLM's Qwen2-VL-family parser keeps of one metadata-only video (Qwen2.5-VL, Omni)."""
    from vllm.model_executor.models.qwen2_vl import Qwen2VLMultiModalDataParser

    parser = Qwen2VLMultiModalDataParser(
        2, video_needs_metadata=True, expected_hidden_size=64, allow_missing_mm_embeddings=True
    )
    data = {"video": {"video_grid_thw": torch.tensor([grid]), "second_per_grid_ts": torch.tensor([seconds])}}
    return dict(parser.parse_mm_data(data)["video"].get(0))


@pytest.mark.usefixtures("shipped_parser")
def test_the_layouts_seconds_per_grid_reaches_vllms_fields() -> None:
    assert "second_per_grid_ts" not in _parsed_video([4, 4, 6], 0.5)  # vLLM as shipped drops it
    accept_second_per_grid_ts()
    accept_second_per_grid_ts()  # idempotent: one wrapper
    fields = _parsed_video([4, 4, 6], 0.5)
    assert float(fields["second_per_grid_ts"]) == 0.5
    assert fields["video_grid_thw"].tolist() == [4, 4, 6]
    assert "second_per_grid_ts" not in dict(_parsed_video_without_seconds())


def _parsed_video_without_seconds() -> Any:
    from vllm.model_executor.models.qwen2_vl import Qwen2VLMultiModalDataParser

    parser = Qwen2VLMultiModalDataParser(
        2, video_needs_metadata=True, expected_hidden_size=64, allow_missing_mm_embeddings=True
    )
    return parser.parse_mm_data({"video": {"video_grid_thw": torch.tensor([[2, 4, 6]])}})["video"].get(0)


@pytest.mark.usefixtures("shipped_parser")
def test_vllms_pixel_path_field_config_is_unchanged() -> None:
    """Qwen2.5-VL's processor declares `second_per_grid_ts` on top of the shared factory for
    pixels: the install leaves that factory alone (patched, the field was declared twice and every
    pixel request failed, the vLLM encoder's included)."""
    from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VLMultiModalProcessor

    accept_second_per_grid_ts()
    processor = Qwen2_5_VLMultiModalProcessor.__new__(Qwen2_5_VLMultiModalProcessor)  # only its field config
    config = SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2))
    processor.info = SimpleNamespace(get_hf_config=lambda: config)
    inputs = {"video_grid_thw": torch.tensor([[2, 4, 6]]), "second_per_grid_ts": torch.tensor([0.5])}
    assert "second_per_grid_ts" in processor._get_mm_fields_config(inputs, {})


def test_only_the_outer_pair_around_a_bare_video_placeholder_goes() -> None:
    start, video, end, image = 1, 2, 3, 9
    ids = [7, start, video, end, 8, start, image, end, video, start, video, end]
    want = [7, video, 8, start, image, end, video, video]
    assert without_outer_video_markers(ids, start=start, video=video, end=end) == want
