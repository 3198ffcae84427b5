"""The suites: for each qa/L0_* folder, its model repositories and the server starts of its test.sh.

Each builder gets the extracted `qa/` tree (ctx.qa) and returns the groups to run. Comments name the test.sh
step each group reproduces; what cannot run here is a Skip with the reason.
"""

from __future__ import annotations

import shutil
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

from scripts.triton_qa import models as m
from scripts.triton_qa.plan import Check, Group, Pytest, Script, Skip, Unit

NGINX = "needs nginx (basic-auth proxy) in front of the server"
CUDA = "needs CUDA shared memory (GPU)"
TF_INCEPTION = "needs inception_graphdef (TensorFlow backend and the Inception v3 weights)"
CPP = "C++ client/test binary, not part of the python set"


def _py(ctx: SimpleNamespace, script: str, *args: str) -> list[str]:
    return [ctx.py, f"../clients/{script}", *args]


def _repo(path: Path) -> str:
    return f"--model-repository={path}"


def _fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def _docs_models(models: Path, names: list[str]) -> None:
    """Dockerfile.QA: cp docs/examples/model_repository/<name> qa/L0_x/models; then test.sh's
    simple_string_dyna_sequence copy (when simple_dyna_sequence is there)."""
    models.mkdir(parents=True, exist_ok=True)
    for name in names:
        m.docs_example(models, name)
    if "simple_dyna_sequence" in names:
        m.string_dyna_sequence(models)


def _post(url: str, body: str) -> tuple[int, str]:
    req = urllib.request.Request(url, data=body.encode(), method="POST")
    req.add_header("Content-Type", "application/x-www-form-urlencoded")  # what `curl -d` sends
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


# ------------------------------------------------------------------------------------------------ L0_http

_IN = '{"name":"INPUT0","datatype":"INT32","shape":[1,16],"data":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16]}'
_IN1 = _IN.replace("INPUT0", "INPUT1")
_SUM, _DIFF = "[2,4,6,8,10,12,14,16,18,20,22,24,26,28,30,32]", "[0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0]"
_SHAPE_ERR = "{\"error\":\"Unable to parse 'data': Shape does not match true shape of 'data' field\"}"
# (name, body, expected-200, {substring: expected count}) as test.sh's curl + grep -c checks
_CURL = [
    ("json_no_outputs", f'{{"inputs":[{_IN},{_IN1}]}}', True, {_SUM: 1, _DIFF: 1}),
    ("binary_output0_json_output1",
     f'{{"inputs":[{_IN},{_IN1}],"outputs":[{{"name":"OUTPUT0","parameters":{{"binary_data":true}}}},'
     f'{{"name":"OUTPUT1","parameters":{{"binary_data":false}}}}]}}', True, {_SUM: 0, _DIFF: 1}),
    ("binary_output0_default_output1",
     f'{{"inputs":[{_IN},{_IN1}],"outputs":[{{"name":"OUTPUT0","parameters":{{"binary_data":true}}}},'
     f'{{"name":"OUTPUT1"}}]}}', True, {_SUM: 0, _DIFF: 1}),
    ("binary_data_output_no_outputs",
     f'{{"parameters":{{"binary_data_output":true}},"inputs":[{_IN},{_IN1}]}}', True, {_SUM: 0, _DIFF: 0}),
    ("binary_data_output_json_output0",
     f'{{"parameters":{{"binary_data_output":true}},"inputs":[{_IN},{_IN1}],"outputs":[{{"name":"OUTPUT0",'
     f'"parameters":{{"binary_data":false}}}},{{"name":"OUTPUT1"}}]}}', True, {_SUM: 1, _DIFF: 1}),
    ("data_shorter_than_shape",
     '{"inputs":[{"name":"INPUT0","datatype":"INT32","shape":[1,16],"data":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15]}]}',
     False, {_SHAPE_ERR: 1}),
    ("data_longer_than_shape",
     '{"inputs":[{"name":"INPUT0","datatype":"INT32","shape":[1,16],"data":'
     '[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18]}]}', False, {_SHAPE_ERR: 1}),
    ("still_serving_after_bad_requests", f'{{"inputs":[{_IN},{_IN1}]}}', True, {_SUM: 1, _DIFF: 1}),
]


