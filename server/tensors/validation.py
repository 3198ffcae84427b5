"""Check a request against its model's spec (names, datatypes, shapes, batch size) with
Triton's wording, and map tensors between API shapes and framework shapes (`reshape`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import re2

from pier.contract.errors import PierError, invalid_arg
from pier.contract.types import InferenceRequest, ModelSpec, RequestedOutput, Tensor, TensorSpec
from pier.tensors import datatypes

_BATCH_NOTE = (
    " NOTE: Setting a non-zero max_batch_size in the model config requires a batch dimension to be "
    "prepended to each input shape. If you want to specify the full shape including the batch dim "
    "in your input dims config, try setting max_batch_size to zero. See the model configuration "
    "docs for more info on max_batch_size."
)


# Keys a client may send although they carry the reserved prefix (Triton accepts these).
_ALLOWED_TRITON_KEYS = frozenset({"triton_enable_empty_final_response"})


class HeaderPattern:
    """--http/grpc-header-forward-pattern, as tritonserver reads it: an RE2 expression matched
    case-insensitively (it prefixes "(?i)"; header names are case-insensitive, and "(?-i)" turns
    that off again) anywhere in a header's name (RE2::PartialMatch). RE2 itself (google-re2),
    not Python's `re`: the syntax differs ((?-i), \\C, possessive forms), and a pattern a
    Triton user wrote must mean the same here."""

    def __init__(self, pattern: str) -> None:
        try:
            self._regex = re2.compile("(?i)" + pattern)
        except re2.error as exc:
            raise ValueError(f"{pattern!r} is not a valid RE2 regular expression ({exc})") from None

    def matches(self, name: str) -> bool:
        return self._regex.search(name) is not None


def header_pattern(pattern: str) -> HeaderPattern | None:
    """The compiled pattern, or None for the default (empty: forward nothing)."""
    return HeaderPattern(pattern) if pattern else None


def forward_headers(pattern: HeaderPattern | None, headers: Iterable[tuple[str, str]],
                    params: dict[str, Any]) -> None:
    """Headers whose names `pattern` matches become string parameters of the request, unless the
    request names that parameter itself. Names the server interprets (priority, timeout, the
    sequence flags, ...) are not forwarded: a header is only ever a string the model reads."""
    if pattern is None:
        return
    for name, value in headers:
        if (isinstance(value, str) and name not in params and pattern.matches(name)
                and not name.lower().startswith("triton_") and name.lower() not in _TYPED_KEYS):
            params[name] = value


def check_parameters(params: dict[str, object]) -> None:
    """Request parameters: values are bool/int/float/str; `triton_*` keys are reserved for the
    server; the keys Triton interprets must have the type it expects."""
    for key, value in params.items():
        if key.startswith("triton_") and key not in _ALLOWED_TRITON_KEYS:
            raise invalid_arg(
                "parameter keys starting with 'triton_' are reserved for Triton usage and should not be "
                f"specified. Only the following keys starting with 'triton_' are allowed: "
                f"{', '.join(sorted(_ALLOWED_TRITON_KEYS))}"
            )
        if not isinstance(value, (bool, int, float, str)):
            raise invalid_arg(f"parameter '{key}' has invalid type. It should be either 'int', 'bool', or 'string'.")
        expected = _TYPED_KEYS.get(key)
        if expected is not None and not expected[0](value):
            if expected[0] is _uint and isinstance(value, int) and not isinstance(value, bool):
                raise invalid_arg(f"invalid value for '{key}' parameter, expected value >= 0.")  # as Triton
            raise invalid_arg(f"invalid value type for '{key}' parameter, expected {expected[1]}.")


def _uint(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_bool(v: object) -> bool:
    return isinstance(v, bool)


_TYPED_KEYS = {
    "priority": (_uint, "int64_param or uint64_param"),
    "timeout": (_uint, "int64_param or uint64_param"),
    "sequence_id": (lambda v: _uint(v) or isinstance(v, str), "int64_param, uint64_param or string_param"),
    "sequence_start": (_is_bool, "bool_param"),
    "sequence_end": (_is_bool, "bool_param"),
    "binary_data_output": (_is_bool, "bool_param"),
    "binary_data": (_is_bool, "bool_param"),
}


def request_prefix(request: InferenceRequest) -> str:
    return datatypes.request_prefix(request.id)


def _fmt(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def _names(names: list[str]) -> str:
    return "[" + ",".join(f"'{n}'" for n in names) + "]"


class _Plan:
    """What validation needs from a spec, computed once per spec (specs never change)."""

    __slots__ = ("required", "n_inputs", "sources", "batching", "out_reshape")

    def __init__(self, spec: ModelSpec) -> None:
        self.required = tuple(t.name for t in spec.inputs if not t.optional)
        self.n_inputs = len(spec.inputs)
        self.sources = tuple(_batch_sources(spec))
        self.batching = spec.max_batch_size > 0
        self.out_reshape = any(t.reshape is not None for t in spec.outputs)


def _plan(spec: ModelSpec) -> _Plan:
    plan = spec.__dict__.get("_validation_plan")
    if plan is None:
        plan = _Plan(spec)
        object.__setattr__(spec, "_validation_plan", plan)  # a cache on a frozen spec
    return plan


def validate_request(spec: ModelSpec, request: InferenceRequest) -> int:
    """Validate in place and return the batch size (1 for models that do not batch). Tensors
    whose config has `reshape` are reshaped to what the framework expects. Checks run in
    Triton's order (input count, then each input, then outputs) with Triton's wording."""
    plan = _plan(spec)
    inputs = request.inputs
    if not len(plan.required) <= len(inputs) <= plan.n_inputs:
        _check_unique(request)  # as Triton: a repeated input is named before the count is checked
        _raise_count(spec, request, list(plan.required), [t.name for t in inputs])
    batch: int | None = None
    seen: set[str] = set()
    for tensor in inputs:
        name = tensor.name
        ts = spec.input(name)
        if ts is None:  # Triton's wording has no request id here
            raise invalid_arg(f"unexpected inference input '{name}' for model '{spec.name}'")
        if name in seen:
            raise _duplicate(request, name)
        seen.add(name)
        if tensor.datatype != ts.datatype:
            raise invalid_arg(
                f"{request_prefix(request)}inference input '{name}' data-type is '{tensor.datatype}', "
                f"but model '{spec.name}' expects '{ts.datatype}'"
            )
        if batch is not None and plan.batching and tensor.shape and tensor.shape[0] != batch:
            raise _batch_mismatch(spec, request, name)  # as Triton, before this input's own checks
        b = _check_shape(spec, plan.batching, ts, tensor, request)
        if batch is None:
            batch = b
    if not seen.issuperset(plan.required):
        _raise_count(spec, request, list(plan.required), [t.name for t in inputs])
    for source in plan.sources:
        if source not in seen:
            raise invalid_arg(
                f"{request_prefix(request)}input '{source}' is optional but model '{spec.name}' needs it to form "
                "the batch (it is the source_input of a batch_input or batch_output)"
            )
    if request.outputs:
        unique: dict[str, RequestedOutput] = {}
        for out in request.outputs:
            if spec.output(out.name) is None:
                raise invalid_arg(f"unexpected inference output '{out.name}' for model '{spec.name}'")
            unique.setdefault(out.name, out)  # a repeated name is answered once, as Triton does
        if len(unique) != len(request.outputs):
            request.outputs = list(unique.values())
    return batch if batch is not None else 1


def _batch_mismatch(spec: ModelSpec, request: InferenceRequest, name: str) -> PierError:
    return invalid_arg(f"{request_prefix(request)}input '{name}' batch size does not match other inputs for "
                       f"'{spec.name}'")


def _duplicate(request: InferenceRequest, name: str) -> PierError:
    return invalid_arg(f"{request_prefix(request)}input '{name}' already exists in request")


def _check_unique(request: InferenceRequest) -> None:
    seen: set[str] = set()
    for t in request.inputs:
        if t.name in seen:
            raise _duplicate(request, t.name)
        seen.add(t.name)


def _batch_sources(spec: ModelSpec) -> list[str]:
    return [s for b in spec.batch_inputs for s in b.source_inputs] + \
        [s for o in spec.batch_outputs for s in o.source_inputs]


def _raise_count(spec: ModelSpec, request: InferenceRequest, required: list[str], given: list[str]) -> None:
    """Triton's wording: 'expected N inputs', or with optional inputs 'expected number of inputs
    between R and N'."""
    missing = [n for n in required if n not in given]
    total = len(spec.inputs)
    expected = f"{total} inputs" if len(required) == total else f"number of inputs between {len(required)} and {total}"
    raise invalid_arg(
        f"{request_prefix(request)}expected {expected} but got {len(given)} inputs for model "
        f"'{spec.name}'. Got input(s) {_names(given)}, but missing required input(s) {_names(missing)}. "
        "Please provide all required input(s)."
    )


