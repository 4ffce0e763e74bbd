"""The contract version this code speaks, and the rule for talking to a peer."""

from __future__ import annotations

from libs.contract.epd.v1 import service_info_pb2

CONTRACT_MAJOR = 1
CONTRACT_MINOR = 9


def current() -> service_info_pb2.ContractVersion:
    """The contract version of this build, as a message."""
    return service_info_pb2.ContractVersion(major=CONTRACT_MAJOR, minor=CONTRACT_MINOR)


def format_version(version: service_info_pb2.ContractVersion) -> str:
    """`major.minor`, as shown in errors and logs."""
    return f"{version.major}.{version.minor}"


def incompatibility(peer: service_info_pb2.ContractVersion) -> str | None:
    """Why a peer speaking `peer` cannot talk to us, or None when it can.

    Minors are additive within a major (unknown fields are ignored; optional features are
    negotiated by capability), so only the major decides.
    """
    if peer.major != CONTRACT_MAJOR:
        return (
            f"contract major mismatch: peer speaks {format_version(peer)}, "
            f"this service speaks {CONTRACT_MAJOR}.{CONTRACT_MINOR}"
        )
    return None
