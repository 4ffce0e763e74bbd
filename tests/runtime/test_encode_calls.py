"""`EncoderRunner.encode_calls`, the encoder's cross-request batches, on each vision family's real
tower: images of several calls in one forward come out with the same bits as each call encoded
alone (what lets the encoder merge calls without changing any request's tokens:
`EncoderRunner.merges_exactly`), and a call with bad input fails alone."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from libs.model import types as eng
from libs.model.errors import InvalidMediaError, UnsupportedModalityError
from libs.model.media import synthetic
from libs.runtime.encoder_runner import fewest_exact_rows
from tests.support.engines import FAMILIES, Engines

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def image(width: int, height: int, seed: int, index: int = 0) -> eng.MediaInput:
    return eng.MediaInput(eng.Modality.IMAGE, synthetic.png_bytes(width, height, seed=seed), item_index=index)


@pytest.mark.parametrize("family", FAMILIES)
def test_images_of_several_calls_in_one_forward_keep_their_bits(family: str, engines: Callable[[str], Engines]) -> None:
    runner = engines(family).encoder
    calls = [
        [image(224, 224, seed=1)],
        [image(112, 168, seed=2), image(280, 196, seed=3, index=1)],
        [image(56, 56, seed=4)],
    ]
    timings: dict[str, int] = {}
    batched = runner.encode_calls(calls, timings)
    assert timings["start"] <= timings["preprocessed"] <= timings["end"]
    assert [len(r) for r in batched if isinstance(r, list)] == [1, 2, 1]
    for call, together in zip(calls, batched, strict=True):
        assert isinstance(together, list)
        alone = runner.encode(call)
        for a, b in zip(alone, together, strict=True):
            assert a.layout == b.layout
            assert a.tensors.keys() == b.tensors.keys()
            for name in a.tensors:
                assert torch.equal(a.tensors[name], b.tensors[name]), (family, name)


def test_a_call_with_an_item_too_small_to_keep_its_bits_is_encoded_alone(
    engines: Callable[[str], Engines], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Items of fewer rows than the host's `fewest_exact_rows` leave the shared forward: the calls
    that have one run their own, the others still share one."""
    runner = engines("qwen2_5_vl").encoder
    forwards: list[int] = []
    run_towers = runner.run_towers
    monkeypatch.setattr(runner, "run_towers", lambda prepared: forwards.append(len(prepared)) or run_towers(prepared))
    monkeypatch.setattr(runner, "fewest_exact_rows", 13)  # 224x224: 16 rows; 112x168, 280x196: 12; 56x56: 4
    calls = [[image(224, 224, seed=1)], [image(112, 168, seed=2), image(280, 196, seed=3, index=1)],
             [image(56, 56, seed=4)], [image(224, 224, seed=5)]]  # fmt: skip
    results = runner.encode_calls(calls)
    assert forwards == [2, 2, 1]  # the two 224x224 calls together, then the others each alone
    for call, result in zip(calls, results, strict=True):
        assert isinstance(result, list)
        assert all(torch.equal(a.embeddings, b.embeddings) for a, b in zip(runner.encode(call), result, strict=True))


def test_the_fewest_exact_rows_are_where_a_layer_stops_changing_bits() -> None:
    class RowByRow(torch.nn.Linear):  # the same bits for a row in any batch, on any BLAS
        def forward(self, rows: torch.Tensor) -> torch.Tensor:
            return torch.cat([super(RowByRow, self).forward(row[None]) for row in rows])

    class SmallProductsDiffer(RowByRow):  # a BLAS with another kernel below 3 rows
        def forward(self, rows: torch.Tensor) -> torch.Tensor:
            return super().forward(rows) + (1e-3 if rows.shape[0] < 3 else 0.0)

    assert fewest_exact_rows(torch.nn.Sequential(RowByRow(8, 8), SmallProductsDiffer(8, 4))) == 3
    assert fewest_exact_rows(torch.nn.Sequential(RowByRow(8, 8))) == 1
    assert fewest_exact_rows(SmallProductsDiffer(8, 4), most=2) == 3  # every count checked differs: none merges


def test_a_bad_call_fails_alone(engines: Callable[[str], Engines]) -> None:
    runner = engines("qwen2_5_vl").encoder
    good = [image(112, 112, seed=5)]
    undecodable = [image(56, 56, seed=6), eng.MediaInput(eng.Modality.IMAGE, b"not an image", item_index=1)]
    unsupported = [eng.MediaInput(eng.Modality.AUDIO, synthetic.wav_bytes(1.0, seed=0))]  # no audio tower
    results = runner.encode_calls([good, undecodable, unsupported, good])
    assert isinstance(results[1], InvalidMediaError)
    assert isinstance(results[2], UnsupportedModalityError) and results[2].field == "items[0].media.modality"
    expected = runner.encode(good)[0].embeddings
    for result in (results[0], results[3]):
        assert isinstance(result, list) and torch.equal(result[0].embeddings, expected)


def test_only_image_calls_merge() -> None:
    from libs.runtime.encoder_runner import EncoderRunner

    still = eng.MediaInput(eng.Modality.IMAGE, b"")
    assert EncoderRunner.merges_exactly([still, still])
    assert not EncoderRunner.merges_exactly([still, eng.MediaInput(eng.Modality.VIDEO, b"")])
    assert not EncoderRunner.merges_exactly([eng.MediaInput(eng.Modality.AUDIO, b"")])


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_a_layout_from_the_resized_pixels_is_the_preprocessed_one(
    family: str, engines: Callable[[str], Engines]
) -> None:
    """What the vLLM encoder computes instead of a second preprocessing (libs/backends/vllm/encoder.py)."""
    from libs.model.content import media_hash
    from libs.model.families.qwen_vl import QwenVLAdapter
    from libs.model.media.limits import MediaLimits

    adapter = engines(family).encoder.adapter
    assert isinstance(adapter, QwenVLAdapter)
    limits = MediaLimits()
    bounded = eng.ProcessorOptions(min_pixels=56 * 56, max_pixels=112 * 140)
    default = eng.ProcessorOptions()
    for width, height, options in [(224, 224, default), (57, 300, default), (640, 360, default), (640, 360, bounded)]:
        media = eng.MediaInput(eng.Modality.IMAGE, synthetic.png_bytes(width, height, seed=width), options=options)
        resized = adapter.vision.resized_image(media.data, media.options, limits)
        key = media_hash(media)
        assert (
            adapter.image_item(media, key, adapter.vision.image_grid(resized))
            == adapter.preprocess(media, key, limits).layout
        ), (width, height, options)