def _curl_check(body: str, ok: bool, counts: dict[str, int]):
    def fn(ctx: SimpleNamespace) -> str | None:
        code, out = _post("http://localhost:8000/v2/models/simple/infer", body)
        problems = []
        if (code == 200) != ok:
            problems.append(f"status {code} (expected {'200' if ok else 'not 200'})")
        for pattern, n in counts.items():
            got = out.count(pattern) and 1  # grep -c counts lines; the body is one line
            if got != n:
                problems.append(f"grep -c {pattern!r} = {got}, expected {n}")
        return None if not problems else "; ".join(problems) + f"; body: {out[:300]}"

    return fn


def l0_http(ctx: SimpleNamespace) -> list[Group]:
    d = ctx.qa / "L0_http"
    models = d / "models"
    _docs_models(models, ["simple", "simple_dyna_sequence", "simple_identity", "simple_sequence", "simple_string",
                          "inception_graphdef"])
    g: list[Group] = []
    first: list = [Script("simple_http_health_metadata.py", _py(ctx, "simple_http_health_metadata.py", "-v"))]
    for script in ["simple_http_aio_infer_client.py", "simple_http_infer_client.py",
                   "simple_http_async_infer_client.py"]:
        first.append(Script(script, _py(ctx, script, "-v")))
    first += [Skip("image_client.py[async]", TF_INCEPTION), Skip("image_client.py", TF_INCEPTION)]
    for script in ["simple_http_shm_string_client.py", "simple_http_shm_client.py"]:
        first.append(Script(script, _py(ctx, script, "-v")))
    first.append(Skip("simple_http_cudashm_client.py", CUDA))
    for script in ["simple_http_string_infer_client.py", "simple_http_sequence_sync_infer_client.py"]:
        first.append(Script(script, _py(ctx, script, "-v")))
    first.append(Script("reuse_infer_objects_client.py", _py(ctx, "reuse_infer_objects_client.py", "-v")))
    first.append(Script("simple_http_infer_client.py[base_path_url]",
                        _py(ctx, "simple_http_infer_client.py", "-u", "localhost:8000/base_path", "-v"),
                        expect_rc0=False, grep_min={"POST /base_path/v2/models/simple/infer": 1}))
    first.append(Unit("http_client_plugin_test.py"))
    first += [Skip("http_basic_auth_test.py::HTTPBasicAuthTest::test_client_call", NGINX),
              Skip("http_basic_auth_test.py::HTTPBasicAuthAsyncTest::test_client_call", NGINX)]
    g.append(Group(d, [_repo(models)], first, label="models"))
    g.append(Group(d, [_repo(models), "--model-control-mode=explicit"], [
        Script("simple_http_model_control.py", _py(ctx, "simple_http_model_control.py", "-v"),
               grep_eq={"PASS": 1}, server_log_min={"Invalid config override": 1})], label="explicit"))
    g.append(Group(d, [_repo(models)], [
        Script("simple_http_sequence_sync_infer_client.py[-d]",
               _py(ctx, "simple_http_sequence_sync_infer_client.py", "-v", "-d"))], label="dyna"))
    g.append(Group(d, [_repo(models)], [Check(f"curl::{name}", _curl_check(body, ok, counts))
                                         for name, body, ok, counts in _CURL], label="binaryjson"))
    g.append(Group(d, [], [Skip("cc_client_test[HTTP*]", CPP)], no_server=True))
    g.append(Group(d, [_repo(models)], [Unit("python_http_aio_test.py")], label="aio"))
    # python_unit_test_models for http_test.py
    pum = _fresh(d / "python_unit_test_models")
    for name in ["onnx_zero_1_float32", "onnx_zero_1_object", "onnx_zero_1_float16", "onnx_zero_3_float32"]:
        m.qa_identity(pum, name)
    one = pum / "onnx_zero_1_object_1_element"
    shutil.copytree(pum / "onnx_zero_1_object", one)
    cfg = (one / "config.pbtxt").read_text().replace("onnx_zero_1_object", "onnx_zero_1_object_1_element")
    (one / "config.pbtxt").write_text(cfg.replace("-1", "1", 1))  # sed "0,/-1/{s/-1/1/}"
    queue = pum / "onnx_zero_1_float32_queue"
    shutil.copytree(pum / "onnx_zero_1_float32", queue)
    cfg = (queue / "config.pbtxt").read_text().replace("onnx_zero_1_float32", "onnx_zero_1_float32_queue")
    cfg += ("dynamic_batching { \n    max_queue_delay_microseconds: 1000000\n    preferred_batch_size: [ 8 ]\n"
            "    default_queue_policy {\n        max_queue_size: 1\n    }\n}\n")
    (queue / "config.pbtxt").write_text(cfg)
    g.append(Group(d, [_repo(pum)], [Unit("http_test.py")], label="http_test"))
    g.append(Group(d, [_repo(d / "generate_models")], [Unit("generate_endpoint_test.py")], label="generate"))
    g.append(Group(d, [_repo(models), "--http-restricted-api=model-repository,health:k1=v1",
                       "--http-restricted-api=metadata,health:k2=v2"], [],
                   expect_start_failure="api 'health' can not be specified in multiple config groups",
                   label="restricted_api_repeated"))
    g.append(Group(d, [_repo(models), "--http-restricted-api=model-reposit,health:k1=v1",
                       "--http-restricted-api=metadata,health:k2=v2"], [],
                   expect_start_failure="unknown restricted api 'model-reposit'", label="restricted_api_unknown"))
    g.append(Group(d, [_repo(models), "--http-restricted-api=model-repository:admin-key=admin-value",
                       "--http-restricted-api=inference,metadata:infer-key=infer-value"],
                   [Unit("http_restricted_api_test.py", ["RestrictedAPITest"])], label="restricted_api"))
    return g


