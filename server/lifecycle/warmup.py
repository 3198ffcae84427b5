"""`model_warmup` from the config: synthetic requests each new instance runs before its version
takes traffic, so the first real request does not pay for lazy initialisation."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from pier.contract.backend import ModelInstance
from pier.contract.errors import PierError, invalid_arg
from pier.contract.types import InferenceRequest, ModelSpec, Tensor
from pier.observability.statistics import ModelStatistics
from pier.protocol import model_config_pb2 as mc
from pier.scheduling.batch import merge
from pier.scheduling.ragged import BatchLayout
from pier.tensors import datatypes
from pier.tensors.validation import validate_request


def _tensor(name: str, spec_input: mc.ModelWarmup.Input, shape: list[int], model_dir: Path,
            rng: np.random.Generator) -> Tensor:
    datatype = datatypes.config_to_datatype(mc.DataType.Name(spec_input.data_type))
    which = spec_input.WhichOneof("input_data_type")
    if which == "input_data_file":
        # As Triton: the file holds one sample (the input's dims), which every request of the
        # batch repeats; a longer file's first bytes are used.
        path = model_dir / "warmup" / spec_input.input_data_file
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise invalid_arg(f"warmup input '{name}': cannot read {path}: {exc}") from None
        dims = list(spec_input.dims)
        if datatype == "BYTES":
            sample = datatypes.deserialize_bytes(raw, datatypes.element_count(dims), name).reshape(dims)
        else:
            size = datatypes.element_count(dims) * datatypes.numpy_dtype(datatype).itemsize
            if len(raw) < size:  # Triton's words
                raise invalid_arg(f"warmup setting expects {size} bytes, but the data provided from "
                                  f"{spec_input.input_data_file} only has {len(raw)} bytes")
            sample = datatypes.from_raw(raw[:size], datatype, dims, name)
        data = np.broadcast_to(sample, shape).copy() if len(shape) > len(dims) else sample
    elif datatype == "BYTES":
        fill = b"" if which != "random_data" else b"warmup"
        data = np.full(shape, fill, dtype=object)
    elif which == "random_data":
        dtype = datatypes.numpy_dtype(datatype)
        if datatype == "BOOL":
            data = rng.integers(0, 2, size=shape).astype(bool)
        elif np.issubdtype(dtype, np.integer):
            data = rng.integers(0, 100, size=shape).astype(dtype)
        else:
            data = rng.random(size=shape).astype(dtype)
    else:
        data = np.zeros(shape, dtype=datatypes.numpy_dtype(datatype))
    return Tensor(name, datatype, list(shape), data)


def warm_up(config: mc.ModelConfig, spec: ModelSpec, model_dir: Path,
            instances: list[ModelInstance]) -> list[tuple[int, int]]:
    """Blocking: run every warmup sample `count` times (at least once) on every instance; returns
    each run's (batch size, execution ns) for the statistics, which count them as Triton does.
    Raises INVALID_ARG naming the sample when one fails: the version does not load."""
    rng = np.random.default_rng(0)
    runs: list[tuple[int, int]] = []
    for sample in config.model_warmup:
        label = sample.name or "<unnamed>"
        try:
            batch = max(sample.batch_size, 1)
            inputs = []
            for name, spec_input in sorted(sample.inputs.items()):
                shape = ([batch] if spec.max_batch_size > 0 else []) + list(spec_input.dims)
                inputs.append(_tensor(name, spec_input, shape, model_dir, rng))
            request = InferenceRequest(spec.name, "", inputs)
            validate_request(spec, request)
        except PierError as exc:
            raise invalid_arg(f"warmup sample '{label}' is invalid: {exc.message}") from None
        layout = BatchLayout.from_spec(spec)
        if layout is not None:  # ragged inputs / batch_input: what the batcher would hand the backend
            request = merge([request], layout)
        for instance in instances:
            for _ in range(max(sample.count, 1)):
                start = time.perf_counter_ns()
                results = instance.execute([request])
                if results and isinstance(results[0], PierError):
                    raise invalid_arg(f"warmup sample '{label}' failed: {results[0].message}")
                runs.append((batch, time.perf_counter_ns() - start))
    return runs


def record_warmup(stats: ModelStatistics, runs: list[tuple[int, int]]) -> None:
    """Triton 2.51 counts warmup (probed): a sample of batch size B is B requests of batch 1 run as
    one execution, so each run adds B successful requests, B inferences and one execution."""
    for batch, ns in runs:
        stats.record_execution(batch, 0, ns, 0)
        for _ in range(batch):
            stats.record_request(True, ns, 0, 0, ns, 0)
