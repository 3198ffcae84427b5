"""A completed ModelConfig -> the frozen ModelSpec the data plane, the schedulers and the
backends use, with its policies (batching, sequences) derived once; and the config as Triton's
JSON, for the HTTP `/config` answer and the backends' view of it (ModelContext.config_json).
The completed protobuf stays the one source: everything here is derived from it."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor

from pier.contract.errors import invalid_arg
from pier.contract.policies import BatchingPolicy, Control, QueuePolicy, SequencePolicy, StateSpec
from pier.contract.types import BatchInputSpec, BatchOutputSpec, InstanceGroupSpec, ModelSpec, TensorSpec
from pier.protocol import model_config_pb2 as mc
from pier.repository.model_config import control_kind, flag_fields
from pier.tensors.classification import read_labels
from pier.tensors.datatypes import config_to_datatype, from_raw, numpy_dtype


def build_spec(config: mc.ModelConfig, model_dir: Path | None = None) -> ModelSpec:
    """Freeze a completed config into the spec the data plane and backends use. With the model
    folder, outputs' `label_filename` files are read too (blocking: run it off the event loop)."""
    def tensor(t: Any) -> TensorSpec:
        return TensorSpec(
            name=t.name,
            datatype=config_to_datatype(mc.DataType.Name(t.data_type)),
            dims=tuple(t.dims),
            reshape=tuple(t.reshape.shape) if t.HasField("reshape") else None,
            optional=getattr(t, "optional", False),
            allow_ragged_batch=getattr(t, "allow_ragged_batch", False),
            is_shape_tensor=t.is_shape_tensor,
        )

    groups = tuple(
        InstanceGroupSpec(
            name=g.name,
            kind=mc.ModelInstanceGroup.Kind.Name(g.kind),
            count=g.count,
            gpus=tuple(g.gpus),
        )
        for g in config.instance_group
    )
    return ModelSpec(
        name=config.name,
        platform=config.platform,
        backend=config.backend,
        max_batch_size=config.max_batch_size,
        inputs=tuple(tensor(t) for t in config.input),
        outputs=tuple(tensor(t) for t in config.output),
        instance_groups=groups,
        default_model_filename=config.default_model_filename,
        parameters={k: v.string_value for k, v in config.parameters.items()},
        decoupled=config.model_transaction_policy.decoupled,
        batching=batching_policy(config),
        batch_inputs=tuple(
            BatchInputSpec(mc.BatchInput.Kind.Name(b.kind), tuple(b.target_name),
                           config_to_datatype(mc.DataType.Name(b.data_type)), tuple(b.source_input))
            for b in config.batch_input
        ),
        batch_outputs=tuple(
            BatchOutputSpec(mc.BatchOutput.Kind.Name(b.kind), tuple(b.target_name), tuple(b.source_input))
            for b in config.batch_output
        ),
        labels={t.name: read_labels(model_dir, t.label_filename, t.name)
                for t in config.output if t.label_filename and model_dir is not None},
        sequence=sequence_policy(config, model_dir) if config.HasField("sequence_batching") else None,
        # a sequence model's answers depend on more than its inputs: never cached
        response_cache=config.response_cache.enable and not config.HasField("sequence_batching"),
    )


def sequence_policy(config: mc.ModelConfig, model_dir: Path | None) -> SequencePolicy:
    """The sequence batcher's controls and states (initial state files read from
    `<model folder>/initial_state/`, as Triton reads them)."""
    sb = config.sequence_batching
    controls = []
    for ci in sb.control_input:
        c = ci.control[0]
        kind = control_kind(c)
        if kind == "CORRID":
            controls.append(Control(ci.name, kind, config_to_datatype(mc.DataType.Name(c.data_type))))
            continue
        field_name = flag_fields(c)[0]
        datatype = {"int32_false_true": "INT32", "fp32_false_true": "FP32", "bool_false_true": "BOOL"}[field_name]
        values = getattr(c, field_name)
        controls.append(Control(ci.name, kind, datatype, (values[0], values[1])))
    states = []
    for st in sb.state:
        datatype = config_to_datatype(mc.DataType.Name(st.data_type))
        dtype = numpy_dtype(datatype)
        initial = np.zeros([d if d >= 0 else 1 for d in st.dims], dtype=dtype)
        for init in st.initial_state[:1]:
            initial = np.zeros(list(init.dims), dtype=dtype)
            if init.WhichOneof("state_data") == "data_file" and model_dir is not None:
                path = (model_dir / "initial_state" / init.data_file).resolve()
                if not path.is_relative_to(model_dir.resolve()):
                    raise invalid_arg(f"initial_state data_file '{init.data_file}' must lie inside the model folder")
                try:
                    raw = path.read_bytes()
                except OSError as exc:
                    raise invalid_arg(f"failed to read initial state file {path}: {exc.strerror}") from None
                initial = from_raw(memoryview(raw), datatype, list(init.dims), init.name or st.input_name,
                                   config.name, "")
        states.append(StateSpec(st.input_name, st.output_name, datatype, initial))
    outputs = {t.name for t in config.output}
    slots = max(1, config.max_batch_size)
    if sb.WhichOneof("strategy_choice") == "oldest" and sb.oldest.max_candidate_sequences > 0:
        slots = sb.oldest.max_candidate_sequences
    return SequencePolicy(
        idle_ns=sb.max_sequence_idle_microseconds * 1000,
        batched=config.max_batch_size > 0,
        slots=slots,
        controls=tuple(controls),
        states=tuple(states),
        returned_states=frozenset(s.output_name for s in states if s.output_name in outputs),
        iterative=sb.iterative_sequence,
    )