# ------------------------------------------------------------------------------------------------ L0_grpc


def l0_grpc(ctx: SimpleNamespace) -> list[Group]:
    d = ctx.qa / "L0_grpc"
    models = d / "models"
    _docs_models(models, ["simple", "simple_dyna_sequence", "simple_int8", "simple_identity", "simple_sequence",
                          "simple_string", "inception_graphdef"])
    first: list = [Script("simple_grpc_health_metadata.py", _py(ctx, "simple_grpc_health_metadata.py", "-v"))]
    for script in ["simple_grpc_aio_infer_client.py", "simple_grpc_aio_sequence_stream_infer_client.py",
                   "simple_grpc_infer_client.py", "simple_grpc_async_infer_client.py",
                   "simple_grpc_string_infer_client.py", "image_client.py",
                   "simple_grpc_sequence_stream_infer_client.py", "simple_grpc_sequence_sync_infer_client.py",
                   "simple_grpc_shm_string_client.py", "simple_grpc_shm_client.py", "simple_grpc_cudashm_client.py",
                   "simple_grpc_keepalive_client.py", "simple_grpc_custom_args_client.py",
                   "grpc_explicit_byte_content_client.py", "grpc_explicit_int_content_client.py",
                   "grpc_explicit_int8_content_client.py", "grpc_client.py", "grpc_image_client.py"]:
        if "image_client" in script:
            first += [Skip(f"{script}[{v}]", TF_INCEPTION) for v in ("async", "streaming", "sync")]
        elif "cudashm" in script:
            first.append(Skip(script, CUDA))
        else:
            first.append(Script(script, _py(ctx, script, "-v"), grep_eq={"PASS": 1}))
    first.append(Script("reuse_infer_objects_client.py[grpc]",
                        _py(ctx, "reuse_infer_objects_client.py", "-v", "-i", "grpc", "-u", "localhost:8001")))
    g = [Group(d, [_repo(models)], first, label="models")]
    g.append(Group(d, [_repo(d / "client_plugin_models"), "--http-header-forward-pattern=.*",
                       "--grpc-header-forward-pattern=.*"],
                   [Unit("grpc_client_plugin_test.py"),
                    Skip("grpc_basic_auth_test.py::GRPCBasicAuthTest::test_client_call", NGINX),
                    Skip("grpc_basic_auth_test.py::GRPCBasicAuthAsyncTest::test_client_call", NGINX)],
                   label="client_plugin"))
    # `export GRPC_TRACE=compression, channel` sets GRPC_TRACE to "compression," (and exports `channel`).
    trace = {"GRPC_TRACE": "compression,", "GRPC_VERBOSITY": "DEBUG"}
    g.append(Group(d, [_repo(models), "--grpc-infer-response-compression-level=high"], [
        Script("simple_grpc_infer_client.py[-C deflate]",
               _py(ctx, "simple_grpc_infer_client.py", "-v", "-C", "deflate"),
               env=trace, grep_min={"Compressed[deflate]": 1})], env=trace, label="compression"))
    g.append(Group(d, [_repo(models), "--model-control-mode=explicit"], [
        Script("simple_grpc_model_control.py", _py(ctx, "simple_grpc_model_control.py", "-v"),
               grep_eq={"PASS": 1}, server_log_min={"Invalid config override": 1})], label="explicit"))
    g.append(Group(d, [_repo(models)], [
        Script("simple_grpc_sequence_stream_infer_client.py[-d]",
               _py(ctx, "simple_grpc_sequence_stream_infer_client.py", "-v", "-d")),
        Script("simple_grpc_sequence_sync_infer_client.py[-d]",
               _py(ctx, "simple_grpc_sequence_sync_infer_client.py", "-v", "-d"))], label="dyna"))
    g.append(Group(d, [], [Skip("cc_client_test[GRPC*]", CPP)], no_server=True))
    g.append(Group(d, [_repo(models)], [Unit("python_grpc_aio_test.py")], label="aio"))
    g.append(Group(d, [_repo(models), "--grpc-restricted-protocol=model-repository,health:k1=v1",
                       "--grpc-restricted-protocol=metadata,health:k2=v2"], [],
                   expect_start_failure="protocol 'health' can not be specified in multiple config groups",
                   label="restricted_protocol_repeated"))
    g.append(Group(d, [_repo(models), "--grpc-restricted-protocol=model-reposit,health:k1=v1",
                       "--grpc-restricted-protocol=metadata,health:k2=v2"], [],
                   expect_start_failure="unknown restricted protocol 'model-reposit'",
                   label="restricted_protocol_unknown"))
    g.append(Group(d, [_repo(models), "--grpc-restricted-protocol=model-repository:admin-key=admin-value",
                       "--grpc-restricted-protocol=inference,health:infer-key=infer-value"],
                   [Unit("python_unit_test.py", ["RestrictedProtocolTest"])], label="restricted_protocol"))
    return g


