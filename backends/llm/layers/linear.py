"""`Linear`: a projection that owns its weight, and `LinearMethod`: how that weight is stored and applied.

Every projection of a decoder (the fused q/k/v, o, the fused gate/up, down) is a `Linear`, so there is
one place where the way a weight is held and multiplied can change: a quantization method is a
`LinearMethod` (vLLM's `QuantizeMethodBase`: `process` turns the checkpoint's float tensor into the
stored form, `apply` multiplies by it), and a LoRA adapter wraps the layer's method with one that adds
its low-rank delta (`x @ A @ B`, per output slice: `output_sizes` names the q/k/v or gate/up widths).
Tensor parallelism shards a layer (`Linear.shard`, a `Split`): `load` keeps only this rank's rows
(column-parallel) or columns (row-parallel) of each checkpoint tensor, so no rank ever holds another's
weights past the tensor in hand, and a row-parallel layer sums the ranks' partial products with one
all-reduce after its method's GEMM (backends/llm/parallel/).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .quantized import PackedSlices, PackedWeight, quantize_int8


class LinearMethod(Protocol):
    """How a `Linear` keeps and applies its weight."""

    def process(self, layer: Linear, weight: torch.Tensor) -> None:
        """Store `weight` ([out, in], the checkpoint's layout, in the model dtype) in this method's form.
        A method with `accepts_packed = True` may get a quantized `PackedWeight` instead."""

    def apply(self, layer: Linear, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """x @ W^T (+ bias); with `residual`, residual + x @ W^T (+ bias), written into `residual` in
        place where the method can: callers use the returned tensor."""


class UnquantizedLinearMethod:
    """The weight in the model dtype, stored transposed ([in, out]): MKL's plain layout. `F.linear`
    with the [out, in] weight runs 2-3x slower at 16-32 rows, a decode step's usual size
    (bench/llm_bench.py). A residual add rides on the GEMM (h += x @ W). Used where oneDNN is not
    (CUDA, float16, a torch without it)."""

    def process(self, layer: Linear, weight: torch.Tensor) -> None:
        layer.weight = weight.t().contiguous()

    def apply(self, layer: Linear, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        w, b = layer.weight, layer.bias
        assert w is not None, f"{layer.name}: not loaded"
        if residual is not None:
            residual.addmm_(x, w)
            return residual if b is None else residual.add_(b)
        return torch.mm(x, w) if b is None else torch.addmm(b, x, w)


# oneDNN lays a reordered weight out for a batch of about this many rows; measured the same from 64
# to 256 rows and within 5 % of a layout made for the batch itself from 1 to 2,048 rows.
ONEDNN_BATCH_HINT = 64


def onednn_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `OneDNNLinearMethod` serves this dtype and device."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and torch.backends.mkldnn.is_available()


class OneDNNLinearMethod:
    """CPU, float32 or bfloat16: the weight reordered once, at load, into oneDNN's blocked layout (an
    opaque `torch._mkldnn` tensor), and each product one oneDNN matmul (`torch.ops.mkldnn`, the
    primitives torch.compile's inductor emits for frozen linear layers on CPU, as vLLM's CPU backend
    also calls oneDNN). No per-call packing of the weight: 1.3-1.5x MKL's `mm` on a decode step's
    GEMMs of a 135 M model, 1.9x on its LM head (64 rows; the step before and after:
    bench/results/llm_profile.md). The residual add
    is oneDNN's binary post-op (a new tensor: oneDNN writes no input in place).

    `gemm_dtype` (bfloat16 under float32 activations): the weight is stored in that dtype and each
    product casts its input to it and its output back (the bias added in the activations' dtype),
    as CPU autocast runs linear layers: bfloat16 GEMMs run at twice float32's rate on a CPU with
    AVX-512 BF16 (bench/results/llm_roofline.md) while norms, attention and the KV cache stay float32."""

    def __init__(self, gemm_dtype: torch.dtype | None = None) -> None:
        self.gemm_dtype = gemm_dtype

    def process(self, layer: Linear, weight: torch.Tensor) -> None:
        if self.gemm_dtype is not None:
            weight = weight.to(self.gemm_dtype)
        layer.weight = torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_BATCH_HINT)

    def apply(self, layer: Linear, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        w = layer.weight
        assert w is not None, f"{layer.name}: not loaded"
        if self.gemm_dtype is not None and x.dtype != self.gemm_dtype:
            y = torch.ops.mkldnn._linear_pointwise(x.to(self.gemm_dtype), w, None, "none", [], "")
            out = residual.add_(y) if residual is not None else y.to(x.dtype)
            return out if layer.bias is None else out.add_(layer.bias)
        if residual is not None:
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, w, layer.bias, "add")
        return torch.ops.mkldnn._linear_pointwise(x, w, layer.bias, "none", [], "")


# The GEMM dtype the layers built inside `gemm_dtype(...)` get (None: their own dtype).
_GEMM_DTYPE: ContextVar[torch.dtype | None] = ContextVar("pier_llm_gemm_dtype", default=None)


@contextlib.contextmanager
def gemm_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    """Inside: `default_method` gives the projections built (and tied) here `dtype` GEMMs on their own
    activations' dtype (the engine's CPU bfloat16: bfloat16 weights under float32 activations)."""
    token = _GEMM_DTYPE.set(dtype)
    try:
        yield
    finally:
        _GEMM_DTYPE.reset(token)


def default_method(dtype: torch.dtype, device: torch.device) -> LinearMethod:
    """oneDNN's where it serves the dtype and device, else the plain transposed weight."""
    gemm = _GEMM_DTYPE.get()
    if gemm is not None and gemm != dtype and onednn_available(gemm, device):
        return OneDNNLinearMethod(gemm)
    return OneDNNLinearMethod() if onednn_available(dtype, device) else UnquantizedLinearMethod()


