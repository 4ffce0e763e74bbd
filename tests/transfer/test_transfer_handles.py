"""Handle validation, spec expectations, checksums, metadata caching and error codes (no NIXL)."""

from __future__ import annotations

import grpc
import pytest
import torch

from libs.contract.epd.v1 import tensor_pb2
from libs.transfer import (
    BadDescriptor,
    ChecksumMismatch,
    ExpectedTensor,
    PeerUnavailable,
    SpecMismatch,
    StaleHandle,
    TransferConfig,
)
from libs.transfer.handles import (
    check_expected,
    crc32,
    expiry_timestamp,
    make_spec,
    packed_offsets,
    validate_handle,
    verify_checksum,
    view_tensor,
)
from libs.transfer.remote_agents import RemoteAgents

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def nixl_handle(**spec_overrides: object) -> tensor_pb2.TensorHandle:
    spec = make_spec((4, 8), torch.float32)
    for key, value in spec_overrides.items():
        setattr(spec, key, value)
    handle = tensor_pb2.TensorHandle(
        transport=tensor_pb2.TRANSPORT_KIND_NIXL,
        agent=tensor_pb2.NixlAgentRef(agent_name="enc-1", instance_id="i1", producer_address="127.0.0.1:1"),
        lease_id="lease-1",
        lease_expire_time=expiry_timestamp(30),
    )
    desc = handle.tensors.add(name="embeddings", spec=spec)
    desc.regions.add(address=0x10000, length=spec.nbytes, memory_kind=tensor_pb2.MEMORY_KIND_CPU)
    return handle


def test_a_consistent_handle_passes() -> None:
    validate_handle(nixl_handle())


def test_nbytes_that_disagree_with_shape_name_the_field() -> None:
    with pytest.raises(BadDescriptor) as info:
        validate_handle(nixl_handle(nbytes=100))
    assert info.value.field == "handle.tensors[0].spec.nbytes"
    assert info.value.grpc_code == grpc.StatusCode.INVALID_ARGUMENT


def test_regions_that_do_not_cover_the_tensor_are_rejected() -> None:
    handle = nixl_handle()
    handle.tensors[0].regions[0].length -= 4
    with pytest.raises(BadDescriptor, match="regions"):
        validate_handle(handle)


def test_gpu_memory_is_a_spec_mismatch_for_this_transport() -> None:
    handle = nixl_handle()
    handle.tensors[0].regions[0].memory_kind = tensor_pb2.MEMORY_KIND_GPU
    with pytest.raises(SpecMismatch) as info:
        validate_handle(handle)
    assert info.value.grpc_code == grpc.StatusCode.FAILED_PRECONDITION


def test_expectations_check_names_dtype_and_fixed_dimensions() -> None:
    handle = nixl_handle()
    check_expected(handle, {"embeddings": ExpectedTensor(tensor_pb2.D_TYPE_FLOAT32, (None, 8))})
    with pytest.raises(SpecMismatch, match="expected"):
        check_expected(handle, {"embeddings": ExpectedTensor(tensor_pb2.D_TYPE_FLOAT32, (None, 16))})
    with pytest.raises(SpecMismatch):
        check_expected(handle, {"embeddings": ExpectedTensor(tensor_pb2.D_TYPE_BFLOAT16, (4, 8))})
    with pytest.raises(SpecMismatch):
        check_expected(handle, {"deepstack.0": ExpectedTensor(tensor_pb2.D_TYPE_FLOAT32, (4, 8))})


def test_unsupported_dtype_is_refused() -> None:
    with pytest.raises(SpecMismatch, match="float64"):
        make_spec((2,), torch.float64)


def test_checksum_detects_a_flipped_bit() -> None:
    data = bytearray(torch.randn(1000).numpy().tobytes())
    checksum = crc32(data)
    verify_checksum("t", checksum, data)
    data[123] ^= 0x01
    with pytest.raises(ChecksumMismatch) as info:
        verify_checksum("t", checksum, data)
    assert info.value.grpc_code == grpc.StatusCode.DATA_LOSS


def test_view_tensor_shares_memory_with_the_buffer() -> None:
    spec = make_spec((3, 5), torch.bfloat16)
    offsets, total = packed_offsets([7, spec.nbytes])
    assert offsets[1] % 256 == 0 and total >= offsets[1] + spec.nbytes
    buffer = bytearray(total)
    tensor = view_tensor(buffer, offsets[1], spec)
    assert tensor.shape == (3, 5) and tensor.dtype == torch.bfloat16
    tensor.fill_(1.5)
    expected = torch.tensor([1.5], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    assert buffer[offsets[1] : offsets[1] + 2] == expected


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="pool_bytes"):
        TransferConfig(pool_bytes=0)
    assert TransferConfig().ucx_environment()["UCX_NET_DEVICES"] == "lo"
    assert "UCX_NET_DEVICES" not in TransferConfig(ucx_net_devices=None).ucx_environment()


class StubAgent:
    """Records what RemoteAgents asks of the NIXL agent."""

    def __init__(self) -> None:
        self.loaded: list[bytes] = []
        self.forgotten: list[str] = []

    def load_peer(self, metadata: bytes) -> str:
        self.loaded.append(metadata)
        return metadata.decode().split("@")[0]

    def forget_peer(self, name: str) -> None:
        self.forgotten.append(name)


def ref(name: str, instance: str) -> tensor_pb2.NixlAgentRef:
    return tensor_pb2.NixlAgentRef(agent_name=name, instance_id=instance, producer_address="127.0.0.1:1")


def test_metadata_is_fetched_once_per_incarnation_and_refetched_after_a_restart() -> None:
    agent = StubAgent()
    blobs = {"1": b"enc@1", "2": b"enc@2"}
    directory = RemoteAgents(agent, lambda r: blobs[r.instance_id])  # type: ignore[arg-type]
    for _ in range(3):
        assert directory.ensure(ref("enc", "1")) == "enc"
    assert directory.resolve_calls == 1
    assert directory.ensure(ref("enc", "2")) == "enc"  # peer restarted under the same name
    assert directory.resolve_calls == 2
    assert agent.forgotten == ["enc"]
    with pytest.raises(StaleHandle):  # a leftover handle of the old incarnation
        directory.ensure(ref("enc", "1"))
    assert directory.resolve_calls == 2


def test_resolver_failure_is_peer_unavailable_and_is_retried_next_time() -> None:
    agent = StubAgent()
    attempts = []

    def flaky(r: tensor_pb2.NixlAgentRef) -> bytes:
        attempts.append(r.agent_name)
        if len(attempts) == 1:
            raise ConnectionError("connection refused")
        return b"enc@1"

    directory = RemoteAgents(agent, flaky)  # type: ignore[arg-type]
    with pytest.raises(PeerUnavailable) as info:
        directory.ensure(ref("enc", "1"))
    assert info.value.grpc_code == grpc.StatusCode.UNAVAILABLE
    assert directory.ensure(ref("enc", "1")) == "enc"


def test_metadata_of_another_agent_means_the_handle_is_stale() -> None:
    directory = RemoteAgents(StubAgent(), lambda r: b"enc-new@2")  # type: ignore[arg-type]
    with pytest.raises(StaleHandle, match="restarted"):
        directory.ensure(ref("enc-old", "1"))
