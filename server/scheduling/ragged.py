"""Triton's ragged batching, as its ONNX Runtime / TensorFlow / TensorRT backends present it.

A batch is plain concatenation along dim 0, except for what the config's `allow_ragged_batch`,
`batch_input` and `batch_output` ask for:

- A ragged input takes no part in shape compatibility (requests whose ragged inputs differ in
  shape share a batch) and the backend sees it as ONE 1-D tensor: every request's tensor,
  flattened, concatenated in request order.
- Each `batch_input` is a tensor computed from the batch and added under each `target_name`
  (INT32 or FP32), from the backend-visible shapes of `source_input` in each request.
- Each `batch_output` (BATCH_SCATTER_WITH_INPUT_SHAPE) is split back by flat element count: a
  request's piece has the output's config shape (batch dim first when the model batches) with
  each -1 replaced by the same dim of that request's `source_input`.

Triton applies all of this even to a batch of one request (the backend does it, not the
batcher), so a layout is applied whenever the model has one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pier.contract.errors import PierError, internal, invalid_arg
from pier.contract.types import BatchInputSpec, InferenceRequest, ModelSpec, Tensor
from pier.tensors.validation import request_prefix

_NUMPY = {"INT32": np.int32, "FP32": np.float32}


@dataclass(frozen=True)
class ScatterOutput:
    """One batch_output target: split back with `shape` (-1: take the dim from `source`)."""

    name: str
    source: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class BatchLayout:
    """What a model's batches need beyond plain concatenation (None when nothing: see from_spec)."""

    ragged_inputs: frozenset[str] = frozenset()
    batch_inputs: tuple[BatchInputSpec, ...] = ()
    scatter_outputs: tuple[ScatterOutput, ...] = ()

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> BatchLayout | None:
        """The layout a validated spec asks for, or None for a model without ragged batching."""
        ragged = frozenset(t.name for t in spec.inputs if t.allow_ragged_batch)
        lead = (-1,) if spec.max_batch_size > 0 else ()
        scatter = []
        for bo in spec.batch_outputs:
            for target in bo.target_names:
                out = spec.output(target)
                if out is None:  # validate_config rejects this; guard the invariant anyway
                    raise internal(f"batch output target '{target}' is not an output of '{spec.name}'")
                dims = out.reshape if out.reshape is not None else out.dims
                scatter.append(ScatterOutput(target, bo.source_inputs[0], lead + tuple(dims)))
        if not ragged and not spec.batch_inputs and not scatter:
            return None
        return cls(ragged, spec.batch_inputs, tuple(scatter))

    def scatter_by_name(self) -> dict[str, ScatterOutput]:
        return {s.name: s for s in self.scatter_outputs}


def _source_shapes(source: str, requests: Sequence[InferenceRequest]) -> list[tuple[int, ...]]:
    shapes = []
    for r in requests:
        tensor = next((t for t in r.inputs if t.name == source), None)
        if tensor is None:
            raise invalid_arg(f"{request_prefix(r)}input '{source}' is needed to form the batch but is missing")
        shapes.append(tuple(tensor.data.shape))
    return shapes


def batch_input_value(spec: BatchInputSpec, requests: Sequence[InferenceRequest]) -> np.ndarray:
    """The tensor Triton computes for `spec` over `requests` (each its own batch element).

    ELEMENT_COUNT [n]: each request's element count; ACCUMULATED_ELEMENT_COUNT [n]: running
    totals; ..._WITH_ZERO [n+1]: 0 then the running totals; MAX_ELEMENT_COUNT_AS_SHAPE
    [max count] (only its shape carries meaning; zeros); ITEM_SHAPE [batch, rank-1]: each batch
    item's shape without the batch dim (a request of batch b gives b rows); ITEM_SHAPE_FLATTEN:
    the same, flattened to 1-D."""
    shapes = _source_shapes(spec.source_inputs[0], requests)
    dtype = _NUMPY[spec.datatype]
    counts = [math.prod(s) for s in shapes]
    kind = spec.kind
    if kind == "BATCH_ELEMENT_COUNT":
        return np.array(counts, dtype=dtype)
    if kind == "BATCH_ACCUMULATED_ELEMENT_COUNT":
        return np.cumsum(counts, dtype=np.int64).astype(dtype)
    if kind == "BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO":
        return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(dtype)
    if kind == "BATCH_MAX_ELEMENT_COUNT_AS_SHAPE":
        return np.zeros(max(counts, default=0), dtype=dtype)
    if kind in ("BATCH_ITEM_SHAPE", "BATCH_ITEM_SHAPE_FLATTEN"):
        # The first dim is the batch dim (ragged batching is for batching models).
        rank = len(shapes[0]) - 1 if shapes else 0
        rows = [list(s[1:]) for s in shapes for _ in range(s[0] if s else 0)]
        if any(len(row) != rank for row in rows):
            raise invalid_arg(f"input '{spec.source_inputs[0]}' has a different rank in requests batched together")
        items = np.array(rows, dtype=dtype).reshape(len(rows), rank)
        return items.reshape(-1) if kind == "BATCH_ITEM_SHAPE_FLATTEN" else items
    raise internal(f"unknown batch input kind '{kind}'")


def batch_input_tensors(layout: BatchLayout, requests: Sequence[InferenceRequest]) -> list[Tensor]:
    """Every batch-input tensor for `requests`, one per target name."""
    tensors = []
    for spec in layout.batch_inputs:
        value = batch_input_value(spec, requests)
        for target in spec.target_names:
            tensors.append(Tensor(target, spec.datatype, list(value.shape), value))
    return tensors


def scatter(tensor: Tensor, out: ScatterOutput, requests: Sequence[InferenceRequest]) -> list[Tensor] | PierError:
    """Split a batch output back: request i gets the next prod(shape_i) elements, shaped shape_i."""
    flat = tensor.data.reshape(-1)
    offset = 0
    parts: list[Tensor] = []
    try:
        sources = _source_shapes(out.source, requests)
    except PierError as exc:
        return exc
    for source_shape in sources:
        shape = []
        for i, d in enumerate(out.shape):
            if d == -1:
                if i >= len(source_shape):
                    return internal(
                        f"batch output '{out.name}' dim {i} is variable but input '{out.source}' has "
                        f"only {len(source_shape)} dims"
                    )
                d = source_shape[i]
            shape.append(d)
        count = math.prod(shape)
        if offset + count > flat.size:
            return internal(
                f"batch output '{out.name}' has {flat.size} elements, fewer than the shapes of "
                f"input '{out.source}' in the batch call for"
            )
        part = flat[offset:offset + count].reshape(shape)
        parts.append(Tensor(tensor.name, tensor.datatype, shape, part, dict(tensor.parameters)))
        offset += count
    return parts
