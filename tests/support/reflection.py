"""A reflection client that does what `grpcurl describe` does: list a server's services, then
resolve each one's schema from the files reflection returns (file_containing_symbol, then any
dependency by file name), in a descriptor pool of its own. Either protocol: v1 or v1alpha."""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection_pb2

PROTOCOLS = ("grpc.reflection.v1", "grpc.reflection.v1alpha")


def describe(address: str, protocol: str) -> dict[str, list[str]]:
    """Every listed service -> its method names, resolved through reflection's `protocol`.
    Raises LookupError naming the symbol or file reflection could not give."""
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream(
            f"/{protocol}.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )

        def ask(request: reflection_pb2.ServerReflectionRequest) -> reflection_pb2.ServerReflectionResponse:
            (reply,) = list(call(iter([request]), timeout=10))
            if reply.HasField("error_response"):
                raise LookupError(f"{protocol}: {reply.error_response.error_message}")
            return reply

        listed = ask(reflection_pb2.ServerReflectionRequest(list_services=""))
        names = [service.name for service in listed.list_services_response.service]
        files: dict[str, descriptor_pb2.FileDescriptorProto] = {}

        def learn(reply: reflection_pb2.ServerReflectionResponse) -> None:
            for data in reply.file_descriptor_response.file_descriptor_proto:
                proto = descriptor_pb2.FileDescriptorProto.FromString(data)
                files.setdefault(proto.name, proto)

        for name in names:
            learn(ask(reflection_pb2.ServerReflectionRequest(file_containing_symbol=name)))
        missing = {dep for proto in files.values() for dep in proto.dependency} - set(files)
        while missing:
            learn(ask(reflection_pb2.ServerReflectionRequest(file_by_filename=missing.pop())))
            missing = {dep for proto in files.values() for dep in proto.dependency} - set(files)
    pool = descriptor_pool.DescriptorPool()
    added: set[str] = set()
    while len(added) < len(files):  # each file after its dependencies
        for proto in files.values():
            if proto.name not in added and set(proto.dependency) <= added:
                pool.Add(proto)
                added.add(proto.name)
    return {name: [method.name for method in pool.FindServiceByName(name).methods] for name in names}