def _check_shape(spec: ModelSpec, batching: bool, ts: TensorSpec, tensor: Tensor, request: InferenceRequest) -> int:
    shape = tensor.shape
    dims = ts.dims
    batch = 1
    lead = 0
    if batching:
        if shape and shape[0] > spec.max_batch_size:
            raise invalid_arg(
                f"{request_prefix(request)}inference request batch-size must be <= {spec.max_batch_size} "
                f"for '{spec.name}'"
            )
        if shape and shape[0] < 1 and len(shape) == len(dims) + 1:
            raise invalid_arg(f"{request_prefix(request)}inference request batch-size must be >= 1 for "
                              f"'{spec.name}': input '{ts.name}' has shape {_fmt(shape)}")
        if len(shape) != len(dims) + 1:
            raise _shape_error(spec, ts, tensor, request, [-1, *dims], note=True)
        batch = shape[0]
        lead = 1
    if ts.is_shape_tensor:
        return batch
    if len(shape) != len(dims) + lead:
        raise _shape_error(spec, ts, tensor, request, [-1, *dims] if batching else list(dims), note=batching)
    for i, d in enumerate(dims):
        if d != -1 and d != shape[i + lead]:
            raise _shape_error(spec, ts, tensor, request, [-1, *dims] if batching else list(dims), note=batching)
    if ts.reshape is not None:
        tensor.data = tensor.data.reshape(([batch] if batching else []) + list(ts.reshape))
    return batch


def _shape_error(spec: ModelSpec, ts: TensorSpec, tensor: Tensor, request: InferenceRequest,
                 expected: list[int], note: bool):
    return invalid_arg(
        f"{request_prefix(request)}unexpected shape for input '{ts.name}' for model '{spec.name}'. "
        f"Expected {_fmt(expected)}, got {_fmt(tensor.shape)}.{_BATCH_NOTE if note else ''}"
    )


def to_api_outputs(spec: ModelSpec, outputs: list[Tensor], batch: int) -> list[Tensor]:
    """Map framework-shaped outputs back to their configured dims (undo `reshape`)."""
    if not _plan(spec).out_reshape:
        for t in outputs:
            t.shape = list(t.data.shape)
        return outputs
    for t in outputs:
        ts = spec.output(t.name)
        if ts is not None and ts.reshape is not None:
            lead = [batch] if spec.max_batch_size > 0 else []
            t.data = t.data.reshape(lead + [d for d in ts.dims])
        t.shape = list(t.data.shape)
    return outputs
