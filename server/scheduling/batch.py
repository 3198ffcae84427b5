"""Merge requests along dim 0 into one batch and split the outputs back, row for row."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from backends.base import ExecuteResult
from server.errors import internal
from server.types import InferenceRequest, RequestedOutput, Tensor

CompatKey = tuple[tuple[str, str, tuple[int, ...]], ...]


def compat_key(request: InferenceRequest) -> CompatKey:
    """Requests with equal keys can share a batch: same inputs, datatypes and non-batch dims."""
    return tuple(sorted((t.name, t.datatype, tuple(t.data.shape[1:])) for t in request.inputs))


def merge(requests: Sequence[InferenceRequest]) -> InferenceRequest:
    """One request whose inputs are the concatenation of `requests`' inputs (in order). It asks
    for every output any of them asked for (all, if one asked for all)."""
    first = requests[0]
    if len(requests) == 1:
        return first
    by_name = [{t.name: t for t in r.inputs} for r in requests]
    inputs = []
    for t in first.inputs:
        data = np.concatenate([m[t.name].data for m in by_name], axis=0)
        inputs.append(Tensor(t.name, t.datatype, list(data.shape), data))
    outputs: list[RequestedOutput] = []
    if all(r.outputs for r in requests):
        seen: dict[str, RequestedOutput] = {}
        for r in requests:
            for o in r.outputs:
                seen.setdefault(o.name, RequestedOutput(o.name))
        outputs = list(seen.values())
    return InferenceRequest(first.model_name, first.model_version, inputs, outputs)


def split(result: ExecuteResult, sizes: Sequence[int]) -> list[ExecuteResult]:
    """Per-request results from one batch result: rows [offset, offset + size) of each output."""
    if isinstance(result, Exception) or len(sizes) == 1:
        return [result] * len(sizes) if isinstance(result, Exception) else [result]
    total = sum(sizes)
    for t in result:
        if t.data.ndim == 0 or t.data.shape[0] != total:
            err = internal(f"output '{t.name}' has {t.data.shape[:1]} rows for a batch of {total}: cannot split")
            return [err] * len(sizes)
    out: list[ExecuteResult] = []
    offset = 0
    for size in sizes:
        rows = []
        for t in result:
            part = t.data[offset:offset + size]
            rows.append(Tensor(t.name, t.datatype, list(part.shape), part, dict(t.parameters)))
        out.append(rows)
        offset += size
    return out