def config_to_json(config: mc.ModelConfig) -> dict[str, Any]:
    """ModelConfig as Triton's HTTP `/config` shows it: snake_case names, every scalar and list
    printed even when default, enums as names, 64-bit integers as JSON numbers."""
    raw = json_format.MessageToDict(
        config, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return _int64_as_numbers(raw, config.DESCRIPTOR)


_INT64_TYPES = {
    FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64,
}


def _int64_as_numbers(value: Any, descriptor: Any) -> Any:
    """Walk a MessageToDict result with its descriptor, turning quoted 64-bit ints into ints."""
    if not isinstance(value, dict):
        return value
    for fd in descriptor.fields:
        if fd.name not in value:
            continue
        v = value[fd.name]
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            vfd = fd.message_type.fields_by_name["value"]
            value[fd.name] = {k: _convert(x, vfd) for k, x in v.items()}
        elif fd.is_repeated:
            value[fd.name] = [_convert(x, fd) for x in v]
        else:
            value[fd.name] = _convert(v, fd)
    return value


def _convert(v: Any, fd: Any) -> Any:
    if fd.message_type is not None:
        return _int64_as_numbers(v, fd.message_type)
    if fd.type in _INT64_TYPES and isinstance(v, str):
        return int(v)
    if isinstance(v, float) and v.is_integer():  # as protobuf's C++ JSON printer (Triton's): 1, not 1.0
        return int(v)
    return v


def batching_policy(config: mc.ModelConfig) -> BatchingPolicy | None:
    """The dynamic batcher's settings, or None when the model runs requests one at a time
    (no `dynamic_batching`, or max_batch_size 0)."""
    if config.max_batch_size <= 0:
        return None
    if config.WhichOneof("scheduling_choice") == "sequence_batching":  # across sequences, per the strategy
        sb = config.sequence_batching
        if sb.WhichOneof("strategy_choice") == "oldest":
            return BatchingPolicy(
                max_batch_size=config.max_batch_size,
                preferred_sizes=tuple(sb.oldest.preferred_batch_size),
                max_queue_delay_us=sb.oldest.max_queue_delay_microseconds,
                preserve_ordering=sb.oldest.preserve_ordering,
            )
        # direct: a batch runs as soon as `minimum_slot_utilization` of its slots hold a ready
        # request (default 0: any one), else when max_queue_delay_microseconds expires
        ready = max(1, math.ceil(sb.direct.minimum_slot_utilization * config.max_batch_size - 1e-9))
        return BatchingPolicy(
            max_batch_size=config.max_batch_size,
            preferred_sizes=tuple(range(ready, config.max_batch_size + 1)) if ready > 1 else (),
            max_queue_delay_us=sb.direct.max_queue_delay_microseconds if ready > 1 else 0,
        )
    if config.WhichOneof("scheduling_choice") != "dynamic_batching":
        return None
    db = config.dynamic_batching

    def queue_policy(q: Any) -> QueuePolicy:
        return QueuePolicy(
            timeout_action_delay=q.timeout_action == mc.ModelQueuePolicy.DELAY,
            default_timeout_us=q.default_timeout_microseconds,
            allow_timeout_override=q.allow_timeout_override,
            max_queue_size=q.max_queue_size,
        )

    return BatchingPolicy(
        max_batch_size=config.max_batch_size,
        preferred_sizes=tuple(db.preferred_batch_size),
        max_queue_delay_us=db.max_queue_delay_microseconds,
        preserve_ordering=db.preserve_ordering,
        priority_levels=db.priority_levels,
        default_priority_level=db.default_priority_level,
        default_policy=queue_policy(db.default_queue_policy),
        level_policies={int(k): queue_policy(v) for k, v in db.priority_queue_policy.items()},
    )
