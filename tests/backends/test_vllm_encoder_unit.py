"""The vLLM encoder without an engine: its settings as vLLM's encoder-only arguments, the refusals
(families, layouts, pairs), the shared pool another process writes into, and the producer
connector's write of one item (split, checked against the layout, marked)."""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path

import pytest
import torch

from libs.backends import registry
from libs.backends.engines import encoder_refusal
from libs.backends.settings import EncoderBackendSettings
from libs.backends.vllm import runtime
from libs.backends.vllm.ec_producer import ItemRefused, write_item, written_mark
from libs.backends.vllm.shared_pool import SlotDescriptor
from libs.config import load_settings
from libs.contract.epd.v1 import service_info_pb2
from libs.contract.errors import FailedPrecondition
from libs.launch.config import DescriptionError, parse_description, role_settings, stack_spec
from libs.launch.stack import Stack, StackSpec
from libs.rpc.peers import check_embedding_specs
from libs.serving import convert
from libs.serving.service_info import service_info
from libs.transfer.pool import MemoryPool
from libs.transfer.stamp import STAMP_BYTES

pytestmark = pytest.mark.unit
FAILURES = Path("/tmp/failures")


def _checkpoint(tmp_path: Path, family: str) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": family}))
    return tmp_path


def test_the_encoder_settings_become_vllms_encoder_only_arguments() -> None:
    settings = load_settings(EncoderBackendSettings, argv=["--engine", "vllm", "--model", "m"], env={})
    args = runtime.engine_args(settings, failure_dir=FAILURES, ec_consumer=False, ec_producer=True)
    assert args["mm_encoder_only"] is True and args["enable_prefix_caching"] is False
    assert args["mm_processor_cache_gb"] == 0
    assert args["ec_transfer_config"] == {
        "ec_connector": "EpdECProducer",
        "ec_connector_module_path": "libs.backends.vllm.ec_producer",
        "ec_role": "ec_producer",
        "ec_connector_extra_config": {"failure_dir": str(FAILURES)},
    }
    assert "kv_transfer_config" not in args
    assert (args["dtype"], args["kv_cache_memory_bytes"]) == ("float32", 64 << 20)  # today's CPU values
    assert args["enforce_eager"] is True  # vLLM compiles no tower: the encoder runs eager
    assert args["max_num_seqs"] == 16  # Encode calls per tower step: --encode-batch-items, not the LM's --max-batch
    fewer = load_settings(
        EncoderBackendSettings, argv=["--engine", "vllm", "--model", "m", "--encode-batch-items", "4"], env={}
    )
    assert runtime.engine_args(fewer, failure_dir=FAILURES, ec_consumer=False, ec_producer=True)["max_num_seqs"] == 4
    assert registry.module_name("encoder", "vllm") == "libs.backends.vllm.encoder"
    with pytest.raises(ValueError, match="no colocated backend"):
        registry.module_name("colocated", "vllm")


def test_families_vllms_tower_cannot_serve_are_refused_naming_them(tmp_path: Path) -> None:
    assert encoder_refusal(_checkpoint(tmp_path / "vl", "qwen2_5_vl")) is None
    assert encoder_refusal(_checkpoint(tmp_path / "v3", "qwen3_vl")) is None
    assert encoder_refusal(tmp_path / "absent") is None  # a pod's path: the service decides there
    omni = encoder_refusal(_checkpoint(tmp_path / "omni", "qwen2_5_omni"))
    assert omni is not None and omni.startswith("a vLLM encoder for a qwen2_5_omni checkpoint is refused")
    whisper = encoder_refusal(_checkpoint(tmp_path / "w", "whisper"))
    assert whisper is not None and whisper.startswith("a vLLM encoder for a whisper checkpoint is refused")


def test_stacks_and_descriptions_choose_the_encoder_engine_and_refuse_bad_pairings(tmp_path: Path) -> None:
    vl = _checkpoint(tmp_path / "vl", "qwen2_5_vl")
    omni = _checkpoint(tmp_path / "omni", "qwen2_5_omni")
    with pytest.raises(ValueError, match="not colocated"):
        Stack(StackSpec(layout="colocated", model=vl, run_dir=tmp_path, encoder_engine="vllm"))
    with pytest.raises(ValueError, match="qwen2_5_omni checkpoint is refused"):
        Stack(StackSpec(layout="e+pd", model=omni, run_dir=tmp_path, encoder_engine="vllm"))
    with pytest.raises(ValueError, match="unknown encoder engine"):
        Stack(StackSpec(layout="e+pd", model=vl, run_dir=tmp_path, encoder_engine="onnx"))
    doc = {
        "version": 1,
        "name": "t",
        "layout": "e+pd",
        "encoder_engine": "vllm",
        "model": {"path": str(vl)},
        "roles": {"router": {}, "encoder": {"settings": {"dtype": "bfloat16"}}, "pd": {}},
    }
    desc = parse_description(doc, Path("t.yaml"))
    assert role_settings(desc, "encoder")["engine"] == "vllm"  # EPD_ENGINE in the encoder's pod
    assert "engine" not in role_settings(
        parse_description({**doc, "encoder_engine": "reference"}, Path("r.yaml")), "encoder"
    )
    plan = stack_spec(desc, run_dir=tmp_path)
    assert (plan.spec.encoder_engine, plan.spec.engine) == ("vllm", "reference")
    assert "--dtype" in plan.spec.extra_args["encoder-0"]
    with pytest.raises(DescriptionError, match="encoder_engine: a vLLM encoder for a qwen2_5_omni"):
        parse_description({**doc, "model": {"path": str(omni)}}, Path("o.yaml"))


