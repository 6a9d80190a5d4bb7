"""The gRPC server (grpc.aio) beside the HTTP one: started by the app's lifespan (server/app.py) on
the same event loop, over the same ServerState, so both APIs share one engine and one admission."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from ruvllm.grpc import ruvllm_pb2 as pb
from ruvllm.grpc.api import SERVICE, GenerationAPI, Malformed
from ruvllm.server.config import ServerConfig
from ruvllm.server.model_pool import ModelPool


def _lenient(kind: type) -> Callable[[bytes], Any]:
    """The message, or a Malformed that its method answers INVALID_ARGUMENT (bytes that are no message,
    a string that is not UTF-8)."""

    def parse(data: bytes) -> Any:
        try:
            return kind.FromString(data)
        except (DecodeError, ValueError) as exc:
            return Malformed(str(exc) or type(exc).__name__)

    return parse


def handlers(api: GenerationAPI) -> grpc.GenericRpcHandler:
    """ruvllm.proto's service, by hand rather than through the generated servicer: its deserializers
    are the lenient ones above."""

    def unary(fn: Callable, request: type, response: type) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(fn, request_deserializer=_lenient(request),
                                                   response_serializer=response.SerializeToString)

    return grpc.method_handlers_generic_handler(SERVICE, {
        "Generate": unary(api.generate, pb.GenerateRequest, pb.GenerateResponse),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            api.generate_stream, request_deserializer=_lenient(pb.GenerateRequest),
            response_serializer=pb.GenerateChunk.SerializeToString),
        "ListModels": unary(api.list_models, pb.ListModelsRequest, pb.ListModelsResponse),
        "Health": unary(api.health, pb.HealthRequest, pb.HealthResponse),
    })


def address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def start_grpc(pool: ModelPool, cfg: ServerConfig, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """A started gRPC server on host:port (0: any free port), and the port it bound. OSError when it
    cannot bind."""
    server = grpc.aio.server(options=(
        # gRPC's default lets a second server bind a port already served (SO_REUSEPORT), and the
        # kernel then splits the connections between the two: a port in use must fail instead
        ("grpc.so_reuseport", 0),
        # the HTTP server's body limit (--max-request-bytes); past it gRPC answers RESOURCE_EXHAUSTED
        ("grpc.max_receive_message_length", cfg.max_request_bytes),
    ))
    server.add_generic_rpc_handlers((handlers(GenerationAPI(pool, cfg)),))
    where = address(host, port)
    try:
        bound = server.add_insecure_port(where)
    except RuntimeError as exc:
        raise OSError(f"cannot listen for gRPC on {where}: {exc}") from None
    if not bound:  # older grpcio report a failed bind as port 0
        raise OSError(f"cannot listen for gRPC on {where}")
    await server.start()
    return server, bound