# ------------------------------------------------------------------------------------------------ others


def l0_input_validation(ctx: SimpleNamespace) -> list[Group]:
    d = ctx.qa / "L0_input_validation"
    models = d / "models"
    m.docs_example(models, "simple_identity")  # Dockerfile.QA
    g = [Group(d, [_repo(models)], [Pytest("input_validation_test.py", ["InputValTest"], expect_min=5)],
               label="InputValTest")]
    m.pt_identity(models)
    m.graphdef_object_int32_int32(models)
    g.append(Group(d, [_repo(models)], [
        Pytest("input_validation_test.py", ["InputShapeTest::test_input_shape_validation",
                                            "InputShapeTest::test_input_string_shape_validation"], expect_min=2),
        Skip("input_validation_test.py::InputShapeTest::test_wrong_input_shape_tensor_size",
             "needs TensorRT shape-tensor models (plan_*_zero_1_float32_int32)")], label="InputShapeTest"))
    g.append(Group(d, [], [Skip("input_byte_size_test", CPP)], no_server=True))
    return g


def l0_parameters(ctx: SimpleNamespace) -> list[Group]:
    d = ctx.qa / "L0_parameters"
    repo = d / "model_repository"
    for name in ("identity", "ensemble"):
        (repo / name / "1").mkdir(parents=True, exist_ok=True)
    m.python_backend_for(repo / "identity")  # backend "identity" (C++ test backend)
    g = []
    for test in ["test_params", "test_headers", "test_header_forward_pattern_case_insensitive",
                 "test_grpc_header_forward_pattern_case_sensitive"]:
        flags = [f"--model-repository={repo}", "--exit-timeout-secs=120"]
        if test == "test_headers":
            flags += ["--grpc-header-forward-pattern", "my_header.*", "--http-header-forward-pattern", "my_header.*"]
        elif test == "test_header_forward_pattern_case_insensitive":
            flags += ["--grpc-header-forward-pattern", "MY_HEADER.*", "--http-header-forward-pattern", "MY_HEADER.*"]
        elif test == "test_grpc_header_forward_pattern_case_sensitive":
            flags += ["--grpc-header-forward-pattern", "(?-i)MY_HEADER.*"]
        g.append(Group(d, flags, [Unit("parameters_test.py", env={"TEST_HEADER": test}, suffix=f"[{test}]")],
                       label=test))
    return g


