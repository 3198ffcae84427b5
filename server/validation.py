"""Check a request against its model's spec (names, datatypes, shapes, batch size) with
Triton's wording, and map tensors between API shapes and framework shapes (`reshape`)."""

from __future__ import annotations

from server.errors import invalid_arg
from server.types import InferenceRequest, ModelSpec, Tensor, TensorSpec

_BATCH_NOTE = (
    " NOTE: Setting a non-zero max_batch_size in the model config requires a batch dimension to be "
    "prepended to each input shape. If you want to specify the full shape including the batch dim "
    "in your input dims config, try setting max_batch_size to zero. See the model configuration "
    "docs for more info on max_batch_size."
)


# Keys a client may send although they carry the reserved prefix (Triton accepts these).
_ALLOWED_TRITON_KEYS = frozenset({"triton_enable_empty_final_response"})


def check_parameters(params: dict[str, object]) -> None:
    """Request parameters: `triton_*` keys are reserved for the server, as in Triton."""
    for key in params:
        if key.startswith("triton_") and key not in _ALLOWED_TRITON_KEYS:
            raise invalid_arg(
                f"parameter '{key}' is reserved: keys starting with 'triton_' belong to the server"
            )


def _prefix(request: InferenceRequest) -> str:
    return f"[request id: {request.id or '<id_unknown>'}] "


def _fmt(shape: object) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"  # type: ignore[union-attr]


def validate_request(spec: ModelSpec, request: InferenceRequest) -> int:
    """Validate in place and return the batch size (1 for models that do not batch). Tensors
    whose config has `reshape` are reshaped to what the framework expects."""
    batch: int | None = None
    seen: set[str] = set()
    for tensor in request.inputs:
        ts = spec.input(tensor.name)
        if ts is None:
            raise invalid_arg(f"{_prefix(request)}unexpected inference input '{tensor.name}' for model '{spec.name}'")
        if tensor.name in seen:
            raise invalid_arg(f"{_prefix(request)}input '{tensor.name}' appears more than once in the request")
        seen.add(tensor.name)
        if tensor.datatype != ts.datatype:
            raise invalid_arg(
                f"{_prefix(request)}inference input '{tensor.name}' data-type is '{tensor.datatype}', "
                f"but model '{spec.name}' expects '{ts.datatype}'"
            )
        b = _check_shape(spec, ts, tensor, request)
        if batch is None:
            batch = b
        elif b != batch:
            raise invalid_arg(
                f"{_prefix(request)}input '{tensor.name}' has batch size {b} but other inputs have "
                f"batch size {batch} for model '{spec.name}'"
            )
    missing = [t.name for t in spec.inputs if not t.optional and t.name not in seen]
    if missing:
        required = [t.name for t in spec.inputs if not t.optional]
        raise invalid_arg(
            f"{_prefix(request)}expected {len(required)} inputs but got {len(seen)} inputs for model "
            f"'{spec.name}'. Got input(s) {sorted(seen)}, but missing required input(s) {missing}. "
            "Please provide all required input(s)."
        )
    names = set()
    for out in request.outputs:
        if spec.output(out.name) is None:
            raise invalid_arg(f"{_prefix(request)}unexpected inference output '{out.name}' for model '{spec.name}'")
        if out.name in names:
            raise invalid_arg(f"{_prefix(request)}output '{out.name}' is requested more than once")
        names.add(out.name)
    return batch if batch is not None else 1


def _check_shape(spec: ModelSpec, ts: TensorSpec, tensor: Tensor, request: InferenceRequest) -> int:
    shape = tensor.shape
    dims = ts.dims
    batch = 1
    if spec.max_batch_size > 0:
        expected = [-1, *dims]
        if len(shape) != len(dims) + 1 or shape[0] < 1:
            raise _shape_error(spec, ts, tensor, request, expected, note=True)
        batch = shape[0]
        if batch > spec.max_batch_size:
            raise invalid_arg(
                f"{_prefix(request)}inference request batch-size must be <= {spec.max_batch_size} "
                f"for '{spec.name}'"
            )
        rest = shape[1:]
    else:
        expected = list(dims)
        rest = shape
    if ts.is_shape_tensor:
        return batch
    if len(rest) != len(dims) or any(d != -1 and d != s for d, s in zip(dims, rest)):
        raise _shape_error(spec, ts, tensor, request, expected, note=spec.max_batch_size > 0)
    if ts.reshape is not None:
        lead = [batch] if spec.max_batch_size > 0 else []
        tensor.data = tensor.data.reshape(lead + list(ts.reshape))
    return batch


def _shape_error(spec: ModelSpec, ts: TensorSpec, tensor: Tensor, request: InferenceRequest,
                 expected: list[int], note: bool):
    return invalid_arg(
        f"{_prefix(request)}unexpected shape for input '{ts.name}' for model '{spec.name}'. "
        f"Expected {_fmt(expected)}, got {_fmt(tensor.shape)}.{_BATCH_NOTE if note else ''}"
    )


def to_api_outputs(spec: ModelSpec, outputs: list[Tensor], batch: int) -> list[Tensor]:
    """Map framework-shaped outputs back to their configured dims (undo `reshape`)."""
    for t in outputs:
        ts = spec.output(t.name)
        if ts is not None and ts.reshape is not None:
            lead = [batch] if spec.max_batch_size > 0 else []
            t.data = t.data.reshape(lead + [d for d in ts.dims])
        t.shape = list(t.data.shape)
    return outputs
