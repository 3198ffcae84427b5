"""Merge requests along dim 0 into one batch and split the outputs back, row for row (with a
BatchLayout: ragged inputs, batch inputs and scattered batch outputs, see ragged.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from pier.contract.errors import internal
from pier.contract.types import ExecuteResult, InferenceRequest, Outputs, RequestedOutput, Tensor
from pier.scheduling.ragged import BatchLayout, batch_input_tensors, scatter

CompatKey = tuple[tuple[str, str, tuple[int, ...] | None], ...]


def compat_key(request: InferenceRequest, ragged: frozenset[str] = frozenset()) -> CompatKey:
    """Requests with equal keys can share a batch: same inputs, datatypes and non-batch dims
    (a ragged input's dims do not count: any shapes may share a batch)."""
    inputs = request.inputs
    if len(inputs) == 1:  # the common case: nothing to sort
        t = inputs[0]
        return ((t.name, t.datatype, None if t.name in ragged else t.data.shape[1:]),)
    return tuple(sorted(
        (t.name, t.datatype, None if t.name in ragged else tuple(t.data.shape[1:])) for t in request.inputs
    ))


def merge(requests: Sequence[InferenceRequest], layout: BatchLayout | None = None) -> InferenceRequest:
    """One request whose inputs are the concatenation of `requests`' inputs (in order). It asks
    for every output any of them asked for (all, if one asked for all). With a layout, ragged
    inputs are flattened and concatenated to 1-D and the batch inputs are added, even for one
    request (as Triton's backends do)."""
    first = requests[0]
    if layout is None and len(requests) == 1:
        return first
    ragged = layout.ragged_inputs if layout is not None else frozenset()
    by_name = [{t.name: t for t in r.inputs} for r in requests]
    inputs = []
    for t in first.inputs:
        parts = [m[t.name].data for m in by_name]
        if t.name in ragged:
            data = np.concatenate([p.reshape(-1) for p in parts])
        else:
            data = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
        inputs.append(Tensor(t.name, t.datatype, list(data.shape), data))
    if layout is not None:
        inputs.extend(batch_input_tensors(layout, requests))
    if len(requests) == 1:
        return dataclasses.replace(first, inputs=inputs)
    outputs: list[RequestedOutput] = []
    if all(r.outputs for r in requests):
        seen: dict[str, RequestedOutput] = {}
        for r in requests:
            for o in r.outputs:
                seen.setdefault(o.name, RequestedOutput(o.name))
        outputs = list(seen.values())
    return InferenceRequest(first.model_name, first.model_version, inputs, outputs)


def split(result: ExecuteResult, sizes: Sequence[int], requests: Sequence[InferenceRequest] = (),
          layout: BatchLayout | None = None) -> list[ExecuteResult]:
    """Per-request results from one batch result: rows [offset, offset + size) of each output;
    a layout's batch outputs are scattered by their source input's shape in `requests`. A result
    that needs no splitting (one request, nothing scattered) is passed on as it is; split ones
    carry only tensors."""
    n = len(sizes)
    if isinstance(result, Exception):
        return [result] * n
    scattered = layout.scatter_by_name() if layout is not None else {}
    if n == 1 and not scattered:
        return [result]
    total = sum(sizes)
    out: list[list[Tensor]] = [[] for _ in sizes]
    for t in result.tensors:
        if t.name in scattered:
            parts = scatter(t, scattered[t.name], requests)
            if not isinstance(parts, list):
                return [parts] * n
        elif n == 1:
            parts = [t]
        elif t.data.ndim == 0 or t.data.shape[0] != total:
            err = internal(f"output '{t.name}' has {t.data.shape[:1]} rows for a batch of {total}: cannot split")
            return [err] * n
        else:
            parts = []
            offset = 0
            for size in sizes:
                part = t.data[offset:offset + size]
                parts.append(Tensor(t.name, t.datatype, list(part.shape), part, dict(t.parameters)))
                offset += size
        for rows, piece in zip(out, parts):
            rows.append(piece)
    return [Outputs(rows) for rows in out]