SHM_TESTS = ["test_invalid_create_shm", "test_valid_create_set_register", "test_unregister_before_register",
             "test_unregister_after_register", "test_reregister_after_register", "test_unregister_after_inference",
             "test_register_after_inference", "test_too_big_shm", "test_mixed_raw_shm", "test_unregisterall",
             "test_infer_offset_out_of_bound", "test_infer_byte_size_out_of_bound", "test_register_out_of_bound",
             "test_python_client_leak"]


def l0_shared_memory(ctx: SimpleNamespace) -> list[Group]:
    d = ctx.qa / "L0_shared_memory"
    models = d / "models"
    m.docs_example(models, "simple")
    g = []
    for test in SHM_TESTS:
        for client in ("http", "grpc"):
            g.append(Group(d, [_repo(models), "--log-verbose=1"],
                           [Unit("shared_memory_test.py", [f"SharedMemoryTest.{test}"], [f"SharedMemoryTest.{test}"],
                                 env={"CLIENT_TYPE": client}, suffix=f"[{client}]")],
                           server_exit_zero=True, label=f"{test}.{client}"))
    pm = d / "python_models" / "simple"
    (pm / "1").mkdir(parents=True, exist_ok=True)
    shutil.copy(ctx.qa / "python_models/execute_delayed_model/model.py", pm / "1" / "model.py")
    shutil.copy(ctx.qa / "python_models/execute_delayed_model/config.pbtxt", pm / "config.pbtxt")
    for client in ("http", "grpc"):
        t = f"TestSharedMemoryUnregister.test_unregister_shm_during_inference_{client}"
        g.append(Group(d, [_repo(d / "python_models"), "--log-verbose=1"],
                       [Unit("shared_memory_test.py", [t], [t], env={"CLIENT_TYPE": client})],
                       server_exit_zero=True, label=f"unregister_shm.{client}"))
    return g


OPTIONAL_TESTS = ["test_all_inputs", "test_optional_same_input", "test_optional_mix_inputs",
                  "test_optional_mix_inputs_2", "test_ensemble_all_inputs", "test_ensemble_optional_same_input",
                  "test_ensemble_optional_mix_inputs", "test_ensemble_optional_mix_inputs_2",
                  "test_ensemble_optional_pipeline", "test_ensemble_optional_connecting_tensor"]


def l0_optional_input(ctx: SimpleNamespace) -> list[Group]:
    d = ctx.qa / "L0_optional_input"
    models = d / "models"
    for name in ("identity_2_float32", "ensemble_identity_2_float32", "pipeline_identity_2_float32",
                 "optional_connecting_tensor"):
        (models / name / "1").mkdir(parents=True, exist_ok=True)
    m.python_backend_for(models / "identity_2_float32")  # backend "identity"
    return [Group(d, [_repo(models), "--log-verbose=1"],
                  [Unit("optional_input_test.py", [f"OptionalInputTest.{t}"], [f"OptionalInputTest.{t}"])], label=t)
            for t in OPTIONAL_TESTS]


