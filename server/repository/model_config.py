"""config.pbtxt -> validated, completed ModelConfig (pier.repository.spec freezes it into a ModelSpec).

Parsing uses protobuf's text format on our wire-compatible ModelConfig, so any Triton config
parses unchanged. Every error names the file (and, for syntax errors, line and column).
Completion follows Triton: platform/backend filled from each other or from the model file,
default file name, version policy, instance groups, dynamic-batching preferred size, and (with
auto-complete on) inputs/outputs/max_batch_size read from the model itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from google.protobuf import json_format, text_format

from pier.contract import llm
from pier.contract.errors import PierError, invalid_arg
from pier.contract.types import (
    ModelSignature,
)
from pier.protocol import model_config_pb2 as mc
from pier.repository import backend_registry
from pier.tensors.datatypes import datatype_to_config

ModelConfig = mc.ModelConfig
Describe = Callable[[backend_registry.BackendEntry, Path], ModelSignature | None]

MAX_INSTANCES = 256  # per model version, all instance groups together


def parse_config_text(text: str, source: str) -> mc.ModelConfig:
    """Parse config.pbtxt text; errors read '<source>:<line>:<col>: <problem>'."""
    config = mc.ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        line, col = exc.GetLine(), exc.GetColumn()
        problem = str(exc)
        # ParseError's text starts with "line:col : " when it knows the position.
        if line is not None and " : " in problem:
            problem = problem.split(" : ", 1)[1]
        where = f"{source}:{line}:{col}" if line is not None else source
        raise invalid_arg(f"failed to parse model configuration {where}: {problem}") from None
    return config


def parse_config_file(path: Path) -> mc.ModelConfig:
    try:
        # Bytes that are not UTF-8 are kept as surrogates: harmless in a comment (as in Triton's
        # parser), and a parse error with its line and column inside a string value.
        text = path.read_bytes().decode("utf-8", "surrogateescape")
    except OSError as exc:
        raise invalid_arg(f"failed to read model configuration {path}: {exc}") from None
    return parse_config_text(text, str(path))


def parse_config_json(text: str, source: str) -> mc.ModelConfig:
    """A ModelConfig sent as JSON (the load API's `config` parameter), as Triton accepts it:
    proto field names or their lowerCamelCase forms."""
    config = mc.ModelConfig()
    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        doc = dict(pairs)
        if len(doc) != len(pairs):  # as protobuf's JSON parser: a field given twice is an error
            seen: set[str] = set()
            twice = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
            raise invalid_arg(f"failed to parse the model configuration in {source}: field '{twice}' is given twice")
        return doc

    try:
        doc = json.loads(text, object_pairs_hook=unique)
    except RecursionError:
        raise invalid_arg(f"failed to parse the model configuration in {source}: JSON nested too deeply") from None
    except ValueError as exc:
        raise invalid_arg(f"failed to parse the model configuration in {source}: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise invalid_arg(f"failed to parse the model configuration in {source}: expected a JSON object "
                          "(a ModelConfig)")
    try:
        json_format.ParseDict(doc, config)
    except (json_format.ParseError, RecursionError) as exc:
        problem = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise invalid_arg(f"failed to parse the model configuration in {source}: {problem}") from None
    return config


def complete_config(
    config: mc.ModelConfig,
    model_name: str,
    version_dirs: list[Path],
    source: str,
    auto_complete: bool,
    describe: Describe,
) -> mc.ModelConfig:
    """Fill what Triton fills, then validate. Returns a new message; `config` is not changed."""
    out = mc.ModelConfig()
    out.CopyFrom(config)
    if out.name and out.name != model_name:
        raise invalid_arg(
            f"{source}: model name '{out.name}' does not match the name of its folder '{model_name}'"
        )
    out.name = model_name
    entry = _resolve_backend(out, version_dirs, source, auto_complete)
    if not out.default_model_filename:  # an LLM adapter model's versions hold a PEFT adapter
        out.default_model_filename = llm.ADAPTER_MODEL_FILE if base_model(out) else entry.default_model_filename
    if auto_complete and (not out.input or not out.output) and entry is not backend_registry.ENSEMBLE:
        _auto_complete_io(out, entry, version_dirs, describe, source)
    if not out.HasField("version_policy"):
        out.version_policy.latest.num_versions = 1
    elif out.version_policy.HasField("latest") and out.version_policy.latest.num_versions == 0:
        out.version_policy.latest.num_versions = 1
    if entry is not backend_registry.ENSEMBLE:  # an ensemble has no instances of its own
        _complete_instance_groups(out)
    if out.HasField("sequence_batching") and not out.sequence_batching.max_sequence_idle_microseconds:
        out.sequence_batching.max_sequence_idle_microseconds = 1_000_000  # Triton's default: 1 s
    if out.HasField("dynamic_batching") and not out.dynamic_batching.preferred_batch_size:
        if out.max_batch_size > 0:
            out.dynamic_batching.preferred_batch_size.append(out.max_batch_size)
    oldest = out.sequence_batching.oldest if out.sequence_batching.HasField("oldest") else None
    if oldest is not None and not oldest.preferred_batch_size and out.max_batch_size > 0:
        oldest.preferred_batch_size.append(out.max_batch_size)  # as Triton's dynamic_batching default
    if entry is backend_registry.ENSEMBLE:  # as Triton's /config of an ensemble: the policy, no optimization
        out.model_transaction_policy.SetInParent()
    elif not out.HasField("optimization"):
        out.optimization.input_pinned_memory.enable = True
        out.optimization.output_pinned_memory.enable = True
    validate_config(out, source)
    return out


def _resolve_backend(
    config: mc.ModelConfig, version_dirs: list[Path], source: str, auto_complete: bool
) -> backend_registry.BackendEntry:
    if not config.platform and not config.backend:
        entry = backend_registry.detect(version_dirs) if auto_complete else None
        if entry is None:
            raise invalid_arg(
                f"{source}: the configuration names no 'platform' or 'backend' and none could be "
                "inferred from the model files"
            )
    else:
        try:
            entry = backend_registry.lookup(config.platform, config.backend)
        except PierError as exc:
            raise invalid_arg(f"{source}: {exc.message}") from None
    config.backend = config.backend or entry.backend
    if entry.platform and not config.platform:
        config.platform = entry.platform
    return entry


def base_model(config: mc.ModelConfig) -> str:
    """The model an LLM adapter model runs on (backend "llm" with a `base_model` parameter: its
    PEFT adapter in each version folder, served by the base's engine); "" for every other model.
    A load brings its base up first, as an ensemble's steps (pier.control.manager)."""
    if config.backend != llm.BACKEND_NAME or llm.BASE_MODEL_PARAMETER not in config.parameters:
        return ""
    return config.parameters[llm.BASE_MODEL_PARAMETER].string_value.strip()


def _auto_complete_io(
    config: mc.ModelConfig,
    entry: backend_registry.BackendEntry,
    version_dirs: list[Path],
    describe: Describe,
    source: str,
) -> None:
    """Fill inputs/outputs (and max_batch_size) from the newest version's model file."""
    for d in sorted(version_dirs, key=lambda p: int(p.name), reverse=True):
        found = entry.model_file(d, config.default_model_filename)
        if found is not None:
            path = found
            break
    else:
        return
    sig = describe(entry, path)
    if sig is None:
        return
    all_shapes = [s for _, _, s in sig.inputs + sig.outputs]
    if sig.max_batch_size is not None and config.max_batch_size == 0:
        config.max_batch_size = sig.max_batch_size
        if sig.dynamic_batching and not _has_scheduler(config):
            config.dynamic_batching.SetInParent()
    elif config.max_batch_size == 0 and not config.input and not config.output:
        # Triton's ORT backend: batchable when every tensor has a variable first dim.
        if all_shapes and all(len(s) >= 1 and s[0] == -1 for s in all_shapes):
            config.max_batch_size = 4
            if not _has_scheduler(config):
                config.dynamic_batching.SetInParent()
    strip = 1 if config.max_batch_size > 0 and sig.shapes_include_batch else 0
    sb = config.sequence_batching  # the sequence batcher feeds controls and state: not client tensors
    internal = {c.name for c in sb.control_input} | {st.input_name for st in sb.state} | \
        {st.output_name for st in sb.state}
    for target, tensors in ((config.input, sig.inputs), (config.output, sig.outputs)):
        if len(target) > 0:
            continue
        for name, datatype, shape in tensors:
            if name in internal:
                continue
            t = target.add()
            t.name = name
            t.data_type = mc.DataType.Value(datatype_to_config(datatype))
            t.dims.extend(shape[strip:])
            if target is config.input and name in sig.optional_inputs:
                t.optional = True
    if sig.decoupled and not config.HasField("model_transaction_policy"):
        config.model_transaction_policy.decoupled = True
    del source


def _has_scheduler(config: mc.ModelConfig) -> bool:
    return config.WhichOneof("scheduling_choice") is not None


def _complete_instance_groups(config: mc.ModelConfig) -> None:
    if not config.instance_group:  # as Triton: one group named after the model
        config.instance_group.add(name=config.name)
    for i, group in enumerate(config.instance_group):
        if not group.name:
            group.name = f"{config.name}_{i}"
        if group.count == 0:
            group.count = 1
        if group.kind == mc.ModelInstanceGroup.KIND_AUTO:
            group.kind = mc.ModelInstanceGroup.KIND_GPU if group.gpus else mc.ModelInstanceGroup.KIND_CPU


def validate_config(config: mc.ModelConfig, source: str) -> None:
    """Reject configurations Triton rejects, with the file named."""
    def fail(problem: str) -> PierError:
        return invalid_arg(f"{source}: {problem}")

    if config.max_batch_size < 0:
        raise fail(f"max_batch_size must be >= 0, got {config.max_batch_size}")
    if config.platform == "ensemble" or config.backend == "ensemble":
        return
    # As Triton's core: a model may declare no inputs (a generator) or no outputs; its backend
    # decides (an override config such as {"max_batch_size": 16} on a python model loads there).
    for kind, tensors in (("input", config.input), ("output", config.output)):
        seen: set[str] = set()
        for t in tensors:
            if not t.name:
                raise fail(f"every {kind} needs a name")
            if t.name in seen:
                raise fail(f"{kind} '{t.name}' is declared more than once")
            seen.add(t.name)
            if t.data_type == mc.TYPE_INVALID:
                raise fail(f"{kind} '{t.name}' must specify a data_type")
            if not t.dims and config.max_batch_size == 0 and not t.HasField("reshape"):
                raise fail(f"{kind} '{t.name}' must specify dims (use [ 1 ] for a scalar-like tensor)")
            for d in t.dims:
                if d < -1:
                    raise fail(f"{kind} '{t.name}' has invalid dim {d}: dims must be >= 0 or -1")
            if t.HasField("reshape"):
                _check_reshape(t.name, list(t.dims), list(t.reshape.shape), fail)
    _validate_batch_io(config, fail)
    for group in config.instance_group:
        if group.count < 0:
            raise fail(f"instance_group '{group.name}' count must be >= 1")
    instances = sum(g.count * max(1, len(g.gpus)) for g in config.instance_group)
    if instances > MAX_INSTANCES:  # each instance is a thread and a copy of the model
        raise fail(f"instance_group asks for {instances} instances; at most {MAX_INSTANCES} per model are allowed")
    if config.response_cache.enable and config.model_transaction_policy.decoupled:  # Triton's refusal
        raise fail(f"Response Cache does not currently support model '{config.name}' with 'decoupled' "
                   "transaction policy.")
    if config.HasField("sequence_batching"):
        _validate_sequence_batching(config, fail)
    if config.HasField("dynamic_batching"):
        db = config.dynamic_batching
        if db.priority_levels and not 1 <= db.default_priority_level <= db.priority_levels:  # as Triton
            raise fail(f"default_priority_level {db.default_priority_level} must be in 1..{db.priority_levels}")
        for level in db.priority_queue_policy:
            if not 1 <= level <= db.priority_levels:
                raise fail(f"priority_queue_policy level {level} must be in 1..priority_levels ({db.priority_levels})")
        for size in config.dynamic_batching.preferred_batch_size:
            if size <= 0 or (config.max_batch_size > 0 and size > config.max_batch_size):
                raise fail(
                    f"dynamic batching preferred size {size} must be in 1..max_batch_size "
                    f"({config.max_batch_size})"
                )


_FLAG_FIELDS = ("int32_false_true", "fp32_false_true", "bool_false_true")
_CORRID_TYPES = (mc.TYPE_UINT64, mc.TYPE_INT64, mc.TYPE_UINT32, mc.TYPE_INT32, mc.TYPE_STRING)


def control_kind(c: Any) -> str:
    """START, END, READY or CORRID."""
    return mc.ModelSequenceBatching.Control.Kind.Name(c.kind).removeprefix("CONTROL_SEQUENCE_")


def flag_fields(c: Any) -> list[str]:
    """The false/true value fields a flag control sets (exactly one when valid)."""
    return [f for f in _FLAG_FIELDS if len(getattr(c, f))]


def _validate_sequence_batching(config: mc.ModelConfig, fail: Callable[[str], PierError]) -> None:
    """Control inputs and implicit state: well-formed, and no name taken twice."""
    sb = config.sequence_batching
    taken = {t.name for t in config.input}
    for ci in sb.control_input:
        if not ci.name:
            raise fail("sequence batching control input must have a name")
        if ci.name in taken:
            raise fail(f"sequence batching control input '{ci.name}' is also a model input or another control")
        taken.add(ci.name)
        if len(ci.control) != 1:
            raise fail(f"sequence batching control input '{ci.name}' must have exactly one control")
        c = ci.control[0]
        kind = control_kind(c)
        if kind == "CORRID":
            if c.data_type not in _CORRID_TYPES:
                raise fail(f"sequence batching control '{ci.name}' (CORRID) must set data_type to TYPE_UINT64, "
                           "TYPE_INT64, TYPE_UINT32, TYPE_INT32 or TYPE_STRING")
            continue
        given = flag_fields(c)
        if len(given) != 1 or len(getattr(c, given[0])) != 2:
            raise fail(f"sequence batching control '{ci.name}' ({kind}) must give exactly two false/true values in "
                       "one of int32_false_true, fp32_false_true or bool_false_true")
    for st in sb.state:
        if not st.input_name or not st.output_name:
            raise fail("sequence batching state must set input_name and output_name")
        if st.input_name in taken:
            raise fail(f"sequence batching state input '{st.input_name}' is also a model input or a control")
        taken.add(st.input_name)
        if st.data_type == mc.TYPE_INVALID or not st.dims:
            raise fail(f"sequence batching state '{st.input_name}' must set data_type and dims")
        for init in st.initial_state:
            if init.WhichOneof("state_data") is None:
                raise fail(f"initial_state of state '{st.input_name}' must set zero_data or data_file")
            if any(d < 0 for d in init.dims):
                raise fail(f"initial_state of state '{st.input_name}' must give fixed dims")


def _batch_io_kind(entry: Any, message: Any, what: str, fail: Callable[[str], PierError]) -> str:
    """A batch input's or output's kind name, after the checks both share: a known kind, one source input."""
    if entry.kind not in message.Kind.values():
        raise fail(f"unknown {what} kind '{entry.kind}'")
    kind: str = message.Kind.Name(entry.kind)
    if len(entry.source_input) != 1:
        raise fail(f"{what} kind '{kind}' expects 1 source input, got {len(entry.source_input)}")
    return kind


def _validate_batch_io(config: mc.ModelConfig, fail: Callable[[str], PierError]) -> None:
    """Ragged inputs, batch_input and batch_output (Triton's ValidateBatchIO, and its wording)."""
    inputs = {t.name for t in config.input}
    outputs = {t.name for t in config.output}
    for t in config.input:
        if t.allow_ragged_batch and config.max_batch_size == 0:
            raise fail(f"input '{t.name}' sets allow_ragged_batch, which needs max_batch_size > 0")
    targets: set[str] = set()
    for bi in config.batch_input:
        kind = _batch_io_kind(bi, mc.BatchInput, "batch input", fail)
        if bi.data_type not in (mc.TYPE_INT32, mc.TYPE_FP32):
            raise fail("batch input data type must be TYPE_INT32 or TYPE_FP32")
        for source in bi.source_input:
            if source not in inputs:
                raise fail(f"unknown source input name '{source}' in batch input '{kind}'")
        if not bi.target_name:
            raise fail(f"batch input kind '{kind}' needs a target_name (the model input it feeds)")
        for target in bi.target_name:
            if target in inputs:
                raise fail(f"batch input target '{target}' is also declared as a model input")
            if target in targets:
                raise fail(f"batch input target '{target}' can only be specified once")
            targets.add(target)
    scattered: set[str] = set()
    for bo in config.batch_output:
        kind = _batch_io_kind(bo, mc.BatchOutput, "batch output", fail)
        for source in bo.source_input:
            if source not in inputs:
                raise fail(f"unknown source input name '{source}' in batch output '{kind}'")
        for target in bo.target_name:
            if target not in outputs:
                raise fail(f"unknown target output name '{target}' in batch output '{kind}'")
            if target in scattered:
                raise fail(f"target output name '{target}' can only be specified once")
            scattered.add(target)


def _check_reshape(name: str, dims: list[int], shape: list[int], fail: Callable[[str], PierError]) -> None:
    if -1 in dims or -1 in shape:
        if dims.count(-1) != shape.count(-1):
            raise fail(f"reshape of '{name}' must keep the same number of variable dims")
        return
    a, b = 1, 1
    for d in dims:
        a *= d
    for d in shape:
        b *= d
    if a != b:
        raise fail(f"reshape of '{name}' changes the element count ({dims} has {a}, {shape} has {b})")