def test_a_pair_whose_embedding_contract_differs_is_refused_at_first_contact() -> None:
    """The router's first-contact check of an encoder against the LM service: a vLLM encoder in
    bfloat16 cannot feed a float32 PD; the same encoder in float32 can."""
    from libs.backends.vllm.encoder import advertised_specs
    from libs.model.checkpoint import Checkpoint
    from libs.model.checkpoints import ensure_checkpoint
    from libs.model.families import adapter_for

    adapter = adapter_for(Checkpoint(ensure_checkpoint("qwen2_5_vl", "tiny")))
    consumed = [convert.embedding_spec_to_wire(s) for s in advertised_specs(adapter, torch.float32)]

    def encoder_info(dtype: torch.dtype) -> service_info_pb2.ServiceInfo:
        model = service_info_pb2.ModelIdentity(model_id="m")
        return service_info(service_info_pb2.SERVICE_ROLE_ENCODER, model, advertised_specs(adapter, dtype))

    check_embedding_specs(consumed, encoder_info(torch.float32), "e:1")
    with pytest.raises(FailedPrecondition, match=r"embedding spec .* differs from ours"):
        check_embedding_specs(consumed, encoder_info(torch.bfloat16), "e:1")


def _slot(pool: MemoryPool, rows: int, widths: tuple[int, ...], key: str = "item-1") -> SlotDescriptor:
    nbytes = STAMP_BYTES + rows * sum(widths) * 4
    slot = pool.allocate(nbytes)
    offsets, at = [], slot.offset + STAMP_BYTES
    for width in widths:
        offsets.append(at)
        at += rows * width * 4
    names = ["embeddings", *(f"deepstack.{i}" for i in range(len(widths) - 1))]
    assert pool.share_path is not None
    return SlotDescriptor(
        key=key,
        request_id="r",
        item=3,
        pool_path=pool.share_path,
        slot_offset=slot.offset,
        rows=rows,
        dtype="float32",
        tensors=tuple((n, o, w) for n, o, w in zip(names, offsets, widths, strict=True)),
    )


def test_another_mapping_of_a_shared_pool_writes_where_the_owner_reads() -> None:
    """What vLLM's worker does: open the pool at its share path, map it, write an item (split
    into its tensors, then the mark); the owner sees the bytes in its own mapping."""
    pool = MemoryPool(1 << 20, shared=True)
    try:
        slot = _slot(pool, rows=5, widths=(4, 2))
        fd = os.open(slot.pool_path, os.O_RDWR)
        peer = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED)
        os.close(fd)
        output = torch.arange(30, dtype=torch.float32).view(5, 6)
        write_item(peer, slot, output)
        (_, first, _), (_, second, _) = slot.tensors
        got = torch.frombuffer(pool.buffer, dtype=torch.float32, count=20, offset=first).view(5, 4)
        extra = torch.frombuffer(pool.buffer, dtype=torch.float32, count=10, offset=second).view(5, 2)
        assert torch.equal(got, output[:, :4]) and torch.equal(extra, output[:, 4:])
        mark = written_mark("item-1")
        assert bytes(pool.buffer[slot.slot_offset : slot.slot_offset + len(mark)]) == mark
        del got, extra
        peer.close()
    finally:
        pool.close()


def test_an_output_that_does_not_fit_the_layout_is_refused_naming_the_item() -> None:
    pool = MemoryPool(1 << 20, shared=True)
    try:
        slot = _slot(pool, rows=5, widths=(4,))
        before = bytes(pool.buffer[slot.slot_offset : slot.slot_offset + 64])
        with pytest.raises(ItemRefused) as refused:
            write_item(pool.buffer, slot, torch.zeros(7, 4))
        assert refused.value.code == "FAILED_PRECONDITION"
        assert refused.value.message.startswith("items[3]: vLLM's tower gave [7, 4], the project's layout says [5, 4]")
        assert bytes(pool.buffer[slot.slot_offset : slot.slot_offset + 64]) == before  # nothing written, no mark
    finally:
        pool.close()


def test_a_private_pool_has_no_share_path() -> None:
    pool = MemoryPool(1 << 16)
    try:
        assert pool.share_path is None
    finally:
        pool.close()