def l0_simple_ensemble(ctx: SimpleNamespace) -> list[Group]:
    d = ctx.qa / "L0_simple_ensemble"
    models = d / "models"
    (models / "ensemble_add_sub_int32_int32_int32" / "1").mkdir(parents=True, exist_ok=True)
    # Dockerfile.QA puts simple's model.graphdef in versions 1 and 2 of the suite's own `simple` config.
    for v in ("1", "2"):
        (models / "simple" / v).mkdir(parents=True, exist_ok=True)
    m.python_backend_for(models / "simple", m.ADD_SUB_PY)
    return [Group(d, [_repo(models)], [Unit("ensemble_test.py", [f"EnsembleTest.{t}"], [f"EnsembleTest.{t}"])],
                  label=t)
            for t in ["test_ensemble_add_sub", "test_ensemble_sequence_flags", "test_ensemble_add_sub_one_output"]]


REPEAT_NON_DECOUPLED_PY = '''\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Triton's C++ `repeat` test backend without a decoupled policy: one response per request, carrying the
    first element of IN (IDX 0); the C++ backend sends the rest too, which Triton drops."""

    def execute(self, requests):
        responses = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT", values[:1].astype(np.int32)),
                pb_utils.Tensor("IDX", np.zeros([1], dtype=np.uint32))]))
        return responses
'''


def _repeat_from_src_test(ctx: SimpleNamespace, dest: Path) -> None:
    """src/test/models/repeat_int32 (C++ repeat backend) as a python model: the same config with
    backend python, and python_backend's examples/decoupled/repeat_model.py."""
    (dest / "1").mkdir(parents=True, exist_ok=True)
    (dest / "config.pbtxt").write_text(ctx.repeat_src_config.replace('backend: "repeat"', 'backend: "python"'))
    shutil.copy(ctx.pyexamples / "repeat_model.py", dest / "1" / "model.py")


DECOUPLED_TESTS = ["test_one_to_none", "test_one_to_one", "test_one_to_many", "test_no_streaming",
                   "test_response_order", "test_wrong_shape"]


def l0_decoupled(ctx: SimpleNamespace) -> list[Group]:
    d = ctx.qa / "L0_decoupled"
    models = d / "models"
    for name in ("repeat_int32", "square_int32", "identity_int32", "simple_repeat", "fan_repeat",
                 "sequence_repeat", "repeat_square", "nested_square"):
        (models / name / "1").mkdir(parents=True, exist_ok=True)
    m.python_backend_for(models / "identity_int32")  # backend "identity"
    pym = d / "python_models"
    shutil.rmtree(pym, ignore_errors=True)
    shutil.copytree(models, pym)  # Dockerfile.QA: cp -r models python_models + the python_backend examples
    for name, base in (("repeat_int32", "repeat"), ("square_int32", "square")):
        shutil.copy(ctx.pyexamples / f"{base}_model.py", pym / name / "1" / "model.py")
        shutil.copy(ctx.pyexamples / f"{base}_config.pbtxt", pym / name / "config.pbtxt")
    m.libtorch_nobatch_int32(pym)  # test.sh: cp $DATADIR/libtorch_nobatch_int32_int32_int32 + sed dims [ 1 ]
    # (the python repeat model serves one request at a time and waits WAIT ms in each: some tests take minutes)
    steps: list = [Unit("decoupled_test.py", [f"DecoupledTest.{t}"], [f"DecoupledTest.{t}"], suffix="[python]",
                        timeout=1200) for t in DECOUPLED_TESTS]
    steps.append(Unit("decoupled_test.py", ["DecoupledTest.test_one_to_multi_many"],
                      ["DecoupledTest.test_one_to_multi_many"], env={"TRITONSERVER_DELAY_GRPC_RESPONSE": "2000"},
                      suffix="[python]", timeout=1200))
    g = [Group(d, [_repo(pym)], steps, label="python")]
    g.append(Group(d, [], [Skip(f"decoupled_test.py::DecoupledTest::{t}[custom]",
                                "the 'custom' trial needs Triton's C++ repeat/square test backends")
                           for t in [*DECOUPLED_TESTS, "test_one_to_multi_many"]], no_server=True))
    nd = _fresh(d / "non_decoupled_models")
    _repeat_from_src_test(ctx, nd / "repeat_int32")
    cfg = nd / "repeat_int32" / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace("decoupled: True", "decoupled: False"))
    (nd / "repeat_int32" / "1" / "model.py").write_text(REPEAT_NON_DECOUPLED_PY)
    g.append(Group(d, [_repo(nd)], [Unit("decoupled_test.py", ["NonDecoupledTest"],
                                         ["NonDecoupledTest.test_grpc", "NonDecoupledTest.test_http"])],
                   label="non_decoupled"))
    return g


