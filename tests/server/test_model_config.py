"""config.pbtxt parsing, completion and validation; version policies; request validation."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from pier.contract.errors import ErrorCode, PierError
from pier.contract.types import InferenceRequest, RequestedOutput, Tensor
from pier.protocol import model_config_pb2 as mc
from pier.repository import model_config
from pier.repository import spec as spec_of
from pier.repository.version_policy import select_versions
from pier.tensors.validation import check_parameters, validate_request

GOOD = """
name: "m"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]
dynamic_batching { max_queue_delay_microseconds: 100 }
instance_group [ { count: 2 kind: KIND_CPU }, { kind: KIND_AUTO } ]
"""


def _no_describe(entry, path):
    return None


def complete(text: str, name: str = "m", auto: bool = True) -> mc.ModelConfig:
    raw = model_config.parse_config_text(text, "/repo/m/config.pbtxt")
    return model_config.complete_config(raw, name, [], "/repo/m/config.pbtxt", auto, _no_describe)


def test_syntax_error_names_file_line_and_column():
    with pytest.raises(PierError) as err:
        model_config.parse_config_text('name: "m"\nmax_batch_size: 8\ninput [ { nme: "x" } ]\n', "/r/m/config.pbtxt")
    assert err.value.code is ErrorCode.INVALID_ARG
    assert "/r/m/config.pbtxt:3:" in err.value.message and "nme" in err.value.message


def test_completion_fills_what_triton_fills():
    c = complete(GOOD)
    assert c.backend == "onnxruntime" and c.default_model_filename == "model.onnx"
    assert c.version_policy.latest.num_versions == 1
    assert [g.name for g in c.instance_group] == ["m_0", "m_1"]
    assert c.instance_group[1].kind == mc.ModelInstanceGroup.KIND_CPU and c.instance_group[1].count == 1
    assert list(c.dynamic_batching.preferred_batch_size) == [8]
    j = spec_of.config_to_json(c)
    assert j["input"][0]["dims"] == [-1, 4]  # int64 as JSON numbers, not strings
    assert j["dynamic_batching"]["max_queue_delay_microseconds"] == 100
    assert j["input"][0]["data_type"] == "TYPE_FP32" and j["input"][0]["optional"] is False
    spec = spec_of.build_spec(c)
    assert spec.api_shape(spec.inputs[0]) == [-1, -1, 4] and spec.input("IN").datatype == "FP32"


def test_completion_defaults_for_a_bare_config():
    """Triton names the instance group it adds after the model, and gives the sequence batcher's
    oldest strategy the same preferred_batch_size default as dynamic_batching (both probed)."""
    c = complete('''name: "m"
platform: "onnxruntime_onnx"
max_batch_size: 4
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
sequence_batching { oldest { max_candidate_sequences: 2 } }
''')
    assert [(g.name, g.count) for g in c.instance_group] == [("m", 1)]
    assert list(c.sequence_batching.oldest.preferred_batch_size) == [4]
    control = c.sequence_batching.control_input.add(name="START")
    control.control.add(kind=mc.ModelSequenceBatching.Control.CONTROL_SEQUENCE_START, fp32_false_true=[0.0, 1.5])
    j = spec_of.config_to_json(c)["sequence_batching"]["control_input"][0]["control"][0]
    assert j["fp32_false_true"] == [0, 1.5] and type(j["fp32_false_true"][0]) is int  # C++ protobuf JSON: 0, not 0.0


@pytest.mark.parametrize("text,fragment", [
    (GOOD.replace('name: "m"', 'name: "other"'), "does not match the name of its folder 'm'"),
    (GOOD.replace("data_type: TYPE_FP32 dims: [ -1, 4 ] } ]\noutput", "dims: [ 4 ] } ]\noutput"),
     "input 'IN' must specify a data_type"),
    (GOOD.replace("dims: [ -1, 4 ] } ]\noutput", "dims: [ -2 ] } ]\noutput"), "invalid dim -2"),
    (GOOD.replace('input [ { name: "IN"', 'input [ { name: "IN" data_type: TYPE_FP32 dims: [1] }, { name: "IN"'),
     "declared more than once"),
    (GOOD.replace("max_batch_size: 8", "max_batch_size: -1"), "max_batch_size must be >= 0"),
    (GOOD.replace('platform: "onnxruntime_onnx"', 'platform: "nonsense_platform"'), "unknown platform"),
    (GOOD.replace('platform: "onnxruntime_onnx"', 'backend: "no_such_backend"\nplatform: "onnxruntime_onnx"'),
     "unable to find backend 'no_such_backend'"),
    (GOOD.replace('platform: "onnxruntime_onnx"', 'backend: "pytorch"\nplatform: "onnxruntime_onnx"'),
     "platform 'onnxruntime_onnx' does not match backend 'pytorch'"),
    (GOOD.replace("max_queue_delay_microseconds: 100", "preferred_batch_size: [ 16 ]"), "preferred size 16"),
    (GOOD.replace("max_queue_delay_microseconds: 100", "priority_levels: 3"),  # no default level: as Triton
     "default_priority_level 0 must be in 1..3"),
    (GOOD.replace("dims: [ -1, 4 ] } ]\noutput", "dims: [ 4 ] reshape: { shape: [ 3 ] } } ]\noutput"),
     "changes the element count"),
    (GOOD.replace("count: 2 kind: KIND_CPU", "count: 1000000000 kind: KIND_CPU"),
     "asks for 1000000001 instances; at most 256 per model"),
])
def test_invalid_configs_are_rejected_naming_the_file(text, fragment):
    with pytest.raises(PierError) as err:
        complete(text)
    assert fragment in err.value.message
    assert "/repo/m/config.pbtxt" in err.value.message


def test_missing_backend_without_auto_complete():
    text = 'max_batch_size: 1\ninput [ { name: "I" data_type: TYPE_FP32 dims: [1] } ]\n' \
           'output [ { name: "O" data_type: TYPE_FP32 dims: [1] } ]'
    with pytest.raises(PierError) as err:
        complete(text, auto=False)
    assert "names no 'platform' or 'backend'" in err.value.message


@pytest.mark.parametrize("policy,expected", [
    ("", [5]),
    ("latest { num_versions: 2 }", [3, 5]),
    ("all { }", [1, 2, 3, 5]),
    ("specific { versions: [ 2, 4 ] }", [2]),
])
def test_version_policy(policy, expected):
    p = mc.ModelVersionPolicy()
    if policy:
        from google.protobuf import text_format

        text_format.Parse(policy, p)
    assert select_versions(p, [1, 2, 3, 5]) == expected


def _spec():
    return spec_of.build_spec(complete(GOOD))


def _req(*tensors, outputs=()):
    return InferenceRequest("m", "", list(tensors), [RequestedOutput(o) for o in outputs])


def _t(shape, name="IN", datatype="FP32"):
    return Tensor(name, datatype, list(shape), np.zeros(shape, dtype=np.float32))


@pytest.mark.parametrize("request_,fragment", [
    (_req(_t((9, 2, 4))), "batch-size must be <= 8"),
    (_req(_t((1, 2, 5))), "Expected [-1,-1,4], got [1,2,5]"),
    (_req(_t((2, 4))), "unexpected shape for input 'IN'"),
    (_req(_t((1, 2, 4), datatype="INT32")), "data-type is 'INT32', but model 'm' expects 'FP32'"),
    (_req(_t((1, 2, 4)), _t((1, 2, 4), name="X")), "expected 1 inputs but got 2 inputs"),
    (_req(_t((1, 2, 4), name="X")), "unexpected inference input 'X'"),
    (_req(), "missing required input(s) ['IN']"),
    (_req(_t((1, 2, 4)), outputs=("NOPE",)), "unexpected inference output 'NOPE'"),
    (_req(_t((0, 2, 4))), "batch-size must be >= 1"),
])
def test_request_validation(request_, fragment):
    with pytest.raises(PierError) as err:
        validate_request(_spec(), request_)
    assert fragment in err.value.message


def test_valid_request_returns_batch_size():
    assert validate_request(_spec(), _req(_t((3, 7, 4)))) == 3


def test_reserved_parameters():
    check_parameters({"custom": 1, "triton_enable_empty_final_response": True})
    with pytest.raises(PierError):
        check_parameters({"triton_anything": 1})


def test_example_configs_parse():
    root = Path(__file__).resolve().parents[2] / "model_repository"
    for path in root.glob("*/config.pbtxt"):
        assert model_config.parse_config_file(path).name == path.parent.name


def test_version_folders_are_ascii_integers_within_int64(tmp_path):
    from pier.repository.source import version_dirs

    for name in ("1", "7", "01", "99999999999999999999999", "\u0661", "x"):
        (tmp_path / name).mkdir()
    assert sorted(version_dirs(tmp_path)) == [1, 7]


def test_bytes_that_are_not_utf8_in_a_config(tmp_path):
    """In a comment they are skipped, as Triton's parser skips them; in a value the error names
    the file, line and column."""
    from pier.repository.model_config import parse_config_file

    path = tmp_path / "config.pbtxt"
    path.write_bytes(b"# caf\xe9 latin-1 comment\nname: \"m\"\nmax_batch_size: 2\n")
    assert parse_config_file(path).name == "m"
    path.write_bytes(b"max_batch_size: 2\nname: \"m\xff\"\n")
    with pytest.raises(PierError, match=rf"{re.escape(str(path))}:2:7"):
        parse_config_file(path)


def test_config_json_that_is_not_a_model_config_says_so():
    """A load's `config` parameter: not an object, or nested past any config, is named as such (not
    with the parser's own words), with the source."""
    from pier.repository.model_config import parse_config_json

    for text, words in (("[1, 2]", "expected a JSON object"), ("[" * 100_000, "nested too deeply"),
                        ("{bad", "not JSON"), ('{"max_batch_size": 1, "max_batch_size": 8}',
                                                "field 'max_batch_size' is given twice")):
        with pytest.raises(PierError, match=words) as err:
            parse_config_json(text, "the 'config' parameter of 'm'")
        assert "the model configuration in the 'config' parameter of 'm'" in err.value.message


