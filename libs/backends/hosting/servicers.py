"""Servicers every producer / model service registers besides its own: leases and stats."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from libs.backends.api import EngineLeases
from libs.contract.epd.v1 import lease_pb2, lease_pb2_grpc, stats_pb2, stats_pb2_grpc
from libs.contract.validation import validate_release_leases_request
from libs.rpc.main import Register
from libs.serving.transport import Transport


class LeaseServicer(lease_pb2_grpc.LeaseServiceServicer):
    """`ReleaseLeases`: frees tensors held for a consumer that will not read them."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    async def ReleaseLeases(
        self, request: lease_pb2.ReleaseLeasesRequest, context: Any
    ) -> lease_pb2.ReleaseLeasesResponse:
        validate_release_leases_request(request)
        producer = self._transport.producer
        released = producer.release(request.lease_ids) if producer is not None else 0
        return lease_pb2.ReleaseLeasesResponse(released_count=released)


class EngineLeaseServicer(lease_pb2_grpc.LeaseServiceServicer):
    """`ReleaseLeases` for leases an engine holds."""

    def __init__(self, leases: EngineLeases) -> None:
        self._leases = leases

    async def ReleaseLeases(
        self, request: lease_pb2.ReleaseLeasesRequest, context: Any
    ) -> lease_pb2.ReleaseLeasesResponse:
        validate_release_leases_request(request)
        return lease_pb2.ReleaseLeasesResponse(released_count=await self._leases.release(request.lease_ids))


class StatsServicer(stats_pb2_grpc.StatsServiceServicer):
    """`GetStats`: pool occupancy plus the service's own counters."""

    def __init__(
        self,
        transport: Transport | None,
        in_flight: Callable[[], int],
        active_sequences: Callable[[], int] = lambda: 0,
        pool: Callable[[], Awaitable[stats_pb2.TransferPoolStats]] | None = None,
    ) -> None:
        self._transport = transport
        self._in_flight = in_flight
        self._active_sequences = active_sequences
        self._pool = pool

    async def GetStats(self, request: stats_pb2.GetStatsRequest, context: Any) -> stats_pb2.GetStatsResponse:
        response = stats_pb2.GetStatsResponse(
            requests_in_flight=self._in_flight(), active_sequences=self._active_sequences()
        )
        if self._transport is not None:
            response.pool.CopyFrom(self._transport.stats())
        elif self._pool is not None:
            response.pool.CopyFrom(await self._pool())
        return response


def lease_servicer(transport: Transport) -> tuple[Register, Any, str]:
    return (lease_pb2_grpc.add_LeaseServiceServicer_to_server, LeaseServicer(transport), "epd.v1.LeaseService")


def engine_lease_servicer(leases: EngineLeases) -> tuple[Register, Any, str]:
    return (lease_pb2_grpc.add_LeaseServiceServicer_to_server, EngineLeaseServicer(leases), "epd.v1.LeaseService")


def stats_servicer(
    transport: Transport | None,
    in_flight: Callable[[], int],
    active_sequences: Callable[[], int] = lambda: 0,
    pool: Callable[[], Awaitable[stats_pb2.TransferPoolStats]] | None = None,
) -> tuple[Register, Any, str]:
    return (
        stats_pb2_grpc.add_StatsServiceServicer_to_server,
        StatsServicer(transport, in_flight, active_sequences, pool),
        "epd.v1.StatsService",
    )
