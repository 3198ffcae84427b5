"""python-limit's bare_grpc.py with ModelInfer on a generic handler: the request decoded by
protobuf's C code as before, the answer's bytes written by hand (no response message built and
serialised). The other RPCs are bare_grpc.py's. Usage: python generic_grpc.py PORT PYTHON_LIMIT_DIR"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import grpc
import uvloop
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as rpc


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:  # a length-delimited field: tag, length, bytes
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


NAME_VERSION = _field(1, b"identity_fp32") + _field(2, b"1")  # ModelInferResponse.model_name, .model_version


async def model_infer(request: pb.ModelInferRequest, context: Any) -> bytes:
    i = request.inputs[0]
    output = _field(1, b"OUTPUT0") + _field(2, i.datatype.encode()) + _field(3, b"".join(map(_varint, i.shape)))
    return (NAME_VERSION + (_field(3, request.id.encode()) if request.id else b"") + _field(5, output)
            + _field(6, request.raw_input_contents[0]))  # .id, .outputs, .raw_output_contents


class _Collect:
    """Takes the generated servicer's handlers instead of a server (to replace one of them)."""

    def __init__(self) -> None:
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.handlers.update(handlers)


async def main(port: int, limit_dir: str) -> None:
    sys.path.insert(0, limit_dir)
    import bare_grpc

    collect = _Collect()
    rpc.add_GRPCInferenceServiceServicer_to_server(bare_grpc.Servicer(), collect)
    collect.handlers["ModelInfer"] = grpc.unary_unary_rpc_method_handler(
        model_infer, request_deserializer=pb.ModelInferRequest.FromString)  # no response_serializer: bytes
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("inference.GRPCInferenceService",
                                                                          collect.handlers),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


if __name__ == "__main__":
    uvloop.install()
    asyncio.run(main(int(sys.argv[1]), sys.argv[2]))