def _state_release(log: Path) -> str | None:
    text = log.read_text(errors="replace") if log.exists() else ""
    new, rel = text.count("StateNew"), text.count("StateRelease")
    return None if new == rel else f"{new} StateNew vs {rel} StateRelease in the server log"


CLEANUP_TESTS = ["test_simple_infer", "test_simple_infer_cancellation", "test_simple_infer_timeout",
                 "test_streaming_infer", "test_streaming_timeout", "test_streaming_cancellation",
                 "test_decoupled_infer", "test_decoupled_cancellation", "test_decoupled_timeout",
                 "test_non_decoupled_streaming_multi_response"]
CLEANUP_ERROR_TESTS = ["test_simple_infer_error_status", "test_streaming_error_status", "test_decoupled_error_status"]
CLEANUP_SHUTDOWN_TESTS = ["test_simple_infer_shutdownserver", "test_streaming_infer_shutdownserver",
                          "test_decoupled_infer_shutdownserver", "test_decoupled_infer_with_params_shutdownserver"]


def l0_grpc_state_cleanup(ctx: SimpleNamespace) -> list[Group]:
    d = ctx.qa / "L0_grpc_state_cleanup"
    models = _fresh(d / "models")
    _repeat_from_src_test(ctx, models / "repeat_int32")  # Dockerfile.QA: src/test/models/repeat_int32
    czf = models / "custom_zero_1_float32"
    shutil.copytree(ctx.qa / "custom_models" / "custom_zero_1_float32", czf)
    (czf / "1").mkdir(exist_ok=True)
    with open(czf / "config.pbtxt", "a") as f:
        f.write('parameters [\n{ key: "execute_delay_ms"; value: { string_value: "1000" }}\n]\n')
    m.python_backend_for(czf)  # backend "identity"
    nd = models / "repeat_int32_non_decoupled"
    shutil.copytree(models / "repeat_int32", nd)
    lines = (nd / "config.pbtxt").read_text().splitlines(keepends=True)
    i = next(k for k, line in enumerate(lines) if "model_transaction_policy" in line)
    del lines[i:i + 3]  # sed "/model_transaction_policy/,+2d"
    (nd / "config.pbtxt").write_text("".join(lines).replace("repeat_int32", "repeat_int32_non_decoupled"))
    (nd / "1" / "model.py").write_text(REPEAT_NON_DECOUPLED_PY)

    def group(test: str, extra: list[str], **kw) -> Group:
        return Group(d, [_repo(models), "--log-verbose=2", *extra],
                     [Unit("cleanup_test.py", [f"CleanUpTest.{test}"], [f"CleanUpTest.{test}"])],
                     after_stop=[Check(f"cleanup_test.py::CleanUpTest::{test}",
                                       lambda ctx: _state_release(ctx.server_log))],
                     label=test, **kw)

    g = [group(t, []) for t in CLEANUP_TESTS]
    g += [group(t, ["--grpc-restricted-protocol=inference:infer-key=infer-value"]) for t in CLEANUP_ERROR_TESTS]
    g += [group(t, [], server_pid_env=True, wait_server_exit=True) for t in CLEANUP_SHUTDOWN_TESTS]
    g.append(group("test_decoupled_infer_complete", [], env={"TRITONSERVER_DELAY_GRPC_COMPLETE": "2000"},
                   server_log_env=True))
    return g