def test_forwarded_headers_never_set_what_the_server_interprets():
    """--http/grpc-header-forward-pattern: a header named priority / timeout / sequence_* would reach
    the schedulers as a string (a TypeError in the dynamic batcher); only the model's own names pass."""
    from pier.tensors.validation import forward_headers, header_pattern

    params: dict = {"mine": 1}
    headers = [("priority", "1"), ("Timeout", "5"), ("sequence_end", "false"), ("Triton_x", "y"),
               ("mine", "header"), ("my_header", "v"), ("other", "w")]
    forward_headers(header_pattern("priority|timeout|sequence|triton|mine|my_"), headers, params)
    assert params == {"mine": 1, "my_header": "v"}


def test_the_input_count_message_with_optional_inputs_is_tritons():
    """Triton 2.51's wording when a model has optional inputs (qa/L0_optional_input compares it)."""
    config = GOOD.replace('input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]',
                          'input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1, 4 ] },'
                          ' { name: "OPT" data_type: TYPE_FP32 dims: [ -1, 4 ] optional: true } ]')
    spec = spec_of.build_spec(complete(config))
    with pytest.raises(PierError) as err:
        validate_request(spec, _req())
    assert err.value.message == (
        "[request id: <id_unknown>] expected number of inputs between 1 and 2 but got 0 inputs for model 'm'. "
        "Got input(s) [], but missing required input(s) ['IN']. Please provide all required input(s).")
    with pytest.raises(PierError) as err:
        validate_request(spec, _req(_t((1, 2, 4)), _t((1, 2, 4), name="OPT"), _t((1, 2, 4), name="X")))
    assert "expected number of inputs between 1 and 2 but got 3 inputs" in err.value.message
