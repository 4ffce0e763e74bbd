"""A real gRPC server between the router and one stage of a real stack (prefill, decode or PD),
for failures that need a precise moment: it forwards every call to the real stage, and a test's
hook may act on a request first (release the embeddings' leases at their encoder, mark a handle
expired) or hold it until the caller gives up (cancel or deadline before decode reads the KV).

It runs its own event loop in a thread of the test process and listens on loopback; the router
reaches it like any stage (it forwards `GetServiceInfo`, so the router's first-contact checks see
the real stage). Each call's outcome (the status code name the stage answered, or "CANCELLED" when
the caller went away) is recorded per request id. The stage may be restarted on its address: calls
wait for the replacement.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from libs.contract.epd.v1 import (
    decode_pb2_grpc,
    lease_pb2,
    lease_pb2_grpc,
    prefill_decode_pb2_grpc,
    prefill_pb2_grpc,
    service_info_pb2_grpc,
)
from libs.rpc.server import channel_options

Hook = Callable[[Any], Awaitable[None]]


class Interposer:
    """Forwards PrefillService, DecodeService, PrefillDecodeService and ServiceInfoService calls to
    `target`; `hooks[method](request)` runs before a call is forwarded (it may mutate the request,
    or never return: the call is then held until the caller cancels it)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.hooks: dict[str, Hook] = {}
        self.outcomes: dict[str, list[str]] = {}  # request id -> outcome of each call, in order
        self.changed = threading.Condition()
        self.address = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="interposer", daemon=True)
        self._server: grpc.aio.Server | None = None
        self._channels: dict[str, grpc.aio.Channel] = {}

    # --- life cycle (called from the test's thread) ---------------------------------------------

    def start(self) -> str:
        self._thread.start()
        self.address = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self.address

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def wait_outcomes(self, request_id: str, count: int, timeout_s: float = 60.0) -> list[str]:
        """The outcomes of `request_id`'s calls once there are `count` of them."""
        with self.changed:
            if not self.changed.wait_for(lambda: len(self.outcomes.get(request_id, [])) >= count, timeout_s):
                raise AssertionError(f"{request_id}: outcomes {self.outcomes.get(request_id)} after {timeout_s} s")
            return list(self.outcomes[request_id])

    def run(self, coroutine: Awaitable[Any], timeout_s: float = 30.0) -> Any:
        """Run a coroutine on the interposer's loop (e.g. a hook's helper) and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout_s)  # type: ignore[arg-type]

    # --- on the interposer's loop ---------------------------------------------------------------

    def channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = grpc.aio.insecure_channel(address, options=channel_options())
        return self._channels[address]

    async def release_leases(self, lease_ids_by_producer: dict[str, list[str]]) -> int:
        """What a producer does when leases expire or are abandoned: free the slots (poisoned)."""
        released = 0
        for address, lease_ids in lease_ids_by_producer.items():
            reply = await lease_pb2_grpc.LeaseServiceStub(self.channel(address)).ReleaseLeases(
                lease_pb2.ReleaseLeasesRequest(lease_ids=lease_ids, reason=lease_pb2.RELEASE_REASON_ABANDONED),
                timeout=10,
            )
            released += reply.released_count
        return released

    def _record(self, request_id: str, outcome: str) -> None:
        with self.changed:
            self.outcomes.setdefault(request_id, []).append(outcome)
            self.changed.notify_all()

    async def _start(self) -> str:
        server = grpc.aio.server(options=channel_options())
        target = self.channel(self.target)
        interposer = self

        async def unary(method: str, call: Callable[..., Any], request: Any, context: Any) -> Any:
            try:
                if method in interposer.hooks:
                    await interposer.hooks[method](request)
                # wait_for_ready: while the stage is between processes (a restart on its port), a
                # call waits for the replacement instead of failing as "connection refused".
                reply = await call(request, timeout=context.time_remaining(), wait_for_ready=True)
            except asyncio.CancelledError:
                interposer._record(request.request_id, "CANCELLED")
                raise
            except grpc.aio.AioRpcError as exc:
                interposer._record(request.request_id, exc.code().name)
                await context.abort(exc.code(), exc.details() or "")
            interposer._record(request.request_id, "OK")
            return reply

        async def stream(method: str, call: Callable[..., Any], request: Any, context: Any) -> AsyncIterator[Any]:
            try:
                if method in interposer.hooks:
                    await interposer.hooks[method](request)
                async for reply in call(request, timeout=context.time_remaining(), wait_for_ready=True):
                    yield reply
            except asyncio.CancelledError:
                interposer._record(request.request_id, "CANCELLED")
                raise
            except grpc.aio.AioRpcError as exc:
                interposer._record(request.request_id, exc.code().name)
                await context.abort(exc.code(), exc.details() or "")
            interposer._record(request.request_id, "OK")

        class Prefill(prefill_pb2_grpc.PrefillServiceServicer):
            async def Prefill(self, request: Any, context: Any) -> Any:
                return await unary("Prefill", prefill_pb2_grpc.PrefillServiceStub(target).Prefill, request, context)

        class Decode(decode_pb2_grpc.DecodeServiceServicer):
            async def Decode(self, request: Any, context: Any) -> AsyncIterator[Any]:
                async for reply in stream("Decode", decode_pb2_grpc.DecodeServiceStub(target).Decode, request, context):
                    yield reply

        class PrefillDecode(prefill_decode_pb2_grpc.PrefillDecodeServiceServicer):
            async def PrefillDecode(self, request: Any, context: Any) -> AsyncIterator[Any]:
                call = prefill_decode_pb2_grpc.PrefillDecodeServiceStub(target).PrefillDecode
                async for reply in stream("PrefillDecode", call, request, context):
                    yield reply

        class ServiceInfo(service_info_pb2_grpc.ServiceInfoServiceServicer):
            async def GetServiceInfo(self, request: Any, context: Any) -> Any:
                stub = service_info_pb2_grpc.ServiceInfoServiceStub(target)
                return await stub.GetServiceInfo(request, timeout=context.time_remaining())

        prefill_pb2_grpc.add_PrefillServiceServicer_to_server(Prefill(), server)
        decode_pb2_grpc.add_DecodeServiceServicer_to_server(Decode(), server)
        prefill_decode_pb2_grpc.add_PrefillDecodeServiceServicer_to_server(PrefillDecode(), server)
        service_info_pb2_grpc.add_ServiceInfoServiceServicer_to_server(ServiceInfo(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self._server = server
        return f"127.0.0.1:{port}"

    async def _stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=None)
        for channel in self._channels.values():
            await channel.close()