@dataclass(frozen=True)
class Split:
    """One rank's share of a tensor-parallel `Linear` (Megatron's split).

    Column-parallel (`all_reduce` None): rows `parts[i]` = (start, length) of checkpoint output slice i
    (q/k/v, gate/up), whose full widths are `full`. Row-parallel: columns `parts[0]` of the checkpoint's
    `full[0]` inputs; the ranks' partial products are summed by `all_reduce`, and only the `first` rank
    adds the bias and the residual (each is added once to the sum)."""

    parts: tuple[tuple[int, int], ...]
    full: tuple[int, ...]
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    first: bool = True

    @property
    def row(self) -> bool:
        return self.all_reduce is not None


class Linear:
    """y = x @ W^T + b for W of shape [sum(output_sizes), input_size].

    Fused projections load one part per output slice (`load(index, weight)`: q, k, v or gate, up)
    and are joined by `finish()`, which hands the whole weight to the method. `__call__(x, residual)`
    returns residual + x @ W^T when `residual` is given (the decoder's residual stream; in place
    where the method can)."""

    def __init__(self, name: str, input_size: int, output_sizes: tuple[int, ...], bias: bool,
                 dtype: torch.dtype, device: torch.device, method: LinearMethod | None = None) -> None:
        self.name = name
        self.input_size = input_size
        self.output_sizes = output_sizes
        self.has_bias = bias
        self.dtype, self.device = dtype, device
        self.method: LinearMethod = method or default_method(dtype, device)
        self.weight: torch.Tensor | None = None  # the method's stored form
        self.bias: torch.Tensor | None = None
        self.split: Split | None = None
        self._parts: dict[tuple[str, int], Any] = {}

    @property
    def checkpoint_sizes(self) -> tuple[int, ...]:
        """The output slices' widths in the checkpoint (a column-parallel shard's are smaller)."""
        sp = self.split
        return self.output_sizes if sp is None or sp.row else sp.full

    @property
    def checkpoint_input_size(self) -> int:
        """The input width in the checkpoint (a row-parallel shard's is smaller)."""
        sp = self.split
        return sp.full[0] if sp is not None and sp.row else self.input_size

    def shard(self, split: Split) -> None:
        """Hold only this rank's share (`split`) from now on; before `load`. The layer's sizes become
        the shard's, the checkpoint's stay in `split.full`."""
        full = (self.input_size,) if split.row else self.output_sizes
        if split.full != full or len(split.parts) != len(full):
            raise ValueError(f"{self.name}: split {split} does not fit sizes {full}")
        self.split = split
        if split.row:
            self.input_size = split.parts[0][1]
        else:
            self.output_sizes = tuple(n for _, n in split.parts)

    @property
    def output_size(self) -> int:
        return sum(self.output_sizes)

    def load(self, index: int, weight: torch.Tensor | PackedWeight, kind: str = "weight") -> None:
        """Keep one output slice's checkpoint tensor (`kind` "weight" [out_i, in] or "bias" [out_i]);
        sharded, only this rank's part of it (a copy: the checkpoint's tensor is not kept alive). A
        weight may come quantized (a `PackedWeight`, layers/quantized.py: its rows, or whole groups of
        its columns, for a shard)."""
        sp = self.split
        out = self.output_sizes[index] if sp is None or sp.row else sp.full[index]
        inp = self.input_size if sp is None or not sp.row else sp.full[0]
        expected = (out, inp) if kind == "weight" else (out,)
        if tuple(weight.shape) != expected:
            raise ValueError(f"{self.name}: {kind} of slice {index} has shape {list(weight.shape)}, "
                             f"expected {list(expected)}")
        if sp is not None and sp.row and kind == "weight" and isinstance(weight, torch.Tensor) and \
                getattr(self.method, "online", False):
            weight = quantize_int8(weight.to(self.dtype))  # each row's scale over the whole row, as on one rank
        if sp is not None and isinstance(weight, PackedWeight):  # its codes and scales, still packed
            start, length = sp.parts[index if not sp.row else 0]
            try:
                weight = weight.columns(start, length) if sp.row else weight.rows(start, length)
            except ValueError as exc:
                raise ValueError(f"{self.name}: {exc}") from None
        elif sp is not None and isinstance(weight, torch.Tensor):
            if not sp.row:
                weight = weight.narrow(0, *sp.parts[index]).clone()
            elif kind == "weight":
                weight = weight.narrow(1, *sp.parts[0]).clone()
        self._parts[(kind, index)] = weight.to(device=self.device, dtype=self.dtype)

    def missing(self) -> list[tuple[str, int]]:
        """The (kind, slice) parts not loaded yet."""
        kinds = ("weight", "bias") if self.has_bias else ("weight",)
        return [(k, i) for k in kinds for i in range(len(self.output_sizes)) if (k, i) not in self._parts]

    def finish(self) -> None:
        """Join the loaded slices and store them (the method's `process`). Call once every part is in."""
        assert not self.missing(), f"{self.name}: parts missing {self.missing()}"
        n = len(self.output_sizes)
        parts = [self._parts[("weight", i)] for i in range(n)]
        weight: Any
        if any(isinstance(p, PackedWeight) for p in parts):  # a quantized checkpoint's slices (layers/quantized.py)
            weight = PackedWeight.join(parts)
            if isinstance(weight, PackedWeight | PackedSlices) and not getattr(self.method, "accepts_packed", False):
                weight = weight.dequantize(self.dtype)  # a layer no quantized method was set on
        else:
            weight = (torch.cat(parts) if n > 1 else parts[0]).contiguous()
        if self.has_bias:
            self.bias = torch.cat([self._parts[("bias", i)] for i in range(n)]).contiguous()
        self._parts.clear()
        if self.split is not None and self.split.row and not self.split.first:
            self.bias = None  # a row-parallel bias is added once, by the first rank
        self.method.process(self, weight)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        sp = self.split
        if sp is None or sp.all_reduce is None:
            return self.method.apply(self, x, residual)
        return sp.all_reduce(self.method.apply(self, x, residual if sp.first else None))