def l0_model_namespacing(ctx: SimpleNamespace) -> list[Group]:
    d = ctx.qa / "L0_model_namespacing"
    env = {"TRITON_QA_ROOT_DIR": str(ctx.qa), "TRITON_QA_PYTHON_MODEL_DIR": str(d), "PYTHONDONTWRITEBYTECODE": "1"}
    tests = ["test_duplication", "test_dynamic_resolution", "test_ensemble_duplication", "test_no_duplication"]
    for test in tests:
        for model_dir in (d / test).glob("*/*"):
            (model_dir / "1").mkdir(exist_ok=True)
    td = d / "test_dir"
    repo = ["--model-namespacing=true", f"--model-repository={td}/addsub_repo", f"--model-repository={td}/subadd_repo"]
    g = []
    for suite, mode in (("ModelNamespacePoll", ["--model-control-mode=POLL", "--repository-poll-secs=2"]),
                        ("ModelNamespaceExplicit", ["--model-control-mode=EXPLICIT"])):
        for test in tests:
            def prepare(ctx: SimpleNamespace, test: str = test) -> None:
                shutil.rmtree(td, ignore_errors=True)
                shutil.copytree(d / test, td)

            g.append(Group(d, repo + mode, [Unit("test.py", [f"{suite}.{test}"], [f"{suite}.{test}"],
                                                 env={**env, "NAMESPACE_TESTING_DIRCTORY": str(td)})],
                           env=env, label=f"{suite}.{test}", prepare=prepare))
    return g


def l0_logging(ctx: SimpleNamespace) -> list[Group]:
    d = ctx.qa / "L0_logging"
    log_models = _fresh(d / "log_models")
    m.onnx_int32_as_simple(log_models)
    g = [Group(d, [], [Skip("test.sh shell checks (log settings/file/verbosity via C++ clients)", CPP)],
               no_server=True)]
    g.append(Group(d, [_repo(log_models)], [Unit("logging_endpoint_test.py")], label="logging_endpoint"))
    # log_format_test.py launches `tritonserver` itself (from PATH: the runner's shim for the server under test).
    g.append(Group(d, [], [Pytest("log_format_test.py", expect_min=12, env={"PATH": f"{ctx.bindir}:{ctx.path}"},
                                  timeout=900, case_timeout=120)], no_server=True, label="log_format"))
    return g


def python_backend_decoupled(ctx: SimpleNamespace) -> list[Group]:
    """python_backend examples/decoupled: repeat/square models served, their clients run (README steps)."""
    d = ctx.qa / "python_backend_decoupled"
    repo = _fresh(d / "models")
    for name, base in (("repeat_int32", "repeat"), ("square_int32", "square")):
        (repo / name / "1").mkdir(parents=True)
        shutil.copy(ctx.pyexamples / f"{base}_model.py", repo / name / "1" / "model.py")
        shutil.copy(ctx.pyexamples / f"{base}_config.pbtxt", repo / name / "config.pbtxt")
    steps = [Script(f"{base}_client.py", [ctx.py, str(ctx.pyexamples / f"{base}_client.py")],
                    grep_min={"PASS": 1}) for base in ("repeat", "square")]
    return [Group(d, [_repo(repo)], steps, label="decoupled_examples")]


SUITES = {
    "L0_http": l0_http,
    "L0_grpc": l0_grpc,
    "L0_input_validation": l0_input_validation,
    "L0_parameters": l0_parameters,
    "L0_shared_memory": l0_shared_memory,
    "L0_optional_input": l0_optional_input,
    "L0_simple_ensemble": l0_simple_ensemble,
    "L0_decoupled": l0_decoupled,
    "L0_grpc_state_cleanup": l0_grpc_state_cleanup,
    "L0_model_namespacing": l0_model_namespacing,
    "L0_logging": l0_logging,
    "python_backend_decoupled": python_backend_decoupled,
}
