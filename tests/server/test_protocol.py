"""Tests for the generated protocol modules in server/protocol.

* freshness: the committed generated files equal a fresh run of scripts/gen_protos.py;
* compatibility: our descriptors match tritonclient's (Triton's) field by field;
* usability: text_format parsing of real config.pbtxt files, import next to
  tritonclient in either order, and a grpc.aio server built on our modules
  answering a real tritonclient.grpc client.
"""

from __future__ import annotations

import asyncio
import filecmp
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, text_format

from pier.protocol import (
    _pool,
    grpc_service_pb2,
    grpc_service_pb2_grpc,
    health_pb2,
    health_pb2_grpc,
    model_config_pb2,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
GEN_SCRIPT = REPO_ROOT / "scripts" / "gen_protos.py"
PROTOCOL_DIR = REPO_ROOT / "server" / "protocol"

FDP = descriptor_pb2.FieldDescriptorProto


def _load_gen_script():
    spec = importlib.util.spec_from_file_location("pier_gen_protos", GEN_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _triton_modules():
    pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is needed to compare against Triton")
    from tritonclient.grpc import model_config_pb2 as triton_model_config_pb2
    from tritonclient.grpc import service_pb2 as triton_service_pb2

    return triton_model_config_pb2, triton_service_pb2


def _file_proto(module) -> descriptor_pb2.FileDescriptorProto:
    fdp = descriptor_pb2.FileDescriptorProto()
    module.DESCRIPTOR.CopyToProto(fdp)
    return fdp


# --------------------------------------------------------------------------------------
# Freshness
# --------------------------------------------------------------------------------------


def test_generated_files_are_fresh(tmp_path):
    gen = _load_gen_script()
    try:
        from importlib.metadata import version

        import grpc_tools  # noqa: F401

        tools_version = version("grpcio-tools")
    except Exception as exc:  # ImportError / PackageNotFoundError
        pytest.skip(f"grpcio-tools is not available ({exc}); cannot regenerate protocol modules")
    if tools_version != gen.PINNED_GRPCIO_TOOLS:
        pytest.skip(
            f"grpcio-tools {tools_version} installed but the committed modules are generated with "
            f"grpcio-tools=={gen.PINNED_GRPCIO_TOOLS}; output would legitimately differ"
        )

    out = tmp_path / "protocol"
    subprocess.run([sys.executable, str(GEN_SCRIPT), "--out", str(out)], check=True, capture_output=True)

    generated = sorted(p.name for p in out.iterdir())
    assert generated == sorted(gen.OUTPUTS)
    committed = sorted(p.name for p in PROTOCOL_DIR.iterdir() if "_pb2" in p.name and p.is_file())
    assert committed == generated, "stale or missing generated files in server/protocol"
    stale = [name for name in generated if not filecmp.cmp(out / name, PROTOCOL_DIR / name, shallow=False)]
    assert not stale, f"server/protocol is out of date for {stale}; run: python scripts/gen_protos.py"


# --------------------------------------------------------------------------------------
# Descriptor comparison against tritonclient
# --------------------------------------------------------------------------------------


def _collect(fdp: descriptor_pb2.FileDescriptorProto):
    """Map full names to DescriptorProto / EnumDescriptorProto for all (nested) types."""
    messages: dict[str, descriptor_pb2.DescriptorProto] = {}
    enums: dict[str, descriptor_pb2.EnumDescriptorProto] = {}

    def walk(msg, prefix):
        name = f"{prefix}.{msg.name}"
        messages[name] = msg
        for enum in msg.enum_type:
            enums[f"{name}.{enum.name}"] = enum
        for nested in msg.nested_type:
            walk(nested, name)

    pkg = f".{fdp.package}" if fdp.package else ""
    for enum in fdp.enum_type:
        enums[f"{pkg}.{enum.name}"] = enum
    for msg in fdp.message_type:
        walk(msg, pkg)
    return messages, enums


def _field_signature(field: FDP, msg: descriptor_pb2.DescriptorProto, messages) -> dict:
    oneof = None
    if field.HasField("oneof_index"):
        oneof = msg.oneof_decl[field.oneof_index].name
    entry = messages.get(field.type_name) if field.type == FDP.TYPE_MESSAGE else None
    return {
        "number": field.number,
        "type": FDP.Type.Name(field.type),
        "label": FDP.Label.Name(field.label),
        "type_name": field.type_name,  # fully qualified (".inference.X") in both files
        "oneof": oneof,
        "proto3_optional": field.proto3_optional,
        "map": bool(entry is not None and entry.options.map_entry),
        "packed": field.options.packed if field.options.HasField("packed") else None,
        "default_value": field.default_value,
    }


def compare_file_protos(
    theirs: descriptor_pb2.FileDescriptorProto, ours: descriptor_pb2.FileDescriptorProto
) -> list[str]:
    """Every difference that matters on the wire / in text format, as readable lines."""
    problems: list[str] = []
    for attr in ("package", "syntax"):
        if getattr(theirs, attr) != getattr(ours, attr):
            problems.append(
                f"{theirs.name}: {attr} {getattr(theirs, attr)!r} != ours {getattr(ours, attr)!r}"
            )

    t_msgs, t_enums = _collect(theirs)
    o_msgs, o_enums = _collect(ours)

    for name in sorted(t_msgs.keys() - o_msgs.keys()):
        problems.append(f"message {name}: missing in ours")
    for name in sorted(o_msgs.keys() - t_msgs.keys()):
        problems.append(f"message {name}: extra in ours (not in Triton)")
    for name in sorted(t_msgs.keys() & o_msgs.keys()):
        t_msg, o_msg = t_msgs[name], o_msgs[name]
        if t_msg.options.map_entry != o_msg.options.map_entry:
            problems.append(
                f"message {name}: map_entry {t_msg.options.map_entry} != ours {o_msg.options.map_entry}"
            )
        t_fields = {f.name: f for f in t_msg.field}
        o_fields = {f.name: f for f in o_msg.field}
        for fname in sorted(t_fields.keys() - o_fields.keys()):
            problems.append(f"field {name}.{fname}: missing in ours (number {t_fields[fname].number})")
        for fname in sorted(o_fields.keys() - t_fields.keys()):
            problems.append(f"field {name}.{fname}: extra in ours (number {o_fields[fname].number})")
        for fname in sorted(t_fields.keys() & o_fields.keys()):
            t_sig = _field_signature(t_fields[fname], t_msg, t_msgs)
            o_sig = _field_signature(o_fields[fname], o_msg, o_msgs)
            for key in t_sig:
                if t_sig[key] != o_sig[key]:
                    problems.append(f"field {name}.{fname}: {key} {t_sig[key]!r} != ours {o_sig[key]!r}")
        t_oneofs = [o.name for o in t_msg.oneof_decl]
        o_oneofs = [o.name for o in o_msg.oneof_decl]
        if sorted(t_oneofs) != sorted(o_oneofs):
            problems.append(f"message {name}: oneofs {t_oneofs} != ours {o_oneofs}")
        for attr in ("reserved_range", "reserved_name", "extension_range"):
            if list(getattr(t_msg, attr)) != list(getattr(o_msg, attr)):
                problems.append(f"message {name}: {attr} differs")

    for name in sorted(t_enums.keys() - o_enums.keys()):
        problems.append(f"enum {name}: missing in ours")
    for name in sorted(o_enums.keys() - t_enums.keys()):
        problems.append(f"enum {name}: extra in ours (not in Triton)")
    for name in sorted(t_enums.keys() & o_enums.keys()):
        t_vals = {v.name: v.number for v in t_enums[name].value}
        o_vals = {v.name: v.number for v in o_enums[name].value}
        for vname in sorted(t_vals.keys() | o_vals.keys()):
            if t_vals.get(vname) != o_vals.get(vname):
                problems.append(f"enum value {name}.{vname}: {t_vals.get(vname)} != ours {o_vals.get(vname)}")
        if t_enums[name].options.allow_alias != o_enums[name].options.allow_alias:
            problems.append(f"enum {name}: allow_alias differs")

    t_services = {s.name: s for s in theirs.service}
    o_services = {s.name: s for s in ours.service}
    for sname in sorted(t_services.keys() ^ o_services.keys()):
        where = "missing in ours" if sname in t_services else "extra in ours"
        problems.append(f"service {theirs.package}.{sname}: {where}")
    for sname in sorted(t_services.keys() & o_services.keys()):
        t_methods = {m.name: m for m in t_services[sname].method}
        o_methods = {m.name: m for m in o_services[sname].method}
        for mname in sorted(t_methods.keys() ^ o_methods.keys()):
            where = "missing in ours" if mname in t_methods else "extra in ours"
            problems.append(f"rpc {sname}.{mname}: {where}")
        for mname in sorted(t_methods.keys() & o_methods.keys()):
            for attr in ("input_type", "output_type", "client_streaming", "server_streaming"):
                t_val, o_val = getattr(t_methods[mname], attr), getattr(o_methods[mname], attr)
                if t_val != o_val:
                    problems.append(f"rpc {sname}.{mname}: {attr} {t_val!r} != ours {o_val!r}")
    return problems


@pytest.mark.parametrize("which", ["model_config", "grpc_service"])
def test_descriptors_match_triton(which):
    triton_model_config_pb2, triton_service_pb2 = _triton_modules()
    theirs, ours = {
        "model_config": (triton_model_config_pb2, model_config_pb2),
        "grpc_service": (triton_service_pb2, grpc_service_pb2),
    }[which]
    theirs_fdp, ours_fdp = _file_proto(theirs), _file_proto(ours)
    assert theirs_fdp.name == ours_fdp.name
    assert list(theirs_fdp.dependency) == list(ours_fdp.dependency)
    problems = compare_file_protos(theirs_fdp, ours_fdp)
    assert not problems, f"{len(problems)} difference(s) from Triton's {theirs_fdp.name}:\n" + "\n".join(
        problems
    )


def test_descriptor_comparison_detects_changes():
    """Guard against the comparison above silently comparing nothing."""
    triton_model_config_pb2, triton_service_pb2 = _triton_modules()
    theirs = _file_proto(triton_model_config_pb2)
    assert compare_file_protos(theirs, _file_proto(model_config_pb2)) == []

    def mutated(edit):
        fdp = _file_proto(model_config_pb2)
        edit(fdp)
        return compare_file_protos(theirs, fdp)

    def msg(fdp, name):
        return next(m for m in fdp.message_type if m.name == name)

    def field(fdp, msg_name, field_name):
        return next(f for f in msg(fdp, msg_name).field if f.name == field_name)

    def renumber(fdp):
        field(fdp, "ModelConfig", "max_batch_size").number = 99

    def retype(fdp):
        field(fdp, "ModelConfig", "max_batch_size").type = FDP.TYPE_UINT32

    def drop_from_oneof(fdp):
        field(fdp, "ModelConfig", "dynamic_batching").ClearField("oneof_index")

    def drop_field(fdp):
        del msg(fdp, "ModelConfig").field[0]

    def drop_nested(fdp):
        del msg(fdp, "ModelWarmup").nested_type[0]

    def enum_value(fdp):
        fdp.enum_type[0].value[1].number = 42

    assert mutated(renumber) == ["field .inference.ModelConfig.max_batch_size: number 4 != ours 99"]
    assert any("ModelConfig.max_batch_size: type" in p for p in mutated(retype))
    assert any("ModelConfig.dynamic_batching: oneof" in p for p in mutated(drop_from_oneof))
    assert any(p.startswith("field .inference.ModelConfig.name: missing") for p in mutated(drop_field))
    assert any(p.startswith("message .inference.ModelWarmup.Input: missing") for p in mutated(drop_nested))
    assert any(p.startswith("enum value .inference.DataType.TYPE_BOOL") for p in mutated(enum_value))

    service_fdp = _file_proto(grpc_service_pb2)
    stream = next(m for m in service_fdp.service[0].method if m.name == "ModelStreamInfer")
    stream.server_streaming = False
    assert compare_file_protos(_file_proto(triton_service_pb2), service_fdp) == [
        "rpc GRPCInferenceService.ModelStreamInfer: server_streaming True != ours False"
    ]


def test_health_descriptor():
    fdp = _file_proto(health_pb2)
    assert fdp.package == "grpc.health.v1"
    assert fdp.syntax == "proto3"
    request, response = fdp.message_type
    assert (request.name, [(f.name, f.number, f.type) for f in request.field]) == (
        "HealthCheckRequest",
        [("service", 1, FDP.TYPE_STRING)],
    )
    assert response.name == "HealthCheckResponse"
    assert [(f.name, f.number, f.type_name) for f in response.field] == [
        ("status", 1, ".grpc.health.v1.HealthCheckResponse.ServingStatus")
    ]
    assert [(v.name, v.number) for v in response.enum_type[0].value] == [
        ("UNKNOWN", 0),
        ("SERVING", 1),
        ("NOT_SERVING", 2),
        ("SERVICE_UNKNOWN", 3),
    ]
    (service,) = fdp.service
    assert service.name == "Health"
    assert [(m.name, m.client_streaming, m.server_streaming) for m in service.method] == [
        ("Check", False, False),
        ("Watch", False, True),
    ]


# --------------------------------------------------------------------------------------
# Using the modules
# --------------------------------------------------------------------------------------

CLASSIFIER_PBTXT = """
# A typical ONNX image classifier.
name: "resnet50"
platform: "onnxruntime_onnx"
max_batch_size: 8
version_policy: { specific: { versions: [ 1, 3 ] } }
input [
  {
    name: "input"
    data_type: TYPE_FP32
    format: FORMAT_NCHW
    dims: [ 3, 224, 224 ]
  }
]
output [
  {
    name: "probs"
    data_type: TYPE_FP32
    dims: [ 1000 ]
    label_filename: "labels.txt"
  }
]
instance_group [
  {
    count: 2
    kind: KIND_GPU
    gpus: [ 0, 1 ]
  },
  {
    count: 1
    kind: KIND_CPU
  }
]
dynamic_batching {
  preferred_batch_size: [ 4, 8 ]
  max_queue_delay_microseconds: 100
  priority_levels: 2
  default_priority_level: 1
  default_queue_policy {
    timeout_action: DELAY
    default_timeout_microseconds: 5000
    max_queue_size: 64
  }
  priority_queue_policy {
    key: 2
    value: { timeout_action: REJECT }
  }
}
optimization {
  execution_accelerators {
    gpu_execution_accelerator: [
      {
        name: "tensorrt"
        parameters { key: "precision_mode" value: "FP16" }
      }
    ]
  }
  cuda { graphs: true }
}
parameters {
  key: "intra_op_thread_count"
  value: { string_value: "4" }
}
parameters [
  { key: "enable_mem_arena", value { string_value: "1" } }
]
model_warmup [
  {
    name: "zeros"
    batch_size: 4
    inputs {
      key: "input"
      value: {
        data_type: TYPE_FP32
        dims: [ 3, 224, 224 ]
        zero_data: true
      }
    }
  }
]
response_cache { enable: true }
"""

ENSEMBLE_PBTXT = """
name: "pipeline"
platform: "ensemble"
max_batch_size: 8
input [ { name: "RAW" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "SCORES" data_type: TYPE_FP32 dims: [ 1000 ] } ]
ensemble_scheduling {
  step [
    {
      model_name: "preprocess"
      model_version: -1
      input_map { key: "IN" value: "RAW" }
      output_map { key: "OUT" value: "pixels" }
    },
    {
      model_name: "resnet50"
      model_version: -1
      input_map { key: "input" value: "pixels" }
      output_map { key: "probs" value: "SCORES" }
    }
  ]
}
"""


def test_text_format_parses_triton_configs():
    cfg = text_format.Parse(CLASSIFIER_PBTXT, model_config_pb2.ModelConfig())
    assert cfg.name == "resnet50"
    assert cfg.max_batch_size == 8
    assert cfg.version_policy.WhichOneof("policy_choice") == "specific"
    assert list(cfg.version_policy.specific.versions) == [1, 3]
    assert cfg.input[0].data_type == model_config_pb2.TYPE_FP32
    assert cfg.input[0].format == model_config_pb2.ModelInput.FORMAT_NCHW
    assert list(cfg.input[0].dims) == [3, 224, 224]
    assert [(g.kind, g.count, list(g.gpus)) for g in cfg.instance_group] == [
        (model_config_pb2.ModelInstanceGroup.KIND_GPU, 2, [0, 1]),
        (model_config_pb2.ModelInstanceGroup.KIND_CPU, 1, []),
    ]
    assert cfg.WhichOneof("scheduling_choice") == "dynamic_batching"
    db = cfg.dynamic_batching
    assert list(db.preferred_batch_size) == [4, 8]
    assert db.max_queue_delay_microseconds == 100
    assert db.default_queue_policy.timeout_action == model_config_pb2.ModelQueuePolicy.DELAY
    assert db.priority_queue_policy[2].timeout_action == model_config_pb2.ModelQueuePolicy.REJECT
    accel = cfg.optimization.execution_accelerators.gpu_execution_accelerator[0]
    assert (accel.name, dict(accel.parameters)) == ("tensorrt", {"precision_mode": "FP16"})
    assert cfg.optimization.cuda.graphs
    assert {k: v.string_value for k, v in cfg.parameters.items()} == {
        "intra_op_thread_count": "4",
        "enable_mem_arena": "1",
    }
    warm = cfg.model_warmup[0]
    assert (warm.name, warm.batch_size) == ("zeros", 4)
    assert warm.inputs["input"].WhichOneof("input_data_type") == "zero_data"
    assert cfg.response_cache.enable

    ens = text_format.Parse(ENSEMBLE_PBTXT, model_config_pb2.ModelConfig())
    assert ens.WhichOneof("scheduling_choice") == "ensemble_scheduling"
    steps = ens.ensemble_scheduling.step
    assert [(s.model_name, s.model_version) for s in steps] == [("preprocess", -1), ("resnet50", -1)]
    assert dict(steps[0].input_map) == {"IN": "RAW"}
    assert dict(steps[1].output_map) == {"probs": "SCORES"}
    assert ens.input[0].data_type == model_config_pb2.TYPE_STRING

    # JSON view uses the same names the Triton HTTP API returns.
    as_dict = json_format.MessageToDict(cfg, preserving_proto_field_name=True)
    assert as_dict["dynamic_batching"]["preferred_batch_size"] == [4, 8]
    assert as_dict["input"][0]["data_type"] == "TYPE_FP32"
    assert as_dict["parameters"]["intra_op_thread_count"] == {"string_value": "4"}
    assert json_format.ParseDict(as_dict, model_config_pb2.ModelConfig()) == cfg


def test_wire_compatible_with_tritonclient():
    triton_model_config_pb2, triton_service_pb2 = _triton_modules()
    for pbtxt in (CLASSIFIER_PBTXT, ENSEMBLE_PBTXT):
        ours = text_format.Parse(pbtxt, model_config_pb2.ModelConfig())
        theirs = text_format.Parse(pbtxt, triton_model_config_pb2.ModelConfig())
        assert ours.SerializeToString(deterministic=True) == theirs.SerializeToString(deterministic=True)
        assert model_config_pb2.ModelConfig.FromString(theirs.SerializeToString()) == ours

    request = grpc_service_pb2.ModelInferRequest(
        model_name="m",
        id="42",
        parameters={"sequence_id": grpc_service_pb2.InferParameter(uint64_param=7)},
        inputs=[grpc_service_pb2.ModelInferRequest.InferInputTensor(name="x", datatype="FP32", shape=[1, 2])],
        raw_input_contents=[b"\x00" * 8],
    )
    theirs = triton_service_pb2.ModelInferRequest.FromString(request.SerializeToString())
    assert theirs.parameters["sequence_id"].uint64_param == 7
    assert list(theirs.inputs[0].shape) == [1, 2]
    assert grpc_service_pb2.ModelInferRequest.FromString(theirs.SerializeToString()) == request


def test_private_pool():
    assert model_config_pb2.DESCRIPTOR.pool is _pool.POOL
    assert grpc_service_pb2.DESCRIPTOR.pool is _pool.POOL
    assert health_pb2.DESCRIPTOR.pool is _pool.POOL
    assert (
        _pool.POOL.FindMessageTypeByName("inference.ModelConfig") is model_config_pb2.ModelConfig.DESCRIPTOR
    )
    assert model_config_pb2.ModelConfig.__module__ == "pier.protocol.model_config_pb2"
    default_pool = descriptor_pool.Default()
    try:
        found = default_pool.FindMessageTypeByName("inference.ModelConfig")
    except KeyError:
        found = None
    assert found is not model_config_pb2.ModelConfig.DESCRIPTOR


_IMPORT_CHECK = textwrap.dedent(
    """
    import sys
    from google.protobuf import descriptor_pool, text_format

    def ours():
        from pier.protocol import grpc_service_pb2, grpc_service_pb2_grpc, health_pb2_grpc  # noqa: F401
        from pier.protocol import model_config_pb2
        return model_config_pb2

    def triton():
        import tritonclient.grpc  # noqa: F401
        from tritonclient.grpc import model_config_pb2
        return model_config_pb2

    if sys.argv[1] == "triton_first":
        theirs, mine = triton(), ours()
    else:
        mine, theirs = ours(), triton()
    assert mine.ModelConfig.DESCRIPTOR is not theirs.ModelConfig.DESCRIPTOR
    default = descriptor_pool.Default()
    assert default.FindMessageTypeByName("inference.ModelConfig") is theirs.ModelConfig.DESCRIPTOR
    assert default.FindFileByName("model_config.proto") is theirs.DESCRIPTOR
    cfg = text_format.Parse('name: "m" max_batch_size: 2', mine.ModelConfig())
    assert theirs.ModelConfig.FromString(cfg.SerializeToString()).max_batch_size == 2
    print("ok")
    """
)


@pytest.mark.parametrize("impl", ["default", "python"])
@pytest.mark.parametrize("order", ["triton_first", "ours_first"])
def test_import_alongside_tritonclient(order, impl):
    _triton_modules()
    env = dict(os.environ)
    if impl == "python":
        # Pure-Python protobuf registers generated classes differently; make sure the
        # private pool stays private there too.
        env["PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"] = "python"
    proc = subprocess.run(
        [sys.executable, "-W", "error", "-c", _IMPORT_CHECK, order],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


class _Servicer(grpc_service_pb2_grpc.GRPCInferenceServiceServicer):
    async def ServerLive(self, request, context):
        return grpc_service_pb2.ServerLiveResponse(live=True)

    async def ModelConfig(self, request, context):
        cfg = text_format.Parse(CLASSIFIER_PBTXT, model_config_pb2.ModelConfig())
        cfg.name = request.name
        return grpc_service_pb2.ModelConfigResponse(config=cfg)

    async def ModelInfer(self, request, context):
        return grpc_service_pb2.ModelInferResponse(
            model_name=request.model_name,
            id=request.id,
            outputs=[
                grpc_service_pb2.ModelInferResponse.InferOutputTensor(
                    name="OUT", datatype=request.inputs[0].datatype, shape=request.inputs[0].shape
                )
            ],
            raw_output_contents=[request.raw_input_contents[0]],
        )

    async def ModelStreamInfer(self, request_iterator, context):
        async for request in request_iterator:
            yield grpc_service_pb2.ModelStreamInferResponse(
                infer_response=grpc_service_pb2.ModelInferResponse(
                    model_name=request.model_name, id=request.id
                )
            )


class _Health(health_pb2_grpc.HealthServicer):
    async def Check(self, request, context):
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def test_grpc_aio_server_serves_tritonclient():
    pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is needed for the client side")
    import grpc
    import numpy as np
    import tritonclient.grpc as triton_grpc

    async def scenario():
        server = grpc.aio.server()
        grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(_Servicer(), server)
        health_pb2_grpc.add_HealthServicer_to_server(_Health(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            client = triton_grpc.InferenceServerClient(url=f"127.0.0.1:{port}")
            try:
                assert await asyncio.to_thread(client.is_server_live)

                cfg = await asyncio.to_thread(client.get_model_config, "resnet50")
                assert cfg.config.name == "resnet50"
                assert list(cfg.config.dynamic_batching.preferred_batch_size) == [4, 8]
                assert cfg.config.parameters["intra_op_thread_count"].string_value == "4"

                data = np.arange(6, dtype=np.float32).reshape(2, 3)
                infer_input = triton_grpc.InferInput("IN", list(data.shape), "FP32")
                infer_input.set_data_from_numpy(data)
                result = await asyncio.to_thread(client.infer, "echo", [infer_input], request_id="r1")
                np.testing.assert_array_equal(result.as_numpy("OUT"), data)
                assert result.get_response().id == "r1"

                # Unimplemented RPCs surface as UNIMPLEMENTED, not as a crash.
                with pytest.raises(triton_grpc.InferenceServerException, match="UNIMPLEMENTED"):
                    await asyncio.to_thread(client.is_server_ready)
            finally:
                await asyncio.to_thread(client.close)

            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                health = health_pb2_grpc.HealthStub(channel)
                reply = await health.Check(health_pb2.HealthCheckRequest(service=""))
                assert reply.status == health_pb2.HealthCheckResponse.SERVING

                stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
                requests = [grpc_service_pb2.ModelInferRequest(model_name="m", id=str(i)) for i in range(3)]
                call = stub.ModelStreamInfer(iter(requests))
                ids = [response.infer_response.id async for response in call]
                assert ids == ["0", "1", "2"]
        finally:
            await server.stop(None)

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))
